"""Files written whole or not at all.

Every file cospec keeps across an interrupt (a checkpoint's `latest` pointer, a partial draft
training, kept answers, metrics, stamps, summaries, figures) is written to a temporary sibling
and then renamed over its final name. `os.replace` within one directory is a single rename on
POSIX filesystems, so a reader sees either the old file or the new one, never a half-written one;
the temporary file is fsynced before the rename so that a crash right after it cannot leave the
new name pointing at data that never reached the disk. A failure or an interrupt while writing
removes the temporary file and leaves the old one as it was.

Whole directories (HF checkpoints, RL checkpoints) are staged and swapped in by their own
modules (`models.hf_checkpoint.swap_in_directory`, `rl.checkpoint`), which build on the same
rename.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def temporary_sibling(path: str | Path) -> Path:
    """The temporary name `path` is written under: hidden, in the same directory (a rename across
    filesystems is not atomic), and fixed, so a leftover from a killed writer is overwritten by
    the next write instead of piling up."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp")


@contextmanager
def replaced_atomically(path: str | Path) -> Iterator[Path]:
    """Yield the temporary path to write; when the block ends normally it replaces ``path``.

    >>> with replaced_atomically(out / "state.pt") as tmp:
    ...     torch.save(state, tmp)
    """
    path = Path(path)
    tmp = temporary_sibling(path)
    try:
        yield tmp
        if not tmp.exists():
            raise FileNotFoundError(f"nothing was written to {tmp} for {path}")
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomically(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all."""
    with replaced_atomically(path) as tmp:
        tmp.write_text(text)


def write_json_atomically(path: str | Path, obj, *, indent: int | None = 2, **dumps_kwargs) -> None:
    """Write ``obj`` as JSON (with a final newline) to ``path`` whole or not at all. The JSON is
    made before the file is touched, so an object that cannot be serialised leaves no trace."""
    write_text_atomically(path, json.dumps(obj, indent=indent, **dumps_kwargs) + "\n")


def save_figure_atomically(fig, path: str | Path, **savefig_kwargs) -> Path:
    """``fig.savefig(path, ...)`` whole or not at all; the format is the suffix's (the temporary
    name has none of its own)."""
    path = Path(path)
    with replaced_atomically(path) as tmp:
        fig.savefig(tmp, format=path.suffix.lstrip(".") or None, **savefig_kwargs)
    return path
