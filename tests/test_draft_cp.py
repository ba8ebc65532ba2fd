"""Specification of the draft's TTT loss under context parallelism (cospec.parallel.draft_cp):
loss and every draft gradient on 2 and 4 gloo ranks equal the single-process `ttt_loss`, for the
EAGLE-3 draft and for the block draft (whose block keys stay rank-local as the branch keys do).

fp64 end to end; tolerance 1e-9 relative to the largest magnitude. A failure in the loss only
points at the sharding of the step inputs or the count reduction; in the gradients only, at the
ring backward or the gradient all-reduce.
"""

import pytest
import torch

from cospec.config import ModelConfig
from cospec.draft.ttt import TTTBatch, ttt_loss, ttt_steps
from cospec.models.block_draft import BlockDraft
from cospec.models.draft import Eagle3Draft
from cospec.models.llama import Transformer
from cospec.parallel.draft_cp import all_reduce_grads, ttt_loss_cp
from cospec.parallel.launch import spawn
from cospec.parallel.zigzag import ZigzagLayout

CFG = ModelConfig(vocab_size=50, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2,
                  intermediate_size=64, max_seq_len=64)
LENGTHS = [11, 3, 17]  # unequal, one shorter than 2 * cp at cp = 4


def _setup(kind):
    torch.manual_seed(0)
    policy = Transformer(CFG).double()
    policy.reset_parameters(std=0.3)
    if kind == "block":  # two layers, both heads, the correction made non-trivial
        draft = BlockDraft.from_policy(policy.eval(), num_layers=2, correction=True)
        with torch.no_grad():
            draft.correction.weight.normal_(std=0.1)
    else:  # "eagle3-deep": EAGLE-3's layer and two more, each with its own ring pass
        draft = Eagle3Draft.from_policy(policy.eval(), num_layers=3 if kind == "eagle3-deep" else 1)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(4, CFG.vocab_size, (sum(LENGTHS),), generator=gen)
    cu = torch.tensor([0] + list(torch.tensor(LENGTHS).cumsum(0)))
    mask = (torch.rand(len(tokens), generator=gen) > 0.3).double()
    with torch.no_grad():
        out = policy(tokens[None], cu_seqlens=cu, tap_layers=draft.tap_layers)
    batch = TTTBatch(tokens=tokens, cu_seqlens=cu, loss_mask=mask,
                     taps={k: v[0] for k, v in out.taps.items()}, policy_logits=out.logits[0])
    return draft, batch


def _cp_errors(rank, num_ranks, kind):
    import torch.distributed as dist

    draft, batch = _setup(kind)
    ref_loss, _ = ttt_loss(draft, batch, num_steps=3, tv_weight=0.3)
    ref_grads = torch.autograd.grad(ref_loss, list(draft.parameters()))
    layout = ZigzagLayout.build(batch.cu_seqlens, num_ranks)
    steps = ttt_steps(draft, batch, 3)
    loss, _ = ttt_loss_cp(draft, steps, layout, rank=rank, tv_weight=0.3)
    draft.zero_grad()
    loss.backward()
    all_reduce_grads(draft)
    total = loss.detach().clone()
    dist.all_reduce(total)
    rel = lambda a, b: float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))  # noqa: E731
    return {"loss": rel(total, ref_loss.detach()),
            "grads": max(rel(p.grad, g) for p, g in zip(draft.parameters(), ref_grads))}


@pytest.mark.slow
@pytest.mark.parametrize("cp,kind", [(2, "eagle3"), (4, "eagle3-deep"), (2, "block")])
def test_ttt_loss_and_draft_gradients_under_cp_equal_cp1(cp, kind):
    for rank, errs in enumerate(spawn(_cp_errors, cp, kind, timeout_s=60)):
        assert errs["loss"] <= 1e-9 and errs["grads"] <= 1e-9, f"cp={cp} rank {rank}: {errs}"
