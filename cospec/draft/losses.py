"""Draft losses against the policy's distribution, at the rollout sampling temperature.

# N tokens, V vocab

p = softmax(policy_logits / temperature) (the detached target), q = softmax(draft_logits / temperature).
- soft cross-entropy  H(p, q) = -sum_x p(x) log q(x)  (= KL(p || q) + H(p): forward KL up to a
  constant; EAGLE-3's and NeMo RL's draft loss);
- total variation     TV(p, q) = 0.5 * sum_x |p(x) - q(x)| = 1 - sum_x min(p(x), q(x)), which is
  exactly 1 - (acceptance probability of a drafted token) under lossless speculative sampling
  (Leviathan et al. 2211.17192, Sec. 3.5), so minimising it maximises acceptance directly.
Temperature 0 (greedy rollouts) trains at temperature 1: a one-hot target would carry no ranking.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def _scale(temperature: float) -> float:
    return 1.0 if temperature == 0 else temperature


def _acc(x: Tensor) -> Tensor:
    """fp32 (fp64 kept for fp64 input): low-precision logits are upcast before the softmax."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def compress_to_head(policy_logits_NV: Tensor, vocab_ids: Tensor, temperature: float) -> Tensor:
    """[N, Vd + 1]: the policy's logits on a reduced draft head's ids, then one bucket logit for
    all other ids, t * logsumexp(x_outside / t), so that at temperature t the softmax of the result
    is exactly p on the head's ids and p(outside) in the bucket. What the losses need of p at that
    temperature, in Vd + 1 numbers instead of V (6x less for SmolLM2 with an 8K head)."""
    x = _acc(policy_logits_NV.detach())
    return torch.cat([x[..., vocab_ids], bucket_logit(x, vocab_ids, temperature)], dim=-1)


def bucket_logit(policy_logits_NV: Tensor, vocab_ids: Tensor, temperature: float) -> Tensor:
    """[N, 1]: `compress_to_head`'s last column, t * logsumexp(x_outside / t) over the ids outside
    the head (the one number a position needs beyond the head's own logits)."""
    t = _scale(temperature)
    x = _acc(policy_logits_NV.detach())
    outside = torch.ones(x.shape[-1], dtype=torch.bool, device=x.device)
    outside[vocab_ids] = False
    return t * (x[..., outside] / t).logsumexp(-1, keepdim=True)


def draft_targets(vocab_ids: Tensor | None, temperature: float) -> Callable[[Tensor], Tensor]:
    """``keep(policy_logits_TV) -> Tensor``: the form in which co-training keeps the policy's
    logits for a draft's losses from the moment they are captured: `compress_to_head`'s
    [T, Vd + 1] for a draft with a reduced head (everything its losses read of p; V / (Vd + 1)
    times less to hold and, under cp and pp, to gather: 4x at a 128K vocabulary with a 32K head),
    else the logits as they are."""
    if vocab_ids is None:
        return lambda logits: logits
    return lambda logits: compress_to_head(logits, vocab_ids.to(logits.device), temperature)


def _compressed(policy_logits: Tensor, vocab_ids: Tensor | None) -> bool:
    return vocab_ids is not None and policy_logits.shape[-1] == len(vocab_ids) + 1


def soft_cross_entropy(draft_logits_NV: Tensor, policy_logits_NV: Tensor,
                       temperature: float = 1.0, vocab_ids: Tensor | None = None) -> Tensor:
    """Per-token H(p, q) [N] (fp32, or fp64 for fp64 logits); the policy side is detached.

    vocab_ids: a reduced draft vocabulary (draft logits [N, Vd] over those policy ids); the target
    is then p restricted to them and renormalised, as EAGLE-3 trains its reduced head. The policy
    logits may be full [N, V] or `compress_to_head`'s [N, Vd + 1] (at this temperature).
    """
    t = _scale(temperature)
    target = policy_logits_NV.detach()
    if vocab_ids is not None:  # softmax of the restriction = p renormalised on it
        target = target[..., :-1] if _compressed(target, vocab_ids) else target[..., vocab_ids]
    p = (_acc(target) / t).softmax(-1)
    log_q = (_acc(draft_logits_NV) / t).log_softmax(-1)
    return -(p * log_q).sum(-1)


def total_variation(draft_logits_NV: Tensor, policy_logits_NV: Tensor,
                    temperature: float = 1.0, vocab_ids: Tensor | None = None) -> Tensor:
    """Per-token TV(p, q) [N] (fp32, or fp64 for fp64 logits); the policy side is detached.

    vocab_ids: a reduced draft vocabulary; q is 0 outside it, so the policy's mass there counts
    whole: TV = 0.5 * (sum over the draft ids of |p - q| + p(outside)), still 1 - acceptance.
    The policy logits may be full [N, V] or `compress_to_head`'s [N, Vd + 1].
    """
    t = _scale(temperature)
    q = (_acc(draft_logits_NV) / t).softmax(-1)
    logits = policy_logits_NV.detach()
    if vocab_ids is None:
        p = (_acc(logits) / t).softmax(-1)
        return 0.5 * (p - q).abs().sum(-1)
    if _compressed(logits, vocab_ids):
        p_draft = (_acc(logits) / t).softmax(-1)[..., :-1]
    else:  # p on the head's ids through one logsumexp over V, not a V-wide softmax
        lse = (_acc(logits) / t).logsumexp(-1, keepdim=True)
        p_draft = ((_acc(logits[..., vocab_ids]) / t) - lse).exp()
    return 0.5 * ((p_draft - q).abs().sum(-1) + (1 - p_draft.sum(-1)).clamp(min=0))


def rejection_posterior(draft_logits_NV: Tensor, policy_logits_NV: Tensor, next_N: Tensor,
                        temperature: float = 1.0, vocab_ids: Tensor | None = None) -> Tensor:
    """Per position [N] (detached): had token ``next_N`` been drafted here from q, the probability
    that it was the residual draw after a rejection rather than an accepted draft, given that it
    is what came: max(0, p(x) - q(x)) / p(x) = max(0, 1 - q(x) / p(x)) (docs/design.md, "Where
    drafting starts"). 1 for a token off a reduced head (q = 0 there); 0 where p(x) = 0.
    The policy logits may be full [N, V] or `compress_to_head`'s [N, Vd + 1]."""
    t = _scale(temperature)
    with torch.no_grad():
        if vocab_ids is None:
            col, on_head = next_N, torch.ones_like(next_N, dtype=torch.bool)
        else:  # a draft's vocab_ids increase (`cospec.models.draft`): a search, no host sync
            col = torch.searchsorted(vocab_ids, next_N).clamp(max=len(vocab_ids) - 1)
            on_head = vocab_ids[col] == next_N
        x = _acc(draft_logits_NV) / t
        log_q_x = x.gather(-1, col[:, None])[:, 0] - x.logsumexp(-1)
        # p's column of x: the head's column in compressed targets, else the policy id itself
        y = _acc(policy_logits_NV.detach()) / t
        p_col = col if vocab_ids is not None and _compressed(policy_logits_NV, vocab_ids) else next_N
        log_p_x = y.gather(-1, p_col[:, None])[:, 0] - y.logsumexp(-1)
        residual_share = (1 - (log_q_x - log_p_x).exp()).clamp(min=0)
        posterior = torch.where(log_p_x > -float("inf"), residual_share, 0.0)
        return torch.where(on_head, posterior, 1.0)


def masked_mean(values_N: Tensor, mask_N: Tensor) -> Tensor:
    m = mask_N.float()
    return (values_N * m).sum() / m.sum().clamp(min=1)
