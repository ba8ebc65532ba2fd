"""What a speculative `generate` call reports: `SpeculationStats` and `SpeculativeResult`."""

from __future__ import annotations

from dataclasses import dataclass, field

from cospec.rollout.engine import GenerationResult


@dataclass
class SpeculationStats:
    """Counts over one `generate` call.

    accept_length (tau): tokens produced per row per policy decode forward (prefills excluded;
        a step at G = 0 produces 1); counts all k+1 tokens of a step, also those a finishing row
        drops. per_row_steps / per_row_tokens: each completion's steps and those tokens, in
        prompt order; a group's tau is its tokens over its steps (`pooled_accept_length`), as
        the overall one is, not the mean of its rows' ratios (which weighs a short row's few
        steps as much as a long row's many). per_row_accept_length: each completion's own ratio.
    acceptance_by_position[j]: P(draft position j+1 accepted | positions <= j accepted).
    per_row_judged / per_row_accepted: drafted tokens of each completion that the policy judged
        (those up to the first rejection) and accepted; their ratio is the row's acceptance.
    gamma_counts: steps taken at each gamma. Seconds: draft calls, verify forwards (or plain decode
    forwards at G = 0), and everything else (prefill, sampling, bookkeeping).
    seconds_by_gamma: whole steps' seconds (draft, verify and bookkeeping; refills excluded) by
        the gamma chosen for them. switch_on_steps / switch_on_seconds: of the drafting steps,
        those that followed a step at G = 0 of the same call; their catch-up reads every entry the
        plain steps before them left unseen (the price of switching speculation on).
        draft_prefill_seconds: the draft's prefill of rows it had not seen (inside draft_seconds).
    plain_decode_estimate_seconds: what plain decoding of the same tokens would have cost by the
        cost model (each step's tau rows-tokens at verify(N, 1) per token); None without a cost model.
    overshoot_by_position[j], over the drafted tokens x at position j+1 of every overshoot_every-th
        drafting step (p, q as sampled):
        log_q_over_p = mean log q(x) - log p(x) (p floored at 1e-12), frac_q_above_p = share with
        q(x) > p(x), mass = mean sum_v max(0, q(v) - p(v)) (= TV(p, q) = 1 - acceptance probability).
    """

    row_steps: int = 0
    step_tokens: int = 0
    reached: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    gamma_counts: dict[int, int] = field(default_factory=dict)
    per_row_steps: list[int] = field(default_factory=list)
    per_row_tokens: list[int] = field(default_factory=list)
    per_row_judged: list[int] = field(default_factory=list)
    per_row_accepted: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    other_seconds: float = 0.0
    seconds_by_gamma: dict[int, float] = field(default_factory=dict)
    switch_on_steps: int = 0
    switch_on_seconds: float = 0.0
    draft_prefill_seconds: float = 0.0
    _last_gamma: int | None = field(default=None, repr=False)  # the call's previous step's
    plain_decode_estimate_seconds: float | None = None
    overshoot_by_position: list[dict] = field(default_factory=list)

    def add_step(self, gamma: int, ks: list[int], row_counts: list[list[int]]) -> None:
        """One step at `gamma` in which row i accepted ks[i] drafts; row_counts[i], that row's
        [steps, tokens, drafts judged, drafts accepted], is updated in place."""
        self.gamma_counts[gamma] = self.gamma_counts.get(gamma, 0) + 1
        self.row_steps += len(ks)
        self.step_tokens += sum(ks) + len(ks)
        for k, counts in zip(ks, row_counts):
            judged = min(k + 1, gamma)  # drafts up to the first rejection
            counts[0] += 1
            counts[1] += k + 1
            counts[2] += judged
            counts[3] += k
            for j in range(judged):
                self.reached[j] += 1
                self.accepted[j] += j < k

    def add_step_seconds(self, gamma: int, seconds: float) -> None:
        """A whole step at `gamma` took `seconds` (steps in order: one after a plain step that
        drafts switched drafting on)."""
        self.seconds_by_gamma[gamma] = self.seconds_by_gamma.get(gamma, 0.0) + seconds
        switched_on, self._last_gamma = gamma > 0 and self._last_gamma == 0, gamma
        if switched_on:
            self.switch_on_steps += 1
            self.switch_on_seconds += seconds

    def set_rows(self, row_counts: list[list[int]]) -> None:
        """The per-row figures from each completion's counts (`add_step`), in prompt order."""
        self.per_row_steps = [c[0] for c in row_counts]
        self.per_row_tokens = [c[1] for c in row_counts]
        self.per_row_judged = [c[2] for c in row_counts]
        self.per_row_accepted = [c[3] for c in row_counts]

    def set_overshoot(self, sums: list[list[float]]) -> None:
        """overshoot_by_position from sums [log q/p, q > p, mass, count] x draft position."""
        self.overshoot_by_position = [
            {"log_q_over_p": lq / n, "frac_q_above_p": above / n, "mass": mass / n} if n else {}
            for lq, above, mass, n in zip(*sums)]

    @property
    def accept_length(self) -> float:
        return self.step_tokens / max(self.row_steps, 1)

    @property
    def per_row_accept_length(self) -> list[float]:
        return [tokens / max(steps, 1) for tokens, steps in zip(self.per_row_tokens, self.per_row_steps)]

    def pooled_accept_length(self, rows) -> float:
        """tau of the completions ``rows`` (indices in prompt order) together: their tokens over
        their steps (nan where they took no step)."""
        return _pooled(self.per_row_tokens, self.per_row_steps, rows)

    def pooled_acceptance(self, rows) -> float:
        """Acceptance of the completions ``rows`` together: their drafts accepted over their
        drafts judged (nan where none was judged)."""
        return _pooled(self.per_row_accepted, self.per_row_judged, rows)

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / r if r else float("nan") for a, r in zip(self.accepted, self.reached)]


@dataclass
class SpeculativeResult(GenerationResult):
    stats: SpeculationStats = field(default_factory=SpeculationStats)


def _pooled(numerators: list[int], denominators: list[int], rows) -> float:
    den = sum(denominators[i] for i in rows)
    return sum(numerators[i] for i in rows) / den if den else float("nan")
