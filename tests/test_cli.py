"""The `cospec` command: config errors exit 2 naming the field; sft and demo run end to end.

What a command did is read from what it wrote (checkpoints, metrics.jsonl, summary.json) and its
exit code; printed text is asserted only where it is the spec (an error naming the field or the
fix). A reused file is one whose modification time did not move."""

import json
import shutil

import pytest

from cospec.cli import main


def _mtime(path) -> int:
    return path.stat().st_mtime_ns


def _steps(metrics_jsonl, key: str) -> list[int]:
    """The steps of the metrics.jsonl rows that hold `key` (training rows: "reward"; evaluations:
    "eval_reward")."""
    rows = [json.loads(line) for line in metrics_jsonl.read_text().splitlines()]
    return [r["step"] for r in rows if key in r]


def test_a_bad_override_exits_2_and_names_the_field(capsys):
    assert main(["config", "model.num_heads=5"]) == 2
    assert "model.num_heads" in capsys.readouterr().err


def test_sft_then_demo_reuses_the_checkpoint_and_ends_with_report_and_summary(tmp_path):
    out = tmp_path / "run"
    args = ["--recipe", "tiny", f"out_dir={out}", "sft.steps=3", "sft.warmup_steps=1",
            "sft.eval_prompts_per_family=2", "draft.train_steps=3", "draft.num_train_prompts=8",
            "sampling.max_new_tokens=12", "grpo.steps=2"]
    assert main(["sft", *args]) == 0
    sft_weights = out / "sft" / "model.safetensors"
    assert (out / "sft_metrics.json").exists()
    sft_written = _mtime(sft_weights)
    assert main(["demo", *args]) == 0
    assert _mtime(sft_weights) == sft_written  # reused, not retrained
    assert (out / "draft" / "draft.json").exists()
    for mode in ("none", "frozen", "cotrain-ce"):
        assert _steps(out / "stale-draft" / mode / "metrics.jsonl", "reward") == [1, 2], mode
    assert (out / "report" / "report.html").stat().st_size > 0
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"none", "frozen", "cotrain-ce"}
    fields = {"reward_start", "reward_end", "tau_start", "tau_end", "rollout_speedup",
              "end_to_end_speedup", "cotrain_share"}
    assert all(set(row) == fields for row in summary.values())
    assert summary["none"]["tau_start"] is None and summary["none"]["end_to_end_speedup"] == 1.0
    assert all(summary[m][f] is not None for m in ("frozen", "cotrain-ce") for f in fields)


TINY = ["--recipe", "tiny", "sft.steps=3", "sft.warmup_steps=1", "sft.eval_prompts_per_family=2",
        "draft.train_steps=3", "draft.num_train_prompts=8", "sampling.max_new_tokens=12"]


def test_draft_train_then_speculative_cotraining_rl_then_a_refused_rerun(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["draft-train", *TINY, f"out_dir={out}"]) == 0
    draft_weights = out / "draft" / "model.safetensors"
    assert (out / "draft" / "draft.json").exists()
    draft_written = _mtime(draft_weights)
    rl = [*TINY, f"out_dir={out}", "rollout.speculative=true", "draft.mode=cotrain", "grpo.steps=2"]
    assert main(["train", *rl]) == 0
    assert _mtime(draft_weights) == draft_written  # the offline draft is co-training's start
    metrics, checkpoints = out / "rl" / "metrics.jsonl", out / "rl" / "checkpoints"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows if "reward" in r] == [1, 2]
    assert all("accept_length" in r and "draft_loss" in r for r in rows if "reward" in r)
    assert _steps(metrics, "eval_reward") == [0, 2]  # held-out reward before and after
    assert (checkpoints / "latest").read_text().strip() == "step_000002"
    assert (checkpoints / "step_000002" / "draft" / "draft.json").exists()  # the co-trained draft
    logged, latest = metrics.read_bytes(), _mtime(checkpoints / "latest")
    capsys.readouterr()
    # A second run into the same out_dir must say what to do rather than mix two runs.
    assert main(["train", *rl]) == 2
    assert "--resume" in capsys.readouterr().err
    # Resuming with another config is refused, naming the field.
    assert main(["train", *rl, "--resume", "grpo.lr=1e-3"]) == 2
    assert "grpo.lr" in capsys.readouterr().err
    assert metrics.read_bytes() == logged and _mtime(checkpoints / "latest") == latest


def test_a_retrained_sft_policy_drops_the_draft_made_for_the_old_one(tmp_path):
    """Another sft.label_noise retrains the SFT policy; the saved draft still fits its config but
    learnt the old policy, so a speculative run must train a new one rather than reuse it."""
    out = tmp_path / "run"
    assert main(["draft-train", *TINY, f"out_dir={out}"]) == 0
    old_policy = (out / "sft" / "model.safetensors").read_bytes()
    old_draft = (out / "draft" / "model.safetensors").read_bytes()
    assert main(["train", *TINY, f"out_dir={out}", "sft.label_noise=0.1",
                 "rollout.speculative=true", "grpo.steps=1", "grpo.eval_every=0"]) == 0
    assert (out / "sft" / "model.safetensors").read_bytes() != old_policy
    assert (out / "draft" / "model.safetensors").read_bytes() != old_draft


def test_resume_accepts_a_checkpoint_from_before_a_field_existed_at_its_default():
    from cospec.rl.checkpoint import check_resumable
    from cospec.config import ConfigError, RunConfig

    cfg = RunConfig()
    stored = cfg.to_dict()
    del stored["sft"]["label_noise"]  # a checkpoint written before the field was added
    check_resumable(cfg, stored)
    stored["sft"]["label_noise"] = 0.3
    with pytest.raises(ConfigError, match="sft.label_noise"):
        check_resumable(cfg, stored)


def test_stale_draft_experiment_writes_its_json_and_plots(tmp_path):
    out = tmp_path / "run"
    assert main(["experiment", "stale-draft", "--modes", "none,frozen,cotrain-tv", *TINY,
                 f"out_dir={out}", "grpo.steps=2"]) == 0
    result = json.loads((out / "stale-draft" / "stale_draft.json").read_text())
    assert set(result["modes"]) == {"none", "frozen", "cotrain-tv"}
    assert all(len(h) == 2 for h in result["modes"].values())
    assert "tau_first" in result["summary"]["frozen"] and "tau_first" not in result["summary"]["none"]
    # each speculative step's answers timed again by plain decoding at their lengths (paired)
    for mode in ("frozen", "cotrain-tv"):
        assert all(h["paired_plain_generate"] > 0 for h in result["modes"][mode])
    assert not any("paired_plain_generate" in h for h in result["modes"]["none"])
    for png in ("tau_vs_step.png", "reward_vs_step.png", "step_time_split.png"):
        assert (out / "stale-draft" / png).stat().st_size > 0
    made_by = json.loads((out / "draft" / "made_by.json").read_text())
    assert result["start_draft"] == {"path": str(out / "draft"), "made_by": made_by}
    # --out puts another experiment beside the first, on the same SFT policy and draft; --reuse
    # keeps that draft under other draft settings, and the JSON says what the draft was made with
    assert main(["experiment", "stale-draft", "--modes", "frozen", "--out", str(tmp_path / "more"),
                 "--reuse", *TINY, f"out_dir={out}", "grpo.steps=1", "draft.train_steps=4"]) == 0
    more = json.loads((tmp_path / "more" / "stale_draft.json").read_text())
    assert set(more["modes"]) == {"frozen"}
    # without a plain mode, a plain engine over the frozen mode's policy times its answers
    assert all(h["paired_plain_generate"] > 0 for h in more["modes"]["frozen"])
    assert more["config"]["draft"]["train_steps"] == 4
    assert more["start_draft"]["made_by"] == made_by
    assert made_by["fields"]["draft"]["train_steps"] == 3
    assert set(json.loads((out / "stale-draft" / "stale_draft.json").read_text())["modes"]) == {
        "none", "frozen", "cotrain-tv"}


def test_the_paired_plain_engine_is_nones_else_a_plain_one_over_a_speculative_modes_policy():
    from types import SimpleNamespace

    import torch

    from cospec.config import resolve
    from cospec.experiments.stale_draft import paired_plain_engine
    from cospec.models.llama import Transformer
    from cospec.rl.trainer import GRPOTrainer
    from cospec.rollout.engine import GenerationEngine
    from cospec.rollout.speculative import SpeculativeEngine

    cfg = resolve("tiny", overrides=["sampling.batch_size=3"])
    torch.manual_seed(0)
    policies = [Transformer(cfg.model).eval() for _ in range(2)]

    def trainer(speculative: bool, policy, engine=None):
        mode_cfg = SimpleNamespace(rollout=SimpleNamespace(speculative=speculative, compile=False),
                                   sampling=cfg.sampling)
        t = SimpleNamespace(cfg=mode_cfg, rollout_policy=policy, engine=engine,
                            data=SimpleNamespace(tokenizer=SimpleNamespace(stop_ids=(2,))))
        t.make_engine = lambda *, plain=False: GRPOTrainer.make_engine(t, plain=plain)
        return t

    none_engine = object()
    both = {"none": trainer(False, policies[0], none_engine), "frozen": trainer(True, policies[1])}
    assert paired_plain_engine(both) is none_engine
    engine = paired_plain_engine({"frozen": trainer(True, policies[1]), "cotrain": trainer(True, policies[0])})
    assert type(engine) is GenerationEngine and not isinstance(engine, SpeculativeEngine)
    assert engine.model is policies[1] and engine.batch_size == 3  # the first speculative mode's
    assert paired_plain_engine({"other": trainer(False, policies[0])}) is None  # none speculates


def test_bench_rollout_measures_each_draft_kind_side_by_side(tmp_path, capsys):
    """`--drafts eagle3,block`: one row per draft kind and batch size (a ``draft`` field), each
    draft trained in its own directory, and the acceptance by task family of each. The rollout.*
    and block fields are read (the benchmark speculates with each kind): no warning says not."""
    out, path = tmp_path / "run", tmp_path / "bench.json"
    assert main(["bench", "rollout", "--quick", "--no-hf", "--batch-sizes", "2",
                 "--drafts", "eagle3,block", "--json", str(path), *TINY, f"out_dir={out}",
                 "rollout.gamma=2", "draft.ttt_steps=2", "draft.block_layers=1",
                 "draft.block_confidence=false"]) == 0
    assert "has no effect" not in capsys.readouterr().err
    result = json.loads(path.read_text())
    assert [(r["draft"], r["batch_size"]) for r in result["results"]] == [("eagle3", 2), ("block", 2)]
    assert all(r["accept_length"] >= 1 and set(r["draft_step_over_decode_by_gamma"]) == {"1", "2"}
               for r in result["results"])
    # each speculative run is paired with plain decoding of its own response lengths
    assert all(r["paired_speedup"] > 0 and r["adaptive_paired_speedup"] > 0 for r in result["results"])
    assert (out / "draft").is_dir() and (out / "draft_block").is_dir()
    families = result["acceptance_by_family"]
    assert set(families) == {"eagle3", "block"} and set(families["block"]) == set(families["eagle3"])
    assert result["meta"]["drafts"]["block"]["confidence"] is False
    for kind, where in (("eagle3", "draft"), ("block", "draft_block")):  # what each was made with
        stamp = json.loads((out / where / "made_by.json").read_text())
        assert result["meta"]["drafts"][kind]["made_by"] == stamp
        assert stamp["fields"]["draft"]["kind"] == kind
    # a kind not asked for is neither trained nor loaded
    shutil.rmtree(out / "draft")
    assert main(["bench", "rollout", "--quick", "--no-hf", "--batch-sizes", "2", "--drafts", "block",
                 "--json", str(path), *TINY, f"out_dir={out}", "rollout.gamma=2", "draft.ttt_steps=2",
                 "draft.block_layers=1", "draft.block_confidence=false"]) == 0
    assert not (out / "draft").exists()
    assert [r["draft"] for r in json.loads(path.read_text())["results"]] == ["block"]


def test_bench_compile_measures_eager_and_compiled_engines_side_by_side(tmp_path):
    """`cospec bench compile`: per batch size, plain and speculative engines eager and compiled on
    the same prompts and seeds; the compiled ones sample the eager ones' tokens, and their
    compiled graphs (verification, the draft's steps) were the ones called."""
    out, path = tmp_path / "run", tmp_path / "compile.json"
    assert main(["bench", "compile", "--quick", "--batch-sizes", "2", "--json", str(path), *TINY,
                 f"out_dir={out}", "rollout.gamma=2", "draft.ttt_steps=2"]) == 0
    (row,) = json.loads(path.read_text())["results"]
    assert row["batch_size"] == 2 and row["rows_equal_to_eager"] == {"plain": 1.0, "spec": 1.0}
    assert all(row[f"{k}_tok_s"] > 0 for k in ("plain", "plain_compiled", "spec", "spec_compiled"))
    calls = row["compiled_calls_by_span"]
    assert sum(calls["plain"].values()) > 0 and sum(calls["verify"].values()) > 0
    assert sum(calls["draft"].values()) > 0


def test_the_long_workload_on_a_policy_that_never_saw_copy_is_refused_before_any_work(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["bench", "rollout", "--quick", "--no-hf", "--workload", "long", *TINY,
                 f"out_dir={out}", "task.families=[carry,mul]"]) == 2
    assert "--workload long samples copy prompts" in capsys.readouterr().err and not out.exists()


def test_a_parallel_config_without_torchrun_says_how_to_launch(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["train", *TINY, f"out_dir={tmp_path}", "parallel.cp=2"]) == 2
    assert "torchrun --nproc-per-node 2" in capsys.readouterr().err
    assert main(["train", *TINY, f"out_dir={tmp_path}", "parallel.cp=2", "parallel.pp=2"]) == 2
    assert "torchrun --nproc-per-node 4" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # refused before any work


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["parallel.pp=2 parallel.cp=2", "parallel.dp=2 parallel.cp=2"])
def test_torchrun_runs_distributed_grpo_from_the_command_line(tmp_path, layout):
    """The real entry point: torchrun starts dp x pp x cp ranks of `python -m cospec train`; rank 0
    makes the SFT policy and the draft, all ranks train, rank 0 logs and checkpoints. Two meshes
    between them launch every axis (each layout's step itself: tests/test_parallel_grpo.py)."""
    import json
    import math
    import subprocess
    import sys
    from pathlib import Path

    torchrun = Path(sys.executable).parent / "torchrun"
    out = tmp_path / "run"
    overrides = layout.split()
    nproc = math.prod(int(o.split("=")[1]) for o in overrides)
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", str(nproc),
           "-m", "cospec", "train", *TINY, f"out_dir={out}", "rollout.speculative=true",
           "draft.mode=cotrain", "rollout.adaptive=false", "grpo.steps=2", "grpo.eval_every=0",
           *overrides]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all("accept_length" in r for r in rows)
    assert (out / "rl" / "checkpoints" / "latest").exists()


def test_the_stale_draft_modes_build_on_a_cotraining_recipe_and_adaptive_is_kept_on_request(tmp_path):
    """A recipe whose draft.mode is cotrain (smollm2-math's) still builds the plain mode, and
    --adaptive keeps rollout.adaptive (gamma is otherwise fixed so tau compares across modes)."""
    import torch

    from cospec.config import resolve
    from cospec.experiments.stale_draft import make_trainer
    from cospec.models.draft import Eagle3Draft
    from cospec.models.llama import Transformer

    cfg = resolve("tiny", overrides=["draft.mode=cotrain", "rollout.speculative=true",
                                     "rollout.adaptive=true"])
    torch.manual_seed(0)
    policy = Transformer(cfg.model)
    draft = Eagle3Draft.from_policy(policy)
    plain = make_trainer(cfg, "none", policy, draft, tmp_path)
    assert not plain.cfg.rollout.speculative
    fixed = make_trainer(cfg, "cotrain-ce", policy, draft, tmp_path)
    adaptive = make_trainer(cfg, "cotrain-ce", policy, draft, tmp_path, adaptive=True)
    assert not fixed.cfg.rollout.adaptive and adaptive.cfg.rollout.adaptive


def test_the_stale_draft_cotrain_mode_co_trains_with_the_runs_own_loss_mix(tmp_path):
    """`cotrain` co-trains as `cospec train` would, with the run's draft.tv_weight (a recipe's
    0.75, say); `cotrain-ce` and `cotrain-tv` pin it to 0 and 1 whatever the run says."""
    import torch

    from cospec.config import resolve
    from cospec.experiments.stale_draft import make_trainer
    from cospec.models.draft import Eagle3Draft
    from cospec.models.llama import Transformer

    cfg = resolve("tiny", overrides=["draft.tv_weight=0.75"])
    torch.manual_seed(0)
    policy = Transformer(cfg.model)
    draft = Eagle3Draft.from_policy(policy)
    mixes = {mode: make_trainer(cfg, mode, policy, draft, tmp_path / mode).cfg.draft
             for mode in ("cotrain", "cotrain-ce", "cotrain-tv")}
    assert {m: d.mode for m, d in mixes.items()} == dict.fromkeys(mixes, "cotrain")
    assert {m: d.tv_weight for m, d in mixes.items()} == {"cotrain": 0.75, "cotrain-ce": 0.0,
                                                           "cotrain-tv": 1.0}


def test_the_policy_movement_panel_says_when_kl_was_not_measured(tmp_path, monkeypatch):
    """grpo.log_kl=false leaves kl_from_init NaN (null once in JSON): the panel says so instead
    of an empty frame that reads as a policy that did not move."""
    from cospec.experiments import stale_draft

    saved = {}
    monkeypatch.setattr(stale_draft, "save_figure_atomically",
                        lambda fig, path, **kw: saved.setdefault(path.name, fig))

    def run(kl):
        return [{"step": i, "reward": 0.5, "kl_from_init": kl, "accept_length": 2.0,
                 "time": {"generate": 1.0}} for i in (1, 2)]

    for kl, says in ((float("nan"), True), (None, True), (0.01, False)):
        saved.clear()
        stale_draft.plot({"none": run(kl), "frozen": run(kl)}, tmp_path)
        kl_panel = saved["tau_vs_step.png"].axes[1]
        assert any("not measured" in t.get_text() for t in kl_panel.texts) == says
        assert (kl_panel.get_legend() is not None) == (not says)
