"""What per-prompt random streams (`generate(seeds=...)`) cost against one generator, per token.

    python docs/results/worked/streams_cost.py     # needs runs/demo-w (the default's SFT policy
                                                  # and EAGLE-3 draft: cospec demo out_dir=...)

64 worked-default prompts at batch 16, temperature 1, max_new_tokens 160; four rounds, each a
generator call then a seeded call; prints the median seconds per token of each and their ratio.
"""
import random
import statistics

import torch

from cospec.config import resolve, SamplingConfig
from cospec.artifacts import load_policy
from cospec.data.prompts import TaskData
from cospec.rollout.engine import GenerationEngine
from cospec.rollout.speculative import SpeculativeEngine
from cospec.models.draft_checkpoint import load_draft
cfg = resolve(overrides=["out_dir=runs/demo-w"])
start = load_policy(cfg, torch.device("cpu"), reuse=True)
policy = start.policy.eval()
draft = load_draft("runs/demo-w/draft").eval()
data = TaskData.from_config(cfg.task, start.tokenizer)
rng = random.Random(0)
prompts = [data.prompt_ids(data.source.sample(rng)) for _ in range(64)]
s = SamplingConfig(temperature=1.0, max_new_tokens=160)
for name, eng in (("plain", GenerationEngine(policy, batch_size=16, stop_ids=data.tokenizer.stop_ids)),
                  ("eagle3 g4", SpeculativeEngine(policy, draft, batch_size=16, gamma=4, stop_ids=data.tokenizer.stop_ids))):
    eng.generate(prompts[:16], s, seeds=list(range(16)))
    gen_s, seed_s = [], []
    for rep in range(4):
        r = eng.generate(prompts, s, generator=torch.Generator().manual_seed(rep)); gen_s.append(r.seconds / r.num_tokens)
        r = eng.generate(prompts, s, seeds=list(range(rep * 64, rep * 64 + 64))); seed_s.append(r.seconds / r.num_tokens)
    print(name, "generator us/token", statistics.median(gen_s) * 1e6, "seeds us/token", statistics.median(seed_s) * 1e6, "ratio", statistics.median(seed_s) / statistics.median(gen_s))
