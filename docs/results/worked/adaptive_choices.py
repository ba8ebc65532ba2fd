"""Run from the repository root after `cospec demo out_dir=/tmp/demo_fresh` (docs/results/rollout.md):
the adaptive controller's gamma per step at batch 64 on 128 default prompts, counted by the number
of active rows, beside plain decoding's throughput on the same prompts and seed."""

import collections
import random
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

OUT = "/tmp/demo_fresh"
cfg = resolve("default", None, [f"out_dir={OUT}"])
policy, draft = load_hf(f"{OUT}/sft").eval(), load_draft(f"{OUT}/draft").eval()
data = TaskData.from_config(cfg.task, CharTokenizer())
rng = random.Random(1)
prompts = [data.prompt_ids(data.source.sample(rng)) for _ in range(128)]

choices = []  # (active rows, gamma chosen, predicted tok/s by gamma)
choose = adaptive.AdaptiveGamma.choose


def recording_choose(self, n):
    gamma = choose(self, n)
    choices.append((n, gamma, {g: self.throughput(n, g) for g in range(self.gamma_max + 1)}))
    return gamma


adaptive.AdaptiveGamma.choose = recording_choose
stops = data.tokenizer.stop_ids
plain = GenerationEngine(policy, batch_size=64, stop_ids=stops)
spec = SpeculativeEngine(policy, draft, batch_size=64, gamma=4, adaptive=True, stop_ids=stops)


def tok_s(engine) -> float:
    start = time.perf_counter()
    with torch.inference_mode():
        result = engine.generate(prompts, cfg.sampling, generator=torch.Generator().manual_seed(0))
    return result.num_tokens / (time.perf_counter() - start)


tok_s(plain), tok_s(spec)  # warm-up (the speculative engine calibrates its cost model here)
plain_tok_s = tok_s(plain)
choices.clear()
adaptive_tok_s = tok_s(spec)
print(f"plain {plain_tok_s:.0f} tok/s, adaptive {adaptive_tok_s:.0f} ({adaptive_tok_s / plain_tok_s:.2f}x)")
by_rows = collections.defaultdict(collections.Counter)
for n, gamma, _ in choices:
    by_rows[n // 16 * 16][gamma] += 1
for rows in sorted(by_rows):
    print(f"{rows}-{rows + 15} active rows: gamma counts {dict(by_rows[rows])}")
for n, gamma, predicted in [c for c in choices if c[0] == 64][:3]:
    print(n, gamma, {g: round(v) if v else v for g, v in predicted.items()})
