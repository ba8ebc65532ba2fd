"""One block of ring attention: queries of this rank against one K/V block, forward and backward.

# N sequences, H query heads, Hkv kv heads, G = H / Hkv, Q query rows, K key rows, D head dim,
# L local packed tokens, S = 2 * cmax rows of a sequence in the halves layout

A zigzag rank holds two chunks of every sequence (cospec/parallel/zigzag.py). The ring computes on
the *halves layout*: [N, H, S, D], sequence n's first local chunk at rows [0, c_n) and its second at
[cmax, cmax + c_n); rows past c_n in each half are padding (``valid``). The zigzag case analysis
(docs/design.md, "Context parallel") then becomes plain slicing: "first half of a block" is rows
[:cmax], "second local chunk" rows [cmax:]. Blocks of different sequences never meet (block-diagonal masking for packed input).

The kernel is plain PyTorch so it runs on CPU and CUDA alike. Scores are materialised for at most
``QUERY_TILE`` query rows at a time (flash-attention style recomputation in the backward from the
saved output and log-sum-exp, Dao et al. 2205.14135), so memory per block is O(tile * K), not
O(Q * K). Grouped-query attention folds the G query heads of a kv head into the row dim
([Hkv, G*Q, D] @ [Hkv, D, K]) so K/V are never repeated. Sums run in fp32 (fp64 for fp64 input).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from cospec.models.precision import outside_autocast

#: query rows (per sequence and kv-head group) whose scores exist at once
QUERY_TILE = 256


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp32, or fp64 when the input is fp64 (tests)."""
    return torch.promote_types(dtype, torch.float32)


@dataclass(frozen=True)
class HalvesLayout:
    """Index maps between a rank's packed row [.., L, ..] and the halves layout [N, .., S, ..].

    Built from local cu_seqlens whose every length is even (2 chunks of c_n tokens).
    """

    gather_NS: Tensor  # int [N, S]: packed index of each halves row (clamped inside its chunk)
    valid_NS: Tensor  # bool [N, S]: the row holds a real local token
    scatter_L: Tensor  # int [L]: flat index (n * S + row) of every packed token
    cmax: int

    @classmethod
    def build(cls, local_cu_seqlens: Tensor) -> "HalvesLayout":
        cu = local_cu_seqlens.to(torch.long)
        chunk_N = (cu[1:] - cu[:-1]) // 2
        cmax = int(chunk_N.max())  # device sync, once per forward
        i = torch.arange(cmax, device=cu.device)
        row_NS = torch.cat([i, i])[None].expand(len(chunk_N), -1)
        half_NS = torch.cat([torch.zeros_like(i), torch.ones_like(i)])[None]
        valid_NS = row_NS < chunk_N[:, None]
        inside = torch.minimum(row_NS, (chunk_N[:, None] - 1).clamp(min=0))
        gather_NS = cu[:-1, None] + half_NS * chunk_N[:, None] + inside
        t = torch.arange(int(cu[-1]), device=cu.device)
        seq = torch.bucketize(t, cu[1:], right=True)
        offset = t - cu[seq]
        half = offset // chunk_N[seq]
        scatter_L = seq * 2 * cmax + half * cmax + offset - half * chunk_N[seq]
        return cls(gather_NS=gather_NS, valid_NS=valid_NS, scatter_L=scatter_L, cmax=cmax)

    def to_halves(self, x_HLX: Tensor) -> Tensor:
        """[H, L, *rest] -> [N, H, S, *rest] (padding rows copy a real row; mask them)."""
        return x_HLX[:, self.gather_NS].transpose(0, 1)

    def from_halves(self, x_NHSX: Tensor) -> Tensor:
        """[N, H, S, *rest] -> [H, L, *rest], dropping padding rows."""
        N, H, S = x_NHSX.shape[:3]
        flat = x_NHSX.transpose(0, 1).reshape(H, N * S, *x_NHSX.shape[3:])
        return flat[:, self.scatter_L]


def _group_rows(x_NHQD: Tensor, num_kv_heads: int) -> Tensor:
    """[N, H, Q, D] -> [N, Hkv, G*Q, D]: the G query heads of a kv head stacked along rows."""
    N, H, Q, D = x_NHQD.shape
    return x_NHQD.reshape(N, num_kv_heads, (H // num_kv_heads) * Q, D)


def _scores(q_NHQD: Tensor, k_NHkvKD: Tensor, mask_NQK: Tensor, scale: float) -> Tensor:
    """Masked scores [N, Hkv, G, Q, K] in the accumulation dtype."""
    N, H, Q, _ = q_NHQD.shape
    Hkv = k_NHkvKD.shape[1]
    s = _group_rows(q_NHQD, Hkv) @ k_NHkvKD.transpose(-1, -2) * scale  # [N, Hkv, G*Q, K]
    s = s.view(N, Hkv, H // Hkv, Q, -1)
    return s.masked_fill(~mask_NQK[:, None, None], float("-inf"))


def _tiles(num_rows: int):
    for start in range(0, num_rows, QUERY_TILE):
        yield slice(start, min(start + QUERY_TILE, num_rows))


@outside_autocast  # fp32 scores under autocast too (cospec.models.precision says why)
def block_forward(q_NHQD: Tensor, k_NHkvKD: Tensor, v_NHkvKD: Tensor, mask_NQK: Tensor,
                  scale: float) -> tuple[Tensor, Tensor]:
    """softmax(q k^T * scale, masked) v and its log-sum-exp: (out [N, H, Q, D], lse [N, H, Q]).

    mask_NQK: bool, broadcastable to [N, Q, K]. A row with no visible key gets lse = -inf, out = 0.
    Inputs must already be in the accumulation dtype.
    """
    N, H, Q, D = q_NHQD.shape
    mask_NQK = mask_NQK.expand(N, Q, k_NHkvKD.shape[2])
    out = q_NHQD.new_empty(N, H, Q, D)
    lse = q_NHQD.new_empty(N, H, Q)
    for t in _tiles(Q):
        s = _scores(q_NHQD[:, :, t], k_NHkvKD, mask_NQK[:, t], scale)  # [N, Hkv, G, q, K]
        m = s.logsumexp(-1)
        p = (s - m.nan_to_num(neginf=0.0)[..., None]).exp()  # empty rows: exp(-inf) = 0
        o = p.flatten(2, 3) @ v_NHkvKD  # [N, Hkv, G*q, D]
        out[:, :, t] = o.view(N, H, -1, D)
        lse[:, :, t] = m.reshape(N, H, -1)
    return out, lse


@outside_autocast
def block_backward(do_NHQD: Tensor, q_NHQD: Tensor, k_NHkvKD: Tensor, v_NHkvKD: Tensor,
                   lse_NHQ: Tensor, delta_NHQ: Tensor, mask_NQK: Tensor,
                   scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block's share of a softmax whose *final* (merged) lse and
    delta = rowsum(dO * O) are given (docs/design.md, "Context parallel"): (dq, dk, dv), same shapes as inputs.

    p = exp(s - lse); dv = p^T dO; dp = dO v^T; ds = p * (dp - delta); dq = ds k * scale;
    dk = ds^T q * scale. Rows with dO = 0 (padding) contribute nothing.
    """
    N, H, Q, D = q_NHQD.shape
    Hkv = k_NHkvKD.shape[1]
    mask_NQK = mask_NQK.expand(N, Q, k_NHkvKD.shape[2])
    dq = torch.empty_like(q_NHQD)
    dk = torch.zeros_like(k_NHkvKD)
    dv = torch.zeros_like(v_NHkvKD)
    for t in _tiles(Q):
        s = _scores(q_NHQD[:, :, t], k_NHkvKD, mask_NQK[:, t], scale)  # [N, Hkv, G, q, K]
        lse = lse_NHQ[:, :, t].reshape(N, Hkv, H // Hkv, -1, 1)
        p = (s - lse.nan_to_num(neginf=0.0)).exp().flatten(2, 3)  # [N, Hkv, G*q, K]
        do = _group_rows(do_NHQD[:, :, t], Hkv)  # [N, Hkv, G*q, D]
        dv += p.transpose(-1, -2) @ do
        dp = do @ v_NHkvKD.transpose(-1, -2)
        ds = p * (dp - delta_NHQ[:, :, t].reshape(N, Hkv, -1, 1)) * scale
        dq[:, :, t] = (ds @ k_NHkvKD).view(N, H, -1, D)
        dk += ds.transpose(-1, -2) @ _group_rows(q_NHQD[:, :, t], Hkv)
    return dq, dk, dv
