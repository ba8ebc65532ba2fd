"""`cospec bench train-step` on the tiny recipe: one row per layout, each the same synthetic step
(same token count), with positive times and ratios against the single-process rows. Times are not
asserted: they are a benchmark's business."""

import json

import pytest

from cospec.bench.train_step import run_cli
from cospec.config import resolve


@pytest.mark.slow
def test_bench_train_step_times_every_layout_on_the_same_step(tmp_path):
    cfg = resolve("tiny", overrides=["grpo.prompts_per_step=2", "grpo.group_size=4",
                                     "parallel.microbatches=2"])
    run_cli(cfg, layouts="single,single@2,cp2,pp2", quick=True, json_path=str(tmp_path / "t.json"))
    rows = json.loads((tmp_path / "t.json").read_text())["results"]
    assert [r["layout"] for r in rows] == ["single", "single@2", "cp2", "pp2"]
    assert len({r["tokens"] for r in rows}) == 1
    assert all(r["train_policy_seconds"] > 0 and r["train_draft_seconds"] > 0 for r in rows)
    assert rows[0]["vs_single"] == 1.0 and rows[2]["vs_single_same_cores"] is not None
