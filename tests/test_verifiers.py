"""Specification of cospec.data.verifiers: the final number of a response, the math and exact
verifiers, and loading a verifier (built-in or module:function plug-in) from task.verifier."""

import sys
import textwrap

import pytest

from cospec.data.verifiers import (exact_verifier, extract_final_number, load_verifier,
                                   math_verifier)

TWELVE = {"answer": "12"}

# (response, reward against the answer "12"); each row is one way a model writes, or fails to.
MATH_CASES = [
    ("Answer: 12", 1.0),
    ("\\boxed{12}", 1.0),
    ("12.0", 1.0),
    ("twelve", 0.0),
    ("I do not know.", 0.0),
    ("", 0.0),
    # the Answer line wins over numbers after it and over an earlier box
    ("5 + 7 = 12\nAnswer: 12\nThat used 2 steps.", 1.0),
    ("\\boxed{11}\nAnswer: 12", 1.0),
    ("Answer: 11\nWait, I made a mistake.\nAnswer: 12", 1.0),
    ("Answer: 12\nHmm, no.\nAnswer: 13", 0.0),
    # decorations around the Answer line
    ("**Answer:** 12", 1.0),
    ("**Answer: 12**", 1.0),
    ("answer: 12", 1.0),
    ("ANSWER:12", 1.0),
    ("Final Answer: $12", 1.0),
    ("Answer: 12.", 1.0),
    ("Answer: 12 apples", 1.0),
    ("The answer is 12.", 1.0),
    ("Answer = 12", 1.0),
    # the box beats the last number
    ("So the total is \\boxed{12} after 3 steps", 1.0),
    ("\\boxed{ 12 }", 1.0),
    # the last number, when nothing marks the answer
    ("7 + 5 = 12", 1.0),
    ("She has 12 apples.", 1.0),
    ("12 apples minus 1 apple", 0.0),
    ("12 or 13", 0.0),
    ("Answer: N", 0.0),
    ("The answer is twelve.", 0.0),
]


@pytest.mark.parametrize("response, reward", MATH_CASES)
def test_math_verifier_rewards_the_final_number(response, reward):
    assert math_verifier(TWELVE, response) == reward


# (text, the number extracted)
NUMBER_CASES = [
    ("Answer: 1,200", 1200.0),
    ("Answer: 1,234,567", 1234567.0),
    ("Answer: -5", -5.0),
    ("Answer: \u22125", -5.0),  # a Unicode minus sign
    ("Answer: 3.75", 3.75),
    ("Answer: $2.50", 2.5),
    ("\\boxed{-3}", -3.0),
    ("\\boxed{1,000}", 1000.0),
    ("from 3-5 people", 5.0),  # a range, not minus five
    ("10 - 3 = 7", 7.0),
    ("1,2345", 2345.0),  # not a thousands separator: two numbers
    ("costs $12.", 12.0),
    ("v2", None),  # a digit inside a word is not a number
    ("twelve", None),
    ("no numbers here", None),
]


@pytest.mark.parametrize("text, number", NUMBER_CASES)
def test_extract_final_number(text, number):
    assert extract_final_number(text) == number


def test_math_verifier_compares_numbers_not_text():
    assert math_verifier({"answer": "1200"}, "Answer: 1,200.0") == 1.0
    assert math_verifier({"answer": "12.0"}, "Answer: 12") == 1.0
    assert math_verifier({"answer": "-3"}, "Answer: -3") == 1.0
    assert math_verifier({"answer": "-3"}, "Answer: 3") == 0.0
    assert math_verifier({"answer": "0.1"}, "Answer: 0.1000000001") == 1.0  # within 1e-6 relative
    assert math_verifier({"answer": "1000000"}, "Answer: 1000002") == 0.0  # 2e-6 is not within


def test_math_verifier_rejects_a_record_whose_answer_is_not_a_number():
    with pytest.raises(ValueError, match="task.verifier=math: answer 'Paris' is not a number"):
        math_verifier({"answer": "Paris"}, "Answer: 12")


@pytest.mark.parametrize("response, reward", [
    ("Paris", 1.0), ("  Paris\n", 1.0), ("paris", 0.0), ("Paris.", 0.0),
    ("The answer is Paris", 0.0),
])
def test_exact_verifier_compares_stripped_text(response, reward):
    assert exact_verifier({"answer": " Paris "}, response) == reward


# ----------------------------------------------------------------------------- load_verifier

def test_builtin_verifiers_load_by_name():
    assert load_verifier("math") is math_verifier
    assert load_verifier("exact") is exact_verifier


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    """A directory on sys.path holding a module `cospec_test_plugin` of small verifiers."""
    (tmp_path / "cospec_test_plugin.py").write_text(textwrap.dedent("""
        def half_credit(record, response):
            return 0.5 if record["hint"] in response else 0.0

        def says_yes(record, response):
            return response == "yes"

        def returns_text(record, response):
            return "1.0"

        def returns_nothing(record, response):
            return None

        NOT_CALLABLE = 3
    """))
    (tmp_path / "cospec_test_broken.py").write_text("import no_such_module_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in ("cospec_test_plugin", "cospec_test_broken"):
        sys.modules.pop(name, None)


def test_a_plugin_is_called_with_the_record_and_the_response(plugin_dir):
    verify = load_verifier("cospec_test_plugin:half_credit")
    assert verify({"answer": "1", "hint": "carry"}, "I carry the one") == 0.5
    assert verify({"answer": "1", "hint": "carry"}, "no idea") == 0.0


def test_a_plugin_returning_a_bool_gives_a_float(plugin_dir):
    reward = load_verifier("cospec_test_plugin:says_yes")({"answer": "y"}, "yes")
    assert reward == 1.0 and type(reward) is float


@pytest.mark.parametrize("name", ["returns_text", "returns_nothing"])
def test_a_plugin_that_returns_no_number_fails_when_called(plugin_dir, name):
    verify = load_verifier(f"cospec_test_plugin:{name}")
    with pytest.raises(TypeError, match=f"task.verifier='cospec_test_plugin:{name}' returned"):
        verify({"answer": "1"}, "1")


def test_a_stdlib_callable_is_a_plugin_too():
    # operator.contains(record, response): 1.0 when the response is one of the record's keys
    assert load_verifier("operator:contains")({"answer": "1"}, "answer") == 1.0


@pytest.mark.parametrize("spec, message", [
    ("exactly", "must be math, exact or module:function"),
    (":fn", "must be math, exact or module:function"),
    ("mod:", "must be math, exact or module:function"),
    ("a:b:c", "must be math, exact or module:function"),
    ("no_such_module_anywhere:fn", "cannot import module 'no_such_module_anywhere'"),
    ("cospec_test_broken:fn", "cannot import module 'cospec_test_broken' \\(ModuleNotFoundError"),
    ("cospec_test_plugin:missing", "module 'cospec_test_plugin' has no attribute 'missing'"),
    ("cospec_test_plugin:NOT_CALLABLE", "'NOT_CALLABLE' is not callable \\(int\\)"),
])
def test_a_bad_spec_is_a_value_error_naming_task_verifier(plugin_dir, spec, message):
    with pytest.raises(ValueError, match=f"^task.verifier='{spec}': {message}"):
        load_verifier(spec)
