"""Specification of cospec.rollout.verify: the lossless acceptance rule on rigged distributions.

p and q are written down by hand (no model), so the expected acceptance is exact:
always when q == p, never when their supports are disjoint, sum(min(p, q)) in general; and the
token that follows the accepted prefix is distributed as p. Statistical checks use 40000 rows and a
5-sigma band (false-failure rate < 1e-6 per check).
"""

import math

import pytest
import torch

from cospec.rollout.sampling import sample
from cospec.rollout.verify import verify_drafts

ROWS = 40_000


def rigged(p_V, q_V, gamma, seed=0):
    """Every row: drafts ~ q at each of gamma positions, p the same at every position."""
    gen = torch.Generator().manual_seed(seed)
    q = q_V.expand(ROWS, gamma, -1).contiguous()
    drafts = sample(q.reshape(-1, q.shape[-1]), gen).view(ROWS, gamma)
    p = p_V.expand(ROWS, gamma + 1, -1).contiguous()
    return verify_drafts(p, q, drafts, gen), drafts


def test_a_draft_equal_to_the_policy_accepts_everything():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    verdict, drafts = rigged(p, p.clone(), gamma=4)
    assert (verdict.num_accepted == 4).all()
    assert torch.equal(verdict.tokens[:, :4], drafts)


def test_a_draft_with_disjoint_support_accepts_nothing_and_samples_from_p():
    p = torch.tensor([0.6, 0.4, 0.0, 0.0])
    q = torch.tensor([0.0, 0.0, 0.5, 0.5])
    verdict, _ = rigged(p, q, gamma=3)
    assert (verdict.num_accepted == 0).all()
    freq = torch.bincount(verdict.next_token, minlength=4).float() / ROWS
    sigma = math.sqrt(0.6 * 0.4 / ROWS)
    assert abs(freq[0].item() - 0.6) < 5 * sigma and freq[2:].sum() == 0


def test_partial_overlap_accepts_at_the_rate_sum_of_min_p_q_and_keeps_p():
    p = torch.tensor([0.5, 0.25, 0.15, 0.1])
    q = torch.tensor([0.1, 0.2, 0.3, 0.4])
    rate = torch.minimum(p, q).sum().item()  # 0.1 + 0.2 + 0.15 + 0.1 = 0.55
    verdict, _ = rigged(p, q, gamma=1)
    accepted = verdict.num_accepted.float().mean().item()
    assert abs(accepted - rate) < 5 * math.sqrt(rate * (1 - rate) / ROWS)
    # The first emitted token (accepted draft or the residual draw) is distributed as p.
    first = verdict.tokens[:, 0]
    freq = torch.bincount(first, minlength=4).float() / ROWS
    sigma = (p * (1 - p) / ROWS).sqrt()
    assert ((freq - p).abs() < 5 * sigma).all(), (freq, p)


def test_accepted_prefix_length_follows_the_geometric_law_of_independent_positions():
    # Same p, q at every position: P(k = i) = a^i (1 - a) for i < G, P(k = G) = a^G.
    p = torch.tensor([0.7, 0.2, 0.1])
    q = torch.tensor([0.4, 0.4, 0.2])
    a, G = torch.minimum(p, q).sum().item(), 3
    verdict, _ = rigged(p, q, gamma=G, seed=3)
    counts = torch.bincount(verdict.num_accepted, minlength=G + 1).float() / ROWS
    law = [a ** i * (1 - a) for i in range(G)] + [a ** G]
    for i in range(G + 1):
        assert abs(counts[i].item() - law[i]) < 5 * math.sqrt(law[i] * (1 - law[i]) / ROWS), i


def test_greedy_one_hot_distributions_accept_exactly_while_draft_equals_argmax():
    V = 5
    argmax_p = torch.tensor([[1, 3, 0, 2, 4], [1, 1, 1, 1, 1]])  # per row, per position
    drafts = torch.tensor([[1, 3, 4, 2], [1, 1, 1, 1]])
    p = torch.nn.functional.one_hot(argmax_p, V).float()
    q = torch.nn.functional.one_hot(drafts, V).float()
    verdict = verify_drafts(p, q, drafts, torch.Generator().manual_seed(0))
    assert verdict.num_accepted.tolist() == [2, 4]
    assert verdict.tokens[0, :3].tolist() == [1, 3, 0]  # third token replaced by p's argmax
    assert verdict.tokens[1].tolist() == [1, 1, 1, 1, 1]  # bonus token from p at position G


def test_mis_shaped_inputs_are_rejected():
    with pytest.raises(ValueError, match="verify needs"):
        verify_drafts(torch.rand(2, 3, 5), torch.rand(2, 3, 5), torch.zeros(2, 3, dtype=torch.long))


def test_a_head_only_q_and_a_once_warped_p_verify_exactly_as_their_written_out_forms():
    """The engine hands verification q over a reduced head (`HeadProbs`) and p as warped logits
    (`SamplingDistribution`); with the same random stream the verdicts are those of the full
    [N, G(+1), V] probability tensors."""
    from cospec.config import SamplingConfig
    from cospec.rollout.sampling import SamplingDistribution
    from cospec.rollout.verify import HeadProbs

    gen = torch.Generator().manual_seed(3)
    N, G, V, ids = 2000, 3, 7, torch.tensor([1, 3, 4])
    head = (torch.randn(N, G, 3, generator=gen) * 2).softmax(-1)
    dense_q = torch.zeros(N, G, V).index_copy(-1, ids, head)
    drafts = ids[sample(head.reshape(-1, 3), gen).view(N, G)]
    p = SamplingDistribution(torch.randn(N, G + 1, V, generator=gen) * 2, SamplingConfig(temperature=0.8))
    a = verify_drafts(p, HeadProbs(head, ids, V), drafts, torch.Generator().manual_seed(5))
    b = verify_drafts(p.probs, dense_q, drafts, torch.Generator().manual_seed(5))
    assert torch.equal(a.num_accepted, b.num_accepted) and torch.equal(a.tokens, b.tokens)
    assert set(a.next_token.tolist()) - set(ids.tolist())  # ids off the head are emitted too
    torch.testing.assert_close(HeadProbs(head, ids, V).probs, dense_q)
