"""Specification of cospec.parallel.ring_attention: the zigzag ring computes exactly the single-device
`trunk_branch_attention` (and the policy's training step), sharded over 2 and 4 gloo ranks.

Every rank builds the same global tensors from a seed, runs the single-process reference on the whole
packed row, shards inputs with `ZigzagLayout`, runs the ring, and compares its shard of every result
on real (non-padding) tokens. The ranks are spawned once per world size (module fixture) and each
test reads its part of the results, so the multi-process cost is paid twice, not per test.

Tolerances: fp64 1e-10 (outputs, lse) and 1e-9 (gradients): only the order of sums differs. fp32
2e-5 / 1e-4. Reading a failure: a wrong *output* on some ranks points at the zigzag case analysis
(which chunk sees which block); right outputs but wrong dk/dv point at the accumulators' trip round
the ring; an error only with branches points at the branch merge or its backward; only with GQA at
the head grouping; only for short sequences (fewer tokens than 2*cp) at the padding rows.
"""

from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist

from cospec.config import ModelConfig
from cospec.models.branch_attention import trunk_branch_attention
from cospec.models.llama import Transformer
from cospec.parallel.launch import spawn
from cospec.parallel.ring_attention import (RingAttention, ring_trunk_branch_attention,
                                            shard_packed_batch)
from cospec.parallel.zigzag import ZigzagLayout

# (name, sequence lengths, query heads, kv heads, branch depth J, dtype). Lengths mix one longer
# than 2*cp*chunk, ones shorter than 2*cp (mostly padding) and a single token.
CASES = [
    ("fp64 unequal lengths no branch", (13, 3, 1, 8), 4, 4, 0, torch.float64),
    ("fp64 gqa branch depth 1", (9, 16, 2), 4, 2, 1, torch.float64),
    ("fp64 gqa branch depth 2", (21, 5), 6, 2, 2, torch.float64),
    ("fp64 gqa branch depth 3", (7, 1, 17), 4, 1, 3, torch.float64),
    ("fp32 gqa branch depth 3", (30, 11), 4, 2, 3, torch.float32),
    # the ring inside a bf16 autocast region, the reference outside: the ring must stay fp32
    ("fp32 under bf16 autocast gqa branch depth 2", (30, 11), 4, 2, 2, torch.float32),
]
TOL = {torch.float64: (1e-10, 1e-9), torch.float32: (2e-5, 1e-4)}


def _attention_errors(rank, num_ranks, case):
    """Max abs error of this rank's shard of (out, lse, dq, dk, dv, dbk, dbv) on real tokens."""
    name, lengths, H, Hkv, J, dt = case
    torch.manual_seed(len(name))
    T, D = sum(lengths), 8
    cu = torch.tensor([0, *lengths]).cumsum(0)
    full = {"q": torch.randn(H, T, D, dtype=dt), "k": torch.randn(Hkv, T, D, dtype=dt),
            "v": torch.randn(Hkv, T, D, dtype=dt), "bk": torch.randn(J, Hkv, T, D, dtype=dt),
            "bv": torch.randn(J, Hkv, T, D, dtype=dt)}
    g = torch.randn(H, T, D, dtype=dt)
    for x in full.values():
        x.requires_grad_(True)
    out, lse = trunk_branch_attention(full["q"], full["k"], full["v"], cu, full["bk"], full["bv"])
    ref = {"out": out, "lse": lse}
    ref.update(zip(["d" + n for n in full],
                   torch.autograd.grad((out * g).sum(), list(full.values()), materialize_grads=True)))

    z = ZigzagLayout.build(cu, num_ranks)
    mine = {n: z.shard(x.detach(), rank, dim=-2).requires_grad_(True) for n, x in full.items()}
    region = torch.autocast("cpu", dtype=torch.bfloat16) if "autocast" in name else nullcontext()
    with region:
        out, lse = ring_trunk_branch_attention(mine["q"], mine["k"], mine["v"],
                                               z.local_cu_seqlens(), mine["bk"], mine["bv"])
    got = {"out": out, "lse": lse}
    got.update(zip(["d" + n for n in mine],
                   torch.autograd.grad((out * z.shard(g, rank, dim=-2)).sum(), list(mine.values()),
                                       materialize_grads=True)))
    real = z.shard(torch.ones(T, dtype=torch.bool), rank, value=0)
    errors = {}
    for n in ref:
        diff = (got[n].detach() - z.shard(ref[n].detach(), rank, dim=-1 if n == "lse" else -2))
        diff = diff[..., real] if n == "lse" else diff[..., real, :]
        errors[n] = float(diff.abs().max()) if diff.numel() else 0.0  # J = 0: no branch grads
    return errors


def _bad_input_errors(rank, num_ranks):
    """The messages every rank raised for (a) an unpadded shard on rank 0 only and (b) ranks whose
    shards disagree in length. None where nothing was raised (a failure)."""
    caught = {}
    H, D = 2, 4
    for kind in ("unpadded", "mismatched"):
        L = 8 if kind == "unpadded" or rank == 0 else 12
        cu = torch.tensor([0, 5, L] if kind == "unpadded" and rank == 0 else [0, 4, L])
        q, k = torch.randn(H, L, D), torch.randn(H, L, D)
        try:
            ring_trunk_branch_attention(q, k, k, cu)
            caught[kind] = None
        except ValueError as e:
            caught[kind] = str(e)
    return caught


def _policy_step(model, tokens, labels, cu, positions=None, attn_fn=None, num_labels=None):
    """Sum of token NLL / num_labels (mean NLL over the whole packed batch), and per-token logprobs."""
    out = model(tokens, cu_seqlens=cu, positions_BT=positions, attn_fn=attn_fn)
    logp = out.logits.float().log_softmax(-1)
    mask = labels != -100
    token_logp = logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0] * mask
    num_labels = int(mask.sum()) if num_labels is None else num_labels
    return -token_logp.sum() / num_labels, token_logp


def _policy_errors(rank, num_ranks):
    """Relative error of the cp training step against cp=1: loss, gathered logprobs, every grad."""
    cfg = ModelConfig(vocab_size=37, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      intermediate_size=48, max_seq_len=64)
    torch.manual_seed(0)
    model = Transformer(cfg)
    lengths = (19, 2, 11, 6)
    cu = torch.tensor([0, *lengths]).cumsum(0)
    tokens = torch.randint(0, cfg.vocab_size, (cu[-1].item(),))
    labels = torch.full_like(tokens, -100)  # next token within the same sequence
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        labels[a:b - 1] = tokens[a + 1:b]
    loss, ref_logp = _policy_step(model, tokens[None], labels[None], cu)
    ref_grads = torch.autograd.grad(loss, list(model.parameters()))

    z = ZigzagLayout.build(cu, num_ranks)
    batch = shard_packed_batch(z, rank, tokens, labels)
    local_loss, local_logp = _policy_step(model, batch["tokens"], batch["labels"],
                                          batch["cu_seqlens"], batch["positions"], RingAttention(),
                                          num_labels=int((labels != -100).sum()))
    grads = torch.autograd.grad(local_loss, list(model.parameters()))
    total = local_loss.detach().clone()
    dist.all_reduce(total)
    for gr in grads:  # data-parallel style sum: each rank holds the grads of its tokens
        dist.all_reduce(gr)
    logp = z.gather(local_logp[0])
    rel = lambda a, b: float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))  # noqa: E731
    return {"loss": rel(total, loss.detach()), "logprobs": rel(logp, ref_logp[0].detach()),
            "grads": max(rel(a, b) for a, b in zip(grads, ref_grads))}


def _all_checks(rank, num_ranks):
    return {"attention": {c[0]: _attention_errors(rank, num_ranks, c) for c in CASES},
            "bad_input": _bad_input_errors(rank, num_ranks),
            "policy": _policy_errors(rank, num_ranks)}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"cp{n}")
def ranks(request):
    """Per-rank results of all checks at one world size (spawned once, gloo, 30 s timeout)."""
    return spawn(_all_checks, request.param, timeout_s=30)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_ring_equals_single_device_trunk_branch_attention_forward_and_backward(ranks, case):
    out_tol, grad_tol = TOL[case[-1]]
    for rank, res in enumerate(ranks):
        for name, err in res["attention"][case[0]].items():
            tol = out_tol if name in ("out", "lse") else grad_tol
            assert err <= tol, f"rank {rank} of {len(ranks)}: {name} off by {err:.2e} > {tol:.0e}"


@pytest.mark.slow
def test_a_malformed_shard_on_one_rank_raises_a_clear_error_on_every_rank(ranks):
    """Rank 0 passes an unpadded shard (odd local length): it names the fix, the others name rank 0.
    Ranks holding shards of different length all say so. Nobody waits for the 30 s timeout."""
    for rank, res in enumerate(ranks):
        unpadded, mismatched = res["bad_input"]["unpadded"], res["bad_input"]["mismatched"]
        expected = "shard the packed row with ZigzagLayout" if rank == 0 else "rank(s) [0]"
        assert unpadded is not None and expected in unpadded, f"rank {rank}: {unpadded}"
        assert mismatched is not None and "disagree on local tokens" in mismatched, \
            f"rank {rank}: {mismatched}"


@pytest.mark.slow
def test_policy_training_step_under_cp_equals_cp1_loss_logprobs_and_every_gradient(ranks):
    """fp32, relative to the largest magnitude: loss and logprobs 1e-5, each parameter grad 1e-4."""
    for rank, res in enumerate(ranks):
        errs = res["policy"]
        assert errs["loss"] <= 1e-5 and errs["logprobs"] <= 1e-5, f"rank {rank}: {errs}"
        assert errs["grads"] <= 1e-4, f"rank {rank}: {errs}"


@pytest.mark.slow
def test_ring_on_one_rank_is_the_reference_with_no_communication():
    """cp = 1: the diagonal step alone; fp64, 1e-10 on outputs, 1e-9 on gradients."""
    errs = spawn(_one_rank_errors, 1, timeout_s=30)[0]
    assert max(errs.values()) <= 1e-9, errs


def _one_rank_errors(rank, num_ranks):
    return _attention_errors(rank, num_ranks, CASES[3])


def _stuck_neighbour(rank, num_ranks, flag_path):
    """Rank 1 stays alive but never joins the ring; it leaves only once rank 0 has given up (the
    flag file), so rank 0's error cannot come from its peer leaving: only the process-group
    timeout can end rank 0's ring pass. (60 s cap so a broken timeout fails instead of hanging.)"""
    import os
    import time

    if rank == 1:
        deadline = time.monotonic() + 60
        while not os.path.exists(flag_path) and time.monotonic() < deadline:
            time.sleep(0.05)
        return None
    q = torch.randn(2, 4, 8)
    try:
        ring_trunk_branch_attention(q, q, q, torch.tensor([0, 4]), check_ranks=False)
        error = None
    except RuntimeError as e:
        error = str(e)
    open(flag_path, "w").close()
    return error


@pytest.mark.slow
def test_a_stuck_rank_fails_the_ring_after_the_process_group_timeout(tmp_path):
    """Timeout 2 s: rank 0 raises RuntimeError while its peer is still alive and silent, and the
    error is the process group's timeout (gloo names the 2000 ms it waited), not another failure."""
    error = spawn(_stuck_neighbour, 2, str(tmp_path / "rank0_gave_up"), timeout_s=2)[0]
    assert error is not None and "Timed out waiting 2000ms" in error, error
