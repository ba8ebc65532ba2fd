"""What the GRPO policy step saves for backward on a rank: the formula `cospec plan`
(`cospec.parallel.plan`) sizes activations with.

# L layers, C hidden size, I MLP width, H / Hkv query / key-value heads, D head dim, V vocab,
# T tokens a rank trains on at once in N sequences of up to Lmax

What this implementation saves (counted with `cospec.metrics.saved_activations`;
`tests/test_plan.py` checks the formula on every stage kind and the peak of whole trainer steps),
per microbatch, in fp32: per layer (7C + 4I + 2) T in token layout and (2HD + 2HkvD + H) N Lmax
in the attention's padded layout (ring attention under cp: T); per stage 2D T of RoPE
tables and 2 T of the attention's index (4 T under cp); the token ids 2 T on the first stage; on
the last the final norm's and the head's inputs (3C + 1) K and the GRPO loss (V + 7) K, 3 V K
more with a KL penalty, where K = T, or under neither cp nor pp (the step runs the head at the
response positions only) K = the response tokens, and the head's index 2 K more.

Under bf16 autocast (grpo.autocast), by dtype: the norms, the attention's log-sum-exp and the
loss in fp32; the matmuls' inputs (3 C + 4 I a token and layer: the norms cast their output once
for q, k, v and for gate, up) and the attention's q, k, v and output in bf16 (the ring's output
in fp32; on a CPU all of the padded attention in fp32, `cospec.models.attention.sdpa_attention`);
and the bf16 copy autocast makes of every matmul weight for each forward, held until its
backward (under pp: one copy per microbatch in flight; under FSDP2: of the unsharded weights).

`cospec plan` has the trained lengths only, not the prompts', so it counts the head at every
position (K = T): an upper bound for the single-process and dp steps.

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
from cospec.models.precision import runs_on_cpu
from cospec.parallel.pipeline import schedule_actions, split_layers

FP32 = 4


def activation_bytes(m: ModelConfig, lengths: Sequence[int], *, layers: int, first: bool,
                     last: bool, kl: bool, ring: bool = False, autocast: bool = False,
                     attention_fp32: bool = False, head_tokens: int | None = None) -> float:
    """Bytes saved for backward by one forward of a packed row of sequences of ``lengths`` tokens
    on a stage of ``layers`` layers (the module docstring's formula). The attention's part sits
    in the padded [N, Lmax] layout, or with ``ring`` (cp ring attention) in the row's own.
    ``autocast``: under bf16 autocast (``grpo.autocast``), with its bf16 weight copies;
    ``attention_fp32``: its padded attention in fp32 all the same (on a CPU,
    `cospec.models.attention.sdpa_attention`). ``head_tokens``: the positions the final norm,
    the head and the loss run at (None: all T; the single-process and dp steps run them at the
    K response positions only, `cospec.rl.policy_step`)."""
    C, I, H, Hkv, D = m.hidden_size, m.intermediate_size, m.num_heads, m.num_kv_heads, m.head_dim
    T = sum(lengths)
    K = T if head_tokens is None else head_tokens
    slots = T if ring else len(lengths) * max(lengths)
    # RoPE tables and the attention's int64 index (the ring's: two); the token
    # ids on the first stage; the final norm's and the head's inputs on the last (and the int64
    # indices of the head's positions when it runs at some); the GRPO loss, always fp32
    # (autocast runs log_softmax in fp32)
    picked = 2 * K if last and head_tokens is not None else 0  # the head's positions (int64)
    outside = (2 * D + 2 + 2 * first) * T + (2 * slots if ring else 0) + picked
    loss = (m.vocab_size + 7 + (3 * m.vocab_size if kl else 0)) * K if last else 0
    if not autocast:
        per_layer = (7 * C + 4 * I + 2) * T + (2 * H * D + 2 * Hkv * D + H) * slots
        return FP32 * (layers * per_layer + outside + (3 * C + 1) * K * last + loss)
    # bf16 autocast: the norms stay fp32 (their inputs, 1 / rms and outputs: (4 C + 2) T) and
    # cast their output to bf16 once for the matmuls that read it (q, k, v; gate, up); each
    # matmul saves its bf16 input (3 C T with o_proj's, 4 I T in the MLP) and autocast's bf16
    # copy of its weight (one for every forward, held until its backward); attention in bf16 but
    # its log-sum-exp (and the ring's output, computed in fp32)
    weights = 2 * C * H * D + 2 * C * Hkv * D + 3 * C * I
    if ring:
        attn_fp32, attn_bf16 = (H * D + H) * slots, (H * D + 2 * Hkv * D) * slots
    elif attention_fp32:
        attn_fp32, attn_bf16 = (2 * H * D + 2 * Hkv * D + H) * slots, 0
    else:
        attn_fp32, attn_bf16 = H * slots, (2 * H * D + 2 * Hkv * D) * slots
    fp32 = layers * ((4 * C + 2) * T + attn_fp32) + outside + (2 * C + 1) * K * last + loss
    bf16 = layers * ((3 * C + 4 * I) * T + attn_bf16 + weights) + (C * K + m.vocab_size * C) * last
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
                          replica: int = 0, responses: Sequence[int] | None = None) -> float:
    """The most bytes saved for backward at once on a rank of ``stage`` and dp ``replica``: one
    minibatch at a time, and under pp the microbatches its schedule has run forward and not yet
    backward (`schedule_actions`: 1F1B at most pp - stage of them, GPipe all M).
    ``responses``: each rollout's response tokens (rollout order), where the layout's step runs
    the head at them only (no pp, no cp); None counts the head at every trained position, which
    bounds it from above."""
    p = cfg.parallel
    layers = split_layers(cfg.model.num_layers, p.pp)[stage]
    kl = bool(cfg.grpo.kl_coef or cfg.grpo.log_kl)
    autocast = bool(cfg.grpo.autocast)
    picks_head = responses is not None and p.pp == 1 and p.cp == 1
    heads = rank_microbatches(cfg, responses, replica) if picks_head else None
    peak = 0.0
    for i, micro in enumerate(rank_microbatches(cfg, lengths, replica)):
        each = [activation_bytes(cfg.model, mb, layers=len(layers), first=stage == 0,
                                 last=stage == p.pp - 1, kl=kl, ring=p.cp > 1, autocast=autocast,
                                 attention_fp32=autocast and runs_on_cpu(cfg),
                                 head_tokens=sum(heads[i][j]) if heads else None)
                for j, mb in enumerate(micro)]
        live = 0.0
        for action, m in schedule_actions(p.schedule, stage, p.pp, len(micro)):
            live += each[m] if action == "F" else -each[m]
            peak = max(peak, live)
    return peak
