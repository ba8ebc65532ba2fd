"""SmolLM2 (the recipe): a saved draft's expected tau on fixed held-out answers at each of several
proposal scales (q = softmax(k * logits / T); `cospec.draft.expected_accept_length.
expected_steps_by_scale`, one unroll for all k; docs/design.md, "The proposal scale").

    python docs/results/real_model/proposal_scale_sweep.py NUM_ANSWERS DRAFT_DIR K[,K...] [-- overrides]

The answers are the first NUM_ANSWERS of the held-out split kept in out_dir's answer store (as
`expected_tau_check.py` reads them). In-sample for any k chosen from it: `fit_proposal_scale.py`
fits on one half and measures on the other.
"""
import sys

from expected_tau_check import recipe_held_out  # beside this script

from cospec.draft.expected_accept_length import expected_steps_by_scale
from cospec.draft.policy_outputs import policy_batches
from cospec.models.draft_checkpoint import load_draft


def main(count: int, draft_dir: str, scales: list[float], overrides: list[str]) -> None:
    cfg, policy, held = recipe_held_out(count, overrides)
    draft = load_draft(draft_dir, device=next(policy.parameters()).device).eval()
    batches = policy_batches(cfg, policy, held, vocab_ids=draft.vocab_ids, progress=True)
    by_scale = expected_steps_by_scale(draft, batches, cfg.rollout.gamma, cfg.sampling.temperature,
                                       scales)
    for k, (steps, tokens) in sorted(by_scale.items()):
        print(f"{draft_dir} on {len(held)} held-out answers: proposal scale {k:.4g}, expected tau "
              f"{tokens / steps:.4f}")


if __name__ == "__main__":
    args = sys.argv[1:]
    cut = args.index("--") if "--" in args else len(args)
    main(int(args[0]), args[1], [float(k) for k in args[2].split(",")], args[cut + 1:])
