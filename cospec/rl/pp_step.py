"""The GRPO policy step pipelined over stages, the draft fed by TapChannel on the last stage.

# T packed tokens, C hidden size, V vocab, M microbatches, P pipeline stages

One rank per stage (under the pp x cp mesh, cp ranks per stage, each on its zigzag shard of every
microbatch; the pipeline runs per cp column); every rank holds the same minibatch (the trainer
broadcasts the rollouts) and splits it the same way into M microbatches of whole sequences (`PolicyMinibatch.split`). Per
minibatch, on each stage:
1. Reference pass (forward only, no graph): the frozen reference's stages run the M microbatches
   through the pipe in order; the last stage keeps the reference logits [T, V] of each, which the
   loss needs for the KL (penalty or log). It is a pass of its own on the same pipeline group,
   finished before the training schedule starts, so the schedule's operations are unchanged.
2. The training schedule (`PipelineStep`, 1F1B or GPipe). The last stage's loss of microbatch m is
   `minibatch_terms` with the whole minibatch's token count as divisor: the microbatches' losses sum
   to the pp = 1 loss, and so do the gradients each stage accumulates.
3. Gradient clipping across stages: the global norm is sqrt of the all-reduced sum of the stages'
   squared norms (what `torch.nn.utils.clip_grad_norm_` computes on one process), then every stage
   scales by the same min(1, max_norm / (norm + 1e-6)) and steps its own optimizer.
4. The summed statistics are broadcast from the last stage, so rank 0 can log them.

When the draft is co-trained the same schedule carries its features: `TapChannel` (its own group)
delivers the tapped layers of microbatch m to the last stage, where `TapCapture` keeps them with
its detached logits of m; the microbatches' data are packed back into the minibatch's `TTTBatch`,
and the trainer's co-training (`cotrain_draft`) runs on it there, exactly as on one process.

Weights reach the rollout engine on rank 0 through `StageWeightSync` (the stages' state dicts,
sent as tensors) and, for the draft, `DraftWeightSync` (last stage -> rank 0).
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import Tensor, nn

from cospec.draft.ttt import TTTBatch
from cospec.models.precision import autocast
from cospec.parallel.data_parallel import (GatherOncePerStep, all_reduce_sum, full_tensor,
                                           local_tensor)
from cospec.parallel.pipeline import Microbatch, PipelineStep, PipeTransport, TapCapture
from cospec.parallel.tensor_transfer import StateDictReceiver, StateDictSender
from cospec.parallel.tap_channel import TapChannel
from cospec.rl.policy_step import SUMS, PolicyMinibatch, minibatch_terms, step_if_finite


def clip_grad_norm_across_stages(params, max_norm: float, group) -> Tensor:
    """Step 3: the global gradient norm of all stages' ``params``; clipped in place if max_norm > 0.
    ``group``: the ranks whose gradients together hold every gradient entry once (the pipeline;
    under dp x pp the world, each rank holding its FSDP2 shards of its stage's)."""
    grads = [local_tensor(p.grad) for p in params if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    sq = torch.zeros((), device=device, dtype=torch.float32)
    for g in grads:
        sq = sq + g.detach().float().pow(2).sum()
    dist.all_reduce(sq, group=group)
    total = sq.sqrt()
    if max_norm > 0:
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
    return total


def by_microbatch(sequences: list[int] | None, microbatches) -> dict[int, list[int]] | None:
    """The minibatch's ``sequences`` (increasing indices; None: all) as each microbatch's own
    indices (microbatches of consecutive whole sequences, in order)."""
    if sequences is None:
        return None
    out, first = {}, 0
    for m in microbatches:
        n = len(m.cu_seqlens) - 1
        out[m.index] = [i - first for i in sequences if first <= i < first + n]
        first += n
    return out


class PipelinedPolicyStep:
    """`cospec.rl.policy_step.LocalPolicyStep` over pipeline stages (see the module docstring).

    model, reference: this rank's stage of the policy and of the reference (`build_stage`);
    stage_layers: every stage's layer range (`split_layers`); tap_layers: the draft's (the channel
    is built for them; a call with no tap_layers runs without taps); draft_targets: the form the
    last stage keeps its logits in for the draft, and a call's ``sequences`` those it keeps
    (microbatch by microbatch, as they come), as in `LocalPolicyStep`; autocast: the forwards'
    mixed precision (`grpo.autocast`), on every stage.
    """

    def __init__(self, model, reference, optimizer, *, stage: int, stage_layers: list[range],
                 pipe_group, tap_group, num_microbatches: int, schedule: str, tap_layers=(),
                 cp_group=None, dp_group=None, data_parallel: bool = False, temperature: float,
                 clip_low: float, clip_high: float, kl_coef: float, grad_clip: float,
                 autocast: str = "", draft_targets=None):
        self.model, self.reference, self.optimizer = model, reference, optimizer
        self.draft_targets, self.autocast = draft_targets, autocast
        self.stage, self.num_stages = stage, len(stage_layers)
        self.first, self.last = stage == 0, stage == self.num_stages - 1
        self.pipe_group, self.num_microbatches, self.schedule = pipe_group, num_microbatches, schedule
        self.tap_group, self.stage_layers = tap_group, stage_layers
        # pp x cp: this stage is held by the ranks of cp_group, each running it on its zigzag shard
        # of every microbatch with ring attention inside the group.
        self.cp_group = cp_group
        # dp x pp: the stage is FSDP2-sharded over every replica's ranks of it (which sums the
        # replicas' and cp ranks' gradient shares); the minibatch is the replica's share, its loss
        # divided by the token count summed over dp_group (this rank's place in every replica).
        self.data_parallel, self.dp_group = data_parallel, dp_group
        self.cp = dist.get_world_size(cp_group) if cp_group is not None else 1
        self.cp_rank = dist.get_rank(cp_group) if cp_group is not None else 0
        if cp_group is not None:
            from cospec.parallel.ring_attention import RingAttention

            model.attn_fn = reference.attn_fn = RingAttention(cp_group)
        self.transport = PipeTransport(pipe_group, stage, self.num_stages)
        self.ref_transport = PipeTransport(pipe_group, stage, self.num_stages)
        self.last_rank = dist.get_process_group_ranks(pipe_group)[-1]
        self.loss_kwargs = dict(temperature=temperature, clip_low=clip_low, clip_high=clip_high,
                                kl_coef=kl_coef)
        self.grad_clip = grad_clip
        self.tap_layers = tuple(tap_layers)
        self.taps, self._tap_hooks = None, []
        self.num_steps = 0  # the taps' step stamp

    def _channel_for(self, mbs: list[PolicyMinibatch]) -> TapChannel:
        """The TapChannel, (re)built when a microbatch outgrows its landing slots: every rank sees
        the same microbatches, so all of them rebuild at the same step, with the same size."""
        need = max(len(m.tokens) for m in mbs)
        if self.taps is None or need > self.taps.max_tokens:
            for handle in self._tap_hooks:
                handle.remove()
            like = next(self.model.parameters())
            self.taps = TapChannel(self.tap_group, stage=self.stage, stage_layers=self.stage_layers,
                                   tap_layers=self.tap_layers, max_microbatches=self.num_microbatches,
                                   max_tokens=2 * need, hidden_size=self.model.config.hidden_size,
                                   dtype=like.dtype, device=like.device)
            self._tap_hooks = self.taps.attach(self.model)
        return self.taps

    @torch.no_grad()
    def reference_logits(self, mbs: list[PolicyMinibatch]) -> list[Tensor]:
        """Step 1: the reference's logits of every microbatch on the last stage ([] elsewhere)."""
        t, like = self.ref_transport, next(self.model.parameters())
        logits = []
        for mb in mbs:
            pos = mb.positions[None] if mb.positions is not None else None
            x = None
            if not self.first:
                x = t.recv(like, (1, len(mb.tokens), self.model.config.hidden_size), self.stage - 1,
                           "ref_act", mb.index)
            with autocast(self.autocast, like.device):
                if self.first:
                    out = self.reference(mb.tokens[None], cu_seqlens=mb.cu_seqlens,
                                         positions_BT=pos)
                else:
                    out = self.reference(inputs_embeds=x, cu_seqlens=mb.cu_seqlens,
                                         positions_BT=pos)
            if self.last:
                logits.append(out.logits[0])
            else:
                t.send(out.hidden.to(like.dtype), self.stage + 1, "ref_act", mb.index)
        t.finish()
        return logits

    def __call__(self, mb: PolicyMinibatch, tap_layers=(),
                 sequences=None) -> tuple[Tensor, float, list[TTTBatch]]:
        if tap_layers and tuple(tap_layers) != self.tap_layers:
            raise ValueError(f"tap_layers {tuple(tap_layers)}: the TapChannel was built for "
                             f"{self.tap_layers}")
        device = next(self.model.parameters()).device
        if self.data_parallel:
            total = all_reduce_sum(torch.tensor(float(mb.num_tokens), device=device), self.dp_group)
            mb = dataclasses.replace(mb, num_tokens=int(total))
        mbs, wholes, layouts = self._split(mb, device)
        with self._gathered(self.reference, train=False):
            ref_logits = self.reference_logits(mbs)
        sums: list[Tensor] = []

        def loss_fn(logits_TV: Tensor, micro: Microbatch) -> Tensor:
            loss, s = minibatch_terms(logits_TV, ref_logits[micro.index], mbs[micro.index],
                                      **self.loss_kwargs)
            sums.append(s)
            return loss

        with_taps = bool(tap_layers)
        taps = self._channel_for(mbs) if with_taps else None
        capture = None
        if with_taps and self.last:  # the draft's inputs; it trains after the step (cotrain_draft)
            gather = None
            if layouts is not None:  # pp x cp: the rows the draft keeps, gathered into sequences
                from cospec.rl.cp_step import gathered_capture

                def gather(micro, feats, logits, keep):
                    return gathered_capture(wholes[micro.index], layouts[micro.index],
                                            self.cp_group, feats, logits, keep)
            capture = TapCapture(taps, self.tap_layers, to_batch=gather,
                                 keep_logits=self.draft_targets,
                                 sequences=by_microbatch(sequences, wholes))
        self.optimizer.zero_grad(set_to_none=True)
        with self._gathered(self.model) as gathered:
            step = PipelineStep(self.model, self.transport, loss_fn, schedule=self.schedule,
                                taps=taps, on_last_backward=capture,
                                before_backward=gathered.sync_on if gathered else None,
                                autocast=self.autocast)
            step.run([Microbatch(tokens=m.tokens, cu_seqlens=m.cu_seqlens, targets=m.targets,
                                 loss_mask=m.loss_mask, index=m.index, positions=m.positions)
                      for m in mbs], step=self.num_steps)
        self.num_steps += 1
        self._sum_gradients_over_cp()
        grad_norm = step_if_finite(self.optimizer, clip_grad_norm_across_stages(
            list(self.model.parameters()), self.grad_clip,
            None if self.data_parallel else self.pipe_group))
        sums = self._broadcast_sums(sums, device)
        if self.data_parallel:
            sums = all_reduce_sum(sums, self.dp_group)
        captured = capture.take() if capture is not None else None
        return sums, grad_norm, [captured] if captured is not None else []

    def _gathered(self, model, train: bool = True):
        """dp x pp: the stage gathered once for all the step's microbatches (`GatherOncePerStep`);
        otherwise nothing."""
        return GatherOncePerStep(model, train=train) if self.data_parallel else nullcontext()

    def _split(self, mb: PolicyMinibatch, device) -> tuple[list[PolicyMinibatch],
                                                           list[PolicyMinibatch], list | None]:
        """The minibatch's M microbatches on the device as this rank runs them (under pp x cp, its
        zigzag shard of each), the whole microbatches, and their `ZigzagLayout`s (None without cp)."""
        wholes = [m.to(device) for m in mb.split(self.num_microbatches)]  # split on the host
        if self.cp_group is None:
            return wholes, wholes, None
        from cospec.rl.cp_step import shard_minibatch
        from cospec.parallel.zigzag import ZigzagLayout

        layouts = [ZigzagLayout.build(m.cu_seqlens, self.cp) for m in wholes]
        mbs = [shard_minibatch(m, lay, self.cp_rank) for m, lay in zip(wholes, layouts)]
        for m, lay in zip(mbs, layouts):
            m.positions = lay.local_positions(self.cp_rank)
        return mbs, wholes, layouts

    def _sum_gradients_over_cp(self) -> None:
        """Under pp x cp, the stage's replicas each hold their shards' gradients: sum them (under
        dp x pp x cp FSDP2 has summed them)."""
        if self.cp_group is None or self.data_parallel:
            return
        for p in self.model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.cp_group)

    def _broadcast_sums(self, sums: list[Tensor], device) -> Tensor:
        """Step 4: the minibatch's summed statistics (`SUMS`) from the last stage, on every rank."""
        total = torch.stack(sums).sum(0) if self.last else torch.zeros(len(SUMS), device=device)
        if self.last and self.cp_group is not None:
            dist.all_reduce(total, group=self.cp_group)
        dist.broadcast(total, self.last_rank, group=self.pipe_group)
        return total


class StageWeightSync:
    """The seam of `cospec.rl.weight_sync` for a pipelined policy: ``push(stage)`` is a collective
    over ``group`` (a replica's pipeline of cp column 0): every stage sends its state dict
    (checkpoint names) to rank ``dst``, which copies the stages into ``target`` (the replica's
    rollout engine; None on other ranks). Tensors only (`cospec.parallel.tensor_transfer`; the
    names and shapes go once, at the first push). Under dp x pp the stage's FSDP2 shards are
    all-gathered first, on every rank of the stage; a rank outside the pipeline that feeds the
    engine (``group`` None: another cp column) stops there."""

    def __init__(self, group, target: nn.Module | None, dst: int = 0):
        self.group, self.target, self.dst = group, target, dst
        self.num_pushes = 0
        self._sender, self._receivers = None, None

    @torch.no_grad()
    def push(self, stage: nn.Module) -> None:
        state = {k: full_tensor(v).detach() for k, v in stage.state_dict().items()}
        if self.group is None:
            return
        self.num_pushes += 1
        if dist.get_rank() != self.dst:
            self._sender = self._sender or StateDictSender(self.dst)
            self._sender.send(state)
            return
        if self._receivers is None:
            self._receivers = [StateDictReceiver(r) for r in dist.get_process_group_ranks(self.group)
                               if r != self.dst]
        merged = dict(state)
        for receiver in self._receivers:
            merged.update(receiver.receive())
        dst = self.target.state_dict()
        if merged.keys() != dst.keys():
            raise ValueError(f"stage weight sync: the stages' weights do not make up the policy: "
                             f"{sorted(set(merged) ^ set(dst))[:5]}")
        for name, t in dst.items():
            t.copy_(merged[name])


class DraftWeightSync:
    """The draft's weights from the stage that trains it (``src``) to the rollout engine's copy on
    ``dst``; ``push(draft)`` is called on both (other ranks: no-op). Tensors only, as above. Under
    dp x pp the draft is FSDP2-sharded over its trainers (``owner``): they all-gather it first."""

    def __init__(self, target: nn.Module | None, *, src: int, dst: int = 0, owner: bool = False):
        self.target, self.src, self.dst, self.owner = target, src, dst, owner
        self._sender, self._receiver = None, None

    @torch.no_grad()
    def push(self, draft: nn.Module) -> None:
        rank = dist.get_rank()
        if self.owner:  # a collective among the draft's trainers when it is sharded
            state = {k: full_tensor(v) for k, v in draft.state_dict().items()}
        if self.src == self.dst:
            if rank == self.dst:
                for name, t in self.target.state_dict().items():
                    t.copy_(state[name])
            return
        if rank == self.src:
            self._sender = self._sender or StateDictSender(self.dst)
            self._sender.send(state)
        elif rank == self.dst:
            self._receiver = self._receiver or StateDictReceiver(self.src)
            state = self._receiver.receive()
            for name, t in self.target.state_dict().items():
                t.copy_(state[name])
