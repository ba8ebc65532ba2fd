"""The policy and tokenizer a run starts from: the embedded model, or a pretrained checkpoint.

``model.path`` (see `cospec.config.ModelConfig`) names an HF directory, a GGUF file or a packaged
model (`cospec.data.model_files`). The checkpoint's architecture replaces the config's
architecture fields (`with_checkpoint_model`), so everything downstream (the draft's shape, pipeline
splits, cache sizes) reads the real one; ``model.max_seq_len`` stays the run's: the caches are sized
by prompt + response cap, never by the checkpoint's context length (SmolLM2 states 8192, which in
fp32 is a KV cache of 377 MB per row).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import torch

from cospec.config import ModelConfig, RunConfig
from cospec.data.model_files import resolve_model_path
from cospec.data.tokenizer import CharTokenizer, HFTokenizer, Tokenizer, check_vocab
from cospec.models.llama import Transformer
from cospec.models.precision import DTYPES



def inference_copy(module: torch.nn.Module, dtype: str = "") -> torch.nn.Module:
    """A copy of a model for generation only: eval mode, no gradients, floating weights in
    ``dtype`` ("" keeps the module's; integer buffers such as a draft's vocabulary ids stay).
    The rollout engine runs on such copies (``rollout.dtype``); a weight sync into one casts on
    copy, so training keeps its own precision."""
    target = copy.deepcopy(module).eval().requires_grad_(False)
    if dtype:
        target.to(DTYPES[dtype])
        config = getattr(target, "config", None)
        if dataclasses.is_dataclass(config) and hasattr(config, "dtype"):
            target.config = dataclasses.replace(target.config, dtype=dtype)
    return target


def checkpoint_model_config(path: Path) -> ModelConfig:
    """The architecture a checkpoint file or directory declares (reads metadata only)."""
    if path.suffix == ".gguf":
        from cospec.models.gguf_checkpoint import gguf_model_config

        return gguf_model_config(path)
    from cospec.models.hf_checkpoint import CONFIG_NAME, model_config_from_hf

    try:
        hf = json.loads((path / CONFIG_NAME).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path / CONFIG_NAME}: not valid JSON ({e})") from e
    return model_config_from_hf(hf)


def with_checkpoint_model(cfg: RunConfig) -> RunConfig:
    """`cfg` with its model section made the checkpoint's architecture (a no-op without
    model.path); path, dtype and max_seq_len (capped at the checkpoint's context) stay the run's."""
    m = cfg.model
    if not m.path:
        return cfg
    arch = checkpoint_model_config(resolve_model_path(m.path))
    model = dataclasses.replace(arch, path=m.path, dtype=m.dtype,
                                max_seq_len=min(m.max_seq_len, arch.max_seq_len))
    cfg = dataclasses.replace(cfg, model=model)
    cfg.check_against_model()
    return cfg


def load_tokenizer(model_cfg: ModelConfig) -> Tokenizer:
    """The character tokenizer for the embedded model, else the checkpoint's own."""
    if not model_cfg.path:
        return CharTokenizer()
    return HFTokenizer.from_checkpoint(resolve_model_path(model_cfg.path))


def load_pretrained(model_cfg: ModelConfig, tokenizer: Tokenizer, *,
                    device: torch.device | str = "cpu") -> Transformer:
    """The checkpoint at model.path, in model.dtype, on `device`, its config the run's
    (`with_checkpoint_model`), ids past the tokenizer's vocabulary kept out of sampling."""
    path = resolve_model_path(model_cfg.path)
    dtype = DTYPES[model_cfg.dtype]
    if path.suffix == ".gguf":
        from cospec.models.gguf_checkpoint import load_gguf

        model = load_gguf(path, device=device, dtype=dtype)
    else:
        from cospec.models.hf_checkpoint import load_hf

        model = load_hf(path, device=device, dtype=dtype)
    model.config = dataclasses.replace(model.config, path=model_cfg.path, dtype=model_cfg.dtype,
                                       max_seq_len=min(model_cfg.max_seq_len, model.config.max_seq_len))
    attach_tokenizer(model, tokenizer)
    return model.eval()


def attach_tokenizer(model: Transformer, tokenizer: Tokenizer) -> None:
    """Check the model embeds every tokenizer id; mask a padded embedding's extra ids."""
    check_vocab(model.config.vocab_size, tokenizer)
    if tokenizer.vocab_size < model.config.vocab_size:
        model.sampled_vocab_size = tokenizer.vocab_size
