"""Process groups for cp and pp: under torchrun, or spawned on one machine (tests, benchmarks).

Every group is created with an explicit timeout, so a rank that died or never reached a collective
fails the others after ``timeout_s`` instead of hanging them (the default is 30 minutes).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def default_backend() -> str:
    """nccl when CUDA is available, else gloo."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def backend_device(group=None) -> torch.device:
    """Where ``group``'s backend reads tensors: NCCL moves CUDA tensors only, gloo CPU ones."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_from_env(timeout_s: float = 300.0, backend: str | None = None) -> tuple[int, int]:
    """Join the group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR/PORT); (rank, size)."""
    dist.init_process_group(backend or default_backend(), timeout=timedelta(seconds=timeout_s))
    if dist.get_backend() == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return dist.get_rank(), dist.get_world_size()


def _worker(rank: int, fn: Callable, num_ranks: int, workdir: str, backend: str,
            timeout_s: float, args: tuple) -> None:
    torch.set_num_threads(1)  # ranks share the machine's cores; oversubscription only slows
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=f"file://{workdir}/store", rank=rank,
                            world_size=num_ranks, timeout=timedelta(seconds=timeout_s))
    try:
        result = fn(rank, num_ranks, *args)
        torch.save(result, Path(workdir) / f"result{rank}.pt")
    finally:
        dist.destroy_process_group()
    _exit_without_finalizing()


def _exit_without_finalizing() -> None:
    """End a rank whose result is saved without running the interpreter's finalization.

    A gloo worker thread marks a collective done and only then drops its own reference to it, so
    it may drop it after the caller's wait returned; if that reference is the last one to a
    tensor Python has let go of, dropping it needs the GIL. Gloo's worker threads outlive
    `destroy_process_group` (its shutdown is a no-op; they are joined only when the C++ group is
    freed, which may be at the interpreter's final gc), and under CPython 3.11 a thread that asks
    for the GIL while Python finalizes is ended with a forced unwind, which std::terminate()s
    inside the work's noexcept destructor: the rank dies with SIGABRT ("terminate called without
    an active exception") after its result was written. Seen in 5 of 17 runs of a 2-rank test
    on a loaded 2-core machine (core dump: an `AsyncAllreduceWork` destructor on a gloo
    `runLoop` thread, waiting in `take_gil` while the main thread ran `Py_FinalizeEx`).
    `_worker` has nothing left to do, so the rank leaves at once (see `spawn` for what that
    skips). `cospec train` under torchrun is exposed in principle too; not seen in its tests,
    it exits normally.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn: Callable[..., Any], num_ranks: int, *args: Any, backend: str = "gloo",
          timeout_s: float = 60.0, deadline_s: float | None = None) -> list[Any]:
    """Run ``fn(rank, num_ranks, *args)`` in ``num_ranks`` fresh processes joined in one group;
    return each rank's result (must be picklable by torch.save), in rank order.

    ``fn`` must be importable (module level). An exception on any rank is re-raised here
    (torch.multiprocessing.ProcessRaisedException, with the rank's traceback).

    ``timeout_s`` is the process group's timeout (a collective whose peer is gone fails after it).
    Hard deadline: if any rank is still running ``deadline_s`` (default: timeout_s + 30) seconds
    after the start, every rank is killed and `TimeoutError` is raised: read it as a hang (deadlock) in what ``fn`` ran. The
    process-group timeout alone does not give that: a rank stuck in a Python wait, or in a receive
    whose peer is itself stuck, may never reach a timed gloo call.

    A rank that returns ends with ``os._exit`` once its result is saved (`_exit_without_finalizing`
    says why): no atexit handlers run and no thread or child process ``fn`` left behind is
    joined, so ``fn`` closes what it opens. A rank that raises exits the usual way.
    """
    with tempfile.TemporaryDirectory(prefix="cospec-dist-") as workdir:
        ctx = mp.start_processes(_worker, args=(fn, num_ranks, workdir, backend, timeout_s, args),
                                 nprocs=num_ranks, join=False, start_method="spawn")
        deadline_s = timeout_s + 30.0 if deadline_s is None else deadline_s
        deadline = time.monotonic() + deadline_s
        while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                alive = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                for p in ctx.processes:
                    p.join()
                raise TimeoutError(f"ranks {alive} of {num_ranks} still running after {deadline_s:.0f}s: "
                                   f"a hang in {getattr(fn, '__name__', fn)}")
        return [torch.load(Path(workdir) / f"result{r}.pt", weights_only=False)
                for r in range(num_ranks)]
