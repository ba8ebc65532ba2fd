"""Weight sync: how the trainer's updated weights reach the rollout engine.

The seam is one method, ``push(model)``, called after every update (policy, and draft when it is
trained). `InProcessWeightSync` copies tensors into the engine's own copy of the model, in place, so
the engine's caches and compiled state stay valid. A remote engine (another process or machine)
implements the same method by sending the state dict (e.g. over torch.distributed broadcast or a
shared-memory file) and loading it on the other side; the trainer does not change.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class WeightSync(Protocol):
    def push(self, model: nn.Module) -> None: ...


class InProcessWeightSync:
    """Copy `model`'s parameters and buffers into `target` (same architecture) without a reallocation."""

    def __init__(self, target: nn.Module):
        self.target = target
        self.num_pushes = 0

    @torch.no_grad()
    def push(self, model: nn.Module) -> None:
        src = model.state_dict()
        dst = self.target.state_dict()
        if src.keys() != dst.keys():
            raise ValueError(f"weight sync: models differ: {sorted(set(src) ^ set(dst))[:5]}")
        for name, t in dst.items():
            t.copy_(src[name])
        self.num_pushes += 1
