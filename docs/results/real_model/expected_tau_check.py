"""SmolLM2 (the recipe): saved drafts measured side by side on the same held-out answers:
teacher-forced acceptance by TTT step and the expected tau of drafting gamma tokens a step on
those answers (`cospec.draft.expected_accept_length`, docs/design.md, "Expected accept length
on fixed answers"). Paired: every draft meets the same answers, so differences between drafts
are not the draws of a rollout. docs/results/real_model.md, "Where drafting starts".

    python docs/results/real_model/expected_tau_check.py NUM_ANSWERS DRAFT_DIR [...] [-- overrides]

The answers are the first NUM_ANSWERS of the held-out split kept in out_dir's answer store
(sampled there first if missing, as `cospec draft-train` samples them: the bf16 rollout engine
on an AMX CPU); the policy's outputs on them are computed in fp32 (in bf16 autocast with
draft.autocast=bfloat16 among the overrides).
"""
import sys

import torch

from cospec.artifacts import answer_store, load_policy, pick_device, starting_policy_fields
from cospec.config import resolve
from cospec.data.prompts import TaskData
from cospec.draft.offline import held_out_metrics, sample_responses
from cospec.draft.policy_outputs import policy_batches
from cospec.models.draft_checkpoint import load_draft
from cospec.models.loading import with_checkpoint_model


def recipe_held_out(count: int, overrides: list[str]):
    """(cfg, the fp32 policy, the first ``count`` held-out answers of out_dir's answer store)."""
    torch.set_num_threads(2)
    # the policy's outputs in fp32 unless the overrides say draft.autocast=bfloat16 (the
    # recipe's, under which draft-train computes its targets since stop 51)
    cfg = with_checkpoint_model(resolve("smollm2-math", overrides=["draft.autocast="] + overrides + [
        f"draft.num_eval_prompts={count}"]))
    start = load_policy(cfg, pick_device(cfg.device))
    policy, data = start.policy.eval(), TaskData.from_config(cfg.task, start.tokenizer)
    held = sample_responses(cfg, policy, data, split="held_out",
                            store=answer_store(cfg, starting_policy_fields(cfg)))
    return cfg, policy, held


def main(count: int, dirs: list[str], overrides: list[str]) -> None:
    cfg, policy, held = recipe_held_out(count, overrides)
    device = next(policy.parameters()).device
    batches, vocab_ids = None, None
    for d in dirs:
        draft = load_draft(d, device=device).eval()
        same_head = (draft.vocab_ids is None and vocab_ids is None) or (
            draft.vocab_ids is not None and vocab_ids is not None
            and torch.equal(draft.vocab_ids, vocab_ids))
        if batches is None or not same_head:
            # the policy's outputs in the form this draft's head reads (computed again only
            # for a draft with another vocabulary)
            vocab_ids = draft.vocab_ids
            batches = policy_batches(cfg, policy, held, vocab_ids=vocab_ids, progress=True)
        m = held_out_metrics(draft, batches, cfg)
        print(f"{d}: {len(held)} held-out answers, acceptance by TTT step "
              f"{[round(a, 3) for a in m['acceptance']]}, expected tau at gamma "
              f"{cfg.rollout.gamma}: {m['expected_accept_length'][0]:.3f}", flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    cut = args.index("--") if "--" in args else len(args)
    main(int(args[0]), args[1:cut], args[cut + 1:])
