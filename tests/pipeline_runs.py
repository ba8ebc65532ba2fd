"""Pipelined runs on spawned gloo ranks and their single-process (pp=1) reference, for the tests.

# T packed tokens, C hidden size, V vocab, M microbatches

tests/test_pipeline.py and tests/test_tap_channel.py compare the two. Import with ``from
pipeline_runs import ...`` (pytest puts tests/ on sys.path): spawned ranks import their function by
module path and receive the parent's sys.path, so they find this module too. `OpRecorder` patches the
rank's torch.distributed point-to-point functions to log every operation with the group it used: a
record independent of the pipeline's own `PipeTransport.trace`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from cospec.config import ModelConfig
from cospec.draft.ttt import TTTBatch, cat_batches, ttt_loss
from cospec.models.block_draft import BlockDraft
from cospec.models.draft import Eagle3Draft
from cospec.models.llama import Transformer
from cospec.parallel.pipeline import (Microbatch, PipelineStep, PipeTransport, build_stage,
                                      co_trained_step, pipeline_groups, split_layers, token_nll)
from cospec.data.packing import pack_examples
from cospec.data.tokenizer import BOS, EOS
from cospec.parallel.tap_channel import TapChannel, TapStampError

TINY = ModelConfig(vocab_size=50, hidden_size=32, num_layers=6, num_heads=4, num_kv_heads=2,
                   intermediate_size=64, max_seq_len=64)
NUM_TTT_STEPS = 2


def tiny_policy() -> Transformer:
    torch.manual_seed(0)
    return Transformer(TINY)


def tiny_draft(policy: Transformer, kind: str = "eagle3") -> Eagle3Draft | BlockDraft:
    """Taps (1, 2, 3): EAGLE-3's default low/mid/high for 6 layers (the block draft's too)."""
    torch.manual_seed(1)
    if kind == "block":
        return BlockDraft.from_policy(policy, num_layers=2, correction=True)
    return Eagle3Draft.from_policy(policy)


def random_microbatches(num_microbatches: int, seed: int = 0) -> list[Microbatch]:
    """2-3 sequences of 4-10 tokens per microbatch: every microbatch has its own T."""
    rng = random.Random(seed)
    mbs = []
    for m in range(num_microbatches):
        examples = []
        for _ in range(rng.randint(2, 3)):
            n, prompt_len = rng.randint(2, 8), rng.randint(1, 3)
            ids = [BOS] + [rng.randrange(4, TINY.vocab_size) for _ in range(n)] + [EOS]
            examples.append((ids, [0] * prompt_len + [1] * (len(ids) - prompt_len)))
        mbs.append(Microbatch.from_packed(pack_examples(examples), index=m))
    return mbs


def num_step_tokens(mbs: list[Microbatch]) -> int:
    return int(sum(mb.loss_mask.sum() for mb in mbs))


class OpRecorder:
    """Logs (group name, op, peer rank, shape) of every isend/irecv/send/recv this rank issues,
    alone or in a batch_isend_irecv."""

    def __init__(self, groups: dict):
        self.ops: list[tuple] = []
        self._names = [(g, name) for name, g in groups.items()]
        for op in ("isend", "irecv", "send", "recv"):
            setattr(dist, op, self._wrap(op, getattr(dist, op)))
        dist.batch_isend_irecv = self._wrap_batch(dist.batch_isend_irecv)

    def _wrap_batch(self, fn):
        """batch_isend_irecv: each op of the batch logged as an isend or an irecv."""
        def recorded(ops):
            for p2p in ops:
                name = next((n for g, n in self._names if g is p2p.group), "other")
                kind = "isend" if p2p.op.__name__ == "isend" else "irecv"
                self.ops.append((name, kind, p2p.peer, tuple(p2p.tensor.shape)))
            return fn(ops)
        return recorded

    def _wrap(self, op: str, fn):
        def recorded(tensor, peer, group=None, **kw):
            name = next((n for g, n in self._names if g is group), "other")
            self.ops.append((name, op, peer, tuple(tensor.shape)))
            return fn(tensor, peer, group=group, **kw)
        return recorded


@dataclass(frozen=True)
class RunSpec:
    """schedule: '1f1b' | 'gpipe'; taps: the TapChannel's layers (() = no channel); draft: co-train
    the draft (taps (1, 2, 3); `draft_kind`) on the last stage; num_steps: steps run (stamps
    0..num_steps-1)."""

    schedule: str = "1f1b"
    taps: tuple[int, ...] = ()
    draft: bool = False
    num_steps: int = 1
    draft_kind: str = "eagle3"  # or "block"


#: the block draft co-trained on the last stage, every layer tapped, 2 steps under 1F1B
BLOCK_SPEC = RunSpec(schedule="1f1b", taps=tuple(range(TINY.num_layers)), draft=True, num_steps=2,
                     draft_kind="block")


def pipelined_runs(rank: int, num_ranks: int, stage_sizes, num_microbatches: int,
                   specs: list[RunSpec]) -> list[dict]:
    """Each spec run on this rank's stage; per spec: loss (last stage), policy grads by name,
    draft grads and loss, the transport's trace, the recorded ops, and the taps the draft stage
    received {(step, microbatch, layer): [T, C]}."""
    policy, mbs = tiny_policy(), random_microbatches(num_microbatches)
    pipe_group, tap_group = pipeline_groups()
    recorder = OpRecorder({"pipe": pipe_group, "tap": tap_group})
    layers = split_layers(TINY.num_layers, num_ranks, stage_sizes)
    out = []
    for spec in specs:
        num_ops = len(recorder.ops)
        result = _run(policy, mbs, spec, rank, layers, pipe_group, tap_group)
        result["ops"] = recorder.ops[num_ops:]
        out.append(result)
    return out


def _run(policy, mbs, spec: RunSpec, rank: int, layers, pipe_group, tap_group) -> dict:
    num_stages, last = len(layers), rank == len(layers) - 1
    model = build_stage(policy, layers[rank], stage=rank, num_stages=num_stages)
    loss_fn = partial(token_nll, num_step_tokens=num_step_tokens(mbs))
    draft, delivered = None, {}
    if spec.taps:
        draft = tiny_draft(policy, spec.draft_kind) if last and spec.draft else None
        runner = co_trained_step(model, stage_layers=layers, stage=rank, pipe_group=pipe_group,
                                 tap_group=tap_group, loss_fn=loss_fn, tap_layers=spec.taps,
                                 max_microbatches=len(mbs),
                                 max_tokens=max(len(mb.tokens) for mb in mbs), draft=draft,
                                 schedule=spec.schedule)
        if last:
            runner.taps.wait = _recording_wait(runner.taps, delivered)
    else:
        runner = PipelineStep(model, PipeTransport(pipe_group, rank, num_stages), loss_fn,
                              schedule=spec.schedule)
    draft_loss = None
    for k in range(spec.num_steps):
        model.zero_grad(set_to_none=True)
        if draft is not None:
            draft.zero_grad(set_to_none=True)
        loss = runner.run(mbs, step=k)
        if draft is not None:  # the loss `cotrain_draft` trains on, over the step's captured inputs
            d_loss, _ = ttt_loss(draft, runner.on_last_backward.take(), num_steps=NUM_TTT_STEPS)
            d_loss.backward()
            draft_loss = d_loss.item()
    return {"loss": loss, "grads": _grads(model), "trace": runner.transport.trace,
            "batches": runner.transport.batches,
            "draft_grads": _grads(draft) if draft is not None else None,
            "draft_loss": draft_loss, "delivered": delivered}


def _recording_wait(channel: TapChannel, delivered: dict):
    """channel.wait that fetches every tap of the microbatch and keeps a copy (step, m, layer)."""
    wait = channel.wait

    def recorded(m, layers=None):
        feats = wait(m)
        delivered.update({(channel._step, m, layer): f.clone() for layer, f in feats.items()})
        return {layer: feats[layer] for layer in (layers or feats)}
    return recorded


def _grads(module) -> dict:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def reference_step(policy: Transformer, mbs: list[Microbatch], tap_layers=(),
                   draft: Eagle3Draft | BlockDraft | None = None) -> dict:
    """The same step on one process, pp=1: the policy's loss and grads from one packed forward of
    the whole step (independent of the microbatch split); per microbatch the taps; when a draft
    is given, its TTT loss over the step's microbatches packed together, and its grads."""
    policy.zero_grad(set_to_none=True)
    whole = pack_whole_step(mbs)
    loss = token_nll(policy(whole.tokens[None], cu_seqlens=whole.cu_seqlens).logits[0], whole,
                     num_step_tokens=num_step_tokens(mbs))
    loss.backward()
    ref = {"loss": loss.item(), "grads": _grads(policy), "taps": {}, "draft_loss": None}
    batches = []
    for mb in mbs:
        with torch.no_grad():
            o = policy(mb.tokens[None], cu_seqlens=mb.cu_seqlens,
                       tap_layers=sorted(set(tap_layers) | set(draft.tap_layers if draft else ())))
        ref["taps"].update({(mb.index, layer): t[0] for layer, t in o.taps.items()})
        if draft is not None:
            batches.append(TTTBatch(tokens=mb.tokens, cu_seqlens=mb.cu_seqlens,
                                    loss_mask=mb.loss_mask,
                                    taps={layer: o.taps[layer][0] for layer in draft.tap_layers},
                                    policy_logits=o.logits[0]))
    if draft is not None:
        d_loss, _ = ttt_loss(draft, cat_batches(batches), num_steps=NUM_TTT_STEPS)
        d_loss.backward()
        ref["draft_loss"] = d_loss.item()
    ref["draft_grads"] = _grads(draft) if draft is not None else None
    return ref


def pack_whole_step(mbs: list[Microbatch]) -> Microbatch:
    """All microbatches of a step as one packed row."""
    offsets = torch.tensor([0] + [len(mb.tokens) for mb in mbs]).cumsum(0)
    cu = torch.cat([torch.tensor([0])] + [mb.cu_seqlens[1:] + o for mb, o in zip(mbs, offsets)])
    return Microbatch(tokens=torch.cat([mb.tokens for mb in mbs]), cu_seqlens=cu,
                      targets=torch.cat([mb.targets for mb in mbs]),
                      loss_mask=torch.cat([mb.loss_mask for mb in mbs]))


def stamp_mismatch(rank: int, num_ranks: int) -> str:
    """Stage 0 stamps its tap of layer 1 with step 1 while the draft stage awaits step 0. Returns
    the draft stage's error message ('' on the source, 'no error' if the draft read it)."""
    policy, mb = tiny_policy(), random_microbatches(1)[0]
    _, tap_group = pipeline_groups()
    layers = split_layers(TINY.num_layers, num_ranks)
    model = build_stage(policy, layers[rank], stage=rank, num_stages=num_ranks)
    channel = TapChannel(tap_group, stage=rank, stage_layers=layers, tap_layers=(1,),
                         max_microbatches=1, max_tokens=len(mb.tokens), hidden_size=TINY.hidden_size)
    channel.attach(model)
    channel.begin_step(1 if rank == 0 else 0, [len(mb.tokens)])
    if rank == 0:
        channel.set_microbatch(0)
        model(mb.tokens[None], cu_seqlens=mb.cu_seqlens)
        channel.after_forward(0)
        channel.end_step()  # returns: the draft stage posted the receive at its begin_step
        return ""
    try:
        channel.wait(0)
    except TapStampError as e:
        return str(e)
    return "no error"
