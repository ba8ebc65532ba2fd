"""The draft's training-time-test loss under context parallelism.

# J TTT steps, T packed tokens, L local tokens (this rank's zigzag shard)

Step j at anchor t reads the token at t + j, which may sit on another rank once the row is
zigzag-sharded; so the unroll's inputs are laid out by anchor on the whole row first (`ttt_steps`:
every field indexed by t), then every field is sharded with the zigzag plan (`shard_ttt_steps`).
Each rank then runs the same unroll on its shard with the ring version of the trunk + branch
attention: the step-1 (trunk) K/V travel the ring, the branch K/V of steps 2..j stay on the rank of
their anchor. The masked means divide by the all-reduced count of trained tokens, so the ranks'
losses, and their gradients, sum to the single-process ones; summing the draft's parameter
gradients over the group (`all_reduce_grads`) gives exactly the cp = 1 gradients.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import Tensor

from cospec.data.tokenizer import PAD
from cospec.draft.ttt import TTTSteps, ttt_loss_on_steps
from cospec.models.draft import TappedDraft
from cospec.parallel.data_parallel import all_reduce_sum
from cospec.parallel.ring_attention import ring_trunk_branch_attention
from cospec.parallel.zigzag import ZigzagLayout


def shard_ttt_steps(layout: ZigzagLayout, steps: TTTSteps, rank: int) -> TTTSteps:
    """This rank's part of every field (padding: PAD tokens, nothing trained)."""
    return TTTSteps(feat_raw_TF=layout.shard(steps.feat_raw_TF, rank, dim=0),
                    tokens_JT=layout.shard(steps.tokens_JT, rank, dim=1, value=PAD),
                    inside_JT=layout.shard(steps.inside_JT, rank, dim=1, value=False),
                    targets_JTV=layout.shard(steps.targets_JTV, rank, dim=1),
                    mask_JT=layout.shard(steps.mask_JT, rank, dim=1, value=False),
                    positions_T=layout.local_positions(rank).to(steps.positions_T.device))


def ttt_loss_cp(draft: TappedDraft, steps: TTTSteps, layout: ZigzagLayout, *, rank: int,
                group: dist.ProcessGroup | None = None, count_group="cp",
                **loss_kwargs) -> tuple[Tensor, dict]:
    """This rank's share of `ttt_loss` (a collective over ``group``): the ranks' values sum to the
    cp = 1 loss. ``steps``: `ttt_steps` of the whole packed row (the same on every rank).
    ``count_group``: where the trained-token counts are summed ("cp": ``group``; under dp x cp
    the world, None, so that the shares of every replica sum to the whole step's loss)."""
    local = shard_ttt_steps(layout, steps, rank)
    attention = functools.partial(ring_trunk_branch_attention, group=group)
    counts = group if count_group == "cp" else count_group
    return ttt_loss_on_steps(draft, local, layout.local_cu_seqlens(), attention=attention,
                             total_count=functools.partial(all_reduce_sum, group=counts),
                             sharded=True, **loss_kwargs)


def all_reduce_grads(model: torch.nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Sum every parameter's gradient over the group (what each rank computed for its shard)."""
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
