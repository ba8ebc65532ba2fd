"""Specification of "every bad file a clear error": a config file, a checkpoint, a draft or a trainer
state that cannot be read as what it should be is a named exception (`ConfigError`,
`CheckpointError`, both `ValueError`s) naming the file, and exit 2 from the CLI; a field that cannot
fit the model is a `ConfigError` naming the field before any work starts."""

import json

import pytest
import torch

from cospec.cli import main
from cospec.config import ConfigError, ModelConfig, load_file, resolve
from cospec.models.draft import Eagle3Draft
from cospec.models.draft_checkpoint import load_draft, save_draft
from cospec.models.hf_checkpoint import load_hf, save_hf
from cospec.models.integrity import CheckpointError
from cospec.models.llama import Transformer
from cospec.rl.checkpoint import load_checkpoint, load_latest_good, save_checkpoint

CFG = ModelConfig(vocab_size=40, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
                  intermediate_size=64, max_seq_len=48)


# ----------------------------------------------------------------------------- config files

@pytest.mark.parametrize("name, text, where", [
    ("bad.yaml", "grpo:\n  steps: 3\n  lr: [1,\n", r"bad\.yaml:4:1: not valid YAML"),
    ("bad.json", '{"grpo": {"steps": 3,}}', r"bad\.json:1:22: not valid JSON"),
    ("bad.toml", "[grpo]\nsteps = \n", r"bad\.toml: not valid TOML: .*line 2"),
    ("list.yaml", "- 1\n- 2\n", r"list\.yaml: the top level must be a table .* got a list"),
])
def test_a_malformed_config_file_names_the_file_and_the_line(tmp_path, name, text, where):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=where):
        load_file(path)


def test_the_cli_exits_2_on_a_malformed_config_file(tmp_path, capsys):
    (tmp_path / "bad.yaml").write_text("grpo: [\n")
    assert main(["config", "--config", str(tmp_path / "bad.yaml")]) == 2
    assert "bad.yaml:2:1" in capsys.readouterr().err


def test_tap_layers_beyond_the_model_are_a_config_error_up_front():
    with pytest.raises(ConfigError, match=r"draft\.tap_layers: \[0, 1, 9\]: the policy has layers 0\.\.1"):
        resolve("tiny", overrides=["draft.tap_layers=[0,1,9]"])


def test_a_model_too_short_for_the_prompts_is_a_config_error_naming_max_seq_len(tmp_path):
    from cospec.rl.trainer import GRPOTrainer

    cfg = resolve("tiny", overrides=[f"out_dir={tmp_path}", "model.max_seq_len=8"])
    with pytest.raises(ConfigError, match=r"model\.max_seq_len=8: prompts of this task run to \d+"):
        GRPOTrainer(cfg, Transformer(cfg.model), tensorboard=False)


def test_sft_on_a_model_too_short_for_its_examples_is_a_config_error(tmp_path):
    from cospec.sft import train_sft

    cfg = resolve("tiny", overrides=[f"out_dir={tmp_path}", "model.max_seq_len=16"])
    with pytest.raises(ConfigError, match=r"model\.max_seq_len=16: an SFT example"):
        train_sft(cfg, device=torch.device("cpu"), progress=False)


# ----------------------------------------------------------------------------- checkpoints

@pytest.fixture
def policy_dir(tmp_path):
    torch.manual_seed(0)
    save_hf(Transformer(CFG), tmp_path / "policy")
    return tmp_path / "policy"


def truncate(path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])


def test_a_truncated_safetensors_file_names_the_file(policy_dir):
    truncate(policy_dir / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"policy/model\.safetensors: not a readable safetensors"):
        load_hf(policy_dir)


@pytest.mark.parametrize("text, problem", [
    ("{not json", r"config\.json: not valid JSON \(the model config\): line 1 column 2"),
    ("[1, 2]", r"config\.json: expected a JSON object"),
    ('{"architectures": ["LlamaForCausalLM"]}', r"config\.json: missing field"),
])
def test_a_garbage_config_json_names_the_file(policy_dir, text, problem):
    (policy_dir / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match=problem):
        load_hf(policy_dir)


def test_a_draft_json_that_disagrees_with_its_weights_names_the_draft(tmp_path):
    torch.manual_seed(0)
    save_draft(Eagle3Draft.from_policy(Transformer(CFG)), tmp_path / "draft")
    meta = json.loads((tmp_path / "draft" / "draft.json").read_text())
    meta["intermediate_size"] = 96  # the weights were saved at 64
    (tmp_path / "draft" / "draft.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"draft: the weights do not match draft\.json"):
        load_draft(tmp_path / "draft")


def test_a_directory_that_is_no_draft_says_so(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"empty: not a draft checkpoint"):
        load_draft(tmp_path / "empty")


def save_steps(root, steps, config=None):
    torch.manual_seed(0)
    for step in steps:
        state = {"step": step, "torch_rng": torch.get_rng_state(), "prompt_rng": [3, [], None],
                 "optimizer": {}}
        save_checkpoint(root, step, policy=Transformer(CFG), trainer_state=state,
                        config=config or {"step": step}, keep=5)


def test_a_truncated_trainer_state_names_the_file(tmp_path):
    save_steps(tmp_path, [1])
    truncate(tmp_path / "step_000001" / "trainer_state.pt")
    with pytest.raises(CheckpointError, match=r"step_000001/trainer_state\.pt: cannot be read"):
        load_checkpoint(tmp_path / "step_000001")


def test_resume_falls_back_past_a_damaged_newest_checkpoint_and_says_so(tmp_path):
    save_steps(tmp_path, [1, 2])
    truncate(tmp_path / "step_000002" / "policy" / "model.safetensors")
    said = []
    path, ckpt = load_latest_good(tmp_path, warn=said.append)
    assert path.name == "step_000001" and ckpt["trainer_state"]["step"] == 1
    assert "step_000002 is damaged" in said[0] and "older checkpoint" in said[1]


def test_resume_with_no_loadable_checkpoint_lists_what_is_wrong_with_each(tmp_path):
    save_steps(tmp_path, [1, 2])
    for step in ("step_000001", "step_000002"):
        (tmp_path / step / "config.json").write_text("garbage")
    with pytest.raises(CheckpointError, match=r"no checkpoint loads: .*step_000002.*step_000001"):
        load_latest_good(tmp_path, warn=lambda _: None)


def test_the_cli_exits_2_on_a_corrupt_draft(tmp_path, capsys):
    """`cospec export` of a run whose saved draft is garbage: exit 2 naming the file."""
    out = tmp_path / "run"
    args = ["--recipe", "tiny", f"out_dir={out}", "sft.steps=2", "draft.train_steps=2",
            "draft.num_train_prompts=4", "sampling.max_new_tokens=4"]
    assert main(["draft-train", *args]) == 0
    (out / "draft" / "draft.json").write_text("{")
    capsys.readouterr()
    assert main(["export", "--reuse", *args]) == 2
    assert "draft.json: not valid JSON" in capsys.readouterr().err


def test_fields_that_do_not_fit_a_checkpoints_architecture_fail_once_it_is_read(tmp_path, capsys):
    """model.path's architecture is known only when the checkpoint is read; draft.tap_layers and
    draft.vocab_size are checked against it then, before any work, and exit 2 naming the field."""
    from checkpoint_factory import random_policy, train_tiny_bpe, write_hf_checkpoint

    cfg = ModelConfig(**{**vars(CFG), "vocab_size": 300})
    write_hf_checkpoint(tmp_path / "ckpt", random_policy(cfg), train_tiny_bpe(300))
    common = ["config", f"model.path={tmp_path / 'ckpt'}"]
    assert main([*common, "draft.tap_layers=[0,1,2]"]) == 0  # it has 3 layers
    assert main([*common, "draft.tap_layers=[0,1,3]"]) == 2
    assert "draft.tap_layers: [0, 1, 3]: the policy has layers 0..2" in capsys.readouterr().err
    assert main([*common, "draft.vocab_size=301"]) == 2
    assert "model.vocab_size=300" in capsys.readouterr().err


def test_a_nan_weight_in_the_saved_sft_policy_exits_2_naming_the_file_and_tensor(tmp_path, capsys):
    """A NaN weight used to load, generate PAD tokens with NaN logprobs, and exit 0."""
    from safetensors.torch import load_file, save_file

    args = ["--recipe", "tiny", f"out_dir={tmp_path}", "sft.steps=2", "grpo.steps=1",
            "grpo.eval_every=0", "sampling.max_new_tokens=4"]
    assert main(["sft", *args]) == 0
    weights = tmp_path / "sft" / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.layers.0.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(tensors, weights, metadata={"format": "pt"})
    capsys.readouterr()
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert "sft: non-finite values (NaN or inf) in model.layers.0.mlp.up_proj.weight" in err
    assert not (tmp_path / "rl" / "metrics.jsonl").exists()


@pytest.mark.parametrize("pointer", [b"\xff\xfe", b"", b"..", b"step_000009"])
def test_a_damaged_latest_pointer_is_not_trusted(tmp_path, pointer):
    save_steps(tmp_path, [1, 2])
    (tmp_path / "latest").write_bytes(pointer)
    path, ckpt = load_latest_good(tmp_path, warn=lambda _: None)
    assert path.name == "step_000002" and ckpt["trainer_state"]["step"] == 2


def test_a_trainer_state_without_its_optimizer_names_what_is_missing(tmp_path):
    save_steps(tmp_path, [1])
    torch.save({"step": 1, "torch_rng": torch.get_rng_state(), "prompt_rng": []},
               tmp_path / "step_000001" / "trainer_state.pt")
    with pytest.raises(CheckpointError, match=r"trainer_state\.pt: not a trainer state \(no optimizer\)"):
        load_checkpoint(tmp_path / "step_000001")


def test_a_data_parallel_checkpoint_without_its_shards_is_refused(tmp_path):
    save_steps(tmp_path, [1])
    torch.save({"step": 1, "torch_rng": torch.get_rng_state(), "prompt_rng": [], "sharded": True},
               tmp_path / "step_000001" / "trainer_state.pt")
    with pytest.raises(CheckpointError, match=r"step_000001: no sharded/ directory"):
        load_checkpoint(tmp_path / "step_000001")


def test_a_speculative_runs_checkpoint_without_its_draft_is_refused(tmp_path):
    """Resuming it would co-train the offline draft with the co-trained one's optimizer state."""
    save_steps(tmp_path, [1], config={"rollout": {"speculative": True}})
    with pytest.raises(CheckpointError, match=r"step_000001: no draft/ directory"):
        load_checkpoint(tmp_path / "step_000001")


def test_non_finite_numbers_in_the_config_name_the_field():
    for override in ("grpo.lr=.inf", "sampling.temperature=.nan", "draft.cotrain_lr=-.inf"):
        with pytest.raises(ConfigError, match=rf"{override.split('=')[0]}: must be finite"):
            resolve("tiny", overrides=[override])


def test_an_unknown_task_family_exits_2(tmp_path, capsys):
    assert main(["sft", "--recipe", "tiny", f"out_dir={tmp_path}", "task.families=[copy,foo]"]) == 2
    assert "task.families: unknown 'foo'" in capsys.readouterr().err


def test_every_record_of_a_prompt_file_is_checked_against_the_context(tmp_path):
    from cospec.data.prompts import TaskData
    from cospec.data.tokenizer import CharTokenizer

    records = [{"prompt": "short", "answer": "1"}] * 2999 + [{"prompt": "x" * 80, "answer": "1"}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = resolve("tiny", overrides=[f"task.source={tmp_path / 'p.jsonl'}", "task.verifier=exact"])
    data = TaskData.from_config(cfg.task, CharTokenizer())
    data.check_room(82)
    with pytest.raises(ConfigError, match=r"max_seq_len=81: .* 81 tokens \(record 3000\), of all 3000"):
        data.check_room(81)


def test_a_field_error_in_a_config_file_names_the_file(tmp_path):
    (tmp_path / "run.yaml").write_text("grpo:\n  lr: -1\n")
    with pytest.raises(ConfigError, match=r"config file .*run\.yaml: grpo\.lr"):
        resolve("tiny", config_file=str(tmp_path / "run.yaml"))


def test_fresh_discards_the_old_run_only_once_the_new_one_has_its_models(tmp_path):
    args = ["--recipe", "tiny", f"out_dir={tmp_path}", "sft.steps=2", "grpo.steps=1",
            "grpo.eval_every=0", "sampling.max_new_tokens=4"]
    assert main(["train", *args]) == 0
    truncate(tmp_path / "sft" / "model.safetensors")
    assert main(["train", "--fresh", *args]) == 2
    assert (tmp_path / "rl" / "checkpoints" / "step_000001").is_dir()
