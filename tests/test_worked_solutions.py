"""Worked-solution families: every step is right, the result after the last '>' is what is
rewarded, and the lengths have the long tail the default workload is for."""

import random
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cospec.config import ModelConfig, SamplingConfig, TaskConfig
from cospec.data.tasks import TaskSuite, encode_sft
from cospec.data.tokenizer import UNK, CharTokenizer
from cospec.data.worked_solutions import (WORKED_FAMILIES, Carry, Eval, Mul, SelectionSort,
                                          final_result)
from cospec.models.block_draft import BlockDraft
from cospec.models.draft import Eagle3Draft
from cospec.models.llama import Transformer
from cospec.rollout.engine import GenerationEngine
from cospec.rollout.speculative import SpeculativeEngine

WORKED = [f.name for f in WORKED_FAMILIES]
SUITE = TaskSuite(TaskConfig(families=tuple(WORKED)))
TOK = CharTokenizer()


def many(family, n=500, seed=0):
    rng = random.Random(seed)
    return [SUITE.sample_family(family, rng) for _ in range(n)]


def steps_of(answer: str) -> list[str]:
    """The steps of a worked answer (each ended by ','), without the result."""
    return answer.rpartition(">")[0].split(",")[:-1]


def test_the_default_suite_is_the_worked_families():
    assert TaskSuite(TaskConfig()).family_names == ("carry", "mul", "selsort", "eval")


def test_worked_examples_by_hand():
    """The module docstring's examples, made by the generators' own solvers."""
    assert Carry.solve(478, 56).answer == "8+6+0=14,7+5+1=13,4+0+1=5,>534"
    assert Carry.solve(95, 7).answer == "5+7+0=12,9+0+1=10,>102"  # the last carry is the result's lead
    assert Mul.solve(473, 6).answer == "3x6+0=18,7x6+1=43,4x6+4=28,>2838"
    assert SelectionSort.solve("dbxa").answer == "a:dbx,b:dx,d:x,x:,>abdx"
    assert Eval.solve(12, [("+", 7), ("-", 5)]).answer == "12+7=19,19-5=14,>14"
    assert Eval.solve(12, [("+", 7), ("-", 5)]).prompt == "eval:12+7-5="
    assert steps_of("8+6+0=14,7+5+1=13,4+0+1=5,>534") == ["8+6+0=14", "7+5+1=13", "4+0+1=5"]
    assert final_result("a:dbx,b:dx,d:x,x:,>abdx") == "abdx" and final_result("abdx") is None


@pytest.mark.parametrize("family", WORKED)
def test_every_step_of_the_reference_is_right(family):
    """Each step is checked from the prompt by an independent reading of the format: the column
    sums of an addition, the digit products of a multiplication, the selections of a sort and the
    partial results of an evaluation are each recomputed with Python's own arithmetic."""
    for e in many(family, 300):
        body = e.prompt.split(":", 1)[1][:-1]
        steps = steps_of(e.answer)
        if family in ("carry", "mul"):
            a, b = body.split("+" if family == "carry" else "x")
            carry, digits = 0, []
            for i, step in enumerate(steps):
                lhs, s = step.split("=")
                x = int(a[::-1][i]) if i < len(a) else 0
                if family == "carry":
                    y = int(b[::-1][i]) if i < len(b) else 0
                    assert lhs == f"{x}+{y}+{carry}" and int(s) == x + y + carry
                else:
                    assert lhs == f"{x}x{b}+{carry}" and int(s) == x * int(b) + carry
                carry, digits = int(s) // 10, digits + [int(s) % 10]
            assert len(steps) == (len(a) if family == "mul" else max(len(a), len(b)))
            expected = int(a) + int(b) if family == "carry" else int(a) * int(b)
            assert final_result(e.answer) == str(expected)
            assert int(str(carry) + "".join(map(str, digits[::-1]))) == expected  # the steps give it
        elif family == "selsort":
            rest = body
            for step in steps:
                picked, left = step.split(":")
                assert picked == min(rest) and left == rest.replace(picked, "", 1)
                rest = left
            assert rest == "" and final_result(e.answer) == "".join(sorted(body))
            assert len(set(body)) == len(body)
        else:
            assert final_result(e.answer) == str(eval(body))  # + and - on integers only
            assert all(int(step.rpartition("=")[2]) >= 0 for step in steps)


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), family=st.sampled_from(WORKED), junk=st.text(max_size=30))
def test_only_the_result_after_the_last_arrow_is_rewarded(seed, family, junk):
    e = SUITE.sample_family(family, random.Random(seed))
    result = e.meta["result"]
    assert SUITE.reward(e, e.answer) == 1.0
    assert SUITE.reward(e, ">" + result) == 1.0  # skipping the steps is not penalised
    assert SUITE.reward(e, junk.replace(">", "") + ">" + result) == 1.0
    assert SUITE.reward(e, e.answer + "0") == 0.0
    assert SUITE.reward(e, e.answer + ">" + result + "x") == 0.0  # the LAST arrow counts
    assert SUITE.reward(e, result) == 0.0  # no arrow, no result
    assert SUITE.reward(e, e.answer[:-1]) == 0.0


def test_the_workload_is_long_and_ragged():
    """Responses of ~40 characters on average, not ~6; the selection sort gives the tail."""
    lengths = {f: [len(e.answer) for e in many(f, 2000)] for f in WORKED}
    everything = sorted(n for v in lengths.values() for n in v)
    assert 30 <= statistics.mean(everything) <= 55
    assert everything[len(everything) // 10] >= 12
    assert everything[-1] >= 120 and max(lengths["selsort"]) == everything[-1]
    assert statistics.quantiles(lengths["selsort"], n=10)[-1] >= 2 * statistics.median(lengths["selsort"])


@pytest.mark.parametrize("family", WORKED)
def test_worked_examples_encode_cleanly_and_fit_176_tokens(family):
    for e in many(family, 2000):
        ids, mask = encode_sft(e, TOK)
        assert UNK not in ids and len(ids) <= 176
        assert sum(mask) == len(e.answer) + 1


@pytest.mark.parametrize("draft_kind", ["eagle3", "block"])
def test_greedy_speculation_equals_plain_decoding_on_worked_prompts_at_full_length(draft_kind):
    """The default workload's prompts with room for its longest answers (160 new tokens): a random
    policy rarely stops, so rows run to the length cap, and the speculative engine (a random draft:
    rejections at every position) must give plain decoding's tokens and logprobs exactly."""
    torch.manual_seed(0)
    policy = Transformer(ModelConfig(vocab_size=50, hidden_size=64, num_layers=4, num_heads=4,
                                     num_kv_heads=2, intermediate_size=128, max_seq_len=192)).eval()
    draft = (Eagle3Draft if draft_kind == "eagle3" else BlockDraft).from_policy(policy).eval()
    rng = random.Random(5)
    prompts = [TOK.encode(SUITE.sample(rng).prompt, bos=True) for _ in range(6)]
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=160)
    plain = GenerationEngine(policy, batch_size=4).generate(prompts, greedy)
    spec = SpeculativeEngine(policy, draft, batch_size=4, gamma=4).generate(prompts, greedy)
    assert max(len(c.tokens) for c in plain.completions) == 160
    for a, b in zip(plain.completions, spec.completions):
        assert (b.tokens, b.finish_reason) == (a.tokens, a.finish_reason)
        torch.testing.assert_close(b.logprobs, a.logprobs, atol=1e-4, rtol=0)
