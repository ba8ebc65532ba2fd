"""The co-trained EAGLE-3 draft's memory in a GRPO step, for `cospec plan` (cospec.parallel.plan).

# T tokens of a TTT batch in N sequences of up to Lmax, C / I the draft's hidden and MLP width,
# H / D its query heads and head dim, Vd its head's vocabulary, V the policy's, k the tapped
# layers (distinct ones where kept, all of draft.tap_layers as the draft's input), J =
# draft.ttt_steps, Vk the width the policy's logits are kept in: V, or Vd + 1 for a reduced head
# (`cospec.draft.losses.draft_targets`: the head's logits and one bucket for the rest)

Two parts, in fp32, on the ranks that train the draft (a pipeline's last stage):
- captured: what the step keeps for the draft of each minibatch (`TTTBatch`, only the rows of
  its share of draft.cotrain_max_tokens, drawn before the minibatch's forward by
  `cotrain_sampler`: whole sequences at random, at least one; counted as the share's tokens,
  their sequences in proportion, the minibatch's longest; under pp the last stage keeps them
  microbatch by microbatch): the tapped features k C, the policy's logits Vk, the token ids and
  loss mask, (k C + Vk + 3) per token, held from the policy step until the draft has trained;
- cotrain: the draft's update on one minibatch's share: its TTT targets gathered, J Vk per token,
  and what the TTT unroll saves for backward (what `cospec.draft.ttt.ttt_unroll` and the loss
  save, counted with saved-tensor hooks; tests/test_plan.py checks it), per step j = 0..J-1:
      (12 C + 4 I + 2 D + 4) T + (4 Vd + 2) K_j + 3 N H Lmax D + N H Lmax + 2 N H Lmax^2
      + Lmax^2 / 4
  (K_j = T - N j the anchors step j trains, counting every token as trained, an upper bound:
  the losses run at the trained anchors only; the trunk attention's dense scores, 2 N H Lmax^2,
  grow with the square of the sequence), plus
  for j >= 1 the branch keys (2 j + 3) H D T + (2 j + 4) H T, and once (k C + C + 2 J + 2) T.
  A deeper draft (draft.eagle3_layers = L) adds per step and further layer (7 C + 4 I + 4) T
  and the same attention terms as the first layer's (its trunk and branch, or its ring pass).
  Under cp each rank holds the whole share's targets and trains on its zigzag shard of T / cp
  tokens (and padding) with ring attention, no dense scores: per step
  (12 C + 4 I + 2 D + 4 Vd + 6 + 2 H D + 2 Hkv D + H) T + 2 j Hkv D T, once (k C + C + 2) T
  (K_j = T: the rank with the sequences' middle chunks trains all it holds).
  The largest minibatch's update sets the peak.

The block draft (draft.kind=block, `cospec.draft.block_ttt.block_unroll`; G = draft.ttt_steps block
positions, L = draft.block_layers layers) saves, counted the same way (tests/test_plan.py):
- once: the raw and fused features, the G x T token ids, the context's and the block's RoPE
  tables, the last layer's output (which the heads read): (k C + C + 2 G + 2 D + 2 G D + G C) T;
- per layer: the context's keys and values (2 C + 1) T, and the G positions through the layer at
  once, (7 C + 4 I + 2 + H D) G T (H D: the queries, kept whole for the G attention calls);
- per layer and block position i = 0..G-1, the attention over the context (trunk) and the block's
  keys 0..i (branch): dense, 3 N H Lm D + 2 N H Lm^2 + Lm^2 / 4 + N H Lm + 2 T
  + (2 i + 4) H D T + (2 i + 6) H T; under cp (the ring, on a rank's shard), (2 Hkv D + H + H D) T
  per position and 2 G Hkv D T per layer (the block's keys and values, rank-local);
- per block position i: the head and the loss (2 C + 1) T + (4 Vd + 2) K_i + 1, the sequential
  correction (3 C + 1) T, the confidence head (2 C + 1) T + 4 K_i (each when switched on), with
  K_i as for EAGLE-3's steps.
"""

from __future__ import annotations

from collections.abc import Sequence

from cospec.config.sections import ModelConfig

FP32 = 4


def trained_anchors(tokens: float, sequences: float, step: int, ring: bool) -> float:
    """K_j: the anchors whose TTT step j (or block position j) has a loss: those whose t + j is
    still inside their sequence, every token counted as trained (in training only the response
    tokens are, by their loss mask, so this bounds K_j from above; exact for a batch whose
    tokens are all trained). It assumes every sequence has at least j tokens (a chat prompt
    alone has more than any TTT depth). On a cp rank's shard: all of its tokens, which the rank
    holding the sequences' middle chunks trains (the last j tokens and the padding sit in the
    end chunks)."""
    return tokens if ring else max(0.0, tokens - sequences * step)


def ttt_activation_floats(d: ModelConfig, tokens: float, sequences: float, longest: int, *,
                          steps: int, taps: int, ring: bool = False, head: int = 0) -> float:
    """fp32 numbers the EAGLE-3 TTT unroll and loss save for backward on a batch of ``tokens``
    in ``sequences`` of up to ``longest`` (the module docstring's formula); ``d`` the draft's
    config, ``head`` its head's vocabulary Vd (0: d.vocab_size, a full head). ``ring``: a cp
    rank's zigzag shard of ``tokens``, its trunk attention the ring's. The losses run at the
    trained anchors only (`trained_anchors`)."""
    T, N, L, Vd = tokens, sequences, longest, head or d.vocab_size
    C, H, Hkv, D = d.hidden_size, d.num_heads, d.num_kv_heads, d.head_dim
    floats = (taps * C + C + 2 + (0 if ring else 2 * steps)) * T
    extra_layers = d.num_layers - 1  # a deeper draft's plain decoder layers
    for j in range(steps):
        floats += (12 * C + 4 * d.intermediate_size + 2 * D + 4) * T
        floats += extra_layers * (7 * C + 4 * d.intermediate_size + 4) * T
        floats += (4 * Vd + 2) * trained_anchors(T, N, j, ring)  # the losses' rows
        if ring:  # the ring's q, K/V, output and log-sum-exp; the branch keys and values
            attention = (2 * H * D + 2 * Hkv * D + H) * T + 2 * j * Hkv * D * T
        else:  # the dense trunk attention, and the branch
            attention = 3 * N * H * L * D + N * H * L + 2 * N * H * L * L + L * L / 4
            if j:
                attention += (2 * j + 3) * H * D * T + (2 * j + 4) * H * T
        floats += d.num_layers * attention  # every layer attends alike
    return floats


def block_activation_floats(d: ModelConfig, tokens: float, sequences: float, longest: int, *,
                           steps: int, taps: int, ring: bool = False, head: int = 0,
                           correction: bool = False, confidence: bool = True) -> float:
    """fp32 numbers the block draft's training (`block_unroll` and the loss) saves for backward on
    a batch of ``tokens`` in ``sequences`` of up to ``longest``: the module docstring's formula,
    ``d`` the draft's config (its num_layers the block's layers), ``steps`` the block positions G,
    ``head`` Vd (0: d.vocab_size); ``ring``: a cp rank's shard, its trunk attention the ring's."""
    T, N, Lm, G, Vd = tokens, sequences, longest, steps, head or d.vocab_size
    C, H, Hkv, D, Lyr = d.hidden_size, d.num_heads, d.num_kv_heads, d.head_dim, d.num_layers
    floats = (taps * C + C + 2 * G + 2 * D + 2 * G * D + G * C) * T
    per_layer = (2 * C + 1) * T + (7 * C + 4 * d.intermediate_size + 2 + H * D) * G * T
    if ring:
        per_layer += 2 * G * Hkv * D * T + G * (2 * Hkv * D + H + H * D) * T
    else:  # summed over i: sum (2 i + 4) = G (G + 3), sum (2 i + 6) = G (G + 5)
        per_layer += G * (3 * N * H * Lm * D + 2 * N * H * Lm * Lm + Lm * Lm / 4
                          + N * H * Lm + 2 * T) + G * (G + 3) * H * D * T + G * (G + 5) * H * T
    floats += Lyr * per_layer
    per_position = (2 * C + 1) * T + 1 + (3 * C + 1) * T * correction + (2 * C + 1) * T * confidence
    rows = sum(trained_anchors(T, N, i, ring) for i in range(G))  # the losses' rows
    return floats + G * per_position + (4 * Vd + 2 + 4 * confidence) * rows


def kept_share(minibatch: Sequence[int], per_batch: int) -> tuple[float, float]:
    """(tokens, sequences) the draft keeps of a minibatch of sequences of these lengths, given
    its share ``per_batch`` of the token budget (0: all): whole sequences, at least one."""
    T, N = sum(minibatch), len(minibatch)
    if not per_batch or T <= per_batch:
        return T, N
    keep = max(1, round(N * per_batch / T))
    return min(T, max(per_batch, keep * T / N)), keep


def kept_logit_bytes(head: int, autocast: str) -> int:
    """Bytes of a policy logit kept for the draft: the logits' own dtype (bf16 under the policy
    step's ``autocast``), but a reduced head's targets are computed in fp32 (`compress_to_head`)."""
    return 2 if autocast and not head else FP32


def kept_vocab(policy: ModelConfig, head: int = 0) -> int:
    """Vk: the numbers a token of the policy's logits are kept in for a draft whose head has
    ``head`` ids (0: the whole vocabulary)."""
    return head + 1 if head else policy.vocab_size


def draft_memory_bytes(policy: ModelConfig, d: ModelConfig, minibatches: Sequence[Sequence[int]],
                       *, steps: int, taps: int, features: int, max_tokens: int, cp: int = 1,
                       head: int = 0, kind: str = "eagle3", correction: bool = False,
                       confidence: bool = True, logit_bytes: int = FP32,
                       bucket: int = 0) -> dict[str, float]:
    """The module docstring's parts for a replica's ``minibatches`` (each the sequence lengths
    of one): ``draft_captured`` and ``draft_cotrain``. ``taps``:
    the distinct tapped layers (what is kept), ``features``: the draft's tap list (duplicates
    included: its input); ``head``: a reduced head's vocabulary Vd (0: the policy's); under
    ``cp`` the targets of the whole share, the activations of a rank's shard. ``kind``: eagle3
    or block (with its ``correction`` and ``confidence`` heads switched on or off).
    ``logit_bytes``: of a kept logit (`kept_logit_bytes`); ``bucket``: draft.token_bucket (an
    update trains on its share padded to a multiple of it, one sequence more)."""
    if kind not in ("eagle3", "block"):
        raise ValueError(f"draft memory is modelled for draft.kind eagle3 and block, not {kind!r}")
    per_batch = max(1, max_tokens // len(minibatches)) if max_tokens else 0
    Vk = kept_vocab(policy, head)
    # a kept token's features (fp32), logits and token id (int64) and loss mask, in bytes
    row = (taps * policy.hidden_size + 3) * FP32 + Vk * logit_bytes
    kept = update = 0.0
    for mb in minibatches:
        T, N = kept_share(mb, per_batch)
        kept += row * T
        padded_copy = 0.0
        if bucket > 1 and T % bucket:  # `pad_to_bucket`: the update's batch, a copy of the kept
            T, N = T + (-T % bucket), N + 1
            padded_copy = row * T
        # a cp rank's shard: 1 / cp of every sequence padded by (2 cp - 1) / 2 on average
        local = T if cp == 1 else (T + N * (2 * cp - 1) / 2) / cp
        if kind == "block":
            saved = block_activation_floats(d, local, N, max(mb), steps=steps, taps=features,
                                            ring=cp > 1, head=head, correction=correction,
                                            confidence=confidence)
        else:
            saved = ttt_activation_floats(d, local, N, max(mb), steps=steps, taps=features,
                                          ring=cp > 1, head=head)
        update = max(update, steps * Vk * T * logit_bytes + saved * FP32 + padded_copy)
    return {"draft_captured": kept, "draft_cotrain": update}
