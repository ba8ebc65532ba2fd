"""SmolLM2 (the recipe, bf16 rollouts): real tau and speed of one draft proposing at scale 1 and
at its fitted proposal scale, side by side on the same prompts and seeds, with plain decoding
timed on each run's own answer lengths (the paired baseline, docs/design.md "Paired speedups").

    python docs/results/real_model/proposal_scale_rollouts.py DRAFT_DIR BATCH NUM_PROMPTS REPEATS

DRAFT_DIR: a draft whose draft.json holds the fitted scale (`fit_proposal_scale.py`). Each repeat
runs scale 1, then the fitted scale, then plain decoding at each run's lengths, all on the same
prompts with the same seed. Prints pooled tau, tokens/s and the paired speedup per scale.
"""
import random
import sys
import time

import torch

from cospec.artifacts import load_policy, pick_device
from cospec.config import resolve
from cospec.data.prompts import TaskData
from cospec.models.draft_checkpoint import load_draft
from cospec.models.loading import inference_copy, with_checkpoint_model
from cospec.rollout.engine import GenerationEngine
from cospec.rollout.sampling import SamplingConfig
from cospec.rollout.speculative import SpeculativeEngine


def main(draft_dir: str, batch: int, num_prompts: int, repeats: int) -> None:
    torch.set_num_threads(2)
    cfg = with_checkpoint_model(resolve("smollm2-math"))
    start = load_policy(cfg, pick_device(cfg.device))
    data, tok = TaskData.from_config(cfg.task, start.tokenizer), start.tokenizer
    policy = inference_copy(start.policy, cfg.rollout.dtype)
    draft = inference_copy(load_draft(draft_dir), cfg.rollout.dtype)
    fitted = draft.proposal_scale
    if fitted == 1.0:
        raise SystemExit(f"{draft_dir} proposes at scale 1: nothing to compare (fit_proposal_scale.py)")
    rng = random.Random(2024)
    prompts = [data.prompt_ids(data.source.sample(rng)) for _ in range(num_prompts)]
    s = cfg.sampling
    sampling = SamplingConfig(temperature=s.temperature, max_new_tokens=s.max_new_tokens)
    spec = SpeculativeEngine(policy, draft, batch_size=batch, gamma=cfg.rollout.gamma,
                             stop_ids=tok.stop_ids, overshoot_every=cfg.rollout.overshoot_every)
    plain = GenerationEngine(policy, batch_size=batch, stop_ids=tok.stop_ids)
    print(f"draft {draft_dir}: fitted scale {fitted:.4g}; batch {batch}, {num_prompts} prompts, "
          f"{repeats} repeats, T {s.temperature}, {cfg.rollout.dtype}", flush=True)
    totals = {k: [0, 0, 0.0, 0.0] for k in (1.0, fitted)}  # tokens, steps, seconds, plain seconds
    with torch.inference_mode():
        for engine in (spec, plain):  # warm-up
            engine.generate(prompts[:batch], sampling, generator=torch.Generator().manual_seed(0))
        for r in range(repeats):
            for k in (1.0, fitted):
                draft.proposal_scale = k
                t0 = time.perf_counter()
                res = spec.generate(prompts, sampling, generator=torch.Generator().manual_seed(1 + r))
                seconds = time.perf_counter() - t0
                lengths = [len(c.tokens) for c in res.completions]
                t0 = time.perf_counter()
                plain.generate(prompts, sampling, generator=torch.Generator().manual_seed(1 + r),
                               response_lengths=lengths)
                plain_seconds = time.perf_counter() - t0
                row = totals[k]
                row[0] += res.stats.step_tokens
                row[1] += res.stats.row_steps
                row[2] += seconds
                row[3] += plain_seconds
                print(f"repeat {r} scale {k:.4g}: tau {res.stats.accept_length:.3f}, "
                      f"{sum(lengths) / seconds:.1f} tok/s, paired {plain_seconds / seconds:.3f}x",
                      flush=True)
    for k, (tokens, steps, seconds, plain_seconds) in totals.items():
        print(f"scale {k:.4g}: tau {tokens / steps:.3f} over {steps} steps, paired speedup "
              f"{plain_seconds / seconds:.3f}x ({seconds:.1f} s against plain's {plain_seconds:.1f} s)")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
