"""SmolLM2 (the recipe's policy, fp32): the EAGLE-3 draft's teacher-forced acceptance on HELD-OUT
answers as it trains, for several initialisations of its decoder layer (docs/results/real_model.md,
"The draft's held-out acceptance as it trains").

    python docs/results/real_model/draft_learning_curve.py VARIANT[,VARIANT...] STEPS EVAL_EVERY \
        [TRAIN_PROMPTS [SAVE_DIR]]

VARIANT: `random` (cospec's default: the layer initialised at random, embedding and head copied
from the policy) or `layer` (the layer also copied from the policy's decoder layer after the high
tap, layer 27 of SmolLM2: `draft.layer_from_policy`), with any of the suffixes `+norm` (the final
norm's weight copied from the policy's, so the copied head rows see states scaled as the
policy's head does), `+fhead` (the head frozen at the policy's rows), `+lr=X` (draft.lr X
instead of the recipe's 2e-3; the same warmup and cosine to a tenth), `+tv=W` (draft.tv_weight
W: the loss (1 - W) x soft cross-entropy + W x total variation, instead of cross-entropy alone)
and `+layers=N` (draft.eagle3_layers N: plain decoder layers after the first; with `layer` they
start as the policy's layers after the copied one).

The answers are draft-train's own (`cospec.draft.answer_store`: TRAIN_PROMPTS, default 256, of
the training prompt stream, and 48 held-out prompts of its own stream), sampled once and kept in
/tmp/draft_probe/draft_answers (or $ANSWERS_OUT_DIR/draft_answers: a draft-train run's out_dir,
to reuse its answers), so every variant and every later run trains on the same data; the training
loop and the held-out measurement are draft-train's too (`fit_draft`, `held_out_metrics`: 1 - TV
per TTT step, averaged over all held-out answer tokens). For the plain variants this is what
`cospec draft-train --recipe smollm2-math` with the overrides below and draft.eval_every does;
the script adds the variants and one shared set of answers. SAVE_DIR: each variant's draft is
saved there at the end (SAVE_DIR/<variant>), for `draft_tau_check.py` to measure in rollouts.

Until 2026-12-06 (commit 016e8d1) the script sampled with its own seeds and held out the answers
of another seed's training stream, and had a `+slow` variant; the figures of real_model.md up to
"Four times the answers" came from that version.
"""
import os
import sys
import time
from pathlib import Path

import torch

from cospec.artifacts import answer_store, load_policy, pick_device, starting_policy_fields
from cospec.config import apply, resolve
from cospec.data.prompts import TaskData
from cospec.draft.answer_store import policy_answers
from cospec.draft.offline import build_draft, draft_vocabulary, fit_draft
from cospec.draft.policy_outputs import policy_batches
from cospec.models.draft_checkpoint import save_draft
from cospec.models.loading import with_checkpoint_model

OVERRIDES = ["draft.ttt_steps=4", "draft.tokens_per_batch=640",
             "rollout.dtype=float32", "grpo.autocast=", "draft.autocast="]


def train(variant: str, cfg, policy, vocab_ids, train_b, held_b, save: Path | None) -> None:
    base, *options = variant.split("+")
    # the suffix's name -> the draft field it sets, and that field's type
    fields = {"lr": ("lr", float), "tv": ("tv_weight", float), "layers": ("eagle3_layers", int)}
    given = {fields[name][0]: fields[name][1](value) for name, value in
             (o.split("=", 1) for o in options if "=" in o)}
    cfg = apply(cfg, {"draft": {"layer_from_policy": base == "layer", **given}})
    draft = build_draft(cfg, policy, vocab_ids)
    if "norm" in options:
        draft.norm.weight.data.copy_(policy.norm.weight.data)
    if "fhead" in options:  # fit_draft's optimizer takes only what requires a gradient
        draft.lm_head.weight.requires_grad_(False)
    t0 = time.perf_counter()
    metrics = fit_draft(cfg, draft, train_b, held_b, progress=False)
    for h in metrics["held_out"]:
        tau = h.get("expected_accept_length", [float("nan")])[0]
        print(f"{variant} step {h['step']}: held-out {[round(a, 3) for a in h['acceptance']]}, "
              f"expected tau {tau:.3f}", flush=True)
    print(f"{variant}: last batch {[round(a, 3) for a in metrics['last_batch']['acceptance']]}, "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    if save is not None:
        save_draft(draft, save / variant)
        print(f"{variant}: saved to {save / variant}", flush=True)


def main(variants: list[str], steps: int, every: int, prompts: int = 256,
         save: Path | None = None) -> None:
    torch.set_num_threads(2)
    cfg = with_checkpoint_model(resolve("smollm2-math", overrides=OVERRIDES))
    cfg = apply(cfg, {"draft": {"train_steps": steps, "eval_every": every}})
    start = load_policy(cfg, pick_device(cfg.device))
    policy, data = start.policy.eval(), TaskData.from_config(cfg.task, start.tokenizer)
    t0 = time.perf_counter()
    answers_dir = os.environ.get("ANSWERS_OUT_DIR", "/tmp/draft_probe")
    store = answer_store(apply(cfg, {"out_dir": answers_dir}), starting_policy_fields(cfg))
    train_a = policy_answers(cfg, policy, data, "train", prompts, store=store)
    held_a = policy_answers(cfg, policy, data, "held_out", 48, store=store)
    print(f"answers: {time.perf_counter() - t0:.0f} s", flush=True)
    vocab_ids = draft_vocabulary([a.tokens for a in train_a], cfg.draft.vocab_size,
                                 policy.config.vocab_size, keep=data.tokenizer.stop_ids)
    train_b = policy_batches(cfg, policy, train_a, vocab_ids=vocab_ids)
    held_b = policy_batches(cfg, policy, held_a, vocab_ids=vocab_ids)
    print(f"{sum(int(b.loss_mask.sum()) for b in train_b)} training answer tokens in "
          f"{len(train_b)} batches, {sum(int(b.loss_mask.sum()) for b in held_b)} held out", flush=True)
    for v in variants:
        train(v, cfg, policy, vocab_ids, train_b, held_b, save)


if __name__ == "__main__":
    main(sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3]),
         int(sys.argv[4]) if len(sys.argv) > 4 else 256,
         Path(sys.argv[5]) if len(sys.argv) > 5 else None)
