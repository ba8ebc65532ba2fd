"""SmolLM2 (the recipe's policy, fp32): draft-train's answers sampled at two engine batches, side by
side (`draft.answer_batch_size`; docs/results/real_model.md, "Draft-train keeps its answers").

    python docs/results/real_model/answer_batch.py [PROMPTS [BATCHES [ROUNDS]]]

The same PROMPTS (default 128) held-out prompts are answered at each batch in BATCHES (default
16,64), in ROUNDS (default 1) alternating rounds (16, 64, 16, 64, ...), nothing kept on disk. Every answer draws from its own
prompt's random stream, so each batch makes the same answers (checked, token for token): the
times compare the same work.
"""
import sys
import time

import torch

from cospec.artifacts import load_policy, pick_device
from cospec.config import apply, resolve
from cospec.data.prompts import TaskData
from cospec.draft.answer_store import policy_answers
from cospec.models.loading import with_checkpoint_model

OVERRIDES = ["rollout.dtype=float32", "grpo.autocast=", "draft.autocast="]


def main(prompts: int = 128, batches: tuple[int, ...] = (16, 64), rounds: int = 1) -> None:
    torch.set_num_threads(2)
    cfg = with_checkpoint_model(resolve("smollm2-math", overrides=OVERRIDES))
    start = load_policy(cfg, pick_device(cfg.device))
    policy, data = start.policy.eval(), TaskData.from_config(cfg.task, start.tokenizer)
    seconds, answers = {b: [] for b in batches}, {}
    for _ in range(rounds):
        for b in batches:
            t0 = time.perf_counter()
            got = policy_answers(apply(cfg, {"draft": {"answer_batch_size": b}}), policy, data,
                                 "held_out", prompts, progress=False)
            seconds[b].append(time.perf_counter() - t0)
            answers.setdefault(b, got)
            tokens = sum(len(a.tokens) for a in got)
            print(f"batch {b}: {prompts} answers, {tokens} tokens, {seconds[b][-1]:.0f} s, "
                  f"{tokens / seconds[b][-1]:.1f} tok/s", flush=True)
    same = [sum(x.tokens == y.tokens for x, y in zip(answers[batches[0]], answers[b])) for b in batches]
    print(f"answers equal to batch {batches[0]}'s, token for token: "
          + ", ".join(f"batch {b}: {n}/{prompts}" for b, n in zip(batches, same)))
    base = min(seconds[batches[0]])
    print("speed against batch " + str(batches[0]) + " (best of each): "
          + ", ".join(f"batch {b}: {base / min(seconds[b]):.2f}x" for b in batches))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 128,
         tuple(int(b) for b in sys.argv[2].split(",")) if len(sys.argv) > 2 else (16, 64),
         int(sys.argv[3]) if len(sys.argv) > 3 else 1)
