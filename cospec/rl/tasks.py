"""Synthetic, verifiable task families and their exact verifiers.

Every family makes (prompt, reference answer) pairs from a seeded `random.Random` and scores a
response with an exact check; rewards are in {0, 1} and never come from a model. Why each is here:

- ``copy``  ("copy:kqzv=" -> "kqzv"): near-deterministic output whose length has a long tail
  (geometric, 1..40 chars). It is what a draft predicts best (acceptance near 1) and what makes
  rollout lengths ragged, i.e. the long tail that continuous batching and speculation target.
- ``add``   ("add:821+379=" -> "1200"): deterministic but hard for a small char model (carries
  over up to 3 digits), so SFT leaves it at partial accuracy and RL has reward to gain.
- ``sort``  ("sort:dbxa=" -> "abdx"): deterministic, medium difficulty and medium length; the
  policy must attend over the whole prompt, unlike copy's monotone alignment.
- ``perm``  ("perm:aabc=" -> any arrangement of a, a, b, c): many valid answers per prompt. SFT
  shows a uniformly random arrangement, so the policy starts with high output entropy; RL rewards
  every valid arrangement alike and lets the policy drift toward whatever arrangements it prefers,
  which moves its distribution far from the SFT one (the case where a frozen draft goes stale).

The families differ in output entropy (copy/add/sort ~0 bits per token at the optimum, perm up to
log2(n!) bits per answer), in length (1..40) and in difficulty.
"""

from __future__ import annotations

import math
import random
import string
from dataclasses import dataclass, field

from cospec.config import TaskConfig
from cospec.rl.tokenizer import CharTokenizer


@dataclass(frozen=True)
class Example:
    """family: the family's name; prompt: the text the policy sees after BOS (e.g. "add:12+35=");
    answer: one reference answer (the SFT target, EOS appended by the encoder); meta: what the
    verifier needs beyond the answer (e.g. the letters of a perm prompt)."""

    family: str
    prompt: str
    answer: str
    meta: dict = field(default_factory=dict, compare=False, hash=False)


class TaskFamily:
    name: str = ""

    def sample(self, rng: random.Random) -> Example:
        raise NotImplementedError

    def reward(self, example: Example, response: str) -> float:
        """Exact match with the reference answer, for families with a unique answer."""
        return float(response == example.answer)


def _letters(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(n))


class Copy(TaskFamily):
    name = "copy"

    def __init__(self, mean_len: float = 6.0, max_len: int = 40):
        self.mean_len, self.max_len = mean_len, max_len

    def sample(self, rng: random.Random) -> Example:
        # Geometric length with the given mean: most strings short, a few near max_len (long tail).
        p = 1.0 / self.mean_len
        n = min(self.max_len, 1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - p)))
        s = _letters(rng, n)
        return Example(self.name, f"copy:{s}=", s)


class Add(TaskFamily):
    name = "add"

    def __init__(self, max_digits: int = 3):
        self.max_digits = max_digits

    def sample(self, rng: random.Random) -> Example:
        a = rng.randrange(10 ** rng.randint(1, self.max_digits))
        b = rng.randrange(10 ** rng.randint(1, self.max_digits))
        return Example(self.name, f"add:{a}+{b}=", str(a + b))


class Sort(TaskFamily):
    name = "sort"

    def __init__(self, min_len: int = 2, max_len: int = 12):
        self.min_len, self.max_len = min_len, max_len

    def sample(self, rng: random.Random) -> Example:
        s = _letters(rng, rng.randint(self.min_len, self.max_len))
        return Example(self.name, f"sort:{s}=", "".join(sorted(s)))


class Perm(TaskFamily):
    """Any arrangement of the prompt's letters is correct (a multiset check)."""

    name = "perm"

    def __init__(self, min_len: int = 3, max_len: int = 8):
        self.min_len, self.max_len = min_len, max_len

    def sample(self, rng: random.Random) -> Example:
        s = _letters(rng, rng.randint(self.min_len, self.max_len))
        arranged = list(s)
        rng.shuffle(arranged)
        return Example(self.name, f"perm:{s}=", "".join(arranged), {"letters": s})

    def reward(self, example: Example, response: str) -> float:
        return float(sorted(response) == sorted(example.meta["letters"]))


FAMILIES: dict[str, type[TaskFamily]] = {f.name: f for f in (Copy, Add, Sort, Perm)}


class TaskSuite:
    """The families of a `TaskConfig`, sampled by its weights, with dispatching verifiers."""

    def __init__(self, cfg: TaskConfig):
        unknown = [f for f in cfg.families if f not in FAMILIES]
        if unknown:
            raise ValueError(f"task.families: unknown {unknown} (known: {', '.join(FAMILIES)})")
        self.families = [FAMILIES[f]() for f in cfg.families]
        self._by_name = {f.name: f for f in self.families}
        self.weights = list(cfg.weights) or [1.0] * len(self.families)

    def sample(self, rng: random.Random) -> Example:
        return rng.choices(self.families, weights=self.weights)[0].sample(rng)

    def sample_family(self, name: str, rng: random.Random) -> Example:
        if name not in self._by_name:
            raise ValueError(f"family {name!r} is not in this suite ({', '.join(self._by_name)})")
        return self._by_name[name].sample(rng)

    def reward(self, example: Example, response: str) -> float:
        return self._by_name[example.family].reward(example, response)

    @staticmethod
    def encode_prompt(example: Example, tok: CharTokenizer) -> list[int]:
        return tok.encode(example.prompt, bos=True)

    @staticmethod
    def encode_sft(example: Example, tok: CharTokenizer) -> tuple[list[int], list[int]]:
        """(ids, loss mask): BOS + prompt + answer + EOS, mask 1 on the answer and EOS only."""
        prompt = tok.encode(example.prompt, bos=True)
        answer = tok.encode(example.answer, eos=True)
        return prompt + answer, [0] * len(prompt) + [1] * len(answer)
