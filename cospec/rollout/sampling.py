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


def uniform(generator, n: int, k: int, device, dtype=torch.float64) -> Tensor:
    """[n, k] uniforms in [0, 1) from ``generator``: a `torch.Generator` (or None: the global
    one), or per-prompt streams (`cospec.rollout.prompt_streams.PromptStreams`, which have the
    engine's rows bound)."""
    if generator is None or isinstance(generator, torch.Generator):
        return torch.rand(n, k, dtype=dtype, device=device, generator=generator)
    u = generator.uniform(n, k)
    # float64 -> float32 may round up to 1.0; torch.rand's range excludes it
    return u if dtype == torch.float64 else u.to(dtype).clamp_(max=1.0 - 2.0 ** -24)


def sample(probs_NV: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One categorical draw per row, without a device sync (unlike `torch.multinomial`).

    Inverse CDF: with u ~ Uniform[0, 1) scaled by the row's total mass m, the token is the first
    v whose cumulative mass c_v exceeds u*m. Token v is drawn exactly when c_{v-1} <= u*m < c_v,
    an interval of width p_v, so with probability p_v / m; a token with p_v = 0 owns an empty
    interval and is never drawn. Rows need not be normalised (the residual max(0, p - q) of
    speculative verification is not). Cumulative sums run in float64, so the interval widths
    keep fp32's precision even at a 49K vocabulary's tail; u*m can round up to m with probability
    below 2^-50, and then the last token is taken.

    One uniform per row and a cumsum: ~40 us per 49K-wide row on one CPU thread, against ~900 us
    for the exponential race (argmax p_v / E_v) that this replaced, whose V logarithms per row
    cost 5 ms per speculative step on SmolLM2. Returns long [N].
    """
    cdf_NV = probs_NV.double().cumsum(-1)
    u_N1 = uniform(generator, cdf_NV.shape[0], 1, cdf_NV.device) * cdf_NV[:, -1:]
    return torch.searchsorted(cdf_NV, u_N1, right=True)[:, 0].clamp_(max=cdf_NV.shape[-1] - 1)


def sampling_logprobs_NV(logits_NV: Tensor, sampling: SamplingConfig) -> Tensor:
    """fp32 [N, V] log-probabilities that `sample_tokens` reports (module docstring's convention):
    of the warped distribution, or of the raw logits under greedy."""
    if sampling.temperature == 0:
        return logits_NV.float().log_softmax(-1)
    return warp_logits(logits_NV, sampling.temperature, sampling.top_k,
                       sampling.top_p).log_softmax(-1)


class SamplingDistribution:
    """The sampling distribution of a batch of logits [N, T, V] (N rows, T positions), warped once.

    A speculative step needs, for the policy's G+1 positions per row: the probability of each
    drafted token, the whole distribution at ONE position per row (where the next token is drawn),
    and the logprobs of the emitted tokens. All three come from the warped logits and their
    log-normaliser: p(x) = exp(warped[x] - logsumexp(warped)). The full [N, T, V] probabilities
    (`probs`) are built only when asked (the overshoot diagnostics, tests): at batch 16 and a 49K
    vocabulary each pass over them is 4M floats, and warping twice (probabilities, then a
    log_softmax for the logprobs) doubled that work, and under top-p the sort.
    """

    def __init__(self, logits_NTV: Tensor, sampling: SamplingConfig):
        self.logits, self.greedy = logits_NTV, sampling.temperature == 0
        self.warped = warp_logits(logits_NTV, sampling.temperature, sampling.top_k, sampling.top_p)
        self.log_norm_NT1 = self.warped.logsumexp(-1, keepdim=True)
        self.shape = tuple(logits_NTV.shape)
        self._probs: Tensor | None = None

    @property
    def probs(self) -> Tensor:
        """fp32 [N, T, V], built on first use."""
        if self._probs is None:
            self._probs = (self.warped - self.log_norm_NT1).exp()
        return self._probs

    def prob_of(self, ids_NP: Tensor) -> Tensor:
        """fp32 [N, P]: the probability of ids_NP[:, t] at position t, for the first P positions."""
        P = ids_NP.shape[1]
        logits_NP = self.warped[:, :P].gather(-1, ids_NP[..., None])[..., 0]
        return (logits_NP - self.log_norm_NT1[:, :P, 0]).exp()

    def row(self, rows_N: Tensor, positions_N: Tensor) -> Tensor:
        """fp32 [N, V]: the whole distribution of row rows_N[i] at position positions_N[i]."""
        return (self.warped[rows_N, positions_N] - self.log_norm_NT1[rows_N, positions_N]).exp()

    def logprobs(self, ids_NT: Tensor) -> Tensor:
        """fp32 [N, T]: what `sample_tokens` reports for ids_NT (greedy: of the raw logits)."""
        if self.greedy:
            raw = self.logits.float()
            return raw.gather(-1, ids_NT[..., None])[..., 0] - raw.logsumexp(-1)
        return (self.warped.gather(-1, ids_NT[..., None]) - self.log_norm_NT1)[..., 0]


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
