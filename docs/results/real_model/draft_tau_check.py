"""SmolLM2 (the recipe's policy, fp32): tau of saved EAGLE-3 drafts in real speculative sampling,
side by side on the same 64 held-out prompts and seed (the prompts `cospec draft-train` checks
on), batch 16, gamma 4, the recipe's temperature (docs/results/real_model.md, "The draft's
held-out acceptance as it trains").

    python docs/results/real_model/draft_tau_check.py DRAFT_DIR [DRAFT_DIR ...]
"""
import random
import sys
import time

import torch

from cospec.artifacts import load_policy, pick_device
from cospec.config import resolve
from cospec.data.prompts import TaskData
from cospec.models.draft_checkpoint import load_draft
from cospec.models.loading import with_checkpoint_model
from cospec.rollout.speculative import SpeculativeEngine

OVERRIDES = ["rollout.dtype=float32", "grpo.autocast=", "draft.autocast="]


def main(dirs: list[str]) -> None:
    torch.set_num_threads(2)
    cfg = with_checkpoint_model(resolve("smollm2-math", overrides=OVERRIDES))
    start = load_policy(cfg, pick_device(cfg.device))
    policy, data = start.policy.eval(), TaskData.from_config(cfg.task, start.tokenizer)
    rng = random.Random(4321)
    prompts = [data.prompt_ids(data.source.sample(rng)) for _ in range(64)]
    for d in dirs:
        draft = load_draft(d, device=next(policy.parameters()).device).eval()
        engine = SpeculativeEngine(policy, draft, batch_size=16, gamma=4,
                                   stop_ids=data.tokenizer.stop_ids)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = engine.generate(prompts, cfg.sampling, generator=torch.Generator().manual_seed(4321))
        st = out.stats
        print(f"{d}: tau {st.accept_length:.3f}, acceptance by position "
              f"{[round(a, 3) for a in st.acceptance_by_position]}, {out.num_tokens} tokens, "
              f"{time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
