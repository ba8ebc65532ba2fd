"""SmolLM2 (the recipe): how a draft's tau reads on smaller prompt sets drawn from the same
held-out answers (docs/results/real_model.md, "Real tau against expected tau"). Each held-out
answer's expected steps and tokens (the chain, `expected_accept_length`, one answer at a time),
then the pooled tau (tokens over steps) of many random subsets of SIZE answers: if rare, heavy
answers decide a set's tau, small sets read above the whole set's tau more often than below.

    python docs/results/real_model/tau_subsets.py NUM_ANSWERS DRAFT_DIR SIZE[,SIZE...] -- overrides

Answers and policy outputs as in expected_tau_check.py (beside this script).
"""
import random
import statistics
import sys

from expected_tau_check import recipe_held_out  # beside this script

import torch

from cospec.draft.expected_accept_length import expected_accept_length
from cospec.draft.policy_outputs import policy_batches
from cospec.models.draft_checkpoint import load_draft

SUBSETS = 2000


def main(count: int, draft_dir: str, sizes: list[int], overrides: list[str]) -> None:
    cfg, policy, held = recipe_held_out(count, overrides)
    draft = load_draft(draft_dir, device=next(policy.parameters()).device).eval()
    per_answer = []  # (expected steps, tokens) of each answer
    with torch.no_grad():
        for a in held:
            batches = policy_batches(cfg, policy, [a], vocab_ids=draft.vocab_ids)
            per_answer.append(expected_accept_length(draft, batches, cfg.rollout.gamma,
                                                     cfg.sampling.temperature))
    whole = sum(t for _, t in per_answer) / sum(s for s, _ in per_answer)
    print(f"{draft_dir}: expected tau on all {len(held)} answers {whole:.3f}")
    rng = random.Random(0)
    for size in sizes:
        taus = []
        for _ in range(SUBSETS):
            pick = rng.sample(per_answer, size)
            taus.append(sum(t for _, t in pick) / sum(s for s, _ in pick))
        taus.sort()
        above = sum(t > whole for t in taus) / len(taus)
        print(f"{SUBSETS} subsets of {size} answers: median {statistics.median(taus):.3f}, "
              f"5-95% {taus[len(taus) // 20]:.3f}-{taus[-len(taus) // 20]:.3f}, "
              f"above the whole set's {above:.0%}, >= 2.8 {sum(t >= 2.8 for t in taus) / len(taus):.0%}")


if __name__ == "__main__":
    args = sys.argv[1:]
    cut = args.index("--") if "--" in args else len(args)
    main(int(args[0]), args[1], [int(s) for s in args[2].split(",")], args[cut + 1:])
