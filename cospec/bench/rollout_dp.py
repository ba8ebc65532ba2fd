"""`cospec bench rollout-dp`: a GRPO step's rollouts by dp replicas against one process.

# R rollouts per step (grpo.prompts_per_step x grpo.group_size)

The rollouts are those of a GRPO step: prompts_per_step task prompts, each answered group_size
times, at the run's sampling temperature and max_new_tokens, every rollout from its own seed
(`PromptStreams`), so every layout draws the same samples and decodes the same tokens. Layouts:
- single: one process, one thread, all R rollouts through one engine at sampling.batch_size;
- single@T: the same on T threads (the cores the dp rows use: the fair comparison);
- dpN: N processes, one thread each, every one answering its R / N rollouts with its own engine
  at the same batch size, as `parallel.dp=N` does (`GRPOTrainer.generate`).
Each layout runs in fresh spawned processes: a warm-up round, then ``repeats`` rounds, each started
by a barrier; a round's time is its slowest replica's (the step waits for it), and the row
reports the median round's tokens per second. The policy is the run's starting policy (the SFT
checkpoint in out_dir, trained when absent; or model.path).

    cospec bench rollout-dp [--quick] [--layouts single,single@2,dp2] [--json PATH] [key=value ...]
"""

from __future__ import annotations

import random
import statistics
import time

import torch

from cospec.atomic_file import write_json_atomically
from cospec.config import RunConfig, SamplingConfig


def step_prompts(cfg: RunConfig, data, seed: int = 0) -> list[list[int]]:
    """The R prompts of a GRPO step (each group_size times, groups contiguous)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(cfg.grpo.prompts_per_step):
        prompts += [data.prompt_ids(data.source.sample(rng))] * cfg.grpo.group_size
    return prompts


def _parse(layout: str) -> tuple[int, int]:
    """(processes, threads per process) of a layout name."""
    if layout == "single":
        return 1, 1
    if layout.startswith("single@"):
        return 1, int(layout.split("@")[1])
    if layout.startswith("dp") and layout[2:].isdigit() and int(layout[2:]) >= 2:
        return int(layout[2:]), 1
    raise ValueError(f"layout must be single, single@THREADS or dpN (N >= 2), got {layout!r}")


def _replica_rounds(rank: int, num_ranks: int, policy, prompts, sampling: SamplingConfig,
                    batch_size: int, stop_ids, threads: int, repeats: int) -> dict:
    import torch.distributed as dist

    from cospec.rollout.engine import GenerationEngine

    torch.set_num_threads(threads)
    if torch.cuda.is_available():  # a replica per device
        policy = policy.to(torch.device("cuda", rank % torch.cuda.device_count()))
    share = len(prompts) // num_ranks
    mine = range(rank * share, (rank + 1) * share)
    engine = GenerationEngine(policy, batch_size=batch_size, stop_ids=stop_ids)
    seeds = [1_000 + k for k in mine]
    engine.generate([prompts[k] for k in mine[:batch_size]], sampling, seeds=seeds[:batch_size])
    seconds, tokens = [], 0
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        result = engine.generate([prompts[k] for k in mine], sampling, seeds=seeds)
        seconds.append(time.perf_counter() - t0)
        tokens = result.num_tokens
    return {"seconds": seconds, "tokens": tokens}


def run(cfg: RunConfig, policy, data, layouts=("single", "single@2", "dp2"),
        repeats: int = 3) -> list[dict]:
    from cospec.parallel.launch import spawn

    prompts = step_prompts(cfg, data)
    s = cfg.sampling
    sampling = SamplingConfig(temperature=s.temperature, max_new_tokens=s.max_new_tokens)
    rows = []
    for layout in layouts:
        ranks, threads = _parse(layout)
        if len(prompts) % ranks:
            raise ValueError(f"{layout}: {len(prompts)} rollouts do not split over {ranks} replicas")
        per_rank = spawn(_replica_rounds, ranks, policy, prompts, sampling, s.batch_size,
                         data.tokenizer.stop_ids, threads, repeats, timeout_s=1800)
        rounds = [max(r["seconds"][i] for r in per_rank) for i in range(repeats)]
        tokens = sum(r["tokens"] for r in per_rank)
        seconds = statistics.median(rounds)
        rows.append({"layout": layout, "processes": ranks, "threads": threads, "cores": ranks * threads,
                     "rollouts": len(prompts), "tokens": tokens, "seconds": seconds,
                     "tokens_per_second": tokens / seconds})
    by_layout = {r["layout"]: r for r in rows}
    base = by_layout.get("single")
    for r in rows:
        same = by_layout.get(f"single@{r['cores']}") if r["cores"] > 1 else None
        r["vs_single"] = r["tokens_per_second"] / base["tokens_per_second"] if base else None
        r["vs_single_same_cores"] = (r["tokens_per_second"] / same["tokens_per_second"]
                                     if same else None)
    return rows


def format_table(rows: list[dict]) -> str:
    fmt = lambda x: f"{x:.2f}" if x is not None else "-"  # noqa: E731
    lines = [f"{'layout':>9} {'procs':>5} {'threads':>7} {'tokens':>7} {'seconds':>8} {'tok/s':>7} "
             f"{'x single':>8} {'x single, same cores':>20}", "-" * 80]
    for r in rows:
        lines.append(f"{r['layout']:>9} {r['processes']:>5} {r['threads']:>7} {r['tokens']:>7} "
                     f"{r['seconds']:>8.2f} {r['tokens_per_second']:>7.0f} {fmt(r['vs_single']):>8} "
                     f"{fmt(r['vs_single_same_cores']):>20}")
    return "\n".join(lines)


def run_cli(cfg: RunConfig, *, layouts: str = "single,single@2,dp2", quick: bool = False,
            json_path: str | None = None, reuse: bool = False) -> list[dict]:
    from cospec.artifacts import load_policy
    from cospec.data.prompts import TaskData

    start = load_policy(cfg, torch.device("cpu"), reuse=reuse)
    policy = start.policy.eval()
    data = TaskData.from_config(cfg.task, start.tokenizer)
    repeats = 1 if quick else 3
    rows = run(cfg, policy, data, layouts=layouts.split(","), repeats=repeats)
    print(format_table(rows))
    if json_path:
        write_json_atomically(json_path, {"config": cfg.to_dict(), "repeats": repeats, "results": rows},
                              indent=1)
    return rows
