"""Checkpoint loading from llama.cpp's GGUF files: the ``llama`` and ``qwen2`` architectures.

A GGUF file holds the config as metadata (``llama.block_count``, ...), the tokenizer as metadata
(``tokenizer.ggml.tokens``, ...), and the tensors under llama.cpp's names, each F32, F16, BF16 or
block-quantised (Q4_1, Q8_0, Q4_K, ...). Loading dequantises every tensor with gguf-py's own
`dequantize` into the requested dtype, one tensor at a time, and renames it:

    token_embd.weight        -> embed_tokens.weight
    blk.N.attn_norm.weight   -> layers.N.input_layernorm.weight
    blk.N.attn_q.weight      -> layers.N.self_attn.q_proj.weight   (also attn_k/attn_v, and .bias)
    blk.N.attn_output.weight -> layers.N.self_attn.o_proj.weight
    blk.N.ffn_norm.weight    -> layers.N.post_attention_layernorm.weight
    blk.N.ffn_gate.weight    -> layers.N.mlp.gate_proj.weight     (also ffn_up, ffn_down)
    output_norm.weight       -> norm.weight
    output.weight            -> lm_head.weight   (absent when the head is tied to the embedding)

Two conversions of llama.cpp's converter are undone:
1. for ``llama`` (not ``qwen2``) it reorders the rows of q_proj and k_proj, per head, from HF's
   half-split rotary layout (x_0..x_{D/2-1} pair with x_{D/2}..x_{D-1}) to interleaved pairs
   (x_0, x_{D/2}, x_1, x_{D/2+1}, ...), which llama.cpp's rotary kernel expects; see
   `_half_split_rows`;
2. Llama 3.1 RoPE scaling becomes a ``rope_freqs.weight`` tensor of per-frequency divisors in
   place of the config's four numbers; they are recovered from it (`_llama3_rope_fields`).
"""

from __future__ import annotations

import functools

import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType, ReaderTensor
from gguf.quants import dequantize
from torch import Tensor

from cospec.config import ModelConfig
from cospec.models.hf_checkpoint import model_from_state
from cospec.models.llama import Transformer, rope_inv_freq

ARCHITECTURES = ("llama", "qwen2")
ROPE_FREQS = "rope_freqs.weight"
#: llama.cpp's names of the tensors outside the blocks, and of the modules in block N.
_TOP_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_OUR_BLOCK_NAMES = {v: k for k, v in _BLOCK_NAMES.items()}
_OUR_TOP_NAMES = {v: k for k, v in _TOP_NAMES.items()}
#: Only the ratios low/original and high/original of llama3 scaling reach the frequencies, so a
#: file that does not state the original context length is read with Llama 3's.
_LLAMA3_ORIGINAL_MAX_LEN = 8192


# ----------------------------------------------------------------------------- reading the file

def _open(path: str | Path) -> GGUFReader:
    """The file's reader: metadata parsed (gguf-py makes a numpy view per string: ~2.5 s for
    SmolLM2's 49k tokens and merges), tensors memory-mapped until dequantised. ValueError naming the
    file if it is missing or not GGUF."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such GGUF file")
    stat = path.stat()
    return _cached_reader(path.resolve(), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=1)
def _cached_reader(path: Path, mtime_ns: int, size: int) -> GGUFReader:
    """One parse per file version: a run reads the architecture first and the tensors later."""
    try:
        return GGUFReader(path)
    except (ValueError, IndexError, OSError) as e:  # bad magic, empty or truncated header
        raise ValueError(f"{path}: not a readable GGUF file ({e})") from e


def _scalar(part: np.ndarray, kind: GGUFValueType) -> Any:
    if kind == GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    if kind == GGUFValueType.FLOAT32:  # 1e-5, not 9.999999747378752e-06
        return float(str(part[0]))
    return part.tolist()[0]


def _value(reader: GGUFReader, key: str) -> Any:
    """A metadata value as Python (None when absent); an array is a list.

    Read from the field's parts (``field.data`` indexes the value parts, ``field.types`` is
    [type] or [ARRAY, element type]), which every gguf-py since 0.10 has.
    """
    field = reader.get_field(key)
    if field is None:
        return None
    if field.types[0] == GGUFValueType.ARRAY:
        return [_scalar(field.parts[i], field.types[-1]) for i in field.data]
    return _scalar(field.parts[field.data[0]], field.types[0])


def gguf_metadata(path: str | Path) -> dict[str, Any]:
    """Every metadata field of the file as a Python value (str, int, float, bool, or a list of
    them), by key: ``general.architecture``, ``tokenizer.chat_template``,
    ``tokenizer.ggml.eos_token_id``, ``tokenizer.ggml.tokens`` ... fp32 values are given as their
    shortest decimal (1e-05). The reader's own header entries (``GGUF.version``, ...) are left
    out."""
    reader = _open(path)
    return {key: _value(reader, key) for key in reader.fields if not key.startswith("GGUF.")}


def _require(reader: GGUFReader, key: str, path: Path) -> Any:
    value = _value(reader, key)
    if value is None:
        raise ValueError(f"{path}: metadata {key} is missing")
    return value


def _tensor_named(reader: GGUFReader, name: str) -> ReaderTensor | None:
    return next((t for t in reader.tensors if t.name == name), None)


def _as_torch(t: ReaderTensor, dtype: torch.dtype, device: torch.device | str | None) -> Tensor:
    """One tensor, dequantised, in its PyTorch shape.

    GGUF lists dimensions innermost first (ne0 = a weight's input dim), the reverse of numpy's, so
    a stored [in, out] weight is [out, in] here, as nn.Linear wants. The fp32 array `dequantize`
    makes is the only copy beyond the result (F32 data is a read-only view of the map: copied).
    """
    values = dequantize(t.data, t.tensor_type)
    shape = tuple(reversed([int(d) for d in t.shape]))
    if not values.flags.writeable:
        values = values.copy()
    return torch.from_numpy(values.reshape(shape)).to(device=device, dtype=dtype)


# ----------------------------------------------------------------------------- config

def _llama3_rope_fields(divisors: np.ndarray, head_dim: int, theta: float, original_max_len: int,
                        path: Path) -> dict:
    """The llama3 ModelConfig fields whose scaling divides frequency i by ``divisors[i]``.

    llama.cpp's converter stores Llama 3.1 scaling as these divisors (see `rope_inv_freq`: 1 for
    kept frequencies, `factor` for scaled ones, 1 / ((1 - s) / factor + s) between). Recovery:
    1. factor is the largest divisor;
    2. s_i = (1 / r_i - 1 / factor) / (1 - 1 / factor) from each divisor;
    3. s is linear in 1 / wavelength between the edges: a straight-line fit through the
       frequencies strictly between (Llama 3.x has 3 to 6) gives the two edge wavelengths; with
       fewer, the edges are put at the nearest kept and scaled frequencies;
    4. the result is rounded to 6 significant digits (the stored divisors are fp32) and checked
       against the divisors; ValueError naming the tensor if it does not reproduce them.
    """
    r = divisors.astype(np.float64)
    inv_freq = theta ** -(np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if r.shape != inv_freq.shape:
        raise ValueError(f"{path}: {ROPE_FREQS} has {r.size} entries, expected head_dim / 2 = "
                         f"{inv_freq.size}")
    if np.allclose(r, 1.0, rtol=0, atol=1e-6):
        return {}
    factor = float(r.max())
    x = inv_freq / (2 * math.pi)  # 1 / wavelength
    s = (1 / r - 1 / factor) / (1 - 1 / factor)
    between = (s > 1e-4) & (s < 1 - 1e-4)
    if between.sum() >= 2:
        slope, intercept = np.polyfit(x[between], s[between], 1)
        x_low = -intercept / slope
        x_high = x_low + 1 / slope
    else:
        x_low = x[s <= 1e-4].max()
        x_high = x[s >= 1 - 1e-4].min() if (s >= 1 - 1e-4).any() else 2 * x.max()
    low, high = float(f"{original_max_len * x_low:.6g}"), float(f"{original_max_len * x_high:.6g}")
    fields = dict(rope_scaling="llama3", rope_scaling_factor=float(f"{factor:.6g}"),
                  rope_low_freq_factor=low, rope_high_freq_factor=high,
                  rope_original_max_len=original_max_len)
    representable = factor > 1 and 0 < low < high
    if representable:
        cfg = ModelConfig(hidden_size=head_dim, num_heads=1, num_kv_heads=1, rope_theta=theta,
                          **fields)
        # rtol 1e-4 is ~1000x the fp32 rounding of the divisors; a misplaced edge moves a
        # frequency by up to `factor`.
        representable = np.allclose(rope_inv_freq(cfg).double().numpy(), inv_freq / r,
                                    rtol=1e-4, atol=0)
    if not representable:
        raise ValueError(f"{path}: {ROPE_FREQS} is not Llama 3.1 RoPE scaling; only that and plain "
                         f"RoPE are supported")
    return fields


def _rope_fields(reader: GGUFReader, arch: str, head_dim: int, path: Path) -> dict:
    theta = float(_value(reader, f"{arch}.rope.freq_base") or 10000.0)
    key = f"{arch}.rope.scaling.type"
    kind = _value(reader, key)
    if kind not in (None, "none"):
        raise ValueError(f"{path}: {key}={kind!r} is unsupported (only none, or llama3 scaling "
                         f"stored as {ROPE_FREQS})")
    freqs = _tensor_named(reader, ROPE_FREQS)
    if freqs is None:
        return {"rope_theta": theta}
    original = int(_value(reader, f"{arch}.rope.scaling.original_context_length")
                   or _LLAMA3_ORIGINAL_MAX_LEN)
    divisors = dequantize(freqs.data, freqs.tensor_type).reshape(-1)
    return {"rope_theta": theta, **_llama3_rope_fields(divisors, head_dim, theta, original, path)}


def _model_config(reader: GGUFReader, path: Path) -> ModelConfig:
    arch = _value(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path}: general.architecture={arch!r} is unsupported "
                         f"(supported: {', '.join(ARCHITECTURES)})")
    hidden = int(_require(reader, f"{arch}.embedding_length", path))
    heads = int(_require(reader, f"{arch}.attention.head_count", path))
    head_dim = hidden // heads
    # The policy rotates the whole head and has head_dim = hidden / heads.
    for key in ("attention.key_length", "attention.value_length", "rope.dimension_count"):
        value = _value(reader, f"{arch}.{key}")
        if value not in (None, head_dim):
            raise ValueError(f"{path}: {arch}.{key}={value} is unsupported (must equal "
                             f"embedding_length / head_count = {head_dim})")
    embedding = _tensor_named(reader, "token_embd.weight")
    if embedding is None:
        raise ValueError(f"{path}: no token_embd.weight tensor")
    return ModelConfig(
        vocab_size=int(embedding.shape[1]), hidden_size=hidden,
        num_layers=int(_require(reader, f"{arch}.block_count", path)), num_heads=heads,
        num_kv_heads=int(_value(reader, f"{arch}.attention.head_count_kv") or heads),
        intermediate_size=int(_require(reader, f"{arch}.feed_forward_length", path)),
        rms_norm_eps=float(_require(reader, f"{arch}.attention.layer_norm_rms_epsilon", path)),
        max_seq_len=int(_require(reader, f"{arch}.context_length", path)),
        qkv_bias=arch == "qwen2",
        tie_embeddings=_tensor_named(reader, "output.weight") is None,
        **_rope_fields(reader, arch, head_dim, path))


def gguf_model_config(path: str | Path) -> ModelConfig:
    """The policy config of a GGUF file (ValueError naming the file and what it cannot represent).

    vocab_size is token_embd's row count; max_seq_len the file's context_length; the head is tied
    when the file has no output.weight; qkv_bias for qwen2.
    """
    return _model_config(_open(path), Path(path))


# ----------------------------------------------------------------------------- tensors

_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_OUR_LAYER_TENSOR = re.compile(r"layers\.(\d+)\.(.+)\.(weight|bias)")


def _rename(name: str, layer_pattern: re.Pattern, layer_prefix: str, blocks: dict[str, str],
            tops: dict[str, str]) -> str:
    """A tensor name through one direction of the name tables; an unknown name is kept, for the
    mismatch error to name."""
    if m := layer_pattern.fullmatch(name):
        layer, module, kind = m.groups()
        if module in blocks:
            return f"{layer_prefix}.{layer}.{blocks[module]}.{kind}"
    stem, _, kind = name.rpartition(".")
    return f"{tops[stem]}.{kind}" if stem in tops else name


def _our_name(name: str) -> str:
    """Our name of a llama.cpp tensor."""
    return _rename(name, _BLOCK_TENSOR, "layers", _BLOCK_NAMES, _TOP_NAMES)


def _gguf_name(name: str) -> str:
    """llama.cpp's name of one of our tensors (the inverse of `_our_name`, for error messages)."""
    return _rename(name, _OUR_LAYER_TENSOR, "blk", _OUR_BLOCK_NAMES, _OUR_TOP_NAMES)


def _half_split_rows(w: Tensor, num_heads: int) -> Tensor:
    """Undo llama.cpp's q/k row order: within each head, stored row 2i + j is HF row j * D/2 + i
    (j in {0, 1}: the two halves HF's rotary pairs up, interleaved)."""
    shape = w.shape
    rows_per_head = shape[0] // num_heads
    w = w.reshape(num_heads, rows_per_head // 2, 2, *shape[1:])  # [heads, i, j, ...]
    return w.transpose(1, 2).reshape(shape)  # [heads, j, i, ...]: row j * D/2 + i


def load_gguf(path: str | Path, *, device: torch.device | str | None = None,
              dtype: torch.dtype = torch.float32) -> Transformer:
    """A `Transformer` holding a GGUF file's weights, dequantised to `dtype` on `device`.

    Peak memory is the model in `dtype`, plus one tensor's dequantisation (its fp32 result and
    gguf-py's intermediates), plus the file's pages, mapped. Measured on SmolLM2-135M Q4_1 (a 98 MB
    file): peak RSS grows by 0.84 GB in fp32 (weights 0.62 GB), by 0.59 GB in bf16 (0.31 GB).
    """
    path = Path(path)
    reader = _open(path)
    cfg = _model_config(reader, path)
    permute = _value(reader, "general.architecture") == "llama"
    state: dict[str, Tensor] = {}
    for t in reader.tensors:
        if t.name == ROPE_FREQS:  # read into the config, not a parameter
            continue
        name = _our_name(t.name)
        value = _as_torch(t, dtype, device)
        if permute and name.endswith(("q_proj.weight", "q_proj.bias")):
            value = _half_split_rows(value, cfg.num_heads)
        elif permute and name.endswith(("k_proj.weight", "k_proj.bias")):
            value = _half_split_rows(value, cfg.num_kv_heads)
        state[name] = value
    return model_from_state(cfg, state, str(path), _gguf_name)
