"""`cospec bench rollout-dp` on the tiny recipe: every layout answers the same GRPO step's
rollouts, each from its own seed, so every layout decodes (nearly) the same tokens; the ratios are
the rows' own throughputs over their reference rows'. Times are not asserted."""

import json
import math

import pytest

from cospec.bench.rollout_dp import run_cli
from cospec.config import resolve


@pytest.mark.slow
def test_bench_rollout_dp_answers_the_same_rollouts_in_every_layout(tmp_path):
    cfg = resolve("tiny", overrides=[f"out_dir={tmp_path}", "grpo.prompts_per_step=4",
                                     "grpo.group_size=4", "sampling.batch_size=4"])
    run_cli(cfg, layouts="single,single@2,dp2", quick=True, json_path=str(tmp_path / "r.json"))
    rows = json.loads((tmp_path / "r.json").read_text())["results"]
    assert [(r["layout"], r["processes"], r["threads"]) for r in rows] == [
        ("single", 1, 1), ("single@2", 1, 2), ("dp2", 2, 1)]
    # Same seeds, same samples: the token counts agree (up to a token that another batch shape's
    # rounding flips; per-rollout equality is tests/test_prompt_streams.py's).
    tokens = [r["tokens"] for r in rows]
    assert all(t == pytest.approx(tokens[0], rel=0.05) for t in tokens), tokens
    assert all(r["rollouts"] == 16 for r in rows)
    by = {r["layout"]: r for r in rows}
    for r in rows:
        assert r["tokens_per_second"] > 0 and math.isfinite(r["seconds"])
        assert r["vs_single"] == pytest.approx(r["tokens_per_second"] / by["single"]["tokens_per_second"])
    assert by["dp2"]["vs_single_same_cores"] == pytest.approx(
        by["dp2"]["tokens_per_second"] / by["single@2"]["tokens_per_second"])
    assert by["single"]["vs_single_same_cores"] is None
