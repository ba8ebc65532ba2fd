"""`cospec bench cp`: the merged zigzag ring against two baselines, per rank, cp = 1, 2, 4.

# H query heads, Hkv kv heads, L local tokens, T packed tokens, P padded tokens, D head dim,
# J branch keys per query (TTT depth - 1), N sequences, S halves-layout rows

Workload: the attention of the deepest step of a TTT unroll of depth ``depth`` (EAGLE-3, docs/design.md):
queries against the step-1 trunk (packed causal) and depth-1 branch keys per position, forward and
backward with a random output gradient, on ``num_sequences`` equal sequences packed into T tokens.
Methods:
- merged_ring: `ring_trunk_branch_attention`; one ring pass of trunk K/V, branch keys local.
- allgather: every rank all-gathers the trunk K/V (the prior draft-CP approach), computes its queries
  against all of it, re-gathers in the backward and reduce-scatters dK/dV; branch keys local.
- ring_per_step: what a ring without branch support forces: every key set (the trunk, then each
  branch step) takes its own causal ring pass. A cost model: the transfers and block work are those
  of such a ring, the numerics are not the TTT softmax (the branch sets are not diagonal-masked).

Per rank: peak bytes of tensors alive at once among those allocated during the attention forward
and backward (tracked by a dispatch mode over every aten op; the inputs q/k/v/branch, the same for
all methods, are not counted), bytes this rank sent (exact for the ring; for the collectives the
bytes a ring all-gather / reduce-scatter sends, (cp-1)/cp of the gathered tensor), and wall time.
Each rank runs one thread; ranks share the machine's cores, so at cp > cores time is oversubscribed.

    cospec bench cp --quick
    python -m cospec.bench.cp --tokens 4096,8192 --json docs/results/cp.json
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from cospec.atomic_file import write_json_atomically
from cospec.models.branch_attention import branch_attention, merge_attention
from cospec.parallel.block_attention import HalvesLayout, block_backward, block_forward
from cospec.parallel.launch import spawn
from cospec.parallel.ring_attention import RingStats, branch_backward, ring_trunk_branch_attention
from cospec.parallel.zigzag import ZigzagLayout

METHODS = ("merged_ring", "allgather", "ring_per_step")


class PeakMemory(TorchDispatchMode):
    """Peak bytes of live tensor storages created inside the ``with`` block (any device)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > 0:
                st = t.untyped_storage()
                known = self.live.get(st.data_ptr())
                if known is None or known[0].expired():
                    self.live[st.data_ptr()] = (StorageWeakRef(st), st.nbytes())
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


class _AllGatherTrunk(torch.autograd.Function):
    """Baseline (b): gather all trunk K/V, attend locally, reduce-scatter dK/dV (equal lengths)."""

    @staticmethod
    def forward(ctx, q_HLD, k_HkvLD, v_HkvLD, bk, bv, z, stats, scale):
        kv = torch.stack([k_HkvLD, v_HkvLD])
        hl = HalvesLayout.build(z.local_cu_seqlens())
        k_N, v_N, mask = _gathered_blocks(kv, z, hl, stats)
        out_h, lse_h = block_forward(hl.to_halves(q_HLD), k_N, v_N, mask, scale)
        out, lse = merge_attention(hl.from_halves(out_h), hl.from_halves(lse_h),
                                   *branch_attention(q_HLD, bk, bv, scale))
        ctx.save_for_backward(q_HLD, kv, bk, bv, out, lse)
        ctx.z, ctx.hl, ctx.stats, ctx.scale = z, hl, stats, scale
        return out

    @staticmethod
    def backward(ctx, do):
        q, kv, bk, bv, out, lse = ctx.saved_tensors
        z, hl, scale = ctx.z, ctx.hl, ctx.scale
        k_N, v_N, mask = _gathered_blocks(kv, z, hl, ctx.stats)  # re-gathered, not kept
        valid = hl.valid_NS[:, None, :].to(q.dtype)
        dq_h, dk_N, dv_N = block_backward(hl.to_halves(do) * valid[..., None], hl.to_halves(q), k_N,
                                          v_N, hl.to_halves(lse), hl.to_halves((do * out).sum(-1))
                                          * valid, mask, scale)
        dkv_padded = torch.stack([dk_N, dv_N]).transpose(1, 2).flatten(2, 3)  # [2, Hkv, P, D]
        order = torch.cat([z.local_index(r) for r in range(z.cp)])
        chunks = list(dkv_padded[:, :, order].chunk(z.cp, dim=2))
        dkv = torch.empty_like(chunks[0])
        dist.reduce_scatter(dkv, [c.contiguous() for c in chunks])
        ctx.stats.sent_bytes += (z.cp - 1) * dkv.numel() * dkv.element_size()
        dq_b, dbk, dbv = branch_backward(do, q, bk, bv, out, lse, scale)
        return hl.from_halves(dq_h) + dq_b, dkv[0], dkv[1], dbk, dbv, None, None, None


def _gathered_blocks(kv_2HkvLD, z, hl, stats):
    """All-gather trunk K/V into [N, Hkv, Pn, D] per sequence and the visibility of local rows."""
    parts = [torch.empty_like(kv_2HkvLD) for _ in range(z.cp)]
    dist.all_gather(parts, kv_2HkvLD.contiguous())
    stats.sent_bytes += (z.cp - 1) * kv_2HkvLD.numel() * kv_2HkvLD.element_size()
    order = torch.cat([z.local_index(r) for r in range(z.cp)])
    full = torch.cat(parts, dim=2)[:, :, torch.argsort(order)]  # [2, Hkv, P, D] position order
    N = len(z.cu_seqlens) - 1
    full = full.view(2, full.shape[1], N, -1, full.shape[-1]).transpose(1, 2)  # [2, N, Hkv, Pn, D]
    pos_NS = hl.to_halves(z.local_positions(dist.get_rank())[None])[:, 0]
    key_pos = torch.arange(full.shape[3], device=pos_NS.device)
    mask = key_pos[None, None, :] <= pos_NS[:, :, None]  # [N, S, Pn]
    return full[0], full[1], mask & hl.valid_NS[:, :, None]


def _run_method(method, x, z, stats):
    """Forward of one method on this rank's shard; returns a tensor to backpropagate from."""
    scale = 1.0 / math.sqrt(x["q"].shape[-1])
    cu = z.local_cu_seqlens()
    if method == "merged_ring":
        return ring_trunk_branch_attention(x["q"], x["k"], x["v"], cu, x["bk"], x["bv"],
                                           stats=stats)[0]
    if method == "allgather":
        return _AllGatherTrunk.apply(x["q"], x["k"], x["v"], x["bk"], x["bv"], z, stats, scale)
    outs = [ring_trunk_branch_attention(x["q"], x["k"], x["v"], cu, stats=stats)[0]]
    for j in range(x["bk"].shape[0]):  # one more ring pass per branch step's key set
        outs.append(ring_trunk_branch_attention(x["q"], x["bk"][j], x["bv"][j], cu,
                                                stats=stats)[0])
    return torch.stack(outs).sum(0)


def _measure(method, shards, z, repeats):
    best = None
    for _ in range(repeats):
        x = {n: t.detach().clone().requires_grad_(True) for n, t in shards.items()}
        stats = RingStats()
        dist.barrier()
        with PeakMemory() as mem:
            start = time.perf_counter()
            out = _run_method(method, x, z, stats)
            out.backward(torch.ones_like(out))
            seconds = time.perf_counter() - start
        row = {"peak_mem_bytes": mem.peak, "sent_bytes": stats.sent_bytes, "seconds": seconds}
        best = row if best is None or seconds < best["seconds"] else best
    return best


def _worker(rank, cp, token_counts, num_sequences, depth, heads, kv_heads, head_dim, repeats):
    rows = []
    for T in [2 * 2 * cp * num_sequences] + list(token_counts):  # the first is a warm-up
        cu = torch.arange(num_sequences + 1) * (T // num_sequences)
        z = ZigzagLayout.build(cu, cp)
        gen = torch.Generator().manual_seed(T)
        J, Hkv, D = depth - 1, kv_heads, head_dim
        full = {"q": torch.randn(heads, T, D, generator=gen),
                "k": torch.randn(Hkv, T, D, generator=gen),
                "v": torch.randn(Hkv, T, D, generator=gen),
                "bk": torch.randn(J, Hkv, T, D, generator=gen),
                "bv": torch.randn(J, Hkv, T, D, generator=gen)}
        shards = {n: z.shard(t, rank, dim=-2) for n, t in full.items()}
        for method in METHODS:
            row = _measure(method, shards, z, repeats)
            rows.append({"cp": cp, "tokens": T, "method": method, **row})
    return rows[len(METHODS):]


def run(cp_values=(1, 2, 4), token_counts=(4096, 8192), *, num_sequences: int = 2, depth: int = 3,
        heads: int = 4, kv_heads: int = 1, head_dim: int = 32, repeats: int = 1,
        show: bool = True) -> list[dict]:
    """One row per (cp, tokens, method): the maximum over ranks of peak_mem_bytes, sent_bytes and
    seconds (the slowest rank is the step time)."""
    rows = []
    for cp in cp_values:
        per_rank = spawn(_worker, cp, tuple(token_counts), num_sequences, depth, heads, kv_heads,
                         head_dim, repeats, timeout_s=600)
        for i, row in enumerate(per_rank[0]):
            rows.append({**row, **{k: max(r[i][k] for r in per_rank)
                                   for k in ("peak_mem_bytes", "sent_bytes", "seconds")}})
    if show:
        print(format_table(rows))
    return rows


def format_table(rows: list[dict]) -> str:
    """Rows plus, per (cp, tokens), the ratios the targets are stated in."""
    head = f"{'cp':>3} {'tokens':>7} {'method':>14} {'peak MiB':>9} {'sent MiB':>9} {'seconds':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['cp']:>3} {r['tokens']:>7} {r['method']:>14} "
                     f"{r['peak_mem_bytes'] / 2**20:>9.1f} {r['sent_bytes'] / 2**20:>9.1f} "
                     f"{r['seconds']:>8.2f}")
    lines += ["", f"{'cp':>3} {'tokens':>7} {'allgather/merged mem':>21} "
                  f"{'merged/per-step sent':>21} {'merged/allgather s':>19} "
                  f"{'merged/per-step s':>18}"]
    by_key = {(r["cp"], r["tokens"], r["method"]): r for r in rows}
    for cp, tokens in dict.fromkeys((r["cp"], r["tokens"]) for r in rows):
        m, a, p = (by_key[(cp, tokens, name)] for name in METHODS)
        sent = f"{m['sent_bytes'] / p['sent_bytes']:.3f}" if p["sent_bytes"] else "-"
        lines.append(f"{cp:>3} {tokens:>7} {a['peak_mem_bytes'] / m['peak_mem_bytes']:>21.2f} "
                     f"{sent:>21} {m['seconds'] / a['seconds']:>19.2f} "
                     f"{m['seconds'] / p['seconds']:>18.2f}")
    return "\n".join(lines)


def run_cli(quick: bool = False, token_counts: str | None = None, cp_values: str = "1,2,4",
            json_path: str | None = None, repeats: int = 1) -> list[dict]:
    tokens = token_counts or ("1024,2048" if quick else "4096,8192")
    rows = run(cp_values=[int(c) for c in cp_values.split(",")],
               token_counts=[int(t) for t in tokens.split(",")], repeats=repeats)
    if json_path:
        write_json_atomically(json_path, {"results": rows}, indent=1)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="short lengths (1K, 2K tokens)")
    p.add_argument("--tokens", help="comma-separated packed lengths (default 4096,8192)")
    p.add_argument("--cp", default="1,2,4", help="comma-separated context-parallel sizes")
    p.add_argument("--json", help="also write the rows as JSON to this path")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per row; the fastest counts")
    args = p.parse_args(argv)
    return 0 if run_cli(args.quick, args.tokens, args.cp, args.json, args.repeats) else 1


if __name__ == "__main__":
    raise SystemExit(main())
