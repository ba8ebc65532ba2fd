"""Calibration of the adaptive controller's cost model: measured verify and draft forwards.

# N rows, T tokens (entries) per row, G = gamma, B batch size

Before a speculative engine first generates with an adaptive controller, `calibrate` times
verify(N, T) and draft(N, T) for T = 1..G+1 at N = 1, 2, 4, .. and B on dummy tokens (draft
calls also at T = 16 and 64, the catch-up of a drafting step after plain ones), so that the
controller's first choices rest on measurements (`cospec.rollout.adaptive`); the online averages
refine the table during generation. `synced_time` is the clock both this and the engine's step
timing read.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from cospec.config import SamplingConfig
from cospec.rollout.engine import score_tokens
from cospec.rollout.sampling import probs_from_logits, sample


def synced_time(like: Tensor) -> float:
    """Wall time; on CUDA after a device sync, so phases are timed, not their launches."""
    if like.is_cuda:
        torch.cuda.synchronize(like.device)
    return time.perf_counter()


@torch.inference_mode()
def calibrate(engine, *, context: int = 32, repeats: int = 2) -> None:
    """Measure verify(N, T) and draft(N, T) for T = 1..G+1 at N = 1, 2, 4, .. and the batch size,
    into the engine controller's cost model (the online averages refine it during generation).
    engine: a `SpeculativeEngine` with a controller. Uses the engine's own caches on dummy tokens
    and leaves them empty."""
    cost, B, G = engine.controller.cost, engine.batch_size, engine.gamma
    device = engine.seq_BS.device
    sizes = sorted({min(2 ** i, B) for i in range(B.bit_length() + 1)})
    context = min(context, engine.capacity - 1)
    scratch_rng = torch.Generator(device=device).manual_seed(0)  # leaves the global RNG alone
    for N in sizes:
        rows_t = None if N == B else torch.arange(N, device=device)
        for T in range(1, G + 2):
            best = float("inf")
            for _ in range(repeats + 1):  # the first call warms up
                engine.cache.reset()
                engine.cache.advance(context)
                t0 = synced_time(engine.seq_BS)
                logits = score_tokens(engine.forward, engine.cache, torch.full((N, T), 4, device=device),
                                      rows_t).logits
                # What a step does with the logits, roughly: warp and draw at all N * T positions,
                # then the host reads the results (the step's sync).
                sample(probs_from_logits(logits.reshape(N * T, -1), 1.0), scratch_rng).tolist()
                best = min(best, synced_time(engine.seq_BS) - t0)
            cost.observe_verify(N, T, best)
        for T in draft_widths(G, engine.capacity - context):
            best = float("inf")
            stored = (None if engine.feat_BSF is None
                      else torch.zeros(N, T, engine.feat_BSF.shape[-1], device=device,
                                       dtype=engine.feat_BSF.dtype))
            for _ in range(repeats + 1):
                engine.draft_cache.reset()
                engine.draft_cache.advance(context)
                t0 = synced_time(engine.seq_BS)
                # as a catch-up call: the stored features projected, then the draft's forward
                if engine.drafter.parallel:  # a block drafter's catch-up writes context only
                    engine.drafter.add_context(engine.draft_cache, engine.drafter.project(stored),
                                               rows_t, T)
                else:
                    # the head at the last entry only, as a catch-up (T = 1: a one-entry step)
                    last = {} if T == 1 else {"logits_positions_N": torch.full((N,), T - 1,
                                                                               device=device)}
                    logits, _ = engine.drafter(engine.draft_cache,
                                               torch.full((N, T), 4, device=device),
                                               engine.drafter.project(stored), rows_t, **last)
                    sample(probs_from_logits(logits[:, -1], 1.0), scratch_rng)  # a step's draw
                best = min(best, synced_time(engine.seq_BS) - t0)
            cost.observe_draft(N, T, best)
        if engine.drafter.parallel:
            _calibrate_block(engine, N, rows_t, context, repeats, scratch_rng)
    engine.cache.reset()
    engine.draft_cache.reset()


def draft_widths(gamma: int, room: int) -> list[int]:
    """The draft call widths calibrated: 1..G+1 (a step's catch-up and single-entry calls), then
    16 and 64 entries (a switch-on's catch-up over plain steps; linear in between), those that fit
    ``room``."""
    wide = [w for w in (16, 64) if w > gamma + 1]
    return [w for w in list(range(1, gamma + 2)) + wide if w <= room]


def _calibrate_block(engine, N, rows_t, context, repeats, generator) -> None:
    """block(N, G) for G = 1..gamma: one block forward and its heads' draws."""
    device = engine.seq_BS.device
    sampling = SamplingConfig(temperature=1.0)
    for G in range(1, engine.gamma + 1):
        best = float("inf")
        for _ in range(repeats + 1):
            engine.draft_cache.reset()
            engine.draft_cache.advance(context)
            t0 = synced_time(engine.seq_BS)
            engine.drafter.draft(engine.draft_cache, torch.full((N,), 4, device=device), G, rows_t,
                                 sampling, generator)
            best = min(best, synced_time(engine.seq_BS) - t0)
        engine.controller.cost.observe_block(N, G, best)
