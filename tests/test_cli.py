"""The `cospec` command: config errors exit 2 naming the field; sft and demo run end to end."""

from cospec.cli import main


def test_a_bad_override_exits_2_and_names_the_field(capsys):
    assert main(["config", "model.num_heads=5"]) == 2
    assert "model.num_heads" in capsys.readouterr().err


def test_sft_then_demo_reuses_the_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["--recipe", "tiny", f"out_dir={out}", "sft.steps=3", "sft.warmup_steps=1",
            "sft.eval_prompts_per_family=2"]
    assert main(["sft", *args]) == 0
    assert (out / "sft" / "model.safetensors").exists() and (out / "sft_metrics.json").exists()
    capsys.readouterr()
    assert main(["demo", *args]) == 0
    printed = capsys.readouterr().out
    assert "reusing SFT checkpoint" in printed and "sampled answers" in printed
