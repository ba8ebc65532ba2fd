"""`cospec bench train-step`: one GRPO training step on one process, under cp and under pp.

# R rollouts per step

The step is the trainer's own (`GRPOTrainer.train_policy` then `train_draft`, co-training on): the
policy update with its reference forward and the draft's TTT co-training on the captured features.
Every layout gets the same synthetic rollouts (seeded: prompts of 12-24 tokens, responses of 8 to
sampling.max_new_tokens tokens, random old logprobs and advantages; R = prompts_per_step *
group_size) and the same initial weights, so the rows differ only in how the step is laid out:
- single: one process, one thread; single@T: one process on T threads (T = the cores the
  parallel rows use: the fair comparison on a shared machine);
- cp=N: N ranks, every minibatch zigzag-sharded, ring attention (`cospec.rl.cp_step`);
- pp=N: N stages, parallel.microbatches microbatches, TapChannel-fed co-training on the last stage
  (`cospec.rl.pp_step`);
- dp=N: N replicas, each training on R / N of the rollouts, the policy FSDP2-sharded
  (`cospec.rl.dp_step`).
Each layout runs in fresh spawned processes with one thread per rank; a barrier precedes every step,
the first step is a warm-up, and the row reports rank 0's median over the others (rank 0 finishes a
step only after the collectives that end it, so that is the step's time). What a row means: on a
machine with as many cores as ranks, cp, pp and dp split the step's compute; on this 2-core
machine the ratio against `single@2` (the same cores) is what tells them apart.

    cospec bench train-step [--quick] [--layouts single,single@2,cp2,pp2,dp2] [--json PATH] [key=value ...]
"""

from __future__ import annotations

import random
import statistics
import time

import torch

from cospec.atomic_file import write_json_atomically
from cospec.config import RunConfig, apply
from cospec.parallel.launch import spawn


def synthetic_batch(cfg: RunConfig, seed: int = 0):
    """R rollouts with plausible lengths and random GRPO inputs (the training step's timing does
    not depend on their values)."""
    from cospec.rl.trainer import RolloutBatch
    from cospec.rollout.engine import Completion

    rng = random.Random(seed)
    rollouts = cfg.grpo.prompts_per_step * cfg.grpo.group_size
    completions = []
    for i in range(rollouts):
        n = rng.randint(8, cfg.sampling.max_new_tokens)
        completions.append(Completion(index=i, prompt=[rng.randrange(4, cfg.model.vocab_size)
                                                       for _ in range(rng.randint(12, 24))],
                                      tokens=[rng.randrange(4, cfg.model.vocab_size) for _ in range(n)],
                                      logprobs=[-3 * rng.random() for _ in range(n)]))
    advantages = torch.tensor([rng.gauss(0, 1) for _ in range(rollouts)])
    return RolloutBatch(examples=[], completions=completions, rewards=None, advantages=advantages,
                        generate_seconds=0.0, num_tokens=sum(len(c.tokens) for c in completions))


def _layout_overrides(layout: str) -> tuple[dict, int]:
    if layout.startswith("single"):
        return {}, 1
    kind, n = layout[:2], int(layout[2:])
    if kind not in ("cp", "pp", "dp") or n < 2:
        raise ValueError(f"layout must be single, cpN, ppN or dpN (N >= 2), got {layout!r}")
    return {kind: n}, n


def _time_steps(rank: int, num_ranks: int, cfg: RunConfig, layout: str, steps: int) -> dict:
    import torch.distributed as dist

    from cospec.models.draft import Eagle3Draft
    from cospec.models.llama import Transformer
    from cospec.parallel.train_group import make_train_group
    from cospec.rl.trainer import GRPOTrainer

    if layout.startswith("single@"):  # one process on several threads (the ranks' cores)
        torch.set_num_threads(int(layout.split("@")[1]))
    torch.manual_seed(0)
    policy = Transformer(cfg.model)
    draft = Eagle3Draft.from_policy(policy)
    group = make_train_group(cfg.parallel, rank, num_ranks) if num_ranks > 1 else None
    trainer = GRPOTrainer(cfg, policy, draft=draft, tensorboard=False, group=group)
    batch = synthetic_batch(cfg)
    tokens = sum(len(c.prompt) + len(c.tokens) - 1 for c in batch.completions)  # the whole step's
    if group is not None and group.dp > 1:  # a replica trains on its share of the rollouts
        share = len(batch.completions) // group.dp
        first = group.dp_rank * share
        batch.completions = batch.completions[first:first + share]
        batch.advantages = batch.advantages[first:first + share]
        batch.first = first
    policy_s, draft_s = [], []
    for _ in range(steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        trainer.train_policy(batch)
        t1 = time.perf_counter()
        trainer.train_draft()
        if group is not None and group.draft_rank not in (None, 0):
            dist.barrier()  # rank 0 waits for the last stage's co-training like the trainer does
        t2 = time.perf_counter()
        policy_s.append(t1 - t0)
        draft_s.append(t2 - t1)
        trainer.step += 1
    return {"train_policy_seconds": statistics.median(policy_s[1:]),
            "train_draft_seconds": statistics.median(draft_s[1:]), "tokens": tokens}


def run(cfg: RunConfig, layouts=("single", "single@2", "cp2", "pp2", "dp2"),
        steps: int = 3) -> list[dict]:
    rows = []
    for layout in layouts:
        parallel, ranks = _layout_overrides(layout)
        run_cfg = apply(cfg, {"parallel": parallel, "rollout": {"speculative": True},
                              "draft": {"mode": "cotrain"}})
        result = spawn(_time_steps, ranks, run_cfg, layout, steps, timeout_s=600)[0]
        rows.append({"layout": layout, "ranks": ranks, **result,
                     "step_seconds": result["train_policy_seconds"] + result["train_draft_seconds"]})
    base = next((r for r in rows if r["layout"] == "single"), None)
    by_layout = {r["layout"]: r for r in rows}
    for r in rows:
        r["vs_single"] = r["step_seconds"] / base["step_seconds"] if base else None
        same = by_layout.get(f"single@{r['ranks']}") if r["ranks"] > 1 else None
        r["vs_single_same_cores"] = r["step_seconds"] / same["step_seconds"] if same else None
    return rows


def format_table(rows: list[dict]) -> str:
    lines = [f"{'layout':>8} {'ranks':>5} {'tokens':>7} {'policy s':>9} {'draft s':>8} "
             f"{'step s':>7} {'x single':>8} {'x single, same cores':>20}", "-" * 80]
    fmt = lambda x: f"{x:.2f}" if x is not None else "-"  # noqa: E731
    for r in rows:
        lines.append(f"{r['layout']:>8} {r['ranks']:>5} {r['tokens']:>7} "
                     f"{r['train_policy_seconds']:>9.3f} {r['train_draft_seconds']:>8.3f} "
                     f"{r['step_seconds']:>7.3f} {fmt(r['vs_single']):>8} "
                     f"{fmt(r['vs_single_same_cores']):>20}")
    return "\n".join(lines)


def run_cli(cfg: RunConfig, *, layouts: str = "single,single@2,cp2,pp2,dp2", quick: bool = False,
            json_path: str | None = None) -> list[dict]:
    steps = 2 if quick else 5
    rows = run(cfg, layouts=layouts.split(","), steps=steps)
    print(format_table(rows))
    if json_path:
        write_json_atomically(json_path, {"config": cfg.to_dict(), "steps": steps, "results": rows}, indent=1)
    return rows
