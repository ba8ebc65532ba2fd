"""Config: recipes, file loading, command-line overrides, and errors that name the field."""

from dataclasses import FrozenInstanceError

import pytest

from cospec.config import ConfigError, ModelConfig, RunConfig, apply, describe, parse_override, resolve


def test_default_recipe_is_the_embedded_default_logging_its_kl():
    assert resolve() == apply(RunConfig(), {"grpo": {"log_kl": True}})


def test_overrides_reach_nested_fields_and_are_typed():
    cfg = resolve("tiny", overrides=["model.num_layers=3", "sampling.temperature=0.5",
                                     "task.families=copy,add", "model.qkv_bias=true"])
    assert cfg.model.num_layers == 3
    assert cfg.sampling.temperature == 0.5
    assert cfg.task.families == ("copy", "add")
    assert cfg.model.qkv_bias is True
    # the rest of the tiny recipe is kept
    assert cfg.model.hidden_size == 64


def test_yaml_and_toml_files_are_laid_over_the_recipe(tmp_path):
    y = tmp_path / "run.yaml"
    y.write_text("model:\n  num_layers: 5\nsft:\n  lr: 1.0e-3\n")
    t = tmp_path / "run.toml"
    t.write_text("[model]\nnum_layers = 7\n")
    assert resolve(config_file=str(y)).model.num_layers == 5
    assert resolve(config_file=str(y)).sft.lr == 1e-3
    # command-line overrides win over the file
    assert resolve(config_file=str(t), overrides=["model.num_layers=2"]).model.num_layers == 2


@pytest.mark.parametrize("override, field", [
    ("model.num_heads=5", "model.num_heads"),
    ("model.num_kv_heads=3", "model.num_kv_heads"),
    ("sampling.top_p=1.5", "sampling.top_p"),
    ("sampling.temperature=-1", "sampling.temperature"),
    ("sft.steps=0", "sft.steps"),
    ("rollout.dtype=float16", "rollout.dtype"),
    ("grpo.autocast=float16", "grpo.autocast"),
    ("model.num_layers=two", "model.num_layers"),
    ("model.no_such_field=1", "model.no_such_field"),
    ("task.families=copy,nope_family_is_checked_by_the_suite,copy", "task.families"),
    ("device=tpu", "device"),
    ("parallel.cp=0", "parallel.cp"),
    ("parallel.dp=0", "parallel.dp"),
    ("draft.eagle3_layers=0", "draft.eagle3_layers"),
])
def test_invalid_values_raise_an_error_naming_the_field(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        resolve(overrides=[override])


def test_configs_are_frozen():
    with pytest.raises(FrozenInstanceError, match="num_layers"):
        ModelConfig().num_layers = 3  # type: ignore[misc]


def test_override_syntax_errors_are_clear():
    with pytest.raises(ConfigError, match="key.sub=value"):
        parse_override("model.num_layers")
    with pytest.raises(ConfigError, match=r"recipe: unknown 'no_such_recipe' \(known: default, tiny"):
        resolve("no_such_recipe")


def test_every_field_is_documented():
    undocumented = [name for name, _, doc in describe() if not doc and name not in
                    ("model", "task", "sampling", "sft")]
    assert undocumented == []
    # A doc over several `#:` lines is read whole, not only its last line.
    docs = {name: doc for name, _, doc in describe()}
    assert docs["sft.label_noise"].startswith("a noisy demonstrator") and "docs/results/cotrain.md" in docs["sft.label_noise"]


def test_apply_round_trips_through_dict():
    cfg = resolve("tiny")
    assert apply(RunConfig(), cfg.to_dict()) == cfg


def test_cross_field_checks_see_all_overrides_together():
    cfg = resolve(overrides=["sft.steps=10", "sft.warmup_steps=2"])
    assert (cfg.sft.steps, cfg.sft.warmup_steps) == (10, 2)


def test_a_setting_its_switch_turns_off_is_reported_not_silently_ignored():
    from cospec.config import no_effect_warnings

    cfg = resolve("tiny", overrides=["rollout.probe_every=3", "draft.cotrain_lr=0.1",
                                     "parallel.microbatches=2"])
    assert no_effect_warnings(cfg) == [
        "rollout.probe_every=3 has no effect without rollout.speculative=true rollout.adaptive=true",
        "draft.cotrain_lr=0.1 has no effect without draft.mode=cotrain",
        "parallel.microbatches=2 has no effect without parallel.pp > 1"]
    assert no_effect_warnings(resolve("tiny", overrides=["draft.kind=block", "draft.eagle3_layers=2"])) \
        == ["draft.eagle3_layers=2 has no effect without draft.kind=eagle3"]
    # switched on, or left at the default, they say nothing
    assert no_effect_warnings(resolve("smollm2-math")) == []
    assert no_effect_warnings(resolve("tiny", overrides=[
        "rollout.speculative=true", "rollout.adaptive=true", "rollout.probe_every=3"])) == []


def test_data_parallel_layouts_that_cannot_work_are_refused_up_front():
    from cospec.parallel.train_group import check_launch

    with pytest.raises(ConfigError, match=r"parallel\.dp.*multiple of dp \(a group never straddles"):
        resolve(overrides=["parallel.dp=3", "grpo.prompts_per_step=8"])
    with pytest.raises(ConfigError, match=r"each replica's 4 rollouts must fill grpo\.micro_steps=8"):
        resolve(overrides=["parallel.dp=2", "grpo.prompts_per_step=2", "grpo.group_size=4",
                           "grpo.micro_steps=8"])
    with pytest.raises(ConfigError, match=r"parallel\.microbatches.*a minibatch has only 4 "):
        resolve(overrides=["parallel.dp=2", "parallel.pp=2", "parallel.microbatches=5",
                           "grpo.prompts_per_step=2", "grpo.group_size=4"])  # 4 per replica
    with pytest.raises(ConfigError, match="x cp=2 needs 8 processes"):  # every layout is one
        check_launch(resolve(overrides=["parallel.dp=2", "parallel.pp=2", "parallel.cp=2"]).parallel)
    with pytest.raises(ConfigError, match="needs 2 processes; launch it with torchrun --nproc-per-node 2"):
        check_launch(resolve(overrides=["parallel.dp=2"]).parallel)


def test_bf16_settings_on_a_cpu_without_bf16_matmul_units_are_warned_about_with_the_fix(
        monkeypatch, capsys):
    """The smollm2-math recipe trains and rolls out in bf16: on a CPU that emulates bf16 matmuls
    (30x dearer than fp32 on a Zen 1 EPYC) the command says so and names the overrides; on one
    with the units, or once they are applied, nothing is said."""
    from cospec import cli
    from cospec.models import precision

    recipe = ["--recipe", "smollm2-math", "device=cpu"]  # also where CUDA is present
    monkeypatch.setattr(precision, "cpu_lacks_bf16_matmul", lambda: True)
    assert cli.main(["config", *recipe]) == 0
    err = capsys.readouterr().err
    assert "rollout.dtype, grpo.autocast, draft.autocast = bfloat16, but this CPU has no bf16" in err
    fix = "rollout.dtype=float32 grpo.autocast= draft.autocast="
    assert f"add `{fix}`" in err
    assert cli.main(["config", *recipe, *fix.split()]) == 0
    assert "bf16" not in capsys.readouterr().err
    monkeypatch.setattr(precision, "cpu_lacks_bf16_matmul", lambda: False)
    assert cli.main(["config", *recipe]) == 0
    assert "bf16" not in capsys.readouterr().err


def test_the_bf16_matmul_check_agrees_with_the_cpus_own_flags():
    """On Linux x86 /proc/cpuinfo lists the CPU's features: no avx512_bf16 and no amx_bf16
    is exactly a CPU that emulates bf16 matmuls."""
    import platform
    from pathlib import Path

    from cospec.models.precision import cpu_lacks_bf16_matmul

    info = Path("/proc/cpuinfo")
    if platform.machine().lower() != "x86_64" or not info.exists():
        pytest.skip("needs Linux on x86")
    flags = set(next(line for line in info.read_text().splitlines()
                     if line.startswith("flags")).split())
    assert cpu_lacks_bf16_matmul() == (not {"avx512_bf16", "amx_bf16"} & flags)
