"""Progress bars for long work: rich when enabled, silent in tests and CI."""

from __future__ import annotations


class progress_bar:
    """A rich progress bar when wanted and available; a no-op otherwise (CI, tests)."""

    def __init__(self, enabled: bool, total: int, label: str):
        self.enabled, self.total, self.label = enabled, total, label

    def __enter__(self):
        if not self.enabled:
            return lambda msg="": None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        # a short bar leaves room for the message (draft-train's held-out acceptance) on 80 columns
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(bar_width=20), MofNCompleteColumn(),
                            TimeRemainingColumn(), TextColumn("{task.fields[msg]}"))
        self.bar.__enter__()
        task = self.bar.add_task(self.label, total=self.total, msg="")
        return lambda msg="": self.bar.update(task, advance=1, msg=msg)

    def __exit__(self, *exc):
        if self.enabled:
            self.bar.__exit__(*exc)
        return False
