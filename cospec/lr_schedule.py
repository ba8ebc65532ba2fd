"""The learning-rate schedule SFT and offline draft training share."""

from __future__ import annotations

import math


def lr_at(step: int, *, lr: float, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to lr, then cosine decay to min_ratio * lr at `total`."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))
