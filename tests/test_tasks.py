"""The short task families (copy, add, sort, perm; the worked-solution families have their own
tests): exact verifiers, long-tailed lengths, differing entropy, clean encoding."""

import itertools
import random
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cospec.config import TaskConfig
from cospec.data.tasks import FAMILIES, Example, Perm, TaskSuite, encode_prompt, encode_sft
from cospec.data.tokenizer import ALPHABET, BOS, EOS, UNK, CharTokenizer

SHORT = ["copy", "add", "sort", "perm"]
SUITE = TaskSuite(TaskConfig(families=tuple(SHORT)))
TOK = CharTokenizer()
EXACT = ["copy", "add", "sort"]  # families with exactly one correct answer per prompt


def many(family, n=500, seed=0):
    rng = random.Random(seed)
    return [SUITE.sample_family(family, rng) for _ in range(n)]


def test_every_family_is_known_by_name():
    assert list(FAMILIES) == SHORT + ["carry", "mul", "selsort", "eval"]


# ----------------------------------------------------------------------------- verifiers

@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), family=st.sampled_from(SHORT))
def test_the_reference_answer_always_earns_full_reward(seed, family):
    e = SUITE.sample_family(family, random.Random(seed))
    assert SUITE.reward(e, e.answer) == 1.0


@pytest.mark.parametrize("family", SHORT)
def test_truncated_or_extended_answers_earn_nothing(family):
    for e in many(family, 200):
        assert SUITE.reward(e, e.answer[:-1]) == 0.0
        assert SUITE.reward(e, e.answer + "a") == 0.0
        assert SUITE.reward(e, "") == 0.0


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), family=st.sampled_from(EXACT),
       response=st.text(alphabet=ALPHABET, max_size=12))
def test_exact_families_reward_only_the_reference_answer(seed, family, response):
    e = SUITE.sample_family(family, random.Random(seed))
    assert SUITE.reward(e, response) == float(response == e.answer)


def test_verifiers_are_exact_on_hand_made_cases():
    add = Example("add", "add:999+1=", "1000")
    assert [SUITE.reward(add, r) for r in ("1000", "0100", "01000", "100", "1000 ")] == [1, 0, 0, 0, 0]
    srt = Example("sort", "sort:dbca=", "abcd")
    assert SUITE.reward(srt, "abcd") == 1.0 and SUITE.reward(srt, "abdc") == 0.0
    cp = Example("copy", "copy:abc=", "abc")
    assert SUITE.reward(cp, "abc") == 1.0 and SUITE.reward(cp, "abcabc") == 0.0
    perm = Example("perm", "perm:aab=", "aba", {"letters": "aab"})
    assert [SUITE.reward(perm, r) for r in ("aab", "aba", "baa", "abb", "ab", "aabb")] == [1, 1, 1, 0, 0, 0]


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), data=st.data())
def test_perm_rewards_any_arrangement_and_nothing_else(seed, data):
    e = SUITE.sample_family("perm", random.Random(seed))
    letters = e.meta["letters"]
    arrangement = "".join(data.draw(st.permutations(letters)))
    assert SUITE.reward(e, arrangement) == 1.0
    # one letter swapped for another one changes the multiset: invalid
    i = data.draw(st.integers(0, len(arrangement) - 1))
    other = data.draw(st.sampled_from([c for c in ALPHABET if c != arrangement[i]]))
    assert SUITE.reward(e, arrangement[:i] + other + arrangement[i + 1:]) == 0.0


def test_rewarding_an_example_of_a_family_outside_the_suite_is_a_clear_error():
    suite = TaskSuite(TaskConfig(families=("copy",)))
    with pytest.raises(ValueError, match="'add' is not in this suite"):
        suite.reward(Example("add", "add:1+2=", "3"), "3")


# ----------------------------------------------------------------------------- entropy and length

def test_perm_has_many_valid_answers_per_prompt():
    examples = many("perm", 300)
    # enumerate every arrangement of a few prompts: the verifier accepts each, and they are many
    for e in [e for e in examples if len(e.meta["letters"]) == 6][:5]:
        answers = {"".join(p) for p in itertools.permutations(e.meta["letters"])}
        assert all(SUITE.reward(e, a) == 1.0 for a in answers)
        assert len(answers) == Perm.num_valid_answers(e.meta["letters"]) >= 180
    counts = [Perm.num_valid_answers(e.meta["letters"]) for e in examples]
    assert statistics.median(counts) >= 100


def test_perm_reference_answers_are_random_arrangements_not_a_canonical_order():
    # SFT must see a spread of valid answers (high entropy), not always sorted or as given
    examples = [e for e in many("perm", 2000) if len(e.meta["letters"]) >= 5]
    as_given = sum(e.answer == e.meta["letters"] for e in examples) / len(examples)
    in_order = sum(e.answer == "".join(sorted(e.meta["letters"])) for e in examples) / len(examples)
    assert as_given < 0.03 and in_order < 0.03


@pytest.mark.parametrize("family", EXACT)
def test_exact_families_give_the_same_answer_whenever_a_prompt_repeats(family):
    seen = {}
    for e in many(family, 3000):
        assert seen.setdefault(e.prompt, e.answer) == e.answer


def test_copy_lengths_have_a_long_tail():
    lengths = sorted(len(e.answer) for e in many("copy", 4000))
    median = statistics.median(lengths)
    p90, p99 = lengths[int(0.90 * len(lengths))], lengths[int(0.99 * len(lengths))]
    assert median <= 5 and p90 >= 2.5 * median and p99 >= 5 * median
    assert 30 <= max(lengths) <= 40


def test_the_suite_mixes_short_and_long_answers():
    rng = random.Random(3)
    lengths = sorted(len(SUITE.sample(rng).answer) for _ in range(4000))
    assert lengths[0] == 1 and lengths[int(0.99 * len(lengths))] >= 4 * statistics.median(lengths)


# ----------------------------------------------------------------------------- sampling

def test_sampling_is_deterministic_given_the_seed():
    def stream(seed):
        rng = random.Random(seed)
        return [(e, e.meta) for e in (SUITE.sample(rng) for _ in range(100))]

    assert stream(7) == stream(7)
    assert stream(7) != stream(8)


def test_family_weights_are_respected():
    suite = TaskSuite(TaskConfig(families=("copy", "add", "sort"), weights=(3.0, 1.0, 0.0)))
    rng = random.Random(0)
    families = [suite.sample(rng).family for _ in range(4000)]
    assert abs(families.count("copy") / 4000 - 0.75) < 0.03
    assert "sort" not in families


def test_no_weights_means_uniform_over_families():
    rng = random.Random(0)
    families = [SUITE.sample(rng).family for _ in range(4000)]
    assert all(abs(families.count(f) / 4000 - 0.25) < 0.03 for f in SHORT)


def test_unknown_family_is_a_clear_error_listing_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown 'nope'.*known: copy, add, sort, perm, carry"):
        TaskSuite(TaskConfig(families=("copy", "nope")))


# ----------------------------------------------------------------------------- encoding

@pytest.mark.parametrize("family", SHORT)
def test_examples_encode_without_unknown_tokens_and_fit_128_tokens(family):
    for e in many(family, 2000):
        ids, _ = SUITE.encode_sft(e, TOK)
        assert UNK not in ids and len(ids) <= 128
        assert len(e.prompt) + len(e.answer) <= 120


@pytest.mark.parametrize("family", list(FAMILIES))
def test_sft_loss_mask_covers_exactly_the_answer_and_eos(family):
    every = TaskSuite(TaskConfig(families=tuple(FAMILIES)))
    rng = random.Random(0)
    for e in (every.sample_family(family, rng) for _ in range(200)):
        ids, mask = encode_sft(e, TOK)
        n_prompt = 1 + len(e.prompt)
        assert ids[:n_prompt] == encode_prompt(e, TOK) and ids[0] == BOS
        assert mask == [0] * n_prompt + [1] * (len(e.answer) + 1)
        assert ids[-1] == EOS and TOK.decode(ids[n_prompt:]) == e.answer


def test_sft_encoding_of_a_worked_example():
    e = Example("add", "add:1+2=", "3")
    ids, mask = SUITE.encode_sft(e, TOK)
    assert ids == [BOS] + TOK.encode("add:1+2=3") + [EOS]
    assert mask == [0] * 9 + [1, 1]
    assert SUITE.encode_prompt(e, TOK) == ids[:9]
