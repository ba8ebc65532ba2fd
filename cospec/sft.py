"""Supervised fine-tuning of the policy on the task suite: packed batches, AdamW, cosine schedule.

The SFT policy is the starting point of RL (and the source of the initial draft's training data), so
it is meant to reach *partial* accuracy: high enough that GRPO gets signal, low enough that RL has
room to raise reward and move the distribution.

Loss: next-token cross-entropy on the answer and EOS tokens only (the prompt is given, not learned),
averaged over those tokens. Sequences are packed into one row with `cu_seqlens`, so no compute is
spent on padding and attention never crosses an example boundary.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from cospec.atomic_file import write_json_atomically
from cospec.config import ConfigError, RunConfig, SamplingConfig
from cospec.data.packing import PackedBatch, pack_examples
from cospec.data.prompts import TaskData
from cospec.data.tasks import TaskSuite
from cospec.data.tokenizer import SPECIALS, CharTokenizer, check_vocab
from cospec.lr_schedule import lr_at
from cospec.metrics.progress import progress_bar
from cospec.models.llama import Transformer


def add_label_noise(ids: list[int], mask: list[int], noise: float, rng: random.Random,
                    tok: CharTokenizer) -> list[int]:
    """Each answer token (mask 1, EOS excluded) replaced with probability ``noise`` by a token drawn
    uniformly from the tokenizer's non-special ids: a demonstrator that slips, in its inputs and its
    targets alike (the sequence stays one the demonstrator wrote)."""
    if noise <= 0:
        return ids
    return [rng.randrange(len(SPECIALS), tok.vocab_size) if m and t != tok.eos_id and rng.random() < noise
            else t for t, m in zip(ids, mask)]


def check_example_length(ids: list[int], max_seq_len: int | None) -> None:
    """ConfigError naming model.max_seq_len for an SFT example the model cannot take (it sees
    ids[:-1], the last id being only a target)."""
    if max_seq_len is not None and len(ids) - 1 > max_seq_len:
        raise ConfigError(f"model.max_seq_len={max_seq_len}: an SFT example of task.families "
                          f"has {len(ids) - 1} tokens; raise it to at least that")


def check_examples_fit(suite: TaskSuite, tok: CharTokenizer, max_seq_len: int, *, seed: int,
                       num_examples: int = 16384) -> None:
    """Up front, not at the step that first draws a long example: `num_examples` of a stream of
    their own (~0.1 s; the families' lengths are bounded, and `next_batch` checks each one too)."""
    rng = random.Random(seed)
    for _ in range(num_examples):
        check_example_length(suite.encode_sft(suite.sample(rng), tok)[0], max_seq_len)


def next_batch(suite: TaskSuite, tok: CharTokenizer, rng: random.Random, tokens_per_batch: int,
               label_noise: float = 0.0, max_seq_len: int | None = None) -> PackedBatch:
    """Draw examples until the next one would overflow the token budget (at least one example).
    An example longer than ``max_seq_len`` (the model's) is a ConfigError naming the field."""
    encoded, used = [], 0
    while True:
        ids, m = suite.encode_sft(suite.sample(rng), tok)
        check_example_length(ids, max_seq_len)
        ids = add_label_noise(ids, m, label_noise, rng, tok)
        if encoded and used + len(ids) - 1 > tokens_per_batch:
            break
        encoded.append((ids, m))
        used += len(ids) - 1
    return pack_examples(encoded)


def sft_loss(model: Transformer, batch: PackedBatch) -> Tensor:
    logits = model(batch.tokens, cu_seqlens=batch.cu_seqlens).logits
    nll = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), reduction="none")
    m = batch.loss_mask.flatten()
    return (nll * m).sum() / m.sum().clamp(min=1)


def evaluate(model: Transformer, suite: TaskSuite, tok: CharTokenizer, *, prompts_per_family: int,
             max_new_tokens: int, batch_size: int, seed: int = 12345) -> dict[str, float]:
    """Greedy accuracy per family on a held-out prompt stream (a seed the training stream never
    uses); a response cut at max_new_tokens is scored as it stands."""
    from cospec.evaluate import evaluate_policy

    res = evaluate_policy(model, TaskData(suite, tok, chat=False),
                          SamplingConfig(temperature=0.0, max_new_tokens=max_new_tokens),
                          prompts_per_family=prompts_per_family, batch_size=batch_size, seed=seed,
                          require_stop=False)
    acc = {k: v["accuracy"] for k, v in res["by_family"].items()}
    acc["mean"] = sum(acc.values()) / len(acc)
    return acc


def train_sft(cfg: RunConfig, *, device: torch.device, progress: bool = True,
              model: Transformer | None = None) -> tuple[Transformer, dict]:
    """Train (a fresh policy unless `model` is given) and return it with its metrics."""
    tok = CharTokenizer()
    check_vocab(cfg.model.vocab_size, tok)
    torch.manual_seed(cfg.sft.seed)
    model = (model or Transformer(cfg.model)).to(device).train()
    suite = TaskSuite(cfg.task)
    check_examples_fit(suite, tok, cfg.model.max_seq_len, seed=cfg.task.seed + 1)
    rng = random.Random(cfg.task.seed)
    s = cfg.sft
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": s.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=s.lr, betas=(0.9, 0.95))
    history = []
    t0 = time.perf_counter()
    with progress_bar(progress, s.steps, "sft") as advance:
        for step in range(s.steps):
            for g in opt.param_groups:
                g["lr"] = lr_at(step, lr=s.lr, warmup=s.warmup_steps, total=s.steps,
                                min_ratio=s.min_lr_ratio)
            batch = next_batch(suite, tok, rng, s.tokens_per_batch, s.label_noise,
                               cfg.model.max_seq_len)
            batch = PackedBatch(*(t.to(device) for t in (batch.tokens, batch.targets,
                                                          batch.loss_mask, batch.cu_seqlens)))
            loss = sft_loss(model, batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if s.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
            opt.step()
            history.append(loss.item())
            advance(f"loss {history[-1]:.3f}")
    train_seconds = time.perf_counter() - t0
    model.eval()
    t1 = time.perf_counter()
    acc = evaluate(model, suite, tok, prompts_per_family=s.eval_prompts_per_family,
                   max_new_tokens=cfg.sampling.max_new_tokens, batch_size=cfg.sampling.batch_size)
    metrics = {"final_loss": sum(history[-20:]) / len(history[-20:]), "loss_history": history,
               "accuracy": acc, "train_seconds": train_seconds,
               "eval_seconds": time.perf_counter() - t1, "num_params": model.num_params(),
               "steps": s.steps}
    return model, metrics


def save_sft(model: Transformer, metrics: dict, cfg: RunConfig, out_dir: str | Path) -> Path:
    """HF-layout checkpoint at out_dir/sft (atomic) plus metrics and the config beside it."""
    from cospec.models.hf_checkpoint import save_hf

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / "sft"
    save_hf(model, ckpt)
    write_json_atomically(out / "sft_metrics.json", metrics)
    write_json_atomically(out / "config.json", cfg.to_dict())
    return ckpt
