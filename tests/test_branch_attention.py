"""Specification of cospec.models.branch_attention: trunk (packed causal) + branch (diagonal) in one
softmax, against a dense masked attention over the concatenated keys.

The oracle lays the trunk keys (T of them) and the J branch keys per position side by side in one
[T, T + J*T] score matrix, masks what a query may not see (trunk keys outside its sequence or after
it; branch keys of other positions) and runs one plain softmax. fp64, tolerance 1e-10 on outputs,
1e-8 on gradients: the reference and the implementation reorder sums only.
"""

import math

import pytest
import torch

from cospec.models.attention import packed_causal_mask
from cospec.models.branch_attention import merge_attention, trunk_branch_attention


def dense_reference(q, k, v, cu_seqlens, bk, bv):
    """One softmax over [trunk | branch step 2 | ... | branch step J+1] keys."""
    H, T, D = q.shape
    rep = H // k.shape[0]
    keys = [k.repeat_interleave(rep, 0)] + [b.repeat_interleave(rep, 0) for b in bk]
    vals = [v.repeat_interleave(rep, 0)] + [b.repeat_interleave(rep, 0) for b in bv]
    K, V = torch.cat(keys, 1), torch.cat(vals, 1)  # [H, T + J*T, D]
    masks = [packed_causal_mask(cu_seqlens, T)[0, 0]] + [torch.eye(T, dtype=torch.bool)] * len(bk)
    mask = torch.cat(masks, 1)
    scores = (q @ K.transpose(-1, -2)) / math.sqrt(D)
    scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ V, scores.logsumexp(-1)


@pytest.mark.parametrize("num_branch", [0, 1, 3])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)])
def test_trunk_branch_equals_one_dense_softmax_forward_and_backward(num_branch, heads, kv_heads):
    torch.manual_seed(num_branch + 10 * heads + kv_heads)
    cu = torch.tensor([0, 5, 6, 13])  # three packed sequences, one of length 1
    T, D = 13, 8
    dt = torch.float64
    q = torch.randn(heads, T, D, dtype=dt, requires_grad=True)
    k = torch.randn(kv_heads, T, D, dtype=dt, requires_grad=True)
    v = torch.randn(kv_heads, T, D, dtype=dt, requires_grad=True)
    bk = torch.randn(num_branch, kv_heads, T, D, dtype=dt, requires_grad=True)
    bv = torch.randn(num_branch, kv_heads, T, D, dtype=dt, requires_grad=True)
    out, lse = trunk_branch_attention(q, k, v, cu, bk, bv)
    ref_out, ref_lse = dense_reference(q, k, v, cu, bk, bv)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-10, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-10, rtol=0)

    g = torch.randn_like(ref_out)
    grads = torch.autograd.grad((out.double() * g).sum(), [q, k, v, bk, bv], allow_unused=True)
    ref_grads = torch.autograd.grad((ref_out * g).sum(), [q, k, v, bk, bv], allow_unused=True)
    for name, a, b in zip("q k v bk bv".split(), grads, ref_grads):
        if b is None:
            assert a is None or not a.any(), name
            continue
        torch.testing.assert_close(a, b, atol=1e-8, rtol=0, msg=lambda m: f"grad {name}: {m}")


def test_bf16_autocast_leaves_the_attention_in_fp32_forward_and_backward():
    """Inside a bf16 autocast region (where the draft trains when its policy step does) the
    outputs and every gradient equal the fp32 ones. Computed in bf16 instead, the softmax backward
    p * (dp - delta) subtracts near-equal terms and the q and k gradients come out ~1e-2 off
    (on SmolLM2's draft their cosines with the fp32 ones fell to 0.2-0.65; it stopped learning)."""
    torch.manual_seed(0)
    cu = torch.tensor([0, 37, 41, 64])
    H, Hkv, T, D, J = 4, 2, 64, 16, 2
    inputs = [torch.randn(H, T, D) * 2, torch.randn(Hkv, T, D) * 2, torch.randn(Hkv, T, D),
              torch.randn(J, Hkv, T, D) * 2, torch.randn(J, Hkv, T, D)]
    g = torch.randn(H, T, D)

    def run(region):
        xs = [x.clone().requires_grad_(True) for x in inputs]
        with region:
            out, lse = trunk_branch_attention(xs[0], xs[1], xs[2], cu, xs[3], xs[4])
        # the backward outside the region, as the trainers run it (it follows the forward's dtypes)
        return out, lse, torch.autograd.grad((out * g).sum(), xs)

    ref_out, ref_lse, ref_grads = run(torch.autocast("cpu", enabled=False))
    out, lse, grads = run(torch.autocast("cpu", dtype=torch.bfloat16))
    assert out.dtype == lse.dtype == torch.float32
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, ref_lse, atol=1e-6, rtol=1e-6)
    for name, a, b in zip("q k v bk bv".split(), grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m: f"grad {name}: {m}")


def test_merge_with_an_empty_side_is_the_identity():
    out, lse = torch.randn(2, 3, 4), torch.randn(2, 3)
    empty_out, empty_lse = torch.zeros(2, 3, 4), torch.full((2, 3), float("-inf"))
    m_out, m_lse = merge_attention(out, lse, empty_out, empty_lse)
    torch.testing.assert_close(m_out, out)
    torch.testing.assert_close(m_lse, lse)


def test_mismatched_branch_shape_is_a_clear_error():
    q, k, v = torch.randn(4, 6, 8), torch.randn(2, 6, 8), torch.randn(2, 6, 8)
    with pytest.raises(ValueError, match="branch k/v"):
        trunk_branch_attention(q, k, v, torch.tensor([0, 6]), torch.randn(1, 2, 5, 8),
                               torch.randn(1, 2, 5, 8))
