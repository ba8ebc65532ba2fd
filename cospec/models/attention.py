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

    def padded_index(self) -> tuple[Tensor, Tensor, int]:
        """For packed input: (gather_NL, scatter_T, L), computed once per forward and shared by all
        layers. gather_NL[n, l] is the packed index of token l of sequence n (clamped past its end);
        scatter_T[t] is where packed token t sits in the flattened [N * L] padded layout."""
        if "padded" not in self._memo:
            cu = self.cu_seqlens
            lens = cu[1:] - cu[:-1]
            L = int(lens.max())  # device sync, once per forward
            offs = torch.arange(L, device=cu.device)
            gather_NL = torch.minimum(cu[:-1, None] + offs[None, :], (cu[1:] - 1).clamp(min=0)[:, None])
            total = int(cu[-1])
            t = torch.arange(total, device=cu.device)
            seq = torch.bucketize(t, cu[1:], right=True)
            self._memo["padded"] = (gather_NL, seq * L + (t - cu[seq]), L)
        return self._memo["padded"]


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
    # Packed: unpack to a padded [N, H, L, D] batch and run plain causal attention, O(N L^2) instead
    # of the O(T^2) of a block-diagonal mask over the packed row (T = N * mean length). Padding sits
    # after each sequence's last token, so the causal mask alone keeps valid queries off it.
    gather_NL, scatter_T, L = layout.padded_index()
    N = gather_NL.shape[0]

    def unpack(x_1HTD: Tensor) -> Tensor:
        return x_1HTD[0][:, gather_NL].transpose(0, 1)  # [H, N, L, D] -> [N, H, L, D]

    out_NHLD = F.scaled_dot_product_attention(unpack(q), unpack(k), unpack(v), is_causal=True,
                                              enable_gqa=gqa)
    out_HTD = out_NHLD.transpose(0, 1).reshape(q.shape[1], N * L, -1)[:, scatter_T]
    return out_HTD[None]


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
