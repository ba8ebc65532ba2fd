"""`cospec bench compile`: eager vs compiled (``rollout.compile``) rollouts, plain and speculative,
on the run's starting policy and its trained draft, measured side by side in one run.

Per batch size B, four engines answer the same prompts (2B of them, at least 16) with the same
seeds: plain and speculative (fixed gamma), each eager and compiled. The first call of each
engine is a warm-up on the same prompts; for a compiled engine it also compiles its graphs (one
per verify length and attention span, `cospec.rollout.compiled_forward`; `precompile_engine`
makes those the warm-up did not reach), and its extra seconds are reported as the compile cost
(inductor caches compiled code on disk, so a second run of the benchmark pays less). The engines
then run interleaved, ``repeats`` times each; tokens/s is total tokens over total seconds.

Equality: each compiled engine's sampled tokens are compared with its eager twin's (same seed,
same batch): the compiled logits differ from eager by float rounding only, so the rows agree
unless a uniform draw falls within ~1e-6 of a CDF boundary. The benchmark reports the share of
rows that agree (1.0 expected).
"""

from __future__ import annotations

import time

import torch

from cospec.atomic_file import write_json_atomically
from cospec.bench.rollout import Timer, _load_inputs, _meta
from cospec.config import RunConfig
from cospec.rollout.compiled_forward import longest_row, precompile_engine
from cospec.rollout.engine import GenerationEngine
from cospec.rollout.speculative import SpeculativeEngine


def bench_batch_size(run, draft, prompts, *, batch_size: int) -> dict:
    stops = run.data.tokenizer.stop_ids
    engines = {
        "plain": GenerationEngine(run.policy, batch_size=batch_size, stop_ids=stops),
        "plain_compiled": GenerationEngine(run.policy, batch_size=batch_size, stop_ids=stops,
                                           compile=True),
        "spec": SpeculativeEngine(run.policy, draft, batch_size=batch_size, gamma=run.gamma,
                                  stop_ids=stops,
                                  overshoot_every=run.cfg.rollout.overshoot_every),
        "spec_compiled": SpeculativeEngine(run.policy, draft, batch_size=batch_size,
                                           gamma=run.gamma, stop_ids=stops, compile=True,
                                           overshoot_every=run.cfg.rollout.overshoot_every),
    }

    def generate(engine, batch, seed):
        return engine.generate(batch, run.sampling,
                               generator=torch.Generator(device=run.device).manual_seed(seed))

    warmup = {}
    with torch.inference_mode():
        for name, engine in engines.items():
            t0 = time.perf_counter()
            generate(engine, prompts, 0)
            # every span the runs reach: none compiles in the timed runs
            precompile_engine(engine, longest_row(prompts, run.sampling.max_new_tokens, run.gamma))
            warmup[name] = time.perf_counter() - t0
    timers = {k: Timer() for k in engines}
    for r in range(run.repeats):
        for name, engine in engines.items():
            timers[name].add(generate(engine, prompts, 1 + r))
    agree = {}
    for kind in ("plain", "spec"):
        pairs = [(a, b) for ra, rb in zip(timers[kind].results, timers[kind + "_compiled"].results)
                 for a, b in zip(ra.completions, rb.completions)]
        agree[kind] = sum(a.tokens == b.tokens for a, b in pairs) / len(pairs)
    tok_s = {k: t.tok_s for k, t in timers.items()}
    return {"batch_size": batch_size, "num_prompts": len(prompts),
            **{f"{k}_tok_s": v for k, v in tok_s.items()},
            "plain_compiled_over_eager": tok_s["plain_compiled"] / tok_s["plain"],
            "spec_compiled_over_eager": tok_s["spec_compiled"] / tok_s["spec"],
            "spec_over_plain": tok_s["spec"] / tok_s["plain"],
            "spec_compiled_over_plain": tok_s["spec_compiled"] / tok_s["plain"],
            "spec_compiled_over_plain_compiled": tok_s["spec_compiled"] / tok_s["plain_compiled"],
            "compile_seconds": {k: warmup[k + "_compiled"] - warmup[k] for k in ("plain", "spec")},
            "compiled_calls_by_span": {
                "plain": engines["plain_compiled"].forward.compiled_calls_by_span,
                "verify": engines["spec_compiled"].forward.compiled_calls_by_span,
                "draft": getattr(engines["spec_compiled"].drafter.forward,
                                 "compiled_calls_by_span", {})},
            "rows_equal_to_eager": agree}


def format_table(rows: list[dict]) -> str:
    head = (f"{'batch':>5} {'plain':>7} {'plain c':>7} {'c/eager':>7} {'spec':>7} {'spec c':>7} "
            f"{'c/eager':>7} {'spec c/plain':>12} {'compile s':>9}  rows equal")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['batch_size']:>5} {r['plain_tok_s']:>7.1f} {r['plain_compiled_tok_s']:>7.1f} "
            f"{r['plain_compiled_over_eager']:>6.2f}x {r['spec_tok_s']:>7.1f} "
            f"{r['spec_compiled_tok_s']:>7.1f} {r['spec_compiled_over_eager']:>6.2f}x "
            f"{r['spec_compiled_over_plain']:>11.2f}x "
            f"{r['compile_seconds']['plain'] + r['compile_seconds']['spec']:>9.1f}  "
            f"plain {r['rows_equal_to_eager']['plain']:.2f}, spec {r['rows_equal_to_eager']['spec']:.2f}")
    return "\n".join(lines)


def run_cli(cfg: RunConfig, *, batch_sizes, quick: bool = False, json_path: str | None = None,
            reuse: bool = False) -> dict:
    """Train (or reuse) the SFT policy and the EAGLE-3 draft under cfg.out_dir, then measure one
    row per batch size (tokens/s of each engine, in tokens of the whole run)."""
    run = _load_inputs(cfg, quick=quick, workload="tasks", reuse=reuse)
    kind, draft = run.first_draft
    rows = []
    for B in batch_sizes:
        prompts = run.prompts(max(16 if quick else 24, 2 * B) // (2 if quick else 1))
        rows.append(bench_batch_size(run, draft, prompts, batch_size=B))
        print(format_table(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(format_table(rows))
    out = {"results": rows, "meta": {**_meta(run), "draft": kind, "compile": "both"}}
    if json_path:
        write_json_atomically(json_path, out, indent=2)
    return out
