"""Task families whose answers are worked solutions: the steps first, then ``>`` and the result.

Why: in LLM RL a rollout is a chain of reasoning of tens to hundreds of tokens, and generating it
is most of the step. The short families of `cospec.data.tasks` answer in ~6 characters, so there
prefill and the overshoot past EOS dominate and speculation has nothing to win. These families
write every intermediate step, so responses run ~10-150 characters with a long tail (`selsort`),
each step is a small local computation a 4M-parameter char model can learn (a column of an
addition, a digit of a product, one selection, one operation), and the reward still checks only
the final result, as an LLM answer verifier does.

Each answer is a list of steps, each ending in ``,``, then ``>`` and the result:

- ``carry``   ("carry:478+56=") adds column by column from the right, writing digit + digit +
  carry-in = column sum: "8+6+0=14,7+5+1=13,4+0+1=5,>534". Operands of 1-4 digits.
- ``mul``     ("mul:473x6=") multiplies by one digit, digit by digit from the right:
  "3x6+0=18,7x6+1=43,4x6+4=28,>2838". Multiplicands of 2-4 digits, multipliers 2-9.
- ``selsort`` ("selsort:dbxa=") sorts by repeated selection: each step writes the smallest
  remaining letter, ``:``, and the letters left after removing it (in prompt order; the letters
  are distinct):
  "a:dbx,b:dx,d:x,x:,>abdx". n letters make about n^2/2 + 3n characters; n is 3 plus a geometric
  draw of mean 3, capped at 14, so most answers are short and a few run to ~150 (the tail).
- ``eval``    ("eval:12+7-5=") evaluates + and - left to right, a two-digit start and distinct
  one-digit operands, writing each partial result: "12+7=19,19-5=14,>14". 3-7 operations; a
  subtraction is drawn only when the running value stays >= 0.

Reward (`reward`): 1.0 when the text after the response's last ``>`` is exactly the result, else 0;
the steps are not graded (a response that skips them and is right earns 1, as with a math
verifier). Lengths: the longest prompt is "selsort:" + 14 letters + "=" (23 characters), the
longest answer 148 characters, so an example with BOS and EOS fits 176 tokens.
"""

from __future__ import annotations

import math
import random
import string

from cospec.data.task_family import Example, TaskFamily


def final_result(response: str) -> str | None:
    """The text after the last ``>`` of a worked solution, None when there is no ``>``."""
    head, sep, tail = response.rpartition(">")
    return tail if sep else None


class WorkedSolution(TaskFamily):
    """A family whose reward checks only the result after the last ``>``; meta["result"] holds it."""

    def reward(self, example: Example, response: str) -> float:
        return float(final_result(response) == example.meta["result"])


def _digits(rng: random.Random, lo: int, hi: int) -> int:
    """A number with a uniformly drawn digit count in [lo, hi], so short ones are as common."""
    n = rng.randint(lo, hi)
    return rng.randrange(10 ** (n - 1) if n > 1 else 0, 10 ** n)


class Carry(WorkedSolution):
    name = "carry"

    def __init__(self, max_digits: int = 4):
        self.max_digits = max_digits

    def sample(self, rng: random.Random) -> Example:
        return self.solve(_digits(rng, 1, self.max_digits), _digits(rng, 1, self.max_digits))

    @classmethod
    def solve(cls, a: int, b: int) -> Example:
        """a + b worked column by column: solve(478, 56).answer == "8+6+0=14,7+5+1=13,4+0+1=5,>534"."""
        da, db = str(a)[::-1], str(b)[::-1]
        steps, carry = [], 0
        for i in range(max(len(da), len(db))):
            x, y = int(da[i]) if i < len(da) else 0, int(db[i]) if i < len(db) else 0
            s = x + y + carry
            steps.append(f"{x}+{y}+{carry}={s},")
            carry = s // 10
        result = str(a + b)
        return Example(cls.name, f"carry:{a}+{b}=", "".join(steps) + ">" + result, {"result": result})


class Mul(WorkedSolution):
    name = "mul"

    def __init__(self, max_digits: int = 4):
        self.max_digits = max_digits

    def sample(self, rng: random.Random) -> Example:
        return self.solve(_digits(rng, 2, self.max_digits), rng.randint(2, 9))

    @classmethod
    def solve(cls, a: int, m: int) -> Example:
        """a x m worked digit by digit: solve(473, 6).answer == "3x6+0=18,7x6+1=43,4x6+4=28,>2838"."""
        steps, carry = [], 0
        for d in str(a)[::-1]:
            s = int(d) * m + carry
            steps.append(f"{d}x{m}+{carry}={s},")
            carry = s // 10
        result = str(a * m)
        return Example(cls.name, f"mul:{a}x{m}=", "".join(steps) + ">" + result, {"result": result})


class SelectionSort(WorkedSolution):
    name = "selsort"

    def __init__(self, min_len: int = 3, mean_extra: float = 3.0, max_len: int = 14):
        self.min_len, self.mean_extra, self.max_len = min_len, mean_extra, max_len

    def sample(self, rng: random.Random) -> Example:
        # Geometric extra length on 0, 1, ... with the given mean, by inversion (P(k > j) =
        # (1 - p)^(j+1) with p = 1 / (1 + mean)): the long tail of the default workload.
        p = 1.0 / (1.0 + self.mean_extra)
        extra = int(math.log(1.0 - rng.random()) / math.log(1.0 - p))
        # distinct letters: each step copies the previous rest but one, and a small model finds
        # where it is in a copy by content, which repeated letters make ambiguous
        return self.solve("".join(rng.sample(string.ascii_lowercase,
                                             min(self.max_len, self.min_len + extra))))

    @classmethod
    def solve(cls, letters: str) -> Example:
        """Sorted by repeated selection: solve("dbxa").answer == "a:dbx,b:dx,d:x,x:,>abdx"."""
        rest, steps = list(letters), []
        while rest:
            smallest = min(rest)
            rest.remove(smallest)  # the rest keeps prompt order
            steps.append(f"{smallest}:{''.join(rest)},")
        result = "".join(sorted(letters))
        return Example(cls.name, f"selsort:{letters}=", "".join(steps) + ">" + result,
                       {"result": result})


class Eval(WorkedSolution):
    name = "eval"

    def __init__(self, min_ops: int = 3, max_ops: int = 7):
        self.min_ops, self.max_ops = min_ops, max_ops

    def sample(self, rng: random.Random) -> Example:
        start = value = rng.randrange(10, 100)
        ops = []
        # distinct operands, for the reason selsort's letters are distinct: each step finds its
        # operand right after the previous one in the prompt, by content
        for x in rng.sample(range(1, 10), rng.randint(self.min_ops, self.max_ops)):
            op = "-" if x <= value and rng.random() < 0.5 else "+"
            value = value - x if op == "-" else value + x
            ops.append((op, x))
        return self.solve(start, ops)

    @classmethod
    def solve(cls, start: int, ops: list[tuple[str, int]]) -> Example:
        """Left to right: solve(12, [("+", 7), ("-", 5)]).answer == "12+7=19,19-5=14,>14"."""
        value, expr, steps = start, str(start), []
        for op, x in ops:
            new = value - x if op == "-" else value + x
            expr += f"{op}{x}"
            steps.append(f"{value}{op}{x}={new},")
            value = new
        result = str(value)
        return Example(cls.name, f"eval:{expr}=", "".join(steps) + ">" + result, {"result": result})


WORKED_FAMILIES: tuple[type[TaskFamily], ...] = (Carry, Mul, SelectionSort, Eval)
