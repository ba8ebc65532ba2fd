"""The prompts the rollout benchmarks answer: the run's RL tasks, or copy prompts with long answers."""

from __future__ import annotations

import random

from cospec.config import ConfigError, RunConfig
from cospec.data.prompts import TaskData
from cospec.data.tasks import Copy, encode_prompt
from cospec.data.tokenizer import CharTokenizer


def check_workload(cfg: RunConfig, workload: str) -> None:
    """ConfigError, before anything is trained, for ``long`` on a policy that never saw copy."""
    if workload == "long" and (cfg.task.source != "synthetic" or "copy" not in cfg.task.families):
        raise ConfigError("--workload long samples copy prompts: it needs task.source=synthetic "
                          "and a policy trained on the copy family (task.families with copy, "
                          "e.g. the short families 'task.families=[copy,add,sort,perm]')")


def task_prompts(cfg: RunConfig, n: int, seed: int = 2024, *, workload: str = "tasks",
                 data: TaskData | None = None) -> list[list[int]]:
    """``tasks``: the run's RL prompts (``task.source`` through its tokenizer; on the default
    synthetic suite, worked solutions of ~40 tokens on average). ``long`` (synthetic only): copy
    prompts whose answers have 24-40 characters (the long tail of the short families: what a
    rollout batch still decodes after their short answers have finished)."""
    rng = random.Random(seed)
    if workload == "long":
        check_workload(cfg, workload)
        tok, copy_family = CharTokenizer(), Copy(mean_len=30.0, max_len=40)
        examples = []
        while len(examples) < n:
            ex = copy_family.sample(rng)
            if len(ex.answer) >= 24:
                examples.append(ex)
        return [encode_prompt(e, tok) for e in examples]
    data = data or TaskData.from_config(cfg.task, CharTokenizer())
    return [data.prompt_ids(data.source.sample(rng)) for _ in range(n)]
