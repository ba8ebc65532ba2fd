"""What the GRPO policy step saves for backward on a rank: the formula `cospec plan`
(`cospec.parallel.plan`) sizes activations with.

# L layers, C hidden size, I MLP width, H / Hkv query / key-value heads, D head dim, V vocab,
# T tokens a rank trains on at once in N sequences of up to Lmax

What this implementation saves (counted with `cospec.metrics.saved_activations`;
`tests/test_plan.py` checks the formula on every stage kind and the peak of whole trainer steps),
per microbatch, in fp32: per layer (7C + 4I + 2) T in token layout and (2HD + 2HkvD + H) N Lmax
in the attention's padded layout (ring attention under cp: T); per stage (2D + 2) T of RoPE
tables and 2 T + 2 N Lmax of attention indices; the token ids 2 T on the first stage; on the
last the final norm's and the head's inputs (3C + 1) T and the GRPO loss (V + 7) T, 3 V T more
with a KL penalty.

Under bf16 autocast (grpo.autocast), by dtype: the norms, the attention's log-sum-exp and the
loss in fp32; the matmuls' inputs (3 C + 4 I a token and layer: the norms cast their output once
for q, k, v and for gate, up) and the attention's q, k, v and output in bf16 (the ring's output
in fp32); and the bf16 copy autocast makes of every matmul weight for each forward, held until
its backward (under pp: one copy per microbatch in flight; under FSDP2: of the unsharded
weights).

The peak: a minibatch at a time, its sequences as the trainer splits them (replica, minibatch,
pp microbatches balanced in tokens, cp zigzag padding), and under pp the microbatches the
schedule holds between their forward and backward. Given the rollouts' lengths it is the
trainer's peak; at one length for all, ragged rollouts exceed it (rows padded to the longest,
microbatches of more rows): size with the longest length, which bounded every run measured in
docs/results/parallel_grpo.md.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from cospec.config import RunConfig
from cospec.config.sections import ModelConfig
from cospec.data.packing import balanced_cuts
from cospec.parallel.pipeline import schedule_actions, split_layers

FP32 = 4


def activation_bytes(m: ModelConfig, lengths: Sequence[int], *, layers: int, first: bool,
                     last: bool, kl: bool, ring: bool = False, autocast: bool = False) -> float:
    """Bytes saved for backward by one forward of a packed row of sequences of ``lengths`` tokens
    on a stage of ``layers`` layers (the module docstring's formula). The attention's part sits
    in the padded [N, Lmax] layout, or with ``ring`` (cp ring attention) in the row's own.
    ``autocast``: under bf16 autocast (``grpo.autocast``), with its bf16 weight copies."""
    C, I, H, Hkv, D = m.hidden_size, m.intermediate_size, m.num_heads, m.num_kv_heads, m.head_dim
    T = sum(lengths)
    slots = T if ring else len(lengths) * max(lengths)
    # RoPE tables and the attention's two int64 indices (token layout, padded layout); the token
    # ids on the first stage; the final norm's and the head's inputs on the last; the GRPO loss,
    # always fp32 (autocast runs log_softmax in fp32)
    outside = (2 * D + 2 + 2 * first) * T + 2 * slots
    loss = (m.vocab_size + 7 + (3 * m.vocab_size if kl else 0)) * T if last else 0
    if not autocast:
        per_layer = (7 * C + 4 * I + 2) * T + (2 * H * D + 2 * Hkv * D + H) * slots
        return FP32 * (layers * per_layer + outside + (3 * C + 1) * T * last + loss)
    # bf16 autocast: the norms stay fp32 (their inputs, 1 / rms and outputs: (4 C + 2) T) and
    # cast their output to bf16 once for the matmuls that read it (q, k, v; gate, up); each
    # matmul saves its bf16 input (3 C T with o_proj's, 4 I T in the MLP) and autocast's bf16
    # copy of its weight (one for every forward, held until its backward); attention in bf16 but
    # its log-sum-exp (and the ring's output, computed in fp32)
    weights = 2 * C * H * D + 2 * C * Hkv * D + 3 * C * I
    if ring:
        attn_fp32, attn_bf16 = (H * D + H) * slots, (H * D + 2 * Hkv * D) * slots
    else:
        attn_fp32, attn_bf16 = H * slots, (2 * H * D + 2 * Hkv * D) * slots
    fp32 = layers * ((4 * C + 2) * T + attn_fp32) + outside + (2 * C + 1) * T * last + loss
    bf16 = layers * ((3 * C + 4 * I) * T + attn_bf16 + weights) + (C * T + m.vocab_size * C) * last
    return FP32 * fp32 + 2 * bf16


def rank_microbatches(cfg: RunConfig, lengths: Sequence[int], replica: int) -> list[list[list[int]]]:
    """The sequence lengths one rank of dp replica ``replica`` runs forward at once, per minibatch
    and microbatch, from the step's rollout lengths (trained tokens, in rollout order), split as
    the trainer splits them: replica r holds its contiguous share of the groups
    (`GRPOTrainer.generate`), minibatch i its rollouts of global index i modulo micro_steps
    (`replica_chunks`), under pp M microbatches balanced in tokens (`balanced_cuts`), and under cp
    each sequence padded to a multiple of 2 cp and a rank's zigzag share 1 / cp of it."""
    p = cfg.parallel
    out = []
    for rows in replica_minibatches(cfg, lengths, replica):
        cu = torch.tensor([0, *itertools.accumulate(rows)])
        cuts = balanced_cuts(cu, p.microbatches) if p.pp > 1 else [0, len(rows)]
        micro = [rows[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
        if p.cp > 1:
            micro = [[-(-n // (2 * p.cp)) * 2 for n in mb] for mb in micro]
        out.append(micro)
    return out


def replica_minibatches(cfg: RunConfig, lengths: Sequence[int], replica: int) -> list[list[int]]:
    """The whole sequences' lengths of each minibatch of dp replica ``replica``."""
    p, g = cfg.parallel, cfg.grpo
    share = len(lengths) // p.dp
    mine = range(replica * share, (replica + 1) * share)
    return [[lengths[k] for k in mine if k % g.micro_steps == i] for i in range(g.micro_steps)]


def activation_peak_bytes(cfg: RunConfig, lengths: Sequence[int], *, stage: int,
                          replica: int = 0) -> float:
    """The most bytes saved for backward at once on a rank of ``stage`` and dp ``replica``: one
    minibatch at a time, and under pp the microbatches its schedule has run forward and not yet
    backward (`schedule_actions`: 1F1B at most pp - stage of them, GPipe all M)."""
    p = cfg.parallel
    layers = split_layers(cfg.model.num_layers, p.pp)[stage]
    kl = bool(cfg.grpo.kl_coef or cfg.grpo.log_kl)
    peak = 0.0
    for micro in rank_microbatches(cfg, lengths, replica):
        each = [activation_bytes(cfg.model, mb, layers=len(layers), first=stage == 0,
                                 last=stage == p.pp - 1, kl=kl, ring=p.cp > 1,
                                 autocast=bool(cfg.grpo.autocast)) for mb in micro]
        live = 0.0
        for action, m in schedule_actions(p.schedule, stage, p.pp, len(micro)):
            live += each[m] if action == "F" else -each[m]
            peak = max(peak, live)
    return peak
