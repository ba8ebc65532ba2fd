"""`cospec plan`: the memory each rank needs and the bytes its collectives move per GRPO step, from
formulas, before a run is launched (or rented).

# L layers, C hidden size, I MLP width, H / Hkv query / key-value heads, D head dim, V vocab,
# T tokens a rank trains on at once, B engine batch, S engine capacity (tokens per row)

Parameter counts are exact: the policy, its pipeline stage and the draft are built on the meta
device (no memory, any size) and counted. Then, per rank, in bytes:
- trained stage: parameters, gradients and AdamW's two moments, in fp32, divided by the FSDP2 group
  (dp x cp ranks) under dp; the KL reference the same as the parameters; FSDP2 also holds one
  unsharded unit and the next (prefetched) during a forward or backward, and under dp x pp the
  whole stage and its accumulated gradients for the step (`GatherOncePerStep`);
- draft (its trainers): parameters, gradients and AdamW in fp32, sharded like the stage under dp
  when co-trained (a frozen draft: its parameters, whole);
- engine (a replica's generating rank): the policy and the draft in ``rollout.dtype``, the KV cache
  2 L B S Hkv D, the draft's cache, and the speculative engine's feature history B S F (F the
  draft's feature width);
- activations saved for backward (`cospec.parallel.activation_memory`: what the policy step
  saves, in fp32 or under bf16 autocast, per microbatch, and the peak the schedule holds);
- the draft's co-training (`cospec.parallel.draft_memory`): its kept share of the captured
  features and logits, and its update; the peak (`StagePlan.total_memory`) counts the policy
  step's phase or the draft's, the larger.
Collective bytes per step (what one rank receives; the ring and tree algorithms move about as much
as they receive):
- FSDP2: every forward and backward of a minibatch all-gathers the stage ((n - 1) / n of its
  fp32 bytes, n the FSDP2 group), every backward reduce-scatters its gradients (the same), the
  reference's forward all-gathers again, and the weight sync all-gathers once; under dp x pp a
  minibatch's M microbatches share one all-gather of the stage, one of the reference, and one
  reduce-scatter;
- pipeline: into a stage, the activations T C of the policy's and of the reference's forward;
  out of it, their gradients; and TapChannel's taps T C per tapped layer into the last stage;
- cp ring: per layer and minibatch, a rank's K and V shards cp - 1 hops forward (the policy's, and
  the reference's with a KL) and backward, dK and dV cp hops; the draft's trunk K and V the same
  per TTT step of each co-training update (the block draft: per block position and layer), and
  its captured taps and logits once a minibatch (what the other ranks hold of the drawn
  sequences); the shards hold the zigzag padding (each sequence padded to a multiple of 2 cp;
  for the draft's sampled sequences, at the step's mean rate).
Under bf16 autocast (grpo.autocast) the ring's K and V travel in bf16 (dK, dV fp32), and a
full-vocabulary draft keeps the policy's logits in bf16.
Not modelled: the transient workspace of a kernel (softmax temporaries, matmul buffers),
allocator fragmentation, and the draft's mixed precision (draft.autocast: counted in fp32, an
upper bound).
`docs/results/parallel/memory_peaks.py` measures a step's peak of tensor memory (temporaries
included) against the total: within 5% on every layout here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from cospec.config import RunConfig
from cospec.draft.cotrain import cotrain_config
from cospec.models.precision import runs_on_cpu
from cospec.parallel.activation_memory import activation_peak_bytes, replica_minibatches
from cospec.parallel.draft_memory import draft_memory_bytes, kept_logit_bytes, kept_vocab
from cospec.parallel.pipeline import split_layers

FP32 = 4
#: the parts of a step that are live only in one phase of it: the policy step (its saved
#: activations), then the draft's update
PHASES = (("activations",), ("draft_cotrain",))
DTYPE_BYTES = {"": FP32, "float32": 4, "bfloat16": 2, "float16": 2}


def _meta_models(cfg: RunConfig):
    """The policy, each pipeline stage and the draft on the meta device (counts only)."""
    from cospec.draft.offline import build_draft
    from cospec.models.llama import Transformer
    from cospec.parallel.pipeline import build_stage

    with torch.device("meta"):
        policy = Transformer(cfg.model)
        layers = split_layers(cfg.model.num_layers, cfg.parallel.pp)
        stages = ([policy] if cfg.parallel.pp == 1 else
                  [build_stage(policy, r, stage=s, num_stages=cfg.parallel.pp)
                   for s, r in enumerate(layers)])
        draft = None
        if cfg.rollout.speculative:
            # the head's ids on the host: the draft checks them (a meta tensor has no values)
            ids = torch.arange(cfg.draft.vocab_size, device="cpu") if cfg.draft.vocab_size else None
            draft = build_draft(cfg, policy, vocab_ids=ids)
    return policy, stages, layers, draft


def _count(module) -> int:
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())


@dataclass
class StagePlan:
    """One pipeline stage's ranks: bytes of memory by part (``memory``) and received by collective
    per step (``comm``), for its first rank (a replica's generating rank holds the engine)."""

    stage: int
    layers: int
    memory: dict[str, float] = field(default_factory=dict)
    comm: dict[str, float] = field(default_factory=dict)

    @property
    def total_memory(self) -> float:
        """The peak: every part, but of the phases' parts only the largest phase's (`PHASES`)."""
        phases = [sum(self.memory.get(k, 0.0) for k in ks) for ks in PHASES]
        return sum(self.memory.values()) - sum(phases) + max(phases)


@dataclass
class _Run:
    """What every stage's figures read: the config, the meta models and the derived sizes."""

    cfg: RunConfig
    lengths: list[int]  # trained tokens of each rollout of the step
    context: float  # their mean
    policy: object
    stages: list
    layers: list[range]
    draft: object

    @property
    def shard(self) -> int:  # the FSDP2 group: dp x cp ranks under dp, else nothing is sharded
        p = self.cfg.parallel
        return p.dp * p.cp if p.dp > 1 else 1

    @property
    def kl(self) -> bool:
        return bool(self.cfg.grpo.kl_coef or self.cfg.grpo.log_kl)

    @property
    def minibatch_tokens(self) -> float:
        g = self.cfg.grpo
        return g.prompts_per_step * g.group_size // g.micro_steps * self.context

    @property
    def zigzag_padding(self) -> float:
        """Tokens a cp group runs over tokens it trains: each sequence padded to a multiple of
        2 cp (`cospec.parallel.zigzag`)."""
        step = 2 * self.cfg.parallel.cp
        return sum(-(-n // step) * step for n in self.lengths) / sum(self.lengths)

    @property
    def cotrained_draft(self) -> bool:
        return self.draft is not None and self.cfg.draft.mode == "cotrain"


def plan(cfg: RunConfig, *, context: float | None = None,
         lengths: Sequence[int] | None = None) -> list[StagePlan]:
    """Per stage: memory and collective bytes per step of ``cfg``'s run, its rollouts all of
    ``context`` tokens (prompt and response; default model.max_seq_len) or of the given
    ``lengths`` (one per rollout of the step, trained tokens, in rollout order). The activations
    are the largest replica's; the traffic is for the mean length."""
    rollouts = cfg.grpo.prompts_per_step * cfg.grpo.group_size
    if context is not None and lengths is not None:
        raise ValueError("plan: give context or lengths, not both")
    if lengths is None:
        context = context or cfg.model.max_seq_len
        lengths = [max(1, round(context))] * rollouts
    if len(lengths) != rollouts or min(lengths) < 1:
        raise ValueError(f"plan: {len(lengths)} lengths (min {min(lengths, default=0)}) for "
                         f"{rollouts} rollouts a step: give one positive length per rollout")
    run = _Run(cfg, list(lengths), context or sum(lengths) / rollouts, *_meta_models(cfg))
    out = []
    for s in range(cfg.parallel.pp):
        sp = StagePlan(stage=s, layers=len(run.layers[s]))
        sp.memory.update(_stage_memory(run, s))
        sp.comm.update(_stage_comm(run, s))
        out.append(sp)
    return out


def _stage_memory(run: _Run, s: int) -> dict:
    p, stage = run.cfg.parallel, run.stages[s]
    n, shard, first, last = _count(stage), run.shard, s == 0, s == p.pp - 1
    mem = {"parameters": n / shard * FP32, "gradients": n / shard * FP32,
           "optimizer": 2 * n / shard * FP32}
    if run.kl:
        mem["reference"] = n / shard * FP32
    if p.dp > 1 and p.pp > 1:  # the stage whole for the step, its gradients accumulated
        mem["fsdp_unsharded"] = 2 * n * FP32
    elif p.dp > 1:  # one unit unsharded and the next prefetched
        unit = max([_count(layer) for layer in stage.layers.values()] or [0])
        mem["fsdp_unsharded"] = 2 * unit * FP32
    if run.draft is not None and last:  # co-trained: sharded like the stage under dp
        mem["draft"] = _count(run.draft) * FP32 * (4 / shard if run.cotrained_draft else 1)
        if run.cotrained_draft:
            mem.update(_draft_cotrain_memory(run))
    mem["activations"] = max(activation_peak_bytes(run.cfg, run.lengths, stage=s, replica=r)
                             for r in range(p.dp))  # the largest replica's
    if first:
        mem.update(_engine_memory(run.cfg, _count(run.policy), run.draft,
                                  DTYPE_BYTES[run.cfg.rollout.dtype]))
    return mem


def _draft_cotrain_memory(run: _Run) -> dict:
    """The draft's captured data and its co-training update (`cospec.parallel.draft_memory`), the
    largest replica's; under dp each replica samples its share of draft.cotrain_max_tokens."""
    d, m, p = run.cfg.draft, run.cfg.model, run.cfg.parallel
    taps = len(set(run.draft.tap_layers))
    rank = cotrain_config(d, p)  # a rank's share of the budget and its bucket, as it trains
    bucket = rank.token_bucket if runs_on_cpu(run.cfg) else 0  # `cpu_bucket`: only on a CPU
    parts = [draft_memory_bytes(m, run.draft.config, replica_minibatches(run.cfg, run.lengths, r),
                                steps=d.ttt_steps, taps=taps, features=len(run.draft.tap_layers),
                                max_tokens=rank.cotrain_max_tokens, cp=p.cp, head=d.vocab_size, kind=d.kind,
                                correction=d.block_correction, confidence=d.block_confidence,
                                logit_bytes=kept_logit_bytes(d.vocab_size, run.cfg.grpo.autocast),
                                bucket=bucket)
             for r in range(p.dp)]
    return {k: max(part[k] for part in parts) for k in parts[0]}


def _stage_comm(run: _Run, s: int) -> dict:
    """Bytes this stage's rank receives per step, by collective."""
    p, g, m = run.cfg.parallel, run.cfg.grpo, run.cfg.model
    n, shard, first, last = _count(run.stages[s]), run.shard, s == 0, s == p.pp - 1
    comm = {}
    if shard > 1:
        gathered = n * (shard - 1) / shard * FP32
        if p.pp > 1:  # once a minibatch for the policy and for its reference pass
            passes = g.micro_steps * 2
        else:
            passes = g.micro_steps * (2 + (1 if run.kl else 0))
        comm["fsdp_all_gather"] = gathered * (passes + 1)  # + the weight sync
        comm["fsdp_reduce_scatter"] = gathered * g.micro_steps
        if last and run.cotrained_draft:
            # the sharded draft: gathered for each update's forward and backward, and for the
            # sync, its gradients reduce-scattered after each update (one per minibatch)
            updates = run.cfg.draft.cotrain_iters * g.micro_steps
            draft_gathered = _count(run.draft) * (shard - 1) / shard * FP32
            comm["fsdp_all_gather"] += draft_gathered * (2 * updates + 1)
            comm["fsdp_reduce_scatter"] += draft_gathered * updates
    step_tokens = run.minibatch_tokens * g.micro_steps / p.dp / p.cp
    if p.pp > 1:  # per token: the policy's and the reference's activations in, gradients back
        comm["pipeline"] = (2 * (not first) + (not last)) * step_tokens * m.hidden_size * FP32
        if last and run.cotrained_draft:
            remote = [t for t in run.draft.tap_layers if t not in run.layers[s]]
            comm["taps"] = len(remote) * step_tokens * m.hidden_size * FP32
    if p.cp > 1:  # K and V of a rank's shard, per layer: cp - 1 hops forward (the policy's, and
        # the reference's with a KL), cp - 1 backward, in bf16 under autocast (they travel in
        # the projections' dtype), and cp for dK and dV, accumulated in fp32
        kv = (2 * run.minibatch_tokens * run.zigzag_padding / p.dp / p.cp * m.num_kv_heads
              * m.head_dim)
        hops = 2 * (p.cp - 1) + ((p.cp - 1) if run.kl else 0)
        kv_bytes = 2 if run.cfg.grpo.autocast else FP32
        comm["cp_ring"] = len(run.layers[s]) * g.micro_steps * (hops * kv_bytes + p.cp * FP32) * kv
        if last and run.cotrained_draft:  # the draft's trunk K/V, once per TTT step (the
            # block draft: per block position and layer)
            d = run.cfg.draft
            tokens = run.minibatch_tokens / p.dp
            if d.cotrain_max_tokens:  # each replica samples its share of the budget
                tokens = min(tokens, d.cotrain_max_tokens / p.dp / g.micro_steps)
            dcfg = run.draft.config
            kv_d = (2 * tokens * run.zigzag_padding / p.cp * dcfg.num_kv_heads * dcfg.head_dim
                    * FP32)
            comm["cp_ring_draft"] = (d.cotrain_iters * g.micro_steps * d.ttt_steps
                                     * len(run.draft.layers) * (2 * (p.cp - 1) + p.cp) * kv_d)
            # the capture: the drawn sequences' taps and kept logits, the other ranks' shards
            # gathered once a minibatch (`cospec.rl.cp_step.gathered_capture`)
            width = (len(set(run.draft.tap_layers)) * m.hidden_size * FP32 + kept_vocab(
                m, d.vocab_size) * kept_logit_bytes(d.vocab_size, run.cfg.grpo.autocast))
            comm["cp_draft_capture"] = (g.micro_steps * tokens * run.zigzag_padding
                                        * (p.cp - 1) / p.cp * width)
    return comm


def _engine_memory(cfg: RunConfig, policy_params: int, draft, rollout_bytes: int) -> dict:
    """The engine's weights and buffers (`GenerationEngine`, `SpeculativeEngine`): the KV cache holds
    capacity + gamma slots a row, the draft's cache twice that, the feature history capacity +
    gamma + 1 entries of the draft's tap width."""
    m, B = cfg.model, cfg.sampling.batch_size
    gamma = cfg.rollout.gamma if cfg.rollout.speculative else 0
    kv_slot = 2 * m.num_kv_heads * m.head_dim * rollout_bytes  # K and V of one token, one layer
    mem = {"engine_policy": policy_params * rollout_bytes,
           "engine_kv_cache": m.num_layers * B * (m.max_seq_len + gamma) * kv_slot}
    if draft is not None:
        dcfg = draft.config
        mem["engine_draft"] = _count(draft) * rollout_bytes
        mem["engine_draft_kv_cache"] = (len(draft.layers) * B * 2 * (m.max_seq_len + gamma) * 2
                                        * dcfg.num_kv_heads * dcfg.head_dim * rollout_bytes)
        F = len(getattr(draft, "tap_layers", ())) * m.hidden_size
        mem["engine_feature_history"] = B * (m.max_seq_len + gamma + 1) * F * rollout_bytes
    return mem


def format_plan(cfg: RunConfig, stages: list[StagePlan], context: int | str) -> str:
    """A table per stage: memory by part and collective bytes per step, in GiB."""
    p = cfg.parallel
    gib = lambda x: f"{x / 2 ** 30:10.3f}"  # noqa: E731
    lines = [f"plan: dp={p.dp} x pp={p.pp} x cp={p.cp} = {p.dp * p.pp * p.cp} ranks, "
             f"{cfg.grpo.prompts_per_step * cfg.grpo.group_size} rollouts of {context} tokens per "
             f"step, micro_steps={cfg.grpo.micro_steps}" + (f", microbatches={p.microbatches}"
                                                            if p.pp > 1 else "")]
    for sp in stages:
        lines.append(f"\nstage {sp.stage} ({sp.layers} layers): memory per rank, GiB"
                     + (" (the engine only on a replica's first rank)" if sp.stage == 0 else ""))
        for k, v in sp.memory.items():
            lines.append(f"  {k:<24}{gib(v)}")
        lines.append(f"  {'total':<24}{gib(sp.total_memory)}")
        if sp.comm:
            lines.append("  received per step, GiB")
            for k, v in sp.comm.items():
                lines.append(f"  {k:<24}{gib(v)}")
    if cfg.draft.autocast:
        lines.append("\nnote: the draft's mixed precision (draft.autocast) is not modelled: its "
                     "co-training is counted in fp32, an upper bound (a TTT or block loss under "
                     "autocast saved 0.91-0.94x the fp32 count on small shapes, "
                     "docs/results/parallel_grpo.md)")
    return "\n".join(lines)


def peak_gib(stages: list[StagePlan]) -> float:
    return max(sp.total_memory for sp in stages) / 2 ** 30 if stages else math.nan
