"""Specification of `cospec plan` (cospec.parallel.plan): its formulas against what real runs hold.

Oracles, all counted on live objects, never derived from the planner's own formulas:
- activations: the bytes autograd saves for backward in a policy forward plus the GRPO loss,
  counted with `torch.autograd.graph.saved_tensors_hooks` (one storage counted once, parameters
  excluded);
- a dp = 2 trainer after one step: the local bytes of its parameter shards, gradient shards and
  AdamW state, and the bytes FSDP2's all-gathers and reduce-scatters received, counted by wrapping
  `torch.distributed`'s collectives;
- a speculative engine: the bytes of its weights, KV caches and feature history.
"""

import pytest
import torch
import torch.distributed as dist

from cospec.cli import main
from cospec.config import ModelConfig, resolve
from cospec.models.llama import Transformer
from cospec.parallel.launch import spawn
from cospec.parallel.plan import activation_floats_per_token, plan
from cospec.rl.policy_step import PolicyMinibatch, minibatch_terms


def saved_bytes(cfg: ModelConfig, lengths: list[int], *, kl: bool, temperature: float) -> int:
    """Bytes saved for backward by a forward of packed sequences of ``lengths`` and the GRPO loss."""
    torch.manual_seed(0)
    model = Transformer(cfg)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved.setdefault(ptr, t.untyped_storage().nbytes())
        return t

    T = sum(lengths)
    tokens = torch.randint(4, cfg.vocab_size, (T,))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    mb = PolicyMinibatch(tokens=tokens, targets=tokens, cu_seqlens=cu, loss_mask=torch.ones(T),
                         old_logprobs=torch.zeros(T), advantages=torch.ones(T), num_tokens=T)
    with torch.no_grad():
        ref = model(tokens[None], cu_seqlens=cu).logits[0] if kl else None
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(tokens[None], cu_seqlens=cu)
        minibatch_terms(out.logits[0], ref, mb, temperature=temperature, clip_low=0.2,
                        clip_high=0.2, kl_coef=0.05 if kl else 0.0)
    return sum(saved.values())


@pytest.mark.parametrize("shape,lengths,kl,temperature", [
    (dict(hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=50),
     [64, 64, 64, 64], True, 1.0),
    (dict(hidden_size=128, num_heads=8, num_kv_heads=8, intermediate_size=352, vocab_size=300),
     [128, 128], False, 1.0),
    (dict(hidden_size=96, num_heads=6, num_kv_heads=2, intermediate_size=256, vocab_size=120,
          num_layers=3), [90, 40, 10, 60], True, 0.7),  # ragged: the attention's padded layout
])
def test_the_activation_formula_is_what_the_model_saves_for_backward(shape, lengths, kl, temperature):
    cfg = ModelConfig(**{"num_layers": 2, "max_seq_len": 256, **shape})
    T = sum(lengths)
    ratio = len(lengths) * max(lengths) / T
    formula = activation_floats_per_token(cfg, layers=cfg.num_layers, first=True, last=True,
                                          kl=kl, padded_ratio=ratio) * 4 * T
    measured = saved_bytes(cfg, lengths, kl=kl, temperature=temperature)
    assert formula == pytest.approx(measured, rel=0.02), (formula, measured)


def _local_bytes(tensors) -> int:
    local = [getattr(t, "_local_tensor", t) for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)


def _dp_run(rank, world, out_dir):
    from cospec.models.draft import Eagle3Draft
    from cospec.parallel.train_group import make_train_group
    from cospec.rl.trainer import GRPOTrainer

    cfg = resolve("tiny", overrides=[f"out_dir={out_dir}", "parallel.dp=2", "grpo.micro_steps=2",
                                     "grpo.kl_coef=0.05", "rollout.speculative=true",
                                     "draft.mode=cotrain", "rollout.adaptive=false"])
    torch.manual_seed(0)
    policy = Transformer(cfg.model)
    trainer = GRPOTrainer(cfg, policy, draft=Eagle3Draft.from_policy(policy), tensorboard=False,
                          group=make_train_group(cfg.parallel, rank, world))
    from torch.distributed.tensor import DTensor

    counted = {"all_gather": 0, "reduce_scatter": 0}
    real = dist.all_gather_single, dist.reduce_scatter_single, DTensor.full_tensor
    share = (world - 1) / world  # what a rank receives of a tensor gathered or scattered

    def gather(output_tensor, input_tensor, *args, **kwargs):  # FSDP2's unshard
        counted["all_gather"] += output_tensor.numel() * output_tensor.element_size() * share
        return real[0](output_tensor, input_tensor, *args, **kwargs)

    def scatter(output, input, *args, **kwargs):  # FSDP2's gradient reduction
        counted["reduce_scatter"] += input.numel() * input.element_size() * share
        return real[1](output, input, *args, **kwargs)

    def full(self, *args, **kwargs):  # the weight sync's gathers
        out = real[2](self, *args, **kwargs)
        counted["all_gather"] += out.numel() * out.element_size() * share
        return out

    dist.all_gather_single, dist.reduce_scatter_single, DTensor.full_tensor = gather, scatter, full
    try:
        trainer.train_policy(trainer_batch(trainer))
        trainer.sync_weights()
    finally:
        dist.all_gather_single, dist.reduce_scatter_single, DTensor.full_tensor = real
    opt_state = [t for st in trainer.optimizer.state.values() for t in st.values()
                 if isinstance(t, torch.Tensor) and t.dim() > 0]
    return {"parameters": _local_bytes(trainer.policy.parameters()),
            "gradients": _local_bytes(p.grad for p in trainer.policy.parameters()),
            "optimizer": _local_bytes(opt_state),
            "reference": _local_bytes(trainer.reference.parameters()), **counted}


def trainer_batch(trainer):
    """The trainer's own rollouts, scored and given advantages (no reward needed: the bytes moved
    do not depend on the values)."""
    batch = trainer.generate()
    trainer.score(batch)
    batch.advantages = torch.randn(len(batch.completions))
    return batch


@pytest.mark.slow
def test_a_dp2_runs_shards_and_fsdp_traffic_are_what_the_plan_says(tmp_path):
    cfg = resolve("tiny", overrides=["parallel.dp=2", "grpo.micro_steps=2", "grpo.kl_coef=0.05",
                                     "rollout.speculative=true", "draft.mode=cotrain"])
    (stage,) = plan(cfg)
    for r in spawn(_dp_run, 2, str(tmp_path)):
        for part in ("parameters", "gradients", "optimizer", "reference"):
            assert r[part] == pytest.approx(stage.memory[part], rel=0.02), part
        assert r["all_gather"] == pytest.approx(stage.comm["fsdp_all_gather"], rel=0.05)
        assert r["reduce_scatter"] == pytest.approx(stage.comm["fsdp_reduce_scatter"], rel=0.05)


def test_the_engine_memory_is_what_a_speculative_engine_allocates():
    from cospec.draft.offline import build_draft
    from cospec.rollout.speculative import SpeculativeEngine

    cfg = resolve("tiny", overrides=["rollout.speculative=true", "draft.mode=cotrain"])
    torch.manual_seed(0)
    policy = Transformer(cfg.model).eval()
    draft = build_draft(cfg, policy).eval()
    engine = SpeculativeEngine(policy, draft, batch_size=cfg.sampling.batch_size,
                               gamma=cfg.rollout.gamma)
    measured = {"engine_policy": _local_bytes(policy.parameters()),
                "engine_draft": _local_bytes(draft.parameters()),
                "engine_kv_cache": _local_bytes([engine.cache.k_LBHSD, engine.cache.v_LBHSD]),
                "engine_draft_kv_cache": _local_bytes([engine.draft_cache.k_LBHSD,
                                                       engine.draft_cache.v_LBHSD]),
                "engine_feature_history": _local_bytes([engine.feat_BSF])}
    planned = plan(cfg)[0].memory
    for part, value in measured.items():
        assert planned[part] == value, part


def test_cospec_plan_prints_every_stage_and_refuses_a_bad_context(capsys):
    assert main(["plan", "--recipe", "tiny", "parallel.dp=2", "parallel.pp=2",
                 "--context", "64"]) == 0
    out = capsys.readouterr().out
    assert "dp=2 x pp=2 x cp=1 = 4 ranks" in out and "stage 1 (1 layers)" in out
    assert "fsdp_all_gather" in out and "pipeline_activations" in out
    assert main(["plan", "--recipe", "tiny", "--context", "0"]) == 2
    assert "--context: must be >= 1" in capsys.readouterr().err
