"""Who does what in a distributed GRPO run: `parallel.dp`, `parallel.cp` or `parallel.pp` ranks
under torchrun.

    torchrun --standalone --nproc-per-node 2 -m cospec train parallel.dp=2
    torchrun --standalone --nproc-per-node 2 -m cospec train parallel.cp=2
    torchrun --standalone --nproc-per-node 2 -m cospec train parallel.pp=2
    torchrun --standalone --nproc-per-node 4 -m cospec train parallel.pp=2 parallel.cp=2
    torchrun --standalone --nproc-per-node 4 -m cospec train parallel.dp=2 parallel.pp=2

World = dp x pp x cp processes, rank = dp_rank * (pp * cp) + stage * cp + cp_rank: a *replica*
is the pp x cp ranks of one dp_rank. Roles:
- the first rank of every replica *generates*: it owns a rollout engine (a full copy of the policy
  and of the draft), generates its replica's share of the step's prompt groups (a group never
  straddles replicas), scores them and computes their advantages. Under cp or pp its rollouts
  reach the replica's other ranks as tensors (`cospec.parallel.tensor_transfer`). (A real
  deployment puts the engine on its own devices; the `WeightSync` seam is where it plugs in.)
  Why one rank of a replica and not all of them: the engine decodes with the whole policy, which
  under pp or cp no single rank of the replica holds; running it on every rank would need a
  pipelined or context-parallel *decoder* (each token a trip through every stage: latency-bound at
  small batch), or a full copy per rank (the memory pp and cp exist to save). So the replica's other
  ranks wait during generation; dp, whose replicas each hold a whole copy, is the axis that
  multiplies rollout throughput (`cospec bench rollout-dp`).
- rank 0 is the *lead*: it also evaluates, logs and writes checkpoints.
- dp: every replica trains on its own rollouts; the policy and a co-trained draft are sharded
  with FSDP2 over every rank (`cospec.parallel.data_parallel`, `cospec.rl.dp_step`). dp x cp: each
  replica's cp ranks zigzag-shard its minibatches as under cp alone, and FSDP2 sums the gradient
  shares of all dp x cp ranks at once (torchtitan's flattened dp-shard x cp mesh). dp x pp (x cp):
  every replica is a pipeline; each stage is sharded over the ranks holding it in every replica
  (``stage_group``), and the draft co-trains on every replica's last stage.
- cp: every rank holds a replica of the policy, the reference and the draft and trains on its
  zigzag shard of every minibatch (`cospec.rl.cp_step`).
- pp: rank s holds stage s of the policy and the reference; the draft lives on the last stage,
  fed by TapChannel (`cospec.rl.pp_step`).
- pp x cp: every stage is held by cp ranks that shard each microbatch (zigzag, ring attention
  inside the stage's cp group); the pipeline and TapChannel run per cp column (cp rank c of every
  stage); the last stage's cp ranks co-train the draft on zigzag shards.
Checkpoints hold the full policy (rank 0's synced copy) and every rank's part of the trained
state (its shards, stage or replica, with its optimizer state, written by each rank through
`torch.distributed.checkpoint`: `cospec.rl.trainer_state`), so a run resumes with the same
parallel layout (the resume check compares the whole config).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from cospec.config import ConfigError, ParallelConfig
from cospec.parallel.launch import init_from_env


@dataclass
class TrainGroup:
    """This process's place in the run: rank = dp_rank * (pp * cp) + stage * cp + cp_rank (the cp
    ranks of a stage are neighbours). cp_group: the ranks holding this rank's stage under pp x cp
    or the ranks of this rank's replica under dp x cp (None otherwise: under cp alone the cp group
    is the world); pipe_group/tap_group: the pipeline's two groups of this rank's cp column
    (pp > 1); dp_group: under dp with cp or pp, the ranks at this rank's place (stage, cp rank) in
    every replica (None: under dp alone the dp group is the world); stage_group: under dp x pp,
    the ranks holding this rank's stage in every replica (FSDP2 shards the stage over them);
    replica_group: under dp with cp or pp, the ranks of this rank's replica; mesh: the (dp, pp, cp)
    `DeviceMesh` they come from; fsdp_mesh: under dp, the one-dimensional mesh FSDP2 shards over."""

    rank: int
    world: int
    cp: int
    pp: int
    dp: int = 1
    cp_group: object = None
    pipe_group: object = None
    tap_group: object = None
    dp_group: object = None
    stage_group: object = None
    replica_group: object = None
    mesh: object = None
    fsdp_mesh: object = None

    @property
    def replica_size(self) -> int:
        return self.pp * self.cp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.replica_size

    @property
    def stage(self) -> int:
        return self.rank % self.replica_size // self.cp

    @property
    def cp_rank(self) -> int:
        return self.rank % self.cp

    @property
    def generates(self) -> bool:
        """Owns a rollout engine: the first rank of every replica."""
        return self.rank % self.replica_size == 0

    @property
    def is_lead(self) -> bool:
        """Evaluates, logs and writes checkpoints."""
        return self.rank == 0

    @property
    def draft_rank(self) -> int | None:
        """Under pp the first rank of the last stage (of replica 0), which reports the draft's
        metrics; None under cp alone (every rank trains the draft)."""
        return (self.pp - 1) * self.cp if self.pp > 1 else None

    @property
    def replica_first_rank(self) -> int:
        """The rank that generates for this rank's replica."""
        return self.dp_rank * self.replica_size

    @property
    def replica_draft_rank(self) -> int | None:
        """Under pp the first rank of this replica's last stage (its draft's trainer)."""
        return self.replica_first_rank + self.draft_rank if self.pp > 1 else None

    @property
    def owns_draft(self) -> bool:
        """Trains the draft: every rank under cp alone, the last stage's ranks under pp."""
        return self.pp == 1 or self.stage == self.pp - 1

    def broadcast(self, obj, src: int = 0):
        """``obj`` of rank ``src`` on every rank (pickled: rollouts, metrics)."""
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    @property
    def replica_collectives(self):
        """The group of this rank's replica for collectives (None: the world, under cp or pp
        alone)."""
        return self.replica_group if self.dp > 1 else None


def check_launch(parallel: ParallelConfig) -> None:
    """ConfigError unless the processes torchrun started match parallel.dp x pp x cp."""
    want = parallel.dp * parallel.cp * parallel.pp
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != want:
        how = (f"launch it with torchrun --nproc-per-node {want} -m cospec train ..." if world == 1
               else f"torchrun started {world} processes")
        raise ConfigError(f"parallel: dp={parallel.dp} x pp={parallel.pp} x cp={parallel.cp} needs "
                          f"{want} processes; {how}")


def join_train_group(parallel: ParallelConfig, timeout_s: float = 600.0) -> TrainGroup | None:
    """None for a single-process run; else join torchrun's group (a dead rank fails the others
    after ``timeout_s``) and create the pipeline's groups."""
    check_launch(parallel)
    if parallel.dp * parallel.cp * parallel.pp == 1:
        return None
    rank, world = init_from_env(timeout_s=timeout_s)
    return make_train_group(parallel, rank, world)


def make_train_group(parallel: ParallelConfig, rank: int, world: int) -> TrainGroup:
    """The roles in an already initialised default group (torchrun, or `launch.spawn` in tests).

    The groups come from one `DeviceMesh` of shape (dp, pp, cp) (rank-major as the module docstring
    says): cp groups along "cp", pipelines along "pp", dp groups along "dp"; FSDP2's mesh is "dp"
    and "cp" flattened (a stage's ranks in every replica), a replica's group "pp" and "cp"
    flattened. TapChannel's group is a second group over each pipeline's ranks, made by every rank
    in the same order (torch.distributed requires it), so taps never share the pipeline's.
    """
    import torch

    cp, pp, dp = parallel.cp, parallel.pp, parallel.dp
    if world != dp * cp * pp:
        raise ConfigError(f"parallel: dp={dp} x pp={pp} x cp={cp} needs {dp * cp * pp} processes, "
                          f"the group has {world}")
    group = TrainGroup(rank=rank, world=world, cp=cp, pp=pp, dp=dp)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    group.mesh = mesh = init_device_mesh(device, (dp, pp, cp), mesh_dim_names=("dp", "pp", "cp"))
    R = group.replica_size
    if cp > 1 and dp * pp > 1:  # under cp alone the cp group is the world
        group.cp_group = mesh["cp"].get_group()
    if dp > 1:
        # torchtitan's flattened dp-shard x cp mesh (DeviceMesh._flatten: private, as there)
        group.fsdp_mesh = mesh["dp", "cp"]._flatten("dp_cp")
        if R > 1:  # under dp alone the dp group and the FSDP2 group are the world
            group.dp_group = mesh["dp"].get_group()
            group.replica_group = mesh["pp", "cp"]._flatten("pp_cp").get_group()
            if pp > 1:
                group.stage_group = group.fsdp_mesh.get_group()
    if pp > 1:
        group.pipe_group = mesh["pp"].get_group()
        for d in range(dp):
            for c in range(cp):
                column = [d * R + st * cp + c for st in range(pp)]
                taps = dist.new_group(column)
                if rank in column:
                    group.tap_group = taps
    return group
