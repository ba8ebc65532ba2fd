"""SmolLM2 (the recipe): the answers that run to the response cap, where a draft loses most of
its tau (docs/results/real_model.md, "Real tau against expected tau"). A draft's
teacher-forced acceptance and expected tau on capped answers it trained on and on held-out ones,
beside short answers it trained on; and for each capped held-out answer its acceptance at the
first TTT step, how sure p is, and the share of its tokens (and of p's mass there) that lies
outside the draft's reduced head, where q is 0.

    python docs/results/real_model/capped_answers.py DRAFT_DIR -- overrides

The training answers are the first draft.num_train_prompts kept in out_dir's answer store (the
draft's own, when out_dir is the one it was trained in); the rest as in expected_tau_check.py
(beside this script).
"""
import sys

from expected_tau_check import recipe_held_out  # beside this script

import torch

from cospec.artifacts import answer_store, starting_policy_fields
from cospec.draft.offline import held_out_metrics
from cospec.draft.policy_outputs import policy_batches
from cospec.models.draft_checkpoint import load_draft

CAP = 380  # tokens: an answer this long ran to (or within a few tokens of) the 384-token cap


def main(draft_dir: str, overrides: list[str]) -> None:
    cfg, policy, held = recipe_held_out(512, overrides)
    draft = load_draft(draft_dir, device=next(policy.parameters()).device).eval()
    kept = answer_store(cfg, starting_policy_fields(cfg)).load("train")
    train = [kept[i] for i in range(cfg.draft.num_train_prompts) if i in kept]
    capped_train = [a for a in train if len(a.tokens) >= CAP]
    capped_held = [a for a in held if len(a.tokens) >= CAP]
    share = sum(len(a.tokens) for a in capped_train) / sum(len(a.tokens) for a in train)
    print(f"{len(train)} training answers, {len(capped_train)} capped ({share:.1%} of the tokens)")
    groups = (("capped, trained on", capped_train[:20]), ("capped, held out", capped_held),
              ("< 100 tokens, trained on", [a for a in train if len(a.tokens) < 100][:200]))
    for name, answers in groups:
        m = held_out_metrics(draft, policy_batches(cfg, policy, answers, vocab_ids=draft.vocab_ids), cfg)
        print(f"{name} ({len(answers)} answers): acceptance by TTT step "
              f"{[round(a, 3) for a in m['acceptance']]}, expected tau {m['expected_accept_length'][0]:.3f}")
    head = set(draft.vocab_ids.tolist())
    t = cfg.sampling.temperature
    print("capped held-out answers: acceptance at TTT step 1 / p of the likeliest id of the head "
          "in the answer's second half (mean) / tokens outside the head / p's mass outside it")
    for a in capped_held:
        batch = policy_batches(cfg, policy, [a], vocab_ids=draft.vocab_ids)[0]
        accept = held_out_metrics(draft, [batch], cfg)["acceptance"][0]
        p = torch.softmax(batch.policy_logits[batch.loss_mask.bool()] / t, -1)
        top = p[len(p) // 2:, :-1].max(-1).values.mean()  # the head's columns, not the bucket
        print(f"  {accept:.3f} / {top:.3f} / {sum(x not in head for x in a.tokens) / len(a.tokens):.3f}"
              f" / {p[:, -1].mean():.3f}")
    for name, answers in (("all", held), ("not capped", [a for a in held if len(a.tokens) < CAP])):
        tokens = [x for a in answers for x in a.tokens]
        print(f"held-out answer tokens outside the head, {name}: "
              f"{sum(x not in head for x in tokens) / len(tokens):.4f}")


if __name__ == "__main__":
    args = sys.argv[1:]
    cut = args.index("--") if "--" in args else len(args)
    main(args[0], args[cut + 1:])
