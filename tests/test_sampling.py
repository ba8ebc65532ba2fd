"""Specification of cospec.rollout.sampling: warping, the inverse-CDF draw, logprobs.

The statistical tests draw 20000 tokens from a fixed 6-token distribution with a seeded generator and
run a chi-square goodness-of-fit test (p > 1e-3 to pass); `test_chi_square_detects_...` shows the same
test rejects the distribution a buggy sampler would produce, so a pass means something.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributions import Chi2

from cospec.config import SamplingConfig
from cospec.rollout.sampling import (SamplingDistribution, probs_from_logits, sample, sample_tokens,
                                     sampling_logprobs_NV, warp_logits)

LOGITS_V = torch.tensor([2.0, 1.5, 0.5, 0.0, -0.5, -1.0])
NUM_DRAWS = 20_000


def draw_counts(sampling: SamplingConfig, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    ids, _ = sample_tokens(LOGITS_V.expand(NUM_DRAWS, -1), sampling, gen)
    return torch.bincount(ids, minlength=len(LOGITS_V)).double()


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of counts to probs over the tokens with probs > 0; 0.0 if a token of
    probability 0 was drawn."""
    support = probs > 0
    if counts[~support].sum() > 0:
        return 0.0
    observed, expected = counts[support], counts.sum() * probs[support].double()
    stat = ((observed - expected) ** 2 / expected).sum()
    return float(1 - Chi2(torch.tensor(float(support.sum() - 1))).cdf(stat))


def test_temperature_divides_logits():
    assert torch.allclose(warp_logits(LOGITS_V[None], 0.5), LOGITS_V[None] / 0.5)


def test_top_k_keeps_the_k_largest_logits():
    warped = warp_logits(LOGITS_V[None], 1.0, top_k=2)[0]
    assert torch.isfinite(warped).tolist() == [True, True, False, False, False, False]


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass():
    # The module docstring's worked example: masses 0.644, 0.237, ... ; 0.644 < 0.8 <= 0.881.
    warped = warp_logits(torch.tensor([[2.0, 1.0, 0.0, -1.0]]), 1.0, top_p=0.8)[0]
    assert torch.isfinite(warped).tolist() == [True, True, False, False]
    assert torch.allclose(warped.softmax(-1)[:2], torch.tensor([2.0, 1.0]).softmax(-1))


def test_top_p_applies_to_what_top_k_left():
    # After top_k=2 the distribution is [0.62, 0.38]: top_p=0.6 keeps only the first token,
    # whereas on the full softmax (first token 0.48) it would keep two.
    warped = warp_logits(LOGITS_V[None], 1.0, top_k=2, top_p=0.6)[0]
    assert torch.isfinite(warped).sum() == 1
    assert torch.isfinite(warp_logits(LOGITS_V[None], 1.0, top_p=0.6)[0]).sum() == 2


def test_greedy_warp_is_a_point_mass_on_the_argmax():
    probs = probs_from_logits(torch.tensor([[0.1, 3.0, 2.9]]), 0.0)
    assert probs.tolist() == [[0.0, 1.0, 0.0]]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), temperature=st.sampled_from([0.0, 0.3, 1.0, 2.5]),
       top_k=st.integers(0, 8), top_p=st.floats(1e-6, 1.0))
def test_warping_keeps_at_least_one_token_and_gives_a_distribution(seed, temperature, top_k, top_p):
    logits = torch.randn(4, 7, generator=torch.Generator().manual_seed(seed)) * 5
    probs = probs_from_logits(logits, temperature, top_k, top_p)
    assert bool((torch.isfinite(warp_logits(logits, temperature, top_k, top_p)).sum(-1) >= 1).all())
    assert torch.allclose(probs.sum(-1), torch.ones(4))
    # the most likely token always survives
    assert bool((probs.gather(-1, logits.argmax(-1, keepdim=True)) > 0).all())


@pytest.mark.parametrize("sampling", [
    SamplingConfig(temperature=1.0),
    SamplingConfig(temperature=0.6),
    SamplingConfig(temperature=1.0, top_k=3),
    SamplingConfig(temperature=1.0, top_p=0.8),
    SamplingConfig(temperature=1.5, top_k=4, top_p=0.9),
], ids=["temperature1", "temperature0.6", "top_k3", "top_p0.8", "combined"])
def test_sampled_frequencies_follow_the_warped_softmax(sampling):
    expected = probs_from_logits(LOGITS_V[None], sampling.temperature, sampling.top_k,
                                 sampling.top_p)[0]
    assert chi_square_pvalue(draw_counts(sampling), expected) > 1e-3


@pytest.mark.parametrize("sampling", [
    SamplingConfig(temperature=0.6), SamplingConfig(top_k=3), SamplingConfig(top_p=0.8)],
    ids=["temperature", "top_k", "top_p"])
def test_chi_square_detects_a_sampler_that_ignores_the_warp(sampling):
    unwarped = LOGITS_V.softmax(-1)
    assert chi_square_pvalue(draw_counts(sampling), unwarped) < 1e-6


def test_inverse_cdf_draw_follows_the_given_probabilities():
    probs = torch.tensor([0.5, 0.0, 0.3, 0.2])
    ids = sample(probs.expand(NUM_DRAWS, -1), torch.Generator().manual_seed(1))
    assert chi_square_pvalue(torch.bincount(ids, minlength=4).double(), probs) > 1e-3


def test_draw_from_unnormalised_rows_never_picks_a_zero_probability_token():
    # The residual max(0, p - q) of verification is drawn from without normalising it; zeros at
    # both ends of the vocabulary must never be drawn (the interval of a zero is empty).
    weights = torch.tensor([0.0, 0.06, 0.0, 0.18, 0.06, 0.0])
    ids = sample(weights.expand(NUM_DRAWS, -1), torch.Generator().manual_seed(6))
    counts = torch.bincount(ids, minlength=6).double()
    assert counts[[0, 2, 5]].sum() == 0
    assert chi_square_pvalue(counts[[1, 3, 4]], weights[[1, 3, 4]] / weights.sum()) > 1e-3


def test_logprob_is_under_the_sampling_distribution():
    sampling = SamplingConfig(temperature=0.7, top_k=4, top_p=0.9)
    logits = torch.randn(64, 6, generator=torch.Generator().manual_seed(2)) * 3
    ids, logprobs = sample_tokens(logits, sampling, torch.Generator().manual_seed(3))
    probs = probs_from_logits(logits, 0.7, 4, 0.9)
    assert torch.allclose(logprobs, probs.gather(-1, ids[:, None])[:, 0].log(), atol=1e-6)


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=0.7, top_k=4, top_p=0.9),
                                      SamplingConfig(temperature=1.3), SamplingConfig(temperature=0.0)],
                         ids=["warped", "plain", "greedy"])
def test_the_distribution_warped_once_gives_the_probs_and_logprobs_of_the_two_warp_path(sampling):
    logits = torch.randn(4, 8, 9, generator=torch.Generator().manual_seed(7)) * 3
    ids = torch.randint(0, 9, (4, 8), generator=torch.Generator().manual_seed(8))
    dist = SamplingDistribution(logits, sampling)
    probs = probs_from_logits(logits.view(32, 9), sampling.temperature, sampling.top_k,
                              sampling.top_p).view(4, 8, 9)
    torch.testing.assert_close(dist.probs, probs)
    torch.testing.assert_close(dist.prob_of(ids[:, :5]), probs[:, :5].gather(-1, ids[:, :5, None])[..., 0])
    rows, positions = torch.tensor([2, 0, 3]), torch.tensor([7, 1, 1])
    torch.testing.assert_close(dist.row(rows, positions), probs[rows, positions])
    expected = sampling_logprobs_NV(logits.view(32, 9), sampling).gather(-1, ids.view(32, 1)).view(4, 8)
    torch.testing.assert_close(dist.logprobs(ids), expected)


def test_greedy_picks_the_argmax_with_the_raw_logprob():
    logits = torch.randn(16, 6, generator=torch.Generator().manual_seed(4))
    ids, logprobs = sample_tokens(logits, SamplingConfig(temperature=0.0))
    assert torch.equal(ids, logits.argmax(-1))
    assert torch.allclose(logprobs, logits.log_softmax(-1).max(-1).values)


def test_same_generator_seed_gives_the_same_draws():
    sampling = SamplingConfig(temperature=1.0)
    a = sample_tokens(LOGITS_V.expand(100, -1), sampling, torch.Generator().manual_seed(5))[0]
    b = sample_tokens(LOGITS_V.expand(100, -1), sampling, torch.Generator().manual_seed(5))[0]
    assert torch.equal(a, b) and not math.isclose(a.float().std().item(), 0.0)
