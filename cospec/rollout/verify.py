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
division; q(x) > 0 since x was drawn from q) and the draws use the inverse-CDF draw of
`cospec.rollout.sampling.sample`, which needs no normalisation of r.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from cospec.models.integrity import NonFiniteError
from cospec.rollout.sampling import sample, uniform


@dataclass
class Verdict:
    """num_accepted: long [N] in 0..G (accepted drafted tokens, a prefix);
    next_token: long [N], the token drawn at position num_accepted (from r, or p_G when all passed);
    tokens: long [N, G+1], the row's output: tokens[:, :num_accepted] are the accepted drafts,
    tokens[:, num_accepted] is next_token, later entries are meaningless;
    nonfinite: long [] (on the device, unread): 0 when p and q were finite where they were read,
    else `POLICY_NONFINITE` | `DRAFT_NONFINITE` bits saying whose probabilities were not."""

    num_accepted: Tensor
    next_token: Tensor
    tokens: Tensor
    nonfinite: Tensor


#: bits of `Verdict.nonfinite`
POLICY_NONFINITE, DRAFT_NONFINITE = 1, 2


def nonfinite_message(code: int, where: str) -> str:
    """What a `Verdict.nonfinite` code means, for an error raised `where` (a step, say)."""
    whose = " and ".join(name for bit, name in ((POLICY_NONFINITE, "the policy (p)"),
                                                (DRAFT_NONFINITE, "the draft (q)")) if code & bit)
    hint = ("a diverged or corrupted draft: retrain it or check co-training's loss"
            if code == DRAFT_NONFINITE else "check the policy's weights and logits")
    return (f"{where}: {whose} gave non-finite probabilities (NaN or inf); speculative sampling "
            f"would no longer be lossless, so it stops here ({hint})")


class DenseProbs:
    """Probabilities written out in full, [N, P, V], read the way `verify_drafts` reads p and q."""

    def __init__(self, probs_NPV: Tensor):
        self.probs, self.shape = probs_NPV, tuple(probs_NPV.shape)

    def prob_of(self, ids_NP: Tensor) -> Tensor:
        return self.probs[:, :ids_NP.shape[1]].gather(-1, ids_NP[..., None])[..., 0]

    def row(self, rows_N: Tensor, positions_N: Tensor) -> Tensor:
        return self.probs[rows_N, positions_N]


class HeadProbs:
    """q of a draft whose head covers only ``vocab_ids`` (EAGLE-3's reduced draft vocabulary):
    probabilities [N, G, Vd] over those ids, zero for every other id of the policy's V.

    Drafting works in the head's Vd columns (warp, softmax and draw: 6x less at 8K of 49K); the
    V-wide distribution is written out for one position per row only, where verification draws
    from the residual max(0, p - q). ``head_index_V``: the head column of each policy id, -1 off
    the head (`head_index`), passed in by an engine that drafts many steps with the same head.
    """

    def __init__(self, probs_NGD: Tensor, vocab_ids: Tensor, vocab_size: int,
                 head_index_V: Tensor | None = None):
        self.head_probs, self.vocab_ids = probs_NGD, vocab_ids
        self.head_index_V = head_index(vocab_ids, vocab_size) if head_index_V is None else head_index_V
        self.shape = (*probs_NGD.shape[:2], vocab_size)

    def prob_of(self, ids_NP: Tensor) -> Tensor:
        col = self.head_index_V[ids_NP]
        probs = self.head_probs[:, :ids_NP.shape[1]].gather(-1, col.clamp(min=0)[..., None])[..., 0]
        return torch.where(col >= 0, probs, 0.0)

    def row(self, rows_N: Tensor, positions_N: Tensor) -> Tensor:
        head = self.head_probs[rows_N, positions_N]
        return head.new_zeros(head.shape[0], self.shape[-1]).index_copy_(-1, self.vocab_ids, head)

    @property
    def probs(self) -> Tensor:
        """[N, G, V] written out (the overshoot diagnostics need the whole of q)."""
        full = self.head_probs.new_zeros(self.shape)
        return full.index_copy_(-1, self.vocab_ids, self.head_probs)


def head_index(vocab_ids: Tensor, vocab_size: int) -> Tensor:
    """long [V]: for each policy id its column in a head over ``vocab_ids``, -1 when off the head."""
    index = torch.full((vocab_size,), -1, dtype=torch.long, device=vocab_ids.device)
    index[vocab_ids] = torch.arange(len(vocab_ids), device=vocab_ids.device)
    return index


def verify_drafts(p_probs_NG1V, q_probs_NGV, draft_NG: Tensor,
                  generator: torch.Generator | None = None, *, check: bool = True) -> Verdict:
    """Steps 3-4 above for a batch of rows; all G drafts of a row are judged in one go.

    p and q: probability tensors ([N, G+1, V] and [N, G, V]) or objects that read like them
    (`DenseProbs`, `HeadProbs`, `cospec.rollout.sampling.SamplingDistribution`): only the
    probabilities of the drafted tokens and one whole row per sequence are read.

    Non-finite p or q (a NaN logit makes its whole softmax row NaN) would make every draft a
    rejection and the residual draw meaningless: no error, rollouts silently not the policy's
    (docs/design.md, "Non-finite probabilities in verification"). The
    verdict's ``nonfinite`` says so from values the step computes anyway (the drafted tokens'
    probabilities, the drawn row's mass); with ``check`` a NaN raises `NonFiniteError` here (a
    device sync); an engine passes check=False and reads the flag with the accepted counts.
    """
    p = DenseProbs(p_probs_NG1V) if isinstance(p_probs_NG1V, Tensor) else p_probs_NG1V
    q = DenseProbs(q_probs_NGV) if isinstance(q_probs_NGV, Tensor) else q_probs_NGV
    N, G, V = q.shape
    if tuple(p.shape) != (N, G + 1, V) or tuple(draft_NG.shape) != (N, G):
        raise ValueError(f"verify needs p [N, G+1, V], q [N, G, V], drafts [N, G]; got "
                         f"{tuple(p.shape)}, {tuple(q.shape)}, {tuple(draft_NG.shape)}")
    p_draft = p.prob_of(draft_NG)  # p_i(x_i)
    q_draft = q.prob_of(draft_NG)  # q_i(x_i)
    u = uniform(generator, N, G, draft_NG.device, torch.float32)
    accept_NG = u * q_draft < p_draft  # probability min(1, p/q)
    num_accepted = accept_NG.long().cumprod(-1).sum(-1)  # length of the accepted prefix
    # The distribution of the token after the prefix: r_k at a rejection (k < G), p_G after all G.
    # Built for that one position of each row only ([N, V], not [N, G+1, V]: at batch 64 and a
    # 49K vocabulary the difference is 12M floats written and read per step).
    rows = torch.arange(N, device=draft_NG.device)
    p_next_NV = p.row(rows, num_accepted)
    q_next_NV = q.row(rows, num_accepted.clamp(max=G - 1))
    rejected_N1 = (num_accepted < G)[:, None]
    weights_NV = torch.where(rejected_N1, (p_next_NV - q_next_NV).clamp(min=0), p_next_NV)
    # r has positive mass whenever a rejection can happen (p(x) < q(x) for the drafted x forces some
    # p(y) > q(y)); only rounding can empty it, and then p is the right fallback.
    mass_N1 = weights_NV.sum(-1, keepdim=True)
    weights_NV = torch.where(mass_N1 <= 0, p_next_NV, weights_NV)
    q_bad = ~torch.isfinite(q_draft).all()
    p_bad = ~torch.isfinite(p_draft).all() | (~torch.isfinite(mass_N1).all() & ~q_bad)
    nonfinite = p_bad.long() * POLICY_NONFINITE + q_bad.long() * DRAFT_NONFINITE
    if check and int(nonfinite):
        raise NonFiniteError(nonfinite_message(int(nonfinite), "verify_drafts"))
    next_token = sample(weights_NV, generator)
    tokens = torch.cat([draft_NG, draft_NG[:, :1]], dim=1).scatter(1, num_accepted[:, None],
                                                                 next_token[:, None])
    return Verdict(num_accepted=num_accepted, next_token=next_token, tokens=tokens,
                   nonfinite=nonfinite)


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
