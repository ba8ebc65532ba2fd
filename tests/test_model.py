"""The policy: one forward for packed training, KV-cache decoding and multi-token scoring."""

import pytest
import torch

from cospec.config import ModelConfig
from cospec.models.llama import Transformer
from cospec.rollout.kv_cache import KVCache

CFG = ModelConfig(vocab_size=50, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                  intermediate_size=128, max_seq_len=64)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = Transformer(CFG).eval()
    m.reset_parameters(std=0.1)  # larger weights than training init: differences show up in logits
    return m


def rand_tokens(*shape, seed=0):
    return torch.randint(4, CFG.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def test_packed_forward_equals_each_sequence_alone(model):
    seqs = [rand_tokens(1, n, seed=n) for n in (7, 1, 12, 5)]
    cu = torch.tensor([0, 7, 8, 20, 25])
    packed = model(torch.cat(seqs, 1), cu_seqlens=cu).logits[0]
    for s, (a, b) in zip(seqs, zip(cu[:-1], cu[1:])):
        torch.testing.assert_close(packed[a:b], model(s).logits[0], atol=1e-5, rtol=0)


def test_scoring_several_tokens_in_one_call_equals_decoding_them_one_by_one(model):
    prompt, new = rand_tokens(2, 6, seed=1), rand_tokens(2, 4, seed=2)
    a, b = KVCache.for_model(model, 2), KVCache.for_model(model, 2)
    model(prompt, kv_cache=a)
    model(prompt, kv_cache=b)
    together = model(new, kv_cache=a).logits
    one_by_one = torch.cat([model(new[:, i:i + 1], kv_cache=b).logits for i in range(4)], 1)
    torch.testing.assert_close(together, one_by_one, atol=1e-5, rtol=0)
    assert a.lengths_B.tolist() == [10, 10]


def test_rolled_back_rows_forget_rejected_tokens(model):
    prompt, junk, real = rand_tokens(1, 5, seed=3), rand_tokens(1, 3, seed=4), rand_tokens(1, 2, seed=5)
    cache = KVCache.for_model(model, 1)
    model(prompt, kv_cache=cache)
    model(junk, kv_cache=cache)
    cache.truncate(torch.tensor([5]))
    after_rollback = model(real, kv_cache=cache).logits
    full = model(torch.cat([prompt, real], 1)).logits[:, -2:]
    torch.testing.assert_close(after_rollback, full, atol=1e-5, rtol=0)


def test_logits_at_one_position_per_row_are_the_full_forwards_logits_there(model):
    """What a ragged prefill asks for: each row's logits after its own last prompt token, and the
    cache written exactly as by the full forward."""
    x, last = rand_tokens(3, 8, seed=9), torch.tensor([7, 0, 4])
    a, b = KVCache.for_model(model, 3), KVCache.for_model(model, 3)
    full = model(x, kv_cache=a, num_valid_B=last + 1)
    picked = model(x, kv_cache=b, num_valid_B=last + 1, logits_positions_B=last)
    assert picked.logits.shape == (3, 1, CFG.vocab_size)
    # the hidden states bit for bit; the head's matmul over 3 rows may take another BLAS kernel
    # than over 24 (an AMD EPYC's OpenBLAS differs in the last bit: 6e-7), hence fp32's roundoff
    torch.testing.assert_close(picked.logits[:, 0], full.logits[torch.arange(3), last])
    torch.testing.assert_close(picked.hidden, full.hidden, atol=0, rtol=0)
    assert torch.equal(a.lengths_B, b.lengths_B)
    assert all(torch.equal(x, y) for x, y in zip(a.keys + a.values, b.keys + b.values))


def test_logits_at_some_positions_of_a_packed_row_give_the_full_forwards_values_and_gradients(model):
    """What the GRPO step asks for: the head at the response positions only. Its loss there and
    that loss's gradients equal the full forward's, which computed the head everywhere."""
    x, cu = rand_tokens(1, 12, seed=3), torch.tensor([0, 5, 12])
    at = torch.tensor([2, 3, 4, 8, 9, 10])
    full = model(x, cu_seqlens=cu).logits[0, at]
    full.float().logsumexp(-1).sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    picked = model(x, cu_seqlens=cu, logits_positions_B=at[None]).logits
    assert picked.shape == (1, len(at), CFG.vocab_size)
    torch.testing.assert_close(picked[0], full.detach())
    picked.float().logsumexp(-1).sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], msg=n)
    model.zero_grad(set_to_none=True)


def test_tap_layers_come_from_the_same_pass_and_are_detached_unless_asked(model):
    x = rand_tokens(1, 9, seed=6)
    out = model(x, tap_layers=(0, 2))
    assert sorted(out.taps) == [0, 2]
    torch.testing.assert_close(out.taps[2], out.hidden)
    assert not out.taps[0].requires_grad
    live = model(x, tap_layers=(1,), detach_taps=False)
    live.taps[1].sum().backward()
    assert model.layers["0"].mlp.down_proj.weight.grad is not None
    model.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match="tap_layers"):
        model(x, tap_layers=(7,))


def test_a_pipeline_stage_holds_a_subset_of_layers_under_checkpoint_names(model):
    first = Transformer(CFG, layer_ids=[0, 1], has_head=False)
    last = Transformer(CFG, layer_ids=[2], has_embedding=False)
    sd = model.state_dict()
    first.load_state_dict({k: v for k, v in sd.items() if k in first.state_dict()})
    last.load_state_dict({k: v for k, v in sd.items() if k in last.state_dict()})
    assert "layers.2.self_attn.q_proj.weight" in last.state_dict()
    x = rand_tokens(2, 8, seed=7)
    h = first(x).hidden
    assert first(x).logits is None
    torch.testing.assert_close(last(inputs_embeds=h).logits, model(x).logits, atol=1e-5, rtol=0)


def test_tied_embeddings_share_one_tensor():
    m = Transformer(ModelConfig(**{**CFG.__dict__, "tie_embeddings": True}))
    assert m.lm_head.weight is m.embed_tokens.weight
    assert m.num_params() == sum(p.numel() for p in m.parameters())


def test_bad_inputs_raise_clear_errors(model):
    cache = KVCache.for_model(model, 1)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(rand_tokens(1, 65))
    with pytest.raises(ValueError, match="overflow"):
        model(rand_tokens(1, 65), kv_cache=cache)
    with pytest.raises(ValueError, match="batch size 1"):
        model(rand_tokens(2, 4), cu_seqlens=torch.tensor([0, 2, 4]))
    with pytest.raises(ValueError, match="KV cache"):
        model(rand_tokens(1, 4), cu_seqlens=torch.tensor([0, 4]), kv_cache=cache)
