"""Pipeline parallelism for the policy's training step: stages by layer ranges, 1F1B and GPipe.

# T packed tokens, C hidden size, V vocab, M microbatches, P pipeline stages

A small explicit schedule, not torch.distributed.pipelining, because:
1. packed microbatches: each has its own length T and ``cu_seqlens``. PipelineStage works from one
   activation shape (given or inferred once) and hands a stage only the previous stage's outputs, so
   ``cu_seqlens`` would have to travel through the pipe as a tensor and shapes be renegotiated;
2. the schedule must be observable: the "schedule untouched" test compares every operation on the
   pipeline group (kind, peer, microbatch, shape) with taps on and off; here all of them pass
   through one object, `PipeTransport`;
3. TapChannel posts its sends from forward hooks inside a stage's forward. With our own executor the
   only pipeline operations that can be outstanding at that moment are non-blocking sends, which is
   what the no-hang argument in `cospec.parallel.tap_channel` rests on.
The cost: about 100 lines that pipelining would give, and no interleaved or zero-bubble schedules.

Every rank holds the step's plan (the list of `Microbatch`, a few KB of token ids), so each stage
knows every microbatch's T without a shape handshake; only the first stage reads the tokens and only
the last the targets. Activations [1, T, C] go s -> s+1 and their gradients s+1 -> s, in schedule
order; sends are waited at the end of the step, receives at once.

Safe on NCCL: in the 1F1B steady state two neighbours can each send before they receive (stage s
sends activation m+1 and then waits for gradient m; stage s+1 sends gradient m and then waits for
activation m+1). gloo buffers the sends; NCCL runs a communicator's point-to-point operations in
order, so both sends would wait for receives queued behind them: a deadlock. So a send that the
stage's next action follows with a receive is not posted alone: it is posted with that receive in
one `batch_isend_irecv` (NCCL groups them, and both progress), which costs no time since nothing
runs between them. A send that no receive follows at once is posted right away.

Schedules (stage s of P, M microbatches; F = forward, B = backward):
- GPipe (Huang et al. 1811.06965): F0 .. F(M-1), then B0 .. B(M-1).
- 1F1B (PipeDream-flush, Narayanan et al. 2006.09503): min(P-1-s, M) warm-up forwards, then F and B
  alternate, then the remaining B. At most P - s microbatches are in flight on stage s.
Both run the forwards in microbatch order 0..M-1 on every stage; TapChannel relies on it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from cospec.draft.ttt import TTTBatch, cat_batches, select_sequences
from cospec.models.llama import Transformer
from cospec.models.precision import autocast
from cospec.parallel.tap_channel import TapChannel


@dataclass
class Microbatch:
    """One packed row of whole sequences.

    tokens: long [T]; cu_seqlens: long [N+1]; targets: long [T], the token after position t in its
    sequence; loss_mask: float [T], 1 where targets[t] is trained (a response token); index: its
    place in the step (0..M-1).
    Example: sequences [BOS a b EOS] and [BOS c EOS] with prompts "BOS a" and "BOS": tokens
    [BOS a b BOS c], targets [a b EOS c EOS], cu_seqlens [0, 3, 5], loss_mask [0 1 1 1 1]
    (the same convention as `cospec.draft.ttt.TTTBatch`).
    """

    tokens: Tensor
    cu_seqlens: Tensor
    targets: Tensor
    loss_mask: Tensor
    index: int = 0
    #: RoPE positions [T] when the row is a context-parallel shard (default: restart per sequence)
    positions: Tensor | None = None

    @classmethod
    def from_packed(cls, packed, index: int) -> "Microbatch":
        """From a one-row `cospec.sft.PackedBatch` (`pack_examples`: SFT's and GRPO's packing)."""
        return cls(tokens=packed.tokens[0], cu_seqlens=packed.cu_seqlens, targets=packed.targets[0],
                   loss_mask=packed.loss_mask[0], index=index)


def token_nll(logits_TV: Tensor, mb: Microbatch, *, num_step_tokens: int) -> Tensor:
    """sum of -log p(target) over mb's trained positions / num_step_tokens.

    Summed over a step's microbatches this is the step's mean token NLL, whatever the split; the
    pipelined step takes any ``loss_fn(logits_TV, mb) -> scalar`` of that additive form (GRPO's
    per-microbatch term plugs in the same way).
    """
    nll = F.cross_entropy(logits_TV.float(), mb.targets.to(logits_TV.device), reduction="none")
    return (nll * mb.loss_mask.to(nll.device)).sum() / num_step_tokens


def split_layers(num_layers: int, num_stages: int,
                 stage_sizes: list[int] | None = None) -> list[range]:
    """Contiguous layer ranges, one per stage. Default: as even as possible, the extra layers on
    the earliest stages (the last stage also holds the head and the draft)."""
    if num_stages < 1:
        raise ValueError(f"pp must be >= 1, got {num_stages}")
    if stage_sizes is None:
        base, extra = divmod(num_layers, num_stages)
        stage_sizes = [base + (s < extra) for s in range(num_stages)]
    if len(stage_sizes) != num_stages or sum(stage_sizes) != num_layers:
        raise ValueError(f"stage sizes {stage_sizes} must be {num_stages} numbers summing to the "
                         f"policy's {num_layers} layers")
    empty = [s for s, n in enumerate(stage_sizes) if n < 1]
    if empty:
        raise ValueError(f"pipeline stage(s) {empty} would own no decoder layer (sizes {stage_sizes}, "
                         f"pp={num_stages}, {num_layers} layers): every stage needs at least one")
    starts = [sum(stage_sizes[:s]) for s in range(num_stages)]
    return [range(a, a + n) for a, n in zip(starts, stage_sizes)]


def build_stage(policy: Transformer, layers: range, *, stage: int, num_stages: int) -> Transformer:
    """Stage ``stage`` of ``policy``: its layers (embedding on the first stage, norm and head on the
    last), parameters copied under the checkpoint's own names."""
    cfg = policy.config
    if cfg.tie_embeddings and num_stages > 1:
        raise ValueError("model.tie_embeddings cannot be split across pipeline stages (the embedding "
                         "lives on the first, the head on the last); use pp=1")
    with torch.device("meta"):  # no throw-away init: the weights come from the policy
        part = Transformer(cfg, layer_ids=list(layers), has_embedding=stage == 0,
                           has_head=stage == num_stages - 1, attn_fn=policy.attn_fn)
    wanted = part.state_dict().keys()
    state = {k: v.detach().clone() for k, v in policy.state_dict().items() if k in wanted}
    part.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_embeddings:  # assign=True replaced the shared tensor by two copies: share it again
        part.lm_head.weight = part.embed_tokens.weight
    return part


def schedule_actions(kind: str, stage: int, num_stages: int, num_microbatches: int
                     ) -> list[tuple[str, int]]:
    """[("F" | "B", microbatch), ...] in the order stage ``stage`` runs them."""
    M = num_microbatches
    if kind == "gpipe":
        return [("F", m) for m in range(M)] + [("B", m) for m in range(M)]
    if kind != "1f1b":
        raise ValueError(f"pipeline schedule must be '1f1b' or 'gpipe', got {kind!r}")
    warmup = min(num_stages - 1 - stage, M)
    actions = [("F", m) for m in range(warmup)]
    for i in range(M - warmup):
        actions += [("F", warmup + i), ("B", i)]
    return actions + [("B", m) for m in range(M - warmup, M)]


#: the point-to-point ops `P2POp` accepts (torch checks the op is one of these two functions)
_ISEND, _IRECV = dist.isend, dist.irecv


class PipeTransport:
    """Every operation on the pipeline group goes through here and is recorded in ``trace`` as
    (op, kind, peer stage, microbatch, shape), in program order; ``batches`` records the same
    operations as they were posted together (each a list of trace entries)."""

    def __init__(self, group, stage: int, num_stages: int):
        self.group, self.stage, self.num_stages = group, stage, num_stages
        self.ranks = dist.get_process_group_ranks(group) if num_stages > 1 else [0]
        if num_stages > 1:
            # NCCL: a group's first batch_isend_irecv must involve all its ranks unless a
            # collective has set the communicator up; this barrier is that collective.
            dist.barrier(group=group)
        self.trace: list[tuple] = []
        self._sends: list = []  # posted, waited at `finish`
        self._pending: list = []  # queued, posted with the next receive (see the module docstring)
        self._pending_trace: list = []
        self.batches: list[list[tuple]] = []

    def send(self, tensor: Tensor, to_stage: int, kind: str, m: int) -> None:
        """Queue a send; it is posted by the next `recv` (in one batch with it) or `flush`."""
        self.trace.append(("send", kind, to_stage, m, tuple(tensor.shape)))
        self._pending_trace.append(self.trace[-1])
        self._pending.append(dist.P2POp(_ISEND, tensor.detach().contiguous(),
                                        self.ranks[to_stage], self.group))

    def recv(self, like: Tensor, shape: tuple, from_stage: int, kind: str, m: int) -> Tensor:
        """Receive (waited here), posted together with the queued sends."""
        self.trace.append(("recv", kind, from_stage, m, tuple(shape)))
        buf = torch.empty(shape, dtype=like.dtype, device=like.device)
        works = dist.batch_isend_irecv(
            self._pending + [dist.P2POp(_IRECV, buf, self.ranks[from_stage], self.group)])
        self.batches.append(self._pending_trace + [self.trace[-1]])
        self._sends += works[:-1]
        self._pending, self._pending_trace = [], []
        works[-1].wait()
        return buf

    def flush(self) -> None:
        """Post the queued sends now (no receive follows them at once)."""
        if self._pending:
            self._sends += dist.batch_isend_irecv(self._pending)
            self.batches.append(self._pending_trace)
            self._pending, self._pending_trace = [], []

    def finish(self) -> None:
        """Wait for this step's sends: every one has its receive in the peer's schedule."""
        self.flush()
        for work in self._sends:
            work.wait()
        self._sends.clear()


@dataclass
class PipelineStep:
    """One stage's part of a pipelined training step; `run` returns the step's policy loss on the
    last stage (None elsewhere) and leaves the gradients in ``model``.

    taps: a TapChannel (or any object with begin_step / set_microbatch / after_forward / end_step),
    already attached to ``model``; None runs without taps. One whose ``after_forward`` blocks on a
    peer (``sends_in_after_forward = True``) gets the stage's activation send posted first. on_last_backward(mb, logits_TV, M): called
    on the last stage right after microbatch mb's backward, with the detached logits and the
    step's number of microbatches (a `TapCapture` keeps the draft's inputs of each).
    before_backward(m, is_last): called before each backward, ``is_last`` for the step's last one
    (an FSDP2-sharded stage reduces its accumulated gradients only then).
    autocast: the forwards' mixed precision (`grpo.autocast`; the backwards run outside it); the
    activation sent on is cast to the stage's weight dtype, which its receiver expects.
    """

    model: Transformer
    transport: PipeTransport
    loss_fn: Callable[[Tensor, Microbatch], Tensor]
    schedule: str = "1f1b"
    taps: object | None = None
    on_last_backward: Callable[[Microbatch, Tensor, int], None] | None = None
    before_backward: Callable[[int, bool], None] | None = None
    autocast: str = ""
    _saved: dict = field(default_factory=dict)

    def run(self, microbatches: list[Microbatch], step: int = 0) -> float | None:
        t = self.transport
        self.first, self.last = t.stage == 0, t.stage == t.num_stages - 1
        self._like = next(self.model.parameters())
        self._loss, self._num_microbatches = torch.zeros(()), len(microbatches)
        for i, mb in enumerate(microbatches):
            if mb.index != i:
                raise ValueError(f"microbatch {i} of the step has index {mb.index}: indices must be 0..M-1 "
                                 f"in order (they are the taps' stamps)")
        if self.taps is not None:
            self.taps.begin_step(step, [len(mb.tokens) for mb in microbatches])
        actions = schedule_actions(self.schedule, t.stage, t.num_stages, len(microbatches))
        last_backward = max(i for i, (op, _) in enumerate(actions) if op == "B")
        for i, (op, m) in enumerate(actions):
            if op == "B" and self.before_backward is not None:
                self.before_backward(m, i == last_backward)
            (self._forward if op == "F" else self._backward)(microbatches[m])
            following = actions[i + 1][0] if i + 1 < len(actions) else None
            # The next action starts with a receive (a forward off the first stage, a backward off
            # the last): the queued send goes with it; otherwise it goes now.
            if not ((following == "F" and not self.first) or (following == "B" and not self.last)):
                t.flush()
        t.finish()
        if self.taps is not None:
            self.taps.end_step()
        return float(self._loss) if self.last else None  # one device sync for the loss, not M

    def _forward(self, mb: Microbatch) -> None:
        t, m = self.transport, mb.index
        cu = mb.cu_seqlens.to(self._like.device)
        if self.taps is not None:
            self.taps.set_microbatch(m)  # the stamp of the taps this forward posts
        pos = mb.positions.to(cu.device)[None] if mb.positions is not None else None
        x = None
        if not self.first:
            shape = (1, len(mb.tokens), self.model.config.hidden_size)
            x = t.recv(self._like, shape, t.stage - 1, "act", m).requires_grad_()
        with autocast(self.autocast, cu.device):
            if self.first:
                out = self.model(mb.tokens.to(cu.device)[None], cu_seqlens=cu, positions_BT=pos)
            else:
                out = self.model(inputs_embeds=x, cu_seqlens=cu, positions_BT=pos)
            if self.last:
                loss = self.loss_fn(out.logits[0], mb)
        if self.last:
            self._saved[m] = (x, loss, out.logits[0].detach())
        else:
            hidden = out.hidden.to(self._like.dtype)
            # Ordering invariant: the forward's tap sends (posted by hooks) precede this send.
            t.send(hidden, t.stage + 1, "act", m)
            self._saved[m] = (x, hidden, None)
        if self.taps is not None:
            if getattr(self.taps, "sends_in_after_forward", False):
                t.flush()  # a transport that blocks there needs the activation on its way
            self.taps.after_forward(m)

    def _backward(self, mb: Microbatch) -> None:
        t, m = self.transport, mb.index
        x, out, logits = self._saved.pop(m)
        if self.last:
            out.backward()
            self._loss = self._loss.to(out.device) + out.detach()
        else:
            grad = t.recv(self._like, tuple(out.shape), t.stage + 1, "grad", m)
            torch.autograd.backward(out, grad)
        if not self.first:
            t.send(x.grad, t.stage - 1, "grad", m)
        if self.last and self.on_last_backward is not None:
            # After the gradient left, so upstream stages are not held up by the draft.
            self.on_last_backward(mb, logits, self._num_microbatches)


def pipeline_groups(ranks: list[int] | None = None):
    """(pipeline group, tap group): two groups over the same ranks (default: the world), created in
    this order on every rank. TapChannel gets the second and never touches the first."""
    ranks = list(range(dist.get_world_size())) if ranks is None else ranks
    return dist.new_group(ranks), dist.new_group(ranks)


class TapCapture:
    """The last stage's `PipelineStep.on_last_backward` when the draft co-trains: per microbatch,
    the draft's training inputs, kept until the step ends (``take``): the taps of ``tap_layers``
    that ``taps`` (the last stage's TapChannel) delivered for it, waited for here and only here,
    copied out of the channel's reused slots, and the stage's own logits, detached.

    The draft then trains on them with `cospec.draft.cotrain.cotrain_draft`, after the policy's
    step: the one co-training path, which the GRPO trainer (`cospec.rl.pp_step`) and `cospec bench
    pp` both run. ``sequences``: {microbatch index: the indices of its sequences to keep}
    (None: all), so that the stage holds only what the draft trains on, never a whole
    minibatch's logits; ``to_batch(micro, feats, logits_TV, sequences)``: how a microbatch's
    inputs become the `TTTBatch` of those of its sequences (default: copied out of the channel;
    under pp x cp the shards' rows of those sequences gathered back into whole sequences).
    ``keep_logits``: the form the logits are kept in, applied before ``to_batch`` (default: as
    they are; `cospec.draft.losses.draft_targets`).
    """

    def __init__(self, taps, tap_layers, to_batch=None, keep_logits=None, sequences=None):
        self.taps, self.tap_layers = taps, tuple(tap_layers)
        self.to_batch = to_batch or self._whole
        self.keep_logits = keep_logits or (lambda logits: logits)
        self.sequences = sequences
        self.batches: dict[int, TTTBatch] = {}

    @staticmethod
    def _whole(mb: Microbatch, feats: dict, logits_TV: Tensor, sequences) -> TTTBatch:
        device = logits_TV.device
        batch = TTTBatch(tokens=mb.tokens.to(device), cu_seqlens=mb.cu_seqlens.to(device),
                         loss_mask=mb.loss_mask.to(device), taps=dict(feats),
                         policy_logits=logits_TV)
        if sequences is None:  # the channel reuses its slots: keep copies
            return dataclasses.replace(batch, taps={k: v.clone() for k, v in feats.items()})
        return select_sequences(batch, sequences)  # copies the rows it keeps

    def __call__(self, mb: Microbatch, logits_TV: Tensor, num_microbatches: int) -> None:
        feats = self.taps.wait(mb.index, self.tap_layers)
        keep = None if self.sequences is None else self.sequences[mb.index]
        if keep != []:  # none of its sequences trained on: nothing kept (alike on every cp rank)
            self.batches[mb.index] = self.to_batch(mb, feats, self.keep_logits(logits_TV.detach()),
                                                   keep)

    def take(self) -> TTTBatch | None:
        """The step's microbatches as one packed `TTTBatch` (in microbatch order), and forget them."""
        if not self.batches:
            return None
        batch = cat_batches([self.batches[m] for m in sorted(self.batches)])
        self.batches = {}
        return batch


def co_trained_step(model: Transformer, *, stage_layers: list[range], stage: int, pipe_group,
                    tap_group, loss_fn, tap_layers, max_microbatches: int, max_tokens: int,
                    draft=None, schedule: str = "1f1b") -> PipelineStep:
    """The pipelined policy step that feeds the draft on the last stage, wired on one rank.

    model: this rank's stage (`build_stage`); tap_layers: the layers TapChannel carries, the same on
    every rank (the draft's ``tap_layers``, or more); draft: the draft on the last stage (ignored
    elsewhere). The returned step's ``taps`` is this rank's TapChannel and, on the last stage,
    ``on_last_backward`` its `TapCapture` (after the step: `cotrain_draft` on its ``take()``).
    """
    taps = TapChannel(tap_group, stage=stage, stage_layers=stage_layers, tap_layers=tap_layers,
                      max_microbatches=max_microbatches, max_tokens=max_tokens,
                      hidden_size=model.config.hidden_size, dtype=next(model.parameters()).dtype,
                      device=next(model.parameters()).device)
    taps.attach(model)
    capture = None
    if stage == len(stage_layers) - 1 and draft is not None:
        capture = TapCapture(taps, draft.tap_layers)
    return PipelineStep(model, PipeTransport(pipe_group, stage, len(stage_layers)), loss_fn,
                        schedule=schedule, taps=taps, on_last_backward=capture)
