"""SmolLM2 (the recipe): real tau of a GRPO run's own rollouts against the tau the chain expects
on those very answers (docs/results/real_model.md, "Real tau against expected tau"). A
frozen-draft GRPO trainer, built as `cospec experiment stale-draft` builds it (gamma fixed),
generates STEPS steps' rollouts (no policy update between them: at the recipe's lr 1e-6 a
step barely moves the policy); then `expected_accept_length` runs on the same answers,
with the policy's outputs in fp32 and in bf16 autocast.

    python docs/results/real_model/grpo_answers_chain.py STEPS DRAFT_DIR -- overrides
"""
import dataclasses
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from cospec.artifacts import load_policy, pick_device
from cospec.config import resolve
from cospec.draft.expected_accept_length import expected_accept_length
from cospec.draft.policy_outputs import policy_batches
from cospec.experiments.stale_draft import make_trainer
from cospec.models.draft_checkpoint import load_draft
from cospec.models.loading import with_checkpoint_model


def main(steps: int, draft_dir: str, overrides: list[str]) -> None:
    torch.set_num_threads(2)
    cfg = with_checkpoint_model(resolve("smollm2-math", overrides=overrides))
    start = load_policy(cfg, pick_device(cfg.device))
    draft = load_draft(draft_dir, device=next(start.policy.parameters()).device).eval()
    torch.manual_seed(cfg.grpo.seed)
    trainer = make_trainer(cfg, "frozen", start.policy, draft, Path(tempfile.mkdtemp()),
                           start.tokenizer)
    answers, tokens, row_steps = [], 0, 0
    for step in range(steps):
        batch = trainer.generate()
        st = batch.stats
        answers += batch.completions
        tokens, row_steps = tokens + st.step_tokens, row_steps + st.row_steps
        print(f"step {step + 1}: real tau {st.accept_length:.3f}", flush=True)
    lengths = [len(c.tokens) for c in answers]
    print(f"{len(answers)} answers, mean length {statistics.mean(lengths):.1f}, "
          f"{sum(n >= 380 for n in lengths)} at the cap; real tau pooled {tokens / row_steps:.3f} "
          f"(the engine counts a finishing row's tokens past its stop)")
    policy = start.policy.eval()
    for precision in ("", "bfloat16"):
        run = dataclasses.replace(cfg, draft=dataclasses.replace(cfg.draft, autocast=precision))
        batches = policy_batches(run, policy, answers, vocab_ids=draft.vocab_ids)
        with torch.no_grad():
            exp_steps, exp_tokens = expected_accept_length(draft, batches, cfg.rollout.gamma,
                                                           cfg.sampling.temperature)
        print(f"expected tau on the same answers, targets {precision or 'fp32'}: "
              f"{exp_tokens / exp_steps:.3f}", flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    cut = args.index("--") if "--" in args else len(args)
    main(int(args[0]), args[1], args[cut + 1:])
