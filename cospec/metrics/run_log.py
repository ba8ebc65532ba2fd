"""Per-step metric sinks of a run: a JSONL file (the source of truth for reports) and TensorBoard.

Each `log` call writes one JSON object per line, ``{"step": N, ...}``, flushed at once, so a killed
run loses nothing already logged. On resume from the checkpoint of step S, lines of steps > S (logged
after that checkpoint by the run that died) are dropped first, and TensorBoard purges its events
after S, so the logs read like those of an uninterrupted run.

Nested values (``{"reward": {"copy": 0.5}}``) go to TensorBoard as ``reward/copy``; lists as
``name/0``, ``name/1`` ...; non-numbers are kept in JSONL only; NaN is written as null.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from cospec.atomic_file import write_text_atomically


def _scalars(prefix: str, value, out: dict[str, float]) -> None:
    if isinstance(value, bool):
        out[prefix] = float(value)
    elif isinstance(value, (int, float)):
        if math.isfinite(value):
            out[prefix] = float(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            _scalars(f"{prefix}/{k}", v, out)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _scalars(f"{prefix}/{i}", v, out)


def finite_or_none(value):
    """NaN/inf -> None, recursively: JSON has no NaN, and browsers' JSON.parse rejects it."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value


def read_jsonl(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a kill mid-write
                break
    return rows


class RunLog:
    """JSONL at ``jsonl_path`` plus TensorBoard under ``tb_dir`` (None: no TensorBoard)."""

    def __init__(self, jsonl_path: str | Path, tb_dir: str | Path | None = None, *,
                 resume_step: int | None = None):
        self.path = Path(jsonl_path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self.path.write_text("")
        else:
            kept = [r for r in read_jsonl(self.path) if r.get("step", -1) <= resume_step]
            write_text_atomically(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self.writer = None
        if tb_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(tb_dir), purge_step=None if resume_step is None
                                        else resume_step + 1)

    def log(self, step: int, metrics: dict) -> None:
        row = finite_or_none({"step": step, **metrics})
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.writer is not None:
            scalars: dict[str, float] = {}
            for k, v in metrics.items():
                _scalars(k, v, scalars)
            for k, v in scalars.items():
                self.writer.add_scalar(k, v, step)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
