"""Co-training: one step of the draft on the features and logits the GRPO forward captured.

The policy step returns its tapped features and logits detached (`TTTBatch`es), so the draft
trains on the policy as it is at this step without a forward of its own (EAGLE-3's training-time
test unroll, `cospec.draft.ttt`; docs/design.md, "EAGLE-3 training-time test"). A draft update
whose gradient is not finite is skipped and counted, never applied: the trainer then refuses to
sync a draft with a NaN weight to the rollout engine, where it would stop the next rollout.
"""

from __future__ import annotations

import dataclasses
import random

import torch

from cospec.config import DraftConfig
from cospec.draft.ttt import (TTTBatch, choose_sequences, cpu_bucket, pad_to_bucket,
                              select_sequences)
from cospec.models.precision import autocast


def cotrain_config(d: DraftConfig, group) -> DraftConfig:
    """The draft config a rank co-trains with: under dp a replica's share of the token budget;
    under cp no token bucket (the ring pads each sequence of its shards itself, and
    `cospec plan` counts its traffic on the batch as drawn). ``group``: the rank's `TrainGroup`,
    or anything with its dp and cp (`cospec plan` passes the run's parallel config); None: one
    process."""
    if group is not None and group.dp > 1 and d.cotrain_max_tokens:
        d = dataclasses.replace(d, cotrain_max_tokens=max(1, d.cotrain_max_tokens // group.dp))
    if group is not None and group.cp > 1:
        d = dataclasses.replace(d, token_bucket=0)
    return d


def cotrain_sampler(d: DraftConfig, num_batches: int, seed: int):
    """``choose(lengths) -> sequences | None``: the whole sequences `cotrain_draft` trains on of
    each of a step's ``num_batches`` minibatches, given their sequence lengths in the order the
    minibatches come (their share of ``d.cotrain_max_tokens``, drawn by ``seed``;
    `choose_sequences`). The trainer draws them before each minibatch's policy step, which
    captures only those rows, so that a step keeps the budget's share of the policy's logits and
    features rather than every token's (V floats a token: at a 128K vocabulary and 32K-token
    rollouts, a TiB a rank; docs/results/parallel_grpo.md), also on a pipeline's last stage,
    microbatch by microbatch; `cotrain_draft` then draws again, which leaves a batch already
    within its share as it is."""
    per_batch = max(1, d.cotrain_max_tokens // num_batches) if d.cotrain_max_tokens else 0
    rng = random.Random(seed)
    return lambda lengths: choose_sequences(lengths, per_batch, rng)


def cotrain_draft(draft, optimizer, captured: list[TTTBatch], d: DraftConfig, *, temperature: float,
                  seed: int, loss_fn, reduce_grads=None) -> dict:
    """``d.cotrain_iters`` passes over the captured batches (at most ``d.cotrain_max_tokens``
    tokens of whole sequences, chosen by ``seed``: the same on every rank and again after a
    resume). ``loss_fn``: `ttt_loss` or its context-parallel form, whose ``reduce_grads`` turns
    the ranks' shares into the whole gradient. The forwards run under ``d.autocast``. Returns
    the last update's loss and teacher-forced acceptance per TTT step, and how many updates were
    skipped as non-finite."""
    draft.train()
    device = next(draft.parameters()).device
    metrics: dict = {}
    choose = cotrain_sampler(d, len(captured), seed)
    data = [select_sequences(b, choose(b.sequence_lengths())) for b in captured]
    bucket = cpu_bucket(d.token_bucket, device)
    skipped = 0
    for _ in range(d.cotrain_iters):
        for batch in data:
            with autocast(d.autocast, device):  # the backward below runs outside it
                loss, metrics = loss_fn(draft, pad_to_bucket(batch, bucket),  # one at a time
                                        num_steps=d.ttt_steps, decay=d.ttt_decay,
                                        temperature=temperature, tv_weight=d.tv_weight,
                                        anchor_weight=d.anchor_weight)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if reduce_grads is not None:
                reduce_grads(draft)
            norm = torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
            if hasattr(norm, "full_tensor"):  # FSDP2-sharded (data parallel): the global norm
                norm = norm.full_tensor()
            if torch.isfinite(norm):  # a sync per update; the loss's metrics take one too
                optimizer.step()
            else:  # skipped and reported; the draft keeps its weights
                optimizer.zero_grad(set_to_none=True)
                skipped += 1
    draft.eval()
    # The loss from the per-step metrics, which are whole-batch ones also under cp (where each
    # rank's ``loss`` is only its share).
    whole = sum(d.ttt_decay ** j * ((1 - d.tv_weight) * ce + d.tv_weight * tv)
                for j, (ce, tv) in enumerate(zip(metrics["ce"], metrics["tv"])))
    return {"draft_loss": whole, "draft_acceptance_tf": metrics["acceptance"],
            "draft_nonfinite_skipped": skipped}
