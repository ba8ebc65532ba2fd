"""Specification of `cospec plan` (cospec.parallel.plan): its formulas against what real runs hold.

Oracles, all counted on live objects, never derived from the planner's own formulas:
- activations: the bytes autograd saves for backward in a policy forward plus the GRPO loss, and
  in each kind of pipeline stage, in fp32 and under bf16 autocast, and in the EAGLE-3 and block
  drafts' training, counted with `torch.autograd.graph.saved_tensors_hooks` (one storage
  counted once, parameters excluded);
- a trainer step under dp = 2, pp = 2 (bf16 autocast), cp = 2 (EAGLE-3; a block draft under
  autocast) and dp = 2 x pp = 2, on every rank: the local bytes
  of its parameter, gradient, AdamW and reference shards, the live peak of its saved
  activations (`SavedActivations`) for its own ragged rollouts, and the bytes it received
  through FSDP2's all-gathers and reduce-scatters and the pipeline's transfers, counted by
  wrapping `torch.distributed`'s functions;
- a speculative engine: the bytes of its weights, KV caches and feature history.
"""

import pytest
import torch
import torch.distributed as dist

from cospec.cli import main
from cospec.config import ModelConfig, resolve
from cospec.models.llama import Transformer
from cospec.metrics.saved_activations import SavedActivations
from cospec.metrics.tensor_memory import TensorMemoryPeak
from cospec.parallel.launch import spawn
from cospec.parallel.pipeline import build_stage, split_layers
from cospec.parallel.draft_memory import block_activation_floats, ttt_activation_floats
from cospec.parallel.activation_memory import activation_bytes, activation_peak_bytes
from cospec.parallel.plan import plan
from cospec.rl.policy_step import PolicyMinibatch, minibatch_terms


def saved_bytes(cfg: ModelConfig, lengths: list[int], *, kl: bool, temperature: float,
                stage: int = 0, num_stages: int = 1, autocast: bool = False,
                prompts: list[int] | None = None) -> int:
    """Bytes saved for backward by a forward of packed sequences of ``lengths`` through pipeline
    stage ``stage`` of ``num_stages`` (the embedding's on the first, the GRPO loss on the last),
    under bf16 autocast with ``autocast`` (its weight copies are saved tensors too). With
    ``prompts`` (the first prompts[i] positions of sequence i are its prompt's), the head and
    the loss run at the response positions only, as the single-process step runs them."""
    torch.manual_seed(0)
    model = Transformer(cfg)
    first, last = stage == 0, stage == num_stages - 1
    part = model if num_stages == 1 else build_stage(
        model, split_layers(cfg.num_layers, num_stages)[stage], stage=stage, num_stages=num_stages)
    params = {p.untyped_storage().data_ptr() for p in part.parameters()}
    saved: dict[int, int] = {}
    alive = []  # no storage freed while counting, so no address is reused by another

    def pack(t):
        alive.append(t)
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved.setdefault(ptr, t.untyped_storage().nbytes())
        return t

    T = sum(lengths)
    tokens = torch.randint(4, cfg.vocab_size, (T,))
    targets = torch.randint(4, cfg.vocab_size, (T,))  # a storage of their own, as in training
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    mask = torch.ones(T)
    for start, n in zip(cu[:-1].tolist(), prompts or []):
        mask[start:start + n] = 0
    mb = PolicyMinibatch(tokens=tokens, targets=targets, cu_seqlens=cu, loss_mask=mask,
                         old_logprobs=torch.zeros(T), advantages=torch.ones(T), num_tokens=T)
    rows = mb.response_positions() if prompts else None
    at = dict(logits_positions_B=rows[None]) if prompts else {}
    with torch.no_grad():
        ref = model(tokens[None], cu_seqlens=cu, **at).logits[0] if kl else None
    hidden = torch.randn(1, T, cfg.hidden_size, requires_grad=True)  # from the stage before
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = part(tokens[None], cu_seqlens=cu, **at) if first else part(
            None, inputs_embeds=hidden, cu_seqlens=cu, **at)
        if last:
            minibatch_terms(out.logits[0], ref, mb, temperature=temperature, clip_low=0.2,
                            clip_high=0.2, kl_coef=0.05 if kl else 0.0, rows=rows)
    return sum(saved.values())


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("shape,lengths,kl,temperature,prompts", [
    (dict(hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=50),
     [64, 64, 64, 64], True, 1.0, None),
    (dict(hidden_size=128, num_heads=8, num_kv_heads=8, intermediate_size=352, vocab_size=300),
     [128, 128], False, 1.0, None),
    (dict(hidden_size=96, num_heads=6, num_kv_heads=2, intermediate_size=256, vocab_size=120,
          num_layers=3), [90, 40, 10, 60], True, 0.7, None),  # ragged: the padded layout
    (dict(hidden_size=96, num_heads=6, num_kv_heads=2, intermediate_size=256, vocab_size=120),
     [90, 40, 10, 60], True, 0.7, [30, 12, 4, 45]),  # the head at the responses only
])
def test_the_activation_formula_is_what_the_model_saves_for_backward(shape, lengths, kl,
                                                                     temperature, prompts,
                                                                     autocast):
    """In fp32, and under bf16 autocast (the matmuls' inputs and autocast's weight copies in
    bf16, the norms and the loss in fp32, and on a CPU the attention in fp32 too)."""
    cfg = ModelConfig(**{"num_layers": 2, "max_seq_len": 256, **shape})
    head = None if prompts is None else sum(lengths) - sum(prompts)
    formula = activation_bytes(cfg, lengths, layers=cfg.num_layers, first=True, last=True,
                               kl=kl, autocast=autocast, attention_fp32=autocast, head_tokens=head)
    measured = saved_bytes(cfg, lengths, kl=kl, temperature=temperature, autocast=autocast,
                           prompts=prompts)
    assert formula == measured


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_each_pipeline_stage_saves_what_the_formula_gives_it(stage, autocast):
    """The first stage keeps the token ids, the last the final norm's and the head's inputs and
    the loss, every stage its own RoPE tables and attention indices."""
    cfg = ModelConfig(num_layers=4, max_seq_len=128, hidden_size=64, num_heads=4, num_kv_heads=2,
                      intermediate_size=160, vocab_size=70)
    lengths = [50, 20, 35]
    layers = split_layers(cfg.num_layers, 3)[stage]
    formula = activation_bytes(cfg, lengths, layers=len(layers), first=stage == 0,
                               last=stage == 2, kl=True, autocast=autocast,
                               attention_fp32=autocast)
    measured = saved_bytes(cfg, lengths, kl=True, temperature=1.0, stage=stage, num_stages=3,
                           autocast=autocast)
    assert formula == measured


def ttt_saved_bytes(cfg, lengths: list[int], *, steps: int, group=None, head: int = 0) -> int:
    """Bytes saved for backward by the co-trained EAGLE-3 draft's TTT loss on a batch of
    ``lengths`` (under cp, ``group``'s ranks each on their zigzag shard); ``head``: a reduced
    head of that many ids, its targets kept as the trainer keeps them (`draft_targets`)."""
    from cospec.draft.losses import draft_targets
    from cospec.draft.offline import build_draft
    from cospec.draft.ttt import TTTBatch, ttt_loss
    from cospec.rl.cp_step import ContextParallelDraftLoss

    torch.manual_seed(0)
    draft = build_draft(cfg, Transformer(cfg.model), vocab_ids=torch.arange(head) if head else None)
    T, m = sum(lengths), cfg.model
    keep = draft_targets(draft.vocab_ids, 1.0)
    batch = TTTBatch(tokens=torch.randint(4, m.vocab_size, (T,)),
                     cu_seqlens=torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]),
                     loss_mask=torch.ones(T), policy_logits=keep(torch.randn(T, m.vocab_size)),
                     taps={k: torch.randn(T, m.hidden_size) for k in set(draft.tap_layers)})
    params = {p.untyped_storage().data_ptr() for p in draft.parameters()}
    saved: dict[int, int] = {}
    alive = []  # as in saved_bytes

    def pack(t):
        alive.append(t)
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and not isinstance(t._base, torch.nn.Parameter):
            saved.setdefault(ptr, t.untyped_storage().nbytes())
        return t

    loss = ttt_loss if group is None else ContextParallelDraftLoss(group)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss(draft, batch, num_steps=steps)
    return sum(saved.values())


DRAFT_SHAPE = ["rollout.speculative=true", "draft.mode=cotrain", "model.hidden_size=96",
               "model.num_heads=6", "model.vocab_size=70", "model.intermediate_size=200"]


@pytest.mark.parametrize("lengths,steps,head,layers", [
    ([30, 20, 10], 3, 0, 1), ([64], 1, 0, 1), ([5, 40, 40, 7], 4, 0, 1), ([30, 20, 10], 3, 24, 1),
    ([5, 40, 40, 7], 4, 0, 2), ([30, 20, 10], 3, 24, 3)])  # deeper drafts
def test_the_draft_ttt_formula_is_what_its_unroll_saves_for_backward(lengths, steps, head, layers):
    cfg = resolve("tiny", overrides=[*DRAFT_SHAPE, f"draft.eagle3_layers={layers}"])
    from cospec.draft.offline import build_draft

    draft = build_draft(cfg, Transformer(cfg.model))
    formula = ttt_activation_floats(draft.config, sum(lengths), len(lengths), max(lengths),
                                    steps=steps, taps=len(draft.tap_layers), head=head) * 4
    assert formula == pytest.approx(ttt_saved_bytes(cfg, lengths, steps=steps, head=head),
                                    rel=0.001)


def block_formula_bytes(cfg, draft, tokens, lengths, *, steps, head=0, ring=False) -> float:
    d = cfg.draft
    return block_activation_floats(draft.config, tokens, len(lengths), max(lengths), steps=steps,
                                   taps=len(draft.tap_layers), ring=ring, head=head,
                                   correction=d.block_correction,
                                   confidence=d.block_confidence) * 4


@pytest.mark.parametrize("lengths,steps,block,head", [
    ([30, 20, 10], 3, [], 0),  # the defaults: one layer, the confidence head
    ([64], 1, ["draft.block_confidence=false"], 0),
    ([5, 40, 40, 7], 4, ["draft.block_layers=2", "draft.block_correction=true"], 0),
    ([30, 20, 10], 5, ["draft.block_layers=3", "draft.block_correction=true",
                       "model.num_kv_heads=6"], 24),  # no GQA, a reduced head
])
def test_the_block_draft_formula_is_what_its_training_saves_for_backward(lengths, steps, block,
                                                                           head):
    """The block draft: one block per anchor, G positions through every layer at once, each
    position's attention over the context and the block's keys up to it, and its heads."""
    from cospec.draft.offline import build_draft

    cfg = resolve("tiny", overrides=[*DRAFT_SHAPE, "draft.kind=block", *block])
    draft = build_draft(cfg, Transformer(cfg.model))
    formula = block_formula_bytes(cfg, draft, sum(lengths), lengths, steps=steps, head=head)
    assert formula == pytest.approx(ttt_saved_bytes(cfg, lengths, steps=steps, head=head),
                                    rel=0.001)


def _ttt_saved_on_a_cp_rank(rank, world, lengths, steps, overrides):
    return ttt_saved_bytes(resolve("tiny", overrides=[*DRAFT_SHAPE, *overrides]), lengths,
                           steps=steps, group=dist.group.WORLD)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["eagle3", "block"])
def test_under_cp_each_rank_saves_the_ring_formula_for_its_shard(kind):
    from cospec.draft.offline import build_draft
    from cospec.parallel.zigzag import ZigzagLayout

    lengths, steps = [30, 20, 11], 3
    overrides = (["draft.eagle3_layers=2"] if kind == "eagle3" else
                 ["draft.kind=block", "draft.block_layers=2", "draft.block_correction=true"])
    cfg = resolve("tiny", overrides=[*DRAFT_SHAPE, *overrides])
    draft = build_draft(cfg, Transformer(cfg.model))
    layout = ZigzagLayout.build(torch.tensor([0, 30, 50, 61]), 2)
    if kind == "eagle3":
        formula = ttt_activation_floats(draft.config, layout.num_local, len(lengths),
                                        max(lengths), steps=steps, taps=len(draft.tap_layers),
                                        ring=True) * 4
    else:
        formula = block_formula_bytes(cfg, draft, layout.num_local, lengths, steps=steps,
                                      ring=True)
    # The losses run at the trained anchors only: the rank holding the sequences' end chunks
    # (their last tokens, which a step past the end cannot train, and the padding) saves less;
    # the formula is the other rank's, the peak.
    measured = spawn(_ttt_saved_on_a_cp_rank, 2, lengths, steps, overrides)
    assert formula == pytest.approx(max(measured), rel=0.001)
    assert min(measured) < max(measured)


def _local_bytes(tensors) -> int:
    local = [getattr(t, "_local_tensor", t) for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)


# pp2-bf16: the draft taps layer 0 too, which lives on the first stage (TapChannel carries it);
# fp32 pipelines are dp2xpp2's
LAYOUTS = {"dp2": ["parallel.dp=2"],
           "pp2-bf16": ["parallel.pp=2", "draft.tap_layers=[0,1,1]", "grpo.autocast=bfloat16"],
           "cp2": ["parallel.cp=2"],
           "cp2-block-bf16": ["parallel.cp=2", "draft.kind=block", "draft.block_layers=2",
                              "grpo.autocast=bfloat16"],
           "dp2xpp2": ["parallel.dp=2", "parallel.pp=2"]}
SHARED = ["grpo.micro_steps=2", "grpo.kl_coef=0.05", "rollout.speculative=true",
          "draft.mode=cotrain", "rollout.adaptive=false", "parallel.microbatches=2"]


def _layout_cfg(layout, out_dir="runs/unused"):
    return resolve("tiny", overrides=[f"out_dir={out_dir}", *LAYOUTS[layout], *SHARED])


def _counting_run(rank, world, out_dir, layout):
    """One trainer step of ``layout`` with every byte this rank receives counted by collective."""
    from torch.distributed.tensor import DTensor

    from cospec.draft.offline import build_draft
    from cospec.parallel.train_group import make_train_group
    from cospec.rl.trainer import GRPOTrainer

    cfg = _layout_cfg(layout, out_dir)
    torch.manual_seed(0)
    policy = Transformer(cfg.model)
    group = make_train_group(cfg.parallel, rank, world)
    trainer = GRPOTrainer(cfg, policy, draft=build_draft(cfg, policy), tensorboard=False,
                          group=group)
    del policy  # the trainer holds what it trains; a stage does not hold the whole model
    counted = {"all_gather": 0.0, "reduce_scatter": 0.0, "p2p": 0.0, "ring": 0.0, "capture": 0.0}
    real = (dist.all_gather_single, dist.reduce_scatter_single, DTensor.full_tensor,
            dist.batch_isend_irecv, dist.all_gather)
    n = cfg.parallel.dp * cfg.parallel.cp if cfg.parallel.dp > 1 else 1
    share = (n - 1) / n  # what a rank receives of a tensor gathered or scattered over n ranks

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

    # the ring's group: the replica's cp group, or the world under cp alone
    ring_group = group.cp_group or dist.distributed_c10d._get_default_group()

    def batch(ops):  # the pipeline's and the ring's (not a collective's own point-to-point steps)
        received = [op for op in ops if op.op.__name__ == "irecv"]
        size = sum(op.tensor.numel() * op.tensor.element_size() for op in received)
        if group.pipe_group is not None and all(op.group is group.pipe_group for op in received):
            counted["p2p"] += size
        elif group.cp > 1 and all(op.group is ring_group or op.group is None for op in received):
            counted["ring"] += size
        return real[3](ops)

    cp = group.cp

    def gather_list(tensor_list, tensor, group=None, async_op=False):  # the draft's capture
        # (not the ring's input checks: a few int64 each)
        if cp > 1 and (group is None or group is ring_group) and tensor.is_floating_point():
            size = sum(t.numel() * t.element_size() for t in tensor_list)
            counted["capture"] += size * (cp - 1) / cp  # the other ranks' shards
        return real[4](tensor_list, tensor, group=group, async_op=async_op)

    (dist.all_gather_single, dist.reduce_scatter_single, DTensor.full_tensor,
     dist.batch_isend_irecv, dist.all_gather) = gather, scatter, full, batch, gather_list
    try:
        with TensorMemoryPeak(device="cpu") as peak:  # the whole step, rollouts to weight sync
            batch_ = trainer_batch(trainer) if trainer.generates else None
            shared = trainer_inputs(trainer, batch_)
            with SavedActivations() as saved:
                trainer.train_policy(shared)
            trainer.train_draft()
            trainer.sync_weights()
    finally:
        (dist.all_gather_single, dist.reduce_scatter_single, DTensor.full_tensor,
         dist.batch_isend_irecv, dist.all_gather) = real
    opt_state = [t for st in trainer.optimizer.state.values() for t in st.values()
                 if isinstance(t, torch.Tensor) and t.dim() > 0]
    memory = {"parameters": _local_bytes(trainer.policy.parameters()),
              "gradients": _local_bytes(p.grad for p in trainer.policy.parameters()),
              "optimizer": _local_bytes(opt_state),
              "reference": _local_bytes(trainer.reference.parameters())}
    if trainer.owns_draft:  # after its co-training: parameters, gradients and AdamW's moments
        draft_state = [t for st in trainer.draft_optimizer.state.values() for t in st.values()
                       if isinstance(t, torch.Tensor) and t.dim() > 0]
        memory["draft"] = (_local_bytes(trainer.draft.parameters())
                           + _local_bytes(p.grad for p in trainer.draft.parameters()
                                          if p.grad is not None)
                           + _local_bytes(draft_state))
    mine = [len(c.prompt) + len(c.tokens) - 1 for c in shared.completions]  # trained positions
    lengths = [0] * (cfg.grpo.prompts_per_step * cfg.grpo.group_size)  # other replicas' unused
    lengths[shared.first:shared.first + len(mine)] = mine
    responses = [0] * len(lengths)  # the positions the head runs at where the step picks them
    responses[shared.first:shared.first + len(mine)] = [len(c.tokens) for c in shared.completions]
    activations = {"measured": saved.peak_bytes, "planned": activation_peak_bytes(
        cfg, lengths, stage=group.stage, replica=group.dp_rank, responses=responses)}
    # the plan of this replica's rollouts: their own lengths when it is the only replica, else
    # their mean; the peak's plan takes every replica's (the plan's figure is the largest's)
    kind = {"lengths": lengths} if group.dp == 1 else {"context": sum(mine) / len(mine)}
    every = [None] * world
    dist.all_gather_object(every, (shared.first, mine))
    for first, theirs in every:
        lengths[first:first + len(theirs)] = theirs
    taps = getattr(trainer.policy_step, "taps", None)
    counted["taps_sent"] = taps.bytes_sent if taps is not None else 0
    return {"stage": group.stage, "memory": memory, "comm": counted, "activations": activations,
            "plan_of": kind, "peak": peak.peak_bytes, "generates": trainer.generates,
            "lengths": lengths}


def trainer_inputs(trainer, batch):
    """The step's rollouts on every rank of the replica (as `GRPOTrainer.run_step` shares them)."""
    from cospec.parallel.tensor_transfer import broadcast_rollouts
    from cospec.rl.trainer import RolloutBatch

    g = trainer.group
    if g.replica_size == 1:
        return batch
    shared = broadcast_rollouts(
        (batch.completions, batch.advantages, batch.rewards, batch.first) if batch else None,
        src=g.replica_first_rank, group=g.replica_collectives)
    return batch or RolloutBatch(examples=[], completions=shared[0], rewards=shared[2],
                                 advantages=shared[1], generate_seconds=0.0, num_tokens=0,
                                 first=shared[3])


def trainer_batch(trainer):
    """The trainer's own rollouts, scored and given advantages (no reward needed: the bytes moved
    do not depend on the values)."""
    batch = trainer.generate()
    trainer.score(batch)
    batch.advantages = torch.randn(len(batch.completions))
    return batch


@pytest.mark.slow
# dp2 alone: a full-matrix case (dp2xpp2 shards the same way, per stage)
@pytest.mark.parametrize("layout,ranks", [pytest.param("dp2", 2, marks=pytest.mark.full_matrix),
                                           ("pp2-bf16", 2), ("cp2", 2), ("cp2-block-bf16", 2),
                                           ("dp2xpp2", 4)])
def test_every_ranks_state_and_traffic_are_what_the_plan_says(tmp_path, layout, ranks):
    results = spawn(_counting_run, ranks, str(tmp_path), layout)
    if layout == "pp2-bf16":  # what stage 0 sent on TapChannel is what the last stage received
        planned = plan(_layout_cfg(layout), **results[1]["plan_of"])[1]
        assert planned.comm["taps"] > 0
        assert results[0]["comm"]["taps_sent"] == pytest.approx(planned.comm["taps"], rel=0.02)
    for r in results:
        planned = plan(_layout_cfg(layout), **r["plan_of"])[r["stage"]]
        for part, value in r["memory"].items():
            assert value == pytest.approx(planned.memory[part], rel=0.02), (r["stage"], part)
        # the live peak of saved activations, for this replica's own ragged rollouts
        assert r["activations"]["measured"] == pytest.approx(r["activations"]["planned"],
                                                             rel=0.01), r["stage"]
        assert r["comm"]["all_gather"] == pytest.approx(planned.comm.get("fsdp_all_gather", 0),
                                                        rel=0.05)
        assert r["comm"]["reduce_scatter"] == pytest.approx(
            planned.comm.get("fsdp_reduce_scatter", 0), rel=0.05)
        assert r["comm"]["p2p"] == pytest.approx(planned.comm.get("pipeline", 0), rel=0.05)
        # the ring, the zigzag chunks' padding included
        ring = planned.comm.get("cp_ring", 0) + planned.comm.get("cp_ring_draft", 0)
        assert r["comm"]["ring"] == pytest.approx(ring, rel=0.01)
        assert r["comm"]["capture"] == pytest.approx(planned.comm.get("cp_draft_capture", 0),
                                                     rel=0.01)
        assert (r["comm"]["capture"] > 0) == layout.startswith("cp2")  # cp's capture, counted
    # The whole step's peak of tensor memory (the "within 15%"): per stage, the largest
    # of its ranks that generate (they hold the engine) and of those that do not.
    stages = plan(_layout_cfg(layout), lengths=results[0]["lengths"])
    for s, sp in enumerate(stages):
        engine = sum(v for k, v in sp.memory.items() if k.startswith("engine"))
        for generates in (True, False):
            measured = [r["peak"] for r in results if r["stage"] == s and r["generates"] == generates]
            if measured:
                planned = sp.total_memory - (0 if generates else engine)
                assert max(measured) == pytest.approx(planned, rel=0.15), (s, generates)


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
                "engine_kv_cache": _local_bytes(engine.cache.keys + engine.cache.values),
                "engine_draft_kv_cache": _local_bytes(engine.draft_cache.keys
                                                       + engine.draft_cache.values),
                "engine_feature_history": _local_bytes([engine.feat_BSF])}
    planned = plan(cfg)[0].memory
    for part, value in measured.items():
        assert planned[part] == value, part


def test_cospec_plan_prints_every_stage_and_refuses_a_bad_context(capsys):
    assert main(["plan", "--recipe", "tiny", "parallel.dp=2", "parallel.pp=2",
                 "--context", "64"]) == 0
    out = capsys.readouterr().out
    assert "dp=2 x pp=2 x cp=1 = 4 ranks" in out and "stage 1 (1 layers)" in out
    assert "fsdp_all_gather" in out and "pipeline" in out
    assert main(["plan", "--recipe", "tiny", "--context", "0"]) == 2
    assert "--context: must be >= 1" in capsys.readouterr().err


def test_a_reduced_draft_head_is_planned_with_its_targets_kept_at_its_width(capsys):
    """draft.vocab_size: the kept logits are Vd + 1 a token (`draft_targets`), not V; the
    unroll's head activations are Vd wide (their formula: the test above, head=24)."""
    cotrain = ["rollout.speculative=true", "draft.mode=cotrain", "parallel.pp=2",
               "draft.cotrain_max_tokens=0"]
    assert main(["plan", "--recipe", "tiny", *cotrain, "draft.vocab_size=12",
                 "--context", "64"]) == 0  # a meta policy, a head of real ids
    assert "draft_captured" in capsys.readouterr().out
    full = resolve("tiny", overrides=cotrain)
    reduced = resolve("tiny", overrides=[*cotrain, "draft.vocab_size=12"])
    last = {cfg.draft.vocab_size: plan(cfg, context=64)[-1].memory for cfg in (full, reduced)}
    from cospec.models.draft import default_tap_layers

    taps = set(full.draft.tap_layers or default_tap_layers(full.model.num_layers))
    row = len(taps) * full.model.hidden_size + 3  # the kept features, ids and loss mask
    assert last[12]["draft_captured"] / last[0]["draft_captured"] == pytest.approx(
        (row + 13) / (row + full.model.vocab_size), rel=1e-9)
    assert last[12]["draft_cotrain"] < last[0]["draft_cotrain"]


def test_under_draft_autocast_the_fp32_draft_counts_are_an_upper_bound_and_the_plan_says_so(capsys):
    """The draft's mixed precision is not modelled: what the EAGLE-3 and block losses save under
    bf16 autocast (its weight copies included) stays within their fp32 formulas, at 0.91-0.94x
    of them on these shapes (the bound below: 0.8x), and `cospec plan` says so."""
    for kind in (["draft.kind=eagle3"], ["draft.kind=block", "draft.block_layers=2"]):
        cfg = resolve("tiny", overrides=[*DRAFT_SHAPE, *kind])
        fp32 = ttt_saved_bytes(cfg, [30, 20, 10], steps=3)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mixed = ttt_saved_bytes(cfg, [30, 20, 10], steps=3)
        assert 0.8 * fp32 <= mixed < fp32, kind
    assert main(["plan", "--recipe", "tiny", "draft.autocast=bfloat16"]) == 0
    assert "draft.autocast) is not modelled" in capsys.readouterr().out
    assert main(["plan", "--recipe", "tiny", "grpo.autocast=bfloat16"]) == 0
    assert "not modelled" not in capsys.readouterr().out


def test_bf16_autocast_plans_less_memory_and_ring_traffic_than_fp32():
    """A 1B-shaped step at cp = 2: the activations shrink under autocast, the ring's K and V
    halve (dK, dV stay fp32), parameters and optimizer state do not change."""
    base = ["model.hidden_size=2048", "model.num_heads=32", "model.num_kv_heads=8",
            "model.intermediate_size=8192", "model.num_layers=16", "model.vocab_size=32000",
            "model.max_seq_len=4096", "parallel.cp=2"]
    fp32 = plan(resolve("tiny", overrides=base))[0]
    bf16 = plan(resolve("tiny", overrides=[*base, "grpo.autocast=bfloat16"]))[0]
    assert bf16.memory["optimizer"] == fp32.memory["optimizer"]
    assert 0.4 < bf16.memory["activations"] / fp32.memory["activations"] < 0.9
    assert bf16.comm["cp_ring"] < fp32.comm["cp_ring"]


def test_cospec_plan_reads_rollout_lengths_and_refuses_bad_ones(tmp_path, capsys):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("40, 90\n25 64\n")
    assert main(["plan", "--recipe", "tiny", "parallel.pp=2", "--lengths", str(lengths)]) == 0
    out = capsys.readouterr().out
    assert "rollouts of 25-90 (mean 55) tokens" in out
    cfg = resolve("tiny", overrides=["parallel.pp=2"])
    rollouts = cfg.grpo.prompts_per_step * cfg.grpo.group_size
    expected = plan(cfg, lengths=[[40, 90, 25, 64][k % 4] for k in range(rollouts)])
    assert f"{expected[1].memory['activations'] / 2 ** 30:10.3f}" in out
    for text, error in [("12 x", "found 'x'"), ("", "found none"), ("0", "found '0'"),
                        ("999", "longer than model.max_seq_len=128")]:
        lengths.write_text(text)
        assert main(["plan", "--recipe", "tiny", "--lengths", str(lengths)]) == 2
        assert error in capsys.readouterr().err
    assert main(["plan", "--recipe", "tiny", "--lengths", str(lengths), "--context", "9"]) == 2
    assert "give one of them" in capsys.readouterr().err


def test_ragged_rollouts_need_more_than_their_mean_length_and_less_than_their_longest():
    """The plan of the rollouts' own lengths sits between the plan at their mean and at their
    longest: padding to a row's longest sequence, and microbatches of unequal size."""
    cfg = resolve("tiny", overrides=["parallel.pp=2", "parallel.microbatches=2"])
    rollouts = cfg.grpo.prompts_per_step * cfg.grpo.group_size
    lengths = [20 + (37 * k) % 100 for k in range(rollouts)]
    mean = round(sum(lengths) / rollouts)
    for s in range(2):
        exact = plan(cfg, lengths=lengths)[s].memory["activations"]
        assert plan(cfg, context=mean)[s].memory["activations"] < exact
        assert exact < plan(cfg, context=max(lengths))[s].memory["activations"]
