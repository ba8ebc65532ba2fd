"""The accept length real drafting would reach on given answers, computed teacher-forced.

# J drafting steps (gamma), T packed tokens

Real tau (tokens per verify step, `cospec.rollout.speculation_stats`) is measured on answers that
speculation itself samples, so two drafts measured on the same prompts see different answers, and
at 64 prompts tau moves by +-0.15 with the draws alone. Held-out acceptance (1 - TV averaged over
every answer position) is paired and smooth, but reads high: decoding drafts from where the last
verify step ended, most often just after a rejection, where the draft does worst
(docs/design.md, "Where drafting starts").

Lossless sampling gives an exact middle way (docs/design.md, "Expected accept length on fixed
answers"). Given an answer, whether each token came as an accepted draft or as the residual draw
after a rejection has a known probability, and which happened decides where the next step
drafts from. So the answer fixes a Markov chain over the anchors (the pending token each step
drafts from) whose expected number of steps is what decoding would take on that answer on
average. Its accept probabilities come from one TTT unroll over the answer: step j at anchor a is
exactly what the draft computes in decoding when the drafts before it were the answer's own
tokens (`cospec.draft.ttt`), the only case in which step j is judged.

The accept probabilities are those of sampling at a temperature > 0 without top-k or top-p
(p and q as softmax(logits / temperature)); `cospec.draft.offline.held_out_metrics` leaves the
figure out for other sampling. The engine's tau also counts a last step's tokens past an
answer's end, which the answer does not show, so on the same answers this reads a little lower
(SmolLM2: 2.624 against 2.644, docs/results/real_model.md).

The same chain prices a *proposal scale* (`fit_proposal_scale`): the engine may draw drafts from
any q and stay lossless, so it draws from softmax(k * logits / T) with the k that gives held-out
answers the most expected tau (docs/design.md, "The proposal scale").
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from cospec.draft.losses import rejection_posterior
from cospec.draft.ttt import TTTBatch, ttt_steps, unroll


def accept_given_token(logits_J: list[Tensor], targets_JTV: Tensor, tokens_T: Tensor,
                       temperature: float, vocab_ids: Tensor | None) -> Tensor:
    """[J, T]: for drafting step j + 1 at anchor a, the probability that the answer's token
    s_{a+j+1}, had it been drafted there, was accepted rather than redrawn: min(1, q(x) / p(x)),
    i.e. 1 - `rejection_posterior`. Entries whose token lies past the row are meaningless (the
    chain never reads them). ``logits_J``: the unroll's logits [T, Vd] per step;
    ``targets_JTV``: p's logits at t + j (`TTTSteps.targets_JTV`)."""
    T, out = tokens_T.shape[0], []
    for j, logits in enumerate(logits_J):
        nxt = torch.cat([tokens_T[j + 1:], tokens_T.new_zeros(j + 1)])[:T]
        out.append(1 - rejection_posterior(logits, targets_JTV[j], nxt, temperature, vocab_ids))
    return torch.stack(out)


def expected_steps(accept_JT: Tensor, cu_seqlens: Tensor, loss_mask: Tensor) -> tuple[float, int]:
    """(expected verify steps, tokens those steps produce) summed over the packed answers.

    An answer packs as s_0..s_{L-1} (`cospec.data.packing`: its last token s_L, an EOS or the
    token at the length cap, is a target only); its response starts at s_P. The first response
    token comes from the prefill, so the first step drafts from anchor P (pending token s_P). A
    step from anchor a drafts s_{a+1}..s_{a+J}: a rejection at s_{a+j} (probability 1 - accept
    there, given the drafts before it passed) makes s_{a+j} the residual draw and the next anchor;
    all J accepted make s_{a+J+1} the bonus and the next anchor. A step that emits s_L ends the
    answer, whatever it drafted past it. Tokens: s_{P+1}..s_L, L - P per answer (the engine's
    count also takes in a last step's tokens past the end, which the answer does not show)."""
    J = accept_JT.shape[0]
    accept = accept_JT.double().tolist()
    mask = loss_mask.tolist()
    total_steps, total_tokens = 0.0, 0
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        trained = [t for t in range(start, end) if mask[t] > 0]
        if not trained:
            continue
        first = trained[0] + 1  # s_P as a packed index; s_L would sit at `end`
        anchor = [0.0] * (end - first + J + 2)  # P(anchor at first + i)
        if first < end:
            anchor[0] = 1.0
        for a in range(first, end):
            here = anchor[a - first]
            if here == 0.0:
                continue
            total_steps += here
            reach = here
            for j in range(1, J + 1):
                if a + j >= end:  # this step emits s_L: the answer ends
                    reach = 0.0
                    break
                p_accept = accept[j - 1][a]
                anchor[a + j - first] += reach * (1 - p_accept)
                reach *= p_accept
            if reach and a + J + 1 < end:
                anchor[a + J + 1 - first] += reach
        total_tokens += end - first
    return total_steps, total_tokens


@torch.no_grad()
def expected_accept_length(draft, batches: Sequence[TTTBatch], gamma: int,
                           temperature: float) -> tuple[float, int]:
    """(expected verify steps, tokens) of drafting ``gamma`` tokens a step (an EAGLE-3 or block
    draft, proposing at its ``proposal_scale``) on the answers of ``batches`` (`TTTBatch`es:
    packed answers with the policy's taps and logits); tau = tokens / steps."""
    return expected_steps_by_scale(draft, batches, gamma, temperature,
                                   (draft.proposal_scale,))[draft.proposal_scale]


@torch.no_grad()
def expected_steps_by_scale(draft, batches: Sequence[TTTBatch], gamma: int, temperature: float,
                            scales: Sequence[float]) -> dict[float, tuple[float, int]]:
    """`expected_accept_length` for each proposal scale in ``scales`` (q = softmax(scale *
    logits / T)), from one unroll of each batch: {scale: (expected steps, tokens)}."""
    totals = {k: (0.0, 0) for k in scales}
    for batch in batches:
        steps = ttt_steps(draft, batch, gamma)
        logits, _ = unroll(draft, steps, batch.cu_seqlens)
        for k, (total_steps, total_tokens) in totals.items():
            accept = accept_given_token([lg * k for lg in logits], steps.targets_JTV, batch.tokens,
                                        temperature, draft.vocab_ids)
            s, t = expected_steps(accept, batch.cu_seqlens, batch.loss_mask)
            totals[k] = (total_steps + s, total_tokens + t)
    return totals


#: The scales `fit_proposal_scale` tries first (1.0 among them: the draft as trained). On
#: SmolLM2's 8,192-answer draft the fit chose 1.25 on 256 held-out answers, and on 256 others
#: expected tau rose from 2.651 at 1.0 to 2.675 (docs/results/real_model.md, "The proposal scale").
SCALE_GRID = (0.8, 1.0, 1.25, 1.5, 2.0)
#: How far the fit extends the grid past its ends, by factors of 1.25, when the best is an end.
SCALE_RANGE = (0.25, 4.0)


def fit_proposal_scale(draft, batches: Sequence[TTTBatch], gamma: int,
                       temperature: float) -> dict[str, float]:
    """The proposal scale of the most expected tau on ``batches`` (held-out answers): the best of
    `SCALE_GRID` (extended past an end while the best is that end, within `SCALE_RANGE`), refined
    twice by trying the midpoints to its neighbours. Ties go to the scale nearest 1 (on a log
    scale), and answers that give no steps at all leave the draft at 1. Returns {"scale",
    "expected_tau_at_1", "expected_tau"}; does not set it on the draft."""
    tau: dict[float, float] = {}

    def measure(scales) -> float:
        new = [k for k in scales if k not in tau]
        for k, (s, t) in expected_steps_by_scale(draft, batches, gamma, temperature, new).items():
            tau[k] = t / s if s else float("nan")
        finite = [k for k in tau if math.isfinite(tau[k])]
        return max(finite, key=lambda k: (tau[k], -abs(math.log(k))), default=1.0)

    best = measure((1.0, *SCALE_GRID))
    while best == min(tau) and best / 1.25 >= SCALE_RANGE[0]:
        best = measure([best / 1.25])
    while best == max(tau) and best * 1.25 <= SCALE_RANGE[1]:
        best = measure([best * 1.25])
    for _ in range(2):
        grid = sorted(tau)
        i = grid.index(best)
        best = measure([(best + grid[j]) / 2 for j in (i - 1, i + 1) if 0 <= j < len(grid)])
    return {"scale": best, "expected_tau_at_1": tau[1.0], "expected_tau": tau[best]}
