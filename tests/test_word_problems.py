"""Specification of cospec.data.word_problems: a seeded stream of arithmetic word problems whose
answers are right, whose types and levels are what was asked for, and whose wording varies.

Answers are checked by a second route: the numbers are read back out of the prompt text and the
record's operations applied to them in exact rational arithmetic (the generator uses integers)."""

import json
import operator
import random
import re
from fractions import Fraction

import pytest

from cospec.data.word_problems import (ANSWER_INSTRUCTION, LEVELS, PROBLEM_TYPES, _BOXES, _GIFTS,
                                       _NAMES, _OBJECTS, sample_problem)

KIND_OP = {"add": "+", "sub": "-", "mul": "*", "div": "/"}
EXACT = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}


def problems(n, seed=0, **kw):
    rng = random.Random(seed)
    return [sample_problem(rng, **kw) for _ in range(n)]


ALL = problems(3000, types=(), levels=LEVELS)


def story(record):
    """The prompt without the closing instruction."""
    assert record["prompt"].endswith("\n" + ANSWER_INSTRUCTION)
    return record["prompt"].removesuffix("\n" + ANSWER_INSTRUCTION)


def test_a_seed_fixes_the_stream():
    assert problems(50, seed=7, levels=LEVELS) == problems(50, seed=7, levels=LEVELS)
    assert problems(50, seed=7, levels=LEVELS) != problems(50, seed=8, levels=LEVELS)


def test_a_record_has_the_documented_fields_and_is_json():
    record = ALL[0]
    assert set(record) == {"prompt", "answer", "type", "level", "operands", "ops"}
    assert json.loads(json.dumps(record)) == record


def test_the_numbers_in_the_prompt_are_the_operands_in_order():
    for record in ALL:
        assert [int(x) for x in re.findall(r"\d+", story(record))] == record["operands"]


def test_every_answer_is_the_operations_applied_left_to_right():
    for record in ALL:
        numbers = [Fraction(x) for x in re.findall(r"\d+", story(record))]
        total = numbers[0]
        for op, x in zip(record["ops"], numbers[1:]):
            total = EXACT[op](total, x)
            # every step leaves a whole, positive amount: no exact-division or negative-count slips
            assert total.denominator == 1 and total >= 1, record
        assert record["answer"] == str(total.numerator)


def test_every_operand_is_at_least_two():  # so the text never says "1 apples"
    assert min(min(r["operands"]) for r in ALL) == 2


def test_the_prompt_ends_with_the_answer_instruction_which_holds_no_number():
    assert all(r["prompt"].endswith(ANSWER_INSTRUCTION) for r in ALL)
    assert '"Answer: "' in ANSWER_INSTRUCTION and not re.search(r"\d", ANSWER_INSTRUCTION)


# ----------------------------------------------------------------------------- types and levels

def test_types_and_levels_are_drawn_from_those_asked_for_and_all_of_them():
    drawn = problems(400, types=("sub", "div"), levels=(2, 4))
    assert {r["type"] for r in drawn} == {"sub", "div"}
    assert {r["level"] for r in drawn} == {2, 4}
    assert {r["type"] for r in ALL} == set(PROBLEM_TYPES)
    assert {r["level"] for r in ALL} == set(LEVELS)


def test_the_default_is_all_types_at_level_one():
    drawn = problems(300)
    assert {r["type"] for r in drawn} == set(PROBLEM_TYPES) and {r["level"] for r in drawn} == {1}


def test_level_is_the_number_of_operations():
    assert all(len(r["ops"]) == r["level"] == len(r["operands"]) - 1 for r in ALL)


@pytest.mark.parametrize("kind", ["add", "sub", "mul", "div"])
def test_a_single_operation_type_uses_only_its_operation(kind):
    assert {op for r in ALL if r["type"] == kind for op in r["ops"]} == {KIND_OP[kind]}


def test_mixed_chains_use_at_least_two_kinds_of_operation_and_all_four_overall():
    mixed = [r for r in ALL if r["type"] == "mixed"]
    assert all(len(set(r["ops"])) >= 2 for r in mixed if r["level"] >= 2)
    assert {op for r in mixed for op in r["ops"]} == {"+", "-", "*", "/"}
    assert {r["ops"][0] for r in mixed if r["level"] == 1} == {"+", "-", "*", "/"}


def test_level_one_numbers_are_small_and_numbers_grow_with_the_level():
    def largest(r):
        return max(r["operands"] + [int(r["answer"])])

    assert max(largest(r) for r in ALL if r["level"] == 1) <= 100
    medians = []
    for lv in LEVELS:
        sizes = sorted(largest(r) for r in ALL if r["level"] == lv)
        medians.append(sizes[len(sizes) // 2])
    assert medians == sorted(set(medians)) and medians[0] * 10 < medians[-1], medians


# ----------------------------------------------------------------------------- wording

def shape(record):
    """The wording with numbers, names, pronouns and nouns masked: which template it came from."""
    words = {n for n, _ in _NAMES} | set(_OBJECTS) | set(_BOXES) | set(_GIFTS)
    masked = re.sub(r"\d+", "#", story(record))
    for w in sorted(words, key=len, reverse=True):  # "toy cars" before "cars"
        masked = re.sub(rf"\b{w}\b", "X", masked)
    return re.sub(r"\b(He|She|he|she|him|her|His|Her|his)\b", "P", masked)


@pytest.mark.parametrize("kind", ["add", "sub", "mul", "div"])
def test_each_type_has_several_wordings_and_varied_names_and_objects(kind):
    one_step = problems(300, types=(kind,), levels=(1,))
    assert len({shape(r) for r in one_step}) >= 4
    assert len({story(r).split()[0] for r in one_step}) >= 5  # names (and "There", "A", ...)
    chains = problems(300, types=(kind,), levels=(3,))
    assert len({shape(r) for r in chains}) >= 20
    text = " ".join(story(r) for r in one_step)
    assert sum(f" {obj}" in text for obj in _OBJECTS) >= 10


# ----------------------------------------------------------------------------- validation

@pytest.mark.parametrize("types", [("add", "plus"), ("Add",), "add"])
def test_unknown_types_name_task_math_types(types):
    with pytest.raises(ValueError, match="task.math_types"):
        sample_problem(random.Random(0), types=types)


@pytest.mark.parametrize("levels", [(), (0,), (1, 5), (True,), ("1",)])
def test_bad_levels_name_task_math_levels(levels):
    with pytest.raises(ValueError, match="task.math_levels"):
        sample_problem(random.Random(0), levels=levels)
