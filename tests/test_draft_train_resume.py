"""Specification of a long offline draft training (`cospec draft-train`) that loses nothing: the
policy's answers are kept in out_dir as they finish and reused by later runs, an interrupted
training resumes to the very weights of an uninterrupted one, and the draft's acceptance on
held-out answers is measured as it trains and saved beside it with a figure."""

import json
import random

import pytest
import torch

from cospec.artifacts import answer_store, load_or_train_draft, starting_policy_fields
from cospec.cli import main
from cospec.config import apply, resolve
from cospec.draft import offline
from cospec.draft.answer_store import policy_answers
from cospec.draft.offline import held_out_metrics, task_data
from cospec.draft.policy_outputs import policy_batches
from cospec.models.llama import Transformer
from cospec.rollout.engine import GenerationEngine

OVERRIDES = ["draft.num_train_prompts=12", "draft.num_eval_prompts=6", "sampling.max_new_tokens=8",
             "draft.train_steps=6", "draft.checkpoint_every=2", "draft.eval_every=3",
             "draft.tokens_per_batch=64"]


def tiny(tmp_path, *more):
    return resolve("tiny", overrides=[f"out_dir={tmp_path}", *OVERRIDES, *more])


@pytest.fixture()
def policy():
    torch.manual_seed(0)
    model = Transformer(resolve("tiny").model)
    model.reset_parameters(std=0.2)
    return model.eval()


def no_sampling(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("sampled answers that were kept")
    monkeypatch.setattr(GenerationEngine, "generate", refuse)


def interrupt_after(monkeypatch, answers: int):
    """Make generation raise KeyboardInterrupt once ``answers`` answers have finished."""
    generate, seen = GenerationEngine.generate, []

    def interrupted(self, prompts, sampling, *, on_answer=None, **kw):
        def counting(c):
            on_answer(c)
            seen.append(c)
            if len(seen) == answers:
                raise KeyboardInterrupt
        return generate(self, prompts, sampling, on_answer=counting, **kw)
    monkeypatch.setattr(GenerationEngine, "generate", interrupted)


def test_an_answer_depends_on_its_prompt_and_seed_not_on_the_batch_or_how_many_were_asked(policy, tmp_path):
    cfg = tiny(tmp_path)
    data = task_data(cfg, None)
    by_4 = policy_answers(apply(cfg, {"draft": {"answer_batch_size": 4}}), policy, data, "train", 12,
                          progress=False)
    by_3 = policy_answers(apply(cfg, {"draft": {"answer_batch_size": 3}}), policy, data, "train", 7,
                          progress=False)
    assert by_3 == by_4[:7]
    held = policy_answers(cfg, policy, data, "held_out", 6, progress=False)
    assert [a.prompt for a in held] != [a.prompt for a in by_4[:6]], "the held-out prompts are their own"


def test_kept_answers_are_reused_and_extended_by_a_run_that_asks_for_more(policy, tmp_path, monkeypatch, capsys):
    cfg = tiny(tmp_path)
    data = task_data(cfg, None)
    store = answer_store(cfg, starting_policy_fields(cfg))
    first = policy_answers(cfg, policy, data, "train", 8, store=store, progress=False)
    asked = []
    generate = GenerationEngine.generate
    monkeypatch.setattr(GenerationEngine, "generate",
                        lambda self, prompts, *a, **kw: asked.append(len(prompts)) or generate(self, prompts, *a, **kw))
    more = policy_answers(cfg, policy, data, "train", 12, store=store, progress=False)
    assert asked == [4] and more[:8] == first
    assert "reusing 8 kept train answers" in capsys.readouterr().out
    no_sampling(monkeypatch)
    assert policy_answers(cfg, policy, data, "train", 12, store=store, progress=False) == more


def test_other_sampling_makes_other_answers_in_a_store_of_their_own(tmp_path):
    cfg = tiny(tmp_path)
    fields = starting_policy_fields(cfg)
    assert answer_store(cfg, fields).dir == answer_store(
        apply(cfg, {"draft": {"train_steps": 99, "answer_batch_size": 2, "num_train_prompts": 3}}),
        fields).dir, "neither the training nor the number of answers makes the answers"
    assert answer_store(cfg, fields).dir != answer_store(
        apply(cfg, {"sampling": {"temperature": 0.5}}), fields).dir


def test_an_interrupt_while_sampling_keeps_the_finished_answers(policy, tmp_path, monkeypatch):
    cfg = tiny(tmp_path)
    data = task_data(cfg, None)
    store = answer_store(cfg, starting_policy_fields(cfg))
    interrupt_after(monkeypatch, 5)
    with pytest.raises(KeyboardInterrupt):
        policy_answers(cfg, policy, data, "train", 12, store=store, progress=False)
    assert len(store.load("train")) == 5
    monkeypatch.undo()
    resumed = policy_answers(cfg, policy, data, "train", 12, store=store, progress=False)
    assert resumed == policy_answers(cfg, policy, data, "train", 12, progress=False)


def test_an_unreadable_part_is_sampled_again(policy, tmp_path, capsys):
    cfg = tiny(tmp_path)
    data = task_data(cfg, None)
    store = answer_store(cfg, starting_policy_fields(cfg))
    first = policy_answers(cfg, policy, data, "train", 4, store=store, progress=False)
    (part,) = (store.dir / "train").glob("part-*.jsonl")
    part.write_text("{not json\n")
    assert policy_answers(cfg, policy, data, "train", 4, store=store, progress=False) == first
    assert "skipping unreadable kept answers" in capsys.readouterr().out


def stop_training_at(monkeypatch, step: int):
    """KeyboardInterrupt in the training loss of optimizer step ``step`` (1-based; the held-out
    evaluations run without gradients and are not counted)."""
    ttt_loss, calls = offline.ttt_loss, []

    def interrupted(*args, **kwargs):
        if torch.is_grad_enabled():
            calls.append(1)
            if len(calls) == step:
                raise KeyboardInterrupt
        return ttt_loss(*args, **kwargs)
    monkeypatch.setattr(offline, "ttt_loss", interrupted)


def test_an_interrupted_draft_training_resumes_to_the_same_weights_bit_for_bit(policy, tmp_path, monkeypatch, capsys):
    whole, whole_metrics = load_or_train_draft(tiny(tmp_path / "a"), policy, progress=False)

    cfg = tiny(tmp_path / "b")
    stop_training_at(monkeypatch, 6)  # after the checkpoint at step 4
    with pytest.raises(KeyboardInterrupt):
        load_or_train_draft(cfg, policy, progress=False)
    assert len(list((tmp_path / "b" / "draft.partial").glob("state-*.pt"))) == 1
    assert not (tmp_path / "b" / "draft").exists()
    monkeypatch.undo()
    no_sampling(monkeypatch)  # the answers were kept
    resumed, metrics = load_or_train_draft(cfg, policy, progress=False)
    assert "resuming draft training at step 4 of 6" in capsys.readouterr().out
    for (name, a), (_, b) in zip(whole.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name
    assert metrics["loss_history"] == whole_metrics["loss_history"]
    assert metrics["held_out"] == whole_metrics["held_out"]
    assert not (tmp_path / "b" / "draft.partial").exists(), "the partial state outlived the draft"


def test_a_partial_training_of_other_settings_is_kept_not_overwritten_and_resumes_when_they_return(
        policy, tmp_path, monkeypatch, capsys):
    cfg, other = tiny(tmp_path), apply(tiny(tmp_path), {"draft": {"lr": 1e-3}})
    partial = tmp_path / "draft.partial"
    stop_training_at(monkeypatch, 4)  # after the checkpoint at step 2
    with pytest.raises(KeyboardInterrupt):
        load_or_train_draft(cfg, policy, progress=False)
    (mine,) = partial.glob("state-*.pt")
    before = mine.read_bytes()

    monkeypatch.undo()
    stop_training_at(monkeypatch, 4)
    with pytest.raises(KeyboardInterrupt):  # a run with another lr, interrupted the same way
        load_or_train_draft(other, policy, progress=False)
    out = capsys.readouterr().out
    assert "also holds 1 other partial draft training file(s)" in out
    assert "resuming" not in out
    assert mine.read_bytes() == before, "another run's settings overwrote the partial training"
    assert len(list(partial.glob("state-*.pt"))) == 2

    monkeypatch.undo()
    whole, _ = load_or_train_draft(tiny(tmp_path / "whole"), policy, progress=False)
    no_sampling(monkeypatch)
    resumed, _ = load_or_train_draft(cfg, policy, progress=False)
    assert f"resuming draft training at step 2 of 6 from {mine}" in capsys.readouterr().out
    for (name, a), (_, b) in zip(whole.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name
    assert not mine.exists() and len(list(partial.glob("state-*.pt"))) == 1  # the other is kept


def test_fresh_discards_every_partial_training(policy, tmp_path, monkeypatch, capsys):
    cfg, other = tiny(tmp_path), apply(tiny(tmp_path), {"draft": {"lr": 1e-3}})
    for c in (cfg, other):
        stop_training_at(monkeypatch, 4)
        with pytest.raises(KeyboardInterrupt):
            load_or_train_draft(c, policy, progress=False)
        monkeypatch.undo()
    assert len(list((tmp_path / "draft.partial").glob("state-*.pt"))) == 2
    capsys.readouterr()
    load_or_train_draft(cfg, policy, progress=False, fresh=True)
    assert "resuming" not in capsys.readouterr().out
    assert not (tmp_path / "draft.partial").exists()


def test_a_partial_training_under_the_old_single_name_still_resumes(policy, tmp_path, monkeypatch, capsys):
    cfg = tiny(tmp_path)
    partial = tmp_path / "draft.partial"
    stop_training_at(monkeypatch, 4)  # after the checkpoint at step 2
    with pytest.raises(KeyboardInterrupt):
        load_or_train_draft(cfg, policy, progress=False)
    monkeypatch.undo()
    (mine,) = partial.glob("state-*.pt")
    legacy = mine.rename(partial / "state.pt")  # as cospec wrote it before per-settings names
    stop_training_at(monkeypatch, 3)  # resumed at 2: steps 3 and 4 (a checkpoint), then stopped
    with pytest.raises(KeyboardInterrupt):
        load_or_train_draft(cfg, policy, progress=False)
    assert f"resuming draft training at step 2 of 6 from {legacy}" in capsys.readouterr().out
    assert not legacy.exists() and mine.exists(), "the state did not move to its per-settings name"
    monkeypatch.undo()
    load_or_train_draft(cfg, policy, progress=False)
    assert f"resuming draft training at step 4 of 6 from {mine}" in capsys.readouterr().out
    assert not partial.exists()


def test_an_old_single_name_state_of_other_settings_is_kept_through_another_training(
        policy, tmp_path, monkeypatch, capsys):
    cfg = tiny(tmp_path)
    stop_training_at(monkeypatch, 4)
    with pytest.raises(KeyboardInterrupt):
        load_or_train_draft(apply(cfg, {"draft": {"lr": 1e-3}}), policy, progress=False)
    monkeypatch.undo()
    (theirs,) = (tmp_path / "draft.partial").glob("state-*.pt")
    legacy = theirs.rename(theirs.with_name("state.pt"))
    load_or_train_draft(cfg, policy, progress=False)
    out = capsys.readouterr().out
    assert "resuming" not in out and "also holds 1 other partial draft training file(s)" in out
    assert legacy.exists() and [p.name for p in (tmp_path / "draft.partial").iterdir()] == ["state.pt"]


def test_held_out_acceptance_is_measured_as_the_draft_trains_and_saved_beside_it(policy, tmp_path):
    cfg = tiny(tmp_path)
    draft, metrics = load_or_train_draft(cfg, policy, progress=False)
    assert [h["step"] for h in metrics["held_out"]] == [0, 3, 6]
    assert metrics["num_held_out_answers"] == 6
    data = task_data(cfg, None)
    held = policy_batches(cfg, policy, policy_answers(cfg, policy, data, "held_out", 6, progress=False),
                          vocab_ids=getattr(draft, "vocab_ids", None))
    again = held_out_metrics(draft, held, cfg)
    assert metrics["held_out"][-1]["acceptance"] == pytest.approx(again["acceptance"])
    assert all(0 <= a <= 1 for h in metrics["held_out"] for a in h["acceptance"])
    saved = json.loads((tmp_path / "draft" / "train_metrics.json").read_text())
    assert saved["held_out"] == metrics["held_out"]
    assert (tmp_path / "draft" / "training_curve.png").read_bytes()[:4] == b"\x89PNG"


def test_draft_train_ends_by_fitting_the_proposal_scale_on_the_held_out_answers(policy, tmp_path):
    """The fitted scale is the draft's, saved in draft.json, and the held-out expected tau at it
    is what the fit reported; draft.fit_proposal_scale=false makes a draft that proposes at 1, or
    sets a reused one to 1."""
    cfg = tiny(tmp_path)
    draft, metrics = load_or_train_draft(cfg, policy, progress=False)
    fit = metrics["proposal_scale_fit"]
    assert draft.proposal_scale == metrics["proposal_scale"] == fit["scale"]
    assert json.loads((tmp_path / "draft" / "draft.json").read_text())["proposal_scale"] == fit["scale"]
    assert fit["expected_tau_at_1"] == pytest.approx(
        metrics["held_out"][-1]["expected_accept_length"][0], rel=1e-9)  # measured at scale 1
    held = policy_batches(cfg, policy, policy_answers(cfg, policy, task_data(cfg, None), "held_out",
                                                      6, progress=False), vocab_ids=draft.vocab_ids)
    assert held_out_metrics(draft, held, cfg)["expected_accept_length"] == [
        pytest.approx(fit["expected_tau"], rel=1e-9)]
    assert fit["scale"] != 1.0 and fit["expected_tau"] > fit["expected_tau_at_1"]
    reused, metrics = load_or_train_draft(tiny(tmp_path, "draft.fit_proposal_scale=false"), policy,
                                          progress=False)
    assert metrics is None and reused.proposal_scale == 1.0  # the same draft, proposing at 1
    plain, metrics = load_or_train_draft(tiny(tmp_path / "off", "draft.fit_proposal_scale=false"),
                                         policy, progress=False)
    assert plain.proposal_scale == 1.0 and "proposal_scale" not in metrics


def test_draft_train_prints_the_held_out_curve_and_offers_fresh(tmp_path, capsys):
    args = ["draft-train", "--recipe", "tiny", f"out_dir={tmp_path}", "sft.steps=2", *OVERRIDES]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "held-out (6 answers) at step 0: acceptance" in out
    assert "held-out (6 answers) at step 6: acceptance" in out
    assert main([*args, "--fresh"]) == 0
    assert "reusing 12 kept train answers" in capsys.readouterr().out


def test_the_training_figure_is_drawn_for_a_draft_lm_an_eagle3_draft_and_without_held_out_answers(tmp_path):
    from cospec.metrics.draft_training import plot_draft_training

    losses = [3.0 - 0.01 * i for i in range(40)]
    lm = {"loss_history": losses, "held_out": [{"step": 0, "ce": [3.1], "tv": [0.9], "acceptance": [0.1]},
                                               {"step": 40, "ce": [2.7], "tv": [0.6], "acceptance": [0.4]}]}
    lm_ce_only = {"loss_history": losses,  # a draft LM's metrics before they kept TV
                  "held_out": [{"step": 0, "ce": [3.1]}, {"step": 40, "ce": [2.7]}]}
    none = {"loss_history": [1.0, 0.9], "held_out": []}
    eagle3 = {"loss_history": losses, "held_out": [
        {"step": 0, "acceptance": [0.3, 0.2], "expected_accept_length": [1.4]},
        {"step": 40, "acceptance": [0.6, 0.5], "expected_accept_length": [2.1]}]}
    for name, metrics in (("lm.png", lm), ("lm_ce.png", lm_ce_only), ("none.png", none),
                          ("eagle3.png", eagle3)):
        assert plot_draft_training(metrics, tmp_path / name).read_bytes()[:4] == b"\x89PNG"


def test_draft_trains_check_warms_each_engine_up_without_changing_a_token(policy, tmp_path, monkeypatch):
    """measure_speculation times each engine after an untimed warm-up on one batch; its answers
    are still those of cold engines started from the check's seed."""
    from cospec.evaluate import measure_speculation
    from cospec.rollout.speculative import SpeculativeEngine

    cfg = tiny(tmp_path, "sampling.batch_size=4", "sampling.max_new_tokens=12")
    draft, data = offline.build_draft(cfg, policy).eval(), task_data(cfg, None)
    rng = random.Random(7)
    prompts = [data.prompt_ids(data.source.sample(rng)) for _ in range(10)]
    stops, s = data.tokenizer.stop_ids, cfg.sampling
    cold_spec = SpeculativeEngine(policy, draft, batch_size=4, gamma=cfg.rollout.gamma, stop_ids=stops).generate(
        prompts, s, generator=torch.Generator().manual_seed(7))
    cold_plain = GenerationEngine(policy, batch_size=4, stop_ids=stops).generate(
        prompts, s, generator=torch.Generator().manual_seed(7))

    calls = []
    for engine in (SpeculativeEngine, GenerationEngine):  # the first calls the second's
        def counted(self, prompts, *args, _generate=engine.generate, _engine=engine, **kwargs):
            if type(self) is _engine:
                calls.append((_engine.__name__, len(prompts)))
            return _generate(self, prompts, *args, **kwargs)
        monkeypatch.setattr(engine, "generate", counted)
    spec, plain = measure_speculation(cfg, policy, draft, data, num_prompts=10, seed=7)
    assert calls == [("SpeculativeEngine", 4), ("SpeculativeEngine", 10),
                     ("GenerationEngine", 4), ("GenerationEngine", 10)]
    assert [c.tokens for c in spec.completions] == [c.tokens for c in cold_spec.completions]
    assert [c.tokens for c in plain.completions] == [c.tokens for c in cold_plain.completions]
    assert spec.num_tokens == sum(len(c.tokens) for c in cold_spec.completions)  # warm-up not counted
