"""Who does what in a distributed GRPO run: `parallel.cp` or `parallel.pp` ranks under torchrun.

    torchrun --nproc-per-node 2 -m cospec train parallel.cp=2
    torchrun --nproc-per-node 2 -m cospec train parallel.pp=2

World = cp x pp processes (one of the two is 1: the pp x cp mesh is not built). Roles:
- rank 0 is the *rollout rank*: it owns the rollout engine (a full copy of the policy and of the
  draft), generates, scores, computes advantages, evaluates, logs and writes checkpoints. The
  rollouts reach the other ranks by one broadcast per step. (A real deployment puts the engine on
  its own devices; the `WeightSync` seam is where it plugs in.)
- cp: every rank holds a replica of the policy, the reference and the draft and trains on its
  zigzag shard of every minibatch (`cospec.parallel.cp_step`).
- pp: rank s holds stage s of the policy and the reference; the draft lives on the last stage,
  fed by TapChannel (`cospec.parallel.pp_step`).
Checkpoints hold the full policy (rank 0's synced copy) and every rank's optimizer state, so a
run resumes with the same parallel layout (the resume check compares the whole config).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist

from cospec.config import ConfigError, ParallelConfig
from cospec.parallel.launch import init_from_env


@dataclass
class TrainGroup:
    """This process's place in the run. pipe_group/tap_group: the pipeline's two groups (pp > 1)."""

    rank: int
    world: int
    cp: int
    pp: int
    pipe_group: object = None
    tap_group: object = None

    @property
    def is_rollout_rank(self) -> bool:
        return self.rank == 0

    @property
    def draft_rank(self) -> int | None:
        """The rank that trains the draft under pp (the last stage); None under cp (all do)."""
        return self.pp - 1 if self.pp > 1 else None

    @property
    def owns_draft(self) -> bool:
        return self.draft_rank is None or self.rank == self.draft_rank

    def broadcast(self, obj, src: int = 0):
        """``obj`` of rank ``src`` on every rank (pickled: rollouts, metrics)."""
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def gather(self, obj, dst: int = 0) -> list | None:
        """Every rank's ``obj``, in rank order, on rank ``dst`` (None elsewhere)."""
        out = [None] * self.world if self.rank == dst else None
        dist.gather_object(obj, out, dst=dst)
        return out


def check_launch(parallel: ParallelConfig) -> None:
    """ConfigError unless the processes torchrun started match parallel.cp x parallel.pp."""
    want = parallel.cp * parallel.pp
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != want:
        how = (f"launch it with torchrun --nproc-per-node {want} -m cospec train ..." if world == 1
               else f"torchrun started {world} processes")
        raise ConfigError(f"parallel: cp={parallel.cp} x pp={parallel.pp} needs {want} processes; {how}")


def join_train_group(parallel: ParallelConfig, timeout_s: float = 600.0) -> TrainGroup | None:
    """None for a single-process run; else join torchrun's group (a dead rank fails the others
    after ``timeout_s``) and create the pipeline's groups."""
    check_launch(parallel)
    if parallel.cp * parallel.pp == 1:
        return None
    rank, world = init_from_env(timeout_s=timeout_s)
    return make_train_group(parallel, rank, world)


def make_train_group(parallel: ParallelConfig, rank: int, world: int) -> TrainGroup:
    """The roles in an already initialised default group (torchrun, or `launch.spawn` in tests)."""
    from cospec.parallel.pipeline import pipeline_groups

    if world != parallel.cp * parallel.pp:
        raise ConfigError(f"parallel: cp={parallel.cp} x pp={parallel.pp} needs "
                          f"{parallel.cp * parallel.pp} processes, the group has {world}")
    group = TrainGroup(rank=rank, world=world, cp=parallel.cp, pp=parallel.pp)
    if parallel.pp > 1:
        group.pipe_group, group.tap_group = pipeline_groups()
    return group
