"""Input validation for the ring: a bad input fails on every rank with a clear error, never a hang.

A ring step blocks until its neighbour sends; if one rank raised on a bad shape and left, the others
would wait for the process-group timeout. So each rank first checks its own inputs, then all ranks
exchange a small signature (one all-gather) and *every* rank raises if any rank's input is bad or the
ranks disagree (different local lengths, sequence counts, heads, branch depth).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

_FIELDS = ("ok", "local tokens", "sequences", "query heads", "kv heads", "head dim",
           "branch depth", "cu_seqlens checksum")


def local_input_error(q_HLD: Tensor, k_HkvLD: Tensor, v_HkvLD: Tensor, cu_seqlens: Tensor,
                      bk_JHkvLD: Tensor, bv_JHkvLD: Tensor) -> str:
    """'' when this rank's shard is well formed, else what is wrong."""
    if q_HLD.dim() != 3 or k_HkvLD.dim() != 3:
        return f"q must be [H, L, D] and k/v [Hkv, L, D], got {tuple(q_HLD.shape)}, " \
               f"{tuple(k_HkvLD.shape)}"
    H, L, D = q_HLD.shape
    if v_HkvLD.shape != k_HkvLD.shape or k_HkvLD.shape[1:] != (L, D):
        return f"k/v must be [Hkv, {L}, {D}], got {tuple(k_HkvLD.shape)} and {tuple(v_HkvLD.shape)}"
    if H % k_HkvLD.shape[0] != 0:
        return f"query heads {H} must be a multiple of kv heads {k_HkvLD.shape[0]}"
    if bk_JHkvLD.shape[1:] != k_HkvLD.shape or bv_JHkvLD.shape != bk_JHkvLD.shape:
        return f"branch k/v must be [J, {k_HkvLD.shape[0]}, {L}, {D}], got " \
               f"{tuple(bk_JHkvLD.shape)} and {tuple(bv_JHkvLD.shape)}"
    cu = cu_seqlens
    if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != L:
        return f"local cu_seqlens must run from 0 to the local length {L}, got {cu.tolist()}"
    lengths = cu[1:] - cu[:-1]
    if bool((lengths <= 0).any()) or bool((lengths % 2).any()):
        return (f"local sequence lengths {lengths.tolist()} must be positive and even: shard the "
                f"packed row with ZigzagLayout (each sequence padded to a multiple of 2*cp)")
    return ""


def check_ring_inputs(q_HLD: Tensor, k_HkvLD: Tensor, v_HkvLD: Tensor, cu_seqlens: Tensor,
                      bk_JHkvLD: Tensor, bv_JHkvLD: Tensor,
                      group: dist.ProcessGroup | None) -> None:
    """ValueError on every rank if any rank's input is bad or ranks disagree. A collective."""
    error = local_input_error(q_HLD, k_HkvLD, v_HkvLD, cu_seqlens, bk_JHkvLD, bv_JHkvLD)
    if error:
        sig = [0] + [-1] * (len(_FIELDS) - 1)
    else:
        cu = cu_seqlens.to(torch.long)
        checksum = int((cu * torch.arange(1, len(cu) + 1, device=cu.device)).sum())
        sig = [1, q_HLD.shape[1], len(cu) - 1, q_HLD.shape[0], k_HkvLD.shape[0], q_HLD.shape[2],
               bk_JHkvLD.shape[0], checksum]
    mine = torch.tensor(sig, dtype=torch.long, device=q_HLD.device)
    num_ranks = dist.get_world_size(group)
    every = [torch.empty_like(mine) for _ in range(num_ranks)]
    dist.all_gather(every, mine, group=group)
    rank = dist.get_rank(group)
    if error:
        raise ValueError(f"ring attention, rank {rank}: {error}")
    bad = [r for r, s in enumerate(every) if int(s[0]) == 0]
    if bad:
        raise ValueError(f"ring attention: rank(s) {bad} got a malformed shard (see their error)")
    for i, name in enumerate(_FIELDS[1:], start=1):
        values = [int(s[i]) for s in every]
        if len(set(values)) > 1:
            raise ValueError(f"ring attention: ranks disagree on {name}: {values} (every rank "
                             f"must hold its zigzag shard of the same packed row)")
