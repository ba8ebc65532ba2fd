"""Compiled decode and verification forwards for the rollout engines (``rollout.compile``).

# B cache rows, T new tokens per row, S cache slots, V vocab

A small policy's decode step is bound by per-op overhead, not by arithmetic: on this CPU a batch-16
decode of the 4M-parameter default costs milliseconds for a tenth of a GFLOP. `torch.compile`
(inductor: C++/OpenMP on CPU, Triton on CUDA) fuses the step's elementwise work and calls far
fewer kernels, but only where the compiled region has static shapes and no host integers. The
eager cache forward has neither: its attention covers the first ``used`` slots, a host integer that
grows every step (`KVCache.check_room`), so a plain ``torch.compile(policy)`` would recompile for
every new length.

Here the same `Transformer.forward` runs over `SpanCacheView`, whose attention covers a fixed
*span* of slots under the per-row length mask (the static-cache decoding of gpt-fast): the span is
the longest row's length rounded up to a bucket (64, 128, 256, ... up to S), so one graph per
(B, T, tap layers, span bucket) serves every step of a run, and the host integer it needs comes
from what the engine already knows (`KVCache.expect_longest`), not from the device. Attention runs
as `matmul_cache_attention`, which fuses where SDPA's masked CPU kernel does not (why both are
exact: docs/design.md, "Compiled decoding over a static cache").

Only forwards that address every row in order, each row writing all its new tokens, go through a
compiled graph (a full batch's decode, verification and one-token draft steps, the bulk of a
run's forwards). The rest runs eagerly: a draft's catch-up (rows write different counts of valid
entries; compiled, a graph per width, it saved 10% of the drafting time at batch 1 for twice the
graphs), a prefill (ragged prompts, a subset of rows, logits at one position), and the tail of a
run (fewer active rows than slots: a graph per row count).

Outputs agree with eager to float rounding (a different summation order), so greedy tokens are
the same unless two logits tie to ~1e-6; sampling stays exact for the logits computed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from cospec.models.attention import matmul_cache_attention
from cospec.models.draft import DraftOutput
from cospec.models.llama import ModelOutput, Transformer
from cospec.rollout.kv_cache import KVCache

#: the shortest attention span a compiled forward covers (shorter rows share its graph)
SMALLEST_SPAN = 64
#: see `compile_rollouts`: off, since a cold compile (~1 minute per batch size on 2 cores) outweighs
#: a 1.1x decode gain at the demo's batch 16 over its ~2 minutes of rollouts per mode
DEFAULT_ON_CPU = False


def compile_rollouts(requested: bool | None, device: torch.device) -> bool:
    """``rollout.compile``: what was asked, or when None the measured default of the device.

    CPU: DEFAULT_ON_CPU, from `cospec bench compile` (docs/results/rollout.md, "Compiled
    forwards"). CUDA: off, because no GPU run has measured it yet; set ``rollout.compile=true``
    to try it there.
    """
    if requested is not None:
        return requested
    return DEFAULT_ON_CPU if device.type == "cpu" else False


def graphs_called(engine) -> int:
    """Graphs a speculative engine's compiled forwards (policy, draft) have called (0 when eager).
    A step that raises the count compiled, so its time is the compiler's: the adaptive controller
    leaves it out of its cost model (a compile pause would read as a step seconds long)."""
    if not engine.compiled:
        return 0
    forwards = (engine.forward, getattr(engine.drafter, "forward", None))
    return sum(getattr(f, "num_graphs", 0) for f in forwards)


def span_buckets(num_slots: int) -> list[int]:
    """The spans a compiled forward may attend over: powers of two from SMALLEST_SPAN, then S."""
    spans, s = [], SMALLEST_SPAN
    while s < num_slots:
        spans.append(s)
        s *= 2
    return spans + [num_slots]


class SpanCacheView:
    """A `KVCache` as a compiled forward sees it: attention covers the first `span` slots (a
    constant of the graph; the length mask hides the stale ones), whatever the rows' lengths."""

    def __init__(self, cache: KVCache, span: int):
        self.cache, self.span = cache, span
        self.lengths_B = cache.lengths_B

    def check_room(self, num_new: int, rows: Tensor | None = None) -> int:
        return self.span

    def update(self, layer_id: int, k_BHTD: Tensor, v_BHTD: Tensor, rows: Tensor | None,
               used: int) -> tuple[Tensor, Tensor]:
        return self.cache.update(layer_id, k_BHTD, v_BHTD, rows, used)

    def advance(self, num_valid_B: Tensor | int, rows: Tensor | None = None) -> None:
        self.cache.advance(num_valid_B, rows)


class CompiledCacheForward:
    """Calls like the module it wraps (a `Transformer` policy or draft LM as in
    `cospec.rollout.engine.score_tokens`, or an `Eagle3Draft` with its feature input); a
    whole-cache forward runs as a compiled graph, anything else eagerly on the same module (same
    weights: a weight sync that copies into the module in place reaches both).

    model: a `Transformer` or an `Eagle3Draft`; cache: the engine's `KVCache` for it.
    mode: `torch.compile`'s mode ("default"; "reduce-overhead" adds CUDA graphs on CUDA).
    compiled_calls_by_span / num_eager_calls count the forwards each way (tests and benchmarks
    read them).
    """

    def __init__(self, model: nn.Module, cache: KVCache, *, mode: str = "default"):
        self.model, self.cache = model, cache
        self._is_policy = isinstance(model, Transformer)
        self.spans = span_buckets(cache.capacity)
        # Dynamo keeps at most `recompile_limit` graphs per code object (default 8) and past it
        # runs that code eagerly for good, with only a log line. Every instance shares the code of
        # `_span_forward`, and each needs a graph per (T, taps, span): T runs 1..gamma+1 under
        # adaptive speculation, with up to 5 spans, and a benchmark builds engines at 4 batch
        # sizes, each with a policy and a draft forward: hundreds of graphs in one process.
        dynamo = torch._dynamo.config
        dynamo.recompile_limit = max(dynamo.recompile_limit, 512)
        dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, 1024)
        self._compiled = torch.compile(self._span_forward, fullgraph=True, dynamic=False, mode=mode)
        self.compiled_calls_by_span = dict.fromkeys(self.spans, 0)
        self.num_eager_calls = 0
        self._shapes: set[tuple] = set()  # (T, taps, span) of every graph called so far

    @property
    def num_graphs(self) -> int:
        """Graphs this forward has called (a call that raised it compiled one)."""
        return len(self._shapes)

    @property
    def num_compiled_calls(self) -> int:
        return sum(self.compiled_calls_by_span.values())

    def _span_forward(self, tokens_BT: Tensor, inputs: tuple[Tensor, ...],
                      tap_layers: tuple[int, ...], span: int):
        view = SpanCacheView(self.cache, span)
        if not self._is_policy:  # a draft step: tokens and the feature it reads
            out = self.model(tokens_BT, *inputs, kv_cache=view, attn_fn=matmul_cache_attention)
            return out.logits, out.hidden, ()
        out = self.model(tokens_BT, kv_cache=view, tap_layers=tap_layers,
                         attn_fn=matmul_cache_attention)
        return out.logits, out.hidden, tuple(out.taps[i] for i in tap_layers)

    def precompile(self, num_tokens: Sequence[int], tap_layers: Sequence[int] = (),
                   longest: int | None = None) -> None:
        """Compile the graph of every span for each count of new tokens, now rather than at the
        first step that needs it (a benchmark's timed runs should not compile). ``longest``: no
        row will hold more slots than this, so spans past the one that holds it are never called
        and not compiled (None: every span). Runs on dummy inputs and leaves every row's length
        as it was: call it between `generate` calls."""
        last = self.spans[-1] if longest is None else self.span_for(
            min(longest, self.cache.capacity))
        spans = [s for s in self.spans if s <= last]
        saved = self.cache.lengths_B.clone()
        device, B = self.cache.lengths_B.device, self.cache.batch_size
        with torch.inference_mode():
            for T in num_tokens:
                tokens = torch.zeros(B, T, dtype=torch.long, device=device)
                inputs, kwargs = (), {"tap_layers": tap_layers}
                if not self._is_policy:  # an EAGLE-3 draft step reads a feature per entry
                    p = next(self.model.parameters())
                    inputs = (torch.zeros(B, T, self.model.config.hidden_size, dtype=p.dtype,
                                          device=device),)
                    kwargs = {}
                for span in spans:
                    self.cache.lengths_B.fill_(max(span - T, 0))
                    self.cache.expect_longest(max(span - T, 0))
                    self(tokens, *inputs, kv_cache=self.cache, **kwargs)
        self.cache.lengths_B.copy_(saved)

    def span_for(self, longest: int) -> int:
        """The smallest bucket that holds `longest` slots."""
        return next(s for s in self.spans if s >= longest)

    def __call__(self, tokens_BT: Tensor, *inputs: Tensor, kv_cache=None,
                 cache_rows: Tensor | None = None, num_valid_B: Tensor | None = None,
                 **kwargs) -> ModelOutput | DraftOutput:
        tap_layers = kwargs.get("tap_layers", ())
        whole = (kv_cache is self.cache and cache_rows is None and num_valid_B is None
                 and kwargs.get("logits_positions_B") is None
                 and tokens_BT.shape[0] == self.cache.batch_size)
        if not whole:
            self.num_eager_calls += 1
            return self.model(tokens_BT, *inputs, kv_cache=kv_cache, cache_rows=cache_rows,
                              num_valid_B=num_valid_B, **kwargs)
        # The overflow check and the span the graph cannot compute: on the host, from
        # `expect_longest` when the engine gave it (else one device read, as the eager forward).
        longest = kv_cache.check_room(tokens_BT.shape[1])
        taps = tuple(int(i) for i in tap_layers)
        span = self.span_for(longest)
        self._shapes.add((tokens_BT.shape[1], taps, span))
        logits, hidden, tapped = self._compiled(tokens_BT, inputs, taps, span)
        self.compiled_calls_by_span[span] += 1
        if not self._is_policy:
            return DraftOutput(logits=logits, hidden=hidden)
        return ModelOutput(logits=logits, hidden=hidden, taps=dict(zip(taps, tapped)))


def precompile_engine(engine, longest: int | None = None) -> None:
    """Compile, now, every graph a run of ``engine`` may call (`CompiledCacheForward.precompile`
    for each of its compiled forwards), so that timed runs after it never compile: a plain
    engine's decode; a speculative engine's verify lengths (every 1..gamma+1 under a controller,
    else gamma+1) and its draft's one-token steps. ``longest``: the most slots a row of the runs
    will hold (`longest_row`), which bounds the spans compiled. Nothing for an eager engine."""
    if not isinstance(engine.forward, CompiledCacheForward):
        return
    drafter = getattr(engine, "drafter", None)
    if drafter is None:
        engine.forward.precompile([1], longest=longest)
        return
    lengths = range(1, engine.gamma + 2) if engine.controller is not None else [engine.gamma + 1]
    engine.forward.precompile(lengths, drafter.tap_layers, longest=longest)
    if isinstance(getattr(drafter, "forward", None), CompiledCacheForward):
        drafter.forward.precompile([1], longest=longest)


def longest_row(prompts: Sequence[Sequence[int]], max_new_tokens: int, gamma: int = 0) -> int:
    """The most cache slots a row of a run on ``prompts`` can hold: its prompt, its response, and
    the gamma + 1 tokens a speculative step writes at once (the policy's cache; the draft's holds
    fewer)."""
    return max(len(p) for p in prompts) + max_new_tokens + gamma + 1
