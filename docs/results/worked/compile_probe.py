"""A naive `torch.compile` of the policy in plain generation, against eager, on the worked default.

    python docs/results/worked/compile_probe.py OUT_DIR   # OUT_DIR holds the default's SFT policy

64 task prompts at batch 16, temperature 1, max_new_tokens 160, per-prompt seeds (both sides
decode the same tokens); a warm-up call on 16 prompts (its time includes compiling), then two
timed calls. Prints tokens/s.
"""

import random
import sys
import time

import torch

from cospec.artifacts import load_policy
from cospec.config import SamplingConfig, resolve
from cospec.data.prompts import TaskData
from cospec.rollout.engine import GenerationEngine


def run(model, label, prompts, data, sampling):
    engine = GenerationEngine(model, batch_size=16, stop_ids=data.tokenizer.stop_ids)
    t = time.perf_counter()
    engine.generate(prompts[:16], sampling, seeds=list(range(16)))
    print(f"{label}: warm-up {time.perf_counter() - t:.1f} s")
    for _ in range(2):
        r = engine.generate(prompts, sampling, seeds=list(range(len(prompts))))
        print(f"{label}: {r.tokens_per_second:.0f} tok/s ({r.num_tokens} tokens)")


def main(out_dir: str) -> None:
    cfg = resolve(overrides=[f"out_dir={out_dir}"])
    start = load_policy(cfg, torch.device("cpu"), reuse=True)
    policy = start.policy.eval()
    data = TaskData.from_config(cfg.task, start.tokenizer)
    rng = random.Random(0)
    prompts = [data.prompt_ids(data.source.sample(rng)) for _ in range(64)]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=160)
    run(policy, "eager", prompts, data, sampling)
    torch._dynamo.config.cache_size_limit = 64
    run(torch.compile(policy, dynamic=True), "compiled", prompts, data, sampling)


if __name__ == "__main__":
    main(sys.argv[1])
