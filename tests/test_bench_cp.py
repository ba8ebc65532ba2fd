"""Specification of cospec.bench.cp: the baselines compute the same attention as the merged ring
(so the benchmark compares like with like), and the rows have the schema docs/results/cp.md uses.

fp32 on 2 gloo ranks; tolerance 1e-5 absolute (same maths, different summation order). A failure in
the all-gather baseline's gradients means its reduce-scatter returned dK/dV to the wrong owner.
"""

import pytest
import torch

from cospec.bench import cp as bench
from cospec.parallel.launch import spawn
from cospec.parallel.ring_attention import RingStats
from cospec.parallel.zigzag import ZigzagLayout


def _allgather_vs_merged(rank, num_ranks):
    torch.manual_seed(0)
    H, Hkv, D, J, T = 4, 2, 8, 2, 24
    z = ZigzagLayout.build(torch.tensor([0, 12, 24]), num_ranks)  # equal lengths (baseline needs)
    full = {"q": torch.randn(H, T, D), "k": torch.randn(Hkv, T, D), "v": torch.randn(Hkv, T, D),
            "bk": torch.randn(J, Hkv, T, D), "bv": torch.randn(J, Hkv, T, D)}
    g = z.shard(torch.randn(H, T, D), rank, dim=-2)
    results = []
    for method in ("merged_ring", "allgather"):
        x = {n: z.shard(t, rank, dim=-2).requires_grad_(True) for n, t in full.items()}
        out = bench._run_method(method, x, z, RingStats())
        results.append([out.detach()] + list(torch.autograd.grad(out, list(x.values()), g)))
    return max(float((a - b).abs().max()) for a, b in zip(*results))


@pytest.mark.slow
def test_allgather_baseline_computes_the_same_attention_and_gradients_as_the_ring():
    errors = spawn(_allgather_vs_merged, 2, timeout_s=30)
    assert max(errors) <= 1e-5, errors


@pytest.mark.slow
def test_rows_have_the_issue_schema_and_the_ring_sends_one_pass_per_key_set():
    rows = bench.run(cp_values=(2,), token_counts=(32,), show=False)
    assert {r["method"] for r in rows} == set(bench.METHODS)
    for r in rows:
        assert set(r) == {"cp", "tokens", "method", "peak_mem_bytes", "sent_bytes", "seconds"}
        assert r["cp"] == 2 and r["tokens"] == 32 and r["peak_mem_bytes"] > 0
    sent = {r["method"]: r["sent_bytes"] for r in rows}
    assert sent["ring_per_step"] == 3 * sent["merged_ring"]  # depth 3: trunk + 2 branch passes
