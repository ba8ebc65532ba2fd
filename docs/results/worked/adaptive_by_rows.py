"""Run from the repository root with the default SFT policy and EAGLE-3 draft in runs/default:
plain, adaptive and fixed-gamma-4 tokens/s on 128 default prompts at the given batch sizes
(`python docs/results/worked/adaptive_by_rows.py 64`), 3 interleaved repeats after a warm-up,
the adaptive controller's gamma per step counted by active rows (16-row groups above batch 16),
and its whole-step corrections c(N, G) and kept fractions f(G) after the run."""

import collections
import random
import sys
import time

import torch
import cospec.rollout.adaptive as adaptive
from cospec.config import resolve
from cospec.data.prompts import TaskData
from cospec.data.tokenizer import CharTokenizer
from cospec.models.draft_checkpoint import load_draft
from cospec.models.hf_checkpoint import load_hf
from cospec.rollout.engine import GenerationEngine
from cospec.rollout.speculative import SpeculativeEngine
OUT = "runs/default"
cfg = resolve("default", None, [f"out_dir={OUT}"])
policy, draft = load_hf(f"{OUT}/sft").eval(), load_draft(f"{OUT}/draft").eval()
data = TaskData.from_config(cfg.task, CharTokenizer())
rng = random.Random(1)
prompts = [data.prompt_ids(data.source.sample(rng)) for _ in range(128)]
choices = []
choose = adaptive.AdaptiveGamma.choose
def recording_choose(self, n):
    g = choose(self, n); choices.append((n, g)); return g
adaptive.AdaptiveGamma.choose = recording_choose
stops = data.tokenizer.stop_ids
def tok_s(engine):
    t = time.perf_counter()
    r = engine.generate(prompts, cfg.sampling, generator=torch.Generator().manual_seed(0))
    return r.num_tokens / (time.perf_counter() - t)
for B in [int(x) for x in sys.argv[1].split(",")]:
    plain = GenerationEngine(policy, batch_size=B, stop_ids=stops)
    spec = SpeculativeEngine(policy, draft, batch_size=B, gamma=4, adaptive=True, stop_ids=stops)
    fixed = SpeculativeEngine(policy, draft, batch_size=B, gamma=4, stop_ids=stops)
    tok_s(plain), tok_s(spec), tok_s(fixed)
    res = collections.defaultdict(list)
    for rep in range(3):
        choices.clear()
        for k, e in (("plain", plain), ("adaptive", spec), ("fixed", fixed)):
            res[k].append(tok_s(e))
    by = collections.defaultdict(collections.Counter)
    for n, g in choices: by[n // 16 * 16 if B > 16 else n][g] += 1
    p = max(res["plain"])
    print(f"B{B}: plain {p:.0f} adaptive {max(res['adaptive'])/p:.2f}x fixed {max(res['fixed'])/p:.2f}x",
          {k: [round(v) for v in vs] for k, vs in res.items()})
    print("   gammas by rows:", {r: dict(c) for r, c in sorted(by.items())})
    c = spec.controller
    if hasattr(c, "step_correction"):
        print("   correction:", {g: {n: round(v, 2) for n, v in sorted(t.items())} for g, t in sorted(c.step_correction.items())},
              "kept:", [round(c.kept_fraction(g), 3) for g in range(5)])
