"""The peak bytes of tensor memory a process holds over a piece of work: what `cospec plan`'s
total per rank predicts, measured (tests/test_plan.py, docs/results/parallel/memory_peaks.py).

    with TensorMemoryPeak() as meter:
        trainer.run_step()
    meter.peak_bytes

On CUDA it is the caching allocator's own count (`torch.cuda.max_memory_allocated`, its peak
reset on entry). On CPU, which keeps no such count, it is the bytes of every tensor alive on entry
(each storage once, found by the garbage collector) plus the highest running sum of the CPU
allocations and frees that the profiler records inside (`profile_memory`): every tensor the work
allocates, kernels' temporaries included. Neither counts allocator slack or fragmentation, nor
memory that is not a tensor (the interpreter, libraries, communication buffers).
"""

from __future__ import annotations

import gc
import warnings

import torch


def live_tensor_bytes() -> int:
    """Bytes of every CPU tensor alive now, each storage counted once (a DTensor by its shard)."""
    storages: dict[int, int] = {}
    with warnings.catch_warnings():  # a type check on a deprecated torch object warns
        warnings.simplefilter("ignore", FutureWarning)
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in tensors:
        try:
            local = getattr(obj, "_local_tensor", obj)
            if local.device.type != "cpu" or local.is_meta:
                continue
            storage = local.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, ReferenceError):  # a tensor without storage (a fake, a freed one)
            continue
    return sum(storages.values())


class TensorMemoryPeak:
    """A context manager: ``peak_bytes`` of tensor memory inside it (module docstring)."""

    def __init__(self, device: torch.device | str | None = None):
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.peak_bytes = 0

    def __enter__(self) -> "TensorMemoryPeak":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return self
        gc.collect()
        self._start = live_tensor_bytes()
        self._profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                               profile_memory=True)
        self._profile.__enter__()
        return self

    def __exit__(self, *exc) -> bool:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
            return False
        self._profile.__exit__(*exc)
        # The allocations and frees in time order (kineto's raw events: the aggregated
        # `profile.events()` do not keep each one).
        events = sorted((e for e in self._profile.profiler.kineto_results.events()
                         if e.name() == "[memory]"
                         and e.device_type() == torch.autograd.DeviceType.CPU),
                        key=lambda e: e.start_ns())
        live = high = 0
        for e in events:
            live += e.nbytes()
            high = max(high, live)
        self.peak_bytes = self._start + high
        return False
