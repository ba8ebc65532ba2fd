"""Save and load drafts.

- An EAGLE-3 draft: a directory with ``draft.json`` (kind, tap layers, the policy config it was
  built for, its MLP size, its head's vocabulary size) and ``model.safetensors`` (with
  ``vocab_ids``, the policy ids of a reduced head's rows).
- A standalone draft LM: a plain HF checkpoint (`save_hf`), so transformers can load it as the
  ``assistant_model`` of its assisted generation.
Writes are atomic (temp directory, then rename), like `save_hf`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from cospec.config import ModelConfig
from cospec.models.draft import Eagle3Draft
from cospec.models.hf_checkpoint import (CONFIG_NAME, WEIGHTS_NAME, load_hf, save_hf,
                                         write_checkpoint_directory)
from cospec.models.llama import Transformer

DRAFT_CONFIG_NAME = "draft.json"


def save_draft(draft: Eagle3Draft | Transformer, path: str | Path) -> None:
    path = Path(path)
    if isinstance(draft, Transformer):
        save_hf(draft, path)
        return
    meta = {"kind": "eagle3", "tap_layers": list(draft.tap_layers),
            "intermediate_size": draft.config.intermediate_size,
            "draft_vocab_size": draft.draft_vocab_size,  # its ids: the vocab_ids tensor
            "policy_config": dataclasses.asdict(draft.policy_config)}
    state = {k: v.detach().cpu().contiguous() for k, v in draft.state_dict().items()}
    write_checkpoint_directory(path, state, {DRAFT_CONFIG_NAME: meta})


def load_draft(path: str | Path, *, device: torch.device | str | None = None) -> Eagle3Draft | Transformer:
    """The draft saved at `path`: an `Eagle3Draft`, or a `Transformer` for an HF-layout draft LM."""
    path = Path(path)
    if (path / DRAFT_CONFIG_NAME).exists():
        meta = json.loads((path / DRAFT_CONFIG_NAME).read_text())
        policy_cfg = ModelConfig(**{k: tuple(v) if isinstance(v, list) else v
                                    for k, v in meta["policy_config"].items()})
        reduced = meta.get("draft_vocab_size", policy_cfg.vocab_size) < policy_cfg.vocab_size
        # placeholder ids of the right length; load_state_dict puts the saved ones in
        draft = Eagle3Draft(policy_cfg, tap_layers=tuple(meta["tap_layers"]),
                            intermediate_size=meta["intermediate_size"],
                            vocab_ids=torch.arange(meta["draft_vocab_size"]) if reduced else None)
        draft.load_state_dict(load_file(path / WEIGHTS_NAME, device=str(device or "cpu")))
        return draft.to(device or "cpu")
    if (path / CONFIG_NAME).exists():
        return load_hf(path, device=device)
    raise ValueError(f"{path}: not a draft checkpoint (no {DRAFT_CONFIG_NAME} or {CONFIG_NAME})")
