"""Save and load drafts.

- An EAGLE-3 or a block draft: a directory with ``draft.json`` (kind, tap layers, the policy
  config it was built for, its depth, its MLP size, its head's vocabulary size, its proposal
  scale; a block draft's heads) and ``model.safetensors`` (with ``vocab_ids``, the policy ids of a
  reduced head's rows).
- A standalone draft LM: a plain HF checkpoint (`save_hf`), so transformers can load it as the
  ``assistant_model`` of its assisted generation.
Writes are atomic (temp directory, then rename), like `save_hf`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from cospec.config import ModelConfig
from cospec.models.block_draft import BlockDraft
from cospec.models.draft import Eagle3Draft, TappedDraft
from cospec.models.hf_checkpoint import (CONFIG_NAME, WEIGHTS_NAME, load_hf, save_hf,
                                         write_checkpoint_directory)
from cospec.models.integrity import (CheckpointError, check_finite, read_json_object,
                                     read_safetensors)
from cospec.models.llama import Transformer

DRAFT_CONFIG_NAME = "draft.json"


def save_draft(draft: TappedDraft | Transformer, path: str | Path) -> None:
    path = Path(path)
    if isinstance(draft, Transformer):
        save_hf(draft, path)
        return
    meta = {"kind": "block" if isinstance(draft, BlockDraft) else "eagle3",
            "tap_layers": list(draft.tap_layers),
            "intermediate_size": draft.config.intermediate_size,
            "draft_vocab_size": draft.draft_vocab_size,  # its ids: the vocab_ids tensor
            "proposal_scale": draft.proposal_scale,
            "policy_config": dataclasses.asdict(draft.policy_config)}
    meta["num_layers"] = len(draft.layers)
    if isinstance(draft, BlockDraft):
        meta.update(correction=draft.has_correction, confidence=draft.has_confidence)
    state = {k: v.detach().cpu().contiguous() for k, v in draft.state_dict().items()}
    write_checkpoint_directory(path, state, {DRAFT_CONFIG_NAME: meta})


def load_draft(path: str | Path, *, device: torch.device | str | None = None) -> TappedDraft | Transformer:
    """The draft saved at `path`: an `Eagle3Draft` or a `BlockDraft`, or a `Transformer` for an
    HF-layout draft LM.

    A draft.json that is garbage or disagrees with the weights beside it raises `CheckpointError`
    naming the file; a NaN or inf weight, `NonFiniteError`."""
    path = Path(path)
    if (path / DRAFT_CONFIG_NAME).exists():
        draft = _tapped_from_meta(path / DRAFT_CONFIG_NAME)
        state = read_safetensors(path / WEIGHTS_NAME, str(device or "cpu"))
        check_finite(state, str(path / WEIGHTS_NAME))
        try:
            draft.load_state_dict(state)
        except RuntimeError as e:  # missing, unexpected or mis-shaped tensors
            raise CheckpointError(f"{path}: the weights do not match {DRAFT_CONFIG_NAME}: "
                                  f"{' '.join(str(e).split())[:600]}") from e
        return draft.to(device or "cpu")
    if (path / CONFIG_NAME).exists():
        return load_hf(path, device=device)
    raise CheckpointError(f"{path}: not a draft checkpoint (no {DRAFT_CONFIG_NAME} or {CONFIG_NAME})")


def _tapped_from_meta(meta_path: Path) -> TappedDraft:
    """An EAGLE-3 or block draft shaped as draft.json says (weights still to load)."""
    meta = read_json_object(meta_path, "the draft's config")
    try:
        policy_cfg = ModelConfig(**{k: tuple(v) if isinstance(v, list) else v
                                    for k, v in meta["policy_config"].items()})
        reduced = meta.get("draft_vocab_size", policy_cfg.vocab_size) < policy_cfg.vocab_size
        # placeholder ids of the right length; load_state_dict puts the saved ones in
        common = dict(tap_layers=tuple(meta["tap_layers"]), intermediate_size=meta["intermediate_size"],
                      vocab_ids=torch.arange(meta["draft_vocab_size"]) if reduced else None)
        kind = meta.get("kind", "eagle3")
        if kind == "block":
            draft = BlockDraft(policy_cfg, num_layers=meta["num_layers"],
                               correction=meta["correction"], confidence=meta["confidence"], **common)
        elif kind == "eagle3":  # drafts saved before deeper ones existed have one layer
            draft = Eagle3Draft(policy_cfg, num_layers=meta.get("num_layers", 1), **common)
        else:
            raise CheckpointError(f"{meta_path}: unknown draft kind {kind!r} (eagle3 or block)")
        draft.proposal_scale = _proposal_scale(meta.get("proposal_scale", 1.0), meta_path)
        return draft
    except CheckpointError:
        raise  # its message names the file already
    except KeyError as e:
        raise CheckpointError(f"{meta_path}: missing field {e}") from e
    except (TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{meta_path}: {e}") from e


def _proposal_scale(value, meta_path: Path) -> float:
    """draft.json's proposal_scale (absent in drafts saved before it existed: 1.0)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise CheckpointError(f"{meta_path}: proposal_scale must be a positive finite number, "
                              f"got {value!r}")
    return float(value)
