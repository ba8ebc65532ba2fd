"""HF checkpoint interop: the policy computes what transformers computes on the same checkpoint.

Every model here is tiny (hidden 64, 2 layers, 4 query / 2 kv heads, vocab 50) with all weights
randomised, norms and biases included, so a mis-mapped tensor or a numerics difference moves the
logits well past the 1e-4 tolerance. A failure in the forward tests with a correct state-dict test
points at `cospec/models/llama.py`; a failure in the round-trip tests points at `hf_checkpoint.py`.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from checkpoint_factory import randomise_

from cospec.config import ModelConfig
from cospec.models.hf_checkpoint import load_hf, model_config_from_hf, save_hf
from cospec.models.llama import Transformer
from cospec.rollout.kv_cache import KVCache

ATOL = 1e-4
HF_CLASSES = {"LlamaForCausalLM": (LlamaConfig, LlamaForCausalLM),
              "Qwen2ForCausalLM": (Qwen2Config, Qwen2ForCausalLM)}
CASES = [(arch, tied) for arch in HF_CLASSES for tied in (False, True)]
IDS = [f"{arch.removesuffix('ForCausalLM')}-{'tied' if tied else 'untied'}" for arch, tied in CASES]


def tiny_hf(arch: str, tied: bool, seed: int = 0, rope_parameters: dict | None = None,
            max_position_embeddings: int = 64):
    config_cls, model_cls = HF_CLASSES[arch]
    rope_parameters = rope_parameters or {"rope_type": "default", "rope_theta": 500.0}
    config = config_cls(vocab_size=50, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-5,
                        rope_parameters=rope_parameters, tie_word_embeddings=tied,
                        attn_implementation="eager")
    model = model_cls(config).float().eval()
    randomise_(model, seed)
    return model


def tokens(*shape, seed=0):
    return torch.randint(0, 50, shape, generator=torch.Generator().manual_seed(seed))


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(input_ids=ids).logits


@pytest.fixture(scope="module", params=CASES, ids=IDS)
def pair(request, tmp_path_factory):
    """(transformers model, the same checkpoint loaded by cospec)."""
    arch, tied = request.param
    hf = tiny_hf(arch, tied)
    path = tmp_path_factory.mktemp("hf")
    hf.save_pretrained(path, safe_serialization=True)
    return hf, load_hf(path).eval()


@torch.no_grad()
def test_plain_forward_matches_transformers(pair):
    hf, ours = pair
    ids = tokens(2, 12)
    torch.testing.assert_close(ours(ids).logits, hf_logits(hf, ids), atol=ATOL, rtol=0)


@torch.no_grad()
def test_packed_forward_matches_transformers_on_each_sequence_alone(pair):
    hf, ours = pair
    first, second = tokens(1, 9, seed=1), tokens(1, 6, seed=2)
    packed = ours(torch.cat([first, second], 1), cu_seqlens=torch.tensor([0, 9, 15])).logits[0]
    torch.testing.assert_close(packed[:9], hf_logits(hf, first)[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(packed[9:], hf_logits(hf, second)[0], atol=ATOL, rtol=0)


@torch.no_grad()
def test_kv_cache_prefill_of_ragged_rows_then_decoding_matches_transformers(pair):
    hf, ours = pair
    prompt_lengths, num_steps = (3, 7, 5), 4
    seqs = [tokens(1, n + num_steps, seed=10 + n) for n in prompt_lengths]
    cache = KVCache.for_model(ours, batch_size=3, capacity=16)
    got = [[ours(s[:, :n], kv_cache=cache, cache_rows=torch.tensor([b])).logits[0]]
           for b, (s, n) in enumerate(zip(seqs, prompt_lengths))]
    for i in range(num_steps):
        step = torch.cat([s[:, n + i:n + i + 1] for s, n in zip(seqs, prompt_lengths)])  # [3, 1]
        logits = ours(step, kv_cache=cache).logits
        for b in range(3):
            got[b].append(logits[b])
    for b, s in enumerate(seqs):  # prefill logits then one per decode step: every position
        torch.testing.assert_close(torch.cat(got[b]), hf_logits(hf, s)[0], atol=ATOL, rtol=0)


@pytest.mark.parametrize(("arch", "tied"), CASES, ids=IDS)
@torch.no_grad()
def test_saved_checkpoint_gives_the_same_logits_in_transformers(arch, tied, tmp_path):
    cfg = ModelConfig(vocab_size=50, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      intermediate_size=96, max_seq_len=64, rope_theta=500.0,
                      qkv_bias=arch == "Qwen2ForCausalLM", tie_embeddings=tied)
    ours = Transformer(cfg).eval()
    randomise_(ours, seed=3)
    save_hf(ours, tmp_path / "ckpt", architecture=arch)
    hf = HF_CLASSES[arch][1].from_pretrained(tmp_path / "ckpt", attn_implementation="eager").eval()
    ids = tokens(2, 10, seed=4)
    torch.testing.assert_close(hf_logits(hf, ids), ours(ids).logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize(("arch", "tied"), CASES, ids=IDS)
def test_round_trip_through_transformers_is_bit_exact(arch, tied, tmp_path):
    cfg = ModelConfig(vocab_size=50, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      intermediate_size=96, max_seq_len=64, qkv_bias=arch == "Qwen2ForCausalLM",
                      tie_embeddings=tied)
    ours = Transformer(cfg)
    randomise_(ours, seed=5)
    save_hf(ours, tmp_path / "a", architecture=arch)
    HF_CLASSES[arch][1].from_pretrained(tmp_path / "a").save_pretrained(tmp_path / "b")
    back = load_hf(tmp_path / "b")
    assert back.config == cfg
    before, after = ours.state_dict(), back.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert (back.lm_head.weight is back.embed_tokens.weight) == tied


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path):
    hf = tiny_hf("Qwen2ForCausalLM", tied=False)
    hf.save_pretrained(tmp_path / "one")
    hf.save_pretrained(tmp_path / "shards", max_shard_size="40KB")
    assert (tmp_path / "shards" / "model.safetensors.index.json").exists()
    one, shards = load_hf(tmp_path / "one").state_dict(), load_hf(tmp_path / "shards").state_dict()
    assert all(torch.equal(one[k], shards[k]) for k in one)


def test_saving_over_a_checkpoint_replaces_it_and_keeps_other_files(tmp_path):
    tiny_hf("LlamaForCausalLM", tied=False).save_pretrained(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "tokenizer.json").write_text("{}")
    new = Transformer(ModelConfig(vocab_size=50, hidden_size=64, num_layers=1, num_heads=4))
    save_hf(new, tmp_path / "ckpt")
    reloaded = load_hf(tmp_path / "ckpt").state_dict()
    assert reloaded.keys() == new.state_dict().keys()
    assert torch.equal(reloaded["embed_tokens.weight"], new.embed_tokens.weight)
    assert (tmp_path / "ckpt" / "tokenizer.json").read_text() == "{}"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temporary directories left


def test_unknown_architecture_is_refused_naming_it_and_the_supported_ones(tmp_path):
    tiny_hf("LlamaForCausalLM", tied=False).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["MistralForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"MistralForCausalLM.*LlamaForCausalLM, Qwen2ForCausalLM"):
        load_hf(tmp_path)


def test_missing_tensor_is_refused_naming_it(tmp_path):
    tiny_hf("Qwen2ForCausalLM", tied=False).save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.bias"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing \['model\.layers\.1\.self_attn\.k_proj\.bias'\]"):
        load_hf(tmp_path)


# Llama 3.1 RoPE scaling, shrunk so that it matters in a tiny model: head_dim 16 and theta 100 give
# wavelengths 6.3, 11, 20, 35, ... so with an original context of 32 (edges at 32/4 = 8 and 32/1)
# the first frequency is kept, the next two are interpolated and the rest divided by 8. Turning the
# scaling off moves these logits by ~0.5, far past ATOL.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 100.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
LLAMA3_FIELDS = dict(rope_theta=100.0, rope_scaling="llama3", rope_scaling_factor=8.0,
                     rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_len=32)


@torch.no_grad()
def test_llama3_rope_scaling_matches_transformers_past_the_original_context(tmp_path):
    hf = tiny_hf("LlamaForCausalLM", tied=False, rope_parameters=LLAMA3_ROPE,
                 max_position_embeddings=128)
    hf.save_pretrained(tmp_path)
    ours = load_hf(tmp_path).eval()
    assert {k: getattr(ours.config, k) for k in LLAMA3_FIELDS} == LLAMA3_FIELDS
    ids = tokens(2, 100, seed=6)
    torch.testing.assert_close(ours(ids).logits, hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_llama3_rope_scaling_survives_save_and_reload_by_transformers(tmp_path):
    cfg = ModelConfig(vocab_size=50, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      intermediate_size=96, max_seq_len=128, **LLAMA3_FIELDS)
    save_hf(Transformer(cfg), tmp_path / "a")
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "a")
    assert hf.config.rope_parameters == LLAMA3_ROPE
    hf.save_pretrained(tmp_path / "b")
    assert load_hf(tmp_path / "b").config == cfg


@pytest.mark.parametrize("type_key", ["rope_type", "type"])
def test_transformers_4_rope_scaling_reads_like_transformers_5_rope_parameters(type_key):
    config = tiny_hf("LlamaForCausalLM", tied=False).config.to_dict()
    config.pop("rope_parameters")
    scaling = {k: v for k, v in LLAMA3_ROPE.items() if k not in ("rope_type", "rope_theta")}
    config.update(architectures=["LlamaForCausalLM"], rope_theta=100.0,
                  rope_scaling={type_key: "llama3", **scaling})
    cfg = model_config_from_hf(config)
    assert {k: getattr(cfg, k) for k in LLAMA3_FIELDS} == LLAMA3_FIELDS


@pytest.mark.parametrize(("patch", "message"), [
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope type 'yarn'"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope type 'linear'"),
    ({"head_dim": 32}, "head_dim=32"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "sliding-window"),
    ({"use_sliding_window": True}, "sliding-window"),
    ({"attention_bias": True}, "attention_bias"),
])
def test_configs_the_policy_would_compute_differently_are_refused(patch, message):
    config = tiny_hf("LlamaForCausalLM", tied=False).config.to_dict() | patch
    config["architectures"] = ["LlamaForCausalLM"]
    with pytest.raises(ValueError, match=message):
        model_config_from_hf(config)
