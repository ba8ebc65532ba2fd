"""SmolLM2 (fp32): how stale is a draft against a policy that GRPO has moved? Every draft against
every policy, teacher-forced on that policy's own answers (docs/results/real_model.md, "A policy
that moves").

In-run tau mixes two things: the draft's fit to the policy, and how easy the policy's current
answers are to draft (RL shortens and sharpens them). Here each policy answers the same 48
held-out prompts of draft-train (same prompts, same per-answer random streams), and each draft is
scored on those answers against that policy (`held_out_metrics`: 1 - TV per TTT step, averaged
over the answer tokens). Down a column the text is fixed, so the drafts compare on equal terms;
along the offline draft's row, its acceptance falls as its policy moves away from the one it
learnt from (stale), unless the moved policy's answers are easier. So it is measured twice:
on each policy's own answers (the text rollouts would draft), and on the starting policy's
answers judged by each policy (fixed text: only the policy that judges changes).

    ANSWERS_OUT_DIR=runs/smollm2-s40 python docs/results/real_model/staleness_matrix.py \
        --policies NAME=CKPT,... --drafts NAME=DIR,...

CKPT: an RL checkpoint (step_NNNNNN, holding policy/); the starting policy is always the first
column (its answers: the ones kept in $ANSWERS_OUT_DIR/draft_answers). DIR: a draft directory, or
an RL checkpoint (its draft/).
"""
import argparse
import os
import time
from pathlib import Path

import torch

from cospec.artifacts import answer_store, load_policy, pick_device, starting_policy_fields
from cospec.config import apply, resolve
from cospec.data.prompts import TaskData
from cospec.draft.answer_store import policy_answers
from cospec.models.draft_checkpoint import load_draft
from cospec.models.hf_checkpoint import load_hf
from cospec.models.loading import with_checkpoint_model

# the script beside this one (its directory is on sys.path when run as a script): the same
# settings and the same held-out scoring
from cotrain_held_out import OVERRIDES, rounded, score

HELD_OUT = 48


def named_paths(text: str) -> list[tuple[str, Path]]:
    pairs = [item.split("=", 1) for item in text.split(",") if item]
    return [(name, Path(path)) for name, path in pairs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", type=named_paths, default=[])
    parser.add_argument("--drafts", type=named_paths, required=True)
    args = parser.parse_args()
    torch.set_num_threads(2)
    cfg = with_checkpoint_model(resolve("smollm2-math", overrides=OVERRIDES))
    start = load_policy(cfg, pick_device(cfg.device))
    data = TaskData.from_config(cfg.task, start.tokenizer)
    answers_dir = os.environ.get("ANSWERS_OUT_DIR", "/tmp/draft_probe")
    store = answer_store(apply(cfg, {"out_dir": answers_dir}),
                         starting_policy_fields(cfg))
    device = next(start.policy.parameters()).device
    drafts = {name: load_draft(path / "draft" if (path / "draft").is_dir() else path,
                               device=device).eval() for name, path in args.drafts}
    columns = [("start", start.policy.eval(), store)]
    columns += [(name, load_hf(path / "policy", device=device).eval(), None)
                for name, path in args.policies]
    start_answers = None
    own, fixed = {}, {}
    for pname, policy, kept in columns:
        t0 = time.perf_counter()
        answers = policy_answers(cfg, policy, data, "held_out", HELD_OUT, store=kept,
                                 progress=False)
        start_answers = start_answers or answers  # the first column is the starting policy
        tokens = sum(len(a.tokens) for a in answers)
        print(f"policy {pname}: {tokens} answer tokens ({tokens / HELD_OUT:.1f} an answer; "
              f"{time.perf_counter() - t0:.0f} s)", flush=True)
        with torch.inference_mode():
            for dname, draft in drafts.items():
                own[dname, pname] = score(cfg, policy, draft, answers)
                fixed[dname, pname] = (own[dname, pname] if answers is start_answers
                                       else score(cfg, policy, draft, start_answers))
                print(f"  draft {dname}: on its answers {rounded(own[dname, pname])}, "
                      f"on the start's {rounded(fixed[dname, pname])}", flush=True)
    names = [p for p, _, _ in columns]
    for title, table in (("each policy's own answers", own),
                         ("the starting policy's answers", fixed)):
        print(f"\n{title}: acceptance at TTT step 1 / mean over the 4 steps "
              f"(rows: drafts; columns: the policy that judges)")
        print(f"{'':>10}" + "".join(f"{p:>16}" for p in names))
        for dname in drafts:
            cells = [table[dname, p] for p in names]
            print(f"{dname:>10}" + "".join(f"{c[0]:>8.3f}{sum(c) / len(c):>8.3f}" for c in cells))


if __name__ == "__main__":
    main()
