"""SmolLM2 (fp32): what a few GRPO steps did to the draft, frozen or co-trained, measured on fixed
text. Each RL checkpoint's draft is scored against its own run's policy and against the policy
the runs started from, teacher-forced on draft-train's 48 held-out answers of the starting policy
(`held_out_metrics`: 1 - TV per TTT step, averaged over every answer token), side by side; a
plain draft directory is scored against the starting policy only (docs/results/real_model.md,
"GRPO on the recipe with the 2,048-answer draft").

    ANSWERS_OUT_DIR=runs/smollm2-s40 python docs/results/real_model/cotrain_held_out.py \
        NAME=DIR [NAME=DIR ...]

DIR: an RL checkpoint (step_NNNNNN, holding policy/ and draft/) or a draft directory. The held-out
answers are the ones kept in $ANSWERS_OUT_DIR/draft_answers (sampled now if missing).
"""
import os
import sys
from pathlib import Path

import torch

from cospec.artifacts import answer_store, load_policy, pick_device, starting_policy_fields
from cospec.config import apply, resolve
from cospec.data.prompts import TaskData
from cospec.draft.answer_store import policy_answers
from cospec.draft.offline import held_out_metrics
from cospec.draft.policy_outputs import policy_batches
from cospec.models.draft_checkpoint import load_draft
from cospec.models.hf_checkpoint import load_hf
from cospec.models.loading import with_checkpoint_model

OVERRIDES = ["draft.ttt_steps=4", "draft.tokens_per_batch=640",
             "rollout.dtype=float32", "grpo.autocast=", "draft.autocast="]


def score(cfg, policy, draft, answers) -> list[float]:
    """The draft's held-out acceptance by TTT step, judged by ``policy`` on ``answers``."""
    batches = policy_batches(cfg, policy, answers, vocab_ids=draft.vocab_ids)
    return held_out_metrics(draft, batches, cfg)["acceptance"]


def rounded(acceptance: list[float]) -> list[float]:
    return [round(a, 3) for a in acceptance]


def main(named: list[tuple[str, Path]]) -> None:
    torch.set_num_threads(2)
    cfg = with_checkpoint_model(resolve("smollm2-math", overrides=OVERRIDES))
    start = load_policy(cfg, pick_device(cfg.device))
    policy, data = start.policy.eval(), TaskData.from_config(cfg.task, start.tokenizer)
    answers_dir = os.environ.get("ANSWERS_OUT_DIR", "/tmp/draft_probe")
    store = answer_store(apply(cfg, {"out_dir": answers_dir}), starting_policy_fields(cfg))
    held = policy_answers(cfg, policy, data, "held_out", 48, store=store)
    print(f"{sum(len(a.tokens) for a in held)} held-out answer tokens", flush=True)
    with torch.inference_mode():
        for name, path in named:
            is_checkpoint = (path / "draft").is_dir()
            draft = load_draft(path / "draft" if is_checkpoint else path).eval()
            line = f"{name}: vs the starting policy {rounded(score(cfg, policy, draft, held))}"
            if is_checkpoint:
                own = load_hf(path / "policy").eval()
                moved = max((a - b).abs().max().item() for a, b in
                            zip(own.state_dict().values(), policy.state_dict().values()))
                line += (f", vs its run's policy {rounded(score(cfg, own, draft, held))} "
                         f"(largest weight change {moved:.2e})")
            print(line, flush=True)


if __name__ == "__main__":
    main([(a.split("=", 1)[0], Path(a.split("=", 1)[1])) for a in sys.argv[1:]])
