"""GRPO's math: group-normalised advantages and the clipped, token-normalised policy loss.

# R rollouts (G per prompt), T packed tokens, V vocab

Advantages (Shao et al. 2402.03300, Sec. 4.1.2, outcome supervision): every token of rollout i of a
group gets A_i = r_i - mean(r_group), divided by std(r_group) + eps under ``"mean_std"`` (Dr. GRPO,
Liu et al. 2503.20783, argues for mean only, ``"mean"``). A group whose rewards are all equal has
A = 0 and contributes no gradient.

Policy loss (PPO's clipped surrogate, Schulman et al. 1707.06347, Eq. 7, with DAPO's decoupled clip
range and token-level normalisation, Yu et al. 2503.14476, Eq. 8):
    ratio_t = exp(logp_t - logp_old_t)
    L = - (1 / sum of response tokens) * sum_t min(ratio_t * A_t, clip(ratio_t, 1 - eps_low, 1 + eps_high) * A_t)
Every token weighs the same, so long responses are not down-weighted as a per-sequence mean would.
Optional KL penalty to the initial policy, beta * KL(pi || pi_ref) per token, exact over the
vocabulary (V is small here; no estimator needed).

Logprobs are taken at the rollout temperature, log_softmax(logits / temperature): the distribution
the rollouts were sampled from (top-k / top-p are not supported in RL; `GRPOConfig` rejects them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def group_advantages(rewards_R: Tensor, group_size: int, mode: str = "mean_std",
                     eps: float = 1e-6) -> Tensor:
    """[R] advantages; rollouts of one prompt are contiguous (R = num_prompts * group_size)."""
    if rewards_R.numel() % group_size:
        raise ValueError(f"{rewards_R.numel()} rewards do not split into groups of {group_size}")
    r = rewards_R.float().view(-1, group_size)
    adv = r - r.mean(-1, keepdim=True)
    if mode == "mean_std":
        adv = adv / (r.std(-1, keepdim=True, unbiased=False) + eps)
    elif mode != "mean":
        raise ValueError(f"advantage mode must be mean or mean_std, got {mode!r}")
    return adv.view(-1)


def token_logprobs(logits_TV: Tensor, targets_T: Tensor, temperature: float) -> Tensor:
    """[T] log p(target_t) at the rollout temperature (fp32)."""
    t = 1.0 if temperature == 0 else temperature
    return (logits_TV.float() / t).log_softmax(-1).gather(-1, targets_T[:, None])[:, 0]


@dataclass
class PolicyLossOutput:
    loss: Tensor
    clip_fraction: float
    kl: float
    ratio_mean: float


def clipped_policy_loss(logp_T: Tensor, old_logp_T: Tensor, adv_T: Tensor, mask_T: Tensor, *,
                        clip_low: float, clip_high: float, kl_T: Tensor | None = None,
                        kl_coef: float = 0.0, num_tokens: float | None = None) -> PolicyLossOutput:
    """The loss above over the tokens where mask_T is 1; kl_T: per-token KL(pi || pi_ref).

    num_tokens: the divisor; default the masked count. A piece of a minibatch (a context-parallel
    shard, a pipeline microbatch) passes the whole minibatch's count, so the pieces' losses add up.
    """
    m = mask_T.float()
    num_tokens = m.sum().clamp(min=1) if num_tokens is None else max(num_tokens, 1)
    ratio = (logp_T - old_logp_T).exp()
    surrogate = torch.minimum(ratio * adv_T, ratio.clamp(1 - clip_low, 1 + clip_high) * adv_T)
    loss = -(surrogate * m).sum() / num_tokens
    kl = 0.0
    if kl_T is not None:
        kl_mean = (kl_T * m).sum() / num_tokens
        loss = loss + kl_coef * kl_mean
        kl = kl_mean.item()
    clipped = ((ratio < 1 - clip_low) | (ratio > 1 + clip_high)).float()
    return PolicyLossOutput(loss=loss, clip_fraction=((clipped * m).sum() / num_tokens).item(),
                            kl=kl, ratio_mean=((ratio * m).sum() / num_tokens).item())


def kl_to_reference(logits_TV: Tensor, ref_logits_TV: Tensor, temperature: float) -> Tensor:
    """[T] exact KL(pi || pi_ref) per token at the rollout temperature."""
    t = 1.0 if temperature == 0 else temperature
    logp = (logits_TV.float() / t).log_softmax(-1)
    logq = (ref_logits_TV.float() / t).log_softmax(-1)
    return (logp.exp() * (logp - logq)).sum(-1)


def token_entropy(logits_TV: Tensor, temperature: float) -> Tensor:
    """[T] entropy of the sampling distribution per token (nats)."""
    t = 1.0 if temperature == 0 else temperature
    logp = (logits_TV.float() / t).log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)
