"""Synthetic, verifiable task families and their exact verifiers: the short-answer families
below, the worked-solution families of `cospec.data.worked_solutions` (the default suite), and
`TaskSuite`, which samples a config's mix of them.

Every family makes (prompt, reference answer) pairs from a seeded `random.Random` and scores a
response with an exact check; rewards are in {0, 1} and never come from a model (no partial
credit: a wrong digit or a missing letter earns 0). Why each is here:

- ``copy``  ("copy:kqzv=" -> "kqzv"): near-deterministic output whose length has a long tail
  (geometric with mean 6, capped at 40: median 4, p90 13, p99 26). It is what a draft predicts
  best (acceptance near 1) and what makes rollout lengths ragged, i.e. the long tail that
  continuous batching and speculation target.
- ``add``   ("add:821+379=" -> "1200"): deterministic but hard for a small char model (carries
  over up to 3 digits; each operand has 1..3 digits), so a CPU-minutes SFT leaves it at partial
  accuracy and RL has reward to gain. More digits push SFT accuracy towards 0, which gives GRPO
  groups with no reward variance and so no signal.
- ``sort``  ("sort:dbxa=" -> "abdx"): deterministic, medium difficulty and medium length (2..12);
  the policy must attend over the whole prompt, unlike copy's monotone alignment.
- ``perm``  ("perm:aabc=" -> any arrangement of a, a, b, c): many valid answers per prompt (up to
  8! = 40320). SFT shows a uniformly random arrangement, so the policy starts with high output
  entropy; RL rewards every valid arrangement alike and lets the policy collapse onto whichever
  arrangements it happens to prefer, which moves its distribution far from the SFT one (the case
  where a frozen draft goes stale) even when reward barely changes.

The short families differ in output entropy (copy/add/sort 0 bits at the optimum, perm up to
log2(n!) bits per answer), in length (1..40 characters) and in difficulty. Every prompt plus answer
stays within 5 + 40 + 1 + 40 = 86 characters, so an example with BOS and EOS fits 128 tokens.

Scoring convention: `reward` sees the decoded response text, everything before EOS. A response cut
off by ``max_new_tokens`` is scored as text; whether a response that never emitted EOS may earn
reward at all is the caller's decision.
"""

from __future__ import annotations

import math
import random
import string

from cospec.config import ConfigError, TaskConfig
from cospec.data.task_family import Example, TaskFamily
from cospec.data.tokenizer import CharTokenizer
from cospec.data.worked_solutions import WORKED_FAMILIES


def _letters(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(n))


class Copy(TaskFamily):
    name = "copy"

    def __init__(self, mean_len: float = 6.0, max_len: int = 40):
        self.mean_len, self.max_len = mean_len, max_len

    def sample(self, rng: random.Random) -> Example:
        # Geometric length on 1, 2, ... with the given mean, by inversion: P(n > k) = (1 - p)^k,
        # so most strings are short and a few reach max_len (the long tail).
        p = 1.0 / self.mean_len
        n = min(self.max_len, 1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - p)))
        s = _letters(rng, n)
        return Example(self.name, f"copy:{s}=", s)


class Add(TaskFamily):
    name = "add"

    def __init__(self, max_digits: int = 3):
        self.max_digits = max_digits

    def sample(self, rng: random.Random) -> Example:
        # Digit count first, then the value, so short operands are as common as long ones.
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
        rng.shuffle(arranged)  # a uniformly random valid answer: the SFT target has high entropy
        return Example(self.name, f"perm:{s}=", "".join(arranged), {"letters": s})

    def reward(self, example: Example, response: str) -> float:
        return float(sorted(response) == sorted(example.meta["letters"]))

    @staticmethod
    def num_valid_answers(letters: str) -> int:
        """Distinct arrangements of `letters`: n! / prod(count_c!)."""
        out = math.factorial(len(letters))
        for c in set(letters):
            out //= math.factorial(letters.count(c))
        return out


FAMILIES: dict[str, type[TaskFamily]] = {f.name: f for f in (Copy, Add, Sort, Perm, *WORKED_FAMILIES)}


def encode_prompt(example: Example, tok: CharTokenizer) -> list[int]:
    """BOS + prompt: what the rollout engine is given."""
    return tok.encode(example.prompt, bos=True)


def encode_sft(example: Example, tok: CharTokenizer) -> tuple[list[int], list[int]]:
    """(ids, loss mask): BOS + prompt + answer + EOS, mask 1 on the answer and EOS only.

    Example: Example("add", "add:1+2=", "3") gives ids [BOS, a, d, d, :, 1, +, 2, =, 3, EOS] and
    mask [0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1]; ids[:9] == encode_prompt(example, tok).
    """
    prompt = encode_prompt(example, tok)
    answer = tok.encode(example.answer, eos=True)
    return prompt + answer, [0] * len(prompt) + [1] * len(answer)


class TaskSuite:
    """The families of a `TaskConfig`, sampled by its weights, with dispatching verifiers."""

    def __init__(self, cfg: TaskConfig):
        unknown = [f for f in cfg.families if f not in FAMILIES]
        if unknown:
            raise ConfigError(f"task.families: unknown {', '.join(map(repr, unknown))} "
                             f"(known: {', '.join(FAMILIES)})")
        self.families: list[TaskFamily] = [FAMILIES[f]() for f in cfg.families]
        self._by_name = {f.name: f for f in self.families}
        self.family_names = tuple(self._by_name)
        self.weights = list(cfg.weights) or [1.0] * len(self.families)

    def _family(self, name: str) -> TaskFamily:
        if name not in self._by_name:
            raise ValueError(f"family {name!r} is not in this suite ({', '.join(self._by_name)})")
        return self._by_name[name]

    def sample(self, rng: random.Random) -> Example:
        """An example from a family drawn by the config's weights (uniform when none are given)."""
        return rng.choices(self.families, weights=self.weights)[0].sample(rng)

    def sample_family(self, name: str, rng: random.Random) -> Example:
        return self._family(name).sample(rng)

    def reward(self, example: Example, response: str) -> float:
        """The exact verifier of `example.family`: 1.0 or 0.0."""
        return self._family(example.family).reward(example, response)

    # kept on the suite too, so callers holding only a suite need no second import
    encode_prompt = staticmethod(encode_prompt)
    encode_sft = staticmethod(encode_sft)
