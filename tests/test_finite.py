"""Specification of "finite or loud": a NaN in a model's weights, a sampling distribution, a loss or a
gradient stops the run with `NonFiniteError` naming the model and where, never a silent corruption.

The silent failure these guard against, reproduced first: with a NaN draft, verification rejects
every draft (whatever p says) and the residual draw's inverse CDF is NaN, so the token it returns is
an artefact of the search, not a draw from p; nothing raises.
"""

import math

import pytest
import torch

from cospec.config import ModelConfig, SamplingConfig
from cospec.data.tokenizer import BOS
from cospec.models.draft import Eagle3Draft
from cospec.models.hf_checkpoint import load_hf, save_hf
from cospec.models.integrity import NonFiniteError
from cospec.models.llama import Transformer
from cospec.rollout.engine import GenerationEngine
from cospec.rollout.speculative import SpeculativeEngine
from cospec.rollout.verify import DRAFT_NONFINITE, POLICY_NONFINITE, verify_drafts

CFG = ModelConfig(vocab_size=40, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
                  intermediate_size=64, max_seq_len=48)
SAMPLED = SamplingConfig(temperature=1.0, max_new_tokens=6)


def policy(seed=0):
    torch.manual_seed(seed)
    m = Transformer(CFG)
    m.reset_parameters(std=0.3)
    return m.eval()


def poison(module: torch.nn.Module, name_part: str) -> None:
    """One NaN in the first parameter whose name contains `name_part`."""
    with torch.no_grad():
        name, p = next((n, p) for n, p in module.named_parameters() if name_part in n)
        p.view(-1)[0] = float("nan")


def distributions(N=3, G=2, V=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    p = torch.rand(N, G + 1, V, generator=gen)
    p[..., 0] = 0.0  # the policy never emits token 0
    q = torch.rand(N, G, V, generator=gen)
    q[..., 0] = 0.0
    return p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True), torch.randint(1, V, (N, G))


def test_unchecked_a_nan_draft_is_rejected_everywhere_without_an_error():
    """Why the check exists: the policy's copy of a draft (q = p) would accept everything; a NaN
    one is rejected at every row's first position, silently, and only the flag tells."""
    p, _, drafts = distributions()
    q = p[:, :-1].clone()
    q[1] = float("nan")
    verdict = verify_drafts(p, q, drafts, torch.Generator().manual_seed(0), check=False)
    assert verdict.num_accepted.tolist() == [2, 0, 2]
    assert int(verdict.nonfinite) == DRAFT_NONFINITE


@pytest.mark.parametrize("whose", ["draft", "policy"])
def test_verify_refuses_non_finite_probabilities_naming_whose_they_are(whose):
    p, q, drafts = distributions()
    (q if whose == "draft" else p)[2, 1] = float("nan")
    with pytest.raises(NonFiniteError, match=rf"the {whose} \([pq]\) gave non-finite"):
        verify_drafts(p, q, drafts, torch.Generator().manual_seed(0))
    flag = verify_drafts(p, q, drafts, torch.Generator().manual_seed(0), check=False).nonfinite
    assert int(flag) == (DRAFT_NONFINITE if whose == "draft" else POLICY_NONFINITE)


def test_finite_distributions_pass_with_a_zero_flag():
    p, q, drafts = distributions()
    assert int(verify_drafts(p, q, drafts, torch.Generator().manual_seed(0)).nonfinite) == 0


def test_a_nan_draft_stops_speculative_generation_at_its_first_step():
    pol = policy()
    torch.manual_seed(1)
    draft = Eagle3Draft.from_policy(pol).eval()
    poison(draft, "lm_head")
    engine = SpeculativeEngine(pol, draft, batch_size=2, gamma=3)
    with pytest.raises(NonFiniteError, match=r"policy forward 2 .*draft: Eagle3.*the draft \(q\)"):
        engine.generate([[BOS, 5, 6], [BOS, 7]], SAMPLED, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("speculative", [False, True])
def test_a_nan_policy_stops_generation_naming_the_policy(speculative):
    pol = policy()
    draft = Eagle3Draft.from_policy(pol).eval()
    poison(pol, "layers.1.mlp")
    engine = (SpeculativeEngine(pol, draft, batch_size=2, gamma=2) if speculative
              else GenerationEngine(pol, batch_size=2))
    with pytest.raises(NonFiniteError, match=r"policy forward 1 .*the policy"):
        engine.generate([[BOS, 5, 6], [BOS, 7]], SAMPLED, generator=torch.Generator().manual_seed(0))


def test_loading_a_checkpoint_with_a_nan_weight_names_the_file_and_the_tensor(tmp_path):
    pol = policy()
    poison(pol, "layers.2.self_attn.q_proj")
    save_hf(pol, tmp_path / "ckpt")
    with pytest.raises(NonFiniteError, match=r"ckpt: non-finite .* in model\.layers\.2\.self_attn\.q_proj"):
        load_hf(tmp_path / "ckpt")


def test_generation_with_finite_models_reports_finite_logprobs():
    pol = policy()
    draft = Eagle3Draft.from_policy(pol).eval()
    out = SpeculativeEngine(pol, draft, batch_size=2, gamma=2).generate(
        [[BOS, 5, 6], [BOS, 7]], SAMPLED, generator=torch.Generator().manual_seed(0))
    assert all(math.isfinite(lp) for c in out.completions for lp in c.logprobs)


# ----------------------------------------------------------------------------- GRPO and co-training

def grpo_cfg(tmp_path, *overrides):
    from cospec.config import resolve

    return resolve("tiny", overrides=[f"out_dir={tmp_path}", "grpo.prompts_per_step=2",
                                      "grpo.group_size=2", "grpo.steps=3", "grpo.checkpoint_every=1",
                                      "grpo.eval_every=0", "grpo.micro_steps=1", *overrides])


def grpo_trainer(cfg, *, draft: bool = False):
    from cospec.rl.trainer import GRPOTrainer

    torch.manual_seed(0)
    pol = Transformer(cfg.model)
    d = Eagle3Draft.from_policy(pol) if draft else None
    return GRPOTrainer(cfg, pol, draft=d, tensorboard=False)


def test_a_nan_advantage_stops_grpo_before_the_update_and_resume_repeats_the_run_exactly(tmp_path):
    """A NaN reaches the loss at step 2 (here through an advantage, as a broken verifier would
    give): the update is refused, the state before the step is checkpointed, and --resume from
    it ends where an uninterrupted run does, bit for bit."""
    cfg = grpo_cfg(tmp_path / "broken")
    broken = grpo_trainer(cfg)
    advantages = broken.compute_advantages

    def nan_at_step_2(batch):
        advantages(batch)
        if broken.step == 1:
            batch.advantages[0] = float("nan")

    broken.compute_advantages = nan_at_step_2
    with pytest.raises(NonFiniteError, match=r"GRPO step 2, minibatch 1 of 1: policy update: the "
                                             r"gradient norm is nan.*before the failed step \(step 1\)"
                                             r" is checkpointed"):
        broken.run(progress=False)
    assert broken.step == 1

    resumed = grpo_trainer(cfg)
    resumed.run(resume=True, progress=False)
    straight = grpo_trainer(grpo_cfg(tmp_path / "straight"))
    straight.run(progress=False)
    for (name, a), b in zip(resumed.policy.named_parameters(), straight.policy.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("copy", ["trainer", "engine"])
def test_a_nan_injected_into_the_draft_mid_run_is_caught_within_one_step(tmp_path, copy):
    """The co-trained draft (the trainer's copy, which co-training would sync) or the engine's
    copy gets a NaN after step 1; step 2 stops with an error naming the draft."""
    cfg = grpo_cfg(tmp_path, "rollout.speculative=true", "rollout.adaptive=false",
                   "draft.mode=cotrain")
    trainer = grpo_trainer(cfg, draft=True)

    def inject(step, metrics):
        if step == 1:
            poison(trainer.draft if copy == "trainer" else trainer.rollout_draft, "fc")

    expected = ("GRPO step 2: the co-trained draft has non-finite weights" if copy == "trainer"
                else r"the draft \(q\) gave non-finite")
    with pytest.raises(NonFiniteError, match=expected):
        trainer.run(progress=False, on_step=inject)
    assert trainer.step == 1


def test_co_training_skips_and_counts_a_non_finite_draft_update(tmp_path):
    cfg = grpo_cfg(tmp_path, "rollout.speculative=true", "rollout.adaptive=false",
                   "draft.mode=cotrain", "draft.cotrain_iters=2")
    trainer = grpo_trainer(cfg, draft=True)
    batch = trainer.generate()
    trainer.score(batch)
    trainer.compute_advantages(batch)
    trainer.train_policy(batch)
    assert trainer._draft_data, "the policy step captured the draft's training data"
    for b in trainer._draft_data:
        next(iter(b.taps.values()))[0, 0] = float("nan")
    before = {k: v.clone() for k, v in trainer.draft.state_dict().items()}
    metrics = trainer.train_draft()
    assert metrics["draft_nonfinite_skipped"] == 2 * 1  # cotrain_iters x captured batches
    for k, v in trainer.draft.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_weights_gone_non_finite_after_an_applied_update_are_never_checkpointed(tmp_path):
    """An update whose gradient is finite can still make the weights inf (a huge step): the save
    refuses them, so --resume never meets a checkpoint it must reject."""
    from cospec.rl.checkpoint import latest_checkpoint

    trainer = grpo_trainer(grpo_cfg(tmp_path))
    step = trainer.optimizer.step

    def overflowing_step(*args, **kwargs):  # the update leaves a NaN in a weight
        step(*args, **kwargs)
        poison(trainer.policy, "layers.0.mlp")

    trainer.optimizer.step = overflowing_step
    with pytest.raises(NonFiniteError, match=r"GRPO step 1: non-finite weights in the policy"):
        trainer.run(progress=False)
    assert latest_checkpoint(tmp_path / "rl" / "checkpoints") is None


def test_the_cli_exits_3_when_a_run_diverges_and_says_where_it_left_the_state(tmp_path, capsys,
                                                                               monkeypatch):
    from cospec.cli import main
    from cospec.rl.trainer import GRPOTrainer

    advantages = GRPOTrainer.compute_advantages

    def nan_advantages(self, batch):
        advantages(self, batch)
        batch.advantages[0] = float("nan")

    monkeypatch.setattr(GRPOTrainer, "compute_advantages", nan_advantages)
    assert main(["train", "--recipe", "tiny", f"out_dir={tmp_path}", "sft.steps=2", "grpo.steps=2",
                 "grpo.eval_every=0", "sampling.max_new_tokens=4"]) == 3
    err = capsys.readouterr().err
    assert "cospec: stopped: GRPO step 1, minibatch 1 of 1: policy update: the gradient norm is nan" in err
    assert "state before the failed step (step 0) is checkpointed" in err
