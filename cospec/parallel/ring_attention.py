"""Zigzag ring attention over packed sequences, with the draft's branch keys merged in one softmax.

# H query heads, Hkv kv heads, L local packed tokens, J branch keys per query, D head dim,
# N sequences, S rows of a sequence in the halves layout (cospec/parallel/block_attention.py)

Computes exactly `cospec.models.branch_attention.trunk_branch_attention`, sharded: every rank holds
its zigzag part (cospec/parallel/zigzag.py) of q, the trunk k/v and the branch k/v, and gets its part
of (out, lse). docs/design.md, "Context parallel: zigzag ring attention" and "EAGLE-3 training-time test":

Forward, one ring pass of the trunk K/V (branch K/V never leave the rank, no all-gather anywhere):
1. At step s rank r holds the K/V block of rank j = (r - s) mod cp. The transfer of the next block
   (send to r+1, receive from r-1) is posted *before* computing on the current one, so it overlaps.
2. Zigzag cases: s = 0 (diagonal) causal; j < r both local chunks against the block's first chunk;
   j > r only the local second chunk against the whole block. Sequences never meet (packed).
3. Partial (out, lse) merged by log-sum-exp in fp32 (`merge_attention`).
4. The branch part (each query against the J branch keys of its own position) is computed locally,
   once, and merged the same way: a branch query sees on every trunk block exactly what its anchor's
   trunk query sees, because it *is* that query's row of the merged softmax.

Backward (custom autograd Function, recomputing scores from the saved merged out and lse):
5. dq accumulates locally; the K/V blocks travel the ring again and their dk/dv accumulators travel
   with them, each rank adding its share, and arrive back at their owner after cp hops.
6. Branch gradients locally from the merged lse (docs/design.md, "Branch backward").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from cospec.models.attention import AttentionLayout
from cospec.models.branch_attention import branch_attention, merge_attention
from cospec.parallel.block_attention import HalvesLayout, acc_dtype, block_backward, block_forward
from cospec.parallel.ring_checks import check_ring_inputs
from cospec.parallel.zigzag import ZigzagLayout

_TAG_KV, _TAG_DKV = 1, 2


@dataclass
class RingStats:
    """Bytes this rank put on the wire (forward and backward), for benchmarks."""

    sent_bytes: int = 0


class _Ring:
    """Neighbour exchange on a process group: send to rank+1, receive from rank-1."""

    def __init__(self, group: dist.ProcessGroup | None, stats: RingStats | None):
        self.group, self.stats = group, stats
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size) if group else \
            (self.rank + 1) % self.size
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size) if group else \
            (self.rank - 1) % self.size

    def exchange(self, send: Tensor, tag: int) -> tuple[Tensor, list]:
        """Post send(send -> next) and recv(<- prev) into a new buffer; wait on the returned reqs."""
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, self.next, self.group, tag),
               dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)]
        if self.stats is not None:
            self.stats.sent_bytes += send.numel() * send.element_size()
        return recv, dist.batch_isend_irecv(ops)


def _case(ring: _Ring, step: int, hl: HalvesLayout) -> tuple[slice, slice, Tensor]:
    """Zigzag case at ``step``: (query rows, key rows, mask [N, Q, K]) of the halves layout."""
    S, c = 2 * hl.cmax, hl.cmax
    valid = hl.valid_NS[:, None, :]  # [N, 1, S] visible keys
    if step == 0:  # diagonal: causal in the halves order (it is increasing position order)
        causal = torch.ones(S, S, dtype=torch.bool, device=valid.device).tril()
        return slice(0, S), slice(0, S), causal[None] & valid
    source = (ring.rank - step) % ring.size
    if source < ring.rank:  # earlier rank: all local queries, its first chunk only, no mask
        return slice(0, S), slice(0, c), valid[:, :, :c]
    return slice(c, S), slice(0, S), valid  # later rank: local second chunk, whole block


def _ring_forward(ring: _Ring, q_NHSD: Tensor, kv_2HkvLD: Tensor, hl: HalvesLayout,
                  scale: float) -> tuple[Tensor, Tensor]:
    """Steps 1-3: merged trunk (out [N, H, S, D], lse [N, H, S]) over all cp blocks."""
    dt = q_NHSD.dtype
    out = lse = None
    for step in range(ring.size):
        pending = ring.exchange(kv_2HkvLD, _TAG_KV) if step + 1 < ring.size else None
        rows, cols, mask = _case(ring, step, hl)
        k = hl.to_halves(kv_2HkvLD[0].to(dt))[:, :, cols]
        v = hl.to_halves(kv_2HkvLD[1].to(dt))[:, :, cols]
        o_b, lse_b = block_forward(q_NHSD[:, :, rows], k, v, mask, scale)
        if out is None:
            out, lse = o_b, lse_b
        else:
            out[:, :, rows], lse[:, :, rows] = merge_attention(out[:, :, rows], lse[:, :, rows],
                                                               o_b, lse_b)
        if pending is not None:
            nxt, reqs = pending
            for req in reqs:
                req.wait()
            kv_2HkvLD = nxt
    return out, lse


def _ring_backward(ring: _Ring, do_NHSD: Tensor, q_NHSD: Tensor, kv_2HkvLD: Tensor,
                   lse_NHS: Tensor, delta_NHS: Tensor, hl: HalvesLayout,
                   scale: float) -> tuple[Tensor, Tensor]:
    """Step 5: (dq [N, H, S, D], dkv [2, Hkv, L, D] of this rank's own block)."""
    dt = q_NHSD.dtype
    dq = torch.zeros_like(q_NHSD)
    dkv, dkv_pending = None, None
    for step in range(ring.size):
        pending = ring.exchange(kv_2HkvLD, _TAG_KV) if step + 1 < ring.size else None
        rows, cols, mask = _case(ring, step, hl)
        k_full = hl.to_halves(kv_2HkvLD[0].to(dt))
        v_full = hl.to_halves(kv_2HkvLD[1].to(dt))
        dq_b, dk_b, dv_b = block_backward(do_NHSD[:, :, rows], q_NHSD[:, :, rows],
                                          k_full[:, :, cols], v_full[:, :, cols],
                                          lse_NHS[:, :, rows], delta_NHS[:, :, rows], mask, scale)
        dq[:, :, rows] += dq_b
        dk_full, dv_full = torch.zeros_like(k_full), torch.zeros_like(v_full)
        dk_full[:, :, cols], dv_full[:, :, cols] = dk_b, dv_b
        dkv = torch.stack([hl.from_halves(dk_full), hl.from_halves(dv_full)])
        if dkv_pending is not None:  # the accumulator of this block, from the previous rank
            acc, reqs = dkv_pending
            for req in reqs:
                req.wait()
            dkv = dkv + acc
        if ring.size > 1:
            dkv_pending = ring.exchange(dkv, _TAG_DKV)
        if pending is not None:
            nxt, reqs = pending
            for req in reqs:
                req.wait()
            kv_2HkvLD = nxt
    if dkv_pending is not None:  # after cp hops the accumulator of our own block is back
        dkv, reqs = dkv_pending
        for req in reqs:  # each request is waited on exactly once (gloo hangs on a second wait)
            req.wait()
    return dq, dkv


def branch_backward(do_HLD, q_HLD, bk_JHkvLD, bv_JHkvLD, out_HLD, lse_HL, scale):
    """Step 6 (docs/design.md, "Branch backward"): w_i = exp(s_i - L); ds_i = w_i <dO, v_i - O>; dq += ds_i scale k_i;
    dk_i += ds_i scale q; dv_i += w_i dO. Returns (dq [H, L, D], dk, dv [J, Hkv, L, D])."""
    H, L, D = q_HLD.shape
    J, Hkv = bk_JHkvLD.shape[:2]
    G = H // Hkv
    q = q_HLD.view(Hkv, G, L, D)
    do, out = do_HLD.view(Hkv, G, L, D), out_HLD.view(Hkv, G, L, D)
    k, v = bk_JHkvLD[:, :, None], bv_JHkvLD[:, :, None]  # [J, Hkv, 1, L, D]
    w = ((q[None] * k).sum(-1) * scale - lse_HL.view(Hkv, G, L)[None]).exp()  # [J, Hkv, G, L]
    ds = w * (do[None] * (v - out[None])).sum(-1)
    dq = (ds[..., None] * k).sum(0).view(H, L, D) * scale
    dk = (ds[..., None] * q[None]).sum(2) * scale
    dv = (w[..., None] * do[None]).sum(2)
    return dq, dk, dv


class _RingTrunkBranch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_HLD, k_HkvLD, v_HkvLD, bk_JHkvLD, bv_JHkvLD, hl, ring, scale):
        dt = acc_dtype(q_HLD.dtype)
        kv = torch.stack([k_HkvLD, v_HkvLD]).contiguous()  # travels in the input dtype
        out_h, lse_h = _ring_forward(ring, hl.to_halves(q_HLD.to(dt)), kv, hl, scale)
        out, lse = hl.from_halves(out_h), hl.from_halves(lse_h)
        if bk_JHkvLD.shape[0] > 0:
            out_b, lse_b = branch_attention(q_HLD, bk_JHkvLD, bv_JHkvLD, scale)
            out, lse = merge_attention(out, lse, out_b, lse_b)
        ctx.save_for_backward(q_HLD, kv, bk_JHkvLD, bv_JHkvLD, out, lse)
        ctx.hl, ctx.ring, ctx.scale = hl, ring, scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, do_HLD, _dlse):
        q_HLD, kv, bk, bv, out, lse = ctx.saved_tensors
        hl, ring, scale = ctx.hl, ctx.ring, ctx.scale
        dt = out.dtype
        do = do_HLD.to(dt)
        delta = (do * out).sum(-1)  # [H, L]: rowsum(dO * O) of the merged output
        # Padding rows of the halves layout copy a real row; with dO = delta = 0 there they add
        # nothing (ds = p * (dp - delta) = 0).
        valid = hl.valid_NS[:, None, :].to(dt)
        dq_h, dkv = _ring_backward(ring, hl.to_halves(do) * valid[..., None],
                                   hl.to_halves(q_HLD.to(dt)), kv, hl.to_halves(lse),
                                   hl.to_halves(delta) * valid, hl, scale)
        dq = hl.from_halves(dq_h)
        dbk = dbv = None
        if bk.shape[0] > 0:
            dq_b, dbk, dbv = branch_backward(do, q_HLD.to(dt), bk.to(dt), bv.to(dt), out, lse,
                                              scale)
            dq = dq + dq_b
            dbk, dbv = dbk.to(bk.dtype), dbv.to(bv.dtype)
        return (dq.to(q_HLD.dtype), dkv[0].to(kv.dtype), dkv[1].to(kv.dtype), dbk, dbv,
                None, None, None)


def ring_trunk_branch_attention(q_HLD: Tensor, k_HkvLD: Tensor, v_HkvLD: Tensor,
                                cu_seqlens: Tensor, branch_k_JHkvLD: Tensor | None = None,
                                branch_v_JHkvLD: Tensor | None = None, scale: float | None = None,
                                *, group: dist.ProcessGroup | None = None,
                                halves: HalvesLayout | None = None, check_ranks: bool = True,
                                stats: RingStats | None = None) -> tuple[Tensor, Tensor]:
    """`trunk_branch_attention` on this rank's zigzag shard; a collective over ``group``.

    cu_seqlens: the *local* cu_seqlens (`ZigzagLayout.local_cu_seqlens`), the same on every rank;
    tensors hold this rank's tokens (`ZigzagLayout.shard` along the token dim). Returns this rank's
    (out fp32 [H, L, D], lse fp32 [H, L]); fp64 for fp64 input. lse is not differentiable.
    check_ranks: validate that all ranks agree on shapes (one small all-gather; a bad input on any
    rank then raises ValueError on every rank instead of hanging the ring).
    """
    if branch_k_JHkvLD is None:
        branch_k_JHkvLD = k_HkvLD.new_zeros(0, *k_HkvLD.shape)
        branch_v_JHkvLD = v_HkvLD.new_zeros(0, *v_HkvLD.shape)
    if check_ranks:
        check_ring_inputs(q_HLD, k_HkvLD, v_HkvLD, cu_seqlens, branch_k_JHkvLD, branch_v_JHkvLD,
                          group)
    scale = 1.0 / math.sqrt(q_HLD.shape[-1]) if scale is None else scale
    halves = HalvesLayout.build(cu_seqlens) if halves is None else halves
    return _RingTrunkBranch.apply(q_HLD, k_HkvLD, v_HkvLD, branch_k_JHkvLD, branch_v_JHkvLD,
                                  halves, _Ring(group, stats), scale)


class RingAttention:
    """The policy's ``attn_fn`` under context parallelism: packed (cu_seqlens) input only.

    The model runs unchanged on its zigzag shard (tokens, local cu_seqlens, `local_positions` for
    RoPE); this adapter turns each layer's attention into a ring pass. Ranks are checked to agree
    once per forward (the layout is shared by all layers).
    """

    def __init__(self, group: dist.ProcessGroup | None = None, stats: RingStats | None = None):
        self.group, self.stats = group, stats

    def __call__(self, q_1HLD: Tensor, k_1HkvLD: Tensor, v_1HkvLD: Tensor,
                 layout: AttentionLayout) -> Tensor:
        if layout.cu_seqlens is None or q_1HLD.shape[0] != 1:
            raise ValueError("ring attention serves packed training input only (batch 1 with "
                             "cu_seqlens); use sdpa_attention for KV-cache decoding")
        first = "ring_halves" not in layout._memo
        if first:
            layout._memo["ring_halves"] = HalvesLayout.build(layout.cu_seqlens)
        out, _ = ring_trunk_branch_attention(q_1HLD[0], k_1HkvLD[0], v_1HkvLD[0],
                                             layout.cu_seqlens, group=self.group,
                                             halves=layout._memo["ring_halves"],
                                             check_ranks=first, stats=self.stats)
        return out.to(q_1HLD.dtype)[None]


def shard_packed_batch(layout: ZigzagLayout, rank: int, tokens_T: Tensor,
                       labels_T: Tensor | None = None, *, pad_token: int = 0,
                       ignore_index: int = -100) -> dict[str, Tensor]:
    """This rank's model inputs for a packed row: tokens [1, L], labels [1, L] (padding ignored),
    cu_seqlens (local) and positions [1, L] for RoPE. Pass them to the model with ``RingAttention``.
    Index tensors live where ``layout.cu_seqlens`` does: build the layout on the model's device.
    """
    out = {"tokens": layout.shard(tokens_T, rank, value=pad_token)[None],
           "cu_seqlens": layout.local_cu_seqlens(),
           "positions": layout.local_positions(rank)[None]}
    if labels_T is not None:
        out["labels"] = layout.shard(labels_T, rank, value=ignore_index)[None]
    return out
