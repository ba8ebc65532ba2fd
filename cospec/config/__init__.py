"""Typed run configuration: frozen dataclasses, validation, file loading and CLI overrides.

Every field has a docstring-style comment just above it (`#:`) that `cospec config --describe`
prints. Invalid values raise `ConfigError` (a `ValueError`) naming the dotted field the user typed,
e.g. ``model.num_heads=5: must divide model.hidden_size=128``.

Overrides are ``section.field=value`` strings; values are parsed as YAML scalars (so ``true``,
``3``, ``1e-3``, ``[1, 2]`` work) and then coerced to the field's declared type.

The modules, bottom up: `sections` and `rl_sections` (one frozen dataclass per section), `run`
(`RunConfig`, the checks across sections, and `no_effect_warnings`), `parsing` (files, overrides,
`apply`, `describe`), `recipes` (named recipes deriving from `base()`, torchtitan style, and
`resolve`). Callers import from the package: ``from cospec.config import RunConfig, resolve``.
"""

from cospec.config.parsing import apply, describe, load_file, parse_override
from cospec.config.recipes import RECIPES, base, resolve, smollm2_math, tiny
from cospec.config.rl_sections import DraftConfig, GRPOConfig, ParallelConfig, RolloutConfig
from cospec.config.run import RunConfig, no_effect_warnings
from cospec.config.sections import (ConfigError, ModelConfig, SamplingConfig, SFTConfig,
                                    TaskConfig)

__all__ = ["ConfigError", "DraftConfig", "GRPOConfig", "ModelConfig", "ParallelConfig",
           "RECIPES", "RolloutConfig", "RunConfig", "SFTConfig", "SamplingConfig", "TaskConfig",
           "apply", "base", "describe", "load_file", "no_effect_warnings", "parse_override", "resolve",
           "smollm2_math", "tiny"]
