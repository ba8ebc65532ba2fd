"""The attention seam: one function signature that every attention implementation serves.

# B batch, T query tokens, S key tokens, H query heads, Hkv key/value heads, D head dim

The policy calls ``attn_fn(q_BHTD, k_BHkvSD, v_BHkvSD, layout)`` and gets ``out_BHTD`` back. The
`AttentionLayout` says which keys each query may see, in the form each implementation needs:

- packed training: ``cu_seqlens`` (sequence boundaries in the packed row); attention is causal within
  a sequence and never crosses one. A ring (context parallel) implementation reads ``cu_seqlens``
  and ignores ``mask``.
- KV-cache decoding / verification: ``mask`` only (key slot j is visible to query i of row b when
  j <= cache_length_b + i), built once per forward by the model and shared across layers.

Grouped-query attention is handled by the implementation (here SDPA's ``enable_gqa``), so the K/V
heads never get materialised H/Hkv times.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from cospec.models.precision import autocast_off


@dataclass
class AttentionLayout:
    """Visibility of keys for the queries of one forward (shared by all layers).

    mask: bool [B or 1, 1, T, S], True where query t may attend key s; None only for packed input,
        where an implementation may build its own mask from cu_seqlens.
    cu_seqlens: int [N+1] cumulative sequence lengths of a packed row (B == 1), else None.
        Example: sequences of length 3 and 2 packed -> cu_seqlens = [0, 3, 5].
    """

    mask: Tensor | None = None
    cu_seqlens: Tensor | None = None
    _memo: dict = field(default_factory=dict, repr=False)

    def padded_index(self) -> tuple[Tensor, int, int]:
        """For packed input: (scatter_T, N, L), computed once per forward and shared by all
        layers: scatter_T[t] is where packed token t sits in the flattened [N * L] padded layout
        of N sequences of up to L tokens."""
        if "padded" not in self._memo:
            cu = self.cu_seqlens
            lens = cu[1:] - cu[:-1]
            L = int(lens.max())  # device sync, once per forward
            t = torch.arange(int(cu[-1]), device=cu.device)
            seq = torch.bucketize(t, cu[1:], right=True)
            self._memo["padded"] = (seq * L + (t - cu[seq]), len(lens), L)
        return self._memo["padded"]

    # A copy into zeros and index_select rather than advanced indexing: their backwards are a
    # gather and a scatter-add over distinct slots, where indexing's is an accumulating
    # index_put, ~4x dearer on a CPU (SmolLM2's q, 8 sequences: 6.3 against 1.5 ms to unpack,
    # pack and back; docs/results/real_model/policy_step_kernels.py).
    def to_padded(self, x_HTD: Tensor) -> Tensor:
        """[H, T, D] packed -> [N, H, L, D], zeros past each sequence's end."""
        scatter_T, N, L = self.padded_index()
        H, _, D = x_HTD.shape
        return _IntoSlots.apply(x_HTD, scatter_T, N * L).view(H, N, L, D).transpose(0, 1)

    def from_padded(self, x_NHL: Tensor) -> Tensor:
        """[N, H, L, ...] padded -> [H, T, ...] packed (the padding dropped)."""
        scatter_T, N, L = self.padded_index()
        x = x_NHL.transpose(0, 1)
        return x.reshape(x.shape[0], N * L, *x.shape[3:]).index_select(1, scatter_T)


class _IntoSlots(torch.autograd.Function):
    """[H, T, D] -> [H, S, D] with token t at slot slots_T[t] (distinct) and zeros elsewhere; its
    backward gathers the slots back. Written out because torch's own index_copy saves its
    source for backward (one more copy of q, k and v per layer); this saves only the slots."""

    @staticmethod
    def forward(ctx, x_HTD: Tensor, slots_T: Tensor, num_slots: int) -> Tensor:
        ctx.save_for_backward(slots_T)
        H, _, D = x_HTD.shape
        return x_HTD.new_zeros(H, num_slots, D).index_copy_(1, slots_T, x_HTD)

    @staticmethod
    def backward(ctx, grad_HSD: Tensor):
        (slots_T,) = ctx.saved_tensors
        return grad_HSD.index_select(1, slots_T), None, None


class AttentionFn(Protocol):
    def __call__(self, q: Tensor, k: Tensor, v: Tensor, layout: AttentionLayout) -> Tensor: ...


def packed_causal_mask(cu_seqlens: Tensor, total: int) -> Tensor:
    """bool [1, 1, T, T]: causal within each packed sequence, nothing across sequences.

    O(T^2) memory: the reference (oracle) for packed attention, and for implementations that want a
    dense mask; `sdpa_attention` itself unpacks instead.

    Tokens past cu_seqlens[-1] (padding) form their own causal block so no row is empty (an
    all-False softmax row would be NaN).
    """
    device = cu_seqlens.device
    idx = torch.arange(total, device=device)
    seq_id = torch.bucketize(idx, cu_seqlens[1:], right=True)  # [T], padding gets id N
    same = seq_id[:, None] == seq_id[None, :]
    causal = idx[:, None] >= idx[None, :]
    return (same & causal)[None, None]


def cache_mask(lengths_B: Tensor, num_new: int, capacity: int) -> Tensor:
    """bool [B, 1, T, S]: query i of row b sees cache slots j <= lengths_b + i."""
    device = lengths_B.device
    limit_BT = lengths_B[:, None] + torch.arange(num_new, device=device)[None, :]
    slots = torch.arange(capacity, device=device)
    return (slots[None, None, :] <= limit_BT[:, :, None])[:, None]


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, layout: AttentionLayout) -> Tensor:
    """Reference implementation on torch's scaled_dot_product_attention (CPU and CUDA)."""
    gqa = q.shape[1] != k.shape[1]
    if layout.mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=layout.mask, enable_gqa=gqa)
    if layout.cu_seqlens is None:
        raise ValueError("attention layout needs a mask or cu_seqlens")
    if q.device.type == "cpu" and q.dtype == torch.bfloat16 and q.requires_grad:
        # Training under bf16 autocast on a CPU: torch's fused CPU attention costs ~2.5x in
        # bf16 what it costs in fp32, its backward most of it (SmolLM2's shapes, 8 sequences of
        # 132 tokens: 16.1 against 6.5 ms a layer forward and backward, torch 2.13 on a Xeon
        # with AMX; docs/results/real_model/policy_step_kernels.py). In fp32 it is also the more
        # exact one; forwards without gradient (prefill, the draft's data) keep bf16, faster
        # there.
        with autocast_off(q.device):
            return sdpa_attention(q.float(), k.float(), v.float(), layout).to(q.dtype)
    # Packed: unpack to a padded [N, H, L, D] batch and run plain causal attention, O(N L^2) instead
    # of the O(T^2) of a block-diagonal mask over the packed row (T = N * mean length). Padding sits
    # after each sequence's last token, so the causal mask alone keeps valid queries off it.
    q_NHLD, k_NHLD, v_NHLD = (layout.to_padded(x[0]) for x in (q, k, v))
    out_NHLD = F.scaled_dot_product_attention(q_NHLD, k_NHLD, v_NHLD, is_causal=True,
                                              enable_gqa=gqa)
    return layout.from_padded(out_NHLD)[None]


AttentionCallable = Callable[[Tensor, Tensor, Tensor, AttentionLayout], Tensor]


def matmul_cache_attention(q: Tensor, k: Tensor, v: Tensor, layout: AttentionLayout) -> Tensor:
    """Masked attention written as two matmuls and a softmax (same result as `sdpa_attention` for
    a mask layout): softmax(q k^T / sqrt(D) + mask) v, Vaswani et al. 1706.03762 eq. 1.

    For the compiled decode and verification forwards (`cospec.rollout.compiled_forward`): with
    a handful of query tokens against a few hundred cache slots, CPU SDPA's masked kernel costs
    more per call than the arithmetic, while these plain ops fuse under `torch.compile`. The
    queries of the G = H / Hkv heads that share a key/value head are stacked along the token axis,
    so K and V are read once per key/value head (no repeat). Scores and softmax in fp32.
    """
    if layout.mask is None:
        raise ValueError("matmul_cache_attention serves mask layouts (KV-cache forwards) only")
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    q_BKMD = q.reshape(B, Hkv, G * T, D)  # heads h = kv * G + g, as SDPA's enable_gqa groups them
    scores = torch.matmul(q_BKMD.float(), k.float().transpose(-1, -2)) / (D ** 0.5)
    visible = layout.mask[:, :, None].expand(-1, -1, G, -1, -1).reshape(
        layout.mask.shape[0], 1, G * T, -1)  # [B, 1, G*T, S]: the same mask for every head
    probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    out = torch.matmul(probs.to(v.dtype), v)  # [B, Hkv, G*T, D]
    return out.reshape(B, H, T, D)
