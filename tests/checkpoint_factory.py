"""Real-format checkpoints of tiny models, made in-process, for tests that load checkpoints.

    tokenizer = train_tiny_bpe()                       # byte-level BPE, SmolLM2's special tokens
    write_hf_checkpoint(tmp / "hf", model, tokenizer)  # config, safetensors, tokenizer files
    write_gguf_checkpoint(tmp / "m.gguf", model, tokenizer,
                          quantize={"layers.0.mlp.up_proj.weight": "Q8_0"})

Both directories load in transformers (``AutoTokenizer``/``AutoModelForCausalLM.from_pretrained``,
with ``gguf_file=`` for GGUF) with no network. The GGUF writer is written from llama.cpp's file
format and its converter's conventions (tensor names, q/k row order, RoPE-scaling tensor, gpt2-style
tokenizer metadata), independently of `cospec.models.gguf_checkpoint`, so the loader is tested
against it and against transformers' own GGUF reader. Import with ``from checkpoint_factory import
...`` (pytest puts tests/ on sys.path).
"""

from __future__ import annotations

import functools
import json
import math
import random
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import quantize as gguf_quantize
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from cospec.config import ModelConfig
from cospec.models.hf_checkpoint import save_hf
from cospec.models.llama import Transformer

#: SmolLM2's special tokens, at its ids.
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
BOS_ID, EOS_ID, PAD_ID, UNK_ID = 1, 2, 2, 0

#: ChatML as SmolLM2 writes it, less its default system message: every turn is
#: "<|im_start|>{role}\n{content}<|im_end|>\n"; add_generation_prompt opens the assistant's turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_ENGLISH = """\
The river ran quietly past the old mill, where a family of otters had built their home.
Every morning the baker opened her shop before sunrise and filled the window with warm bread.
Children walked to school along the narrow lane, counting the blackbirds on the fence.
A good teacher explains the same idea in three different ways until everyone understands it.
When the storm finally passed, the village gathered in the square to repair the broken roofs.
Scientists measure the speed of light with mirrors, lasers and very precise clocks.
She planted tomatoes, beans and sunflowers in the garden behind the library.
The library keeps maps of the valley drawn by travellers hundreds of years ago.
If you add two even numbers, the result is always even; two odd numbers also give an even sum.
Multiplication is repeated addition, and division asks how many equal groups fit.
The train leaves the station at seven o'clock and arrives in the city before noon.
Please write your answer clearly, show your working, and check the final number twice.
Mountains in the north are covered with snow for most of the year, even in summer.
A question about fractions: what is one half plus one quarter? It is three quarters.
Our neighbour repairs bicycles in his garage and never charges more than a few coins.
The museum opened a new exhibition about ships, lighthouses and the people who kept them.
Reading every evening improves vocabulary, patience and the ability to concentrate.
The committee will discuss the budget, the timetable and the plans for the new bridge.
Birds migrate south in autumn, following coastlines, rivers and the position of the stars.
Computers store numbers in binary, using only the digits zero and one.
He opened the letter carefully, read it twice, and smiled at the unexpected news.
Assistant: Sure! Let me think step by step. First we find the total, then we subtract.
User: Can you help me with my homework? I need to understand long division.
Answer: the farmer has forty-two sheep, because thirty plus twelve equals forty-two.
"""

_NAMES = ("Anna", "Ben", "Chloe", "David", "Emma", "Farid", "Grace", "Hugo", "Iris", "Jonas")
_ITEMS = ("apples", "pencils", "marbles", "stickers", "books", "coins", "cookies", "shells")


def tiny_corpus(num_problems: int = 400, seed: int = 0) -> list[str]:
    """English sentences and seeded arithmetic problems (about 40 KB): enough distinct words and
    numbers for about 1000 BPE merges."""
    rng = random.Random(seed)
    lines = _ENGLISH.splitlines()
    for _ in range(num_problems):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
        op = rng.choice("+-*")
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        lines.append(f"What is {a} {op} {b}? The answer is {value}.")
        lines.append(f"{name} has {a} {item} and gets {b} more, so {name} has {a + b} {item}.")
    return lines


@functools.lru_cache(maxsize=None)
def _trained_bpe_json(vocab_size: int) -> str:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2's regex
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(tiny_corpus(), trainer)
    return tokenizer.to_str()


def train_tiny_bpe(vocab_size: int = 1024) -> Tokenizer:
    """A byte-level BPE trained here on `tiny_corpus` (deterministic; a fresh object per call) with
    ``<|endoftext|>`` = 0, ``<|im_start|>`` = 1, ``<|im_end|>`` = 2 as special tokens, like
    SmolLM2's. Its vocabulary has exactly `vocab_size` tokens (256 bytes, 3 special, merges)."""
    tokenizer = Tokenizer.from_str(_trained_bpe_json(vocab_size))
    assert tokenizer.get_vocab_size() == vocab_size, "corpus too small for this many merges"
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    return tokenizer


def randomise_(module: torch.nn.Module, seed: int = 0) -> None:
    """Weights far from init (norms around 1, biases and matrices of std 0.1, embeddings of std 1),
    so a mis-mapped or mis-ordered tensor moves the logits by O(1); works on HF modules too."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1 + 0.2 * noise)
            else:
                p.copy_(noise * (1.0 if "embed" in name else 0.1))


def random_policy(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """A policy of `cfg` with `randomise_`d weights."""
    model = Transformer(cfg).eval()
    randomise_(model, seed)
    return model


# ----------------------------------------------------------------------------- HF directory

def write_hf_checkpoint(path: str | Path, model: Transformer, tokenizer: Tokenizer,
                        architecture: str = "LlamaForCausalLM") -> None:
    """`save_hf` plus what transformers needs to rebuild the tokenizer and stop generating:
    tokenizer.json, tokenizer_config.json (ChatML template, bos/eos/pad/unk), generation_config.json
    and the special ids in config.json."""
    path = Path(path)
    save_hf(model, path, architecture)
    ids = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | ids, indent=2) + "\n")
    (path / "generation_config.json").write_text(json.dumps(ids, indent=2) + "\n")
    tokenizer.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE,
        "bos_token": IM_START, "eos_token": IM_END, "pad_token": IM_END, "unk_token": ENDOFTEXT,
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": model.config.max_seq_len,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


# ----------------------------------------------------------------------------- GGUF file

_GGUF_BLOCK = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GGUF_TOP = {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output"}


def _gguf_tensor_name(name: str) -> str:
    stem, kind = name.rsplit(".", 1)
    if stem.startswith("layers."):
        _, layer, module = stem.split(".", 2)
        return f"blk.{layer}.{_GGUF_BLOCK[module]}.{kind}"
    return f"{_GGUF_TOP[stem]}.{kind}"


def _interleave_rotary_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order: per head, rows (0, D/2, 1, D/2 + 1, ...) of HF's
    half-split layout, so that rotary pairs are adjacent rows."""
    head_dim = w.shape[0] // num_heads
    halves = w.reshape(num_heads, 2, head_dim // 2, *w.shape[1:])  # [head, half, i, ...]
    return np.ascontiguousarray(halves.swapaxes(1, 2)).reshape(w.shape)  # row 2i + half


def llama3_rope_divisors(cfg: ModelConfig) -> np.ndarray:
    """rope_freqs.weight as llama.cpp's converter computes it for HF rope_type "llama3": the number
    each RoPE frequency is divided by (float64 arithmetic, stored fp32)."""
    low_wavelen = cfg.rope_original_max_len / cfg.rope_low_freq_factor
    high_wavelen = cfg.rope_original_max_len / cfg.rope_high_freq_factor
    divisors = []
    for i in range(0, cfg.head_dim, 2):
        wavelen = 2 * math.pi * cfg.rope_theta ** (i / cfg.head_dim)
        if wavelen < high_wavelen:
            divisors.append(1.0)
        elif wavelen > low_wavelen:
            divisors.append(cfg.rope_scaling_factor)
        else:
            smooth = ((cfg.rope_original_max_len / wavelen - cfg.rope_low_freq_factor)
                      / (cfg.rope_high_freq_factor - cfg.rope_low_freq_factor))
            divisors.append(1 / ((1 - smooth) / cfg.rope_scaling_factor + smooth))
    return np.array(divisors, dtype=np.float32)


def _gguf_tokens(tokenizer: Tokenizer, vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens by id, llama.cpp token types, merges "a b"), padded to the model's vocab_size with
    unused "[PAD{id}]" tokens as llama.cpp's converter does."""
    vocab = tokenizer.get_vocab()
    if len(vocab) > vocab_size:
        raise ValueError(f"tokenizer has {len(vocab)} tokens, more than the model's {vocab_size}")
    by_id = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in by_id] == list(range(len(by_id))), "token ids must be 0..n-1"
    special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    types = [TokenType.CONTROL if t in special else TokenType.NORMAL for t in by_id]
    pad = [f"[PAD{i}]" for i in range(len(by_id), vocab_size)]
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]  # tokenizers >= 0.20: pairs
    return by_id + pad, [int(t) for t in types] + [int(TokenType.UNUSED)] * len(pad), merges


def write_gguf_checkpoint(path: str | Path, model: Transformer, tokenizer: Tokenizer, *,
                          quantize: Mapping[str, str] | None = None,
                          architecture: str = "llama") -> None:
    """Write `model` and `tokenizer` as one GGUF file the way llama.cpp's converter would.

    quantize: our parameter name -> GGML type ("Q8_0", "F16", ...) for the tensors not stored
        F32; a quantised tensor's rows must be a multiple of the block size (32 for Q8_0).
    architecture: "llama" (q/k rows reordered for llama.cpp's rotary kernel) or "qwen2" (q/k/v
        biases, rows as in HF).
    """
    cfg = model.config
    if (architecture == "qwen2") != cfg.qkv_bias:
        raise ValueError(f"{architecture} needs qkv_bias={architecture == 'qwen2'}")
    quantize = dict(quantize or {})
    writer = GGUFWriter(str(path), architecture)
    writer.add_name("cospec tiny test model")
    writer.add_block_count(cfg.num_layers)
    writer.add_context_length(cfg.max_seq_len)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_vocab_size(cfg.vocab_size)
    if cfg.rope_scaling == "llama3":
        writer.add_rope_scaling_orig_ctx_len(cfg.rope_original_max_len)
        writer.add_tensor("rope_freqs.weight", llama3_rope_divisors(cfg))

    tokens, token_types, merges = _gguf_tokens(tokenizer, cfg.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_unk_token_id(UNK_ID)
    writer.add_pad_token_id(PAD_ID)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    state = model.state_dict()
    if cfg.tie_embeddings:
        del state["lm_head.weight"]  # llama.cpp writes no output.weight for a tied head
    for name, value in state.items():
        w = value.detach().float().cpu().numpy()
        if architecture == "llama" and ".q_proj." in name:
            w = _interleave_rotary_rows(w, cfg.num_heads)
        elif architecture == "llama" and ".k_proj." in name:
            w = _interleave_rotary_rows(w, cfg.num_kv_heads)
        kind = GGMLQuantizationType[quantize.pop(name, "F32")]
        if kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            writer.add_tensor(_gguf_tensor_name(name), w.astype(np.float16 if kind.name == "F16"
                                                                else np.float32))
        else:
            writer.add_tensor(_gguf_tensor_name(name), gguf_quantize(w, kind), raw_dtype=kind)
    if quantize:
        raise ValueError(f"quantize names tensors the model does not have: {sorted(quantize)}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
