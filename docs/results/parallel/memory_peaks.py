"""One trainer step's memory, per rank, against `cospec plan`: the peak of tensor memory per phase
against the plan's total, and the peak of saved activations against the plan's activations.

    python docs/results/parallel/memory_peaks.py      # one process, dp2, pp2, cp2, dp2xpp2 (tiny)

Each layout runs one GRPO step of the tiny recipe (its own rollouts, co-training on) on spawned
gloo ranks; `cospec.metrics.tensor_memory.TensorMemoryPeak` measures each phase (rollouts, the
policy step, the draft's co-training, the weight sync), and
`cospec.metrics.saved_activations.SavedActivations` the policy step's saved activations. The plan
takes the step's rollout lengths from every replica. Its total counts the engine on a replica's
first rank only: a rank that does not generate is compared with the total less the engine's
parts. The activations are also planned for every rollout at the replica's mean length and at
its longest (what `cospec plan --context` gives).
"""

import sys

import torch
import torch.distributed as dist

from cospec.config import resolve
from cospec.draft.offline import build_draft
from cospec.metrics.saved_activations import SavedActivations
from cospec.metrics.tensor_memory import TensorMemoryPeak
from cospec.models.llama import Transformer
from cospec.parallel.launch import spawn
from cospec.parallel.activation_memory import activation_peak_bytes
from cospec.parallel.plan import plan

LAYOUTS = {"single": ([], 1), "dp2": (["parallel.dp=2"], 2), "pp2": (["parallel.pp=2"], 2),
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
    group = make_train_group(cfg.parallel, rank, world) if world > 1 else None
    trainer = GRPOTrainer(cfg, policy, draft=build_draft(cfg, policy), tensorboard=False,
                          group=group)
    del policy

    def rollouts():
        batch = None
        if trainer.generates:
            batch = trainer.generate()
            trainer.score(batch)
            batch.advantages = torch.randn(len(batch.completions))
        if group is not None and group.replica_size > 1:
            shared = broadcast_rollouts(
                (batch.completions, batch.advantages, batch.rewards, batch.first) if batch else None,
                src=group.replica_first_rank, group=group.replica_collectives)
            batch = batch or RolloutBatch(examples=[], completions=shared[0], rewards=shared[2],
                                          advantages=shared[1], generate_seconds=0.0,
                                          num_tokens=0, first=shared[3])
        return batch

    peaks, out, saved = {}, {}, SavedActivations()

    def policy_step():
        with saved:
            trainer.train_policy(out["b"])

    for phase, work in [("rollouts", rollouts), ("policy", policy_step),
                        ("draft", trainer.train_draft), ("sync", trainer.sync_weights)]:
        with TensorMemoryPeak(device="cpu") as meter:
            result = work()
        out.setdefault("b", result)
        peaks[phase] = meter.peak_bytes
    batch = out["b"]
    mine = [len(c.prompt) + len(c.tokens) - 1 for c in batch.completions]
    lengths = [0] * (cfg.grpo.prompts_per_step * cfg.grpo.group_size)
    every = [(batch.first, mine)]
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, (batch.first, mine))
    for first, theirs in every:
        lengths[first:first + len(theirs)] = theirs
    stage, replica = (group.stage, group.dp_rank) if group else (0, 0)
    sp = plan(cfg, lengths=lengths)[stage]
    engine = sum(v for k, v in sp.memory.items() if k.startswith("engine"))
    planned = sp.total_memory - (0 if trainer.generates else engine)
    activations = [saved.peak_bytes, activation_peak_bytes(cfg, lengths, stage=stage,
                                                           replica=replica)]
    activations += [plan(cfg, context=n)[stage].memory["activations"]
                    for n in (round(sum(mine) / len(mine)), max(mine))]
    return stage, replica, trainer.generates, peaks, planned, activations


if __name__ == "__main__":
    for layout in sys.argv[1:] or LAYOUTS:
        ranks = LAYOUTS[layout][1]
        results = spawn(_step, ranks, layout) if ranks > 1 else [_step(0, 1, layout)]
        for stage, replica, generates, peaks, planned, (saved, exact, mean, longest) in results:
            measured = max(peaks.values())
            phases = ", ".join(f"{k} {v:,}" for k, v in peaks.items())
            print(f"{layout:8} stage {stage} replica {replica}{' (engine)' if generates else ''}: "
                  f"peak {measured:,} B, plan {planned:,.0f} B, x{measured / planned:.3f}  [{phases}]"
                  f"\n{'':10}saved activations {saved:,} B; plan: of the rollouts' lengths "
                  f"x{saved / exact:.3f}, of their mean x{saved / mean:.2f}, of the longest "
                  f"x{saved / longest:.2f}")
