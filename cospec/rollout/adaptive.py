"""Adaptive speculation: pick gamma each step to maximise expected tokens per second.

# N rows in the step, G = gamma (drafted tokens per row), a_j acceptance at draft position j

Expected tokens one row gains from a step with gamma drafts, when draft position j is accepted with
probability a_j given that positions < j were (Leviathan et al. 2211.17192, Eq. 1, generalised from
one rate a to one per position):
    E(G) = 1 + sum_{i=1..G} prod_{j<=i} a_j          (= (1 - a^(G+1)) / (1 - a) when all a_j = a)
and the step costs
    cost(N, G) = verify(N, G + 1) + draft(N, ceil(E(G))) + (G - 1) * draft(N, 1)
(verify(N, T): one policy forward of N rows with T tokens each, with the step's sampling, acceptance
test and bookkeeping, which grow with T too; draft(N, T): one draft call over T entries per row.
A step's first draft call catches the draft up on the tokens the previous step accepted, about E(G)
per row, so it costs like a T = E(G) call; the other G - 1 calls take one entry). The controller picks
    argmax_G  N * E(G) / cost(N, G),   G in 0..gamma_max,
G = 0 being plain decoding (E = 1, no draft). So speculation switches itself off at batch sizes where
verifying G + 1 tokens costs nearly G + 1 decode steps, and back on as the batch drains in the tail.

A block drafter (`cospec.rollout.drafter.BlockDrafter`) drafts all G tokens in one forward, so there
    cost(N, G) = verify(N, G + 1) + draft(N, ceil(E(G))) + block(N, G)
with block(N, G) one block forward and its heads. With its confidence head, the drafted block is
then cut to the verify length k that maximises this step's rate, from the confidences c_{r,i} of
each row r (the head's estimate of a_i for that row):
    argmax_k  sum_r E_r(k) / (spent + verify(N, k + 1)),   k in 0..G,
spent being the drafting time already paid (DSpark's confidence-scheduled verification).

Costs come from `CostModel`: a table of measured seconds per (N, T), filled by a short calibration
(`calibrate` in `cospec.rollout.calibration`; draft calls also as wide as a switch-on's catch-up)
and kept current by an exponential moving average of every step's measured time; N and T between
measured points are interpolated linearly. Acceptance is a
decayed count per position, so it follows a draft that co-training improves; while G = 0 nothing is
measured, so after ``probe_every`` steps at G = 0 the controller drafts once (G = gamma_max), and
after twice as many the next time, up to 16 times as many, while speculation stays off. Mirrored:
while it drafts, plain steps go unmeasured, so after ``probe_every`` drafting steps it takes one
plain step, spaced out the same way while drafting stays on but only up to 4 times as many (a
plain step among drafting ones costs little; a plain cost known wrong keeps speculation on where
it loses).

Whole steps (docs/design.md, "Adaptive gamma on whole steps"). The sum above leaves out what a
speculative step pays besides its forwards: the catch-up is as wide as the step's widest row (not
E(G)), rows refilled while the draft was off are prefilled into it when drafting resumes, and
tokens drafted past a row's stop token are thrown away. So each step's wall time S (choice to
bookkeeping, refills excluded) and its kept tokens K of the E emitted are observed too (S not for
a step that switches drafting on after plain steps: its catch-up over them is the price of
switching, priced in the choice instead: docs/design.md, "Switching speculation on"), and the
choice uses
    rate(N, G) = N * E(G) * f(G) / (cost(N, G) * c(N, G)),
c(N, G) = an exponential moving average of S / cost(N, G) over the steps taken at G with ~N rows
(1 until one is; at an unmeasured G >= 1 the mean of the measured G >= 1 at that N), and
f(G) = decayed sum K / decayed sum E (at an unmeasured G >= 1, pooled over the speculative
steps; 1 at G = 0, where every emitted token is kept). The forwards' table still carries how
costs grow with N and T; the corrections carry what it misses.
"""

from __future__ import annotations

import bisect
import math


class CostModel:
    """Seconds per verify step and per draft call, each by rows N and tokens (entries) per row T.
    ``ema``: weight of a new measurement."""

    def __init__(self, ema: float = 0.2):
        self.ema = ema
        self.verify: dict[int, dict[int, float]] = {}  # T -> {N: seconds}
        self.draft: dict[int, dict[int, float]] = {}  # T -> {N: seconds per draft call}
        self.block: dict[int, dict[int, float]] = {}  # G -> {N: seconds per block forward}

    @staticmethod
    def bucket(n: int) -> int:
        """The power of two nearest to n in log scale: measurements of 60 and of 64 rows feed one
        entry, so every T at a batch size is refined by the same online average (a table keyed by
        exact N would compare online entries, overheads included, with calibrated neighbours)."""
        lo = 1 << (max(n, 1).bit_length() - 1)
        return lo if n * n < 2 * lo * lo else 2 * lo

    def average_into(self, table: dict[int, float], n: int, seconds: float) -> None:
        """table[bucket(n)] <- the moving average with this measurement."""
        n = self.bucket(n)
        old = table.get(n)
        table[n] = seconds if old is None else (1 - self.ema) * old + self.ema * seconds

    def observe_verify(self, n: int, t: int, seconds: float) -> None:
        self.average_into(self.verify.setdefault(t, {}), n, seconds)

    def observe_draft(self, n: int, t: int, seconds: float) -> None:
        self.average_into(self.draft.setdefault(t, {}), n, seconds)

    def observe_block(self, n: int, g: int, seconds: float) -> None:
        self.average_into(self.block.setdefault(g, {}), n, seconds)

    @staticmethod
    def _interpolate(table: dict[int, float], n: int) -> float | None:
        """Linear in N between the nearest measured N on each side; constant past the ends."""
        if not table:
            return None
        if n in table:
            return table[n]
        keys = sorted(table)
        i = bisect.bisect_left(keys, n)
        if i == 0:
            return table[keys[0]]
        if i == len(keys):
            return table[keys[-1]]
        lo, hi = keys[i - 1], keys[i]
        w = (n - lo) / (hi - lo)
        return (1 - w) * table[lo] + w * table[hi]

    def verify_cost(self, n: int, t: int) -> float | None:
        return self._interpolate(self.verify.get(t, {}), n)

    def draft_cost(self, n: int, t: int = 1) -> float | None:
        """A call of t entries per row; between measured t linear in t, past the widest measured
        t along the slope of the two widest (`_by_length`)."""
        return self._by_length(self.draft, n, t)

    def block_cost(self, n: int, g: int) -> float | None:
        """A block forward of g positions (and its heads); past the longest measured, linear."""
        return self._by_length(self.block, n, g)

    def draft_step_cost(self, n: int, gamma: int, catch_up: int, block: bool) -> float | None:
        """A drafting step of n rows: the catch-up call of `catch_up` entries, then gamma - 1
        single-entry calls (autoregressive) or one block forward of gamma positions (block);
        None while a part is unmeasured."""
        first = self.draft_cost(n, catch_up)
        rest = self.block_cost(n, gamma) if block else self.draft_cost(n, 1)
        if first is None or rest is None:
            return None
        return first + (rest if block else (gamma - 1) * rest)

    def observe_drafting(self, n: int, catch_up_width: int, drafted: int, block: bool,
                         times: tuple[float, float, float]) -> None:
        """A drafting step's draft calls, from times (start, catch-up done, drafting done): the
        catch-up by its width, then one block forward by the block's length, or the one-entry
        calls. The catch-up refines only a calibrated width: a table begun online would hold one
        batch size and be read at every other (a 111-entry catch-up of 2 rows priced at 64)."""
        start, caught_up, end = times
        if catch_up_width in self.draft:
            self.observe_draft(n, catch_up_width, caught_up - start)
        if block:
            self.observe_block(n, drafted, end - caught_up)
        elif drafted > 1:
            self.observe_draft(n, 1, (end - caught_up) / (drafted - 1))

    def _by_length(self, tables: dict[int, dict[int, float]], n: int, t: int) -> float | None:
        """tables[t] at n rows. An unmeasured t: linear in t between the measured t on each side;
        past the longest, along the slope between the two longest (a call's fixed cost is not
        scaled up with it: a 60-entry catch-up of one row costs about what a 5-entry one does,
        not 12 times as much), never below the longest's cost."""
        lengths = sorted(t_ for t_, table in tables.items() if table)
        if not lengths:
            return None
        if t in tables:
            return self._interpolate(tables[t], n)
        i = bisect.bisect_left(lengths, t)
        if i == 0:
            return self._interpolate(tables[lengths[0]], n)
        if i == len(lengths):  # past the longest
            if len(lengths) == 1:
                base = self._interpolate(tables[lengths[-1]], n)
                return base * t / lengths[-1]
            i -= 1
        lo, hi = lengths[i - 1], lengths[i]
        c_lo, c_hi = self._interpolate(tables[lo], n), self._interpolate(tables[hi], n)
        slope = max((c_hi - c_lo) / (hi - lo), 0.0)
        return c_lo + slope * (t - lo) if t < hi else c_hi + slope * (t - hi)


def expected_tokens(accept_by_position: list[float], gamma: int) -> float:
    """E(G) = 1 + sum_{i<=G} prod_{j<=i} a_j: tokens one row gains from one step."""
    total, reach = 1.0, 1.0
    for a in accept_by_position[:gamma]:
        reach *= a
        total += reach
    return total


class AdaptiveGamma:
    """Chooses gamma per step; learns acceptance per draft position from the steps it sees.

    prior / prior_weight: the acceptance a position starts from, as that many pseudo-observations.
    decay: per-step forgetting factor of the acceptance counts (tracks a changing draft).
    margin: the predicted gain speculation needs before it is switched on (0.1 = 10%).
    """

    def __init__(self, gamma_max: int, cost: CostModel | None = None, *, probe_every: int = 16,
                 prior: float = 0.5, prior_weight: float = 2.0, decay: float = 0.98,
                 margin: float = 0.1):
        if gamma_max < 1:
            raise ValueError(f"gamma_max must be >= 1, got {gamma_max}")
        self.gamma_max = gamma_max
        self.cost = cost or CostModel()
        self.probe_every = probe_every
        self.margin = margin
        self.prior, self.prior_weight, self.decay = prior, prior_weight, decay
        self.reached = [0.0] * gamma_max  # rows whose draft position j was judged
        self.accepted = [0.0] * gamma_max  # of those, rows that accepted it
        self.steps_at_zero = 0
        self.probe_interval = probe_every  # plain steps before the next probe (see `_choose`)
        self.steps_drafting, self.plain_probe_interval = 0, probe_every  # and the mirror probe
        self.block_drafter = False  # set by the engine: the draft proposes a block per forward
        # Whole-step calibration (module docstring): c(N, G) as G -> {bucket(N): S / cost},
        # and per G the decayed kept and emitted token counts of f(G).
        self.step_correction: dict[int, dict[int, float]] = {}
        self.kept = [0.0] * (gamma_max + 1)
        self.emitted = [0.0] * (gamma_max + 1)
        self.last_choice: tuple[int, int, float | None] | None = None  # (N, G, cost(N, G))
        self.last_gamma = 0  # of the step observed last

    def acceptance(self) -> list[float]:
        """Current estimate of a_j for j = 1..gamma_max."""
        return [(acc + self.prior * self.prior_weight) / (n + self.prior_weight)
                for acc, n in zip(self.accepted, self.reached)]

    def observe_acceptance(self, gamma: int, num_accepted: list[int]) -> None:
        """num_accepted: per row of a step drafted with `gamma`, the accepted prefix length."""
        self.reached = [r * self.decay for r in self.reached]
        self.accepted = [a * self.decay for a in self.accepted]
        for k in num_accepted:
            for j in range(min(k + 1, gamma)):  # positions 1..k accepted, k+1 judged and rejected
                self.reached[j] += 1
                self.accepted[j] += j < k

    def forwards_cost(self, n: int, gamma: int, accept: list[float] | None = None,
                      catch_up: int = 0) -> float | None:
        """cost(N, G): the step's forwards (module docstring); None while one is unmeasured.
        accept: the a_j to assume (default the current estimate). catch_up: entries per row the
        draft must read first when that is more than E(G) (a switch-on after plain steps)."""
        verify = self.cost.verify_cost(n, gamma + 1)
        draft = 0.0
        if gamma > 0:
            tokens = math.ceil(expected_tokens(accept or self.acceptance(), gamma))
            draft = self.cost.draft_step_cost(n, gamma, max(tokens, catch_up), self.block_drafter)
        if verify is None or draft is None:
            return None
        return verify + draft

    def correction(self, n: int, gamma: int) -> float:
        """c(N, G): measured whole-step seconds over cost(N, G), near N (module docstring)."""
        n = self.cost.bucket(n)
        measured = self.step_correction.get(gamma, {}).get(n)
        if measured is not None:
            return measured
        if gamma > 0:  # another speculative gamma's at this N: the same overheads, roughly
            others = [t[n] for g, t in self.step_correction.items() if g > 0 and n in t]
            if others:
                return sum(others) / len(others)
        return 1.0

    def kept_fraction(self, gamma: int) -> float:
        """f(G): of the tokens steps at G emitted, the share kept (not past a stop token); at an
        unmeasured G >= 1, that of all speculative steps."""
        if self.emitted[gamma]:
            return self.kept[gamma] / self.emitted[gamma]
        speculative = sum(self.emitted[1:])
        return sum(self.kept[1:]) / speculative if gamma > 0 and speculative else 1.0

    def throughput(self, n: int, gamma: int, accept: list[float] | None = None,
                   catch_up: int = 0) -> float | None:
        """Expected kept tokens per second of a whole step of n rows with `gamma`; None while a
        cost is unknown. accept: the a_j to assume (default the current estimate); catch_up: as
        `forwards_cost`'s."""
        accept = accept or self.acceptance()
        seconds = self.forwards_cost(n, gamma, accept, catch_up)
        if seconds is None:
            return None
        tokens = expected_tokens(accept, gamma) * self.kept_fraction(gamma)
        return n * tokens / (seconds * self.correction(n, gamma))

    def observe_step(self, n: int, gamma: int, seconds: float, emitted: int, kept: int) -> None:
        """A whole step of n rows at `gamma` took `seconds` and kept `kept` of the `emitted`
        tokens; its S / cost(N, G) updates c(N, G) when this controller chose that step (it
        holds the cost it predicted then, before the step's own forwards were observed), unless
        it switched drafting on after plain steps."""
        self.kept[gamma] = self.decay * self.kept[gamma] + kept
        self.emitted[gamma] = self.decay * self.emitted[gamma] + emitted
        chosen, self.last_choice = self.last_choice, None
        switched_on, self.last_gamma = gamma > 0 and self.last_gamma == 0, gamma
        if chosen is None or chosen[:2] != (n, gamma) or not chosen[2]:
            return
        if switched_on:
            # The first drafting step after plain ones catches the draft up on all of them: a
            # price of switching (the margin's), not of speculating; counted here, it would keep
            # speculation off after every probe.
            return
        # Clamped: one step stalled by the OS must not switch speculation off for many steps.
        ratio = min(max(seconds / chosen[2], 0.5), 3.0)
        self.cost.average_into(self.step_correction.setdefault(gamma, {}), n, ratio)

    def start_call(self) -> None:
        """A generate call begins: its rows are new to the draft, so its first drafting step
        (a prefill of every row into the draft) is a switch-on, whatever the last call ended
        with."""
        self.last_gamma = 0

    def choose(self, n: int, catch_up: int = 0) -> int:
        """The gamma for the next step of n rows (may be a probe; see the module docstring).
        catch_up: the widest run of entries a row's draft has not read (a row it never saw: its
        whole length), which a drafting step reads first; 0 when unknown.

        Speculation must beat plain decoding by ``margin`` in the model, near break-even the
        model's errors decide, so there plain decoding is the safe side. After a plain step,
        drafting is priced with the catch-up it would read (every entry since the draft last ran):
        the first drafting step must pay for it itself (docs/design.md, "Switching speculation
        on"), else a controller that flips near the margin pays one catch-up per flip. A probe
        happens only where a perfect draft would pay, its catch-up included: at batch sizes where
        even acceptance 1 loses, knowing the acceptance better cannot change the choice.
        """
        switch_on = catch_up if self.last_gamma == 0 else 0
        best = self._choose(n, switch_on)
        self.last_choice = (n, best, self.forwards_cost(n, best))
        return best

    def _choose(self, n: int, catch_up: int = 0) -> int:
        accept = self.acceptance()  # once: choose runs every step
        rates = {g: self.throughput(n, g, accept, catch_up) for g in range(self.gamma_max + 1)}
        known = {g: r for g, r in rates.items() if r is not None}
        if 0 not in known or len(known) == 1:
            return max(known, key=known.get) if known else self.gamma_max
        best = max(known, key=known.get)
        if known[best] < (1 + self.margin) * known[0]:
            best = 0
        if best == 0:
            self.steps_drafting, self.plain_probe_interval = 0, self.probe_every
            self.steps_at_zero += 1
            if self.steps_at_zero >= self.probe_interval:
                self.steps_at_zero = 0
                if self._could_pay(n, known[0], catch_up):
                    # A probe costs a catch-up over every step since the last draft, so while
                    # probes keep finding speculation off, they space out: x2 each, up to 16 x.
                    self.probe_interval = min(2 * self.probe_interval, 16 * self.probe_every)
                    return self.gamma_max
        else:
            self.steps_at_zero = 0
            self.probe_interval = self.probe_every
            self.steps_drafting += 1
            if self.steps_drafting >= self.plain_probe_interval:
                # The mirror probe: while drafting, plain steps go unmeasured, and a plain-step
                # cost known only from calibration (or a few early steps) may be far off.
                self.steps_drafting = 0
                self.plain_probe_interval = min(2 * self.plain_probe_interval,
                                                4 * self.probe_every)
                return 0
        return best

    def _could_pay(self, n: int, plain_rate: float, catch_up: int = 0) -> bool:
        """Whether a draft accepted at every position would beat plain decoding by the margin in
        the probe's own step, its catch-up included (a probe at 64 rows after a long plain run
        reads every row's whole gap: 4-5 plain steps' worth on the default policy)."""
        perfect = [1.0] * self.gamma_max
        optimistic = max(self.throughput(n, g, perfect, catch_up) or 0.0
                         for g in range(1, self.gamma_max + 1))
        return optimistic >= (1 + self.margin) * plain_rate

    def verify_length(self, n: int, confidence_rows: list[list[float]], spent: float) -> int:
        """How many of a drafted block to verify: argmax_k sum_r E_r(k) / (spent + verify(n, k+1))
        with each row's confidences as its acceptance (module docstring); the whole block while
        a verify cost is unknown."""
        G = len(confidence_rows[0])
        rates = {}
        for k in range(G + 1):
            verify = self.cost.verify_cost(n, k + 1)
            if verify is None:
                return G
            rates[k] = sum(expected_tokens(c, k) for c in confidence_rows) / (spent + verify)
        return max(rates, key=rates.get)
