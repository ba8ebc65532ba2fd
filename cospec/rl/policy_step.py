"""One GRPO optimizer step on the policy: the minibatch, its additive loss, and the single-process step.

# T packed tokens, N sequences, V vocab, K summed statistics

The trainer (`cospec.rl.trainer`) calls a *policy step* once per minibatch:
``step(mb, tap_layers) -> (sums, grad_norm, captured)``. `LocalPolicyStep` below is the
single-process one; the context-parallel (`cospec.rl.cp_step`) and pipelined
(`cospec.rl.pp_step`) ones fill the same seam, so the trainer does not know which ran.

What makes the three agree is that the loss is *additive over any split of the tokens*:
`minibatch_terms` divides by the minibatch's total response-token count, not by the count of the
piece it sees, so the pieces (zigzag shards, pipeline microbatches) sum to the whole minibatch's
loss, and so do their gradients and every logged statistic (`SUMS`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from cospec.data.packing import balanced_cuts, pack_examples, sequence_rows
from cospec.draft.ttt import TTTBatch, select_sequences
from cospec.models.integrity import NonFiniteError
from cospec.models.precision import autocast
from cospec.rl import grpo

#: the statistics a step sums over its tokens (a tensor, so one all-reduce carries all of them)
SUMS = ("loss", "tokens", "clipped", "kl", "entropy", "mismatch_abs", "mismatch_mult")


@dataclass
class PolicyMinibatch:
    """Packed rollouts with their per-token GRPO inputs, laid out like the packed targets.

    tokens, targets: long [T]; cu_seqlens: long [N+1]; loss_mask: float [T] (1 on response tokens);
    old_logprobs: float [T] (the rollout engine's); advantages: float [T] (the rollout's A on each
    of its tokens); num_tokens: response tokens of the *whole* minibatch (the loss's divisor, also
    for a piece of it); index: a microbatch's place in its step (pipeline stamps); positions: set
    on a zigzag shard (else positions restart at every sequence).
    """

    tokens: Tensor
    targets: Tensor
    cu_seqlens: Tensor
    loss_mask: Tensor
    old_logprobs: Tensor
    advantages: Tensor
    num_tokens: int
    index: int = 0
    positions: Tensor | None = None  # RoPE positions of a context-parallel shard

    @classmethod
    def from_rollouts(cls, completions, advantages_R: Tensor, idx: list[int]) -> "PolicyMinibatch":
        packed = pack_examples([(completions[i].prompt + completions[i].tokens,
                                 [0] * len(completions[i].prompt) + [1] * len(completions[i].tokens))
                                for i in idx])
        cu, mask = packed.cu_seqlens, packed.loss_mask[0]
        old, adv = torch.zeros_like(mask), torch.zeros_like(mask)
        for j, i in enumerate(idx):
            c = completions[i]
            end, n = int(cu[j + 1]), len(c.tokens)
            old[end - n:end] = torch.tensor(c.logprobs, dtype=old.dtype)
            adv[end - n:end] = float(advantages_R[i])
        return cls(tokens=packed.tokens[0], targets=packed.targets[0], cu_seqlens=cu, loss_mask=mask,
                   old_logprobs=old, advantages=adv, num_tokens=int(mask.sum()))

    @property
    def num_sequences(self) -> int:
        return len(self.cu_seqlens) - 1

    def response_positions(self) -> Tensor:
        """long [K]: the positions whose logits the loss reads (loss_mask 1: they predict a
        response token). On a chat prompt of ~70 tokens and answers of ~60 they are under half
        of the row, and the head over a 49K vocabulary is the largest matmul of the forward."""
        return self.loss_mask.nonzero()[:, 0]

    def to(self, device) -> "PolicyMinibatch":
        return PolicyMinibatch(**{k: v.to(device) if isinstance(v, Tensor) else v
                                  for k, v in self.__dict__.items()})

    def sequences(self, first: int, last: int, index: int = 0) -> "PolicyMinibatch":
        """Sequences first..last-1 as a microbatch; num_tokens stays the whole minibatch's."""
        a, b = int(self.cu_seqlens[first]), int(self.cu_seqlens[last])
        return PolicyMinibatch(tokens=self.tokens[a:b], targets=self.targets[a:b],
                               cu_seqlens=self.cu_seqlens[first:last + 1] - a,
                               loss_mask=self.loss_mask[a:b], old_logprobs=self.old_logprobs[a:b],
                               advantages=self.advantages[a:b], num_tokens=self.num_tokens,
                               index=index)

    def split(self, parts: int) -> list["PolicyMinibatch"]:
        """``parts`` microbatches of whole sequences, contiguous, balanced in tokens
        (`cospec.data.packing.balanced_cuts`)."""
        cuts = balanced_cuts(self.cu_seqlens, parts)
        return [self.sequences(a, b, index=i) for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:]))]


def minibatch_terms(logits_TV: Tensor, ref_logits_TV: Tensor | None, mb: PolicyMinibatch, *,
                    temperature: float, clip_low: float, clip_high: float,
                    kl_coef: float, rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(loss, sums [K] in the order of `SUMS`) of the tokens of ``mb`` (or of a piece of it).

    loss = GRPO's clipped token-level loss (`grpo.clipped_policy_loss`) divided by mb.num_tokens;
    with a KL penalty the exact KL to the reference is part of it (gradient through logits),
    without it is only summed for the log. mismatch_*: |logp - old| and exp|logp - old| summed
    (trainer vs rollout engine; meaningful before the step's first update).
    rows: the positions of ``mb`` that the logits' rows are of (`response_positions`); None:
    every position, in order.
    """
    if rows is not None:
        mb = PolicyMinibatch(tokens=mb.tokens, targets=mb.targets[rows], cu_seqlens=mb.cu_seqlens,
                             loss_mask=mb.loss_mask[rows], old_logprobs=mb.old_logprobs[rows],
                             advantages=mb.advantages[rows], num_tokens=mb.num_tokens)
    m = mb.loss_mask
    logp = grpo.token_logprobs(logits_TV, mb.targets, temperature)
    if ref_logits_TV is None:  # no reference forward (grpo.log_kl=false): the KL is not measured
        kl_T = torch.zeros_like(logp.detach())
    else:
        kl_T = grpo.kl_to_reference(logits_TV if kl_coef else logits_TV.detach(), ref_logits_TV,
                                    temperature)
    out = grpo.clipped_policy_loss(logp, mb.old_logprobs, mb.advantages, m, clip_low=clip_low,
                                   clip_high=clip_high, kl_T=kl_T, kl_coef=kl_coef,
                                   num_tokens=mb.num_tokens)
    with torch.no_grad():
        ratio = (logp - mb.old_logprobs).exp()
        clipped = ((ratio < 1 - clip_low) | (ratio > 1 + clip_high)).float()
        diff = (logp - mb.old_logprobs).abs()
        entropy = grpo.token_entropy(logits_TV, temperature)
        kl_sum = (kl_T.detach() * m).sum() if ref_logits_TV is not None else m.sum() * float("nan")
        sums = torch.stack([out.loss.detach() * mb.num_tokens, m.sum(), (clipped * m).sum(),
                            kl_sum, (entropy * m).sum(), (diff * m).sum(),
                            (diff.exp() * m).sum()]).float()
    return out.loss, sums


def metrics_from_sums(sums: Tensor, grad_norm: float) -> dict:
    """Means per response token of a minibatch's `SUMS` (the loss is already one)."""
    s = dict(zip(SUMS, sums.tolist()))
    n = max(s["tokens"], 1.0)
    return {"loss": s["loss"] / n, "clip_fraction": s["clipped"] / n, "kl_from_init": s["kl"] / n,
            "entropy": s["entropy"] / n, "grad_norm": grad_norm,
            "mismatch_mean_abs_logprob": s["mismatch_abs"] / n,
            "mismatch_token_mult_prob_error": s["mismatch_mult"] / n}


def clip_grad_norm(params, grad_clip: float) -> Tensor:
    """The global gradient norm of ``params``, clipped to ``grad_clip`` when > 0; measured even
    without clipping, since `step_if_finite` reads it."""
    return torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))


def step_if_finite(optimizer, grad_norm: Tensor) -> float:
    """Take the optimizer step unless the gradient norm is NaN or inf; then raise `NonFiniteError`
    with the weights as they were. Returns the norm. The norm is global (all-reduced over cp
    replicas, summed over pp stages), so every rank of a layout decides alike; reading it is the
    sync the step's log needed anyway."""
    norm = float(grad_norm)
    if not math.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        raise NonFiniteError(f"policy update: the gradient norm is {norm} (the GRPO loss or its "
                             f"gradient is not finite); the update was not applied")
    optimizer.step()
    return norm


class LocalPolicyStep:
    """The policy step on one process: forward (with the draft's taps when asked), the reference
    forward (none when ``reference`` is None), loss, backward, clip, optimizer step.
    ``captured``: one `TTTBatch` (detached taps and logits of this same forward: co-training
    costs no policy forward): of the sequences a call names in ``sequences`` (None: all; what
    the draft will train on, `cospec.draft.cotrain.cotrain_sampler`), its logits kept as
    ``draft_targets`` makes them (`cospec.draft.losses.draft_targets`; default: as they are).
    ``autocast``: the forwards' mixed precision (`grpo.autocast`)."""

    def __init__(self, policy, reference, optimizer, *, temperature: float, clip_low: float,
                 clip_high: float, kl_coef: float, grad_clip: float, autocast: str = "",
                 draft_targets=None):
        self.policy, self.reference, self.optimizer = policy, reference, optimizer
        self.autocast = autocast
        self.draft_targets = draft_targets or (lambda logits: logits)
        self.loss_kwargs = dict(temperature=temperature, clip_low=clip_low, clip_high=clip_high,
                                kl_coef=kl_coef)
        self.grad_clip = grad_clip

    def __call__(self, mb: PolicyMinibatch, tap_layers=(),
                 sequences=None) -> tuple[Tensor, float, list[TTTBatch]]:
        device = next(self.policy.parameters()).device
        mb = mb.to(device)
        rows = mb.response_positions()  # the head runs there only: nothing else is read
        with autocast(self.autocast, device):
            out = self.policy(mb.tokens[None], cu_seqlens=mb.cu_seqlens, tap_layers=tap_layers,
                              logits_positions_B=rows[None])
            ref_logits = None
            if self.reference is not None:
                with torch.no_grad():
                    ref_logits = self.reference(mb.tokens[None], cu_seqlens=mb.cu_seqlens,
                                                logits_positions_B=rows[None]).logits[0]
            loss, sums = minibatch_terms(out.logits[0], ref_logits, mb, rows=rows,
                                         **self.loss_kwargs)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = step_if_finite(self.optimizer, clip_grad_norm(self.policy.parameters(),
                                                                  self.grad_clip))
        captured = []
        if tap_layers:  # the targets are filled in below, for the kept sequences only
            kept = select_sequences(TTTBatch(
                tokens=mb.tokens, cu_seqlens=mb.cu_seqlens, loss_mask=mb.loss_mask,
                taps={k: v[0] for k, v in out.taps.items()},
                policy_logits=mb.loss_mask.new_empty(len(mb.tokens), 0)), sequences)
            kept.policy_logits = self._draft_targets_at(out.logits[0].detach(), rows,
                                                        mb.cu_seqlens, sequences)
            captured.append(kept)
        return sums, grad_norm, captured

    def _draft_targets_at(self, logits_KV: Tensor, rows: Tensor, cu_seqlens: Tensor,
                          sequences) -> Tensor:
        """[T', V'] the draft's targets laid out like the kept sequences' packed tokens (all, for
        ``sequences`` None): ``draft_targets`` of their response positions' logits (``logits_KV``
        holds those of ``rows``), zeros elsewhere. The TTT losses read only positions whose
        loss_mask is 1 (`cospec.draft.ttt`), which are exactly the response positions."""
        row_of = torch.full((int(cu_seqlens[-1]),), -1, dtype=torch.long, device=rows.device)
        row_of[rows] = torch.arange(len(rows), device=rows.device)
        if sequences is not None:
            row_of = row_of[sequence_rows(cu_seqlens, sequences)]
        picked = row_of >= 0
        kept = self.draft_targets(logits_KV.index_select(0, row_of[picked]))
        out = kept.new_zeros(len(row_of), kept.shape[-1])
        out[picked] = kept
        return out
