"""Lossless speculative sampling: accept a prefix of the drafted tokens, then draw one more.

# N rows, G drafted tokens per row (gamma), V vocab

Leviathan et al. (arXiv 2211.17192, Algorithm 1) and Chen et al. (arXiv 2302.01318, Algorithm 2).
p = the policy's sampling distribution, q = the draft's, both warped identically (temperature,
top-k, top-p: `cospec.rollout.sampling.probs_from_logits`); q is what the drafts were drawn from.
Per row:
  Step 1. x_1..x_G were drawn with x_i ~ q_i (the draft's distribution given the prefix and x_<i).
  Step 2. One policy forward gave p_0..p_G (p_i conditions on the prefix and x_1..x_i).
  Step 3. For i = 1..G accept x_i with probability min(1, p(x_i) / q(x_i)); at the first rejection,
          draw the next token from r(x) = max(0, p(x) - q(x)) / sum_y max(0, p(y) - q(y)) and stop.
  Step 4. If all G were accepted, draw a bonus token from p_G.
Every output token is then distributed exactly as under plain sampling from p (Leviathan et al.,
Appendix A.1). Per-token acceptance is sum_x min(p(x), q(x)) = 1 - TV(p, q).

Greedy (temperature 0) needs no special case: p and q are one-hot, so x_i is accepted exactly when it
is the policy's argmax, and r is the policy's argmax.

Everything stays on the device, without a sync: the acceptance test is ``u * q(x) < p(x)`` (no
division; q(x) > 0 since x was drawn from q) and the draws use the exponential race of
`cospec.rollout.sampling.sample`, which needs no normalisation of r.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from cospec.rollout.sampling import sample


@dataclass
class Verdict:
    """num_accepted: long [N] in 0..G (accepted drafted tokens, a prefix);
    next_token: long [N], the token drawn at position num_accepted (from r, or p_G when all passed);
    tokens: long [N, G+1], the row's output: tokens[:, :num_accepted] are the accepted drafts,
    tokens[:, num_accepted] is next_token, later entries are meaningless."""

    num_accepted: Tensor
    next_token: Tensor
    tokens: Tensor


def verify_drafts(p_probs_NG1V: Tensor, q_probs_NGV: Tensor, draft_NG: Tensor,
                  generator: torch.Generator | None = None) -> Verdict:
    """Steps 3-4 above for a batch of rows; all G drafts of a row are judged in one go."""
    N, G, V = q_probs_NGV.shape
    if p_probs_NG1V.shape != (N, G + 1, V) or draft_NG.shape != (N, G):
        raise ValueError(f"verify needs p [N, G+1, V], q [N, G, V], drafts [N, G]; got "
                         f"{tuple(p_probs_NG1V.shape)}, {tuple(q_probs_NGV.shape)}, {tuple(draft_NG.shape)}")
    p_draft = p_probs_NG1V[:, :G].gather(-1, draft_NG[..., None])[..., 0]  # p_i(x_i)
    q_draft = q_probs_NGV.gather(-1, draft_NG[..., None])[..., 0]  # q_i(x_i)
    u = torch.rand(N, G, device=q_probs_NGV.device, generator=generator)
    accept_NG = u * q_draft < p_draft  # probability min(1, p/q)
    num_accepted = accept_NG.long().cumprod(-1).sum(-1)  # length of the accepted prefix
    # The distribution of the token after the prefix: r_i at a rejection (i < G), p_G after all G.
    residual_NGV = (p_probs_NG1V[:, :G] - q_probs_NGV).clamp(min=0)
    candidates = torch.cat([residual_NGV, p_probs_NG1V[:, G:]], dim=1)  # [N, G+1, V]
    rows = torch.arange(N, device=draft_NG.device)
    weights_NV = candidates[rows, num_accepted]
    # r has positive mass whenever a rejection can happen (p(x) < q(x) for the drafted x forces some
    # p(y) > q(y)); only rounding can empty it, and then p is the right fallback.
    empty = weights_NV.sum(-1, keepdim=True) <= 0
    weights_NV = torch.where(empty, p_probs_NG1V[rows, num_accepted], weights_NV)
    next_token = sample(weights_NV, generator)
    tokens = torch.cat([draft_NG, draft_NG[:, :1]], dim=1).scatter(1, num_accepted[:, None],
                                                                 next_token[:, None])
    return Verdict(num_accepted=num_accepted, next_token=next_token, tokens=tokens)


def overshoot_sums(p_probs_NGV: Tensor, q_probs_NGV: Tensor, draft_NG: Tensor) -> Tensor:
    """Per draft position, sums over the N rows (fp64 [4, G]) of: log q(x) - log p(x) (p floored at
    1e-12), 1[q(x) > p(x)], the overshoot mass sum_v max(0, q(v) - p(v)), and 1 (the count).

    The mass equals TV(p, q) = 1 - sum_v min(p, q): the probability that the drafted token is
    rejected, so 1 - mass / count is the acceptance the drafts should show on average.
    """
    p_x = p_probs_NGV.gather(-1, draft_NG[..., None])[..., 0].double()
    q_x = q_probs_NGV.gather(-1, draft_NG[..., None])[..., 0].double()
    mass = (q_probs_NGV - p_probs_NGV).clamp(min=0).sum(-1).double()
    return torch.stack([(q_x.log() - p_x.clamp(min=1e-12).log()).sum(0), (q_x > p_x).double().sum(0),
                        mass.sum(0), torch.full_like(mass[0], draft_NG.shape[0])])
