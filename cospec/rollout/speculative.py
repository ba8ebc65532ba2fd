"""Batched lossless speculative generation with continuous batching.

# B cache rows (slots), N rows in a step, G drafted tokens (gamma), W catch-up entries, V vocab,
# F feature width, S history length

Per step, for the N active rows (a ragged batch: rows have their own lengths):
1. draft (catch-up): feed each row every entry its draft has not seen (`cospec.rollout.drafter`:
   entry t = token s_t + the policy feature of position t-1) in one ragged call; its last entry's
   logits give q_1; sample x_1 ~ q_1. Then G-1 single-entry steps give x_2..x_G, each on the draft's
   own previous hidden (EAGLE-3). The draft's cache is then rolled back to the committed entries.
   A block drafter (`cospec.rollout.drafter.BlockDrafter`) instead writes only context in the
   catch-up and proposes all G tokens in one forward; with the adaptive controller and its
   confidence head the block is then cut to the verify length the confidences make best.
2. verify: ONE policy forward of [s_n, x_1..x_G] for all N rows (G+1 tokens each), which also
   returns the tapped features the draft's next catch-up reads (no extra policy forward).
3. accept: `verify_drafts` (Leviathan et al. / Chen et al.) per row: k accepted, one more token drawn;
   the policy cache rolls back per row to keep s_n, x_1..x_k.
4. record: the k+1 tokens with their policy logprobs are appended; finished rows free their slot and
   queued prompts refill it (prefill, as the plain engine does, then a draft prefill of the new
   rows' prompt entries in a call of their own, so that no step's catch-up is as wide as a prompt).
With G = 0 (the adaptive controller's choice, `cospec.rollout.adaptive`) a step is plain decoding:
one policy forward of 1 token per row, no draft call; the draft catches up when drafting resumes.

Per-slot state: ``seq_BS`` the row's tokens (prompt + response; seq[n] is the pending token, sampled
but not yet fed to the policy), ``feat_BSF`` the draft feature of each entry (feat[t] = the policy's
taps at position t-1 side by side, projected by the draft only when an entry is fed to it;
feat[0] = 0), host-side ``n`` (policy cache length) and ``e`` (entries in the draft's cache).
Caches get G spare slots beyond the capacity (the verify forward writes up to G+1 tokens past the
committed length); the draft's cache is twice as long, since a ragged catch-up writes padding
past short rows.

Outputs are the plain engine's `Completion`s (tokens, policy logprobs under the sampling
distribution, finish reasons) plus `SpeculationStats`.
"""

from __future__ import annotations

from collections import deque
from typing import Collection

import torch

from cospec.config import SamplingConfig
from cospec.data.tokenizer import EOS
from cospec.models.integrity import NonFiniteError
from cospec.rollout.adaptive import AdaptiveGamma
from cospec.rollout.calibration import calibrate, synced_time
from cospec.rollout.compiled_forward import CompiledCacheForward, graphs_called
from cospec.rollout.drafter import make_drafter
from cospec.rollout.engine import (Completion, GenerationEngine, append_until_finished,
                                   bind_streams, check_logprobs_finite, host_rows, prefill_slots,
                                   score_tokens)
from cospec.rollout.sampling import (SamplingDistribution, probs_from_logits, sample,
                                     sample_tokens)
from cospec.rollout.speculation_stats import SpeculationStats, SpeculativeResult
from cospec.rollout.verify import (DenseProbs, HeadProbs, head_index, nonfinite_message,
                                   overshoot_sums, verify_drafts)


class SpeculativeEngine(GenerationEngine):
    """Continuous-batching speculative generation: same contract as `GenerationEngine.generate`.

    draft: an `Eagle3Draft`, a standalone draft LM (`Transformer`), or any drafter
        (`cospec.rollout.drafter`); vocab (and for EAGLE-3 hidden size) must match the policy.
    gamma: drafted tokens per step (fixed), or the most the adaptive controller may pick.
    adaptive: pick gamma per step (`AdaptiveGamma`); ``controller`` may be given to share a cost
        model and acceptance estimate across engines or runs. Costs are calibrated on first use
        (`cospec.rollout.calibration`).
    overshoot_every: the overshoot diagnostics (`SpeculationStats.overshoot_by_position`) sum
        every this many drafting steps: they read q and p over the whole vocabulary, 3 passes
        over [N, G, V] floats, which at batch 64 and a 49K vocabulary is most of a step's
        sampling work.
    compile: as `GenerationEngine`'s: verification and the EAGLE-3 / draft-LM one-token steps
        compiled; the draft's catch-up (ragged widths) and a block draft's forwards stay eager.
    """

    def __init__(self, model, draft, *, batch_size: int, gamma: int = 4, adaptive: bool = False,
                 max_seq_len: int | None = None, stop_ids: Collection[int] | None = (EOS,),
                 controller: AdaptiveGamma | None = None, probe_every: int = 16,
                 overshoot_every: int = 1, compile: bool | None = False):
        if gamma < 1:
            raise ValueError(f"gamma must be >= 1 (drafted tokens per step), got {gamma}")
        # Spare slots: room for the G+1 tokens a verify writes past the committed length.
        super().__init__(model, batch_size=batch_size, max_seq_len=max_seq_len, stop_ids=stop_ids,
                         spare_slots=gamma, compile=compile)
        self.drafter = make_drafter(draft, model.config)
        # The policy ids of a reduced draft head's columns (None: the head covers the vocabulary)
        self.draft_vocab_ids = ids = getattr(self.drafter, "vocab_ids", None)
        self.head_index_V = None if ids is None else head_index(ids, model.config.vocab_size)
        if overshoot_every < 1:
            raise ValueError(f"overshoot_every must be >= 1, got {overshoot_every}")
        self.gamma, self.overshoot_every = gamma, overshoot_every
        self.draft_cache = self.drafter.new_cache(batch_size, 2 * (self.capacity + gamma))
        if self.compiled and not self.drafter.parallel and hasattr(self.drafter, "forward"):
            self.drafter.forward = CompiledCacheForward(self.drafter.model, self.draft_cache)
        self.controller = controller or (AdaptiveGamma(gamma, probe_every=probe_every)
                                         if adaptive else None)
        if self.controller is not None:
            self.controller.block_drafter = self.drafter.parallel
        if self.controller is not None and self.controller.gamma_max != gamma:
            raise ValueError(f"controller.gamma_max={self.controller.gamma_max} != gamma={gamma}")
        device = self.cache.lengths_B.device
        history = self.capacity + gamma + 1
        self.seq_BS = torch.zeros(batch_size, history, dtype=torch.long, device=device)
        self.all_rows_B = torch.arange(batch_size, device=device)
        F, dtype = self.drafter.feature_size, next(model.parameters()).dtype
        self.feat_BSF = torch.zeros(batch_size, history, F, dtype=dtype, device=device) if F else None
        self._calibrated = False

    @property
    def draws_per_token(self) -> int:
        """A step draws at most gamma drafts, gamma acceptance tests and one token, and emits >= 1."""
        return 2 * self.gamma + 1

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, *,
                 generator: torch.Generator | None = None, seeds: list[int] | None = None,
                 progress: bool = False, on_answer=None) -> SpeculativeResult:
        """As `GenerationEngine.generate`, plus ``stats`` (`SpeculationStats`)."""
        if self.controller is not None and not self._calibrated:
            calibrate(self)
            self._calibrated = True
        self.stats = SpeculationStats(reached=[0] * self.gamma, accepted=[0] * self.gamma)
        if self.controller is not None:
            self.stats.plain_decode_estimate_seconds = 0.0
            self.controller.start_call()
        # Overshoot sums per draft position, kept on the device: [log q/p, q > p, mass, count].
        self._overshoot = torch.zeros(4, self.gamma, dtype=torch.float64, device=self.seq_BS.device)
        self._steps_drafted = 0
        result = super().generate(prompts, sampling, generator=generator, seeds=seeds,
                                  progress=progress, on_answer=on_answer)
        self.stats.set_overshoot(self._overshoot.tolist())
        return SpeculativeResult(**vars(result), stats=self.stats)

    # ------------------------------------------------------------------------- the loop

    def _run(self, prompts, sampling, generator, on_finish) -> tuple[list[Completion], int]:
        queue = deque(range(len(prompts)))
        self.slots: list[Completion | None] = [None] * self.batch_size
        self.n = [0] * self.batch_size
        self.e = [0] * self.batch_size
        self.row_counts: dict[int, list[int]] = {}  # prompt index -> see _refill
        done: list[Completion | None] = [None] * len(prompts)
        self.num_forwards = 0
        while queue or any(s is not None for s in self.slots):
            free = [s for s, row in enumerate(self.slots) if row is None][:len(queue)]
            if free:
                t_refill = synced_time(self.seq_BS)
                self._refill(free, [queue.popleft() for _ in free], prompts, sampling, generator,
                             done, on_finish)
                self.num_forwards += 1
                self.stats.other_seconds += synced_time(self.seq_BS) - t_refill
            active = [s for s, row in enumerate(self.slots) if row is not None]
            if not active:
                continue
            # The step's own time (no refill: prefill cost does not depend on gamma, and counting
            # it would make every gamma look alike to the controller).
            t0 = synced_time(self.seq_BS)
            gamma = self.gamma if self.controller is None else self.controller.choose(  # with the
                len(active), max(self.n[s] - self.e[s] + 1 for s in active))  # widest catch-up
            self._graphs_before = graphs_called(self)
            draft_s, verify_s = self._step(active, gamma, sampling, generator, done, on_finish)
            self.num_forwards += 1
            step_s = synced_time(self.seq_BS) - t0
            other_s = step_s - draft_s - verify_s
            self.stats.add_step_seconds(gamma, step_s)
            self.stats.draft_seconds += draft_s
            self.stats.verify_seconds += verify_s
            self.stats.other_seconds += other_s
            if self.controller is not None and self._step_timed:
                # The step's sampling, acceptance test and bookkeeping grow with gamma too: they
                # count as part of the verify cost of (N, gamma + 1); and the whole step is seen.
                self.controller.cost.observe_verify(len(active), gamma + 1, verify_s + other_s)
                self.controller.observe_step(len(active), gamma, draft_s + verify_s + other_s,
                                             self._emitted, self._kept)
        self.stats.set_rows([self.row_counts[i] for i in range(len(prompts))])
        return done, self.num_forwards

    def _refill(self, free, indices, prompts, sampling, generator, done, on_finish) -> None:
        """Prefill prompts into free slots; their first token is sampled from the prefill."""
        device = self.seq_BS.device
        for s, i in zip(free, indices):
            self.slots[s] = Completion(index=i, prompt=list(prompts[i]))
            self.row_counts[i] = [0, 0, 0, 0]  # steps, tokens, drafts judged, drafts accepted
        rows_N = torch.tensor(free, device=device)
        bind_streams(generator, rows_N, free, indices)
        self.cache.expect_longest(0)  # the rows are emptied first
        logits_NV, out = prefill_slots(self.forward, self.cache, rows_N,
                                       [self.slots[s].prompt for s in free],
                                       tap_layers=self.drafter.tap_layers)
        ids_N, logprobs_N = sample_tokens(logits_NV, sampling, generator)
        lengths = [len(self.slots[s].prompt) for s in free]
        P = max(lengths)
        self.seq_BS[rows_N, :P] = torch.stack([torch.tensor(self.slots[s].prompt + [0] * (P - n))
                                               for s, n in zip(free, lengths)]).to(device)
        lengths_N = torch.tensor(lengths, device=device)
        self.seq_BS[rows_N, lengths_N] = ids_N
        if self.feat_BSF is not None:
            self.feat_BSF[rows_N, 0] = 0
            self.feat_BSF[rows_N, 1:P + 1] = self.drafter.features(out.taps).to(self.feat_BSF.dtype)
        self.draft_cache.reset(rows_N)
        for s, n in zip(free, lengths):  # the draft has seen none of the row: `_draft_prefill`
            self.n[s], self.e[s] = n, 0
        ids, lps = host_rows(ids_N[:, None], logprobs_N[:, None])  # the refill's one host read
        self._record(free, ids, lps, sampling, done, on_finish)

    def _step(self, active, gamma, sampling, generator, done, on_finish) -> tuple[float, float]:
        """One decode step of the active slots at `gamma`; returns (draft, verify) seconds."""
        device = self.seq_BS.device
        rows_t = None if len(active) == self.batch_size else torch.tensor(active, device=device)
        rows_N = self.all_rows_B if rows_t is None else rows_t
        # n of each row is its policy cache length: read there, no host-to-device copy
        n_N = self.cache.lengths_B.clone() if rows_t is None else self.cache.lengths_B[rows_t]
        bind_streams(generator, rows_N)
        t0 = synced_time(self.seq_BS)
        self._drafted = 0  # tokens the draft proposed this step
        if gamma > 0:
            draft_NG, q = self._draft(active, rows_t, rows_N, n_N, gamma, sampling, generator)
            gamma = draft_NG.shape[1]  # the verify length: a block's confidence may cut it
        t1 = synced_time(self.seq_BS)
        if gamma == 0:  # plain decoding: chosen, or a block's confidences cut every draft
            return t1 - t0, self._plain_step(active, rows_t, rows_N, n_N, sampling, generator,
                                             done, on_finish)
        tokens_NT = torch.cat([self.seq_BS[rows_N, n_N][:, None], draft_NG], 1)
        self.cache.expect_longest(max(self.n[s] for s in active))
        out = score_tokens(self.forward, self.cache, tokens_NT, rows_t,
                           tap_layers=self.drafter.tap_layers)
        t2 = synced_time(self.seq_BS)
        dist = SamplingDistribution(out.logits, sampling)  # warped once
        verdict = verify_drafts(dist, q, draft_NG, generator, check=False)
        self._steps_drafted += 1
        if self._steps_drafted % self.overshoot_every == 0:
            self._overshoot[:, :gamma] += overshoot_sums(dist.probs[:, :gamma], q.probs, draft_NG)
        num_accepted, emitted_NT = verdict.num_accepted, verdict.tokens
        logprobs_NT = dist.logprobs(emitted_NT)
        # Histories: tokens at n+1.., the features of positions n.. at entries n+1..
        cols_NT = n_N[:, None] + 1 + torch.arange(gamma + 1, device=device)
        self.seq_BS[rows_N[:, None], cols_NT] = emitted_NT
        if self.feat_BSF is not None:
            self.feat_BSF[rows_N[:, None], cols_NT] = self.drafter.features(out.taps).to(
                self.feat_BSF.dtype)
        self.cache.truncate(n_N + 1 + num_accepted, rows_t)  # keep s_n and the accepted drafts
        # The step's one host read: the counts, tokens and logprobs to record, and the finiteness
        # verdict, in one copy.
        emitted, lps, ks, (nonfinite,) = host_rows(emitted_NT, logprobs_NT, num_accepted[:, None],
                                                   verdict.nonfinite.view(1, 1))
        ks, nonfinite = [k for (k,) in ks], nonfinite[0]
        if nonfinite:
            raise NonFiniteError(nonfinite_message(nonfinite, (
                f"policy forward {self.num_forwards + 1} of this generate call (gamma {gamma}, "
                f"draft: {type(self.drafter).__name__})")))
        self._account(active, gamma, ks)
        for s, k in zip(active, ks):
            self.n[s] += k + 1
        self._record(active, [row[:k + 1] for row, k in zip(emitted, ks)],
                     [row[:k + 1] for row, k in zip(lps, ks)], sampling, done, on_finish)
        return t1 - t0, t2 - t1

    def _plain_step(self, active, rows_t, rows_N, n_N, sampling, generator, done,
                    on_finish) -> float:
        """A step at G = 0: the plain engine's (one token per row, the same draw from the same
        generator, one host read), plus the histories a later drafting step reads (the token and
        the forward's taps); no draft call, no rollback. Returns the forward's seconds."""
        t0 = synced_time(self.seq_BS)
        self.cache.expect_longest(max(self.n[s] for s in active))
        out = score_tokens(self.forward, self.cache, self.seq_BS[rows_N, n_N][:, None], rows_t,
                           tap_layers=self.drafter.tap_layers)
        t1 = synced_time(self.seq_BS)
        ids_N, logprobs_N = sample_tokens(out.logits[:, 0], sampling, generator)
        self.seq_BS[rows_N, n_N + 1] = ids_N
        if self.feat_BSF is not None:
            self.feat_BSF[rows_N, n_N + 1] = self.drafter.features(out.taps)[:, 0].to(
                self.feat_BSF.dtype)
        ids, lps = host_rows(ids_N[:, None], logprobs_N[:, None])
        self._account(active, 0, [0] * len(active))
        for s in active:
            self.n[s] += 1
        self._record(active, ids, lps, sampling, done, on_finish)
        return t1 - t0

    def _draft_prefill(self, rows: list[int]) -> None:
        """Feed the draft every entry but the pending one of rows it has not seen at all (new
        rows), in a call of their own: not at refill, so that steps at gamma 0 are the plain
        engine's steps (no draft work for rows that may never be drafted for), and not in the
        catch-up, which is padded to its widest row (a prompt there would make every row pay)."""
        device, t0 = self.seq_BS.device, synced_time(self.seq_BS)
        rows_N = torch.tensor(rows, device=device)
        lengths_N = torch.tensor([self.n[s] for s in rows], device=device)
        P = max(self.n[s] for s in rows)
        idx_NP = torch.minimum(torch.arange(P, device=device)[None], lengths_N[:, None] - 1)
        feats = (None if self.feat_BSF is None
                 else self.drafter.project(self.feat_BSF[rows_N[:, None], idx_NP]))
        self.draft_cache.expect_longest(0)  # the rows were emptied at refill
        if self.drafter.parallel:
            self.drafter.add_context(self.draft_cache, feats, rows_N, lengths_N)
        else:
            self.drafter(self.draft_cache, self.seq_BS[rows_N[:, None], idx_NP], feats, rows_N,
                         lengths_N, logits_positions_N=lengths_N - 1)  # logits unused: one a row
        for s in rows:
            self.e[s] = self.n[s]
        self.stats.draft_prefill_seconds += synced_time(self.seq_BS) - t0

    def _draft(self, active, rows_t, rows_N, n_N, gamma, sampling, generator):
        """Catch the draft up on every unseen entry, then draft `gamma` tokens per row.
        Returns (drafts long [N, G] in policy ids, q: `DenseProbs` or `HeadProbs` [N, G, V])."""
        device = self.seq_BS.device
        unseen = [s for s in active if self.e[s] == 0]
        if unseen:  # a one-off per row, like the refill's prefill (not a cost of the step)
            self._draft_prefill(unseen)
        e_N = torch.tensor([self.e[s] for s in active], device=device)
        width_N = n_N - e_N + 1  # entries e..n, n being the pending token's
        W = max(self.n[s] - self.e[s] + 1 for s in active)
        self._draft_start, self._catch_up_width = synced_time(self.seq_BS), W
        idx_NW = torch.minimum(e_N[:, None] + torch.arange(W, device=device), n_N[:, None])
        feats = (None if self.feat_BSF is None
                 else self.drafter.project(self.feat_BSF[rows_N[:, None], idx_NW]))
        self.draft_cache.expect_longest(max(self.e[s] for s in active))
        self._drafted = gamma
        if self.drafter.parallel:
            return self._draft_block(active, rows_t, rows_N, n_N, width_N, feats, gamma, sampling,
                                     generator)
        logits, state = self.drafter(self.draft_cache, self.seq_BS[rows_N[:, None], idx_NW], feats,
                                     rows_t, width_N, logits_positions_N=width_N - 1)
        last = torch.arange(len(active), device=device), width_N - 1
        logits_NV, state_NC = logits[:, 0], None if state is None else state[last]
        self._single_steps_start = synced_time(self.seq_BS)  # the catch-up's width varies; steps 2.. do not
        drafts, qs, ids = [], [], self.draft_vocab_ids
        for j in range(gamma):
            # Warped and drawn over the head's columns; the same distribution as over the whole
            # vocabulary with q = 0 off the head (masked ids never enter top-k, carry no top-p
            # mass, and take no width in the inverse CDF).
            q_NV = probs_from_logits(logits_NV, sampling.temperature, sampling.top_k, sampling.top_p)
            x_N = sample(q_NV, generator)
            if ids is not None:
                x_N = ids[x_N]
            drafts.append(x_N)
            qs.append(q_NV)
            if j + 1 < gamma:  # the rows' draft caches hold n + 1 + j entries now
                self.draft_cache.expect_longest(max(self.n[s] for s in active) + 1 + j)
                logits, state = self.drafter(self.draft_cache, x_N[:, None],
                                             None if state_NC is None else state_NC[:, None], rows_t)
                logits_NV, state_NC = logits[:, 0], None if state is None else state[:, 0]
        self._single_steps_end = synced_time(self.seq_BS)
        self.draft_cache.truncate(n_N + 1, rows_t)  # drop the speculative entries
        for s in active:
            self.e[s] = self.n[s] + 1
        q_NGD = torch.stack(qs, 1)
        q = (DenseProbs(q_NGD) if ids is None
             else HeadProbs(q_NGD, ids, self.model.config.vocab_size, self.head_index_V))
        return torch.stack(drafts, 1), q

    def _draft_block(self, active, rows_t, rows_N, n_N, width_N, feats, gamma, sampling,
                     generator):
        """`_draft` for a block drafter: the catch-up writes context only, then one forward
        proposes all gamma tokens; with a controller and a confidence head, the drafts are cut to
        the verify length the confidences make best (`AdaptiveGamma.verify_length`)."""
        self.drafter.add_context(self.draft_cache, feats, rows_t, width_N)
        self._single_steps_start = synced_time(self.seq_BS)
        self.draft_cache.expect_longest(max(self.n[s] for s in active) + 1)
        drafts, q_NGD, conf = self.drafter.draft(self.draft_cache, self.seq_BS[rows_N, n_N], gamma,
                                                 rows_t, sampling, generator)
        self._single_steps_end = synced_time(self.seq_BS)
        for s in active:
            self.e[s] = self.n[s] + 1
        if conf is not None and self.controller is not None:
            # A documented extra host read per drafting step: the confidences decide a shape.
            k = self.controller.verify_length(len(active), conf.tolist(),
                                              self._single_steps_end - self._draft_start)
            drafts, q_NGD = drafts[:, :k], q_NGD[:, :k]
        ids = self.draft_vocab_ids
        q = (DenseProbs(q_NGD) if ids is None
             else HeadProbs(q_NGD, ids, self.model.config.vocab_size, self.head_index_V))
        return drafts, q

    def _account(self, active, gamma, ks) -> None:
        st = self.stats
        st.add_step(gamma, ks, [self.row_counts[self.slots[s].index] for s in active])
        self._emitted = sum(ks) + len(ks)
        self._step_timed = self._graphs_before == graphs_called(self)  # else it timed a compile
        if self.controller is not None:
            plain_step = self.controller.cost.verify_cost(len(active), 1)
            st.plain_decode_estimate_seconds += plain_step * (sum(ks) + len(ks)) / len(ks)
            if self._drafted and self._step_timed:
                self.controller.cost.observe_drafting(
                    len(active), self._catch_up_width, self._drafted, self.drafter.parallel,
                    (self._draft_start, self._single_steps_start, self._single_steps_end))
            if gamma > 0:
                self.controller.observe_acceptance(gamma, ks)

    def _record(self, slots, tokens, logprobs, sampling, done, on_finish) -> None:
        check_logprobs_finite([lp for lps in logprobs for lp in lps], self.num_forwards + 1)
        self._kept = 0  # of the tokens, those appended (none past a row's stop token)
        for s, toks, lps in zip(slots, tokens, logprobs):
            row = self.slots[s]
            self._kept -= len(row.tokens)
            finished = append_until_finished(row, toks, lps, max_new_tokens=sampling.max_new_tokens,
                                             capacity=self.capacity, stop_ids=self.stop_ids)
            self._kept += len(row.tokens)
            if finished:
                done[row.index], self.slots[s] = row, None
                on_finish(row)
