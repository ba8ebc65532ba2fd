"""Task families: exact verifiers, long-tailed lengths, differing entropy, clean encoding."""

import random
import statistics

import pytest

from cospec.config import TaskConfig
from cospec.rl.tasks import FAMILIES, Example, TaskSuite
from cospec.rl.tokenizer import EOS, UNK, CharTokenizer

SUITE = TaskSuite(TaskConfig())
TOK = CharTokenizer()


def many(family, n=500, seed=0):
    rng = random.Random(seed)
    return [SUITE.sample_family(family, rng) for _ in range(n)]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_reference_answer_always_earns_full_reward(family):
    assert all(SUITE.reward(e, e.answer) == 1.0 for e in many(family))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_truncated_or_extended_answers_earn_nothing(family):
    for e in many(family, 200):
        assert SUITE.reward(e, e.answer[:-1]) == 0.0
        assert SUITE.reward(e, e.answer + "a") == 0.0


def test_verifiers_are_exact_on_hand_made_cases():
    add = Example("add", "add:999+1=", "1000")
    assert SUITE.reward(add, "1000") == 1.0 and SUITE.reward(add, "0100") == 0.0
    srt = Example("sort", "sort:dbca=", "abcd")
    assert SUITE.reward(srt, "abcd") == 1.0 and SUITE.reward(srt, "abdc") == 0.0
    perm = Example("perm", "perm:aab=", "aba", {"letters": "aab"})
    assert [SUITE.reward(perm, r) for r in ("aab", "aba", "baa", "abb", "ab", "aabb")] == [1, 1, 1, 0, 0, 0]


def test_perm_has_many_valid_answers_per_prompt():
    e = next(e for e in many("perm") if len(set(e.meta["letters"])) >= 6)
    rng = random.Random(1)
    answers = {"".join(rng.sample(e.meta["letters"], len(e.meta["letters"]))) for _ in range(200)}
    assert len(answers) > 50
    assert all(SUITE.reward(e, a) == 1.0 for a in answers)


def test_copy_lengths_have_a_long_tail():
    lengths = sorted(len(e.answer) for e in many("copy", 2000))
    median, p99 = statistics.median(lengths), lengths[int(0.99 * len(lengths))]
    assert p99 >= 3 * median
    assert max(lengths) <= 40


def test_sampling_is_deterministic_given_the_seed():
    a = [SUITE.sample(random.Random(7)) for _ in range(3)]
    b = [SUITE.sample(random.Random(7)) for _ in range(3)]
    assert a == b


def test_family_weights_are_respected():
    suite = TaskSuite(TaskConfig(families=("copy", "add"), weights=(3.0, 1.0)))
    rng = random.Random(0)
    share = sum(suite.sample(rng).family == "copy" for _ in range(4000)) / 4000
    assert abs(share - 0.75) < 0.03


def test_unknown_family_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown.*nope"):
        TaskSuite(TaskConfig(families=("copy", "nope")))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_examples_encode_without_unknown_tokens_and_fit_128_tokens(family):
    for e in many(family):
        ids, mask = SUITE.encode_sft(e, TOK)
        assert UNK not in ids and len(ids) <= 128
        assert TOK.decode(ids[ids.index(EOS) - len(e.answer):]) == e.answer


def test_sft_loss_mask_covers_exactly_the_answer_and_eos():
    e = Example("add", "add:1+2=", "3")
    ids, mask = SUITE.encode_sft(e, TOK)
    assert len(ids) == 1 + len("add:1+2=") + 1 + 1
    assert mask == [0] * 9 + [1, 1] and ids[-1] == EOS
    assert SUITE.encode_prompt(e, TOK) == ids[:9]
