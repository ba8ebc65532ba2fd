"""Specification of `cospec bench generation`: cospec's engine and HF generate on the same model
and prompts, side by side (speed is measured, never asserted)."""

import json

from cospec.bench import generation
from cospec.config import resolve


def test_bench_generation_times_both_engines_on_the_runs_prompts(tmp_path):
    cfg = resolve("tiny", None, ["sampling.max_new_tokens=6", f"out_dir={tmp_path}"])
    out = tmp_path / "gen.json"
    rows = generation.run_cli(cfg, batch_sizes=[1, 3], repeats=1, json_path=str(out))
    assert [r["batch_size"] for r in rows] == [1, 3]
    for r in rows:
        assert r["cospec_tok_s"] > 0 and r["hf_tok_s"] > 0
        assert r["cospec_over_hf"] == r["cospec_tok_s"] / r["hf_tok_s"]
        assert r["max_new_tokens"] == 6 and r["prompt_tokens_mean"] > 1
    saved = json.loads(out.read_text())
    assert saved["results"] == rows and saved["meta"]["model"]["path"] == ""


def test_hf_side_decodes_exactly_max_new_tokens_per_row(tmp_path):
    """Stopping is off on both sides, so tokens/s compare equal work."""
    from transformers import AutoModelForCausalLM

    from cospec.config import SamplingConfig
    from cospec.models.hf_checkpoint import save_hf
    from cospec.models.llama import Transformer

    cfg = resolve("tiny", None, [])
    save_hf(Transformer(cfg.model), tmp_path / "m")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    calls = []
    real = hf.generate

    def spy(*a, **k):
        out = real(*a, **k)
        calls.append(out.shape[1] - a[0].shape[1])
        return out

    hf.generate = spy
    generation.hf_tok_s(hf, [[1, 5, 6], [1, 7]], SamplingConfig(temperature=1.0, max_new_tokens=9),
                        pad_id=0, seed=0)
    assert calls == [9]
