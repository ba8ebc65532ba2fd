"""Seeded grade-school arithmetic word problems for a small instruct LM to solve with chain of
thought (the ``task.source=math`` prompt stream).

A problem is a chain of whole-number operations on a running total, told as a short story:
``operands[0]`` is the starting amount and ``ops[i]`` applies ``operands[i + 1]`` to the total, left
to right. For example

    {"prompt": "Tom has 12 apples. He buys 7 more. How many apples does he have now?\\n"
               + ANSWER_INSTRUCTION,
     "answer": "19", "type": "add", "level": 1, "operands": [12, 7], "ops": ["+"]}

``operands`` and ``ops`` are kept in the record so a reader can recompute the answer; the numbers
appear in the prompt in operand order, as digits, and nowhere else.

Types are separable so accuracy can be measured per type: a small instruct model answers one-step
sums and small products far better than differences and quotients, and far better than chains.

- ``add``   every operation is an addition
- ``sub``   every operation is a subtraction (the total stays >= 1: these are add problems run
            backwards, so a level's differences are as large as its sums' terms)
- ``mul``   every operation is a multiplication
- ``div``   every operation is an exact division (mul problems run backwards)
- ``mixed`` each operation drawn from all four, with at least two kinds when there are two or
            more operations (at level 1 it is a one-step problem of a random kind)

Levels set the number of operations (level L has L of them) and the size of the numbers; see
`_SIZES`. Answers are whole numbers >= 1, every division is exact and every operand is >= 2 (so no
"1 apples"). All randomness comes from the `random.Random` passed in, so a seed fixes the stream.
"""

from __future__ import annotations

import math
import operator
import random
from collections.abc import Sequence
from dataclasses import dataclass

PROBLEM_TYPES: tuple[str, ...] = ("add", "sub", "mul", "div", "mixed")
LEVELS: tuple[int, ...] = (1, 2, 3, 4)

#: Appended to every prompt on its own line. Holds no digits, so the prompt's numbers are exactly
#: the operands; cospec.data.verifiers reads the "Answer:" line first. Chosen by measurement on
#: SmolLM2-135M-Instruct (greedy, level 1, docs/results/real_model.md): asking to "solve step by
#: step ... as 'Answer: N'" gave 10% (it wrote a literal N, or 300-token loops), no instruction 20%,
#: this one 32% in a median of ~40 tokens.
ANSWER_INSTRUCTION = 'End your answer with a line "Answer: " followed by the number.'


_OPS = ("+", "-", "*", "/")
_KIND_OP = {"add": "+", "sub": "-", "mul": "*", "div": "/"}
_APPLY = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.floordiv}


@dataclass(frozen=True)
class _Size:
    """Number sizes of one level."""

    max_term: int    # largest starting amount, addend and subtrahend
    max_factor: int  # largest multiplier and divisor
    max_value: int   # no running total (so no product, dividend or answer) exceeds this


_SIZES = {1: _Size(20, 10, 100), 2: _Size(50, 10, 500), 3: _Size(100, 12, 2000),
          4: _Size(500, 12, 10000)}
# _factors keeps room for a factor of 2 per remaining step, which needs this to never get stuck.
assert all(s.max_factor * 2 ** lv <= s.max_value for lv, s in _SIZES.items())
assert all((lv + 1) * s.max_term <= s.max_value for lv, s in _SIZES.items())  # sums and sub starts

# Mixed chains are drawn forwards and redrawn when a step has no valid operand (a division of a
# total with no divisor <= max_factor, say). The worst op sequence succeeds in about 1 try in 10.
_MAX_TRIES = 10_000

# ----------------------------------------------------------------------------- story pieces

_NAMES = (("Tom", "he"), ("Mia", "she"), ("Sam", "he"), ("Lena", "she"), ("Omar", "he"),
          ("Ana", "she"), ("Ben", "he"), ("Zoe", "she"), ("Ravi", "he"), ("Yuki", "she"),
          ("Leo", "he"), ("Nora", "she"), ("Kofi", "he"), ("Ella", "she"))
_PRONOUNS = {"he": ("He", "he", "him", "His", "his"), "she": ("She", "she", "her", "Her", "her")}
_OBJECTS = ("apples", "marbles", "stickers", "cookies", "pencils", "books", "coins", "cards",
            "shells", "stamps", "balloons", "crayons", "oranges", "toy cars")
_BOXES = ("boxes", "bags", "baskets", "jars", "packs", "trays")
_GIFTS = ("book", "kite", "ball", "puzzle", "lamp", "backpack")

# One-step problems (level 1), by operation; {a} then {b} in that order, answer a op b.
_ONE_STEP = {
    "+": ("{name} has {a} {obj}. {He} buys {b} more. How many {obj} does {he} have now?",
          "There are {a} {obj} in a basket. {name} puts {b} more {obj} in the basket. "
          "How many {obj} are in the basket now?",
          "{name} has {a} {obj} and {friend} has {b} {obj}. How many {obj} do they have together?",
          "{name} read {a} pages on Monday and {b} pages on Tuesday. "
          "How many pages did {he} read in all?"),
    "-": ("{name} has {a} {obj}. {He} gives {b} of them to {friend}. "
          "How many {obj} does {he} have left?",
          "There are {a} {obj} on the table. {name} takes {b} of them away. "
          "How many {obj} are still on the table?",
          "{name} has {a} {obj}. {friend} has {b} fewer {obj} than {name}. "
          "How many {obj} does {friend} have?",
          "{name} had {a} dollars. {He} spent {b} dollars on a {gift}. "
          "How many dollars does {he} have left?"),
    "*": ("{name} has {a} {box}. Each one holds {b} {obj}. How many {obj} does {he} have in all?",
          "There are {a} rows of {obj} with {b} {obj} in each row. "
          "How many {obj} are there altogether?",
          "{friend} has {a} {obj}. {name} has {b} times as many {obj} as {friend}. "
          "How many {obj} does {name} have?",
          "A {gift} costs {a} dollars. How many dollars do {b} of them cost?"),
    "/": ("{name} has {a} {obj}. {He} shares them equally among {b} friends. "
          "How many {obj} does each friend get?",
          "{name} puts {a} {obj} into {box}, with {b} {obj} in each. "
          "How many {box} does {he} fill?",
          "{a} {obj} are split equally into {b} rows. How many {obj} are in each row?",
          "{name} cycled {a} kilometers in {b} days, the same distance each day. "
          "How many kilometers did {he} cycle each day?"),
}

# Chains (levels 2..4): a start, one sentence per operation, a question.
_CHAIN_START = ("{name} has {a} {obj}.", "{name} starts the day with {a} {obj}.",
                "{name} keeps {a} {obj} in a box.")
_CHAIN_STEP = {
    "+": ("{He} buys {b} more.", "{friend} gives {him} {b} more.",
          "Then {he} finds {b} more {obj}."),
    "-": ("{He} gives {b} of them to {friend}.", "{He} loses {b} of them.",
          "Then {he} sells {b} of {his} {obj}."),
    "*": ("Then {he} has {b} times as many {obj} as before.",
          "{His} number of {obj} grows to {b} times what it was.",
          "{friend} gives {him} more {obj}, so that {he} has {b} times as many as before."),
    "/": ("{He} splits them into {b} equal piles and keeps only one pile.",
          "{He} shares them equally among {b} bags and keeps one bag.",
          "{He} divides them into {b} equal groups and gives away all groups but one."),
}
_CHAIN_QUESTION = ("How many {obj} does {he} have now?",
                   "How many {obj} does {name} have at the end?")


# ----------------------------------------------------------------------------- sampling

def sample_problem(rng: random.Random, *, types: Sequence[str] = (),
                   levels: Sequence[int] = (1,)) -> dict:
    """One problem record (see the module docstring): type uniform over ``types`` (empty = all of
    `PROBLEM_TYPES`), level uniform over ``levels``; a name repeated is drawn more often.

    Raises ValueError naming task.math_types / task.math_levels for unknown types or levels.
    """
    kinds = _check_types(types)
    levels = _check_levels(levels)
    kind = rng.choice(kinds)
    level = rng.choice(levels)
    ops = _draw_ops(rng, kind, level)
    operands = _draw_operands(rng, ops, _SIZES[level])
    return {"prompt": f"{_render(rng, ops, operands)}\n{ANSWER_INSTRUCTION}",
            "answer": str(_evaluate(ops, operands)), "type": kind, "level": level,
            "operands": operands, "ops": list(ops)}


def _check_types(types: Sequence[str]) -> tuple[str, ...]:
    if isinstance(types, str):
        raise ValueError(f"task.math_types: must be a list of type names, got the string {types!r}")
    unknown = [t for t in types if t not in PROBLEM_TYPES]
    if unknown:
        raise ValueError(f"task.math_types: unknown problem type(s) {unknown}; "
                         f"choose from {', '.join(PROBLEM_TYPES)} (empty = all)")
    return tuple(types) or PROBLEM_TYPES


def _check_levels(levels: Sequence[int]) -> tuple[int, ...]:
    bad = [lv for lv in levels if isinstance(lv, bool) or lv not in LEVELS]
    if bad or not levels:
        raise ValueError(f"task.math_levels: must be levels in 1..4, got {list(levels)}")
    return tuple(levels)


def _draw_ops(rng: random.Random, kind: str, level: int) -> tuple[str, ...]:
    if kind != "mixed":
        return (_KIND_OP[kind],) * level
    while True:  # at least two kinds from level 2 on; a redraw is needed 1 time in 4 at worst
        ops = tuple(rng.choice(_OPS) for _ in range(level))
        if level == 1 or len(set(ops)) > 1:
            return ops


def _draw_operands(rng: random.Random, ops: tuple[str, ...], size: _Size) -> list[int]:
    """``[start, x1, ..., xn]`` with every total in 1..max_value and every division exact."""
    n = len(ops)
    if len(set(ops)) > 1:
        return _mixed_operands(rng, ops, size)
    op = ops[0]
    if op == "+":
        return [rng.randint(2, size.max_term) for _ in range(n + 1)]
    if op == "-":  # an add chain backwards: the answer plus the terms taken away
        terms = [rng.randint(2, size.max_term) for _ in range(n)]
        return [rng.randint(1, size.max_term) + sum(terms)] + terms
    factors = _factors(rng, size, n + 1)
    if op == "*":
        return factors
    return [math.prod(factors)] + factors[1:]  # a mul chain backwards: the answer is factors[0]


def _factors(rng: random.Random, size: _Size, n: int) -> list[int]:
    """``n`` factors in 2..max_factor whose product is at most max_value, in random order."""
    factors: list[int] = []
    product = 1
    for remaining in range(n - 1, -1, -1):  # leave room for a factor of 2 per remaining draw
        f = rng.randint(2, min(size.max_factor, size.max_value // (product * 2 ** remaining)))
        factors.append(f)
        product *= f
    rng.shuffle(factors)  # the room-keeping squeezes the last draws; spread that over positions
    return factors


def _mixed_operands(rng: random.Random, ops: tuple[str, ...], size: _Size) -> list[int]:
    for _ in range(_MAX_TRIES):
        operands = [rng.randint(2, size.max_term)]
        total = operands[0]
        for op in ops:
            choices = _step_choices(op, total, size)
            if not choices:
                break
            operands.append(rng.choice(choices))
            total = _APPLY[op](total, operands[-1])
        else:
            return operands
    raise AssertionError(f"no operands for {ops} in {_MAX_TRIES} tries")


def _step_choices(op: str, total: int, size: _Size) -> Sequence[int]:
    """Operands of ``op`` that keep ``total`` a whole number in 1..max_value."""
    if op == "+":
        return range(2, min(size.max_term, size.max_value - total) + 1)
    if op == "-":
        return range(2, min(size.max_term, total - 1) + 1)
    if op == "*":
        return range(2, min(size.max_factor, size.max_value // total) + 1)
    return [d for d in range(2, size.max_factor + 1) if total % d == 0]


def _evaluate(ops: tuple[str, ...], operands: list[int]) -> int:
    total = operands[0]
    for op, x in zip(ops, operands[1:]):
        assert op != "/" or total % x == 0, (ops, operands)
        total = _APPLY[op](total, x)
    assert 1 <= total, (ops, operands)
    return total


# ----------------------------------------------------------------------------- rendering

def _render(rng: random.Random, ops: tuple[str, ...], operands: list[int]) -> str:
    (name, pronoun), (friend, _) = rng.sample(_NAMES, 2)
    He, he, him, His, his = _PRONOUNS[pronoun]
    fields = {"name": name, "friend": friend, "He": He, "he": he, "him": him, "His": His,
              "his": his, "obj": rng.choice(_OBJECTS), "box": rng.choice(_BOXES),
              "gift": rng.choice(_GIFTS)}
    if len(ops) == 1:
        return rng.choice(_ONE_STEP[ops[0]]).format(a=operands[0], b=operands[1], **fields)
    sentences = [rng.choice(_CHAIN_START).format(a=operands[0], **fields)]
    sentences += [rng.choice(_CHAIN_STEP[op]).format(b=x, **fields)
                  for op, x in zip(ops, operands[1:])]
    sentences.append(rng.choice(_CHAIN_QUESTION).format(**fields))
    return " ".join(sentences)
