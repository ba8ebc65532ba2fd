"""Specification of artifacts keyed by what made them (cospec.artifacts): the SFT policy and the drafts
in out_dir are reused only when the config fields that make them are the same; otherwise rebuilt,
with a message naming the fields that differ, unless reuse is forced. Reuse is read off the files:
a reused artifact's weights file keeps its modification time."""

import json

import pytest
import torch

from cospec.artifacts import (MADE_BY, draft_fields, load_or_train_draft, load_or_train_sft,
                              sft_fields)
from cospec.config import apply, resolve
from cospec.cli import main

CPU = torch.device("cpu")


def tiny(tmp_path, *overrides):
    return resolve("tiny", overrides=[f"out_dir={tmp_path}", "sft.steps=2", "draft.train_steps=2",
                                      "draft.num_train_prompts=4", "sampling.max_new_tokens=4",
                                      *overrides])


def mtime(path) -> int:
    return path.stat().st_mtime_ns


def test_the_sft_policy_is_reused_on_equal_fields_and_rebuilt_naming_the_changed_one(tmp_path, capsys):
    cfg = tiny(tmp_path)
    load_or_train_sft(cfg, CPU)
    weights = tmp_path / "sft" / "model.safetensors"
    stamp = json.loads((tmp_path / "sft" / MADE_BY).read_text())
    assert stamp["fields"]["sft"]["steps"] == 2
    first = mtime(weights)

    load_or_train_sft(apply(cfg, {"grpo": {"lr": 1.0}, "task": {"source": "math"}}), CPU)
    assert mtime(weights) == first, "RL fields and the prompt source do not make the SFT policy"

    capsys.readouterr()
    load_or_train_sft(apply(cfg, {"sft": {"steps": 3}}), CPU)
    assert "sft.steps (2 -> 3)" in capsys.readouterr().out
    assert mtime(weights) != first
    assert json.loads((tmp_path / "sft" / MADE_BY).read_text())["fields"]["sft"]["steps"] == 3


def test_forced_reuse_keeps_a_mismatched_sft_policy_with_a_warning(tmp_path, capsys):
    cfg = tiny(tmp_path)
    load_or_train_sft(cfg, CPU)
    first = mtime(tmp_path / "sft" / "model.safetensors")
    capsys.readouterr()
    load_or_train_sft(apply(cfg, {"task": {"families": ["copy", "add"]}}), CPU, reuse=True)
    assert mtime(tmp_path / "sft" / "model.safetensors") == first
    assert "warning: reusing SFT checkpoint" in capsys.readouterr().out


def test_an_artifact_without_a_stamp_is_rebuilt(tmp_path, capsys):
    cfg = tiny(tmp_path)
    load_or_train_sft(cfg, CPU)
    (tmp_path / "sft" / MADE_BY).unlink()
    capsys.readouterr()
    load_or_train_sft(cfg, CPU)
    assert f"has no readable {MADE_BY}" in capsys.readouterr().out
    assert (tmp_path / "sft" / MADE_BY).exists()


def test_a_draft_is_rebuilt_when_its_policy_or_offline_fields_change_not_its_online_ones(tmp_path):
    cfg = tiny(tmp_path)
    policy, _ = load_or_train_sft(cfg, CPU)
    load_or_train_draft(cfg, policy, progress=False)
    weights = tmp_path / "draft" / "model.safetensors"
    first = mtime(weights)
    online = apply(cfg, {"rollout": {"speculative": True},
                         "draft": {"mode": "cotrain", "cotrain_lr": 0.5, "cotrain_iters": 3}})
    _, metrics = load_or_train_draft(online, policy, progress=False)
    assert metrics is None and mtime(weights) == first

    _, metrics = load_or_train_draft(apply(cfg, {"draft": {"train_steps": 3}}), policy, progress=False)
    assert metrics is not None and mtime(weights) != first


def test_a_replaced_draft_is_kept_and_comes_back_without_training_when_its_settings_do(tmp_path, capsys):
    """A draft stands for hours of training on a real model: the one a changed field replaces moves
    beside it (named by its fingerprint), and returning to its fields moves it back."""
    cfg = tiny(tmp_path)
    policy, _ = load_or_train_sft(cfg, CPU)
    load_or_train_draft(cfg, policy, progress=False)
    first = mtime(tmp_path / "draft" / "model.safetensors")
    fp_first = json.loads((tmp_path / "draft" / MADE_BY).read_text())["fingerprint"]
    longer = apply(cfg, {"draft": {"train_steps": 3}})

    capsys.readouterr()
    _, metrics = load_or_train_draft(longer, policy, progress=False)
    kept = tmp_path / f"draft.made-{fp_first[:16]}"
    assert metrics is not None and f"keeping the draft made with other settings as {kept}" in capsys.readouterr().out
    assert mtime(kept / "model.safetensors") == first
    second = mtime(tmp_path / "draft" / "model.safetensors")

    _, metrics = load_or_train_draft(cfg, policy, progress=False)
    assert metrics is None, "trained again instead of bringing the kept draft back"
    assert f"restored the draft made with these settings from {kept}" in capsys.readouterr().out
    assert mtime(tmp_path / "draft" / "model.safetensors") == first
    (other,) = tmp_path.glob("draft.made-*")  # the longer one, kept in turn
    assert mtime(other / "model.safetensors") == second


def test_a_draft_without_a_stamp_is_moved_aside_not_deleted_when_replaced(tmp_path, capsys):
    cfg = tiny(tmp_path)
    policy, _ = load_or_train_sft(cfg, CPU)
    load_or_train_draft(cfg, policy, progress=False)
    first = mtime(tmp_path / "draft" / "model.safetensors")
    (tmp_path / "draft" / MADE_BY).unlink()
    capsys.readouterr()
    _, metrics = load_or_train_draft(cfg, policy, progress=False)
    assert metrics is not None and "has no readable stamp" in capsys.readouterr().out
    assert mtime(tmp_path / "draft.made-unstamped" / "model.safetensors") == first


def test_draft_train_trains_anew_and_keeps_what_it_replaces(tmp_path, capsys):
    """draft-train (force) does not bring a kept copy back only to train over it: the draft in
    place moves aside when the new one is saved."""
    cfg = tiny(tmp_path)
    policy, _ = load_or_train_sft(cfg, CPU)
    longer = apply(cfg, {"draft": {"train_steps": 3}})
    load_or_train_draft(cfg, policy, progress=False)
    load_or_train_draft(longer, policy, progress=False)  # cfg's draft is kept aside
    capsys.readouterr()
    load_or_train_draft(cfg, policy, force=True, progress=False)
    out = capsys.readouterr().out
    assert "restored" not in out and "keeping the draft made with other settings" in out
    assert len(list(tmp_path.glob("draft.made-*"))) == 2  # both earlier drafts, one per settings


def test_a_draft_records_the_policy_it_was_trained_on():
    """A new SFT policy (other sft.* fields) changes every draft's fingerprint: its samples and
    features came from the old policy."""
    cfg = resolve("tiny")
    assert draft_fields(cfg)["policy"] == sft_fields(cfg)
    assert draft_fields(apply(cfg, {"sft": {"lr": 0.5}})) != draft_fields(cfg)
    assert draft_fields(apply(cfg, {"draft": {"mode": "frozen", "oracle_every": 3}})) == draft_fields(cfg)


def test_how_draft_train_holds_its_data_is_not_part_of_the_draft():
    """Keeping or recomputing the policy's outputs makes the same draft: a run interrupted with
    one setting resumes, and a saved draft is reused, under the other."""
    cfg = resolve("tiny")
    assert draft_fields(apply(cfg, {"draft": {"keep_policy_outputs": False}})) == draft_fields(cfg)
    # nor does padding its batches to a token bucket (same loss and gradients)
    assert "token_bucket" not in draft_fields(cfg)["draft"]
    assert draft_fields(apply(cfg, {"draft": {"token_bucket": 0}})) == draft_fields(cfg)
    assert draft_fields(apply(cfg, {"draft": {"tv_weight": 0.5}})) != draft_fields(cfg)  # the loss


def test_a_draft_field_added_later_changes_no_fingerprint_at_its_default():
    """`draft.layer_from_policy`, `draft.anchor_weight` and `draft.eagle3_layers` came after
    drafts were saved: at their defaults they are left out of the fields, so those drafts are
    still reused; set, they make another draft."""
    cfg = resolve("tiny")
    assert "eagle3_layers" not in draft_fields(cfg)["draft"]
    assert draft_fields(apply(cfg, {"draft": {"eagle3_layers": 2}}))["draft"]["eagle3_layers"] == 2
    assert "layer_from_policy" not in draft_fields(cfg)["draft"]
    assert draft_fields(apply(cfg, {"draft": {"layer_from_policy": True}}))["draft"]["layer_from_policy"]
    assert "anchor_weight" not in draft_fields(cfg)["draft"]
    assert draft_fields(apply(cfg, {"draft": {"anchor_weight": 2.0}}))["draft"]["anchor_weight"] == 2.0


def test_the_demo_takes_grpo_steps_from_a_config_file(tmp_path):
    """No command overrides a config file's value: the demo's budget is the default recipe's."""
    (tmp_path / "demo.yaml").write_text("grpo:\n  steps: 1\n  eval_every: 0\n")
    out = tmp_path / "run"
    assert main(["demo", "--recipe", "tiny", "--config", str(tmp_path / "demo.yaml"),
                 f"out_dir={out}", "sft.steps=2", "draft.train_steps=2",
                 "draft.num_train_prompts=4", "sampling.max_new_tokens=6"]) == 0
    for mode in ("none", "frozen", "cotrain-ce"):
        rows = [json.loads(line) for line in (out / "stale-draft" / mode / "metrics.jsonl").open()]
        assert [r["step"] for r in rows] == [1], mode


def test_a_draft_trained_on_a_reused_stale_policy_is_rebuilt_once_the_policy_is(tmp_path, capsys):
    """--reuse keeps an SFT policy made with other settings; a draft trained then records the
    policy it really saw (the SFT stamp), so it is rebuilt when the policy is."""
    load_or_train_sft(tiny(tmp_path), CPU)  # sft.steps=2
    new = tiny(tmp_path, "sft.steps=3")
    policy, _ = load_or_train_sft(new, CPU, reuse=True)  # still the 2-step policy
    load_or_train_draft(new, policy, progress=False)
    policy, _ = load_or_train_sft(new, CPU)  # now retrained at 3 steps
    capsys.readouterr()
    _, metrics = load_or_train_draft(new, policy, progress=False)
    assert metrics is not None, "the draft of the old policy was reused"
    assert "policy.sft.steps (2 -> 3)" in capsys.readouterr().out


def test_export_refuses_a_draft_made_with_other_settings_unless_reused(tmp_path, capsys):
    args = ["--recipe", "tiny", f"out_dir={tmp_path}", "sft.steps=2", "draft.train_steps=2",
            "draft.num_train_prompts=4", "sampling.max_new_tokens=4",
            "model.num_layers=4", "draft.tap_layers=[0,1,2]"]  # distinct, below the last: EAGLE-3
    assert main(["draft-train", *args]) == 0
    capsys.readouterr()
    assert main(["export", *args, "draft.train_steps=3"]) == 0
    out = capsys.readouterr().out
    assert "draft.train_steps (2 -> 3): not exporting it" in out
    assert "draft_eagle3" not in out.splitlines()[-1]
    assert main(["export", "--reuse", *args, "draft.train_steps=3"]) == 0
    assert "draft_eagle3" in capsys.readouterr().out.splitlines()[-1]

    assert main(["draft-train", *args, "draft.train_steps=3"]) == 0  # sets the first draft aside
    capsys.readouterr()
    assert main(["export", *args]) == 0  # the first draft's settings: exported from where it is kept
    out = capsys.readouterr().out
    assert "reusing draft" in out and "draft.made-" in out and "draft_eagle3" in out.splitlines()[-1]


def test_export_says_that_a_block_draft_has_no_layout_to_export_to(tmp_path, capsys):
    args = ["--recipe", "tiny", f"out_dir={tmp_path}", "sft.steps=2", "draft.train_steps=2",
            "draft.num_train_prompts=4", "sampling.max_new_tokens=4", "draft.kind=block"]
    assert main(["draft-train", *args]) == 0
    capsys.readouterr()
    assert main(["export", *args, "--out", str(tmp_path / "export")]) == 0
    out = capsys.readouterr().out
    assert "the block draft is not exported: only an EAGLE-3 draft has a layout" in out
    assert sorted(p.name for p in (tmp_path / "export").iterdir()) == ["policy"]


def test_a_diverged_offline_draft_is_not_saved(tmp_path):
    from cospec.models.integrity import NonFiniteError

    cfg = tiny(tmp_path, "draft.lr=1e30")
    policy, _ = load_or_train_sft(cfg, CPU)
    with pytest.raises(NonFiniteError, match=r"offline draft training diverged"):
        load_or_train_draft(cfg, policy, progress=False)
    assert not (tmp_path / "draft").exists()
