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


def test_bf16_training_attention_on_a_cpu_runs_in_fp32_and_hands_back_bf16():
    """Under bf16 autocast, with gradients, the packed CPU path computes in fp32 (torch's bf16
    CPU attention backward is several times slower): its output and gradients are the fp32
    attention's of the same bf16 inputs, rounded once to bf16."""
    torch.manual_seed(1)
    cu = torch.tensor([0, 7, 9, 20])
    q, k, v = (torch.randn(1, h, 20, 16, dtype=torch.bfloat16, requires_grad=True)
               for h in (6, 2, 2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = sdpa_attention(q, k, v, AttentionLayout(cu_seqlens=cu))
    assert out.dtype == torch.bfloat16
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    want = F.scaled_dot_product_attention(q32, k32.repeat_interleave(3, 1),
                                          v32.repeat_interleave(3, 1),
                                          attn_mask=packed_causal_mask(cu, 20))
    # one rounding of the fp32 result (bf16 keeps 8 significant bits); attention computed in
    # bf16 misses this by 0.3-0.97 relative on some entries of these inputs
    torch.testing.assert_close(out.float(), want, rtol=2 ** -8, atol=1e-6)
    g = torch.randn_like(want)
    grads = torch.autograd.grad(out, (q, k, v), g.to(torch.bfloat16))
    grads32 = torch.autograd.grad(want, (q32, k32, v32), g.to(torch.bfloat16).float())
    for a, b in zip(grads, grads32):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.to(torch.bfloat16).float(), atol=1e-2, rtol=1e-2)
