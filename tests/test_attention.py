"""The attention seam: the packed fast path equals dense attention under a block-diagonal causal mask."""

import torch
import torch.nn.functional as F

from cospec.models.attention import AttentionLayout, packed_causal_mask, sdpa_attention


def test_packed_attention_equals_dense_block_diagonal_attention_with_gradients():
    torch.manual_seed(0)
    cu = torch.tensor([0, 5, 6, 14, 17])  # lengths 5, 1, 8, 3
    q = torch.randn(1, 4, 17, 8, requires_grad=True)
    k = torch.randn(1, 2, 17, 8, requires_grad=True)  # GQA: 2 kv heads for 4 query heads
    v = torch.randn(1, 2, 17, 8, requires_grad=True)
    fast = sdpa_attention(q, k, v, AttentionLayout(cu_seqlens=cu))
    mask = packed_causal_mask(cu, 17)
    dense = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                           attn_mask=mask)
    torch.testing.assert_close(fast, dense, atol=1e-6, rtol=0)
    g = torch.randn_like(fast)
    grads_fast = torch.autograd.grad(fast, (q, k, v), g)
    grads_dense = torch.autograd.grad(dense, (q, k, v), g)
    for a, b in zip(grads_fast, grads_dense):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_the_block_diagonal_mask_never_crosses_a_sequence():
    mask = packed_causal_mask(torch.tensor([0, 2, 5]), 5)[0, 0]
    expected = torch.tensor([[1, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0],
                             [0, 0, 1, 0, 0],
                             [0, 0, 1, 1, 0],
                             [0, 0, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(mask, expected)
