"""Adaptive speculation with and without pricing the switch-on's catch-up, beside plain decoding,
side by side in one run (`python docs/results/worked/adaptive_switch_on.py 1,4,16,64 [JSON]`, from
the repository root, with the default SFT policy and EAGLE-3 draft in runs/default: `cospec
draft-train` makes them).

The bench's prompts and seeds (`cospec bench rollout`: 2B prompts, at least 16, of the default
task mix; one warm-up, then 3 repeats interleaved, a new seed each), gamma 4. "unpriced" is the
controller before the switch-on pricing: it is told a catch-up of 0, so a drafting step
after plain ones is rated like any other; "priced" is the default controller (the first drafting
step pays the whole catch-up); "amortized" spreads it over the drafting streak a switch-on is
expected to start (`AmortizedGamma`, tried and not adopted: docs/results/rollout.md). Per
method: tokens/s over plain's, and where the time went (whole steps by gamma, the switch-on
steps, the draft's prefills of new rows), and what a catch-up entry costs against a row's plain
step."""

import json
import math
import sys

import torch

from cospec.bench.rollout import Timer
from cospec.bench.workloads import task_prompts
from cospec.config import SamplingConfig, resolve
from cospec.data.prompts import TaskData
from cospec.data.tokenizer import CharTokenizer
from cospec.models.draft_checkpoint import load_draft
from cospec.models.hf_checkpoint import load_hf
from cospec.rollout.adaptive import AdaptiveGamma
from cospec.rollout.engine import GenerationEngine
from cospec.rollout.speculative import SpeculativeEngine


class UnpricedGamma(AdaptiveGamma):
    """The controller is told no catch-up: switch-ons are rated like any drafting step."""

    def choose(self, n: int, catch_up: int = 0) -> int:
        return super().choose(n, 0)


class AmortizedGamma(AdaptiveGamma):
    """Tried on 2026-12-06 (stop 35), not adopted: a switch-on's catch-up spread over the drafting
    streak it is expected to start, ceil(W / L) entries with L the moving average (weight 0.3)
    of the lengths of ended streaks, at least 1 (1 until one has ended)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.streak, self.mean_streak = 0, None

    def _end_streak(self) -> None:
        if self.streak:
            m, length, self.streak = self.mean_streak, self.streak, 0
            self.mean_streak = length if m is None else 0.7 * m + 0.3 * length

    def observe_step(self, n, gamma, seconds, emitted, kept) -> None:
        super().observe_step(n, gamma, seconds, emitted, kept)
        if gamma > 0:
            self.streak += 1
        else:
            self._end_streak()

    def start_call(self) -> None:
        super().start_call()
        self._end_streak()

    def choose(self, n: int, catch_up: int = 0) -> int:
        if self.last_gamma == 0:
            catch_up = math.ceil(catch_up / max(1.0, self.mean_streak or 1.0))
        return super().choose(n, catch_up)


def main(batch_sizes: list[int], out: str | None, repeats: int = 3, gamma: int = 4) -> None:
    cfg = resolve("default", None, ["out_dir=runs/default"])
    policy, draft = load_hf("runs/default/sft").eval(), load_draft("runs/default/draft").eval()
    data = TaskData.from_config(cfg.task, CharTokenizer())
    s = cfg.sampling
    sampling = SamplingConfig(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                              max_new_tokens=s.max_new_tokens)
    stops = data.tokenizer.stop_ids
    rows = []
    for B in batch_sizes:
        prompts = task_prompts(cfg, max(2 * B, 16), data=data)
        engines = {
            "plain": GenerationEngine(policy, batch_size=B, stop_ids=stops),
            "unpriced": SpeculativeEngine(policy, draft, batch_size=B, gamma=gamma, stop_ids=stops,
                                          controller=UnpricedGamma(gamma)),
            "priced": SpeculativeEngine(policy, draft, batch_size=B, gamma=gamma, stop_ids=stops,
                                        controller=AdaptiveGamma(gamma)),
            "amortized": SpeculativeEngine(policy, draft, batch_size=B, gamma=gamma,
                                           stop_ids=stops, controller=AmortizedGamma(gamma)),
        }
        timers = {k: Timer() for k in engines}
        with torch.inference_mode():
            for e in engines.values():
                e.generate(prompts[:B], sampling, generator=torch.Generator().manual_seed(0))
            for r in range(repeats):
                for k, e in engines.items():
                    timers[k].add(e.generate(prompts, sampling,
                                             generator=torch.Generator().manual_seed(1 + r)))
        row = {"batch_size": B, "num_prompts": len(prompts),
               "plain_tok_s": timers["plain"].tok_s, "plain_seconds": timers["plain"].seconds}
        for k in ("unpriced", "priced", "amortized"):
            stats = [res.stats for res in timers[k].results]
            by_gamma, counts = {}, {}
            for st in stats:
                for g, sec in st.seconds_by_gamma.items():
                    by_gamma[g] = by_gamma.get(g, 0.0) + sec
                for g, c in st.gamma_counts.items():
                    counts[g] = counts.get(g, 0) + c
            row[k] = {"speedup": timers[k].tok_s / timers["plain"].tok_s,
                      "seconds": timers[k].seconds,
                      "gamma_counts": {str(g): c for g, c in sorted(counts.items())},
                      "seconds_by_gamma": {str(g): v for g, v in sorted(by_gamma.items())},
                      "switch_on_steps": sum(st.switch_on_steps for st in stats),
                      "switch_on_seconds": sum(st.switch_on_seconds for st in stats),
                      "draft_prefill_seconds": sum(st.draft_prefill_seconds for st in stats)}
        # what one catch-up entry costs against one row's plain step, from the priced engine's
        # cost table (the calibration's widest draft call, refined online)
        cost = engines["priced"].controller.cost
        widest = max(cost.draft)
        row["catch_up_entry_over_plain_row"] = (cost.draft_cost(B, widest) / (B * widest)) / (
            cost.verify_cost(B, 1) / B)
        rows.append(row)
        print(f"B{B}: plain {row['plain_tok_s']:.0f} tok/s ({row['plain_seconds']:.1f} s); a "
              f"catch-up entry costs {row['catch_up_entry_over_plain_row']:.2f} of a plain row-step")
        for k in ("unpriced", "priced", "amortized"):
            r = row[k]
            print(f"  {k:>10}: {r['speedup']:.3f}x ({r['seconds']:.1f} s), steps by gamma "
                  f"{r['gamma_counts']}, seconds by gamma "
                  f"{ {g: round(v, 2) for g, v in r['seconds_by_gamma'].items()} }, "
                  f"{r['switch_on_steps']} switch-ons {r['switch_on_seconds']:.2f} s, "
                  f"draft prefills {r['draft_prefill_seconds']:.2f} s")
    if out:
        meta = {"threads": torch.get_num_threads(), "repeats": repeats, "gamma": gamma,
                "command": "python docs/results/worked/adaptive_switch_on.py "
                           + ",".join(map(str, batch_sizes))}
        with open(out, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main([int(b) for b in sys.argv[1].split(",")], sys.argv[2] if len(sys.argv) > 2 else None)
