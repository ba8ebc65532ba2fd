"""Adaptive speculation against plain decoding of the same response lengths, with enough prompts
and repeats that the ratio's spread is known (docs/results/rollout.md, "Paired speedups").

    python docs/results/worked/adaptive_paired.py 16:128:5,64:256:3 [JSON]

Each BATCH:PROMPTS:REPEATS: the default task mix, gamma 4, the default SFT policy and EAGLE-3
draft in runs/default (`cospec draft-train` makes them). Per repeat r (seed 1 + r), in turn:
plain decoding; the engine forced to gamma 0 (the same tokens as plain: what a gamma-0 step costs
over a plain one); the adaptive engine; plain decoding of responses of exactly the adaptive
run's lengths (`cospec.bench.rollout.timed_runs`, the bench's paired baseline; it also decodes
the gamma-0 run's lengths, i.e. plain's work again, which gives the timing noise alone). Prints
per repeat and in total: plain / gamma-0 seconds, plain / plain again, and the paired adaptive
speedup (plain on adaptive's lengths over adaptive), with the unpaired one beside it.
"""

import json
import sys

import torch

from cospec.bench.rollout import _load_inputs, timed_runs
from cospec.config import resolve
from cospec.rollout.adaptive import AdaptiveGamma
from cospec.rollout.engine import GenerationEngine
from cospec.rollout.speculative import SpeculativeEngine


class ZeroGamma(AdaptiveGamma):
    """Always plain decoding: the speculative engine's gamma-0 step, every step."""

    def choose(self, n: int, catch_up: int = 0) -> int:
        return 0


def main(plan: list[tuple[int, int, int]], out: str | None, gamma: int = 4) -> None:
    # the bench's loading: the SFT policy and EAGLE-3 draft in runs/default, reused as they are
    run = _load_inputs(resolve("default", None, ["out_dir=runs/default"]), quick=False,
                       workload="tasks", reuse=True, drafts=("eagle3",))
    policy, draft, sampling = run.policy, run.drafts["eagle3"], run.sampling
    stops = run.data.tokenizer.stop_ids
    rows = []
    for B, num_prompts, repeats in plan:
        prompts = run.prompts(num_prompts)
        engines = {
            "plain": GenerationEngine(policy, batch_size=B, stop_ids=stops),
            "gamma0": SpeculativeEngine(policy, draft, batch_size=B, gamma=gamma, stop_ids=stops,
                                        controller=ZeroGamma(gamma)),
            "adaptive": SpeculativeEngine(policy, draft, batch_size=B, gamma=gamma,
                                          stop_ids=stops, controller=AdaptiveGamma(gamma)),
        }
        with torch.inference_mode():
            for e in engines.values():
                e.generate(prompts[:B], sampling, generator=torch.Generator().manual_seed(0))
            timers = timed_runs(engines, prompts, sampling, repeats=repeats, seed=0)
        sec = {k: [res.seconds for res in t.results] for k, t in timers.items()}
        same = all(a.completions[i].tokens == p.completions[i].tokens
                   for a, p in zip(timers["gamma0"].results, timers["plain"].results)
                   for i in range(len(prompts)))
        row = {"batch_size": B, "num_prompts": len(prompts), "repeats": repeats,
               "seconds": sec, "gamma0_tokens_equal_plain": same,
               "plain_over_gamma0": sum(sec["plain"]) / sum(sec["gamma0"]),
               # the same work twice (gamma 0 samples plain's tokens): the timing noise alone
               "plain_over_plain_again": sum(sec["plain"]) / sum(sec["plain@gamma0"]),
               "adaptive_paired": sum(sec["plain@adaptive"]) / sum(sec["adaptive"]),
               "adaptive_unpaired": timers["adaptive"].tok_s / timers["plain"].tok_s,
               "gamma_counts": [dict(sorted(res.stats.gamma_counts.items()))
                                for res in timers["adaptive"].results]}
        rows.append(row)
        for r in range(repeats):
            print(f"B{B} repeat {r}: plain / gamma-0 {sec['plain'][r] / sec['gamma0'][r]:.3f}, "
                  f"plain / plain again {sec['plain'][r] / sec['plain@gamma0'][r]:.3f}, "
                  f"adaptive paired {sec['plain@adaptive'][r] / sec['adaptive'][r]:.3f} "
                  f"({sec['adaptive'][r]:.1f} s; gammas {row['gamma_counts'][r]})", flush=True)
        print(f"B{B} ({len(prompts)} prompts, {repeats} repeats): plain / gamma-0 "
              f"{row['plain_over_gamma0']:.3f} (tokens equal: {same}), plain / plain again "
              f"{row['plain_over_plain_again']:.3f}, adaptive paired "
              f"{row['adaptive_paired']:.3f}, unpaired {row['adaptive_unpaired']:.3f}", flush=True)
    if out:
        meta = {"threads": torch.get_num_threads(), "gamma": gamma,
                "command": "python docs/results/worked/adaptive_paired.py "
                           + ",".join(":".join(map(str, p)) for p in plan)}
        with open(out, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)


if __name__ == "__main__":
    torch.set_num_threads(2)
    main([tuple(int(x) for x in p.split(":")) for p in sys.argv[1].split(",")],
         sys.argv[2] if len(sys.argv) > 2 else None)
