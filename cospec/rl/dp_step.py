"""The GRPO policy step and the draft's co-training loss under data parallelism (``parallel.dp``).

Each replica holds its own rollouts (its share of the step's prompt groups). Minibatch i of the
step is, over all replicas, the single-process minibatch i: every replica takes the rollouts of
its share whose *global* index is i modulo grpo.micro_steps (`replica_chunks`). Per minibatch:
1. the token count is all-reduced: each replica's loss divides by the whole minibatch's count, so
   the replicas' losses sum to the single-process loss (`cospec.rl.policy_step`'s additivity);
2. the forward and backward run on the replica's own tokens; FSDP2 sums the gradients over the
   replicas (`cospec.parallel.data_parallel.shard_policy`) and the clip uses the global norm;
3. the summed statistics are all-reduced, so every replica logs the whole minibatch's.
Why the sum of the shares is the single-process step: docs/design.md, "Data parallelism: the step
as a sum of shares". The token count's all-reduce is read on the host (one sync per minibatch,
beside the gradient norm's).
"""

from __future__ import annotations

import dataclasses

import torch

from cospec.draft.ttt import TTTBatch, ttt_loss_on_steps, ttt_steps
from cospec.parallel.data_parallel import all_gather_rows, all_reduce_sum
from cospec.parallel.draft_cp import all_reduce_grads
from cospec.rl.policy_step import LocalPolicyStep, PolicyMinibatch


def replica_chunks(first: int, count: int, micro_steps: int) -> list[list[int]]:
    """The local indices of minibatch i = 0..micro_steps-1 for a replica holding the rollouts of
    global indices first..first+count-1: those whose global index is i modulo micro_steps (the
    single-process trainer's ``order[i::micro_steps]``). Every minibatch must get at least one
    rollout on every replica (FSDP2's collectives need every replica in every forward)."""
    if count < micro_steps:
        raise ValueError(f"a replica holds {count} rollouts, fewer than grpo.micro_steps="
                         f"{micro_steps}: raise grpo.prompts_per_step or lower parallel.dp")
    return [[j for j in range(count) if (first + j) % micro_steps == i] for i in range(micro_steps)]


class DataParallelPolicyStep(LocalPolicyStep):
    """`LocalPolicyStep` on a replica's share of a minibatch (module docstring); a collective
    over ``group`` (the dp ranks)."""

    def __init__(self, *args, group=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.group = group

    def __call__(self, mb: PolicyMinibatch, tap_layers=(), sequences=None):
        device = next(self.policy.parameters()).device
        total = all_reduce_sum(torch.tensor(float(mb.num_tokens), device=device), self.group)
        mb = dataclasses.replace(mb, num_tokens=int(total))
        sums, grad_norm, captured = super().__call__(mb, tap_layers, sequences)
        return all_reduce_sum(sums, self.group), grad_norm, captured


class DataParallelDraftLoss:
    """The co-training loss of a replica's `TTTBatch`: its share of the loss over the replicas'
    batches together (masked means divided by the all-reduced count), and the whole metrics.
    `reduce_grads` sums a replicated draft's gradients over the replicas (a co-trained draft is
    FSDP2-sharded instead, `shard_draft`, which sums them itself)."""

    def __init__(self, group=None):
        self.group = group

    def __call__(self, draft, batch: TTTBatch, *, num_steps: int, **loss_kwargs):
        steps = ttt_steps(draft, batch, num_steps)
        loss, metrics = ttt_loss_on_steps(draft, steps, batch.cu_seqlens,
                                          total_count=lambda c: all_reduce_sum(c, self.group),
                                          **loss_kwargs)
        shares = all_reduce_sum(torch.tensor([metrics["ce"], metrics["tv"]], dtype=torch.float64,
                                             device=loss.device), self.group)
        ce, tv = shares.tolist()
        return loss, {"ce": ce, "tv": tv, "acceptance": [1 - x for x in tv]}

    def reduce_grads(self, draft) -> None:
        all_reduce_grads(draft, self.group)


def replicas_view(examples: list, rewards, completions, group=None) -> dict:
    """The step's rollouts over every replica, for the step's log (`step_metrics`' ``replicas``):
    ``examples``: every replica's (each knows them all: the prompt stream is the same on every
    rank), and the rewards and response lengths all-gathered, tensors of equal length per
    replica (prompts_per_step / dp groups each)."""
    lengths = torch.tensor([len(c.tokens) for c in completions], dtype=torch.float64)
    gathered = all_gather_rows(torch.stack([rewards.double(), lengths], 1), group)
    return {"examples": examples, "rewards": gathered[:, 0].tolist(),
            "lengths": [int(x) for x in gathered[:, 1].tolist()],
            "num_tokens": int(gathered[:, 1].sum())}
