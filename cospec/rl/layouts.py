"""The policy step of the run's layout (one process, context parallel, pipelined), with what it
needs around it: the trained module (the whole policy, or this rank's stage), the KL reference, the
optimizer, the weight syncs to the rollout engine's copies, and the draft's loss under that layout.

The trainer (`cospec.rl.trainer`) builds one `PolicyLayout` and does not otherwise know which
layout it runs; `cospec.parallel.train_group` says which rank does what.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch

from cospec.config import ConfigError, RunConfig
from cospec.draft.losses import draft_targets
from cospec.draft.ttt import ttt_loss
from cospec.rl.policy_step import LocalPolicyStep
from cospec.rl.weight_sync import InProcessWeightSync


@dataclass
class PolicyLayout:
    """policy: this rank's trained module; reference: the frozen KL anchor (None when no KL is
    computed); policy_step: called once per minibatch (`cospec.rl.policy_step`); weight_sync /
    draft_sync: push trained weights to the engine's copies (None where this rank sends nothing);
    draft_loss, reduce_draft_grads: the co-training loss and, under cp, the gradient reduction."""

    policy: torch.nn.Module
    reference: torch.nn.Module | None
    optimizer: torch.optim.Optimizer
    policy_step: Callable
    weight_sync: object | None
    draft_sync: object | None
    draft_loss: Callable = ttt_loss
    reduce_draft_grads: Callable | None = None


def build_policy_layout(cfg: RunConfig, policy, *, group, draft, rollout_policy,
                        rollout_draft) -> PolicyLayout:
    """The `PolicyLayout` of ``group`` (None: one process)."""
    g = cfg.grpo
    pp = group.pp if group is not None else 1
    if pp > 1:
        return _pipelined(cfg, policy, group, draft, rollout_policy, rollout_draft)
    if group is not None and group.dp > 1:
        return _data_parallel(cfg, policy, group, draft, rollout_policy, rollout_draft)
    trained = policy.train()
    reference = (copy.deepcopy(policy).eval().requires_grad_(False)  # KL anchor
                 if g.log_kl or g.kl_coef else None)
    optimizer = _adamw(trained, cfg)
    kwargs = _step_kwargs(cfg, draft)
    generates = group is None or group.generates
    syncs = dict(weight_sync=InProcessWeightSync(rollout_policy) if generates else None,
                 draft_sync=InProcessWeightSync(rollout_draft) if rollout_draft is not None else None)
    if group is None:
        step = LocalPolicyStep(trained, reference, optimizer, autocast=g.autocast, **kwargs)
        return PolicyLayout(trained, reference, optimizer, step, **syncs)
    from cospec.rl.cp_step import ContextParallelDraftLoss, ContextParallelPolicyStep

    step = ContextParallelPolicyStep(trained, reference, optimizer, group=None, autocast=g.autocast,
                                     **kwargs)
    cp_loss = ContextParallelDraftLoss(group=None)
    return PolicyLayout(trained, reference, optimizer, step, **syncs, draft_loss=cp_loss,
                        reduce_draft_grads=cp_loss.reduce_grads)


def _data_parallel(cfg: RunConfig, policy, group, draft, rollout_policy,
                   rollout_draft) -> PolicyLayout:
    """dp > 1: the policy, its reference and a co-trained draft sharded with FSDP2 over every rank
    (the dp replicas and, under dp x cp, each replica's cp ranks: FSDP2's sum then adds up every
    rank's share); every replica syncs its own engine (`cospec.parallel.data_parallel`)."""
    from cospec.parallel.data_parallel import ShardedWeightSync, shard_draft, shard_policy
    from cospec.rl.dp_step import DataParallelDraftLoss, DataParallelPolicyStep

    g, mesh = cfg.grpo, group.fsdp_mesh
    reference = None
    if g.log_kl or g.kl_coef:  # the KL anchor, sharded like the policy
        reference = shard_policy(copy.deepcopy(policy).eval().requires_grad_(False), mesh)
    trained = shard_policy(policy.train(), mesh)
    optimizer = _adamw(trained, cfg)  # over the shards: AdamW's state is sharded too
    if group.cp > 1:
        from cospec.rl.cp_step import ContextParallelDraftLoss, ContextParallelPolicyStep

        step = ContextParallelPolicyStep(trained, reference, optimizer, group=group.cp_group,
                                         autocast=g.autocast, data_parallel=True,
                                         dp_group=group.dp_group, **_step_kwargs(cfg, draft))
        draft_loss = ContextParallelDraftLoss(group=group.cp_group, sum_group=None)
    else:
        step = DataParallelPolicyStep(trained, reference, optimizer, group=None,
                                      autocast=g.autocast, **_step_kwargs(cfg, draft))
        draft_loss = DataParallelDraftLoss(group=None)
    reduce_draft_grads = draft_loss.reduce_grads
    draft_sync = InProcessWeightSync(rollout_draft) if rollout_draft is not None else None
    if draft is not None and cfg.draft.mode == "cotrain":  # sharded: FSDP2 sums its gradients
        draft_loss, reduce_draft_grads = shard_draft(draft, draft_loss, mesh), None
        draft_sync = ShardedWeightSync(rollout_draft)
    # every rank takes part in the all-gathers; the replica's generating rank keeps the weights
    return PolicyLayout(trained, reference, optimizer, step,
                        weight_sync=ShardedWeightSync(rollout_policy), draft_sync=draft_sync,
                        draft_loss=draft_loss, reduce_draft_grads=reduce_draft_grads)


def _pipelined(cfg: RunConfig, policy, group, draft, rollout_policy, rollout_draft) -> PolicyLayout:
    """pp > 1: this rank's stage, its reference stage, the pipelined step; in every replica the
    stages of cp column 0 make up the policy that replica's engine gets, the other columns hold
    equal replicas and send nothing; under cp the last stage's cp ranks co-train the draft on
    zigzag shards. Under dp x pp each stage (and its reference) is FSDP2-sharded over the ranks
    holding it in every replica, and the replicas' last stages co-train copies of the draft."""
    from cospec.parallel.pipeline import build_stage, split_layers
    from cospec.rl.pp_step import DraftWeightSync, PipelinedPolicyStep, StageWeightSync

    layers = split_layers(cfg.model.num_layers, group.pp)
    stage = dict(layers=layers[group.stage], stage=group.stage, num_stages=group.pp)
    trained = build_stage(policy, **stage).train()
    reference = build_stage(policy, **stage).eval().requires_grad_(False)
    sharded = group.dp > 1
    if sharded:
        from cospec.parallel.data_parallel import shard_policy

        mesh = group.fsdp_mesh  # the ranks holding this stage in every replica
        trained, reference = shard_policy(trained, mesh), shard_policy(reference, mesh)
    optimizer = _adamw(trained, cfg)
    taps = draft.tap_layers if draft is not None and cfg.draft.mode == "cotrain" else ()
    step = PipelinedPolicyStep(
        trained, reference, optimizer, stage=group.stage, stage_layers=layers,
        pipe_group=group.pipe_group, tap_group=group.tap_group, cp_group=group.cp_group,
        dp_group=group.dp_group, data_parallel=sharded,
        num_microbatches=cfg.parallel.microbatches, schedule=cfg.parallel.schedule,
        tap_layers=taps, autocast=cfg.grpo.autocast, **_step_kwargs(cfg, draft))
    feeds_engine = group.cp_rank == 0  # the pipeline of cp column 0 gathers for the engine
    weight_sync = (StageWeightSync(group.pipe_group if feeds_engine else None, rollout_policy,
                                   dst=group.replica_first_rank)
                   if feeds_engine or sharded else None)
    layout = PolicyLayout(
        trained, reference, optimizer, step, weight_sync=weight_sync,
        draft_sync=(DraftWeightSync(rollout_draft, src=group.replica_draft_rank,
                                    dst=group.replica_first_rank, owner=group.owns_draft)
                    if draft is not None else None))
    # the draft's loss and gradients summed over its trainers: the last stage's cp ranks, and
    # under dp those of every replica (the last stage's stage group)
    if sharded and group.cp > 1:
        from cospec.rl.cp_step import ContextParallelDraftLoss

        cp_loss = ContextParallelDraftLoss(group=group.cp_group, sum_group=group.stage_group)
    elif sharded:
        from cospec.rl.dp_step import DataParallelDraftLoss

        cp_loss = DataParallelDraftLoss(group=group.stage_group)
    elif group.cp > 1:
        from cospec.rl.cp_step import ContextParallelDraftLoss

        cp_loss = ContextParallelDraftLoss(group=group.cp_group)
    else:
        return layout
    layout.draft_loss, layout.reduce_draft_grads = cp_loss, cp_loss.reduce_grads
    if sharded and group.owns_draft and cfg.draft.mode == "cotrain":
        from cospec.parallel.data_parallel import shard_draft

        layout.draft_loss = shard_draft(draft, cp_loss, group.fsdp_mesh)
        layout.reduce_draft_grads = None
    return layout


def check_rl_config(cfg: RunConfig) -> None:
    """ConfigError for what GRPO training cannot do: its logprobs are of the temperature-scaled
    distribution only; greedy rollouts give no group variance."""
    s = cfg.sampling
    if s.top_k != 0 or s.top_p != 1.0:
        raise ConfigError("sampling.top_k/top_p: must be off (0 / 1.0) for RL: the trainer's "
                          "logprobs are of the temperature-scaled distribution only")
    if s.temperature == 0:
        raise ConfigError("sampling.temperature: must be > 0 for RL (greedy rollouts have no "
                          "group variance to learn from)")


def _adamw(module, cfg: RunConfig) -> torch.optim.AdamW:
    """The policy's AdamW, fused: one kernel over all tensors instead of a loop of small ops
    (SmolLM2-135M on 2 CPU cores: 0.08 s a step against 0.36 s, the same update)."""
    g = cfg.grpo
    return torch.optim.AdamW(module.parameters(), lr=g.lr, betas=(0.9, 0.99),
                             weight_decay=g.weight_decay, fused=True)


def _step_kwargs(cfg: RunConfig, draft) -> dict:
    """The policy step's loss settings, and the form it keeps the logits in for the draft."""
    g, t = cfg.grpo, cfg.sampling.temperature
    return dict(temperature=t, clip_low=g.clip_low, clip_high=g.clip_high, kl_coef=g.kl_coef,
                grad_clip=g.grad_clip,
                draft_targets=draft_targets(getattr(draft, "vocab_ids", None), t))
