"""Specification of the pipelined policy step (`cospec.parallel.pipeline`) and its co-trained draft.

The reference is the same step on one process (pp=1, `reference_step`): the policy's loss and
gradients from one packed forward of the whole step, the draft's from per-microbatch taps and
logits. Tolerances: policy loss and gradients rtol 1e-5, atol 1e-6 (fp32; the microbatch split
only reorders the sums over tokens); draft loss and gradients the same. A policy mismatch on one
stage only points at that stage's transport (activation or gradient of the wrong microbatch); a
draft-only mismatch points at the taps or logits the draft read.

The multi-process cases (tests/conftest.py, `pipeline_case`) spawn 2 and 4 gloo ranks with uneven
stages, a tap on every layer and 6 or 12 microbatches, under a hard deadline: a hang fails the
fixture with TimeoutError instead of blocking the run.
"""

from dataclasses import replace

import pytest
import torch

from cospec.draft.ttt import ttt_loss
from cospec.models.llama import Transformer
from cospec.parallel.pipeline import (PipelineStep, PipeTransport, TapCapture, build_stage,
                                      schedule_actions, split_layers, token_nll)
from cospec.parallel.tap_channel import TapChannel

from pipeline_runs import (BLOCK_SPEC, TINY, RunSpec, num_step_tokens, random_microbatches,
                           reference_step, tiny_draft, tiny_policy)

TOL = dict(rtol=1e-5, atol=1e-6)
ALL_LAYERS = tuple(range(TINY.num_layers))


def test_stages_keep_the_checkpoint_names_and_weights():
    policy = tiny_policy()
    layers = split_layers(TINY.num_layers, 3)
    stages = [build_stage(policy, r, stage=s, num_stages=3) for s, r in enumerate(layers)]
    merged = {k: v for st in stages for k, v in st.state_dict().items()}
    full = policy.state_dict()
    assert sum(len(st.state_dict()) for st in stages) == len(full) == len(merged)
    assert all(torch.equal(merged[k], v) for k, v in full.items())
    assert "embed_tokens.weight" in stages[0].state_dict() and "lm_head.weight" in stages[-1].state_dict()


def test_default_split_is_even_with_the_extra_layers_first():
    assert split_layers(6, 4) == [range(0, 2), range(2, 4), range(4, 5), range(5, 6)]
    assert split_layers(6, 2, [5, 1]) == [range(0, 5), range(5, 6)]


def test_a_stage_that_owns_no_layer_is_a_clear_error():
    with pytest.raises(ValueError, match=r"stage\(s\) \[1\] would own no decoder layer"):
        split_layers(6, 3, [4, 0, 2])
    with pytest.raises(ValueError, match="own no decoder layer"):
        split_layers(2, 4)


def test_tied_embeddings_stay_tied_on_one_stage_and_cannot_be_split():
    torch.manual_seed(0)
    policy = Transformer(replace(TINY, tie_embeddings=True))
    whole = build_stage(policy, range(TINY.num_layers), stage=0, num_stages=1)
    assert whole.lm_head.weight is whole.embed_tokens.weight
    with pytest.raises(ValueError, match="tie_embeddings"):
        build_stage(policy, range(0, 3), stage=0, num_stages=2)


@pytest.mark.parametrize("kind", ["1f1b", "gpipe"])
def test_schedules_run_each_microbatch_forward_then_backward_in_order(kind):
    """Every stage runs F(m) then B(m) for every m, forwards in order 0..M-1 (TapChannel's slots
    are filled in that order); 1F1B keeps at most P - s microbatches in flight on stage s."""
    for P in range(1, 5):
        for M in range(1, 7):
            for s in range(P):
                actions = schedule_actions(kind, s, P, M)
                assert sorted(actions) == sorted([("F", m) for m in range(M)] + [("B", m) for m in range(M)])
                assert [m for op, m in actions if op == "F"] == list(range(M))
                in_flight = [sum(1 if op == "F" else -1 for op, _ in actions[:i + 1])
                             for i in range(len(actions))]
                assert min(in_flight) >= 0
                assert max(in_flight) == (min(P - s, M) if kind == "1f1b" else M)


@pytest.mark.parametrize("kind", ["eagle3", "block"])
def test_pp1_step_with_draft_co_training_equals_the_plain_model(one_thread, kind):
    """One stage, no process group: the executor, the channel's local taps and the draft's TTT loss
    (EAGLE-3's, or the block draft's) against `reference_step` (same tolerances as the
    multi-process cases)."""
    torch.manual_seed(0)
    mbs = random_microbatches(3)
    policy = tiny_policy()
    ref = reference_step(policy, mbs, draft=tiny_draft(policy, kind))
    model = build_stage(policy, range(TINY.num_layers), stage=0, num_stages=1)
    channel = TapChannel(None, stage=0, stage_layers=[range(TINY.num_layers)], tap_layers=(1, 2, 3),
                         max_microbatches=3, max_tokens=max(len(mb.tokens) for mb in mbs),
                         hidden_size=TINY.hidden_size)
    channel.attach(model)
    draft = tiny_draft(policy, kind)
    capture = TapCapture(channel, draft.tap_layers)
    step = PipelineStep(model, PipeTransport(None, 0, 1),
                        lambda lg, mb: token_nll(lg, mb, num_step_tokens=num_step_tokens(mbs)),
                        taps=channel, on_last_backward=capture)
    assert step.run(mbs) == pytest.approx(ref["loss"], rel=1e-5)
    draft_loss, _ = ttt_loss(draft, capture.take(), num_steps=2)
    draft_loss.backward()
    assert draft_loss.item() == pytest.approx(ref["draft_loss"], rel=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref["grads"][n], **TOL)
    for n, p in draft.named_parameters():
        torch.testing.assert_close(p.grad, ref["draft_grads"][n], **TOL)


def _spec(schedule, taps):
    return RunSpec(schedule=schedule, taps=ALL_LAYERS if taps else (), draft=taps,
                   num_steps=2 if taps else 1)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pipeline_group_operations_are_identical_with_taps_on_and_off(pipeline_case, schedule):
    """On every rank: the transport's trace (op, kind, peer, microbatch, shape) and the ops recorded
    on the pipeline group at the torch.distributed level are the same with taps on and off (taps-on
    ran 2 steps: each step repeats the taps-off trace). The tap group carries traffic only with taps
    on, so the recorder does see a misrouted tap; a difference names the op that moved."""
    off, on = pipeline_case.run(_spec(schedule, False)), pipeline_case.run(_spec(schedule, True))
    for rank in range(pipeline_case.num_ranks):
        assert on[rank]["trace"] == off[rank]["trace"] * 2, f"rank {rank}"
        pipe_on = [op for op in on[rank]["ops"] if op[0] == "pipe"]
        pipe_off = [op for op in off[rank]["ops"] if op[0] == "pipe"]
        assert pipe_on == pipe_off * 2, f"rank {rank}"
        assert not [op for op in off[rank]["ops"] if op[0] != "pipe"], f"rank {rank}"
        assert not [op for op in on[rank]["ops"] if op[0] not in ("pipe", "tap")], f"rank {rank}"
    assert any(op[0] == "tap" for r in on for op in r["ops"])


@pytest.mark.slow
@pytest.mark.parametrize("schedule,taps", [("1f1b", False), ("1f1b", True), ("gpipe", True)])
def test_loss_and_policy_gradients_equal_pp1(pipeline_case, schedule, taps):
    ranks, ref = pipeline_case.run(_spec(schedule, taps)), pipeline_case.reference
    assert ranks[-1]["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    grads = {n: g for r in ranks for n, g in r["grads"].items()}
    assert grads.keys() == ref["grads"].keys()
    for n, g in grads.items():
        torch.testing.assert_close(g, ref["grads"][n], **TOL, msg=lambda m: f"{n}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_draft_loss_and_gradients_from_delivered_taps_equal_pp1(pipeline_case, schedule):
    assert_draft_step_equals(pipeline_case.run(_spec(schedule, True))[-1], pipeline_case.reference)


def assert_draft_step_equals(last: dict, ref: dict) -> None:
    """The draft stage's loss and gradients against the single-process reference's."""
    assert last["draft_loss"] == pytest.approx(ref["draft_loss"], rel=1e-5)
    assert last["draft_grads"].keys() == ref["draft_grads"].keys()
    for n, g in last["draft_grads"].items():
        torch.testing.assert_close(g, ref["draft_grads"][n], **TOL, msg=lambda m: f"{n}: {m}")


@pytest.mark.slow
def test_the_block_draft_co_trained_from_delivered_taps_equals_pp1(pipeline_case):
    """The block draft on the last stage, fed by TapChannel over 2 and 4 stages: its loss and
    gradients are the single-process step's (the channel does not care which draft reads it)."""
    ref = pipeline_case.block_reference
    assert ref["draft_grads"].keys() != pipeline_case.reference["draft_grads"].keys()  # not EAGLE-3
    assert_draft_step_equals(pipeline_case.run(BLOCK_SPEC)[-1], ref)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_draft_co_training_leaves_the_policy_gradients_bit_identical(pipeline_case, schedule):
    """Draft gradients never reach the policy: with the draft trained on the last stage, every
    policy gradient on every stage is exactly the one of the run without taps or draft."""
    off, on = pipeline_case.run(_spec(schedule, False)), pipeline_case.run(_spec(schedule, True))
    for r_off, r_on in zip(off, on):
        assert r_on["grads"].keys() == r_off["grads"].keys()
        assert all(torch.equal(r_on["grads"][n], g) for n, g in r_off["grads"].items())


# ----------------------------------------------------------------------------- NCCL ordering

def completes_in_order(batches_by_stage: list[list[list[tuple]]]) -> bool:
    """Whether point-to-point batches finish under NCCL's rule, which gloo does not enforce: a
    stage's batches run one after another (a communicator's operations are ordered), and an
    operation completes only when its peer's matching operation is in the peer's current batch.
    Ops are trace entries (op, kind, peer stage, microbatch, shape); a send from s to t of
    (kind, m) matches t's receive from s of (kind, m)."""
    pos = [0] * len(batches_by_stage)
    done: set = set()  # (stage, index of the op within the stage's current batch)

    def current(stage):
        b = batches_by_stage[stage]
        return b[pos[stage]] if pos[stage] < len(b) else []

    moved = True
    while moved:
        moved = False
        for s in range(len(batches_by_stage)):
            for i, (op, kind, peer, m, _) in enumerate(current(s)):
                if (s, i) in done:
                    continue
                want = ("recv" if op == "send" else "send", kind, s, m)
                j = next((j for j, o in enumerate(current(peer)) if o[:4] == want), None)
                if j is not None:
                    done |= {(s, i), (peer, j)}
                    moved = True
        for s in range(len(batches_by_stage)):
            if current(s) and all((s, i) in done for i in range(len(current(s)))):
                done = {d for d in done if d[0] != s}
                pos[s] += 1
                moved = True
    return all(p == len(b) for p, b in zip(pos, batches_by_stage))


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_the_schedule_cannot_deadlock_on_nccl(pipeline_case, schedule):
    """The batches the transport posted finish under NCCL's ordering; the same operations posted
    one by one (the transport before batching) would not, in 1F1B: neighbours both send first."""
    runs = pipeline_case.run(_spec(schedule, False))
    assert completes_in_order([r["batches"] for r in runs])
    one_by_one = [[[op] for op in r["trace"]] for r in runs]
    assert completes_in_order(one_by_one) == (schedule == "gpipe")
