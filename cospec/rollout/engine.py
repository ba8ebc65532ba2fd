"""Batched generation with a static KV cache and continuous batching.

# B cache rows (slots), N rows addressed by one forward, T tokens per row, V vocab

The cache has ``batch_size`` rows ("slots"). A slot holds one active row (a prompt being answered).
Every iteration of the loop:
1. refill: prompts from the queue go into free slots; all of them are prefilled in one right-padded
   forward that addresses only those slots (`prefill_slots`), and their first response token is
   sampled from the logits at each prompt's last position;
2. decode: one forward feeds every active slot its last sampled token (`decode_step`) and samples the
   next one;
3. record: new tokens are appended (`append_until_finished`); a row that produced EOS, reached
   ``sampling.max_new_tokens`` or filled the cache is finished and its slot is freed.

Inactive slots are never fed. While the queue is non-empty every slot is refilled before each decode,
so all slots are active and the decode forward runs over the whole cache (``cache_rows=None``: the
cache hands attention a view, no copy). Only in the tail, when the queue is empty and rows finish,
does the decode address the active subset through ``cache_rows``. That gathers the active rows' K/V
(a copy), which costs far less than running projections, MLP and attention on dead rows: on the
default config (2 CPU threads, 20-token prompts) a decode over 32 of 64 rows takes 21 ms against
26 ms for all 64, and a single row ~9 ms. Feeding dead rows a dummy token would also need
``num_valid_B`` = 0 for them so a finished row's length does not creep past the capacity.

Per-step pieces are module functions so the speculative engine can reuse them: `score_tokens`
writes T tokens per row and returns logits at all T positions (verification); `KVCache.truncate`
rolls rows back after a rejection; `append_until_finished` takes several tokens and stops at the
first finishing one.

Data contract (`Completion`), worked example: prompt [1, 7, 9] (BOS, two chars), the policy samples
12, 2 (EOS) -> tokens [12, 2], logprobs [lp(12 | 1 7 9), lp(2 | 1 7 9 12)], finish_reason "eos".
The logprob of response token i sits at position i of ``logprobs``; it is under the sampling
distribution (see `cospec.rollout.sampling` for the greedy convention).
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Collection, Literal

import torch
from torch import Tensor

from cospec.config import SamplingConfig
from cospec.data.tokenizer import EOS, PAD
from cospec.metrics.progress import progress_bar
from cospec.models.integrity import NonFiniteError
from cospec.rollout.compiled_forward import CompiledCacheForward, compile_rollouts
from cospec.rollout.host_memory import keep_freed_host_memory
from cospec.rollout.kv_cache import KVCache
from cospec.rollout.prompt_streams import PromptStreams
from cospec.rollout.sampling import sample_tokens

FinishReason = Literal["eos", "length"]


@dataclass
class Completion:
    """One answered prompt.

    index: position of the prompt in the list given to `generate`.
    prompt: the prompt's token ids, as given.
    tokens: response token ids, including the EOS when one was produced.
    logprobs: one per response token, logprobs[i] = log p(tokens[i] | prompt, tokens[:i]) under the
        sampling distribution.
    finish_reason: "eos" (EOS sampled) or "length" (max_new_tokens reached or the cache is full).
    """

    index: int
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None


@dataclass
class GenerationResult:
    """completions: in prompt order; num_tokens: response tokens generated (all rows);
    num_forwards: policy forward calls (prefills + decode steps); seconds: wall time of `generate`."""

    completions: list[Completion]
    num_tokens: int
    num_forwards: int
    seconds: float
    tokens_per_second: float


# ----------------------------------------------------------------------------- per-step pieces

def score_tokens(model, cache: KVCache, tokens_NT: Tensor, rows_N: Tensor | None = None, *,
                 num_valid_N: Tensor | None = None, tap_layers: tuple[int, ...] = (),
                 logits_positions_N: Tensor | None = None):
    """Write T tokens per addressed row at its cache length and return the `ModelOutput`
    (logits [N, T, V]: position t predicts the token after tokens_NT[:, t]; [N, 1, V] at
    ``logits_positions_N`` only, when given).

    rows_N: cache rows, None = all rows in order (no K/V gather). The rows advance by num_valid_N
    (default T); a caller that rejects some tokens rolls back with ``cache.truncate``.
    """
    return model(tokens_NT, kv_cache=cache, cache_rows=rows_N, num_valid_B=num_valid_N,
                 tap_layers=tap_layers, logits_positions_B=logits_positions_N)


def prefill_slots(model, cache: KVCache, slots_N: Tensor, prompts: list[list[int]], *,
                  tap_layers: tuple[int, ...] = ()):
    """Empty the given cache rows and write one prompt into each, in one right-padded forward.

    Returns (logits [N, V] at each prompt's last token, the `ModelOutput`: hidden states and taps
    over [N, max len], logits at the last tokens only). Padding (PAD) past a prompt's end is
    written to the cache but the row's length stops at the prompt, so the mask hides it and the
    next decode overwrites it.
    """
    device = cache.lengths_B.device
    lengths = [len(p) for p in prompts]
    tokens_NT = torch.full((len(prompts), max(lengths)), PAD, dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens_NT[i, :len(p)] = torch.tensor(p, dtype=torch.long)
    lengths_N = torch.tensor(lengths, dtype=torch.long)
    cache.reset(slots_N)
    lengths_N = lengths_N.to(device)
    out = score_tokens(model, cache, tokens_NT.to(device), slots_N, num_valid_N=lengths_N,
                       tap_layers=tap_layers, logits_positions_N=lengths_N - 1)
    return out.logits[:, 0], out


def decode_step(model, cache: KVCache, last_tokens_N: Tensor, rows_N: Tensor | None = None) -> Tensor:
    """Feed each addressed row its last token; logits [N, V] for the next one."""
    return score_tokens(model, cache, last_tokens_N[:, None], rows_N).logits[:, 0]


def append_until_finished(row: Completion, tokens: list[int], logprobs: list[float], *,
                          max_new_tokens: int, capacity: int, stop_ids: Collection[int]) -> bool:
    """Append tokens to the row one by one until it finishes; True when it has finished.

    A row finishes on a stop id (reason "eos", the stop token is kept), at max_new_tokens, or when prompt plus
    response fill the cache capacity (reason "length"; the sequence never exceeds the capacity, so the
    trainer can score it in one forward). Tokens after the finishing one are dropped.
    """
    for tok, lp in zip(tokens, logprobs):
        row.tokens.append(tok)
        row.logprobs.append(lp)
        if tok in stop_ids:
            row.finish_reason = "eos"
        elif len(row.tokens) >= max_new_tokens or len(row.prompt) + len(row.tokens) >= capacity:
            row.finish_reason = "length"
        if row.finish_reason is not None:
            return True
    return False


def host_rows(*tensors_NT: Tensor) -> list[list[list]]:
    """Several 2-D tensors read to the host in ONE copy (a device sync each would otherwise be
    taken): each as its list of rows, integer tensors as ints. Carried as float64, which holds
    token ids (< 2^53) and fp32 logprobs exactly, so the values are those of ``.tolist()``."""
    flat = torch.cat([t.reshape(-1).double() for t in tensors_NT]).tolist()
    out, start = [], 0
    for t in tensors_NT:
        rows, cols = t.shape
        values = flat[start:start + rows * cols]
        start += rows * cols
        if not t.is_floating_point():
            values = [int(v) for v in values]
        out.append([values[r * cols:(r + 1) * cols] for r in range(rows)])
    return out


def check_logprobs_finite(logprobs: list[float], forward: int) -> None:
    """NonFiniteError unless every sampled token's logprob is finite. A sampled token has p > 0, so
    its logprob is finite unless the policy's logits were not (a NaN logit makes the row's softmax
    NaN and the draw meaningless): a check on values the host has read already, at no cost."""
    if not all(math.isfinite(lp) for lp in logprobs):
        raise NonFiniteError(f"policy forward {forward} of this generate call: the policy gave "
                             f"non-finite logits (NaN or inf); its weights or inputs are broken")


# ----------------------------------------------------------------------------- the engine

class GenerationEngine:
    """Continuous-batching generation over a static KV cache of ``batch_size`` rows.

    max_seq_len: cache capacity in tokens (prompt + response), at most model.max_seq_len (default).
    stop_ids: the ids that end a response (a tokenizer's ``stop_ids``: EOS, a chat template's
        end-of-turn); default the character tokenizer's EOS; None or () disables stopping (lengths
        then depend only on max_new_tokens and the capacity, as a benchmark wants).
    The engine's batch_size is the cache's; ``SamplingConfig.batch_size`` is for whoever builds
    the engine and is not read here.
    spare_slots: cache slots beyond the capacity, for forwards that write tokens a step may roll
        back (speculative verification); sequences never grow past ``capacity``.
    compile: run the policy's whole-batch decode (and, speculative, verification) forwards as
        `torch.compile` graphs (`CompiledCacheForward`); prefills and a run's tail stay eager.
        The first forward of each new shape compiles (seconds); outputs match eager to rounding.
        None: the device's measured default (`compile_rollouts`).
    """

    def __init__(self, model, *, batch_size: int, max_seq_len: int | None = None,
                 stop_ids: Collection[int] | None = (EOS,), spare_slots: int = 0,
                 compile: bool | None = False):
        model_len = model.config.max_seq_len
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if max_seq_len is not None and not 1 < max_seq_len <= model_len:
            raise ValueError(f"max_seq_len={max_seq_len} must be in [2, model.max_seq_len={model_len}]")
        self.model = model
        if next(model.parameters()).device.type == "cpu":
            keep_freed_host_memory()  # no page faults for the per-step vocabulary-wide tensors
        self.batch_size = batch_size
        self.stop_ids = frozenset(stop_ids or ())
        self.max_seq_len = max_seq_len or model_len
        self.cache = KVCache.for_model(model, batch_size, self.max_seq_len + spare_slots)
        # What the per-step forwards call: the policy itself, or its compiled whole-cache forward
        self.compiled = compile_rollouts(compile, next(model.parameters()).device)
        self.forward = CompiledCacheForward(model, self.cache) if self.compiled else model

    @property
    def capacity(self) -> int:
        """Longest sequence (prompt + response) a row may reach."""
        return self.max_seq_len

    def check_prompts(self, prompts: list[list[int]]) -> None:
        """ValueError for an empty prompt, a token outside the vocabulary, or a prompt that leaves
        no room in the cache for a response token."""
        vocab = self.model.config.vocab_size
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty: a prompt needs at least one token (BOS)")
            if len(p) + 1 > self.capacity:
                raise ValueError(
                    f"prompt {i} has {len(p)} tokens but the KV cache holds {self.capacity} "
                    f"(model.max_seq_len={self.model.config.max_seq_len}): prompts may have at most "
                    f"{self.capacity - 1} tokens, leaving room for one response token")
            if min(p) < 0 or max(p) >= vocab:
                raise ValueError(f"prompt {i} has a token id outside [0, model.vocab_size={vocab})")

    #: the most random numbers a row draws per token it emits (`PromptStreams` sizes by it)
    draws_per_token = 1

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, *,
                 generator: torch.Generator | None = None, seeds: list[int] | None = None,
                 progress: bool = False, response_lengths: list[int] | None = None,
                 on_answer: Callable[[Completion], None] | None = None) -> GenerationResult:
        """Answer every prompt once; completions in prompt order.

        Randomness: with ``seeds`` (one per prompt), every row draws from its own prompt's stream
        (`PromptStreams`): its tokens do not depend on the batch it shares or on its slot.
        Otherwise from ``generator``, reproducible given its state and the batch size (the batch
        size decides which random numbers each row draws); it must live on the model's device.

        response_lengths (plain engine only): each prompt's response runs exactly this many tokens,
        stop ids ignored. The rollout benchmark times plain decoding on another method's response
        lengths with it: a step's cost depends on the rows' lengths, not on the tokens drawn, so
        this is what plain decoding would have taken for those very responses.

        on_answer: called with each completion as it finishes (in finishing order), e.g. to keep
        it on disk before the whole call returns (`cospec.draft.answer_store`).
        """
        self.check_prompts(prompts)
        if response_lengths is not None:
            self._check_response_lengths(response_lengths, prompts, sampling)
        streams = None
        if seeds is not None:
            if len(seeds) != len(prompts):
                raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts: give one per prompt")
            streams = PromptStreams(seeds, self.batch_size,
                                    self.draws_per_token * sampling.max_new_tokens + 1,
                                    self.cache.lengths_B.device)
            generator = streams
        start = time.perf_counter()
        with torch.inference_mode(), progress_bar(progress, len(prompts), "generating") as tick:
            def finished(row: Completion) -> None:
                tick()
                if on_answer is not None:
                    on_answer(row)

            replay = {} if response_lengths is None else {"response_lengths": response_lengths}
            done, num_forwards = self._run(prompts, sampling, generator, finished, **replay)
            if streams is not None:
                streams.check_bound()
        seconds = time.perf_counter() - start
        num_tokens = sum(len(c.tokens) for c in done)
        return GenerationResult(completions=done, num_tokens=num_tokens, num_forwards=num_forwards,
                                seconds=seconds, tokens_per_second=num_tokens / max(seconds, 1e-9))

    def _check_response_lengths(self, lengths: list[int], prompts: list[list[int]],
                                sampling: SamplingConfig) -> None:
        if len(lengths) != len(prompts):
            raise ValueError(f"{len(lengths)} response lengths for {len(prompts)} prompts")
        for i, (n, p) in enumerate(zip(lengths, prompts)):
            room = min(sampling.max_new_tokens, self.capacity - len(p))
            if not 1 <= n <= room:
                raise ValueError(f"response length {n} of prompt {i} is outside [1, {room}] "
                                 f"(sampling.max_new_tokens={sampling.max_new_tokens}, or the "
                                 "cache's room after the prompt)")

    def _run(self, prompts, sampling, generator, on_finish,
             response_lengths: list[int] | None = None) -> tuple[list[Completion], int]:
        device = self.cache.lengths_B.device
        stop_ids = self.stop_ids if response_lengths is None else frozenset()
        queue = deque(range(len(prompts)))
        slots: list[Completion | None] = [None] * self.batch_size
        done: list[Completion | None] = [None] * len(prompts)
        last_B = torch.zeros(self.batch_size, dtype=torch.long, device=device)
        self.num_forwards = 0

        def record(rows: list[int], ids_N: Tensor, logprobs_N: Tensor) -> None:
            # The step's one device sync: the host must see the tokens to spot EOS and free slots.
            ids, logprobs = (sum(x, []) for x in host_rows(ids_N[:, None], logprobs_N[:, None]))
            check_logprobs_finite(logprobs, self.num_forwards)
            for slot, tok, lp in zip(rows, ids, logprobs):
                row = slots[slot]
                budget = (sampling.max_new_tokens if response_lengths is None
                          else response_lengths[row.index])
                if append_until_finished(row, [tok], [lp], max_new_tokens=budget,
                                         capacity=self.capacity, stop_ids=stop_ids):
                    done[row.index], slots[slot] = row, None
                    on_finish(row)

        while queue or any(s is not None for s in slots):
            free = [s for s, row in enumerate(slots) if row is None][:len(queue)]
            if free:  # 1. refill
                for s in free:
                    i = queue.popleft()
                    slots[s] = Completion(index=i, prompt=list(prompts[i]))
                rows_N = torch.tensor(free, device=device)
                bind_streams(generator, rows_N, free, [slots[s].index for s in free])
                self.cache.expect_longest(0)  # the rows are emptied first
                logits_NV, _ = prefill_slots(self.forward, self.cache, rows_N,
                                             [slots[s].prompt for s in free])
                self.num_forwards += 1
                ids_N, logprobs_N = sample_tokens(logits_NV, sampling, generator)
                last_B[rows_N] = ids_N
                record(free, ids_N, logprobs_N)  # a row may finish on its first token
            active = [s for s, row in enumerate(slots) if row is not None]
            if not active:
                continue
            if len(active) == self.batch_size:  # 2. decode: whole cache, no gather
                rows_N, last_N = None, last_B
            else:  # tail: only the active rows
                rows_N = torch.tensor(active, device=device)
                last_N = last_B[rows_N]
            # a row's cache holds its prompt and every response token but the last sampled one
            self.cache.expect_longest(max(len(slots[s].prompt) + len(slots[s].tokens) - 1
                                          for s in active))
            logits_NV = decode_step(self.forward, self.cache, last_N, rows_N)
            self.num_forwards += 1
            bind_streams(generator, rows_N)
            ids_N, logprobs_N = sample_tokens(logits_NV, sampling, generator)
            if rows_N is None:
                last_B.copy_(ids_N)
            else:
                last_B[rows_N] = ids_N
            record(active, ids_N, logprobs_N)  # 3. record
        return done, self.num_forwards


def bind_streams(generator, rows_N: Tensor | None, new_slots: list[int] | None = None,
                 prompt_indices: list[int] | None = None) -> None:
    """With per-prompt streams: restart the streams of ``new_slots`` for their prompts, then bind
    the drawing rows (``rows_N``; None: every slot). Nothing for a `torch.Generator`."""
    if not isinstance(generator, PromptStreams):
        return
    if new_slots:
        generator.assign(new_slots, prompt_indices)
    generator.bind(rows_N)
