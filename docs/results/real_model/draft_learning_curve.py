"""SmolLM2 (the recipe's policy, fp32): the EAGLE-3 draft's teacher-forced acceptance on HELD-OUT
answers as it trains, for several initialisations of its decoder layer (docs/results/real_model.md,
"The draft's held-out acceptance as it trains").

    python docs/results/real_model/draft_learning_curve.py VARIANT[,VARIANT...] STEPS EVAL_EVERY \
        [TRAIN_PROMPTS [SAVE_DIR]]

VARIANT: `random` (cospec's default: the layer initialised at random, embedding and head copied
from the policy) or `layer` (the layer also copied from the policy's decoder layer after the high
tap, layer 27 of SmolLM2: `draft.layer_from_policy`), with any of the suffixes `+norm` (the final
norm's weight copied from the policy's, so the copied head rows see states scaled as the
policy's head does), `+fhead` (the head frozen at the policy's rows) and `+slow` (the tensors the
copy fills, other than q, k and v, trained at a tenth of the learning rate). The policy answers 256 training prompts and 48 held-out prompts (another
prompt stream and seed) once; the answers are cached in /tmp/draft_probe so every variant trains
on the same data. Held-out acceptance is 1 - TV per TTT step (what `ttt_loss` reports), averaged
over all held-out tokens, with no gradient.

TRAIN_PROMPTS (default 256) above 256 adds answers to TRAIN_PROMPTS - 256 more prompts of a third
prompt stream (seed 2, cached as train_extra<N>.pt) to the first 256. SAVE_DIR: each variant's
draft is saved there at the end (SAVE_DIR/<variant>), for `draft_tau_check.py` to measure in
rollouts.
"""
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from cospec.artifacts import load_policy, pick_device
from cospec.config import apply, resolve
from cospec.data.prompts import TaskData
from cospec.draft.offline import (build_draft, draft_vocabulary, policy_batches, sample_responses,
                                  trainable_parameters)
from cospec.draft.ttt import ttt_loss
from cospec.lr_schedule import lr_at
from cospec.models.draft_checkpoint import save_draft
from cospec.models.loading import with_checkpoint_model

OVERRIDES = ["draft.ttt_steps=4", "draft.num_train_prompts=256", "draft.tokens_per_batch=640",
             "rollout.dtype=float32", "grpo.autocast=", "draft.autocast="]
CACHE = Path("/tmp/draft_probe")


def answers(cfg, policy, data, name: str, prompts: int, seed: int):
    path = CACHE / f"{name}.pt"
    if path.exists():
        return [SimpleNamespace(prompt=p, tokens=t) for p, t in torch.load(path)]
    t0 = time.perf_counter()
    out = sample_responses(apply(cfg, {"draft": {"num_train_prompts": prompts, "seed": seed}}),
                           policy, data, progress=False)
    CACHE.mkdir(exist_ok=True)
    torch.save([(c.prompt, c.tokens) for c in out], path)
    print(f"{name}: {prompts} prompts, {sum(len(c.tokens) for c in out)} answer tokens, "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    return out


def held_out_acceptance(draft, batches, cfg) -> list[float]:
    draft.eval()
    total, count = None, 0
    with torch.no_grad():
        for b in batches:
            n = int(b.loss_mask.sum())
            _, m = ttt_loss(draft, b, num_steps=cfg.draft.ttt_steps,
                            temperature=cfg.sampling.temperature)
            acc = torch.tensor(m["acceptance"]) * n
            total, count = (acc if total is None else total + acc), count + n
    draft.train()
    return (total / count).tolist()


def train(variant: str, cfg, policy, vocab_ids, train_b, held_b, steps: int, every: int,
          save: Path | None = None) -> None:
    d = cfg.draft
    draft = build_draft(cfg, policy, vocab_ids)
    base, *options = variant.split("+")
    if base == "layer":
        draft.copy_layer_from_policy(policy)
    if "norm" in options:
        draft.norm.weight.data.copy_(policy.norm.weight.data)
    params = trainable_parameters(draft, cfg)
    if "fhead" in options:
        draft.lm_head.weight.requires_grad_(False)
        params = [p for p in params if p is not draft.lm_head.weight]
    groups = [{"params": params, "scale": 1.0}]
    if "slow" in options:  # the copied tensors (all but q, k, v, whose halves differ) at lr / 10
        layer = draft.layers["0"]
        copied = {id(p) for m in (draft.fc, layer.hidden_norm, layer.self_attn.o_proj,
                                  layer.post_attention_layernorm, layer.mlp) for p in m.parameters()}
        groups = [{"params": [p for p in params if id(p) not in copied], "scale": 1.0},
                  {"params": [p for p in params if id(p) in copied], "scale": 0.1}]
    opt = torch.optim.AdamW(groups, lr=d.lr, betas=(0.9, 0.95), weight_decay=0.0)
    order = torch.Generator().manual_seed(d.seed)
    t0 = time.perf_counter()
    print(f"{variant} step 0: held-out {[round(a, 3) for a in held_out_acceptance(draft, held_b, cfg)]}",
          flush=True)
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = g["scale"] * lr_at(step, lr=d.lr, warmup=min(20, steps // 10), total=steps,
                                         min_ratio=0.1)
        batch = train_b[int(torch.randint(len(train_b), (1,), generator=order))]
        loss, m = ttt_loss(draft, batch, num_steps=d.ttt_steps, decay=d.ttt_decay,
                           temperature=cfg.sampling.temperature)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        if (step + 1) % every == 0 or step + 1 == steps:
            held = held_out_acceptance(draft, held_b, cfg)
            print(f"{variant} step {step + 1}: loss {loss.item():.3f}, train batch "
                  f"{[round(a, 3) for a in m['acceptance']]}, held-out {[round(a, 3) for a in held]}, "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
    if save is not None:
        save_draft(draft.eval(), save / variant)
        print(f"{variant}: saved to {save / variant}", flush=True)


def main(variants: list[str], steps: int, every: int, prompts: int = 256,
         save: Path | None = None) -> None:
    torch.set_num_threads(2)
    cfg = with_checkpoint_model(resolve("smollm2-math", overrides=OVERRIDES))
    start = load_policy(cfg, pick_device(cfg.device))
    policy, data = start.policy.eval(), TaskData.from_config(cfg.task, start.tokenizer)
    train_c = answers(cfg, policy, data, "train", 256, 0)
    if prompts > 256:
        train_c = train_c + answers(cfg, policy, data, f"train_extra{prompts - 256}", prompts - 256, 2)
    held_c = answers(cfg, policy, data, "held_out", 48, 1)
    vocab_ids = draft_vocabulary([c.tokens for c in train_c], cfg.draft.vocab_size,
                                 policy.config.vocab_size, keep=data.tokenizer.stop_ids)
    train_b = policy_batches(cfg, policy, train_c, vocab_ids=vocab_ids)
    held_b = policy_batches(cfg, policy, held_c, vocab_ids=vocab_ids)
    print(f"{sum(int(b.loss_mask.sum()) for b in train_b)} training answer tokens in "
          f"{len(train_b)} batches, {sum(int(b.loss_mask.sum()) for b in held_b)} held out", flush=True)
    for v in variants:
        train(v, cfg, policy, vocab_ids, train_b, held_b, steps, every, save)


if __name__ == "__main__":
    main(sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3]),
         int(sys.argv[4]) if len(sys.argv) > 4 else 256,
         Path(sys.argv[5]) if len(sys.argv) > 5 else None)
