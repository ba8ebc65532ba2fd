"""Verifiers for text prompts (``task.verifier``): score a decoded response against a record.

A verifier is any callable ``fn(record, response) -> float``: ``record`` is the prompt record as
the prompt source made it (a cospec.data.word_problems problem or a cospec.data.jsonl line, with
at least "answer" as a string; any extra fields of the line are there too), ``response`` is the
decoded response text, everything before EOS. It returns the reward, a float (1.0 / 0.0 for the
built-ins; a plug-in may give partial credit). `load_verifier` turns the config string into one:

- ``math``  the response's final number (`extract_final_number`) equals float(answer) within a
            relative 1e-6, so "12.0" and "1,200" match "12" and "1200"
- ``exact`` the stripped response equals the stripped answer
- ``module:function``  a plug-in, imported with importlib; e.g. ``mytasks.scoring:score`` with
            ``def score(record: dict, response: str) -> float``. Its result is checked: anything
            but a finite real number (a bool counts, as 1.0 / 0.0) raises TypeError naming the
            spec.
"""

from __future__ import annotations

import functools
import importlib
import math
import numbers
import re
from collections.abc import Callable

Verifier = Callable[[dict, str], float]

# A number as written in a response: optional minus (not after a word character, so "3-5" is 3
# then 5, and a hyphenated range is not a negative), thousands commas in groups of three (the
# lookahead rejects "1,2345"), optional decimals ("12." stops before the period).
_NUMBER = r"(?<![\w.])[-\u2212]?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
# "Answer: 12", "**Answer:** 12", "answer = $12", "Final answer: -3.5"; markdown emphasis and a
# dollar sign may sit between the word and the number. "The answer is 12" counts too.
_ANSWER_RE = re.compile(r"\banswer\b[\s*_]*(?::|=|\bis\b)[\s*_]*\\?\$?\s*(" + _NUMBER + ")",
                        re.IGNORECASE)
_BOXED_RE = re.compile(r"\\boxed\s*\{\s*\\?\$?\s*(" + _NUMBER + ")")


def extract_final_number(text: str) -> float | None:
    """The response's final numeric answer: the number of the last "Answer: N", else of the last
    ``\\boxed{N}``, else the last number in the text; None when there is none. Number words
    ("twelve") are not numbers.
    """
    for pattern in (_ANSWER_RE, _BOXED_RE):
        found = pattern.findall(text)
        if found:
            return _to_float(found[-1])
    found = _NUMBER_RE.findall(text)
    return _to_float(found[-1]) if found else None


def _to_float(number: str) -> float:
    return float(number.replace(",", "").replace("\u2212", "-"))


def math_verifier(record: dict, response: str) -> float:
    """1.0 when the response's final number equals the record's answer (relative 1e-6), else 0.0.

    Raises ValueError when the record's answer is not a number (score such a file with ``exact``
    or a plug-in).
    """
    target = _answer_number(record["answer"])
    got = extract_final_number(response)
    return float(got is not None and math.isclose(got, target, rel_tol=1e-6))


def _answer_number(answer: object) -> float:
    try:  # float() also takes what a data file may hold beyond a response's grammar: "+5", "1e3"
        value = _to_float(str(answer).strip())
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise ValueError(f"task.verifier=math: answer {answer!r} is not a number; "
                         "use task.verifier=exact or a module:function plug-in")
    return value


def exact_verifier(record: dict, response: str) -> float:
    """1.0 when the stripped response equals the stripped answer, else 0.0."""
    return float(response.strip() == str(record["answer"]).strip())


_BUILTIN: dict[str, Verifier] = {"math": math_verifier, "exact": exact_verifier}


def load_verifier(spec: str) -> Verifier:
    """The verifier ``task.verifier`` names: "math", "exact" or "module:function" (see the module
    docstring). Raises ValueError naming task.verifier when the spec is malformed, the module does
    not import, or the attribute is missing or not callable.
    """
    if spec in _BUILTIN:
        return _BUILTIN[spec]
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name.strip() or not attr.strip() or ":" in attr:
        raise ValueError(f"task.verifier={spec!r}: must be math, exact or module:function")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # a plug-in may fail in any way while importing; say which spec
        raise ValueError(f"task.verifier={spec!r}: cannot import module {module_name!r} "
                         f"({type(exc).__name__}: {exc})") from exc
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"task.verifier={spec!r}: module {module_name!r} "
                         f"has no attribute {attr!r}")
    if not callable(fn):
        raise ValueError(f"task.verifier={spec!r}: {attr!r} is not callable "
                         f"({type(fn).__name__})")
    return _checked(fn, spec)


def _checked(fn: Callable, spec: str) -> Verifier:
    """``fn`` with its result checked to be a real number, returned as a float."""

    @functools.wraps(fn)
    def verifier(record: dict, response: str) -> float:
        reward = fn(record, response)
        # A bool is a Real, so "return got == want" works; None, a string or NaN is a bug.
        if not isinstance(reward, numbers.Real) or not math.isfinite(reward):
            raise TypeError(f"task.verifier={spec!r} returned {reward!r} "
                            f"({type(reward).__name__}); a verifier must return a finite float")
        return float(reward)

    return verifier
