"""SmolLM2 (the recipe): a draft's expected tau on held-out answers, by the answer's length.
Tau pools tokens over steps, so a few long answers weigh as much as many short ones: the
answers that run to the response cap (384 tokens) are ~2% of the answers and ~13% of the
tokens. Are they easier or harder to draft? (docs/results/real_model.md, "Real tau against
expected tau")

    python docs/results/real_model/tau_by_answer_length.py NUM_ANSWERS DRAFT_DIR -- overrides

Answers and policy outputs as in expected_tau_check.py (beside this script; fp32 unless the
overrides say draft.autocast=bfloat16).
"""
import sys

from expected_tau_check import recipe_held_out  # beside this script

import torch

from cospec.draft.expected_accept_length import expected_accept_length
from cospec.draft.policy_outputs import policy_batches
from cospec.models.draft_checkpoint import load_draft

GROUPS = (("< 40 tokens", 0, 40), ("40-99", 40, 100), ("100-379", 100, 380),
          (">= 380 (the cap)", 380, 10 ** 9))


def main(count: int, draft_dir: str, overrides: list[str]) -> None:
    cfg, policy, held = recipe_held_out(count, overrides)
    draft = load_draft(draft_dir, device=next(policy.parameters()).device).eval()
    total_steps, total_tokens = 0.0, 0
    rows = []
    for name, lo, hi in GROUPS:
        answers = [a for a in held if lo <= len(a.tokens) < hi]
        if not answers:
            continue
        batches = policy_batches(cfg, policy, answers, vocab_ids=draft.vocab_ids)
        with torch.no_grad():
            steps, tokens = expected_accept_length(draft, batches, cfg.rollout.gamma,
                                                   cfg.sampling.temperature)
        total_steps, total_tokens = total_steps + steps, total_tokens + tokens
        rows.append((name, len(answers), tokens, steps))
    print(f"{draft_dir} (proposal scale {draft.proposal_scale:g}) on {len(held)} held-out "
          f"answers, gamma {cfg.rollout.gamma}")
    print(f"{'answer length':>18} {'answers':>8} {'tokens':>8} {'share':>6} {'expected tau':>13}")
    for name, n, tokens, steps in rows:
        print(f"{name:>18} {n:>8} {tokens:>8} {tokens / total_tokens:>6.1%} {tokens / steps:>13.3f}")
    print(f"{'all':>18} {len(held):>8} {total_tokens:>8} {1:>6.0%} {total_tokens / total_steps:>13.3f}")


if __name__ == "__main__":
    args = sys.argv[1:]
    cut = args.index("--") if "--" in args else len(args)
    main(int(args[0]), args[1], args[cut + 1:])
