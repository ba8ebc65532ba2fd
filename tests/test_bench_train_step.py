"""`cospec bench train-step` on the tiny recipe: one row per layout, each the same synthetic step
(the token count of `synthetic_batch`), with positive finite times and every ratio the row's own
step time over its reference row's (single, and single on as many threads as the row has ranks).
Times themselves are not asserted: they are a benchmark's business."""

import json
import math

import pytest

from cospec.bench.train_step import run_cli, synthetic_batch
from cospec.config import resolve


@pytest.mark.slow
def test_bench_train_step_times_every_layout_on_the_same_step(tmp_path):
    cfg = resolve("tiny", overrides=["grpo.prompts_per_step=2", "grpo.group_size=4",
                                     "parallel.microbatches=2"])
    run_cli(cfg, layouts="single,single@2,cp2,pp2,dp2", quick=True,
            json_path=str(tmp_path / "t.json"))
    rows = json.loads((tmp_path / "t.json").read_text())["results"]
    assert [(r["layout"], r["ranks"]) for r in rows] == [("single", 1), ("single@2", 1), ("cp2", 2),
                                                         ("pp2", 2), ("dp2", 2)]
    batch = synthetic_batch(cfg)
    tokens = sum(len(c.prompt) + len(c.tokens) - 1 for c in batch.completions)
    assert [r["tokens"] for r in rows] == [tokens] * 5
    for r in rows:
        times = (r["train_policy_seconds"], r["train_draft_seconds"])
        assert all(t > 0 and math.isfinite(t) for t in times), r
        assert r["step_seconds"] == pytest.approx(sum(times), rel=1e-12)
    step_s = {r["layout"]: r["step_seconds"] for r in rows}
    for r in rows:
        assert r["vs_single"] == pytest.approx(r["step_seconds"] / step_s["single"], rel=1e-12)
        same_cores = step_s["single@2"] if r["ranks"] == 2 else None
        assert r["vs_single_same_cores"] == (
            pytest.approx(r["step_seconds"] / same_cores, rel=1e-12) if same_cores else None), r
