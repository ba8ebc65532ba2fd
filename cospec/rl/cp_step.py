"""The GRPO policy step and the draft's co-training step under context parallelism.

# T packed tokens of a minibatch, L local tokens (this rank's zigzag shard), V vocab

Every rank of the cp group holds a full replica of the policy, its reference and the draft, and the
same minibatch (the trainer broadcasts the rollouts). Per minibatch, on each rank:
1. zigzag-shard the packed row (`ZigzagLayout`; padding: PAD tokens with loss_mask 0);
2. the policy's forward on the shard with `RingAttention` as its attention and the shard's own
   RoPE positions, the reference's likewise;
3. `minibatch_terms` with the *whole* minibatch's token count as divisor, so the ranks' losses sum
   to the cp = 1 loss (and their gradients to its gradients);
4. all-reduce (sum) the gradients and the summed statistics; every rank then clips the same
   gradient and takes the same optimizer step, so the replicas stay equal.

The draft's data: its TTT unroll at anchor t reads the features at t-1 and the token at t+j, which
may sit on another rank. The detached taps and logits of the shard are all-gathered back into the
unsharded row (`ZigzagLayout.gather`), laid out by anchor (`ttt_steps`) and re-sharded by
`cospec.parallel.draft_cp`, whose ring trunk + branch attention never all-gathers K/V. The gather
moves [T, 3C + V] floats per minibatch (once, not per layer; T only the tokens of the sequences
the draft trains on, `gathered_capture`; V is Vd + 1 for a draft with a reduced head, whose
targets are compressed before the gather); a halo exchange of ttt_steps tokens per chunk edge
would avoid it and is not built.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import Tensor

from cospec.data.packing import sequence_rows
from cospec.data.tokenizer import PAD
from cospec.draft.ttt import TTTBatch, ttt_steps
from cospec.models.precision import autocast
from cospec.parallel.data_parallel import all_reduce_sum
from cospec.parallel.draft_cp import all_reduce_grads, ttt_loss_cp
from cospec.parallel.ring_attention import RingAttention
from cospec.parallel.zigzag import ZigzagLayout
from cospec.rl.policy_step import (PolicyMinibatch, clip_grad_norm, minibatch_terms,
                                   step_if_finite)


def shard_minibatch(mb: PolicyMinibatch, layout: ZigzagLayout, rank: int) -> PolicyMinibatch:
    """This rank's tokens of ``mb`` (padding is PAD, never trained: loss_mask 0)."""
    def part(x: Tensor, value=0) -> Tensor:
        return layout.shard(x, rank, value=value)

    return PolicyMinibatch(tokens=part(mb.tokens, PAD), targets=part(mb.targets, PAD),
                           cu_seqlens=layout.local_cu_seqlens(), loss_mask=part(mb.loss_mask),
                           old_logprobs=part(mb.old_logprobs), advantages=part(mb.advantages),
                           num_tokens=mb.num_tokens, index=mb.index)


def gathered_capture(whole, layout: ZigzagLayout, group, taps: dict[int, Tensor], logits: Tensor,
                     sequences: list[int] | None) -> TTTBatch:
    """The draft's `TTTBatch` of the sequences ``sequences`` (None: all) of ``whole`` (a
    minibatch or microbatch: tokens, cu_seqlens, loss_mask), its ``taps`` and ``logits`` this
    rank's zigzag shards [L, ...]: only those sequences' rows of every shard are gathered
    (`ZigzagLayout.select`). A collective over ``group``."""
    keep, rows = (layout, None) if sequences is None else layout.select(sequences)

    def gather(x: Tensor) -> Tensor:
        x = x.detach() if rows is None else x.detach()[rows.to(x.device)]
        return keep.gather(x, group, dim=0)

    index = None if sequences is None else sequence_rows(whole.cu_seqlens, sequences)
    pick = (lambda x: x) if index is None else (lambda x: x[index])  # noqa: E731
    return TTTBatch(tokens=pick(whole.tokens), loss_mask=pick(whole.loss_mask),
                    cu_seqlens=keep.cu_seqlens.to(whole.cu_seqlens),
                    taps={k: gather(v) for k, v in taps.items()}, policy_logits=gather(logits))


class ContextParallelPolicyStep:
    """`cospec.rl.policy_step.LocalPolicyStep` on zigzag shards (see the module docstring).
    A collective over ``group``: every rank calls it with the same minibatch.

    ``data_parallel`` (dp x cp): ``group`` is the replica's cp group, the policy is FSDP2-sharded
    over every rank (which sums the gradient shares of all ranks, so no cp all-reduce here), the
    minibatch is the replica's share, its loss divided by the token count all-reduced over
    ``dp_group`` (the replicas), and the statistics are summed over the world."""

    def __init__(self, policy, reference, optimizer, *, group, temperature: float, clip_low: float,
                 clip_high: float, kl_coef: float, grad_clip: float, autocast: str = "",
                 data_parallel: bool = False, dp_group=None, draft_targets=None):
        self.policy, self.reference, self.optimizer = policy, reference, optimizer
        self.draft_targets = draft_targets or (lambda logits: logits)  # as in LocalPolicyStep
        self.group, self.autocast = group, autocast
        self.data_parallel, self.dp_group = data_parallel, dp_group
        self.rank, self.cp = dist.get_rank(group), dist.get_world_size(group)
        self.attention = RingAttention(group)
        self.loss_kwargs = dict(temperature=temperature, clip_low=clip_low, clip_high=clip_high,
                                kl_coef=kl_coef)
        self.grad_clip = grad_clip

    def __call__(self, mb: PolicyMinibatch, tap_layers=(),
                 sequences=None) -> tuple[Tensor, float, list[TTTBatch]]:
        device = next(self.policy.parameters()).device
        mb = mb.to(device)
        if self.data_parallel:
            total = all_reduce_sum(torch.tensor(float(mb.num_tokens), device=device), self.dp_group)
            mb = dataclasses.replace(mb, num_tokens=int(total))
        layout = ZigzagLayout.build(mb.cu_seqlens, self.cp)
        local = shard_minibatch(mb, layout, self.rank)
        positions = layout.local_positions(self.rank)[None]
        kwargs = dict(cu_seqlens=local.cu_seqlens, positions_BT=positions, attn_fn=self.attention)
        with autocast(self.autocast, device):
            out = self.policy(local.tokens[None], tap_layers=tap_layers, **kwargs)
            ref_logits = None
            if self.reference is not None:
                with torch.no_grad():
                    ref_logits = self.reference(local.tokens[None], **kwargs).logits[0]
            loss, sums = minibatch_terms(out.logits[0], ref_logits, local, **self.loss_kwargs)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if not self.data_parallel:
            all_reduce_grads(self.policy, self.group)
        grad_norm = step_if_finite(self.optimizer, clip_grad_norm(self.policy.parameters(),
                                                                  self.grad_clip))
        sums = all_reduce_sum(sums, None if self.data_parallel else self.group)
        captured = []
        if tap_layers:
            captured.append(gathered_capture(
                mb, layout, self.group, {k: v[0] for k, v in out.taps.items()},
                self.draft_targets(out.logits[0].detach()), sequences))
        return sums, grad_norm, captured


class ContextParallelDraftLoss:
    """The co-training loss of one `TTTBatch` (the same whole row on every rank), computed on
    zigzag shards: ``(loss, metrics)`` like `cospec.draft.ttt.ttt_loss`, where loss is this rank's
    share (the ranks' shares sum to the cp = 1 loss) and metrics are the all-reduced, whole-row ones.
    Call `reduce_grads` after backward and before the optimizer step.

    ``sum_group`` (under dp; default: ``group``): the ranks training copies of the draft, over
    which the masked means' counts, the metrics and the draft's gradients are summed (dp x cp: the
    world, None; dp x pp x cp: the last stage's ranks in every replica); ``group`` stays the
    replica's cp group, where the ring runs."""

    def __init__(self, group, sum_group="cp"):
        self.group = group
        self.rank, self.cp = dist.get_rank(group), dist.get_world_size(group)
        self.sum_group = group if sum_group == "cp" else sum_group

    def __call__(self, draft, batch: TTTBatch, *, num_steps: int, **loss_kwargs) -> tuple[Tensor, dict]:
        layout = ZigzagLayout.build(batch.cu_seqlens, self.cp)
        steps = ttt_steps(draft, batch, num_steps)
        loss, metrics = ttt_loss_cp(draft, steps, layout, rank=self.rank, group=self.group,
                                    count_group=self.sum_group, **loss_kwargs)
        shares = torch.tensor([metrics["ce"], metrics["tv"]], dtype=torch.float64, device=loss.device)
        shares = all_reduce_sum(shares, self.sum_group)
        ce, tv = shares.tolist()
        return loss, {"ce": ce, "tv": tv, "acceptance": [1 - x for x in tv]}

    def reduce_grads(self, draft) -> None:
        all_reduce_grads(draft, self.sum_group)
