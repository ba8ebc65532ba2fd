"""Trunk + branch attention: the attention of the draft's training-time-test (TTT) unroll.

# H query heads, Hkv key/value heads, T packed tokens, J branch keys per query, D head dim

EAGLE-3 (arXiv 2503.01840, Sec. 3.3 and Fig. 6) trains the draft for k steps ahead in one pass. At
TTT step j the query anchored at packed position t sees, in one softmax:
- the *trunk*: the step-1 keys/values at positions <= t of the same packed sequence (causal, never
  across a ``cu_seqlens`` boundary);
- the *branch*: the keys/values of steps 2..j at the same anchor t (J = j - 1 of them: a diagonal).

The two parts are computed apart and merged exactly by log-sum-exp (docs/design.md, "Merge partial"):
    lse = logaddexp(lse_trunk, lse_branch)
    out = exp(lse_trunk - lse) * out_trunk + exp(lse_branch - lse) * out_branch
so that a context-parallel ring (cospec/parallel) can replace `trunk_attention` with a ring pass,
keep `branch_attention` rank-local, and merge with the same `merge_attention`.

Tensors carry no batch dim: a packed row is [H, T, D] (the model's [1, H, T, D] squeezed); branch
keys are stacked [J, Hkv, T, D] (index 0 is step 2). Outputs are fp32 (fp64 for fp64 input) ``out_HTD`` and ``lse_HT``
(natural log, softmax scale included), under autocast too (`outside_autocast`: bf16 scores
lose the q/k gradients). Grouped-query attention: query head h reads kv head
h // (H / Hkv), as HF and SDPA's ``enable_gqa`` do.

This is the single-device reference: explicit scores over each sequence unpacked to a padded
[N, H, L, L] block (O(sum of L^2), not O(T^2)), gradients by autograd through plain torch ops.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from cospec.models.attention import AttentionLayout
from cospec.models.precision import outside_autocast


def _expand_kv(x_HkvTD: Tensor, num_heads: int) -> Tensor:
    return x_HkvTD.repeat_interleave(num_heads // x_HkvTD.shape[-3], dim=-3)


def _acc(x: Tensor) -> Tensor:
    """Upcast to the accumulation dtype: fp32, or fp64 when the input is fp64 (for tests)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


@outside_autocast
def trunk_attention(q_HTD: Tensor, k_HkvTD: Tensor, v_HkvTD: Tensor, cu_seqlens: Tensor,
                    scale: float | None = None) -> tuple[Tensor, Tensor]:
    """Causal attention within each packed sequence; returns (out fp32 [H, T, D], lse fp32 [H, T])."""
    H, T, D = q_HTD.shape
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    layout = AttentionLayout(cu_seqlens=cu_seqlens)
    q = layout.to_padded(_acc(q_HTD))  # [N, H, L, D], zeros past each sequence's end
    k = layout.to_padded(_expand_kv(_acc(k_HkvTD), H))
    v = layout.to_padded(_expand_kv(_acc(v_HkvTD), H))
    L = q.shape[2]
    scores = (q @ k.transpose(-1, -2)) * scale  # [N, H, L, L]
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    lse = scores.logsumexp(-1)  # [N, H, L]; the diagonal is always visible, so finite
    out = (scores - lse[..., None]).exp() @ v  # [N, H, L, D]
    return layout.from_padded(out), layout.from_padded(lse)


@outside_autocast
def branch_attention(q_HTD: Tensor, k_JHkvTD: Tensor, v_JHkvTD: Tensor,
                     scale: float | None = None) -> tuple[Tensor, Tensor]:
    """Each query against the J branch keys of its own position only; (out [H, T, D], lse [H, T]).

    J == 0 gives lse = -inf and out = 0, the identity of `merge_attention`.
    """
    H, T, D = q_HTD.shape
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    if k_JHkvTD.shape[0] == 0:
        zero = _acc(q_HTD.new_zeros(H, T, D))
        return zero, torch.full((H, T), float("-inf"), dtype=zero.dtype, device=zero.device)
    k = _expand_kv(_acc(k_JHkvTD), H)  # [J, H, T, D]
    v = _expand_kv(_acc(v_JHkvTD), H)
    scores_JHT = (_acc(q_HTD)[None] * k).sum(-1) * scale
    lse_HT = scores_JHT.logsumexp(0)
    out_HTD = ((scores_JHT - lse_HT[None]).exp()[..., None] * v).sum(0)
    return out_HTD, lse_HT


def merge_attention(out_a: Tensor, lse_a: Tensor, out_b: Tensor,
                    lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Exact softmax over the union of two disjoint key sets from their partial results (fp32).

    A side with lse = -inf (no keys) contributes nothing; both sides empty is not allowed.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    out = (lse_a - lse).exp()[..., None] * out_a + (lse_b - lse).exp()[..., None] * out_b
    return out, lse


def trunk_branch_attention(q_HTD: Tensor, k_HkvTD: Tensor, v_HkvTD: Tensor, cu_seqlens: Tensor,
                           branch_k_JHkvTD: Tensor | None = None,
                           branch_v_JHkvTD: Tensor | None = None,
                           scale: float | None = None) -> tuple[Tensor, Tensor]:
    """Attention of TTT step j = J + 1: trunk (causal, packed) and branch (diagonal) in one softmax.

    Returns (out fp32 [H, T, D], lse fp32 [H, T]). With no branch this is plain packed causal
    attention (step 1).
    """
    H, T, D = q_HTD.shape
    if k_HkvTD.shape[-2] != T or v_HkvTD.shape != k_HkvTD.shape:
        raise ValueError(f"trunk k/v must be [Hkv, {T}, D] like q's tokens, got "
                         f"{tuple(k_HkvTD.shape)} and {tuple(v_HkvTD.shape)}")
    if H % k_HkvTD.shape[0] != 0:
        raise ValueError(f"query heads {H} must be a multiple of kv heads {k_HkvTD.shape[0]}")
    out, lse = trunk_attention(q_HTD, k_HkvTD, v_HkvTD, cu_seqlens, scale)
    if branch_k_JHkvTD is None or branch_k_JHkvTD.shape[0] == 0:
        return out, lse
    if branch_k_JHkvTD.shape[1:] != k_HkvTD.shape or branch_v_JHkvTD.shape != branch_k_JHkvTD.shape:
        raise ValueError(f"branch k/v must be [J, {k_HkvTD.shape[0]}, {T}, {D}], got "
                         f"{tuple(branch_k_JHkvTD.shape)} and {tuple(branch_v_JHkvTD.shape)}")
    out_b, lse_b = branch_attention(q_HTD, branch_k_JHkvTD, branch_v_JHkvTD, scale)
    return merge_attention(out, lse, out_b, lse_b)
