"""Where a run's prompts come from, how they become token ids, and how responses are scored.

Three prompt sources share one small interface (`PromptSource`):
- ``task.source=synthetic``: the character-level families of `cospec.data.tasks` (`TaskSuite`);
- ``task.source=math``: the built-in seeded word problems of `cospec.data.word_problems`;
- ``task.source=PATH.jsonl``: records of a prompt file (`cospec.data.jsonl`), drawn uniformly.
The last two are `RecordSource`s, scored by ``task.verifier`` (`cospec.data.verifiers`).

`TaskData` pairs a source with the run's tokenizer and prompt format. Worked example, SmolLM2 with
``task.chat_template=true``: the record {"prompt": "Tom has 3 apples...", "answer": "5"} becomes
the ids of "<|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\nTom has 3 apples...<|im_end|>\\n
<|im_start|>assistant\\n" (the checkpoint's own template renders it); the response is decoded up to
its first stop id and the verifier compares its final number with 5. With the character tokenizer
the prompt is BOS + the prompt's characters, as the synthetic families always had it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Protocol

from cospec.config import ConfigError, TaskConfig
from cospec.data.tasks import Example, TaskSuite
from cospec.data.tokenizer import Tokenizer


class PromptSource(Protocol):
    """A stream of `Example`s and their verifier. family_names: the groups metrics break down by
    (task families, problem types, a JSONL file's "type" values)."""

    family_names: tuple[str, ...]

    def sample(self, rng: random.Random) -> Example: ...

    def sample_family(self, name: str, rng: random.Random) -> Example: ...

    def reward(self, example: Example, response: str) -> float: ...


def example_from_record(record: dict) -> Example:
    """An `Example` whose meta carries the record (a plug-in verifier reads it whole). prompt is the
    record's text, or for a chat record the content of its last message."""
    messages = record.get("messages")
    prompt = record["prompt"] if messages is None else messages[-1]["content"]
    return Example(record.get("type", "jsonl"), prompt, str(record["answer"]), {"record": record})


class RecordSource:
    """Prompts from records with a verifier: a generator (``draw(rng, family)``, family None for
    any) or a fixed list drawn uniformly (a prompt file)."""

    def __init__(self, draw: Callable[[random.Random, str | None], dict], family_names: tuple[str, ...],
                 verifier: Callable[[dict, str], float], records: list[dict] | None = None):
        self._draw, self.family_names, self.verifier = draw, family_names, verifier
        self.records = records  # a prompt file's every record; None for a generator

    @classmethod
    def from_records(cls, records: list[dict], verifier) -> "RecordSource":
        by_type: dict[str, list[dict]] = {}
        for r in records:
            by_type.setdefault(r.get("type", "jsonl"), []).append(r)

        def draw(rng: random.Random, family: str | None) -> dict:
            pool = records if family is None else by_type[family]
            return pool[rng.randrange(len(pool))]

        return cls(draw, tuple(sorted(by_type)), verifier, records)

    def sample(self, rng: random.Random) -> Example:
        return example_from_record(self._draw(rng, None))

    def sample_family(self, name: str, rng: random.Random) -> Example:
        if name not in self.family_names:
            raise ValueError(f"prompt type {name!r} is not in this source ({', '.join(self.family_names)})")
        return example_from_record(self._draw(rng, name))

    def reward(self, example: Example, response: str) -> float:
        return float(self.verifier(example.meta["record"], response))


def make_prompt_source(cfg: TaskConfig) -> PromptSource:
    """The source ``task.source`` names (a JSONL file is read and checked here, once)."""
    if cfg.source == "synthetic":
        return TaskSuite(cfg)
    from cospec.data.verifiers import load_verifier

    try:  # what the user named: a ConfigError, reported by the CLI with exit 2
        verifier = load_verifier(cfg.verifier)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if cfg.source == "math":
        from cospec.data import word_problems

        types = tuple(cfg.math_types) or word_problems.PROBLEM_TYPES
        try:  # validates task.math_types and task.math_levels
            word_problems.sample_problem(random.Random(0), types=types, levels=cfg.math_levels)
        except ValueError as e:
            raise ConfigError(str(e)) from e

        def draw(rng: random.Random, family: str | None) -> dict:
            return word_problems.sample_problem(rng, types=(family,) if family else types,
                                                levels=cfg.math_levels)

        return RecordSource(draw, types, verifier)
    from cospec.data.jsonl import load_prompt_records
    from cospec.data.verifiers import math_verifier

    records = load_prompt_records(cfg.source)
    if verifier is math_verifier:  # a non-numeric answer fails now, not at the first reward
        for n, r in enumerate(records, 1):
            try:
                math_verifier(r, "")
            except ValueError as e:
                raise ConfigError(f"{cfg.source}: record {n}: {e}") from e
    return RecordSource.from_records(records, verifier)


@dataclass
class TaskData:
    """A prompt source with the tokenizer and prompt format of the run.

    chat: render prompts through the tokenizer's chat template (only where it has one);
    system_prompt: a system message put first in every chat prompt ("" = none).
    """

    source: PromptSource
    tokenizer: Tokenizer
    chat: bool = True
    system_prompt: str = ""

    @classmethod
    def from_config(cls, cfg: TaskConfig, tokenizer: Tokenizer) -> "TaskData":
        return cls(make_prompt_source(cfg), tokenizer, chat=cfg.chat_template,
                   system_prompt=cfg.system_prompt)

    @property
    def uses_chat_template(self) -> bool:
        return self.chat and self.tokenizer.has_chat_template

    def messages(self, example: Example) -> list[dict]:
        record = example.meta.get("record", {})
        messages = list(record.get("messages") or [{"role": "user", "content": example.prompt}])
        if self.system_prompt and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def prompt_ids(self, example: Example) -> list[int]:
        """What the rollout engine is given: the chat-rendered prompt, or BOS + the prompt text."""
        if self.uses_chat_template:
            return self.tokenizer.encode_chat(self.messages(example), add_generation_prompt=True)
        return self.tokenizer.encode(example.prompt, bos=True)

    def check_room(self, max_seq_len: int, *, samples: int = 256, seed: int = 0) -> None:
        """ConfigError naming model.max_seq_len when a prompt leaves no room for a response token:
        said before any rollout, not mid-run. A prompt file's every record is checked; a
        generator's prompts are bounded, and `samples` of them drawn with a fixed seed."""
        records = getattr(self.source, "records", None)
        if records is not None:
            examples, which = [example_from_record(r) for r in records], f"all {len(records)}"
        else:
            rng = random.Random(seed)
            examples, which = [self.source.sample(rng) for _ in range(samples)], f"{samples} drawn"
        lengths = [len(self.prompt_ids(e)) for e in examples]
        longest = max(lengths)
        if longest + 1 > max_seq_len:
            at = lengths.index(longest)
            where = f" (record {at + 1})" if records is not None else ""
            raise ConfigError(f"model.max_seq_len={max_seq_len}: prompts of this task run to "
                              f"{longest} tokens{where}, of {which}, leaving no room for a "
                              f"response; raise it above {longest}")

    def reward(self, example: Example, response_ids: list[int]) -> float:
        """The verifier's score of a response, decoded up to its first stop id."""
        return self.source.reward(example, self.tokenizer.decode(response_ids))
