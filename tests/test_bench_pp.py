"""`cospec bench pp` on a tiny policy: the JSON has the issue's schema, one row per method, and the
bytes each transport moved are what the taps weigh (a wrong count means taps were lost or sent
twice). Times are not asserted: they are a benchmark's business."""

import json

import pytest

from cospec.bench.pp import BenchSettings, run

from pipeline_runs import TINY


@pytest.mark.slow
def test_bench_pp_writes_the_schema_and_counts_the_tap_bytes(tmp_path):
    s = BenchSettings(model=TINY, num_microbatches=3, seqs_per_microbatch=2, seq_len=8, repeats=1,
                      warmup=0)
    run((2,), s, str(tmp_path / "pp.json"))
    rows = json.loads((tmp_path / "pp.json").read_text())["results"]
    assert [r["method"] for r in rows] == ["no_tap", "tap_channel", "blocking"]
    assert all({"pp", "method", "step_seconds", "tap_wait_seconds", "tap_bytes"} <= r.keys() for r in rows)
    # Taps (1, 2, 3) on stages [0..2], [3..5]: layers 1 and 2 travel, layer 3 is the draft stage's own.
    payload = 2 * 3 * (2 * 8) * TINY.hidden_size * 4
    by_method = {r["method"]: r["tap_bytes"] for r in rows}
    assert by_method["no_tap"] == 0 and by_method["blocking"] == payload
    assert by_method["tap_channel"] == payload + 2 * 3 * 64  # one 64-byte stamp per message
