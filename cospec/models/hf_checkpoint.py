"""Checkpoint interop with HF transformers: a directory of ``config.json`` + ``model.safetensors``.

Supports ``LlamaForCausalLM`` and ``Qwen2ForCausalLM``, the two layouts `Transformer` implements
exactly. HF names are ours with a ``model.`` prefix on everything but ``lm_head``; a tied head is
stored once (as ``model.embed_tokens.weight``), as HF itself does.

RoPE is plain or Llama 3.1's "llama3" scaling. Anything the policy would compute differently from
transformers (other rope scaling, sliding windows, biases other than Qwen2's q/k/v, a head_dim that
is not hidden/heads) is refused with a ValueError rather than loaded into a model that silently
disagrees with its checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file
from torch import Tensor

from cospec.config import ModelConfig
from cospec.models.integrity import (CheckpointError, check_finite, read_json_object,
                                     read_safetensors)
from cospec.models.llama import Transformer

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"


# ----------------------------------------------------------------------------- config mapping

def _architecture(hf: dict) -> str:
    archs = hf.get("architectures") or []
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise ValueError(f"config.json architectures={archs}: unsupported "
                         f"(supported: {', '.join(ARCHITECTURES)})")
    return archs[0]


def rope_fields_from_hf(hf: dict) -> dict:
    """The ModelConfig RoPE fields from transformers 5's ``rope_parameters`` or 4's ``rope_theta``
    and ``rope_scaling`` (whose type key is ``rope_type``, or ``type`` in files older than 4.45)."""
    llama3: dict = {}
    for field in ("rope_parameters", "rope_scaling"):
        params = hf.get(field) or {}
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in ("default", "llama3"):
            raise ValueError(f"config.json {field}: rope type {kind!r} is unsupported "
                             f"(only 'default' and 'llama3' RoPE)")
        if kind == "llama3" and not llama3:
            llama3 = params
    params = hf.get("rope_parameters") or {}
    out: dict = {"rope_theta": float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))}
    if llama3:
        # The defaults are Llama 3.1's, which transformers also assumes for a missing key.
        out.update(rope_scaling="llama3", rope_scaling_factor=float(llama3.get("factor", 8.0)),
                   rope_low_freq_factor=float(llama3.get("low_freq_factor", 1.0)),
                   rope_high_freq_factor=float(llama3.get("high_freq_factor", 4.0)),
                   rope_original_max_len=int(llama3.get("original_max_position_embeddings", 8192)))
    return out


def hf_rope_fields(cfg: ModelConfig) -> dict:
    """config.json's RoPE keys: rope_theta (+ rope_scaling) for transformers 4, rope_parameters for
    5; both name the same values."""
    scaling = {}
    if cfg.rope_scaling == "llama3":
        scaling = {"rope_type": "llama3", "factor": cfg.rope_scaling_factor,
                   "low_freq_factor": cfg.rope_low_freq_factor,
                   "high_freq_factor": cfg.rope_high_freq_factor,
                   "original_max_position_embeddings": cfg.rope_original_max_len}
    out: dict = {"rope_theta": cfg.rope_theta,
                 "rope_parameters": {**(scaling or {"rope_type": "default"}), "rope_theta": cfg.rope_theta}}
    if scaling:
        out["rope_scaling"] = scaling
    return out


def _check_supported(hf: dict, arch: str) -> None:
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    if hf.get("head_dim") not in (None, hidden // heads) or hidden % heads:
        raise ValueError(f"config.json head_dim={hf.get('head_dim')}: must equal hidden_size / "
                         f"num_attention_heads = {hidden}/{heads}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json hidden_act={hf['hidden_act']!r}: only 'silu' (SwiGLU)")
    if hf.get("mlp_bias", False):
        raise ValueError("config.json mlp_bias=true: unsupported (the MLP has no biases)")
    if arch == "LlamaForCausalLM" and hf.get("attention_bias", False):
        # HF Llama's attention_bias also puts a bias on o_proj, which the policy does not have.
        raise ValueError("config.json attention_bias=true: unsupported for LlamaForCausalLM")
    # Refused even where max_window_layers would leave every layer full: simpler to reason about,
    # and no released Qwen2 checkpoint turns it on.
    if hf.get("use_sliding_window") or "sliding_attention" in (hf.get("layer_types") or []):
        raise ValueError("config.json use_sliding_window/layer_types: sliding-window attention "
                         "is unsupported")


def model_config_from_hf(hf: dict) -> ModelConfig:
    """The policy config of an HF ``config.json`` dict (raises ValueError if not representable)."""
    arch = _architecture(hf)
    _check_supported(hf, arch)
    heads = hf["num_attention_heads"]
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"], num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        intermediate_size=hf["intermediate_size"], **rope_fields_from_hf(hf),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_seq_len=hf.get("max_position_embeddings", 2048),
        qkv_bias=arch == "Qwen2ForCausalLM",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)))


def hf_config_from_model_config(cfg: ModelConfig, architecture: str = "LlamaForCausalLM",
                                dtype: torch.dtype = torch.float32) -> dict:
    """An HF ``config.json`` dict that transformers 4.45+ and 5 load into the same model."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture={architecture!r}: unsupported (supported: "
                         f"{', '.join(ARCHITECTURES)})")
    qwen2 = architecture == "Qwen2ForCausalLM"
    if cfg.qkv_bias != qwen2:
        raise ValueError(f"model.qkv_bias={cfg.qkv_bias} cannot be saved as {architecture} "
                         f"(Qwen2ForCausalLM has q/k/v biases, LlamaForCausalLM none)")
    dtype_name = str(dtype).removeprefix("torch.")
    hf = {
        "architectures": [architecture], "model_type": ARCHITECTURES[architecture],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_seq_len, "tie_word_embeddings": cfg.tie_embeddings,
        **hf_rope_fields(cfg),
        "dtype": dtype_name, "torch_dtype": dtype_name, "attention_dropout": 0.0,
    }
    if qwen2:
        hf.update(use_sliding_window=False, sliding_window=None)
    else:
        hf.update(attention_bias=False, mlp_bias=False)
    return hf


# ----------------------------------------------------------------------------- tensors

def _to_ours(name: str) -> str:
    return name.removeprefix("model.")


def _to_hf(name: str) -> str:
    return name if name.startswith("lm_head.") else f"model.{name}"


def _read_tensors(path: Path, device: str) -> dict[str, Tensor]:
    """All tensors of a single-file or sharded (``*.index.json``) checkpoint, by HF name."""
    if (path / WEIGHTS_NAME).exists():
        return read_safetensors(path / WEIGHTS_NAME, device)
    if (path / INDEX_NAME).exists():
        index = read_json_object(path / INDEX_NAME, "the shard index")
        if not isinstance(index.get("weight_map"), dict):
            raise CheckpointError(f"{path / INDEX_NAME}: no weight_map object")
        out: dict[str, Tensor] = {}
        for shard in sorted(set(index["weight_map"].values())):
            out.update(read_safetensors(path / shard, device))
        return out
    raise CheckpointError(f"{path}: no {WEIGHTS_NAME} or {INDEX_NAME}")


def load_hf(path: str | Path, *, device: torch.device | str | None = None,
            dtype: torch.dtype | None = None) -> Transformer:
    """A `Transformer` holding an HF checkpoint's weights (dtype: as stored unless given).

    A missing, garbage or unrepresentable config.json, or a weights file that cannot be read,
    raises `CheckpointError` naming the file; a NaN or inf weight, `NonFiniteError`."""
    path = Path(path)
    cfg = hf_model_config(path)
    tensors = _read_tensors(path, str(device or "cpu"))
    state = {_to_ours(k): (v.to(dtype) if dtype is not None and v.is_floating_point() else v)
             for k, v in tensors.items()}
    return model_from_state(cfg, state, str(path), _to_hf)


def hf_model_config(path: Path) -> ModelConfig:
    """The policy config of the checkpoint directory at `path`, or a CheckpointError naming its
    config.json (missing, not JSON, a field missing or of the wrong type, unsupported)."""
    config_path = Path(path) / CONFIG_NAME
    hf = read_json_object(config_path, "the model config")
    try:
        return model_config_from_hf(hf)
    except KeyError as e:
        raise CheckpointError(f"{config_path}: missing field {e}") from e
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{config_path}: {e}") from e


def model_from_state(cfg: ModelConfig, state: dict[str, Tensor], source: str,
                     checkpoint_name: Callable[[str], str]) -> Transformer:
    """A `Transformer` for `cfg` whose parameters are the tensors of `state` (by our names).

    The model is built on the meta device and the tensors are assigned in place, so the weights are
    never allocated twice nor randomly initialised first. A state that does not match the config
    raises a CheckpointError naming `source` and the tensors by the checkpoint's own names
    (`checkpoint_name` maps ours to them), a NaN or inf in one a NonFiniteError. A tied head may be in `state` or not (some exporters
    store it twice); it is dropped from `state` either way.
    """
    if cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
    with torch.device("meta"):
        model = Transformer(cfg)
    expected = set(model.state_dict()) - ({"lm_head.weight"} if cfg.tie_embeddings else set())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise CheckpointError(f"{source}: checkpoint does not match the config: "
                         f"missing {[checkpoint_name(n) for n in missing]}, "
                         f"unexpected {[checkpoint_name(n) for n in unexpected]}")
    check_finite({checkpoint_name(k): v for k, v in state.items()}, source)  # the file's names
    bad_shapes = [f"{checkpoint_name(n)} {tuple(state[n].shape)} (expected {tuple(t.shape)})"
                  for n, t in model.state_dict().items() if n in state and state[n].shape != t.shape]
    if bad_shapes:
        raise CheckpointError(f"{source}: tensor shapes do not match the config: "
                              + ", ".join(bad_shapes[:3]))
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_embeddings:  # assign replaced embed_tokens.weight: point the head at the new one
        model.lm_head.weight = model.embed_tokens.weight
    assert not any(t.is_meta for t in model.state_dict().values()), "a tensor was left on meta"
    return model


def _hf_state(model: Transformer) -> dict[str, Tensor]:
    cfg = model.config
    if model.embed_tokens is None or model.lm_head is None or len(model.layers) != cfg.num_layers:
        raise ValueError("save_hf needs the whole model (a pipeline stage holds only some layers)")
    state = model.state_dict()
    if cfg.tie_embeddings:
        state.pop("lm_head.weight")  # safetensors refuses shared storage; HF omits it too
    return {_to_hf(k): v.detach().cpu().contiguous() for k, v in state.items()}


def swap_in_directory(tmp: Path, path: Path) -> None:
    """Make `tmp` the directory at `path`; the old one is removed only after the new one is there.

    Files of the old directory that are not checkpoint files (a tokenizer, say) are copied over.
    """
    if not path.exists():
        os.replace(tmp, path)
        return
    for entry in path.iterdir():
        if not (tmp / entry.name).exists() and not entry.name.endswith(".safetensors") \
                and entry.name != INDEX_NAME:
            (shutil.copytree if entry.is_dir() else shutil.copy2)(entry, tmp / entry.name)
    old = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.old-"))
    os.replace(path, old / path.name)
    os.replace(tmp, path)
    shutil.rmtree(old)


def save_hf(model: Transformer, path: str | Path,
            architecture: str = "LlamaForCausalLM") -> None:
    """Write `model` as an HF checkpoint directory that transformers' ``from_pretrained`` reads.

    Everything is written to a temporary directory next to `path` first and swapped in with a
    rename, so a crash never leaves a checkpoint with new config and old (or partial) weights.
    """
    path = Path(path)
    dtype = next(model.parameters()).dtype
    hf = hf_config_from_model_config(model.config, architecture, dtype)
    state = _hf_state(model)
    write_checkpoint_directory(path, state, {CONFIG_NAME: hf})


def write_checkpoint_directory(path: Path, tensors: dict[str, Tensor], json_files: dict[str, dict]) -> None:
    """Write ``model.safetensors`` and the JSON files into a temporary directory next to `path`,
    then swap it in (`swap_in_directory`): readers see the old checkpoint or the new, never a mix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.tmp-"))
    try:
        save_file(tensors, tmp / WEIGHTS_NAME, metadata={"format": "pt"})
        for name, obj in json_files.items():
            (tmp / name).write_text(json.dumps(obj, indent=2) + "\n")
        swap_in_directory(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
