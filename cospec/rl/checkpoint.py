"""RL checkpoints: everything a resumed run needs to continue as if never stopped.

Layout under ``<out_dir>/rl/checkpoints``:

    step_000010/
        policy/              HF-layout policy (loadable by transformers as is)
        draft/               the draft, when the run has one (`save_draft`)
        trainer_state.pt     optimizer state(s), RNG states, prompt-stream state, step, controller
        config.json          the run config
    latest                   name of the newest complete checkpoint ("step_000010")

Atomicity: a checkpoint is written into a hidden temporary directory and renamed into place in one
`os.replace`; `latest` is rewritten through a temporary file and `os.replace` too. A kill at any
moment leaves either the previous checkpoint or the new one as `latest`, never a partial one; stale
temporary directories are removed by the next save. (A rename is atomic against process death; an
OS crash would additionally need fsync, which these CPU runs do not pay for.)
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from cospec.models.draft_checkpoint import load_draft, save_draft
from cospec.models.hf_checkpoint import load_hf, save_hf

LATEST = "latest"
PREFIX = "step_"


def save_checkpoint(root: str | Path, step: int, *, policy, trainer_state: dict, config: dict,
                    draft=None, keep: int = 2) -> Path:
    """Write checkpoint `step` atomically, point `latest` at it, keep the newest `keep`."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".tmp-"))
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
    pointer = root / f".{LATEST}.tmp"
    pointer.write_text(name + "\n")
    os.replace(pointer, root / LATEST)
    for old in sorted(root.glob(f"{PREFIX}*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root`, or None."""
    root = Path(root)
    pointer = root / LATEST
    if pointer.exists():
        path = root / pointer.read_text().strip()
        if path.is_dir():
            return path
    done = sorted(root.glob(f"{PREFIX}*")) if root.exists() else []
    return done[-1] if done else None


def load_checkpoint(path: str | Path, *, device=None) -> dict:
    """{"policy": Transformer, "draft": draft or None, "trainer_state": dict, "config": dict}."""
    path = Path(path)
    return {"policy": load_hf(path / "policy", device=device),
            "draft": load_draft(path / "draft", device=device) if (path / "draft").exists() else None,
            "trainer_state": torch.load(path / "trainer_state.pt", weights_only=True),
            "config": json.loads((path / "config.json").read_text())}
