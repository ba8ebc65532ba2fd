"""The live peak of activations saved for backward in one trainer step, against `cospec plan`'s.

    python docs/results/parallel/activation_peaks.py       # dp2, pp2, cp2, dp2xpp2 on the tiny recipe

Each layout runs one GRPO step (its own rollouts, co-training on) on spawned gloo ranks. A saved
tensor counts (once per storage; parameters, and FSDP2's unsharded ones, excluded) from the
forward that saved it until its graph is freed; the peak is the most live at once. Prints, per
rank: its stage, the measured peak and the plan's activations for the rank's mean rollout length.
"""

import torch

from cospec.config import resolve
from cospec.draft.offline import build_draft
from cospec.models.llama import Transformer
from cospec.parallel.launch import spawn
from cospec.parallel.plan import plan

LAYOUTS = {"dp2": (["parallel.dp=2"], 2), "pp2": (["parallel.pp=2"], 2),
           "cp2": (["parallel.cp=2"], 2), "dp2xpp2": (["parallel.dp=2", "parallel.pp=2"], 4)}
SHARED = ["grpo.micro_steps=2", "grpo.kl_coef=0.05", "rollout.speculative=true",
          "draft.mode=cotrain", "rollout.adaptive=false", "parallel.microbatches=2"]


class LiveActivations:
    def __init__(self):
        self.refs, self.live, self.peak = {}, 0, 0

    def pack(self, t):
        if isinstance(t, torch.nn.Parameter):
            return t
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.refs:
            self.live += t.untyped_storage().nbytes()
            self.peak = max(self.peak, self.live)
        self.refs[ptr] = self.refs.get(ptr, 0) + 1
        return _Held(self, ptr, t)

    def release(self, ptr, nbytes):
        self.refs[ptr] -= 1
        if not self.refs[ptr]:
            del self.refs[ptr]
            self.live -= nbytes

    @staticmethod
    def unpack(held):
        return held.t if isinstance(held, _Held) else held


class _Held:
    def __init__(self, owner, ptr, t):
        self.owner, self.ptr, self.t, self.nbytes = owner, ptr, t, t.untyped_storage().nbytes()

    def __del__(self):
        self.owner.release(self.ptr, self.nbytes)


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
    live = LiveActivations()
    with torch.autograd.graph.saved_tensors_hooks(live.pack, live.unpack):
        trainer.train_policy(batch)
    context = sum(len(c.prompt) + len(c.tokens) - 1 for c in batch.completions) / len(
        batch.completions)
    planned = plan(cfg, context=context)[group.stage].memory["activations"]
    return group.stage, live.peak, planned


if __name__ == "__main__":
    for layout, (_, ranks) in LAYOUTS.items():
        for stage, peak, planned in spawn(_step, ranks, layout):
            print(f"{layout:8} stage {stage}: measured {peak:>9,} B, plan {planned:>11,.0f} B, "
                  f"x{peak / planned:.2f}")
