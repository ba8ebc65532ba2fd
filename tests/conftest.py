"""Shared fixtures: the pipelined runs (spawned gloo ranks) that test_pipeline.py and
test_tap_channel.py both read, run once per session; and the ``full_matrix`` marker's skip."""

import os
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch

from cospec.parallel.launch import spawn

from pipeline_runs import (BLOCK_SPEC, RunSpec, pipelined_runs, random_microbatches,
                           reference_step, tiny_draft, tiny_policy)

ALL_LAYERS = tuple(range(6))


def pytest_collection_modifyitems(config, items):
    """Cases marked ``full_matrix`` (distributed layouts whose code paths the suite's other
    layouts already run) are skipped unless COSPEC_FULL_MATRIX=1: the suite stays under 15
    minutes on 2 cores, and a change to the parallel code runs them all on purpose."""
    if os.environ.get("COSPEC_FULL_MATRIX") == "1":
        return
    skip = pytest.mark.skip(reason="full-matrix layout: COSPEC_FULL_MATRIX=1 runs it")
    for item in items:
        if "full_matrix" in item.keywords:
            item.add_marker(skip)


@contextmanager
def single_thread():
    """One intra-op thread: what the spawned ranks use, and on a busy 2-core machine tiny ops with
    2 OpenMP threads run ~100x slower (threads spin on cores others hold)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def one_thread():
    with single_thread():
        yield


@dataclass
class PipelineCase:
    """``results[rank][i]`` is spec ``specs[i]`` run on ``num_ranks`` stages of sizes
    ``stage_sizes``; ``reference`` is `reference_step` on one process."""

    num_ranks: int
    stage_sizes: list[int]
    num_microbatches: int
    specs: list[RunSpec]
    results: list[list[dict]]
    reference: dict
    block_reference: dict  # the same step with the block draft co-trained

    def run(self, spec: RunSpec) -> list[dict]:
        """Every rank's result for ``spec``."""
        i = self.specs.index(spec)
        return [r[i] for r in self.results]


# Uneven stages, a tap on every stage (every layer tapped: the channel carries 6 layers, the draft
# reads 3 of them), several microbatches of different lengths, 2 steps for the tapped runs (the
# slots are reused and the stamps move on).
CASES = {2: ([4, 2], 6), 4: ([1, 3, 1, 1], 12)}
SPECS = [RunSpec(schedule=s, taps=t, draft=bool(t), num_steps=2 if t else 1)
         for s in ("1f1b", "gpipe") for t in ((), ALL_LAYERS)]
SPECS.append(BLOCK_SPEC)


@pytest.fixture(scope="session", params=sorted(CASES), ids=lambda n: f"pp{n}")
def pipeline_case(request) -> PipelineCase:
    num_ranks = request.param
    stage_sizes, num_microbatches = CASES[num_ranks]
    # A hang must fail, not block: 120 s is ~10x what this takes on a busy 2-core machine.
    results = spawn(pipelined_runs, num_ranks, stage_sizes, num_microbatches, SPECS,
              timeout_s=120, deadline_s=120)
    with single_thread():  # like the ranks: GEMM results depend on the thread count
        policy = tiny_policy()
        mbs = random_microbatches(num_microbatches)
        reference = reference_step(policy, mbs, ALL_LAYERS, tiny_draft(policy))
        block_reference = reference_step(policy, mbs, ALL_LAYERS, tiny_draft(policy, "block"))
    return PipelineCase(num_ranks, stage_sizes, num_microbatches, SPECS, results, reference,
                        block_reference)
