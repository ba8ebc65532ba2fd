"""Training-time-test (TTT) unroll of the EAGLE-3 draft over a packed batch (arXiv 2503.01840, Sec. 3.3).

# T packed tokens, C hidden size, K tapped layers, V vocab, H heads, D head dim

The draft is trained for k steps ahead in one pass, the way it will be used in decoding
(`cospec.rollout.speculative`): step 1 at entry t reads token s_t and the policy feature of position
t - 1 and predicts s_{t+1}; step j (1-based) at the same anchor t reads token s_{t+j-1} and the
draft's own step j-1 hidden, sits at position t + j - 1, and predicts s_{t+j}, whose policy
distribution is p at packed position t + j - 1. Its attention sees the step-1 keys at positions
<= t of its sequence (the trunk) and the keys of steps 2..j at anchor t (the branch):
`trunk_branch_attention`. In decoding the draft cache holds exactly those keys when step j runs.

Step j at anchor t is trained only where token s_{t+j-1} is inside t's sequence and its target is
a response token (``loss_mask``). The tokens fed are the sampled sequence's own tokens: on a
policy sample they are what the policy drew, i.e. the draft is trained on-policy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from cospec.draft.losses import masked_mean, soft_cross_entropy, total_variation
from cospec.models.branch_attention import trunk_branch_attention
from cospec.models.draft import Eagle3Draft
from cospec.models.llama import packed_positions, rope_cos_sin
from cospec.rl.tokenizer import PAD


@dataclass
class TTTBatch:
    """One packed row and the policy's detached view of it.

    tokens: long [T]; cu_seqlens: long [N+1]; loss_mask: float [T], 1 where the token after
    position t is a response token; taps: {layer: [T, C]} policy outputs at each position;
    policy_logits: [T, V] (position t predicts token t + 1).
    Example: sequences [BOS a b | EOS] and [BOS c | EOS] with prompts "BOS a", "BOS": tokens
    [BOS a b BOS c] (the EOS is only a target), cu_seqlens [0, 3, 5], loss_mask [0 1 1 1 1].
    """

    tokens: Tensor
    cu_seqlens: Tensor
    loss_mask: Tensor
    taps: dict[int, Tensor]
    policy_logits: Tensor


def first_sequences(batch: TTTBatch, max_tokens: int) -> TTTBatch:
    """The leading whole sequences of `batch` with at most max_tokens tokens (at least one)."""
    cu = batch.cu_seqlens
    if max_tokens <= 0 or int(cu[-1]) <= max_tokens:
        return batch
    n = max(1, int((cu[1:] <= max_tokens).sum()))
    end = int(cu[n])
    return TTTBatch(tokens=batch.tokens[:end], cu_seqlens=cu[:n + 1], loss_mask=batch.loss_mask[:end],
                    taps={k: v[:end] for k, v in batch.taps.items()},
                    policy_logits=batch.policy_logits[:end])


def entry_features(draft: Eagle3Draft, taps: dict[int, Tensor], cu_seqlens: Tensor) -> Tensor:
    """[T, C]: projected policy feature of position t - 1 for entry t; zeros at sequence starts."""
    feat = draft.project({k: v[None] for k, v in taps.items()})[0]  # [T, C]
    shifted = torch.cat([torch.zeros_like(feat[:1]), feat[:-1]], dim=0)
    starts = torch.zeros(feat.shape[0], dtype=torch.bool, device=feat.device)
    starts[cu_seqlens[:-1]] = True
    return shifted.masked_fill(starts[:, None], 0.0)


def ttt_unroll(draft: Eagle3Draft, tokens_T: Tensor, feat_TC: Tensor, cu_seqlens: Tensor,
               num_steps: int) -> tuple[list[Tensor], list[Tensor]]:
    """Draft logits of every step [T, V] and where each step is inside its sequence (bool [T])."""
    T = tokens_T.shape[0]
    device = tokens_T.device
    idx = torch.arange(T, device=device)
    seq_end = cu_seqlens[1:][torch.bucketize(idx, cu_seqlens[1:], right=True)]  # exclusive
    positions = packed_positions(cu_seqlens, T)
    layer, cfg = draft.layers["0"], draft.config
    hidden = feat_TC
    trunk_k = trunk_v = None
    branch_k, branch_v, logits, valid = [], [], [], []
    for j in range(num_steps):  # 0-based: step j + 1 of the paper
        inside = idx + j < seq_end
        tok = torch.where(inside, tokens_T[(idx + j).clamp(max=T - 1)], PAD)
        emb = draft.embed_tokens(tok)[None]
        cos, sin = rope_cos_sin((positions + j)[None], cfg.head_dim, cfg.rope_theta)
        q, k, v = layer.qkv(emb, hidden[None], cos.to(emb.dtype), sin.to(emb.dtype))
        if j == 0:
            trunk_k, trunk_v = k[0], v[0]
            out, _ = trunk_branch_attention(q[0], trunk_k, trunk_v, cu_seqlens)
        else:
            branch_k.append(k[0])
            branch_v.append(v[0])
            out, _ = trunk_branch_attention(q[0], trunk_k, trunk_v, cu_seqlens,
                                            torch.stack(branch_k), torch.stack(branch_v))
        h = layer.finish(hidden[None], out[None].to(emb.dtype))[0]
        logits.append(draft.lm_head(draft.norm(h)))
        valid.append(inside)
        hidden = h
    return logits, valid


def ttt_loss(draft: Eagle3Draft, batch: TTTBatch, *, num_steps: int, decay: float = 0.8,
             temperature: float = 1.0, tv_weight: float = 0.0) -> tuple[Tensor, dict]:
    """sum_j decay^(j-1) * [(1 - tv_weight) * CE_j + tv_weight * TV_j], each a masked mean.

    Returns (loss, metrics) with per-step ``ce``, ``tv`` and ``acceptance`` (= 1 - TV: the expected
    acceptance of step j's drafts under speculative sampling at this temperature, teacher-forced).
    """
    T = batch.tokens.shape[0]
    feat = entry_features(draft, batch.taps, batch.cu_seqlens)
    logits, valid = ttt_unroll(draft, batch.tokens, feat, batch.cu_seqlens, num_steps)
    idx = torch.arange(T, device=batch.tokens.device)
    total = torch.zeros((), device=batch.tokens.device)
    metrics = {"ce": [], "tv": [], "acceptance": []}
    for j, (lg, ok) in enumerate(zip(logits, valid)):
        target_idx = (idx + j).clamp(max=T - 1)
        mask = ok & (batch.loss_mask[target_idx] > 0)
        target = batch.policy_logits[target_idx]
        ce = masked_mean(soft_cross_entropy(lg, target, temperature), mask)
        tv = masked_mean(total_variation(lg, target, temperature), mask)
        total = total + decay ** j * ((1 - tv_weight) * ce + tv_weight * tv)
        metrics["ce"].append(ce.item())
        metrics["tv"].append(tv.item())
        metrics["acceptance"].append(1 - metrics["tv"][-1])
    return total, metrics
