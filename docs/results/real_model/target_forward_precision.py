"""SmolLM2 (the recipe): what a recomputed batch's read costs with the policy's target forward
in fp32 against bf16 autocast (`draft.autocast`, which since stop 51 covers that forward too):
10 reads of real packed answers (~640 tokens each) per setting, alternated twice
(docs/results/real_model.md, "The 16K-answer draft").

    python docs/results/real_model/target_forward_precision.py OUT_DIR DRAFT_DIR

OUT_DIR: a recipe out_dir whose answer store holds at least 512 training answers; DRAFT_DIR:
a draft with the reduced head whose targets are read.
"""
import dataclasses
import sys
import time

import torch

from cospec.artifacts import answer_store, load_policy, pick_device, starting_policy_fields
from cospec.config import resolve
from cospec.draft.policy_outputs import policy_batches
from cospec.models.draft_checkpoint import load_draft
from cospec.models.loading import with_checkpoint_model


def main(out_dir: str, draft_dir: str) -> None:
    torch.set_num_threads(2)
    cfg = with_checkpoint_model(resolve("smollm2-math", overrides=[
        f"out_dir={out_dir}", "draft.tokens_per_batch=640", "draft.num_train_prompts=512"]))
    policy = load_policy(cfg, pick_device(cfg.device)).policy.eval()
    train = answer_store(cfg, starting_policy_fields(cfg)).load("train")
    answers = [train[i] for i in range(512)]
    draft = load_draft(draft_dir, device="cpu")
    for precision in ("", "bfloat16", "", "bfloat16"):
        run = dataclasses.replace(cfg, draft=dataclasses.replace(cfg.draft, autocast=precision))
        lazy = policy_batches(run, policy, answers, vocab_ids=draft.vocab_ids, keep=False)
        lazy[0]  # warm-up
        t0 = time.perf_counter()
        for i in range(1, 11):
            lazy[i]
        print(f"draft.autocast={precision or '(fp32)'}: {(time.perf_counter() - t0) / 10:.3f} s a "
              f"read (10 batches)", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
