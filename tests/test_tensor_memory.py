"""Specification of cospec.metrics.tensor_memory: the peak of tensor memory over a piece of work."""

import gc

import torch

from cospec.metrics.tensor_memory import TensorMemoryPeak, live_tensor_bytes

MiB = 2 ** 20


def test_the_peak_is_what_was_alive_before_plus_the_most_allocated_at_once_inside():
    kept = torch.empty(MiB, dtype=torch.uint8)  # alive on entry: counted
    gc.collect()  # as the meter does on entry: garbage left by earlier tests is not alive
    before = live_tensor_bytes()
    assert before >= kept.untyped_storage().nbytes()
    with TensorMemoryPeak(device="cpu") as meter:
        a = torch.empty(4 * MiB, dtype=torch.uint8)
        b = torch.empty(2 * MiB, dtype=torch.uint8)
        del a  # freed before c: the peak is a and b together, 6 MiB
        c = torch.empty(3 * MiB, dtype=torch.uint8)
        del b, c
    extra = meter.peak_bytes - before
    assert 6 * MiB <= extra <= 6 * MiB + 256 * 1024, extra  # a few small tensors of torch's own


def test_a_kernels_temporaries_count_too():
    x = torch.randn(512, 512)
    with TensorMemoryPeak(device="cpu") as meter:
        (x @ x).sum()  # the product is a temporary: never held by Python
    assert meter.peak_bytes - live_tensor_bytes() >= 512 * 512 * 4
