"""Progress for long work: a rich bar on a terminal, a plain line a minute in a log file, silent in
tests and CI.

A draft-train or GRPO run on a real model runs for hours, often under nohup or a job scheduler
whose stdout is a file. There a live bar draws nothing until the end (rich renders a non-terminal
only once), so such a run says nothing for hours; it prints instead, at most every
``log_interval`` seconds and once at the end, one line: done/total, rate, time left and the
caller's message (draft-train's held-out acceptance, GRPO's reward).
"""

from __future__ import annotations

import sys
import time


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class _LogLines:
    """The plain-text progress of a run whose stdout is not a terminal."""

    def __init__(self, total: int, label: str, interval: float, *, start: int = 0,
                 clock=time.monotonic, stream=None):
        self.total, self.label, self.interval, self.clock = total, label, interval, clock
        self.stream = stream if stream is not None else sys.stdout
        self.done = self.first = start  # a resumed run counts on from where it was
        self.start = self.last_print = clock()

    def line(self, msg: str) -> str:
        elapsed, ran = self.clock() - self.start, self.done - self.first
        pace = f"{elapsed / ran:.2f} s/it" if ran else "-"
        left = (f", ~{_duration(elapsed / ran * (self.total - self.done))} left"
                if ran and self.done < self.total else f", {_duration(elapsed)} in all" if ran else "")
        percent = f" ({100 * self.done // self.total}%)" if self.total else ""
        return f"{self.label} {self.done}/{self.total}{percent} {pace}{left}" + (f"  {msg}" if msg else "")

    def __call__(self, msg: str = "") -> None:
        self.done += 1
        now = self.clock()
        if now - self.last_print >= self.interval or self.done == self.total:
            print(self.line(msg), file=self.stream, flush=True)
            self.last_print = now


class progress_bar:
    """A rich progress bar on a terminal (or in Jupyter), a plain line every `log_interval` s
    otherwise; a no-op when not enabled (CI, tests). ``start``: items done before (a resumed run)."""

    log_interval = 60.0

    def __init__(self, enabled: bool, total: int, label: str, *, start: int = 0):
        self.enabled, self.total, self.label, self.start = enabled, total, label, start
        self.bar = None

    def __enter__(self):
        if not self.enabled:
            return lambda msg="": None
        from rich.console import Console

        console = Console()
        if not (console.is_terminal or console.is_jupyter):
            return _LogLines(self.total, self.label, self.log_interval, start=self.start)
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        # a short bar leaves room for the message (draft-train's held-out acceptance) on 80 columns
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(bar_width=20), MofNCompleteColumn(),
                            TimeRemainingColumn(), TextColumn("{task.fields[msg]}"))
        self.bar.__enter__()
        task = self.bar.add_task(self.label, total=self.total, completed=self.start, msg="")
        return lambda msg="": self.bar.update(task, advance=1, msg=msg)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.__exit__(*exc)
        return False
