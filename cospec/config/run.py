"""The whole run config: its sections, and the checks that need more than one of them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from cospec.config.rl_sections import DraftConfig, GRPOConfig, ParallelConfig, RolloutConfig
from cospec.config.sections import (ModelConfig, SamplingConfig, SFTConfig, TaskConfig, _check)


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
        _check(self.draft.mode != "cotrain" or self.draft.kind != "lm", "draft.mode",
               "cotrain trains a draft on the policy's features (draft.kind=eagle3 or block)")
        if not self.model.path:  # else model.* is known once the checkpoint is read
            self.check_against_model()
        p = self.parallel
        if p.pp > 1:
            _check(p.pp <= self.model.num_layers, "parallel.pp",
                   f"{p.pp} stages for {self.model.num_layers} layers: every stage needs a layer")
            _check(not self.model.tie_embeddings, "parallel.pp",
                   "a tied embedding cannot be split across stages (model.tie_embeddings=false)")
            per_minibatch = (self.grpo.prompts_per_step * self.grpo.group_size
                             // self.grpo.micro_steps // p.dp)
            _check(p.microbatches <= per_minibatch, "parallel.microbatches",
                   f"{p.microbatches} microbatches of whole rollouts, a minibatch has only "
                   f"{per_minibatch} (prompts_per_step * group_size / micro_steps / dp)")
        if p.dp > 1:
            g = self.grpo
            _check(g.prompts_per_step % p.dp == 0, "parallel.dp",
                   f"{p.dp} replicas share grpo.prompts_per_step={g.prompts_per_step} prompt groups: "
                   f"it must be a multiple of dp (a group never straddles replicas)")
            _check(g.prompts_per_step // p.dp * g.group_size >= g.micro_steps, "parallel.dp",
                   f"each replica's {g.prompts_per_step // p.dp * g.group_size} rollouts must fill "
                   f"grpo.micro_steps={g.micro_steps} minibatches")
        _check(p.dp * p.cp * p.pp == 1 or self.draft.mode != "oracle", "draft.mode",
               "oracle (a measurement) runs on one process only; use parallel.dp=cp=pp=1")
        _check(p.cp == 1 or not self.draft.anchor_weight, "draft.anchor_weight",
               "not supported under parallel.cp > 1 yet (entry t's weight reads entry t - 1, "
               "which may sit on another rank); set it to 0")

    def check_against_model(self) -> None:
        """The fields that must fit the policy's architecture (`with_checkpoint_model` calls this
        once a checkpoint has given it)."""
        _check(self.draft.vocab_size <= self.model.vocab_size, "draft.vocab_size",
               f"{self.draft.vocab_size}: a draft head cannot cover more ids than the policy's "
               f"model.vocab_size={self.model.vocab_size}")
        _check(all(t < self.model.num_layers for t in self.draft.tap_layers), "draft.tap_layers",
               f"{list(self.draft.tap_layers)}: the policy has layers 0..{self.model.num_layers - 1}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


#: (field, the switch it needs, is the switch on) for fields that only some configs read
def _gated_fields(cfg: RunConfig) -> list[tuple[str, str, bool]]:
    r, d, p = cfg.rollout, cfg.draft, cfg.parallel
    rows = [(f"rollout.{n}", "rollout.speculative=true", r.speculative)
            for n in ("gamma", "adaptive", "overshoot_every")]
    rows.append(("rollout.probe_every", "rollout.speculative=true rollout.adaptive=true",
                 r.speculative and r.adaptive))
    rows += [(f"draft.{n}", "draft.mode=cotrain", d.mode == "cotrain")
             for n in ("cotrain_every", "cotrain_iters", "cotrain_lr", "cotrain_max_tokens")]
    rows.append(("draft.oracle_every", "draft.mode=oracle", d.mode == "oracle"))
    rows += [(f"draft.{n}", "draft.kind=block", d.kind == "block")
             for n in ("block_layers", "block_correction", "block_confidence")]
    rows.append(("draft.eagle3_layers", "draft.kind=eagle3", d.kind == "eagle3"))
    rows += [(f"parallel.{n}", "parallel.pp > 1", p.pp > 1) for n in ("microbatches", "schedule")]
    rows += [(f"task.{n}", "task.source=math", cfg.task.source == "math")
             for n in ("math_types", "math_levels")]
    return rows


def no_effect_warnings(cfg: RunConfig, switched_on: tuple[str, ...] = ()) -> list[str]:
    """One line per field set away from its default that this config never reads (its switch is
    off), so that a setting is not silently ignored. Relative to the field's default, so a recipe
    or file that merely restates a default says nothing. ``switched_on``: switches the command
    sets itself whatever the config says (``rollout.speculative=true``, ``draft.kind=block``)."""
    defaults, out = RunConfig(), []
    for dotted, switch, on in _gated_fields(cfg):
        section, name = dotted.split(".")
        value = getattr(getattr(cfg, section), name)
        if not (on or switch in switched_on) and value != getattr(getattr(defaults, section), name):
            out.append(f"{dotted}={value!r} has no effect without {switch}")
    return out
