"""The two types every prompt family shares: `Example`, one task instance, and `TaskFamily`, a
prompt generator with its exact verifier (`cospec.data.tasks` and `cospec.data.worked_solutions`
define the families)."""

from __future__ import annotations

import abc
import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Example:
    """One task instance.

    family: the family's name; prompt: the text the policy sees after BOS; answer: one reference
    answer (the SFT target, EOS appended by `encode_sft`); meta: what the verifier needs beyond the
    answer, excluded from equality and hashing.
    Example: Example("perm", "perm:aab=", "aba", {"letters": "aab"}) is rewarded 1 for "aab",
    "aba" and "baa" and 0 for anything else.
    """

    family: str
    prompt: str
    answer: str
    meta: dict = field(default_factory=dict, compare=False, hash=False)


class TaskFamily(abc.ABC):
    """A prompt generator and its exact verifier; `name` is the key in `FAMILIES`."""

    name: str = ""

    @abc.abstractmethod
    def sample(self, rng: random.Random) -> Example:
        """A fresh example; all randomness comes from `rng`, so a seed fixes the stream."""

    def reward(self, example: Example, response: str) -> float:
        """Exact match with the reference answer, for families with a unique answer."""
        return float(response == example.answer)
