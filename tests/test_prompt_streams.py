"""Specification of per-prompt random streams (`seeds=` of `generate`): a rollout's tokens are a
function of its prompt, its seed and the policy, not of the batch it shares, its slot or the
refill order, and they still follow the policy's distribution exactly.

The oracles: the same engine answering the same (prompt, seed) pairs in another order and batch
size; and the exact response distribution enumerated by full forwards (test_speculative.py's).
"""

import pytest
import torch

from cospec.config import SamplingConfig
from cospec.data.tokenizer import EOS
from cospec.models.draft import Eagle3Draft
from cospec.rollout.engine import GenerationEngine
from cospec.rollout.prompt_streams import PromptStreams
from cospec.rollout.sampling import sample
from cospec.rollout.speculative import SpeculativeEngine
from test_speculative import (HORIZON, SAMPLES_PER_PROMPT, TINY,
                             assert_follows_exact_distribution, drafts_for, make_policy,
                             make_prompts, trained_tiny_draft)

SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=12)


@pytest.fixture(scope="module")
def policy():
    return make_policy()


def engines(policy, batch_size):
    """The plain engine and speculative engines (EAGLE-3, block with correction) at one batch size."""
    drafts = drafts_for(policy)
    return {"plain": GenerationEngine(policy, batch_size=batch_size, stop_ids={EOS}),
            "eagle3": SpeculativeEngine(policy, drafts["eagle3"], batch_size=batch_size, gamma=3,
                                        stop_ids={EOS}),
            "block": SpeculativeEngine(policy, drafts["block-corrected"], batch_size=batch_size,
                                       gamma=3, stop_ids={EOS})}


@pytest.mark.parametrize("kind", ["plain", "eagle3", "block"])
def test_a_rollouts_tokens_do_not_depend_on_its_batch_slot_or_order(policy, kind):
    prompts = make_prompts([3, 7, 1, 5, 9, 2, 6, 4], seed=3)
    seeds = [1000 + 17 * i for i in range(len(prompts))]
    wide = engines(policy, batch_size=8)[kind].generate(prompts, SAMPLING, seeds=seeds)
    order = [5, 2, 7, 0, 3, 6, 1, 4]  # another order, through 3 slots: refills all along
    narrow = engines(policy, batch_size=3)[kind].generate([prompts[i] for i in order], SAMPLING,
                                                          seeds=[seeds[i] for i in order])
    for j, i in enumerate(order):
        assert narrow.completions[j].tokens == wide.completions[i].tokens, f"prompt {i}"
        assert narrow.completions[j].logprobs == pytest.approx(wide.completions[i].logprobs,
                                                               abs=1e-4)
    # and the answers are random: the seeds, not the prompts, decide them
    again = engines(policy, batch_size=8)[kind].generate([prompts[0]] * 8, SAMPLING,
                                                         seeds=list(range(8)))
    assert len({tuple(c.tokens) for c in again.completions}) > 1


def test_seeded_speculative_samples_follow_the_exact_sequence_distribution():
    """test_speculative.py's losslessness check, drawing from per-prompt streams."""
    policy = make_policy(TINY, std=0.5, seed=4)
    draft = trained_tiny_draft(policy)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=HORIZON)
    prompts = [[0, 4, 5], [0]]
    engine = SpeculativeEngine(policy, draft, batch_size=48, gamma=2)
    n = len(prompts) * SAMPLES_PER_PROMPT
    result = engine.generate(prompts * SAMPLES_PER_PROMPT, sampling, seeds=list(range(7, 7 + n)))
    assert_follows_exact_distribution(policy, prompts, result.completions, sampling)


def test_a_row_reads_the_next_numbers_of_its_own_stream():
    streams = PromptStreams(seeds=[5, 6, 7], batch_size=2, draws_per_row=6, device="cpu")
    expected = {i: torch.rand(6, dtype=torch.float64, generator=torch.Generator().manual_seed(s))
                for i, s in enumerate([5, 6, 7])}
    streams.assign([0, 1], [2, 0])  # slot 0 answers prompt 2, slot 1 prompt 0
    streams.bind(None)
    torch.testing.assert_close(streams.uniform(2, 2), torch.stack([expected[2][:2], expected[0][:2]]))
    streams.bind(torch.tensor([1]))  # slot 1 alone, 3 numbers laid out as 3 rows of 1
    torch.testing.assert_close(streams.uniform(3, 1), expected[0][2:5, None])
    streams.assign([0], [1])  # a new prompt restarts slot 0's stream
    streams.bind(torch.tensor([0, 1]))
    torch.testing.assert_close(streams.uniform(2, 1)[:, 0],
                               torch.stack([expected[1][0], expected[0][5]]))
    streams.check_bound()
    streams.uniform(2, 1)  # slot 1 asks for a 7th number
    with pytest.raises(RuntimeError, match="drew 7 random numbers but its stream holds 6"):
        streams.check_bound()


def test_sample_from_streams_draws_each_token_with_its_probability():
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3]])
    streams = PromptStreams(seeds=list(range(20_000)), batch_size=1, draws_per_row=1, device="cpu")
    counts = torch.zeros(4)
    for i in range(20_000):
        streams.assign([0], [i])
        streams.bind(None)
        counts[sample(probs, streams)] += 1
    torch.testing.assert_close(counts / counts.sum(), probs[0], atol=0.015, rtol=0)
    assert counts[1] == 0


def test_seeds_must_match_the_prompts(policy):
    engine = GenerationEngine(policy, batch_size=2)
    with pytest.raises(ValueError, match="2 seeds for 3 prompts"):
        engine.generate(make_prompts([2, 3, 4]), SAMPLING, seeds=[1, 2])


def test_reduced_vocabulary_drafts_are_reproducible_across_batches_too(policy):
    draft = Eagle3Draft.from_policy(policy, vocab_ids=torch.tensor(sorted({EOS, *range(4, 50, 3)})))
    prompts = make_prompts([4, 2, 6], seed=9)
    a = SpeculativeEngine(policy, draft.eval(), batch_size=3, gamma=2).generate(
        prompts, SAMPLING, seeds=[1, 2, 3])
    b = SpeculativeEngine(policy, draft.eval(), batch_size=1, gamma=2).generate(
        prompts, SAMPLING, seeds=[1, 2, 3])
    assert [c.tokens for c in a.completions] == [c.tokens for c in b.completions]
