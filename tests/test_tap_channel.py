"""Specification of TapChannel (`cospec.parallel.tap_channel`): taps reach the draft stage on their
own group, bit-identical, stamped, and without hanging the pipeline.

The multi-process cases are `pipeline_case` (tests/conftest.py): 2 and 4 gloo ranks, uneven stages
([4, 2] and [1, 3, 1, 1]), every layer tapped (so every stage sends, and the draft stage keeps its
own), 6 and 12 microbatches of different lengths, 2 steps, 1F1B and GPipe, under a 120 s deadline:
a deadlock fails the fixture with TimeoutError. Delivered features are compared bit for bit
(torch.equal) with the single-process policy's taps of the same microbatch: the transfer copies
bytes, and a stage computes exactly what the whole model computes for its layers. A mismatch names
(step, microbatch, layer); if only one step differs, the slots were reused before being read.
"""

import pytest
import torch

from cospec.parallel.launch import spawn
from cospec.parallel.pipeline import split_layers
from cospec.parallel.tap_channel import TapChannel, tap_owners

from pipeline_runs import TINY, RunSpec, stamp_mismatch, tiny_policy

ALL_LAYERS = tuple(range(TINY.num_layers))


def test_a_tap_layer_the_policy_does_not_have_is_a_clear_error():
    with pytest.raises(ValueError, match=r"tap_layers \[6, 9\] are not layers of the policy"):
        tap_owners((1, 6, 9), split_layers(TINY.num_layers, 2))


def test_each_tap_is_owned_by_the_stage_that_computes_it():
    assert tap_owners((5, 0, 3), split_layers(6, 3, [1, 3, 2])) == {0: 0, 3: 1, 5: 2}


def test_a_step_larger_than_the_landing_slots_is_a_clear_error():
    channel = TapChannel(None, stage=0, stage_layers=[range(6)], tap_layers=(1,), max_microbatches=2,
                         max_tokens=8, hidden_size=TINY.hidden_size)
    with pytest.raises(ValueError, match="exceeds the TapChannel's slots"):
        channel.begin_step(0, [4, 9])
    with pytest.raises(ValueError, match="exceeds the TapChannel's slots"):
        channel.begin_step(0, [4, 4, 4])


def test_attaching_to_a_stage_without_the_tapped_layer_is_a_clear_error():
    layers = split_layers(6, 2)
    channel = TapChannel(None, stage=0, stage_layers=[range(6)], tap_layers=(4,), max_microbatches=1,
                         max_tokens=8, hidden_size=TINY.hidden_size)
    from cospec.parallel.pipeline import build_stage

    stage0 = build_stage(tiny_policy(), layers[0], stage=0, num_stages=2)
    with pytest.raises(ValueError, match="has no layer 4"):
        channel.attach(stage0)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_every_stamp_is_delivered_once_with_many_microbatches_and_uneven_stages(pipeline_case, schedule):
    """Completing at all is the no-deadlock check (deadline in the fixture); this asserts the draft
    stage got every (step, microbatch, layer), taps of every stage, nothing more."""
    last = pipeline_case.run(RunSpec(schedule=schedule, taps=ALL_LAYERS, draft=True, num_steps=2))[-1]
    want = {(k, m, layer) for k in range(2) for m in range(pipeline_case.num_microbatches)
            for layer in ALL_LAYERS}
    assert set(last["delivered"]) == want


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_delivered_features_are_bit_identical_to_the_single_process_taps(pipeline_case, schedule):
    last = pipeline_case.run(RunSpec(schedule=schedule, taps=ALL_LAYERS, draft=True, num_steps=2))[-1]
    taps = pipeline_case.reference["taps"]
    differ = [key for key, feat in last["delivered"].items() if not torch.equal(feat, taps[key[1:]])]
    assert not differ, f"(step, microbatch, layer) delivered different from pp=1: {differ[:5]}"


@pytest.mark.slow
def test_a_stamp_mismatch_is_an_error_and_hangs_nobody():
    """The source stamps step 1, the draft stage awaits step 0: the draft stage raises TapStampError
    naming both stamps, and the source's end_step still returns (deadline 60 s)."""
    source, draft = spawn(stamp_mismatch, 2, timeout_s=60, deadline_s=60)
    assert source == ""
    assert "expected (step, microbatch, layer, tokens) = (0, 0, 1," in draft
    assert "got (1, 0, 1," in draft
