"""Where an interrupted `cospec draft-train` resumes: the training state of offline draft training.

On a real model the training itself runs for up to an hour (SmolLM2: 960 steps in 24 minutes
on 2 idle CPU cores, 44 beside other jobs), so every ``draft.checkpoint_every`` steps the state
that decides the rest of the run is written to out_dir/<draft dir>.partial/state.pt: the draft's
weights and reduced vocabulary, the optimizer's moments, the step, the random state of the batch
order, and the loss and held-out histories so far. The file is written whole or not at all
(`cospec.atomic_file`), and carries the fingerprint of the fields that make the draft
(`cospec.artifacts.draft_fields`): a run with other fields does not resume from it. It is
removed once the trained draft is saved. Resumed, the run ends with the same weights, bit for bit, as one never
interrupted (tests/test_draft_train_resume.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from cospec.atomic_file import replaced_atomically, temporary_sibling


class OfflineCheckpoint:
    """The resumable state of one offline draft training, at ``dir``/state.pt, for the draft
    fields whose fingerprint is ``key``."""

    def __init__(self, dir: Path, key: str):
        self.dir, self.key = Path(dir), key
        self.path = self.dir / "state.pt"

    def load(self, device) -> dict | None:
        """The saved state, or None when there is none for these fields (saying why, when one
        exists for others or cannot be read)."""
        if not self.path.exists():
            return None
        try:
            state = torch.load(self.path, map_location=device, weights_only=True)
        except Exception as e:  # a damaged file: train from the start rather than fail
            print(f"warning: cannot read the partial draft training {self.path} ({e}): starting over")
            return None
        if state.get("key") != self.key:
            print(f"the partial draft training {self.path} was made with other settings: starting over")
            return None
        return state

    def save(self, state: dict) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        with replaced_atomically(self.path) as tmp:
            torch.save({**state, "key": self.key}, tmp)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
        temporary_sibling(self.path).unlink(missing_ok=True)
        if self.dir.exists() and not any(self.dir.iterdir()):
            self.dir.rmdir()
