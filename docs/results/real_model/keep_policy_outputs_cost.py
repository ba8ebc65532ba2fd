"""What `draft.keep_policy_outputs=false` costs on SmolLM2 (the recipe's policy, fp32): the policy
forward over kept answers, per token; the bytes a kept token holds; and draft training seconds a
step with the outputs kept and recomputed, on the same batches in the same order (the two drafts
are compared bit for bit at the end). docs/results/real_model.md, "Answer sets past the memory"
and "A kept position holds its hidden state".

    ANSWERS_OUT_DIR=runs/smollm2-s40 python docs/results/real_model/keep_policy_outputs_cost.py \
        [TRAIN_ANSWERS [STEPS]]

The answers are a draft-train run's kept ones (`$ANSWERS_OUT_DIR/draft_answers`, the first
TRAIN_ANSWERS of them, default 256); nothing is sampled if they are there. Run it alone on the
machine: it times.
"""
import copy
import os
import sys
import time

import torch

from cospec.artifacts import answer_store, load_policy, pick_device, starting_policy_fields
from cospec.config import apply, resolve
from cospec.data.prompts import TaskData
from cospec.draft.answer_store import policy_answers
from cospec.draft.offline import build_draft, draft_vocabulary, fit_draft
from cospec.draft.policy_outputs import kept_bytes_per_token, num_tokens, policy_batches
from cospec.models.loading import with_checkpoint_model

OVERRIDES = ["draft.ttt_steps=4", "draft.tokens_per_batch=640", "draft.eval_every=0",
             "draft.answer_batch_size=64",
             "rollout.dtype=float32", "grpo.autocast=", "draft.autocast="]


def main(train_answers: int = 256, steps: int = 30) -> None:
    torch.set_num_threads(2)
    cfg = with_checkpoint_model(resolve("smollm2-math", overrides=OVERRIDES))
    cfg = apply(cfg, {"draft": {"train_steps": steps}})
    start = load_policy(cfg, pick_device(cfg.device))
    policy, data = start.policy.eval(), TaskData.from_config(cfg.task, start.tokenizer)
    store = answer_store(apply(cfg, {"out_dir": os.environ.get("ANSWERS_OUT_DIR", "/tmp/draft_probe")}),
                         starting_policy_fields(cfg))
    answers = policy_answers(cfg, policy, data, "train", train_answers, store=store)
    vocab_ids = draft_vocabulary([a.tokens for a in answers], cfg.draft.vocab_size,
                                 policy.config.vocab_size, keep=data.tokenizer.stop_ids)
    t0 = time.perf_counter()
    kept = policy_batches(cfg, policy, answers, vocab_ids=vocab_ids)
    forward_s = time.perf_counter() - t0
    tokens = num_tokens(kept)
    held = sum(kept_bytes_per_token(o) * o.packed.tokens.shape[1] for o in kept.outputs)
    first = kept[0]  # what keeping the target logits themselves held until stop 46
    as_logits = sum(t[0].numel() * t.element_size() for t in [first.policy_logits, *first.taps.values()])
    print(f"{len(answers)} answers, {tokens} tokens in {len(kept)} batches: policy forward "
          f"{forward_s:.0f} s ({1e3 * forward_s / tokens:.2f} ms a token), kept "
          f"{held / 1e9:.2f} GB ({held / tokens / 1e3:.1f} KB a token; the target logits "
          f"themselves would hold {as_logits / 1e3:.1f} KB a token)", flush=True)
    lazy = policy_batches(cfg, policy, answers, vocab_ids=vocab_ids, keep=False)
    draft = build_draft(cfg, policy, vocab_ids)
    drafts = {}
    for name, batches in (("kept", kept), ("recomputed", lazy), ("kept again", kept)):
        trained = copy.deepcopy(draft)
        t0 = time.perf_counter()
        fit_draft(cfg, trained, batches, [], progress=False)
        seconds = time.perf_counter() - t0
        print(f"{name}: {steps} steps in {seconds:.1f} s, {seconds / steps:.2f} s a step", flush=True)
        drafts[name] = trained
    same = all(torch.equal(a, b) for a, b in zip(drafts["kept"].state_dict().values(),
                                                 drafts["recomputed"].state_dict().values()))
    print(f"the drafts trained on kept and recomputed outputs are equal bit for bit: {same}")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
