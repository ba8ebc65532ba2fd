"""The live peak of activations saved for backward in one trainer step, against `cospec plan`'s.

    python docs/results/parallel/activation_peaks.py       # dp2, pp2, cp2, dp2xpp2 on the tiny recipe

Each layout runs one GRPO step (its own rollouts, co-training on) on spawned gloo ranks and
measures the peak with `cospec.metrics.saved_activations.SavedActivations`. Prints, per rank: its
stage, the measured peak, and the plan's activations three ways: for the step's own rollout
lengths (`activation_peak_bytes`), for every rollout at the replica's mean length, and at its
longest (what `cospec plan --context` gives when told the longest sequence: an upper bound).
"""

import torch

from cospec.config import resolve
from cospec.draft.offline import build_draft
from cospec.models.llama import Transformer
from cospec.metrics.saved_activations import SavedActivations
from cospec.parallel.launch import spawn
from cospec.parallel.plan import activation_peak_bytes, plan

LAYOUTS = {"dp2": (["parallel.dp=2"], 2), "pp2": (["parallel.pp=2"], 2),
           "cp2": (["parallel.cp=2"], 2), "dp2xpp2": (["parallel.dp=2", "parallel.pp=2"], 4)}
SHARED = ["grpo.micro_steps=2", "grpo.kl_coef=0.05", "rollout.speculative=true",
          "draft.mode=cotrain", "rollout.adaptive=false", "parallel.microbatches=2"]


def _step(rank, world, layout):
    from cospec.parallel.tensor_transfer import broadcast_rollouts
    from cospec.parallel.train_group import make_train_group
    from cospec.rl.trainer import GRPOTrainer, RolloutBatch

    cfg = resolve("tiny", overrides=["out_dir=runs/unused", *LAYOUTS[layout][0], *SHARED])
    torch.manual_seed(0)
    policy = Transformer(cfg.model)
    group = make_train_group(cfg.parallel, rank, world)
    trainer = GRPOTrainer(cfg, policy, draft=build_draft(cfg, policy), tensorboard=False,
                          group=group)
    batch = None
    if trainer.generates:
        batch = trainer.generate()
        trainer.score(batch)
        batch.advantages = torch.randn(len(batch.completions))
    if group.replica_size > 1:
        shared = broadcast_rollouts(
            (batch.completions, batch.advantages, batch.rewards, batch.first) if batch else None,
            src=group.replica_first_rank, group=group.replica_collectives)
        batch = batch or RolloutBatch(examples=[], completions=shared[0], rewards=shared[2],
                                      advantages=shared[1], generate_seconds=0.0, num_tokens=0,
                                      first=shared[3])
    with SavedActivations() as live:
        trainer.train_policy(batch)
    mine = [len(c.prompt) + len(c.tokens) - 1 for c in batch.completions]  # trained tokens
    lengths = [0] * (cfg.grpo.prompts_per_step * cfg.grpo.group_size)
    lengths[batch.first:batch.first + len(mine)] = mine
    exact = activation_peak_bytes(cfg, lengths, stage=group.stage, replica=group.dp_rank)
    mean, longest = (plan(cfg, context=n)[group.stage].memory["activations"]
                     for n in (round(sum(mine) / len(mine)), max(mine)))
    return group.stage, live.peak_bytes, exact, mean, longest


if __name__ == "__main__":
    for layout, (_, ranks) in LAYOUTS.items():
        for stage, peak, exact, mean, longest in spawn(_step, ranks, layout):
            print(f"{layout:8} stage {stage}: measured {peak:>9,} B; plan: of the rollouts' "
                  f"lengths x{peak / exact:.3f}, of their mean x{peak / mean:.2f}, of the "
                  f"longest x{peak / longest:.2f}")
