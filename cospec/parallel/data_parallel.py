"""Data parallelism: FSDP2 sharding of the trained policy over the dp axis, and what goes with it.

# P parameters of a module, dp replicas

Under ``parallel.dp`` every rank is a replica: it generates its share of the step's prompt groups
with its own engine (a full inference copy of the policy and the draft), and trains on them. The
trained policy is sharded with FSDP2 (`torch.distributed.fsdp.fully_shard`, one unit per decoder
layer and one for the rest): each of the N ranks it shards over (dp, or dp x cp) keeps 1/N of
every parameter, of its gradient and of the AdamW state; a forward all-gathers a layer's parameters just before it runs and frees them after
it, the backward reduce-scatters the gradients.

Loss scale: each rank's loss is its tokens' share of the *global* minibatch mean (divided by the
all-reduced token count), so the gradients must be *summed* over replicas, not averaged as FSDP2
does by default (`set_gradient_divide_factor(1)`): then any dp computes the single-process step.
Gradient clipping on DTensor gradients measures the global norm (the clip all-reduces the
squared shard norms).

The co-trained draft is sharded the same way (`shard_draft`): its TTT unroll calls the draft's
submodules directly, outside any forward FSDP2 could hook its all-gathers onto, so the whole
co-training loss runs as the forward of a small wrapper module that FSDP2 shards: the draft is
gathered for the loss and its backward, and its gradients reduce-scattered (summed) after.

Weight sync: each replica's engine takes the full weights by all-gathering the shards
(`ShardedWeightSync`): every rank receives (P - P/N) numbers for N sharding ranks, none passes
through one rank, and no object is pickled.

dp x cp: the policy is sharded over all dp x cp ranks (torchtitan's flattened "dp_shard_cp"): a
replica's cp ranks each compute their zigzag shard's share of the loss, and the one reduce-scatter
sums the shares of every rank, so the cp all-reduce of the gradients is not needed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from cospec.parallel.launch import backend_device


def shard_policy(model: nn.Module, mesh) -> nn.Module:
    """FSDP2 over ``mesh``: one unit per decoder layer, the root (embedding, final norm, head) one
    more; gradients summed over replicas (module docstring). Returns the same module, sharded."""
    units = [*model.layers.values(), model]
    for unit in units:
        # The root too: FSDP2 keeps a root unsharded after its forward by default, for the
        # backward; the KL reference never runs one, so it would hold the whole root all step.
        fully_shard(unit, mesh=mesh, reshard_after_forward=True)
    for unit in units:  # a unit's setting covers its own parameters only
        unit.set_gradient_divide_factor(1.0)
        # a plain SUM reduce-scatter: gloo has no pre-multiplied sum (NCCL does; the factor is 1)
        unit.set_force_sum_reduction_for_comms(True)
    return model


class _DraftLoss(nn.Module):
    """The draft's co-training loss as a forward, so that FSDP2 has one to hook onto."""

    def __init__(self, draft: nn.Module, loss_fn):
        super().__init__()
        self.draft, self.loss_fn = draft, loss_fn

    def forward(self, batch, **kwargs):
        return self.loss_fn(self.draft, batch, **kwargs)


def shard_draft(draft: nn.Module, loss_fn, mesh):
    """FSDP2 over the draft (``mesh``: the ranks that co-train copies of it), gradients summed like
    the policy's; returns the loss to give `cotrain_draft`, called as ``loss(draft, batch, ...)``.
    Set the draft's requires_grad flags before, and build its optimizer after (the parameters
    become DTensor shards)."""
    module = _DraftLoss(draft, loss_fn)
    fully_shard(module, mesh=mesh, reshard_after_forward=True)
    module.set_gradient_divide_factor(1.0)
    module.set_force_sum_reduction_for_comms(True)

    def sharded_loss(_draft, batch, **kwargs):
        return module(batch, **kwargs)

    return sharded_loss


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly sharded) parameter or gradient (a collective for a DTensor)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly sharded) tensor, sharing its storage."""
    return t.to_local() if isinstance(t, DTensor) else t


class ShardedWeightSync:
    """`cospec.rl.weight_sync.WeightSync` from a sharded model into this rank's engine copy: the
    shards all-gathered over the FSDP2 group, parameter by parameter (a collective: every rank
    pushes at the same time, each replica's first rank into its own engine)."""

    def __init__(self, target: nn.Module | None):
        self.target = target  # None on a rank without an engine (dp x cp: all but a replica's first)
        self.num_pushes = 0

    @torch.no_grad()
    def push(self, model: nn.Module) -> None:
        src = model.state_dict()
        dst = self.target.state_dict() if self.target is not None else None
        if dst is not None and src.keys() != dst.keys():
            raise ValueError(f"weight sync: models differ: {sorted(set(src) ^ set(dst))[:5]}")
        for name, t in src.items():  # the same order on every rank: these are collectives
            whole = full_tensor(t)
            if dst is not None:
                dst[name].copy_(whole)
        self.num_pushes += 1


def _on_backend_device(t: torch.Tensor, group) -> torch.Tensor:
    """``t`` where the group's backend reads it (`backend_device`); gloo reads CUDA ones too."""
    device = backend_device(group)
    return t.to(device) if device.type == "cuda" else t


def all_reduce_sum(t: torch.Tensor, group=None) -> torch.Tensor:
    """A summed copy of ``t`` over the group (on ``t``'s device)."""
    out = _on_backend_device(t.detach().clone(), group)
    dist.all_reduce(out, group=group)
    return out.to(t.device)


def all_gather_rows(t: torch.Tensor, group=None) -> torch.Tensor:
    """The ranks' equally long tensors concatenated along dim 0, in rank order (on ``t``'s
    device)."""
    local = _on_backend_device(t.contiguous(), group)
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    return torch.cat(parts).to(t.device)


class GatherOncePerStep:
    """For a pipeline stage sharded with FSDP2: its M microbatches' forwards and backwards would
    each all-gather the stage again (units reshard after every forward and backward), and every
    backward would reduce-scatter its gradients. Inside this context the stage is gathered at
    its first forward and stays whole until the step ends, and gradients accumulate unsharded until
    the step's last backward (`sync_on`), which reduce-scatters them once: one all-gather and one
    reduce-scatter a step instead of 2M and M, for the whole stage's parameters and gradients held
    whole meanwhile (torchtitan makes the same trade under pipeline parallelism)."""

    def __init__(self, model: nn.Module, *, train: bool = True):
        self.units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        self.root, self.train = model, train

    def __enter__(self):
        self.root.set_reshard_after_forward(False)
        if self.train:
            self.root.set_reshard_after_backward(False)
            self.root.set_requires_gradient_sync(False)
        return self

    def sync_on(self, m: int, is_last: bool) -> None:
        """`PipelineStep.before_backward`: gradients are reduced at the last backward only."""
        if self.train:
            self.root.set_requires_gradient_sync(is_last)
            self.root.set_reshard_after_backward(is_last)

    def __exit__(self, *exc):
        self.root.set_reshard_after_forward(True)
        if self.train:
            self.root.set_reshard_after_backward(True)
            self.root.set_requires_gradient_sync(True)
        for unit in self.units:
            unit.reshard()
        return False
