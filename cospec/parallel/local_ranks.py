"""Run a function on N local ranks joined in one process group, with a hard deadline.

Used by the pipeline tests and `cospec bench pp`. The deadline is the point: a pipeline schedule or a
side channel that deadlocks must fail the caller with `TimeoutError` (naming the ranks still
running), not block it. A process-group timeout alone does not give that: a rank stuck in a Python
wait, or in a receive whose peer is itself stuck, may never reach a timed gloo call.
"""

from __future__ import annotations

import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank_main(rank: int, fn: Callable, num_ranks: int, workdir: str, backend: str,
               timeout_s: float, args: tuple) -> None:
    torch.set_num_threads(1)  # ranks share the machine's cores; oversubscription only slows
    dist.init_process_group(backend, init_method=f"file://{workdir}/store", rank=rank,
                            world_size=num_ranks, timeout=timedelta(seconds=timeout_s))
    try:
        result = fn(rank, num_ranks, *args)
        torch.save(result, Path(workdir) / f"result{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], num_ranks: int, *args: Any, backend: str = "gloo",
              timeout_s: float = 60.0) -> list[Any]:
    """``fn(rank, num_ranks, *args)`` on ``num_ranks`` spawned processes; their results in rank order.

    ``fn`` must be importable (module level) and its result picklable by torch.save. A rank's
    exception is re-raised here (torch.multiprocessing.ProcessRaisedException with its traceback).
    If any rank is still running ``timeout_s`` seconds after the start, every rank is killed and
    `TimeoutError` is raised: read it as a hang (deadlock) in what ``fn`` ran.
    """
    with tempfile.TemporaryDirectory(prefix="cospec-pp-") as workdir:
        ctx = mp.start_processes(_rank_main, args=(fn, num_ranks, workdir, backend, timeout_s, args),
                                 nprocs=num_ranks, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                alive = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                for p in ctx.processes:
                    p.join()
                raise TimeoutError(f"ranks {alive} of {num_ranks} still running after {timeout_s:.0f}s: "
                                   f"a hang in {getattr(fn, '__name__', fn)}")
        return [torch.load(Path(workdir) / f"result{r}.pt", weights_only=False)
                for r in range(num_ranks)]
