"""Keep freed host memory inside the process (Linux/glibc), so a step's large CPU tensors do not
come back as fresh pages every step.

glibc serves a large allocation with a fresh ``mmap`` and gives memory freed at the top of its
heap back to the OS ("trimming"). A generation step allocates and frees the same large tensors
every step: the logits and the policy's sampling distribution at batch 16 over a 49K vocabulary
are [16, 5, 49152] floats, 16 MB each. With glibc's defaults they returned as new pages each
time; measured on SmolLM2 on one CPU thread, building the step's sampling distribution took
11,000 minor page faults and 23 ms, against 0 faults and 10 ms with freed memory kept
(docs/results/real_model.md). Raising glibc's mmap and trim thresholds keeps it, up to a bound
(`keep_freed_host_memory`).

CUDA memory has PyTorch's caching allocator and needs none of this; neither do other C
libraries (musl, macOS), where `keep_freed_host_memory` does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers (malloc.h)
_done: bool | None = None


MMAP_THRESHOLD = 64 << 20  # requests above this still get their own mmap, returned on free
TRIM_THRESHOLD = 512 << 20  # free memory kept at the heap's top before glibc returns it


def keep_freed_host_memory() -> bool:
    """Once per process: mallopt(M_MMAP_THRESHOLD, 64 MiB), mallopt(M_TRIM_THRESHOLD, 512 MiB).
    Returns whether glibc took both (False elsewhere).

    Bounded on purpose: with 1 GiB / 2 GiB a stale-draft experiment (three GRPO trainers in one
    process, training batches whose [T, V] logits run to gigabytes) grew to 24 GB and was killed
    for memory; requests above 64 MiB (a step's tensors at batch 64 and a 49K vocabulary are
    63 MB) go back to the OS as before, and at most 512 MiB of free heap is kept."""
    global _done
    if _done is None:
        _done = False
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                _done = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
                    libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
            except (OSError, AttributeError):  # not glibc
                _done = False
    return _done
