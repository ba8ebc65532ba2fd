"""Token sampling: logit warping (temperature, top-k, top-p) and a device-sync-free categorical draw.

# N rows (one distribution each), V vocab

The sampling distribution of a row is ``softmax(warp_logits(logits, temperature, top_k, top_p))``.
`warp_logits` is a pure function so that lossless speculative sampling can warp the policy's p and
the draft's q identically (docs/design.md, "Lossless speculative sampling": warping only one side is a known bug).

Order of the warps (HF transformers' and vLLM's): temperature, then top-k, then top-p on the
distribution top-k left. Removed tokens get logit -inf; at least one token always survives.

Logprob convention (what `sample_tokens` returns next to each token):
- temperature > 0: log of the token's probability under the sampling distribution, i.e.
  ``log_softmax(warp_logits(...))[token]``. This is the behaviour policy's logprob that an
  importance ratio needs; it equals the trainer's ``log_softmax(logits / temperature)`` exactly when
  top-k and top-p are off.
- temperature == 0 (greedy): the sampling distribution is a point mass (logprob 0 carries no
  information), so the logprob is ``log_softmax(logits)[token]`` of the *raw* logits (temperature 1,
  no top-k/top-p): the policy's own logprob of the greedy token.

Worked example (V = 4, temperature 1, top_k 0, top_p 0.8):
    logits            [2.0, 1.0, 0.0, -1.0]
    softmax           [0.644, 0.237, 0.087, 0.032]
    mass before token [0.0, 0.644, 0.881, 0.968]  -> keep while < 0.8: tokens 0 and 1
    warped logits     [2.0, 1.0, -inf, -inf]  -> sampling probs [0.731, 0.269, 0, 0]
"""

from __future__ import annotations

import torch
from torch import Tensor

from cospec.config import SamplingConfig


def warp_logits(logits_NV: Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Logits of the sampling distribution, in fp32: removed tokens are -inf, >= 1 token is kept.

    temperature == 0 is the greedy limit: everything but the argmax (lowest index on ties) is
    removed, so `softmax` of the result is one-hot and speculative acceptance min(1, p/q) reduces to
    "accept while the draft token is the policy's argmax".
    top_k: keep the k largest logits (0 or >= V: off); tokens tied with the k-th value are kept too.
    top_p: keep the smallest prefix of the tokens sorted by probability whose mass reaches top_p
        (1.0: off); the most likely token is always kept.
    """
    logits = logits_NV.float()
    if temperature == 0:
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep.scatter_(-1, logits.argmax(-1, keepdim=True), True)
        return logits.masked_fill(~keep, float("-inf"))
    if temperature != 1.0:
        logits = logits / temperature
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # [N, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # exclusive cumsum; 0 for the first
        remove_sorted = mass_before >= top_p
        remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


def probs_from_logits(logits_NV: Tensor, temperature: float, top_k: int = 0,
                      top_p: float = 1.0) -> Tensor:
    """fp32 [N, V] probabilities of the sampling distribution (rows sum to 1, removed tokens 0)."""
    return warp_logits(logits_NV, temperature, top_k, top_p).softmax(-1)


def sample(probs_NV: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One categorical draw per row, without a device sync (unlike `torch.multinomial`).

    Exponential race: with E_v ~ Exponential(1) i.i.d., argmax_v p_v / E_v is distributed as p
    (E_v / p_v ~ Exponential(p_v), and the first of independent exponential clocks to ring is v
    with probability p_v / sum p). Tokens with p_v = 0 never win since some p_v > 0.
    Returns long [N].
    """
    race_NV = torch.empty_like(probs_NV).exponential_(generator=generator)
    return (probs_NV / race_NV).argmax(-1)


def sampling_logprobs_NV(logits_NV: Tensor, sampling: SamplingConfig) -> Tensor:
    """fp32 [N, V] log-probabilities that `sample_tokens` reports (module docstring's convention):
    of the warped distribution, or of the raw logits under greedy."""
    if sampling.temperature == 0:
        return logits_NV.float().log_softmax(-1)
    return warp_logits(logits_NV, sampling.temperature, sampling.top_k,
                       sampling.top_p).log_softmax(-1)


def sample_tokens(logits_NV: Tensor, sampling: SamplingConfig,
                  generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """Draw one token per row from the warped distribution of ``sampling``.

    Returns (ids long [N], logprobs fp32 [N]) with the logprob convention of the module docstring.
    No device sync: both stay on the logits' device. Greedy consumes no random numbers.
    """
    logprobs_NV = sampling_logprobs_NV(logits_NV, sampling)
    if sampling.temperature == 0:
        ids = logits_NV.argmax(-1)  # of the raw logits, as warp_logits(temperature=0) keeps
    else:
        ids = sample(logprobs_NV.exp(), generator)
    return ids, logprobs_NV.gather(-1, ids[:, None])[:, 0]
