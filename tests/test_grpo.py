"""Specification of GRPO (cospec.rl.grpo, cospec.rl.trainer): the math by hand, one step's effect,
lossless speculative rollouts inside RL, train/inference parity, and checkpoints that survive kills.
"""

import copy
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cospec.config import resolve
from cospec.models.draft import Eagle3Draft
from cospec.models.llama import Transformer
from cospec.rl import grpo
from cospec.rl.checkpoint import latest_checkpoint, load_checkpoint
from cospec.rl.trainer import GRPOTrainer
from cospec.rollout.engine import Completion
from cospec.config import SamplingConfig


# ----------------------------------------------------------------------------- the math by hand

def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    std = math.sqrt(0.1875)  # population std of [1, 0, 0, 0]
    expected = [0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std, 0, 0, 0, 0]
    torch.testing.assert_close(grpo.group_advantages(rewards, 4, "mean_std", eps=0.0)[:4],
                               torch.tensor(expected[:4]))
    # An all-equal group gets zero advantage (no signal), with or without std normalisation.
    assert grpo.group_advantages(rewards, 4, "mean_std")[4:].abs().max() == 0
    torch.testing.assert_close(grpo.group_advantages(rewards, 4, "mean"),
                               torch.tensor([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0]))


def test_clipped_loss_by_hand_with_token_level_normalisation():
    # Two rollouts: 3 tokens with A = +1, 1 token with A = -2; one masked-out token.
    logp = torch.log(torch.tensor([0.5, 0.9, 0.2, 0.3, 0.7]))
    old = torch.log(torch.tensor([0.5, 0.6, 0.4, 0.1, 0.7]))
    adv = torch.tensor([1.0, 1.0, 1.0, -2.0, 5.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0])
    # ratios 1.0, 1.5, 0.5, 3.0; clip range [0.8, 1.28]:
    #  A>0: min(1*1, 1*1)=1; min(1.5, 1.28)=1.28; min(0.5, 0.8)=0.5
    #  A<0: min(3*-2, 1.28*-2) = -6
    expected = -(1 + 1.28 + 0.5 - 6) / 4  # token-level: divide by 4 tokens, not per sequence
    out = grpo.clipped_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    assert math.isclose(out.loss.item(), expected, rel_tol=1e-6)
    assert math.isclose(out.clip_fraction, 3 / 4)  # 1.5, 0.5 and 3.0 lie outside [0.8, 1.28]


def test_kl_penalty_adds_beta_times_the_mean_token_kl():
    logp = torch.zeros(3)
    kl = torch.tensor([0.1, 0.2, 0.6])
    mask = torch.tensor([1.0, 1.0, 0.0])
    base = grpo.clipped_policy_loss(logp, logp, torch.ones(3), mask, clip_low=0.2, clip_high=0.2)
    pen = grpo.clipped_policy_loss(logp, logp, torch.ones(3), mask, clip_low=0.2, clip_high=0.2,
                                   kl_T=kl, kl_coef=0.5)
    assert math.isclose(pen.loss.item() - base.loss.item(), 0.5 * 0.15, rel_tol=1e-6)


# ----------------------------------------------------------------------------- one step

def tiny_cfg(*overrides):
    return resolve("tiny", overrides=["grpo.prompts_per_step=2", "grpo.group_size=2",
                                      "grpo.lr=3e-3", *overrides])


def test_one_step_raises_the_probability_of_above_average_rollouts(tmp_path):
    cfg = tiny_cfg(f"out_dir={tmp_path}")
    torch.manual_seed(0)
    policy = Transformer(cfg.model)
    trainer = GRPOTrainer(cfg, policy, tensorboard=False)
    batch = trainer.generate()
    batch.rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])  # rigged: rollouts 0 and 3 are "right"
    trainer.compute_advantages(batch)

    def seq_logprob(c: Completion) -> float:
        with torch.no_grad():
            logits = trainer.policy(torch.tensor([c.prompt + c.tokens])).logits[0]
        lp = grpo.token_logprobs(logits[len(c.prompt) - 1:-1], torch.tensor(c.tokens), 1.0)
        return lp.sum().item()

    before = [seq_logprob(c) for c in batch.completions]
    trainer.train_policy(batch)
    after = [seq_logprob(c) for c in batch.completions]
    assert after[0] > before[0] and after[3] > before[3]
    assert after[1] < before[1] and after[2] < before[2]


def test_without_the_kl_log_the_step_skips_the_reference_and_updates_the_policy_identically(tmp_path):
    """grpo.log_kl=false at kl_coef=0: no reference model and no reference forward; the update is
    the one the logged run makes, and kl_from_init says it was not measured (NaN), not 0."""
    torch.manual_seed(0)
    policy = Transformer(tiny_cfg().model)
    logged = GRPOTrainer(tiny_cfg(f"out_dir={tmp_path}/a"), copy.deepcopy(policy), tensorboard=False)
    skipped = GRPOTrainer(tiny_cfg(f"out_dir={tmp_path}/b", "grpo.log_kl=false"), copy.deepcopy(policy),
                          tensorboard=False)
    assert skipped.reference is None and logged.reference is not None
    batch = logged.generate()
    logged.score(batch)
    logged.compute_advantages(batch)
    a, b = logged.train_policy(batch), skipped.train_policy(batch)
    for (name, x), y in zip(logged.policy.named_parameters(), skipped.policy.parameters()):
        assert torch.equal(x, y), name
    assert math.isfinite(a["kl_from_init"]) and math.isnan(b["kl_from_init"])
    assert a["loss"] == b["loss"]


@pytest.mark.parametrize("reduced_head", [False, True], ids=["full-head-draft", "8-id-head-draft"])
def test_the_step_runs_the_head_at_the_response_positions_and_updates_as_the_full_head_would(
        reduced_head):
    """`LocalPolicyStep` computes logits only where the loss reads them (a prompt's positions
    predict prompt tokens). Oracle: the same loss from the logits of every position, by the
    minibatch terms without picked rows. Same statistics, same update (a KL penalty, so the
    reference's logits count too), and the draft's captured targets are the full logits' at the
    response positions (zeros where the TTT losses never read)."""
    from cospec.draft.losses import draft_targets
    from cospec.rl.policy_step import LocalPolicyStep, PolicyMinibatch, minibatch_terms

    torch.manual_seed(0)
    cfg = tiny_cfg().model
    policy = Transformer(cfg)
    policy.reset_parameters(std=0.1)
    reference = copy.deepcopy(policy).requires_grad_(False)
    comps = [Completion(index=i, prompt=list(range(3, 3 + p)),
                        tokens=torch.randint(3, 40, (n,)).tolist(), logprobs=(-torch.rand(n)).tolist())
             for i, (p, n) in enumerate([(6, 4), (9, 7), (3, 1)])]
    mb = PolicyMinibatch.from_rollouts(comps, torch.tensor([0.7, -1.2, 0.4]), [0, 1, 2])
    keep = draft_targets(torch.tensor([3, 5, 8, 13, 21, 34, 40, 41]) if reduced_head else None, 0.8)
    kw = dict(temperature=0.8, clip_low=0.2, clip_high=0.28, kl_coef=0.1)
    oracle = copy.deepcopy(policy)
    opt_o = torch.optim.AdamW(oracle.parameters(), lr=1e-2, fused=True)
    out = oracle(mb.tokens[None], cu_seqlens=mb.cu_seqlens, tap_layers=(0, 1))
    ref = reference(mb.tokens[None], cu_seqlens=mb.cu_seqlens).logits[0]
    loss, want_sums = minibatch_terms(out.logits[0], ref, mb, **kw)
    loss.backward()
    opt_o.step()
    step = LocalPolicyStep(policy, reference, torch.optim.AdamW(policy.parameters(), lr=1e-2,
                                                                fused=True),
                           grad_clip=0.0, draft_targets=keep, **kw)
    sums, _, (captured,) = step(mb, tap_layers=(0, 1))
    torch.testing.assert_close(sums, want_sums)
    for (name, a), b in zip(policy.named_parameters(), oracle.parameters()):
        torch.testing.assert_close(a, b, msg=name)
    rows = mb.loss_mask > 0
    assert 0 < rows.sum() < len(rows)  # prompts and responses both present
    want = keep(out.logits[0].detach())
    torch.testing.assert_close(captured.policy_logits[rows], want[rows])
    assert not captured.policy_logits[~rows].any()


def test_a_bf16_autocast_policy_step_keeps_fp32_weights_and_matches_the_fp32_step(tmp_path):
    """grpo.autocast=bfloat16: the forwards run in bf16 (AMX on CPU), weights and optimizer state
    stay fp32; on the same batch the loss and the update agree with the fp32 step to bf16 precision
    (the update's direction: cosine > 0.95); the draft co-trains (in fp32) on its captured features."""
    torch.manual_seed(0)
    policy = Transformer(tiny_cfg().model)
    policy.reset_parameters(std=0.1)
    draft = Eagle3Draft.from_policy(policy)
    common = ["rollout.speculative=true", "rollout.adaptive=false", "draft.mode=cotrain"]
    full = GRPOTrainer(tiny_cfg(f"out_dir={tmp_path}/a", *common), copy.deepcopy(policy),
                       draft=copy.deepcopy(draft), tensorboard=False)
    mixed = GRPOTrainer(tiny_cfg(f"out_dir={tmp_path}/b", "grpo.autocast=bfloat16", *common),
                        copy.deepcopy(policy), draft=copy.deepcopy(draft), tensorboard=False)
    batch = full.generate()
    full.score(batch)
    batch.rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    full.compute_advantages(batch)
    a, b = full.train_policy(batch), mixed.train_policy(batch)
    assert all(p.dtype == torch.float32 for p in mixed.policy.parameters())
    assert math.isclose(a["loss"], b["loss"], rel_tol=0.05, abs_tol=1e-3)
    delta = lambda t: torch.cat([(p - q).flatten() for p, q in zip(t.policy.parameters(), policy.parameters())])  # noqa: E731
    assert torch.nn.functional.cosine_similarity(delta(full), delta(mixed), dim=0) > 0.95
    draft_before = [p.detach().clone() for p in mixed.draft.parameters()]
    m = mixed.train_draft()
    assert math.isfinite(m["draft_loss"])
    assert any(not torch.equal(x, y) for x, y in zip(draft_before, mixed.draft.parameters()))


def test_the_reference_forward_runs_only_for_a_penalty_or_on_request(tmp_path):
    """grpo.log_kl is off by default (the embedded recipe asks for it); a KL penalty needs the
    reference, so with kl_coef > 0 the KL is computed and logged whatever log_kl says."""
    from cospec.config import RunConfig

    assert RunConfig().grpo.log_kl is False and tiny_cfg().grpo.log_kl is True
    torch.manual_seed(0)
    policy = Transformer(tiny_cfg().model)
    trainer = GRPOTrainer(tiny_cfg(f"out_dir={tmp_path}", "grpo.log_kl=false", "grpo.kl_coef=0.1"),
                          policy, tensorboard=False)
    assert trainer.reference is not None
    batch = trainer.generate()
    trainer.score(batch)
    trainer.compute_advantages(batch)
    assert math.isfinite(trainer.train_policy(batch)["kl_from_init"])


# ----------------------------------------------------------------------------- speculative RL

def trainers_plain_and_speculative(tmp_path, *spec_overrides):
    torch.manual_seed(0)
    cfg = tiny_cfg(f"out_dir={tmp_path}", "grpo.prompts_per_step=8", "grpo.group_size=8",
                   "sampling.batch_size=32", "sampling.max_new_tokens=12")
    policy = Transformer(cfg.model)
    policy.reset_parameters(std=0.1)
    torch.manual_seed(1)
    draft = Eagle3Draft.from_policy(policy)
    plain = GRPOTrainer(cfg, policy, tensorboard=False)
    spec_cfg = resolve("tiny", overrides=[f"out_dir={tmp_path}/spec", "grpo.prompts_per_step=8",
                                          "grpo.group_size=8", "sampling.batch_size=32",
                                          "sampling.max_new_tokens=12",
                                          "grpo.lr=3e-3", "rollout.speculative=true",
                                          "rollout.adaptive=false", "rollout.gamma=3", *spec_overrides])
    spec = GRPOTrainer(spec_cfg, policy, draft=draft, tensorboard=False)
    return plain, spec


@pytest.mark.parametrize("mode", ["frozen", "cotrain"])
def test_plain_and_speculative_rl_rollouts_agree(tmp_path, mode):
    """Greedy: identical rollouts from the trainers' own engines. Sampling: two short RL runs whose
    response lengths (a statistic any sampling bug moves) agree by a chi-square two-sample test
    (p > 1e-3), and whose trainer-vs-rollout logprob mismatch is ~0 (fp32 noise). With co-training
    the draft changes every step (and only the draft: its loss never reaches the policy)."""
    plain, spec = trainers_plain_and_speculative(tmp_path, f"draft.mode={mode}")
    prompts = [plain.data.prompt_ids(plain.data.source.sample(plain.prompt_rng))
               for _ in range(24)]
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=20)
    a = plain.engine.generate(prompts, greedy).completions
    b = spec.engine.generate(prompts, greedy).completions
    assert [c.tokens for c in a] == [c.tokens for c in b]

    lengths = {"plain": [], "spec": []}
    for name, trainer in (("plain", plain), ("spec", spec)):
        for _ in range(2):
            batch = trainer.generate()
            trainer.score(batch)
            trainer.compute_advantages(batch)
            m = trainer.train_policy(batch)
            policy_before = [p.detach().clone() for p in trainer.policy.parameters()]
            draft_before = trainer.draft and [p.detach().clone() for p in trainer.draft.parameters()]
            trainer.train_draft()
            assert all(torch.equal(a, b) for a, b in zip(policy_before, trainer.policy.parameters()))
            if name == "spec":
                changed = any(not torch.equal(a, b) for a, b in zip(draft_before, trainer.draft.parameters()))
                assert changed == (mode == "cotrain")
            trainer.sync_weights()
            trainer.step += 1
            lengths[name] += [len(c.tokens) for c in batch.completions]
            assert m["mismatch_mean_abs_logprob"] < 1e-4, name
            assert m["mismatch_token_mult_prob_error"] < 1 + 1e-4, name
    bins = [(0, 3), (3, 6), (6, 9), (9, 12), (12, 13)]
    table = [[sum(lo <= n < hi for n in lengths[k]) for lo, hi in bins] for k in ("plain", "spec")]
    cols = [(i, table[0][i] + table[1][i]) for i in range(len(bins)) if table[0][i] + table[1][i] > 0]
    total = [sum(row) for row in table]
    stat = sum((table[r][i] - total[r] * c / sum(total)) ** 2 / (total[r] * c / sum(total))
               for r in range(2) for i, c in cols)
    p_value = torch.special.gammaincc(torch.tensor((len(cols) - 1) / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64)).item()
    assert p_value > 1e-3, (table, p_value)


def test_bf16_rollouts_beside_fp32_training_get_the_trained_weights_rounded(tmp_path):
    """rollout.dtype=bfloat16: the engine runs on bf16 copies of the policy and the co-trained
    draft, training stays in fp32, and each sync hands the engine the trained weights rounded to
    bf16; the trainer's logprobs differ from the rollouts' by that rounding only (measured, small)."""
    _, spec = trainers_plain_and_speculative(tmp_path, "rollout.dtype=bfloat16", "draft.mode=cotrain")
    assert next(spec.rollout_policy.parameters()).dtype == torch.bfloat16
    assert next(spec.rollout_draft.parameters()).dtype == torch.bfloat16
    assert next(spec.policy.parameters()).dtype == torch.float32
    batch = spec.generate()
    spec.score(batch)
    spec.compute_advantages(batch)
    m = spec.train_policy(batch)
    spec.train_draft()
    spec.sync_weights()
    for trained, engine in [(spec.policy, spec.rollout_policy), (spec.draft, spec.rollout_draft)]:
        for (name, a), b in zip(trained.named_parameters(), engine.parameters()):
            assert torch.equal(b, a.detach().to(torch.bfloat16)), name
    assert 0 < m["mismatch_mean_abs_logprob"] < 0.05


# ----------------------------------------------------------------------------- checkpoints

def test_an_interrupted_checkpoint_write_leaves_the_previous_one_loadable(tmp_path, monkeypatch):
    cfg = tiny_cfg(f"out_dir={tmp_path}")
    torch.manual_seed(0)
    trainer = GRPOTrainer(cfg, Transformer(cfg.model), tensorboard=False)
    trainer.step = 1
    trainer.save()

    def dies_midway(*args, **kwargs):
        raise KeyboardInterrupt("killed while writing the trainer state")

    trainer.step = 2
    monkeypatch.setattr(torch, "save", dies_midway)
    with pytest.raises(KeyboardInterrupt, match="killed while writing"):
        trainer.save()
    root = Path(trainer.out_dir) / "checkpoints"
    assert latest_checkpoint(root).name == "step_000001"
    assert load_checkpoint(latest_checkpoint(root))["trainer_state"]["step"] == 1
    assert not list(root.glob(".tmp-*"))


def test_a_resumed_trainer_takes_the_drafts_proposal_scale_from_the_checkpoint(tmp_path):
    """The scale is draft.json's, not a weight: restoring must set it on both of the trainer's
    drafts (the trained one and the engine's copy)."""
    from cospec.rl.trainer_state import restore_trainer

    _, spec = trainers_plain_and_speculative(tmp_path, "draft.mode=cotrain")
    spec.draft.proposal_scale = spec.rollout_draft.proposal_scale = 1.6
    spec.step = 1
    spec.save()
    _, fresh = trainers_plain_and_speculative(tmp_path / "fresh", "draft.mode=cotrain")
    assert fresh.draft.proposal_scale == fresh.rollout_draft.proposal_scale == 1.0
    restore_trainer(fresh, load_checkpoint(latest_checkpoint(Path(spec.out_dir) / "checkpoints")))
    assert fresh.draft.proposal_scale == fresh.rollout_draft.proposal_scale == 1.6


def _train_cmd(out_dir, *extra):
    return [sys.executable, "-m", "cospec.cli", "train", "--recipe", "tiny", f"out_dir={out_dir}",
            "grpo.steps=6", "grpo.checkpoint_every=1", "sampling.batch_size=8", *extra]


@pytest.mark.slow
def test_sigkill_then_resume_ends_bit_identical_to_an_uninterrupted_run(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ref = tmp_path / "ref"
    subprocess.run(_train_cmd(ref), check=True, env=env, capture_output=True, timeout=600)
    run = tmp_path / "killed"
    proc = subprocess.Popen(_train_cmd(run), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    # The marker: the first complete checkpoint. A checkpoint directory appears only when it is
    # complete (written under a temporary name, then renamed into place), so the kill lands at once
    # after it, wherever the run then is (updating `latest`, or in step 2), with 5 of 6 steps (~1 s
    # on a busy 2-core machine) left against one 10 ms poll. The deadline only bounds a run that
    # never writes the marker.
    first = run / "rl" / "checkpoints" / "step_000001"
    deadline = time.monotonic() + 300
    while not first.is_dir() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert first.is_dir(), f"no checkpoint within 300 s (exit code {proc.poll()})"
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the run finished before it could be killed"
    subprocess.run(_train_cmd(run, "--resume"), check=True, env=env, capture_output=True, timeout=600)
    a = load_checkpoint(latest_checkpoint(ref / "rl" / "checkpoints"))
    b = load_checkpoint(latest_checkpoint(run / "rl" / "checkpoints"))
    assert a["trainer_state"]["step"] == b["trainer_state"]["step"] == 6
    for (name, x), (_, y) in zip(a["policy"].state_dict().items(), b["policy"].state_dict().items()):
        assert torch.equal(x, y), name
    from cospec.metrics.run_log import read_jsonl

    ra = [r for r in read_jsonl(ref / "rl" / "metrics.jsonl") if "reward" in r]  # not eval-only rows
    rb = [r for r in read_jsonl(run / "rl" / "metrics.jsonl") if "reward" in r]
    assert [r["step"] for r in rb] == list(range(1, 7))
    assert [(r["reward"], r["loss"], r["entropy"]) for r in ra] == \
           [(r["reward"], r["loss"], r["entropy"]) for r in rb]
