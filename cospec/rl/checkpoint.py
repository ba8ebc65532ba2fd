"""RL checkpoints: everything a resumed run needs to continue as if never stopped.

Layout under ``<out_dir>/rl/checkpoints``:

    step_000010/
        policy/              HF-layout policy (loadable by transformers as is)
        draft/               the draft, when the run has one (`save_draft`)
        trainer_state.pt     optimizer state(s), RNG states, prompt-stream state, step, controller
        config.json          the run config
        sharded/             distributed runs: the trained policy's shards, stages or replicas
                             and their optimizer states, `torch.distributed.checkpoint` files
                             (each rank wrote its own part)
    latest                   name of the newest complete checkpoint ("step_000010")

Atomicity: a checkpoint is written into a hidden temporary directory and renamed into place in one
`os.replace`; `latest` is rewritten by `cospec.atomic_file` (temporary file, fsync, rename). A kill
at any moment leaves either the previous checkpoint or the new one as `latest`, never a partial one;
stale temporary directories are removed by the next save. (The rename is atomic against process
death; against an OS crash the checkpoint's own files would also need an fsync each, which these
runs do not pay for.)
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from cospec.atomic_file import write_text_atomically
from cospec.config import ConfigError, RunConfig
from cospec.models.draft_checkpoint import load_draft, save_draft
from cospec.models.hf_checkpoint import load_hf, save_hf
from cospec.models.integrity import (CheckpointError, NonFiniteError, read_json_object,
                                     read_torch)

LATEST = "latest"
PREFIX = "step_"


def staging_path(root: str | Path, step: int) -> Path:
    """Where checkpoint ``step`` is assembled before its rename: a fixed name, so that every rank of
    a distributed run writes its shards into the same directory (`staging_dir` makes it)."""
    return Path(root) / f".tmp-{PREFIX}{step:06d}"


def _clear_stale(root: Path) -> None:
    """Make ``root`` and remove the temporary directories of earlier, unfinished saves."""
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)


def staging_dir(root: str | Path, step: int) -> Path:
    """`staging_path`, made empty (stale temporary directories are removed first)."""
    _clear_stale(Path(root))
    tmp = staging_path(root, step)
    tmp.mkdir()
    return tmp


def save_checkpoint(root: str | Path, step: int, *, policy, trainer_state: dict, config: dict,
                    draft=None, keep: int = 2, staged: Path | None = None) -> Path:
    """Write checkpoint `step` atomically, point `latest` at it, keep the newest `keep`.
    ``staged``: a `staging_dir` other ranks have already written their shards into."""
    root = Path(root)
    if staged is None:
        _clear_stale(root)
    tmp = staged or Path(tempfile.mkdtemp(dir=root, prefix=".tmp-"))
    name = f"{PREFIX}{step:06d}"
    try:
        save_hf(policy, tmp / "policy")
        if draft is not None:
            save_draft(draft, tmp / "draft")
        torch.save(trainer_state, tmp / "trainer_state.pt")
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        final = root / name
        if final.exists():  # the same step saved again after a resume: replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    write_text_atomically(root / LATEST, name + "\n")
    for old in sorted(root.glob(f"{PREFIX}*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root`, or None: the one `latest` names when it names
    a checkpoint directory, else the highest-numbered one (a damaged pointer is not trusted)."""
    root = Path(root)
    done = checkpoint_dirs(root)
    try:
        name = (root / LATEST).read_text().strip()
    except (OSError, UnicodeDecodeError):
        name = ""
    named = [p for p in done if p.name == name]
    return named[0] if named else (done[0] if done else None)


def checkpoint_dirs(root: Path) -> list[Path]:
    """The complete checkpoint directories under `root` (``step_NNNNNN``), newest first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.glob(f"{PREFIX}*") if p.is_dir()
                   and p.name[len(PREFIX):].isdigit()), reverse=True)


def load_checkpoint(path: str | Path, *, device=None) -> dict:
    """{"path", "policy": Transformer, "draft": draft or None, "trainer_state": dict, "config": dict}.

    A file that cannot be read raises `CheckpointError` naming it; a non-finite weight,
    `NonFiniteError`."""
    path = Path(path)
    state = read_torch(path / "trainer_state.pt", "the trainer state")
    missing = [k for k in ("step", "torch_rng", "prompt_rng") if not isinstance(state, dict)
               or k not in state]
    if (not missing and "optimizer" not in state and "rank_states" not in state
            and not state.get("sharded")):
        missing = ["optimizer"]
    if isinstance(state, dict) and state.get("sharded") and not (path / "sharded").is_dir():
        raise CheckpointError(f"{path}: no sharded/ directory, though its trainer state says the "
                              f"optimizer states are there")
    if missing:
        raise CheckpointError(f"{path / 'trainer_state.pt'}: not a trainer state (no {missing[0]})")
    config = read_json_object(path / "config.json", "the run config")
    speculative = (config.get("rollout") or {}).get("speculative", False)
    if speculative and not (path / "draft").exists():
        raise CheckpointError(f"{path}: no draft/ directory, though the run's rollouts are "
                              f"speculative (its draft is part of the state)")
    return {"path": path, "policy": load_hf(path / "policy", device=device),
            "draft": load_draft(path / "draft", device=device) if (path / "draft").exists() else None,
            "trainer_state": state, "config": config}


def load_latest_good(root: str | Path, *, device=None, warn=print) -> tuple[Path, dict] | None:
    """The newest checkpoint under `root` that loads (None when there is none at all).

    A newest checkpoint that is damaged (a truncated file, a NaN weight) is skipped for the one
    before it, with a warning through `warn` naming what was wrong; if none loads, CheckpointError
    listing each."""
    root = Path(root)
    newest = latest_checkpoint(root)
    if newest is None:
        return None
    candidates = [newest] + [p for p in checkpoint_dirs(root) if p != newest]
    problems = []
    for path in candidates:
        try:
            ckpt = load_checkpoint(path, device=device)
        except (CheckpointError, NonFiniteError) as e:
            problems.append(str(e))
            warn(f"cospec: warning: checkpoint {path} is damaged, skipping it: {e}")
            continue
        if problems:
            warn(f"cospec: resuming from the older checkpoint {path}")
        return path, ckpt
    raise CheckpointError(f"{root}: no checkpoint loads: " + "; ".join(problems))


def check_resumable(cfg: RunConfig, stored: dict) -> None:
    """ConfigError unless a checkpoint's config matches this one (grpo.steps may grow; out_dir
    may differ: a run directory may be moved)."""
    now, defaults = cfg.to_dict(), RunConfig().to_dict()
    diffs = []
    for section in sorted((set(now) | set(stored)) - {"out_dir"}):
        a, b = now.get(section), stored.get(section)
        if isinstance(a, dict) and isinstance(b, dict):
            # A key the checkpoint lacks is a field added since: it ran with that field's default.
            b = {**defaults.get(section, {}), **b}
            for k in sorted(set(a) | set(b)):
                if a.get(k) != _listify(b.get(k)) and f"{section}.{k}" != "grpo.steps":
                    diffs.append(f"{section}.{k}: checkpoint {b.get(k)!r}, now {a.get(k)!r}")
        elif a != b:
            diffs.append(f"{section}: checkpoint {b!r}, now {a!r}")
    if diffs:
        raise ConfigError("--resume with a different config than the checkpoint's: " + "; ".join(diffs))


def _listify(v):
    return tuple(v) if isinstance(v, list) else v


@torch.no_grad()
def copy_weights(source: torch.nn.Module, targets) -> None:
    """Copy `source`'s tensors into each target (None skipped) by name: a pipeline stage takes the
    names it has, which are the whole model's."""
    full = source.state_dict()
    for model in targets:
        if model is not None:
            for name, t in model.state_dict().items():
                t.copy_(full[name])


def as_tuples(x):
    """random.Random state comes back from torch.load with lists where tuples were."""
    return tuple(as_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x
