"""`spawn`, the local launcher of tests and benchmarks: how its ranks end."""

import atexit
import os

import pytest

from cospec.parallel.launch import spawn


def _abort_if_finalized(rank, world):
    # Runs only if the rank's interpreter finalizes, where a gloo worker thread still releasing
    # a finished collective's tensor would abort the rank (launch._exit_without_finalizing).
    atexit.register(os.abort)
    return rank


@pytest.mark.slow
def test_a_rank_whose_result_is_saved_leaves_without_finalizing_the_interpreter():
    assert spawn(_abort_if_finalized, 2, timeout_s=30) == [0, 1]
