"""SmolLM2 (the recipe): fit a saved draft's proposal scale on one half of the held-out answers
and measure it on the other (`cospec.draft.expected_accept_length.fit_proposal_scale`;
docs/design.md, "The proposal scale"), then save a copy of the draft with the fitted scale.

    python docs/results/real_model/fit_proposal_scale.py NUM_ANSWERS DRAFT_DIR OUT_DIR [-- overrides]

The answers are the first NUM_ANSWERS of the held-out split kept in out_dir's answer store (as
`expected_tau_check.py` reads them); the first half fits, the second half measures expected tau
at scale 1 and at the fitted scale, so the gain is not read on the answers that chose it.
OUT_DIR gets the draft with its scale (draft.json's ``proposal_scale``), the weights unchanged.
"""
import sys

from expected_tau_check import recipe_held_out  # beside this script

from cospec.draft.expected_accept_length import expected_steps_by_scale, fit_proposal_scale
from cospec.draft.policy_outputs import policy_batches
from cospec.models.draft_checkpoint import load_draft, save_draft


def main(count: int, draft_dir: str, out_dir: str, overrides: list[str]) -> None:
    cfg, policy, held = recipe_held_out(count, overrides)
    device = next(policy.parameters()).device
    draft = load_draft(draft_dir, device=device).eval()
    gamma, t = cfg.rollout.gamma, cfg.sampling.temperature
    half = len(held) // 2
    fit_on = policy_batches(cfg, policy, held[:half], vocab_ids=draft.vocab_ids, progress=True)
    fit = fit_proposal_scale(draft, fit_on, gamma, t)
    print(f"fitted on {half} answers: scale {fit['scale']:.4g}, expected tau "
          f"{fit['expected_tau_at_1']:.4f} at 1 -> {fit['expected_tau']:.4f}", flush=True)
    measure_on = policy_batches(cfg, policy, held[half:], vocab_ids=draft.vocab_ids, progress=True)
    by_scale = expected_steps_by_scale(draft, measure_on, gamma, t, (1.0, fit["scale"]))
    tau = {k: tokens / steps for k, (steps, tokens) in by_scale.items()}
    print(f"measured on the other {len(held) - half} answers: expected tau {tau[1.0]:.4f} at 1, "
          f"{tau[fit['scale']]:.4f} at {fit['scale']:.4g} ({tau[fit['scale']] - tau[1.0]:+.4f})")
    draft.proposal_scale = fit["scale"]
    save_draft(draft, out_dir)
    print(f"saved {out_dir}")


if __name__ == "__main__":
    args = sys.argv[1:]
    cut = args.index("--") if "--" in args else len(args)
    main(int(args[0]), args[1], args[2], args[cut + 1:])
