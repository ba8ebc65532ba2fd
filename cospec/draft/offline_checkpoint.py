"""Where an interrupted `cospec draft-train` resumes: the training state of offline draft training.

On a real model the training itself runs for hours (SmolLM2: 960 steps in 24 minutes on 2 idle
CPU cores, 3,840 steps with recomputed policy outputs ~3.2 h), so every ``draft.checkpoint_every``
steps the state that decides the rest of the run is written to out_dir/<draft dir>.partial: the
draft's weights and reduced vocabulary, the optimizer's moments, the step, the random state of the
batch order, and the loss and held-out histories so far. The file is written whole or not at all
(`cospec.atomic_file`) and is named by the fingerprint of the fields that make the draft
(`cospec.artifacts.draft_fields`): ``state-<first 16 hex digits>.pt``. A run with other fields
therefore neither resumes from it nor overwrites it: hours of training are not lost to a mistyped
override, and come back when the settings do; such files are named on stdout, and ``--fresh``
removes them all. A run's own file is removed once its trained draft is saved. Resumed, the run
ends with the same weights, bit for bit, as one never interrupted (tests/test_draft_train_resume.py).
A ``state.pt`` of cospec before per-settings names is still resumed when its fingerprint matches.
"""

from __future__ import annotations

from pathlib import Path

import torch

from cospec.atomic_file import replaced_atomically, temporary_sibling


class OfflineCheckpoint:
    """The resumable state of one offline draft training, in ``dir``, for the draft fields whose
    fingerprint is ``key``."""

    def __init__(self, dir: Path, key: str):
        self.dir, self.key = Path(dir), key
        self.path = self.dir / f"state-{key[:16]}.pt"
        self.legacy = self.dir / "state.pt"  # one file for whatever settings (before per-key names)
        self.loaded_from: Path | None = None  # the file `load` found this training's state in

    def load(self, device) -> dict | None:
        """The saved state for these fields, or None; names the states of other fields kept here."""
        self.loaded_from, state = None, None
        for path in (self.path, self.legacy):
            if state is None and path.exists():
                state = self._read(path, device)
                self.loaded_from = path if state is not None else None
        others = [p for p in self.files() if p not in (self.path, self.loaded_from)]
        if others:
            mb = sum(p.stat().st_size for p in others) / 2**20
            print(f"{self.dir} also holds {len(others)} other partial draft training file(s) "
                  f"({mb:.0f} MB: other settings, or unreadable): kept, to resume when those "
                  f"settings return; --fresh removes them")
        return state

    def _read(self, path: Path, device) -> dict | None:
        try:
            state = torch.load(path, map_location=device, weights_only=True)
        except Exception as e:  # a damaged file: train from the start rather than fail
            print(f"warning: cannot read the partial draft training {path} ({e}): starting over")
            return None
        return state if isinstance(state, dict) and state.get("key") == self.key else None

    def files(self) -> list[Path]:
        """Every training state kept in the directory, of any settings."""
        return sorted(self.dir.glob("state*.pt")) if self.dir.exists() else []

    def leftovers(self) -> list[Path]:
        """Temporaries of killed writers, whatever their settings."""
        return sorted(self.dir.glob(".state*.pt.tmp")) if self.dir.exists() else []

    def save(self, state: dict) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        with replaced_atomically(self.path) as tmp:
            torch.save({**state, "key": self.key}, tmp)
        if self.loaded_from == self.legacy:  # resumed from the old name: it now lives under the new
            self.legacy.unlink(missing_ok=True)
        self.loaded_from = self.path

    def remove(self, *, other_settings: bool = False) -> None:
        """Remove this training's state (with ``other_settings``, every state kept here)."""
        mine = {self.path, self.loaded_from or self.path}
        for path in self.files() if other_settings else mine:
            path.unlink(missing_ok=True)
            temporary_sibling(path).unlink(missing_ok=True)
        for path in self.leftovers() if other_settings else ():
            path.unlink()
        if self.dir.exists() and not any(self.dir.iterdir()):
            self.dir.rmdir()
