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

import random
from dataclasses import dataclass

import torch
from torch import Tensor

from cospec.data.packing import sequence_rows
from cospec.data.tokenizer import PAD
from cospec.draft.block_ttt import block_unroll
from cospec.draft.losses import rejection_posterior, soft_cross_entropy, total_variation
from cospec.models.block_draft import BlockDraft
from cospec.models.branch_attention import trunk_branch_attention
from cospec.models.draft import Eagle3Draft, TappedDraft
from cospec.models.llama import apply_rope, packed_positions, rope_cos_sin
from cospec.models.precision import autocast_off


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

    def sequence_lengths(self) -> list[int]:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()


def pad_to_bucket(batch: TTTBatch, multiple: int) -> TTTBatch:
    """``batch`` with one untrained sequence appended so that its token count is a multiple of
    ``multiple`` (the batch itself when it is, or for ``multiple`` <= 1). On a CPU, oneDNN builds
    a kernel for every new matmul shape (a bf16 matmul on AMX: ~7 ms to build, 2.8 ms to run),
    and packed batches of whole sequences rarely repeat a token count; in buckets more of them
    do (a co-training update of ~450 tokens of SmolLM2's draft with a new answer mix each time:
    0.309 s bucketed by 32, 0.372 s not, 0.238 s for one batch repeated;
    docs/results/real_model.md). The appended sequence is its own (attention never crosses a
    sequence) and its loss mask is 0, so the loss and its gradients are the batch's own. A
    copy of the batch: pad one batch at a time."""
    pad = -len(batch.tokens) % multiple if multiple > 1 else 0
    if not pad:
        return batch

    def padded(x: Tensor) -> Tensor:
        return torch.cat([x, x.new_zeros(pad, *x.shape[1:])])
    return TTTBatch(tokens=padded(batch.tokens),
                    cu_seqlens=torch.cat([batch.cu_seqlens, batch.cu_seqlens[-1:] + pad]),
                    loss_mask=padded(batch.loss_mask),
                    taps={k: padded(v) for k, v in batch.taps.items()},
                    policy_logits=padded(batch.policy_logits))


def cpu_bucket(multiple: int, device: torch.device) -> int:
    """``multiple`` on a CPU, 0 elsewhere: kernel builds per shape are oneDNN's (CPU) cost; on a
    GPU the padding would only add work."""
    return multiple if torch.device(device).type == "cpu" else 0


def cat_batches(batches: list[TTTBatch]) -> TTTBatch:
    """One packed row of the batches' sequences, in order (pipeline microbatches back into the
    minibatch they were cut from)."""
    if len(batches) == 1:
        return batches[0]
    offsets = [0]
    for b in batches:
        offsets.append(offsets[-1] + len(b.tokens))
    cu = torch.cat([batches[0].cu_seqlens[:1]] +
                   [b.cu_seqlens[1:] + off for b, off in zip(batches, offsets)])
    return TTTBatch(tokens=torch.cat([b.tokens for b in batches]), cu_seqlens=cu,
                    loss_mask=torch.cat([b.loss_mask for b in batches]),
                    taps={k: torch.cat([b.taps[k] for b in batches]) for k in batches[0].taps},
                    policy_logits=torch.cat([b.policy_logits for b in batches]))


def choose_sequences(lengths: list[int], max_tokens: int, rng: random.Random) -> list[int] | None:
    """The whole sequences (indices into ``lengths``, increasing) drawn in a random order until
    the next one would pass max_tokens (at least one); None, drawing nothing, when all fit.
    Made from the lengths alone, so a policy step can keep only these rows as it captures them.

    Random, not the leading ones: a step's rollouts come grouped by prompt (group_size answers
    each), so the first sequences would be a handful of prompts' groups.
    """
    if max_tokens <= 0 or sum(lengths) <= max_tokens:
        return None
    order = list(range(len(lengths)))
    rng.shuffle(order)
    chosen, used = [], 0
    for i in order:
        if chosen and used + lengths[i] > max_tokens:
            break
        chosen.append(i)
        used += lengths[i]
    return sorted(chosen)


def select_sequences(batch: TTTBatch, chosen: list[int] | None) -> TTTBatch:
    """The sequences ``chosen`` of `batch` (increasing indices) as a batch of their own (a copy);
    the batch itself for None."""
    if chosen is None:
        return batch
    cu, lengths = batch.cu_seqlens, batch.sequence_lengths()
    index = sequence_rows(cu, chosen)
    new_cu = torch.tensor([0] + [lengths[i] for i in chosen], device=cu.device).cumsum(0)
    return TTTBatch(tokens=batch.tokens[index], cu_seqlens=new_cu.to(cu.dtype),
                    loss_mask=batch.loss_mask[index], taps={k: v[index] for k, v in batch.taps.items()},
                    policy_logits=batch.policy_logits[index])


def shifted_taps(draft: TappedDraft, taps: dict[int, Tensor], cu_seqlens: Tensor) -> Tensor:
    """[T, K*C]: the concatenated policy taps of position t - 1 for entry t, zeros at sequence
    starts (the draft's fc has no bias, so projecting this equals shifting the projection)."""
    missing = [t for t in draft.tap_layers if t not in taps]
    if missing:
        raise ValueError(f"policy features of layers {missing} were not tapped")
    raw = torch.cat([taps[t] for t in draft.tap_layers], dim=-1)
    shifted = torch.cat([torch.zeros_like(raw[:1]), raw[:-1]], dim=0)
    starts = torch.zeros(raw.shape[0], dtype=torch.bool, device=raw.device)
    starts[cu_seqlens[:-1]] = True
    return shifted.masked_fill(starts[:, None], 0.0)


def entry_features(draft: Eagle3Draft, taps: dict[int, Tensor], cu_seqlens: Tensor) -> Tensor:
    """[T, C]: projected policy feature of position t - 1 for entry t; zeros at sequence starts."""
    return draft.fc(shifted_taps(draft, taps, cu_seqlens))


@dataclass
class TTTSteps:
    """The unroll's inputs laid out by anchor position t, computed on the whole packed row, so
    that context parallelism can shard every field along T with the zigzag plan (step j reads the
    token at t + j, which may live on another rank: shifting before sharding needs no exchange).

    feat_raw_TF: `shifted_taps` [T, K*C]; tokens_JT: the token step j reads at anchor t (PAD past
    the sequence end); inside_JT: t + j is inside t's sequence; targets_JTV: policy logits at
    t + j; mask_JT: step j at t is trained (inside, and its target a response token);
    positions_T: t's position in its sequence.
    """

    feat_raw_TF: Tensor
    tokens_JT: Tensor
    inside_JT: Tensor
    targets_JTV: Tensor
    mask_JT: Tensor
    positions_T: Tensor


def ttt_steps(draft: TappedDraft, batch: TTTBatch, num_steps: int) -> TTTSteps:
    T = batch.tokens.shape[0]
    cu = batch.cu_seqlens
    idx = torch.arange(T, device=batch.tokens.device)
    seq_end = cu[1:][torch.bucketize(idx, cu[1:], right=True)]  # exclusive
    shift_JT = idx[None] + torch.arange(num_steps, device=idx.device)[:, None]
    inside = shift_JT < seq_end[None]
    at = shift_JT.clamp(max=T - 1)
    return TTTSteps(feat_raw_TF=shifted_taps(draft, batch.taps, cu),
                    tokens_JT=torch.where(inside, batch.tokens[at], PAD), inside_JT=inside,
                    targets_JTV=batch.policy_logits[at], mask_JT=inside & (batch.loss_mask[at] > 0),
                    positions_T=packed_positions(cu, T))


def ttt_unroll(draft: Eagle3Draft, steps: TTTSteps, cu_seqlens: Tensor,
               attention=trunk_branch_attention) -> list[Tensor]:
    """Draft logits [T, V] of every TTT step. ``attention`` has `trunk_branch_attention`'s
    signature (context parallel passes the ring version bound to its group).

    Every layer of a deeper draft attends the same way: its step-1 keys are its trunk, its keys
    of steps 2..j at the same anchor its branch (in decoding, each layer's cache holds the same
    entries as the first's)."""
    cfg, num_layers = draft.config, len(draft.layers)
    dtype = draft.embed_tokens.weight.dtype  # the attention's fp32 output comes back to it
    hidden = draft.fc(steps.feat_raw_TF)
    trunk = [None] * num_layers  # (k, v) of step 1, per layer
    branch = [([], []) for _ in range(num_layers)]  # keys and values of steps 2..j, per layer

    def attend(lid: int, j: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if j == 0:
            trunk[lid] = (k[0], v[0])
            out, _ = attention(q[0], *trunk[lid], cu_seqlens)
        else:
            branch[lid][0].append(k[0])
            branch[lid][1].append(v[0])
            out, _ = attention(q[0], *trunk[lid], cu_seqlens, torch.stack(branch[lid][0]),
                               torch.stack(branch[lid][1]))
        return out[None].to(dtype)  # [1, H, T, D]

    logits = []
    for j in range(steps.tokens_JT.shape[0]):  # 0-based: step j + 1 of the paper
        emb = draft.embed_tokens(steps.tokens_JT[j])[None]
        cos, sin = (x.to(dtype) for x in rope_cos_sin((steps.positions_T + j)[None], cfg))
        first = draft.layers["0"]
        h = first.finish(hidden[None], attend(0, j, *first.qkv(emb, hidden[None], cos, sin)))
        for lid in range(1, num_layers):
            layer = draft.layers[str(lid)]
            a = layer.self_attn
            x = layer.input_layernorm(h)
            q = apply_rope(a.q_proj(x).view(1, -1, a.num_heads, a.head_dim).transpose(1, 2), cos, sin)
            k = apply_rope(a.k_proj(x).view(1, -1, a.num_kv_heads, a.head_dim).transpose(1, 2),
                           cos, sin)
            v = a.v_proj(x).view(1, -1, a.num_kv_heads, a.head_dim).transpose(1, 2)
            out = attend(lid, j, q, k, v)
            h = h + a.o_proj(out.transpose(1, 2).reshape(1, out.shape[2], -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        hidden = h[0]
        logits.append(draft.lm_head(draft.norm(hidden)))
    return logits


def ttt_loss(draft: TappedDraft, batch: TTTBatch, *, num_steps: int, decay: float = 0.8,
             temperature: float = 1.0, tv_weight: float = 0.0,
             anchor_weight: float = 0.0) -> tuple[Tensor, dict]:
    """sum_j decay^(j-1) * [(1 - tv_weight) * CE_j + tv_weight * TV_j], each a masked mean
    (weighted by `anchor_weights` when ``anchor_weight`` > 0).

    Returns (loss, metrics) with per-step ``ce``, ``tv`` and ``acceptance`` (= 1 - TV: the expected
    acceptance of step j's drafts under speculative sampling at this temperature, teacher-forced;
    unweighted means, whatever the loss's weights).
    """
    return ttt_loss_on_steps(draft, ttt_steps(draft, batch, num_steps), batch.cu_seqlens,
                             decay=decay, temperature=temperature, tv_weight=tv_weight,
                             anchor_weight=anchor_weight)


def anchor_weights(first_logits_TV: Tensor, steps: TTTSteps, cu_seqlens: Tensor, strength: float,
                   temperature: float, vocab_ids: Tensor | None) -> Tensor:
    """[T] detached: 1 + strength * P(s_t came as the residual draw after a rejection), an
    approximation of how often real drafting starts from entry t.

    Decoding drafts from entry t when token s_t ended the previous verify step: the residual draw
    after a rejection (most steps), or the bonus after all gamma drafts passed. Given that s_t
    came and that it was judged, the first has probability `rejection_posterior` under the q
    that proposed it (docs/design.md, "Where drafting starts"). The approximation: that q is read
    from step 1 at entry t - 1, as if t - 1 had been an anchor (it is step j's from anchor t - j
    otherwise), and neither the chance that s_t was judged at all nor the bonus starts are
    weighed (the exact P(anchor at t) is `cospec.draft.expected_accept_length`'s chain). Measured
    on SmolLM2, teacher-forced, a draft is accepted at 0.63-0.66 where real drafting started
    against 0.75-0.77 elsewhere (docs/results/real_model.md): uniform weights train the draft
    least where it is used most. Sequence starts and prompt tokens keep weight 1; so,
    approximately, does the first response token (always an anchor in decoding).
    """
    posterior = rejection_posterior(first_logits_TV[:-1], steps.targets_JTV[0][:-1],
                                    steps.tokens_JT[0][1:], temperature, vocab_ids)
    weights = torch.ones(steps.tokens_JT.shape[1], device=posterior.device, dtype=posterior.dtype)
    weights[1:] += strength * posterior * steps.mask_JT[0][:-1]  # s_t a response token
    weights[cu_seqlens[:-1]] = 1.0  # entry t - 1 belongs to the previous sequence
    return weights


def unroll(draft: TappedDraft, steps: TTTSteps, cu_seqlens: Tensor,
           attention=trunk_branch_attention) -> tuple[list[Tensor], list[Tensor | None]]:
    """(logits [T, Vd] per step, confidence [T] per step or None) of an EAGLE-3 draft's TTT
    unroll or a block draft's block positions."""
    if isinstance(draft, BlockDraft):
        return block_unroll(draft, steps, cu_seqlens, attention)
    logits = ttt_unroll(draft, steps, cu_seqlens, attention)
    return logits, [None] * len(logits)


def ttt_loss_on_steps(draft: TappedDraft, steps: TTTSteps, cu_seqlens: Tensor, *,
                      decay: float = 0.8, temperature: float = 1.0, tv_weight: float = 0.0,
                      anchor_weight: float = 0.0, attention=trunk_branch_attention,
                      total_count=None, sharded: bool = False) -> tuple[Tensor, dict]:
    """`ttt_loss` on (possibly sharded) steps. ``total_count(count) -> count``: under data or
    context parallelism, the all-reduced (weighted) number of trained tokens of a step, so that
    each rank's loss is its share of the global masked mean (the ranks' losses and gradients then
    sum to the single-process ones). ``sharded``: the steps are a context-parallel shard, where
    entry t - 1 of `anchor_weights` may sit on another rank (not supported)."""
    if anchor_weight and sharded:
        raise ValueError("draft.anchor_weight is not supported under context parallelism yet "
                         "(entry t's weight reads entry t - 1, which may sit on another rank); "
                         "set draft.anchor_weight=0 or parallel.cp=1")
    # the rows each step's losses run at (the trained anchors), read before the unroll is
    # queued: on CUDA the host then waits on the masks only, not on the whole unroll
    rows_J = [m.nonzero()[:, 0] for m in steps.mask_JT]
    logits, confidence = unroll(draft, steps, cu_seqlens, attention)
    weights = (anchor_weights(logits[0], steps, cu_seqlens, anchor_weight, temperature,
                              draft.vocab_ids) if anchor_weight else None)
    total = torch.zeros((), device=steps.tokens_JT.device)
    metrics = {"ce": [], "tv": [], "acceptance": []}
    for j, (lg, conf) in enumerate(zip(logits, confidence)):
        # The losses at the trained anchors only (a masked mean): on the policy's chat prompts
        # over half of the anchors are prompt tokens, and the vocabulary-wide softmaxes of CE
        # and TV were most of a co-training update. index_select: its backward is a scatter-add.
        rows = rows_J[j]
        mask = steps.mask_JT[j].float()
        count = (mask.sum() if total_count is None else total_count(mask.sum())).clamp(min=1)
        ids = draft.vocab_ids
        lg_K, target_K = lg.index_select(0, rows), steps.targets_JTV[j].index_select(0, rows)
        tv_t = total_variation(lg_K, target_K, temperature, ids)
        ce_t = soft_cross_entropy(lg_K, target_K, temperature, ids)
        ce, tv = ce_t.sum() / count, tv_t.sum() / count
        if weights is None:
            total = total + decay ** j * ((1 - tv_weight) * ce + tv_weight * tv)
        else:  # the loss weighted by anchor, the metrics as they are
            wm = weights * mask
            w_count = (wm.sum() if total_count is None else total_count(wm.sum())).clamp(min=1e-6)
            mix_t = (1 - tv_weight) * ce_t + tv_weight * tv_t
            total = total + decay ** j * (mix_t * wm[rows]).sum() / w_count
        metrics["ce"].append(ce.item())
        metrics["tv"].append(tv.item())
        metrics["acceptance"].append(1 - metrics["tv"][-1])
        if conf is not None:
            # The block draft's confidence head learns P(accept) = 1 - TV at this position (its
            # input is detached: this term trains the head alone).
            conf = conf.index_select(0, rows).to(tv_t.dtype)  # fp32, or fp64 like the TV
            accept = (1 - tv_t).detach().clamp(0, 1)
            with autocast_off(conf.device):  # CUDA's autocast refuses binary_cross_entropy
                bce = torch.nn.functional.binary_cross_entropy(conf.clamp(1e-6, 1 - 1e-6), accept,
                                                               reduction="none")
            total = total + bce.sum() / count
            metrics.setdefault("confidence_error", []).append(
                ((conf - accept).abs().sum() / count).item())
    return total, metrics
