"""SmolLM2 (the recipe's policy, fp32 unless --bf16): tau of saved EAGLE-3 drafts in real
speculative sampling, side by side, by `cospec.evaluate.measure_speculation` (what `cospec
draft-train` checks a new draft with: the same 64 held-out prompts and seed, the recipe's batch
16, gamma 4 and temperature; plain decoding of the same prompts beside it).
docs/results/real_model.md, "The draft's held-out acceptance as it trains".

    python docs/results/real_model/draft_tau_check.py [--bf16] [--seeds S1,S2,...] DRAFT_DIR [...]

--seeds: measure each draft on the 64 prompts of each seed (default 4321, draft-train's own), to
see how much tau moves with the prompts drawn. --bf16: the recipe's own precision (bf16
rollouts; needs bf16 matmul units to be quick) instead of fp32.
"""
import sys

import torch

from cospec.artifacts import load_policy, pick_device
from cospec.config import resolve
from cospec.data.prompts import TaskData
from cospec.evaluate import measure_speculation
from cospec.models.draft_checkpoint import load_draft
from cospec.models.loading import with_checkpoint_model

OVERRIDES = ["rollout.dtype=float32", "grpo.autocast=", "draft.autocast="]


def main(dirs: list[str], seeds: list[int], overrides: list[str]) -> None:
    torch.set_num_threads(2)
    cfg = with_checkpoint_model(resolve("smollm2-math", overrides=overrides))
    start = load_policy(cfg, pick_device(cfg.device))
    policy, data = start.policy.eval(), TaskData.from_config(cfg.task, start.tokenizer)
    for d in dirs:
        draft = load_draft(d, device=next(policy.parameters()).device).eval()
        for seed in seeds:
            with torch.inference_mode():
                spec, plain = measure_speculation(cfg, policy, draft, data, seed=seed)
            st = spec.stats
            print(f"{d} (prompts of seed {seed}): tau {st.accept_length:.3f}, acceptance by position "
                  f"{[round(a, 3) for a in st.acceptance_by_position]}, {spec.num_tokens} tokens, "
                  f"{spec.tokens_per_second:.0f} tok/s vs plain {plain.tokens_per_second:.0f}",
                  flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    seeds, overrides = [4321], OVERRIDES
    if args[:1] == ["--bf16"]:
        overrides, args = [], args[1:]
    if args[:1] == ["--seeds"]:
        seeds, args = [int(x) for x in args[1].split(",")], args[2:]
    main(args, seeds, overrides)
