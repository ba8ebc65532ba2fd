"""The bytes autograd holds for backward, live, as a run executes: what `cospec plan`'s
activations predict, measured (tests/test_plan.py, docs/results/parallel/memory_peaks.py).

    meter = SavedActivations()
    with meter:
        trainer.train_policy(batch)
    meter.peak_bytes  # the most bytes saved for backward at any one moment

A tensor saved for backward (`torch.autograd.graph.saved_tensors_hooks`) counts from the forward
that saves it until the graph that holds it is freed (after its backward, or when dropped); a
storage saved by several ops counts once. Weights are not activations: parameters and views of
them (a linear's transposed weight; FSDP2's unsharded weights) are left out. This counts what
autograd keeps, not what the allocator holds: kernel workspace and fragmentation are not in it.
"""

from __future__ import annotations

import torch


class SavedActivations:
    """A context manager: ``live_bytes`` and ``peak_bytes`` of the tensors saved for backward inside."""

    def __init__(self):
        self.live_bytes = self.peak_bytes = 0
        self._holders: dict[int, int] = {}  # storage pointer -> saved references alive
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self) -> "SavedActivations":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> bool:
        self._hooks.__exit__(*exc)
        return False

    def _pack(self, t: torch.Tensor):
        if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter):
            return t
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self._holders:
            self.live_bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._holders[ptr] = self._holders.get(ptr, 0) + 1
        return _Saved(self, ptr, storage.nbytes(), t)

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, ptr: int, nbytes: int) -> None:
        self._holders[ptr] -= 1
        if not self._holders[ptr]:
            del self._holders[ptr]
            self.live_bytes -= nbytes


class _Saved:
    """One saved reference; autograd drops it with its graph, which releases its bytes."""

    __slots__ = ("meter", "ptr", "nbytes", "tensor")

    def __init__(self, meter: SavedActivations, ptr: int, nbytes: int, tensor: torch.Tensor):
        self.meter, self.ptr, self.nbytes, self.tensor = meter, ptr, nbytes, tensor

    def __del__(self):
        self.meter._release(self.ptr, self.nbytes)
