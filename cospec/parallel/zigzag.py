"""Zigzag sharding of packed sequences for context parallelism (docs/design.md, "Context parallel").

# N sequences, T packed tokens, P padded packed tokens, L local tokens per rank (P / cp)

Every sequence of a packed row is padded at its end to a multiple of 2*cp tokens and cut into 2*cp
chunks of c = padded_len / (2*cp) tokens. Rank r holds chunks r and 2*cp-1-r of every sequence, in
increasing position order, sequence after sequence:

    cp = 2, one sequence of 6 tokens -> padded to 8, chunks [0 1] [2 3] [4 5] [6 7]
    rank 0 holds [0 1 | 6 7], rank 1 holds [2 3 | 4 5]

Under causal attention chunk i costs ~(i + 1/2) c^2, so the pair (r, 2*cp-1-r) always sums to the same
work. Each rank then sees a packed row of its own whose sequences have local length 2c (even); its
``cu_seqlens`` are the padded ones divided by cp, exactly. Padding sits after each sequence's last
token, so under causal attention real tokens never see it; a loss must skip it (``shard`` takes the
value to pad with, e.g. an ignore label).

Per-token tensors that belong to an anchor position (the draft's branch keys at TTT steps 2..j) are
sharded with the same plan along their token dim, so they live on the rank of their anchor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from cospec.data.packing import sequence_rows


def check_cu_seqlens(cu_seqlens: Tensor, name: str = "cu_seqlens") -> None:
    """ValueError unless cu_seqlens is 1-D, integer, starts at 0 and strictly increases."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"{name} must be 1-D [N+1] with N >= 1, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got {cu_seqlens.dtype}")
    if int(cu_seqlens[0]) != 0 or not bool((cu_seqlens[1:] > cu_seqlens[:-1]).all()):
        raise ValueError(f"{name} must start at 0 and strictly increase (no empty sequence), got "
                         f"{cu_seqlens.tolist()}")


@dataclass(frozen=True)
class ZigzagLayout:
    """The zigzag plan of one packed row for a context-parallel group of ``cp`` ranks.

    cu_seqlens: int [N+1] of the unpadded packed row (as the model takes it).
    padded_cu_seqlens: int [N+1], every sequence padded up to a multiple of 2*cp.
    Example, cp = 2, lengths 5 and 2: cu_seqlens [0, 5, 7] -> padded [0, 8, 12]; rank 0 holds padded
    tokens [0 1 6 7 | 8 11], rank 1 holds [2 3 4 5 | 9 10]; local cu_seqlens [0, 4, 6] on both.
    """

    cu_seqlens: Tensor
    padded_cu_seqlens: Tensor
    cp: int

    @classmethod
    def build(cls, cu_seqlens: Tensor, cp: int) -> "ZigzagLayout":
        if not isinstance(cp, int) or cp < 1:
            raise ValueError(f"cp must be a positive integer, got {cp!r}")
        cu_seqlens = cu_seqlens.to(torch.long)
        check_cu_seqlens(cu_seqlens)
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        padded = (lengths + 2 * cp - 1) // (2 * cp) * (2 * cp)
        padded_cu = torch.cat([padded.new_zeros(1), padded.cumsum(0)])
        return cls(cu_seqlens=cu_seqlens, padded_cu_seqlens=padded_cu, cp=cp)

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    @property
    def num_padded(self) -> int:
        return int(self.padded_cu_seqlens[-1])

    @property
    def num_local(self) -> int:
        return self.num_padded // self.cp

    def local_cu_seqlens(self) -> Tensor:
        """int [N+1]: the same on every rank (each holds 2 of the 2*cp equal chunks)."""
        return self.padded_cu_seqlens // self.cp

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.cp:
            raise ValueError(f"rank {rank} out of range for cp={self.cp}")

    def local_index(self, rank: int) -> Tensor:
        """int [L]: index in the padded packed row of every token rank ``rank`` holds, in order."""
        self._check_rank(rank)
        cu = self.padded_cu_seqlens
        chunk_N = (cu[1:] - cu[:-1]) // (2 * self.cp)
        starts_N2 = torch.stack([cu[:-1] + rank * chunk_N,
                                 cu[:-1] + (2 * self.cp - 1 - rank) * chunk_N], dim=1)
        # Token i of the local row: sequence n, half h, offset o; lengths 2c_n sum to L.
        local_cu = self.local_cu_seqlens()
        idx = torch.arange(self.num_local, device=cu.device)
        seq = torch.bucketize(idx, local_cu[1:], right=True)
        offset = idx - local_cu[seq]
        half = offset // chunk_N[seq]
        return starts_N2[seq, half] + offset - half * chunk_N[seq]

    def select(self, chosen: Sequence[int]) -> tuple["ZigzagLayout", Tensor]:
        """The layout of sequences ``chosen`` alone (increasing indices, at least one) and the
        rows of every rank's local shard that hold them: zigzag cuts each sequence on its own,
        so a shard of the selection is those rows of the whole row's shard (what a gather of
        the chosen sequences only reads)."""
        lengths = self.cu_seqlens[1:] - self.cu_seqlens[:-1]
        kept = lengths[list(chosen)]
        layout = ZigzagLayout.build(torch.cat([kept.new_zeros(1), kept.cumsum(0)]), self.cp)
        return layout, sequence_rows(self.local_cu_seqlens(), list(chosen))

    def local_positions(self, rank: int) -> Tensor:
        """int [L]: position of every local token within its own sequence (for RoPE)."""
        idx = self.local_index(rank)
        seq = torch.bucketize(idx, self.padded_cu_seqlens[1:], right=True)
        return idx - self.padded_cu_seqlens[seq]

    def padded_index(self) -> Tensor:
        """int [T]: where every real token of the unpadded row sits in the padded row."""
        t = torch.arange(self.num_tokens, device=self.cu_seqlens.device)
        seq = torch.bucketize(t, self.cu_seqlens[1:], right=True)
        return t - self.cu_seqlens[seq] + self.padded_cu_seqlens[seq]

    def pad(self, x: Tensor, dim: int = -1, value: float = 0) -> Tensor:
        """[..., T, ...] -> [..., P, ...] with ``value`` in every sequence's padding."""
        dim = dim % x.dim()
        if x.shape[dim] != self.num_tokens:
            raise ValueError(f"tensor dim {dim} has {x.shape[dim]} tokens, the packed row has "
                             f"{self.num_tokens} (cu_seqlens {self.cu_seqlens.tolist()})")
        shape = list(x.shape)
        shape[dim] = self.num_padded
        out = x.new_full(shape, value)
        return out.index_copy(dim, self.padded_index().to(x.device), x)

    def shard(self, x: Tensor, rank: int, dim: int = -1, value: float = 0) -> Tensor:
        """The local part [..., L, ...] of an unpadded [..., T, ...] tensor, padding with ``value``."""
        return self.pad(x, dim, value).index_select(dim, self.local_index(rank).to(x.device))

    def unshard(self, shards: Sequence[Tensor], dim: int = -1) -> Tensor:
        """Inverse of `shard`: the per-rank parts (rank order) back to the unpadded [..., T, ...]."""
        if len(shards) != self.cp:
            raise ValueError(f"unshard needs {self.cp} shards (one per rank), got {len(shards)}")
        dim = dim % shards[0].dim()
        for r, s in enumerate(shards):
            if s.shape[dim] != self.num_local:
                raise ValueError(f"shard of rank {r} has {s.shape[dim]} tokens on dim {dim}, "
                                 f"expected {self.num_local}")
        device = shards[0].device
        order = torch.cat([self.local_index(r) for r in range(self.cp)]).to(device)
        padded = torch.cat(list(shards), dim).index_select(dim, torch.argsort(order))
        return padded.index_select(dim, self.padded_index().to(device))

    def gather(self, x_local: Tensor, group: dist.ProcessGroup | None = None,
               dim: int = -1) -> Tensor:
        """All-gather every rank's shard and unshard (for logits/logprobs in the unsharded order).

        A collective: every rank of ``group`` must call it. Not differentiable.
        """
        num_ranks = dist.get_world_size(group)
        if num_ranks != self.cp:
            raise ValueError(f"process group has {num_ranks} ranks, the zigzag layout cp={self.cp}")
        parts = [torch.empty_like(x_local) for _ in range(num_ranks)]
        dist.all_gather(parts, x_local.contiguous(), group=group)
        return self.unshard(parts, dim)


def causal_pairs_per_rank(layout: ZigzagLayout) -> list[int]:
    """Count of (query, key) pairs with key <= query in the same sequence that each rank's queries
    attend, padding included (it is computed like real tokens). Balanced when all are equal."""
    counts = []
    for r in range(layout.cp):
        pos = layout.local_positions(r)
        counts.append(int((pos + 1).sum()))
    return counts
