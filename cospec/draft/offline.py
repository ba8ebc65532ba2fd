"""Offline draft training (`cospec draft-train`): fit a draft to a fixed policy on its own samples.

1. The policy answers ``draft.num_train_prompts`` prompts of the task suite at the rollout sampling
   temperature (the draft must predict what the policy *samples*, not the SFT references), and
   ``draft.num_eval_prompts`` held-out prompts of another stream; `cospec draft-train` keeps the
   answers in out_dir as they finish and reuses them (`cospec.draft.answer_store`).
2. One policy forward per packed batch of those sequences gives, detached, the tapped features and
   the logits (`cospec.draft.policy_outputs`): kept, so that no forward is repeated across epochs,
   or with ``draft.keep_policy_outputs=false`` recomputed whenever training draws the batch (for
   answer sets past the memory).
3. The draft trains on them (`fit_draft`): EAGLE-3 with the TTT unroll (`cospec.draft.ttt`), a
   standalone draft LM with plain next-token prediction; both against the policy's distribution
   (soft cross-entropy, mixed with total variation by ``draft.tv_weight``), on response positions
   only. Its teacher-forced acceptance on the held-out answers
   is measured every ``draft.eval_every`` steps, and its state kept every
   ``draft.checkpoint_every`` steps so an interrupted run resumes (`cospec.draft.offline_checkpoint`).
4. An EAGLE-3 or block draft's proposal scale is fitted on the held-out answers
   (``draft.fit_proposal_scale``; `cospec.draft.expected_accept_length.fit_proposal_scale`): the
   factor on its logits when it drafts that gives them the most expected tau.
The result is the "frozen" draft that later experiments compare against, and the initial draft of
co-training.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

import torch

from cospec.config import RunConfig
from cospec.data.prompts import TaskData
from cospec.draft.answer_store import Answer, AnswerStore, policy_answers
from cospec.draft.expected_accept_length import expected_accept_length, fit_proposal_scale
from cospec.draft.losses import masked_mean, soft_cross_entropy, total_variation
from cospec.draft.offline_checkpoint import OfflineCheckpoint
from cospec.draft.policy_outputs import num_tokens, policy_batches
from cospec.draft.ttt import TTTBatch, cpu_bucket, pad_to_bucket, ttt_loss
from cospec.lr_schedule import lr_at
from cospec.metrics.progress import progress_bar
from cospec.models.block_draft import BlockDraft
from cospec.models.draft import Eagle3Draft, TappedDraft, default_tap_layers, draft_model_config
from cospec.models.llama import Transformer
from cospec.models.precision import autocast


def draft_vocabulary(responses: list[list[int]], size: int, vocab_size: int,
                     keep: tuple[int, ...] = ()) -> torch.Tensor:
    """The `size` policy ids the draft's head covers: the most frequent tokens of the policy's
    own responses, ties to the lower id, plus `keep` (the stop ids: a response must be able to end
    in a drafted token); increasing, as the EAGLE-3 export's d2t/t2d maps need."""
    if not 0 < size < vocab_size:
        raise ValueError(f"draft.vocab_size={size} must be in (0, the policy's {vocab_size})")
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for r in responses:
        counts += torch.bincount(torch.tensor(r, dtype=torch.long), minlength=vocab_size)
    big = int(counts.max()) + 1
    for t in keep:
        counts[t] = big
    order = torch.sort(-counts, stable=True).indices  # by count, then id (the sort is stable)
    return order[:size].sort().values


def trainable_parameters(draft, cfg: RunConfig) -> list[torch.nn.Parameter]:
    """What the draft's optimizers update: everything, less the input embedding when
    ``draft.freeze_embedding``, which is then marked requires_grad=False (no gradient computed,
    none in the clipping norm). A training choice, so it is applied to a loaded draft too."""
    draft.embed_tokens.weight.requires_grad_(not cfg.draft.freeze_embedding)
    return [p for p in draft.parameters() if p.requires_grad]


def build_draft(cfg: RunConfig, policy: Transformer,
                vocab_ids: torch.Tensor | None = None) -> TappedDraft | Transformer:
    """A fresh draft of kind ``draft.kind`` for `policy` (seeded by ``draft.seed``); vocab_ids: a
    reduced draft vocabulary (`draft_vocabulary`)."""
    d = cfg.draft
    torch.manual_seed(d.seed)
    if d.kind == "eagle3":
        return Eagle3Draft.from_policy(policy, tap_layers=d.tap_layers, num_layers=d.eagle3_layers,
                                       intermediate_size=d.intermediate_size,
                                       init_from_policy=d.init_from_policy,
                                       layer_from_policy=d.layer_from_policy, vocab_ids=vocab_ids)
    if d.kind == "block":
        return BlockDraft.from_policy(policy, tap_layers=d.tap_layers, num_layers=d.block_layers,
                                      intermediate_size=d.intermediate_size,
                                      init_from_policy=d.init_from_policy, vocab_ids=vocab_ids,
                                      correction=d.block_correction, confidence=d.block_confidence)
    lm = Transformer(draft_model_config(policy.config, num_layers=d.lm_num_layers,
                                        intermediate_size=d.intermediate_size))
    if d.init_from_policy:
        lm.embed_tokens.weight.data.copy_(policy.embed_tokens.weight.data)
        lm.lm_head.weight.data.copy_(policy.lm_head.weight.data)
    p = next(policy.parameters())
    return lm.to(device=p.device, dtype=p.dtype)


def task_data(cfg: RunConfig, data: TaskData | None) -> TaskData:
    """`data`, or the run's prompts through the policy's own tokenizer."""
    if data is not None:
        return data
    from cospec.models.loading import load_tokenizer

    return TaskData.from_config(cfg.task, load_tokenizer(cfg.model))


def sample_responses(cfg: RunConfig, policy: Transformer, data: TaskData, *,
                     progress: bool = True, split: str = "train",
                     store: AnswerStore | None = None) -> list[Answer]:
    """Step 1: the policy answers draft.num_train_prompts prompts (draft.num_eval_prompts for
    the held-out split) at the rollout sampling; kept in ``store`` when given
    (`cospec.draft.answer_store`)."""
    count = cfg.draft.num_train_prompts if split == "train" else cfg.draft.num_eval_prompts
    return policy_answers(cfg, policy, data, split, count, store=store, progress=progress)


def lm_draft_loss(lm: Transformer, batch: TTTBatch, temperature: float,
                  tv_weight: float = 0.0) -> tuple[torch.Tensor, dict]:
    """(1 - tv_weight) * soft CE + tv_weight * TV of a standalone draft LM against the policy,
    masked means over the response positions; metrics as `ttt_loss`'s, for its one step."""
    logits = lm(batch.tokens[None], cu_seqlens=batch.cu_seqlens).logits[0]
    ce = masked_mean(soft_cross_entropy(logits, batch.policy_logits, temperature), batch.loss_mask)
    tv = masked_mean(total_variation(logits, batch.policy_logits, temperature), batch.loss_mask)
    loss = (1 - tv_weight) * ce + tv_weight * tv
    return loss, {"ce": [ce.item()], "tv": [tv.item()], "acceptance": [1 - tv.item()]}


def held_out_metrics(draft, batches: list[TTTBatch], cfg: RunConfig) -> dict[str, list[float]]:
    """The training loss's metrics (per TTT step, or the draft LM's one step: acceptance = 1 - TV,
    ce, tv) on answers the draft does not train on, each averaged over their answer tokens, no
    gradient; for an EAGLE-3 or block draft sampled at a temperature without top-k or top-p,
    also ``expected_accept_length`` ([tau]): the tau that drafting rollout.gamma tokens a step
    would reach on these answers (`cospec.draft.expected_accept_length`), the held-out figure
    that reads like real tau (a little lower: it cannot count tokens past an answer's end)."""
    sums, count = {}, 0
    was_training = draft.training
    draft.eval()
    with torch.no_grad():
        for b in batches:
            if isinstance(draft, TappedDraft):
                _, m = ttt_loss(draft, b, num_steps=cfg.draft.ttt_steps,
                                temperature=cfg.sampling.temperature)
            else:
                _, m = lm_draft_loss(draft, b, cfg.sampling.temperature)
            n = int(b.loss_mask.sum())
            for k, v in m.items():
                sums[k] = [a + n * x for a, x in zip(sums.get(k, [0.0] * len(v)), v)]
            count += n
    metrics = {k: [x / max(count, 1) for x in v] for k, v in sums.items()}
    if isinstance(draft, TappedDraft) and batches and chain_applies(cfg):
        with torch.no_grad():
            steps, tokens = expected_accept_length(draft, batches, cfg.rollout.gamma,
                                                   cfg.sampling.temperature)
        metrics["expected_accept_length"] = [tokens / steps if steps else float("nan")]
    draft.train(was_training)
    return metrics


def chain_applies(cfg: RunConfig) -> bool:
    """Whether expected tau can be computed for this sampling: the chain's accept probabilities
    are those of plain temperature sampling (`cospec.draft.expected_accept_length`)."""
    s = cfg.sampling
    return s.temperature > 0 and not s.top_k and s.top_p == 1.0


def train_draft_offline(cfg: RunConfig, policy: Transformer, draft=None, *, data: TaskData | None = None,
                        progress: bool = True, answers: AnswerStore | None = None,
                        checkpoint: OfflineCheckpoint | None = None,
                        evaluate: bool = True) -> tuple[TappedDraft | Transformer, dict]:
    """Steps 1-4; returns the trained draft and metrics (`fit_draft`'s, the data's size, and the
    fitted ``proposal_scale`` with ``proposal_scale_fit``'s expected tau before and after).
    data: the prompts and tokenizer (default: the run's, `task_data`); answers: where the sampled
    answers are kept and reused; checkpoint: where the training state is kept every
    draft.checkpoint_every steps and resumed from (`cospec.artifacts.load_or_train_draft` passes
    both, in out_dir; without them everything stays in memory, as for the oracle's retraining);
    evaluate: measure the draft on draft.num_eval_prompts held-out answers as it trains."""
    d = cfg.draft
    policy.eval()
    data = task_data(cfg, data)
    t0 = time.perf_counter()
    completions = sample_responses(cfg, policy, data, progress=progress, store=answers)
    held = (sample_responses(cfg, policy, data, progress=progress, split="held_out", store=answers)
            if evaluate and d.num_eval_prompts else [])
    state = checkpoint.load(next(policy.parameters()).device) if checkpoint is not None else None
    if draft is None:
        if state is not None:  # the vocabulary the interrupted run chose
            vocab_ids = state["vocab_ids"]
        else:
            vocab_ids = (draft_vocabulary([c.tokens for c in completions], d.vocab_size,
                                          policy.config.vocab_size, keep=data.tokenizer.stop_ids)
                         if d.vocab_size else None)
        draft = build_draft(cfg, policy, vocab_ids)
    vocab_ids = getattr(draft, "vocab_ids", None)
    # The held-out answers' outputs are kept whatever the setting: they are few and read whole
    # at every evaluation.
    batches = policy_batches(cfg, policy, completions, vocab_ids=vocab_ids,
                             keep=d.keep_policy_outputs, progress=progress)
    held_batches = policy_batches(cfg, policy, held, vocab_ids=vocab_ids) if held else []
    data_seconds = time.perf_counter() - t0
    metrics = fit_draft(cfg, draft, batches, held_batches, state=state, checkpoint=checkpoint,
                        progress=progress)
    if held_batches and d.fit_proposal_scale and isinstance(draft, TappedDraft) \
            and chain_applies(cfg):
        fit = fit_proposal_scale(draft, held_batches, cfg.rollout.gamma, cfg.sampling.temperature)
        draft.proposal_scale = metrics["proposal_scale"] = fit["scale"]
        metrics["proposal_scale_fit"] = fit
        print(f"proposal scale {fit['scale']:.4g}: expected tau on {len(held)} held-out answers "
              f"{fit['expected_tau_at_1']:.3f} at 1 -> {fit['expected_tau']:.3f}")
    metrics.update(num_batches=len(batches), num_tokens=num_tokens(batches),
                   num_held_out_batches=len(held_batches),
                   num_answers=len(completions), num_held_out_answers=len(held),
                   data_seconds=data_seconds, kind=d.kind)
    return draft, metrics


def fit_draft(cfg: RunConfig, draft, batches: Sequence[TTTBatch],
              held_batches: Sequence[TTTBatch], *, state: dict | None = None,
              checkpoint: OfflineCheckpoint | None = None, progress: bool = True) -> dict:
    """Step 3: draft.train_steps AdamW steps (warmup, then cosine to a tenth) on batches drawn at
    random from ``batches``; the held-out metrics (`held_out_metrics`) at step 0, every
    draft.eval_every steps and at the end; the state kept in ``checkpoint`` every
    draft.checkpoint_every steps, and resumed from ``state`` (what the checkpoint held).
    Returns loss_history, final_loss, last_batch (the last step's metrics), held_out (a list of
    {"step", metric: per-TTT-step values}) and train_seconds (resumed runs included)."""
    d, device = cfg.draft, next(draft.parameters()).device
    bucket = cpu_bucket(d.token_bucket, device)
    opt = torch.optim.AdamW(trainable_parameters(draft, cfg), lr=d.lr, betas=(0.9, 0.95),
                            weight_decay=0.0, fused=True)
    order = random.Random(d.seed)
    history, held_out, last, start, seconds_before = [], [], {}, 0, 0.0
    if state is not None:
        draft.load_state_dict(state["draft"])
        opt.load_state_dict(state["optimizer"])
        order.setstate(_as_random_state(state["order"]))
        history, held_out, start = list(state["history"]), list(state["held_out"]), state["step"]
        seconds_before = state["train_seconds"]
        print(f"resuming draft training at step {start} of {d.train_steps} from {checkpoint.loaded_from}")
    elif held_batches:
        held_out.append({"step": 0, **held_out_metrics(draft, held_batches, cfg)})
    draft.train()
    t1 = time.perf_counter()
    with progress_bar(progress, d.train_steps, "draft-train", start=start) as advance:
        for step in range(start, d.train_steps):
            for g in opt.param_groups:
                g["lr"] = lr_at(step, lr=d.lr, warmup=min(20, d.train_steps // 10),
                                total=d.train_steps, min_ratio=0.1)
            batch = batches[order.randrange(len(batches))]
            with autocast(d.autocast, device):  # the backward below runs outside it
                if isinstance(draft, TappedDraft):  # EAGLE-3's TTT unroll, or the block's
                    loss, last = ttt_loss(draft, pad_to_bucket(batch, bucket),
                                          num_steps=d.ttt_steps, decay=d.ttt_decay,
                                          temperature=cfg.sampling.temperature,
                                          tv_weight=d.tv_weight, anchor_weight=d.anchor_weight)
                else:
                    loss, last = lm_draft_loss(draft, batch, cfg.sampling.temperature, d.tv_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
            opt.step()
            history.append(loss.item())
            done = step + 1
            if held_batches and ((d.eval_every and done % d.eval_every == 0) or done == d.train_steps):
                held_out.append({"step": done, **held_out_metrics(draft, held_batches, cfg)})
            advance(f"loss {history[-1]:.3f}" + _held_out_note(held_out))
            if checkpoint is not None and d.checkpoint_every and done % d.checkpoint_every == 0 \
                    and done < d.train_steps:
                checkpoint.save({"draft": draft.state_dict(), "optimizer": opt.state_dict(),
                                 "vocab_ids": getattr(draft, "vocab_ids", None),
                                 "order": order.getstate(), "step": done, "history": history,
                                 "held_out": held_out,
                                 "train_seconds": seconds_before + time.perf_counter() - t1})
    draft.eval()
    return {"loss_history": history, "final_loss": sum(history[-20:]) / max(len(history[-20:]), 1),
            "last_batch": last, "held_out": held_out,
            "train_seconds": seconds_before + time.perf_counter() - t1}


def _held_out_note(held_out: list[dict]) -> str:
    if not held_out or "acceptance" not in held_out[-1]:
        return ""
    acc = "/".join(f"{a:.2f}" for a in held_out[-1]["acceptance"])
    tau = held_out[-1].get("expected_accept_length")
    return f", held-out {acc}" + (f" (tau {tau[0]:.2f})" if tau else "")


def _as_random_state(state) -> tuple:
    """random.Random.setstate wants tuples; a state read back through torch.load may hold lists."""
    version, internal, gauss = state
    return (version, tuple(internal), gauss)


def draft_dir(cfg: RunConfig, kind: str | None = None):
    """Where `cospec draft-train` keeps a draft of this kind: out_dir/draft (EAGLE-3),
    out_dir/draft_block or out_dir/draft_lm."""
    from pathlib import Path

    kind = kind or cfg.draft.kind
    return Path(cfg.out_dir) / ("draft" if kind == "eagle3" else f"draft_{kind}")


def draft_fits(draft, cfg: RunConfig, policy: Transformer) -> bool:
    """Whether a loaded draft is the one `build_draft` would make for this config and policy."""
    d = cfg.draft
    if d.kind in ("eagle3", "block"):
        fits = (draft.policy_config == policy.config
                and draft.tap_layers == (d.tap_layers or default_tap_layers(policy.config.num_layers))
                and draft.config.intermediate_size == (d.intermediate_size
                                                       or policy.config.intermediate_size)
                and draft.draft_vocab_size == (d.vocab_size or policy.config.vocab_size))
        if d.kind == "eagle3":
            return isinstance(draft, Eagle3Draft) and fits and len(draft.layers) == d.eagle3_layers
        return (isinstance(draft, BlockDraft) and fits and len(draft.layers) == d.block_layers
                and draft.has_correction == d.block_correction
                and draft.has_confidence == d.block_confidence)
    return isinstance(draft, Transformer) and draft.config == draft_model_config(
        policy.config, num_layers=d.lm_num_layers, intermediate_size=d.intermediate_size)
