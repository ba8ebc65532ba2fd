"""Specification of `draft.anchor_weight`: the draft's loss weighted by where decoding drafts from.

Decoding drafts from entry t when token s_t closed the previous verify step, most often as the
residual draw after a rejection. Given that s_t came, that has probability max(0, p - q) / p at
s_t (q: the draft's distribution that proposed it); the unroll from t then weighs
1 + anchor_weight x that. The oracles: the joint law of (token, accepted or residual) written out
from the speculative rule on a small vocabulary, and the weighted loss summed by hand from the
per-token losses.
"""

import pytest
import torch
from ttt_answers import packed_answers

from cospec.config import ModelConfig, resolve
from cospec.draft.cotrain import cotrain_draft
from cospec.draft.losses import compress_to_head, rejection_posterior, soft_cross_entropy, total_variation
from cospec.draft.offline import build_draft, fit_draft
from cospec.draft.ttt import ttt_loss, ttt_loss_on_steps, ttt_steps, ttt_unroll
from cospec.models.draft import Eagle3Draft
from cospec.models.llama import Transformer

CFG = ModelConfig(vocab_size=40, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2,
                  intermediate_size=64, max_seq_len=64)


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    return Transformer(CFG).eval()


def packed_batch(policy, lengths, prompt_lengths):
    return packed_answers(policy, (1, 2, 3), lengths, prompt_lengths, seed=3)


def residual_share_by_the_rule(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """P(x came as the residual draw | x came), from Leviathan et al.'s rule written out: x is
    drafted with q(x) and accepted with min(1, p(x) / q(x)); on a rejection (probability
    1 - sum min(p, q)) the token is drawn from max(0, p - q), normalised."""
    accepted = q * torch.where(q > 0, (p / q).clamp(max=1), torch.zeros_like(p))
    rejection = 1 - torch.minimum(p, q).sum()
    residual = rejection * (p - q).clamp(min=0) / (p - q).clamp(min=0).sum()
    torch.testing.assert_close(accepted + residual, p)  # the rule is lossless
    return residual / (accepted + residual)


@pytest.mark.parametrize("head", ["whole", "reduced", "reduced, compressed targets"])
def test_the_rejection_posterior_is_the_residual_share_of_each_token_under_the_rule(head):
    torch.manual_seed(1)
    V, t = 9, 0.7
    ids = None if head == "whole" else torch.tensor([0, 2, 3, 5, 8])
    policy_logits = 2 * torch.randn(V)
    draft_logits = 2 * torch.randn(V if ids is None else len(ids))
    p = (policy_logits / t).softmax(-1)
    q = torch.zeros(V)
    q[slice(None) if ids is None else ids] = (draft_logits / t).softmax(-1)
    expected = residual_share_by_the_rule(p.double(), q.double()).float()
    target = policy_logits if "compressed" not in head else compress_to_head(policy_logits[None], ids, t)[0]
    got = rejection_posterior(draft_logits.expand(V, -1), target.expand(V, -1), torch.arange(V), t, ids)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    if ids is not None:  # off the head q = 0: whatever came there came from the residual
        off = torch.ones(V, dtype=torch.bool)
        off[ids] = False
        assert torch.equal(got[off], torch.ones(int(off.sum())))


def _weighted_loss_by_hand(draft, batch, steps_count, decay, t, tv_weight, strength):
    steps = ttt_steps(draft, batch, steps_count)
    logits = ttt_unroll(draft, steps, batch.cu_seqlens)
    T, starts = len(batch.tokens), set(batch.cu_seqlens[:-1].tolist())
    weights = torch.ones(T)
    for i in range(1, T):
        if i in starts or not steps.mask_JT[0][i - 1]:
            continue
        p = (batch.policy_logits[i - 1] / t).softmax(-1).double()
        q = (logits[0][i - 1] / t).softmax(-1).double()
        weights[i] += strength * residual_share_by_the_rule(p, q)[batch.tokens[i]].float()
    total = 0.0
    for j, lg in enumerate(logits):
        per_token = ((1 - tv_weight) * soft_cross_entropy(lg, steps.targets_JTV[j], t)
                     + tv_weight * total_variation(lg, steps.targets_JTV[j], t))
        wm = weights * steps.mask_JT[j].float()
        total += decay ** j * float((per_token * wm).sum() / wm.sum())
    return total, weights


def test_the_weighted_loss_is_each_anchors_unroll_weighed_by_its_rejection_posterior(policy):
    torch.manual_seed(2)
    draft = Eagle3Draft.from_policy(policy, tap_layers=(1, 2, 3))
    batch = packed_batch(policy, [12, 9, 15], prompt_lengths=[4, 3, 5])
    with torch.no_grad():
        expected, weights = _weighted_loss_by_hand(draft, batch, 3, 0.8, 0.7, 0.5, strength=4.0)
        loss, metrics = ttt_loss(draft, batch, num_steps=3, temperature=0.7, tv_weight=0.5,
                                 anchor_weight=4.0)
        plain_loss, plain = ttt_loss(draft, batch, num_steps=3, temperature=0.7, tv_weight=0.5)
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    assert (weights > 1).sum() > 10 and float(loss) != pytest.approx(float(plain_loss), rel=1e-5)
    assert metrics == plain  # the metrics stay the unweighted teacher-forced ones


def test_offline_training_and_co_training_pass_the_configured_weight(policy):
    batch = packed_batch(policy, [12, 9, 15], prompt_lengths=[4, 3, 5])
    cfg = resolve("tiny", overrides=["draft.anchor_weight=3", "draft.train_steps=1",
                                     "draft.ttt_steps=2", "draft.tv_weight=0.5"])
    draft = build_draft(cfg, policy)
    with torch.no_grad():
        expected, _ = _weighted_loss_by_hand(draft, batch, 2, cfg.draft.ttt_decay,
                                             cfg.sampling.temperature, 0.5, strength=3.0)
    history = fit_draft(cfg, draft, [batch], [], progress=False)["loss_history"]
    assert history[0] == pytest.approx(expected, rel=1e-5)
    seen = []

    def spy(*args, **kwargs):
        seen.append(kwargs["anchor_weight"])
        return ttt_loss(*args, **kwargs)

    opt = torch.optim.AdamW(draft.parameters(), lr=1e-4)
    cotrain_draft(draft, opt, [batch], cfg.draft, temperature=0.7, seed=0, loss_fn=spy)
    assert seen == [3.0]


def test_bad_anchor_weights_are_clear_errors(policy):
    with pytest.raises(ValueError, match="draft.anchor_weight"):
        resolve("tiny", overrides=["draft.anchor_weight=-1"])
    with pytest.raises(ValueError, match="draft.anchor_weight.*parallel.cp"):
        resolve("tiny", overrides=["draft.anchor_weight=1", "parallel.cp=2"])
    draft = Eagle3Draft.from_policy(policy, tap_layers=(1, 2, 3))
    batch = packed_batch(policy, [12, 9], prompt_lengths=[4, 3])
    with pytest.raises(ValueError, match="context parallelism"):
        ttt_loss_on_steps(draft, ttt_steps(draft, batch, 2), batch.cu_seqlens, anchor_weight=1.0,
                          sharded=True)
