"""TapChannel: the policy's tapped layer outputs reach the draft stage on their own process group.

# T packed tokens, C hidden size, M microbatches, P pipeline stages, K taps one source stage owns

The draft lives on the last stage, beside the logits it learns from; the layers it reads (EAGLE-3's
low/mid/high taps) mostly live on earlier stages. Protocol for step k:
1. begin_step, on every stage before its first pipeline operation: the draft (last) stage posts one
   non-blocking receive for every (microbatch m, tapped layer l of another stage) of step k, each
   into its own pre-allocated landing slot (M deep per source: a ring reused every step).
2. The forward of m on a source stage: a forward hook on layer l, i.e. at the moment l's output
   exists, copies the detached output into a send slot behind a header (step, m, l, T) and posts a
   non-blocking send to the draft stage. It runs inside the forward, so it precedes the stage's
   pipeline send of m (the ordering invariant the proof below uses).
3. The draft trainer calls wait(m, layers) for the microbatch it is about to consume: it waits for
   those receives only, checks each header against the expected stamp (a mismatch raises
   `TapStampError`, never silent) and returns views of the slots, {layer: [T, C]}. Taps of layers
   on the draft stage itself are kept by reference and never travel.
4. end_step: sources wait for their sends; the draft stage drains any receive nobody consumed
   (stamps checked too).

Why it cannot hang the schedule (the argument holds for gloo; NCCL orders the same operations on
its stream instead of gloo's transport thread, not run here):
a. Own group: its own gloo context and connections (or NCCL communicator). Its messages cannot
   match, queue behind or reorder the pipeline's, and the pipeline's operations are the same ones
   in the same order with taps on or off (on the pipeline's thread a hook only copies and posts).
b. Inside a schedule step nothing blocks on this channel except the draft stage's wait(m).
c. wait(m) runs after the draft stage's forward of m, which needed activation m from stage P-2,
   sent after the forward of m on every earlier stage, each of which had posted its tap sends of
   m before its own pipeline send (step 2). The receives were posted at begin_step. So both ends
   of every awaited transfer are posted when wait(m) starts, and gloo completes a matched pair on
   its transport thread with no further action of any rank's main thread: wait(m) returns.
d. A source's end_step waits for sends whose receives the draft stage posted at its begin_step(k),
   reached once its step k-1 ended, which depends on nothing of step k: it returns.
e. One landing slot per microbatch: no send waits for a slot to be freed, so there is no flow
   control and no cycle through it.
The known trap (a side-group send/receive posted inside a 1F1B step hanging gloo) is a blocking
side operation whose partner is posted only after a pipeline operation it itself delays; here every
side operation posted inside a step is non-blocking and every wait is on a matched pair (c, d).

Cost: the draft stage's slots hold M x (taps of other stages) x max_tokens x C per step, the order
of what a GPipe schedule keeps in activations anyway; each tap is copied once into a send slot so
the stamp travels in the same message as its data (a pair cannot be read half-matched).
"""

from __future__ import annotations

import time
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor, nn

HEADER_BYTES = 64  # 4 int64 (step, microbatch, layer, tokens), padded so the payload stays aligned


class TapStampError(RuntimeError):
    """A delivered tap carries another (step, microbatch, layer, tokens) than the one awaited."""


def tap_owners(tap_layers, stage_layers: list[range]) -> dict[int, int]:
    """{layer: the stage that computes it}, in layer order; ValueError for a layer no stage has."""
    owner = {layer: s for s, layers in enumerate(stage_layers) for layer in layers}
    unknown = sorted(set(tap_layers) - owner.keys())
    if unknown:
        spans = ", ".join(f"stage {s}: {r.start}..{r.stop - 1}" for s, r in enumerate(stage_layers))
        raise ValueError(f"tap_layers {unknown} are not layers of the policy ({len(owner)} layers; "
                         f"{spans})")
    return {layer: owner[layer] for layer in sorted(set(tap_layers))}


class TapChannel:
    """One stage's end of the channel; see the module docstring for the protocol and why it is safe.

    group: a process group of the pipeline's ranks that is not the pipeline's (`pipeline_groups`).
    stage_layers: every stage's layer range (`split_layers`); the last stage is the draft stage.
    max_microbatches, max_tokens: capacity of the slots (microbatches per step, tokens per microbatch).
    Counters: ``bytes_sent`` (this stage's messages, headers included), ``wait_seconds`` (time the
    draft stage spent blocked in wait/end_step) and ``post_seconds`` (time the stage's own thread
    spent posting: the hooks' copies and isends, begin_step's irecvs).
    """

    def __init__(self, group, *, stage: int, stage_layers: list[range], tap_layers,
                 max_microbatches: int, max_tokens: int, hidden_size: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        self.owner = tap_owners(tap_layers, stage_layers)
        self.group, self.stage, self.num_stages = group, stage, len(stage_layers)
        self.draft_stage = self.num_stages - 1
        self.is_draft = stage == self.draft_stage
        self.ranks = dist.get_process_group_ranks(group) if self.num_stages > 1 else [0]
        self.layers_of = {s: [l for l, o in self.owner.items() if o == s] for s in range(self.num_stages)}
        self.sources = [s for s in range(self.draft_stage) if self.layers_of[s]]
        self.max_microbatches, self.max_tokens = max_microbatches, max_tokens
        self.hidden_size, self.dtype = hidden_size, dtype
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        payload = max_tokens * hidden_size * self.itemsize
        slot_bytes = HEADER_BYTES + -(-payload // 64) * 64

        def slots(num_taps: int) -> Tensor:  # uint8 [M, K, slot bytes], allocated once
            return torch.empty(max_microbatches, num_taps, slot_bytes, dtype=torch.uint8, device=device)

        self.landing = {s: slots(len(self.layers_of[s])) for s in self.sources} if self.is_draft else {}
        mine = self.layers_of[stage]
        self.send_slots = slots(len(mine)) if mine and not self.is_draft else None
        self.bytes_sent, self.wait_seconds, self.post_seconds = 0, 0.0, 0.0
        self._step, self._m, self._counts = None, None, []
        self._recvs: dict[tuple[int, int], tuple] = {}
        self._sends: list = []
        self._local: dict[tuple[int, int], Tensor] = {}

    def attach(self, model: nn.Module) -> list:
        """Forward hooks on this stage's tapped layers of ``model`` (a stage `Transformer`)."""
        handles = []
        for layer in self.layers_of[self.stage]:
            if str(layer) not in model.layers:
                raise ValueError(f"stage {self.stage} model has no layer {layer} to tap")
            handles.append(model.layers[str(layer)].register_forward_hook(partial(self._on_tap, layer)))
        return handles

    def _nbytes(self, num_tokens: int) -> int:
        return HEADER_BYTES + num_tokens * self.hidden_size * self.itemsize

    def begin_step(self, step: int, token_counts: list[int]) -> None:
        """Step 1 of the protocol: the draft stage posts every receive of the step."""
        if len(token_counts) > self.max_microbatches or max(token_counts) > self.max_tokens:
            raise ValueError(f"step of {len(token_counts)} microbatches of up to {max(token_counts)} "
                             f"tokens exceeds the TapChannel's slots ({self.max_microbatches} x "
                             f"{self.max_tokens} tokens)")
        if self._recvs or self._sends:
            raise RuntimeError(f"begin_step({step}) before end_step of step {self._step}: its slots "
                               f"are still in flight")
        self._step, self._counts = step, list(token_counts)
        if not self.is_draft:
            return
        start = time.perf_counter()
        # Per source, receives are posted in the order its sends are: microbatch, then layer.
        for m, num_tokens in enumerate(token_counts):
            for s in self.sources:
                for i, layer in enumerate(self.layers_of[s]):
                    buf = self.landing[s][m, i, :self._nbytes(num_tokens)]
                    self._recvs[(m, layer)] = (dist.irecv(buf, self.ranks[s], group=self.group), buf, s)
        self.post_seconds += time.perf_counter() - start

    def set_microbatch(self, m: int) -> None:
        """The stamp of the taps the next forward posts (the executor calls it before forward m)."""
        self._m = m

    def after_forward(self, m: int) -> None:
        self._m = None  # a forward outside a pipelined step (evaluation) posts nothing

    def _on_tap(self, layer: int, module, inputs, output: Tensor) -> None:
        """Step 2: runs inside the stage's forward, right after ``layer``."""
        m = self._m
        if m is None:
            return
        feat_TC = output.detach()[0]
        num_tokens = feat_TC.shape[0]
        if num_tokens != self._counts[m] or feat_TC.dtype != self.dtype:
            raise ValueError(f"tap of layer {layer}, microbatch {m}: {tuple(feat_TC.shape)} "
                             f"{feat_TC.dtype}, planned {self._counts[m]} tokens of {self.dtype}")
        if self.is_draft:
            self._local[(m, layer)] = feat_TC
            return
        start = time.perf_counter()
        buf = self.send_slots[m, self.layers_of[self.stage].index(layer), :self._nbytes(num_tokens)]
        buf[:32].view(torch.int64).copy_(torch.tensor([self._step, m, layer, num_tokens]))
        buf[HEADER_BYTES:].view(self.dtype).view(num_tokens, self.hidden_size).copy_(feat_TC)
        self._sends.append(dist.isend(buf, self.ranks[self.draft_stage], group=self.group))
        self.bytes_sent += buf.numel()
        self.post_seconds += time.perf_counter() - start

    def _landed(self, m: int, layer: int) -> Tensor:
        """Wait for one receive and check its stamp; [T, C] view of its slot."""
        work, buf, source = self._recvs.pop((m, layer))
        work.wait()
        num_tokens = self._counts[m]
        got = tuple(buf[:32].view(torch.int64).tolist())
        want = (self._step, m, layer, num_tokens)
        if got != want:
            raise TapStampError(f"tap from stage {source}: expected (step, microbatch, layer, tokens) "
                                f"= {want}, got {got}")
        return buf[HEADER_BYTES:].view(self.dtype).view(num_tokens, self.hidden_size)

    def wait(self, m: int, layers=None) -> dict[int, Tensor]:
        """Step 3 (draft stage): {layer: [T, C]} of microbatch m, for ``layers`` (default: all taps).

        The views stay valid until the next begin_step reposts the slots."""
        assert self.is_draft, "only the draft (last) stage receives taps"
        start = time.perf_counter()
        feats = {}
        # A draft may read one layer more than once (tap_layers (1, 1, 1) on a 2-layer policy).
        for layer in self.owner if layers is None else dict.fromkeys(layers):
            if layer not in self.owner:
                raise ValueError(f"layer {layer} is not one of the channel's tap_layers {list(self.owner)}")
            if self.owner[layer] == self.stage:
                feats[layer] = self._local.pop((m, layer))
            else:
                feats[layer] = self._landed(m, layer)
        self.wait_seconds += time.perf_counter() - start
        return feats

    def end_step(self) -> None:
        """Step 4: sources wait for their sends; the draft stage drains unconsumed receives."""
        for work in self._sends:
            work.wait()
        self._sends.clear()
        start = time.perf_counter()
        for m, layer in list(self._recvs):
            self._landed(m, layer)
        self.wait_seconds += time.perf_counter() - start
        self._local.clear()
        self._m = None
