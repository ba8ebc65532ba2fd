"""Specification of draft co-training and its diagnostics (cospec.draft, cospec.rl.trainer with
draft.mode=cotrain, cospec.rollout.verify.overshoot_sums)."""

import math

import torch

from cospec.draft.losses import soft_cross_entropy, total_variation
from cospec.rollout.verify import overshoot_sums


def test_tv_loss_is_one_minus_the_overlap_exactly():
    torch.manual_seed(0)
    draft_logits, policy_logits = torch.randn(64, 50), torch.randn(64, 50)
    for temperature in (1.0, 0.7):
        p = (policy_logits / temperature).softmax(-1)
        q = (draft_logits / temperature).softmax(-1)
        overlap = torch.minimum(p, q).sum(-1)
        torch.testing.assert_close(total_variation(draft_logits, policy_logits, temperature),
                                   1 - overlap, atol=1e-6, rtol=0)


def test_soft_cross_entropy_is_kl_plus_the_policy_entropy():
    torch.manual_seed(1)
    d, pl = torch.randn(8, 10), torch.randn(8, 10)
    p, log_q = pl.softmax(-1), d.log_softmax(-1)
    kl = (p * (p.log() - log_q)).sum(-1)
    entropy = -(p * p.log()).sum(-1)
    torch.testing.assert_close(soft_cross_entropy(d, pl), kl + entropy, atol=1e-5, rtol=0)


def test_overshoot_diagnostics_on_rigged_distributions():
    # One row, two draft positions, vocab 3; drafts x = (0, 2).
    p = torch.tensor([[[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]])
    q = torch.tensor([[[0.7, 0.2, 0.1], [0.3, 0.3, 0.4]]])
    sums = overshoot_sums(p, q, torch.tensor([[0, 2]]))
    log_q_over_p, above, mass, count = sums.tolist()
    assert math.isclose(log_q_over_p[0], math.log(0.7 / 0.5), rel_tol=1e-6)
    assert math.isclose(log_q_over_p[1], math.log(0.4 / 0.8), rel_tol=1e-6)
    assert above == [1.0, 0.0]  # q(x) > p(x) at position 1 only
    assert math.isclose(mass[0], 0.2, abs_tol=1e-7) and math.isclose(mass[1], 0.4, abs_tol=1e-7)
    assert count == [1.0, 1.0]


def test_measured_acceptance_matches_the_overlap_of_p_and_q():
    """The engine's acceptance at draft position 1 equals, within sampling noise, the mean over
    steps of sum_x min(p, q) computed from the logits (= 1 - overshoot mass)."""
    from cospec.config import ModelConfig, SamplingConfig
    from cospec.models.draft import Eagle3Draft
    from cospec.models.llama import Transformer
    from cospec.data.tokenizer import BOS
    from cospec.rollout.speculative import SpeculativeEngine

    torch.manual_seed(3)
    cfg = ModelConfig(vocab_size=8, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1,
                      intermediate_size=32, max_seq_len=32)
    policy = Transformer(cfg)
    policy.reset_parameters(std=0.4)
    draft = Eagle3Draft.from_policy(policy.eval())
    engine = SpeculativeEngine(policy, draft, batch_size=64, gamma=1, stop_ids=None)
    result = engine.generate([[BOS, 4]] * 512, SamplingConfig(max_new_tokens=8),
                             generator=torch.Generator().manual_seed(0))
    st = result.stats
    n = st.reached[0]
    measured = st.acceptance_by_position[0]
    expected = 1 - st.overshoot_by_position[0]["mass"]
    assert 0.05 < expected < 0.95  # neither trivial case
    assert abs(measured - expected) < 5 * math.sqrt(expected * (1 - expected) / n)
