"""Accuracy and response lengths of a policy on the run's prompts, by prompt family and temperature.

    cospec eval [model.path=smollm2 task.source=math] [--temperatures 0,0.7,1] [--prompts-per-type N]

For each family of the prompt source (task families, word-problem types, a JSONL file's "type"
values) the same ``N`` held-out prompts (a seed the training streams never use) are answered at
every temperature. Reported per family: accuracy (the verifier's mean score; a response cut off
before a stop token scores 0, as in RL with ``grpo.require_eos``), response length (mean, median,
p90, max, in tokens) and the share of responses that ended by themselves. This is what tells whether
RL has signal: a family at 0% or 100% gives GRPO groups with no reward variance.
"""

from __future__ import annotations

import dataclasses
import random

import torch

from cospec.config import RunConfig, SamplingConfig
from cospec.data.prompts import TaskData
from cospec.rollout.engine import GenerationEngine


def evaluate_policy(policy, data: TaskData, sampling: SamplingConfig, *, prompts_per_family: int,
                    batch_size: int, seed: int = 12345, require_stop: bool = True,
                    progress: bool = False) -> dict:
    """{"by_family": {family: {accuracy, length_mean, length_median, length_p90, length_max,
    stopped}}, "accuracy": mean over families, "tokens_per_second", "num_prompts"}."""
    rng = random.Random(seed)
    examples = [data.source.sample_family(f, rng)
                for f in data.source.family_names for _ in range(prompts_per_family)]
    engine = GenerationEngine(policy, batch_size=batch_size, stop_ids=data.tokenizer.stop_ids)
    device = next(policy.parameters()).device
    result = engine.generate([data.prompt_ids(e) for e in examples], sampling, progress=progress,
                             generator=torch.Generator(device=device).manual_seed(seed))
    rows: dict[str, list[tuple[float, int, bool]]] = {}
    for ex, c in zip(examples, result.completions):
        stopped = c.finish_reason == "eos"
        score = data.reward(ex, c.tokens) if stopped or not require_stop else 0.0
        rows.setdefault(ex.family, []).append((score, len(c.tokens), stopped))
    by_family = {}
    for family, got in rows.items():
        lengths = sorted(n for _, n, _ in got)
        by_family[family] = {
            "accuracy": sum(s for s, _, _ in got) / len(got),
            "length_mean": sum(lengths) / len(lengths), "length_median": lengths[len(lengths) // 2],
            "length_p90": lengths[int(0.9 * (len(lengths) - 1))], "length_max": lengths[-1],
            "stopped": sum(st for _, _, st in got) / len(got)}
    return {"by_family": by_family,
            "accuracy": sum(f["accuracy"] for f in by_family.values()) / len(by_family),
            "tokens_per_second": result.tokens_per_second, "num_prompts": len(examples)}


def format_table(results: dict[float, dict]) -> str:
    """One line per (temperature, family), results keyed by temperature."""
    head = (f"{'temp':>5} {'family':>10} {'accuracy':>9} {'len mean':>9} {'median':>7} {'p90':>5} "
            f"{'max':>5} {'stopped':>8}")
    lines = [head, "-" * len(head)]
    for temp, res in results.items():
        for family, f in res["by_family"].items():
            lines.append(f"{temp:>5.2f} {family:>10} {f['accuracy']:>9.1%} {f['length_mean']:>9.1f} "
                         f"{f['length_median']:>7} {f['length_p90']:>5} {f['length_max']:>5} "
                         f"{f['stopped']:>8.0%}")
        lines.append(f"{temp:>5.2f} {'all':>10} {res['accuracy']:>9.1%}   "
                     f"({res['num_prompts']} prompts, {res['tokens_per_second']:.0f} tok/s)")
    return "\n".join(lines)


def measure_speculation(cfg: RunConfig, policy, draft, data: TaskData, *, num_prompts: int = 64,
                        seed: int = 4321):
    """Speculative generation of held-out task prompts at the config's sampling and gamma:
    (result, plain result) on the same prompts, for a quick look at tau and speedup.

    Each engine first decodes a few tokens of one batch untimed: the first generation in a
    process pays one-time costs (allocations, kernel choices for new shapes), and without the
    warm-up the engine timed first (speculative) paid them alone. The warm-up changes no token:
    the timed run starts from the same seed."""
    from cospec.models.loading import inference_copy
    from cospec.rollout.engine import GenerationEngine
    from cospec.rollout.speculative import SpeculativeEngine

    rng = random.Random(seed)
    prompts = [data.prompt_ids(data.source.sample(rng)) for _ in range(num_prompts)]
    device = next(policy.parameters()).device
    B, s, stops = cfg.sampling.batch_size, cfg.sampling, data.tokenizer.stop_ids
    if cfg.rollout.dtype:  # as rollouts run
        policy, draft = inference_copy(policy, cfg.rollout.dtype), inference_copy(draft, cfg.rollout.dtype)
    warm_up = dataclasses.replace(s, max_new_tokens=min(s.max_new_tokens, 4 * (cfg.rollout.gamma + 1)))
    results = []
    for engine in (SpeculativeEngine(policy, draft, batch_size=B, gamma=cfg.rollout.gamma, stop_ids=stops),
                   GenerationEngine(policy, batch_size=B, stop_ids=stops)):
        engine.generate(prompts[:B], warm_up, generator=torch.Generator(device=device).manual_seed(seed))
        generator = torch.Generator(device=device).manual_seed(seed)
        results.append(engine.generate(prompts, s, generator=generator))
    return tuple(results)


def print_accuracy(metrics: dict) -> None:
    """The SFT run's size, time and loss, and its greedy accuracy by family as a table."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"SFT: {metrics['num_params'] / 1e6:.2f}M params, {metrics['steps']} steps, "
                  f"{metrics['train_seconds']:.0f}s train, final loss {metrics['final_loss']:.3f}")
    t = Table()
    t.add_column("family")
    t.add_column("greedy accuracy", justify="right")
    for k, v in metrics["accuracy"].items():
        t.add_row(k, f"{v:.1%}")
    console.print(t)
