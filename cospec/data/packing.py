"""Sequence packing: several examples concatenated into one row, attention kept within each.

Packing spends no compute on padding; `cu_seqlens` (cumulative sequence lengths, as flash-attention
names them) tells the model where each example starts, so positions restart and attention never
crosses a boundary (`cospec.models.attention.AttentionLayout`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class PackedBatch:
    """One packed row of several examples.

    tokens: [1, T] inputs; targets: [1, T] next tokens; loss_mask: [1, T] 1.0 where the target is an
    answer/EOS token; cu_seqlens: [N+1]. Targets never cross a boundary: each example contributes
    its ids[:-1] as inputs and ids[1:] as targets.
    Example: examples of ids [1,5,6,2] (mask 0,0,1,1) and [1,7,2] (mask 0,0,1) pack to
    tokens [1,5,6, 1,7], targets [5,6,2, 7,2], loss_mask [0,1,1, 0,1], cu_seqlens [0,3,5].
    """

    tokens: Tensor
    targets: Tensor
    loss_mask: Tensor
    cu_seqlens: Tensor


def pack_examples(encoded: list[tuple[list[int], list[int]]]) -> PackedBatch:
    inputs, targets, mask, cu = [], [], [], [0]
    for ids, m in encoded:
        inputs += ids[:-1]
        targets += ids[1:]
        mask += m[1:]
        cu.append(len(inputs))
    return PackedBatch(tokens=torch.tensor([inputs]), targets=torch.tensor([targets]),
                       loss_mask=torch.tensor([mask], dtype=torch.float32),
                       cu_seqlens=torch.tensor(cu))


def balanced_cuts(cu_seqlens: Tensor, parts: int) -> list[int]:
    """Sequence indices [0, c_1, ..., n] that cut a packed row of n sequences into ``parts``
    contiguous pieces of whole sequences, balanced in tokens: cut k is the sequence boundary
    nearest to k T / parts (the earlier on a tie), kept so that every piece has a sequence.
    Example: lengths 36, 43, 45, 43 in two parts cut at 2 (79 | 88 tokens), not at 3 (124 | 43),
    the first boundary past T / 2; the pipeline's peak memory is its largest microbatch's."""
    n = len(cu_seqlens) - 1
    if not 1 <= parts <= n:
        raise ValueError(f"cannot split {n} sequences into {parts} microbatches (need 1..{n}); "
                         f"lower parallel.microbatches or raise the rollouts per minibatch")
    bounds = cu_seqlens.to(torch.float64)
    total = float(bounds[-1])
    cuts = [0]
    for k in range(1, parts):
        nearest = int((bounds - total * k / parts).abs().argmin())  # argmin: the first of a tie
        cuts.append(min(max(nearest, cuts[-1] + 1), n - (parts - k)))
    cuts.append(n)
    return cuts


def sequence_rows(cu_seqlens: Tensor, chosen: list[int]) -> Tensor:
    """long [sum of their lengths]: the packed rows of sequences ``chosen`` (indices into
    ``cu_seqlens``' sequences), in order; one read of ``cu_seqlens`` to the host."""
    cu = cu_seqlens.tolist()
    rows = [torch.arange(cu[i], cu[i + 1]) for i in chosen] or [torch.zeros(0, dtype=torch.long)]
    return torch.cat(rows).to(cu_seqlens.device)
