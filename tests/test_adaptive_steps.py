"""The adaptive controller judges whole steps, not only forwards (cospec.rollout.adaptive,
"Whole steps"): what a speculative step costs beyond its forwards, and the tokens it drafts past a
stop, switch speculation off where the forwards alone say it pays."""

import itertools

import pytest
import torch

from cospec.config import ModelConfig, SamplingConfig
from cospec.models.draft import Eagle3Draft
from cospec.models.llama import Transformer
from cospec.rollout.adaptive import AdaptiveGamma, CostModel
from cospec.rollout.speculative import SpeculativeEngine


def forward_costs(batch_sizes=(1, 8, 64), gamma_max=4) -> CostModel:
    """A policy forward costs 10 ms + 0.3 ms per token (N * T); a draft call 1 ms + 0.05 ms per
    entry: at one row, drafting pays."""
    cost = CostModel()
    for n in batch_sizes:
        for t in range(1, gamma_max + 2):
            cost.observe_verify(n, t, 0.010 + 0.0003 * n * t)
            cost.observe_draft(n, t, 0.001 + 0.00005 * n * t)
    return cost


def good_draft_controller(**kw) -> AdaptiveGamma:
    ctl = AdaptiveGamma(4, forward_costs(), probe_every=1000, **kw)
    for _ in range(50):
        ctl.observe_acceptance(4, [4, 4, 3, 4])
    return ctl


def take_steps(ctl: AdaptiveGamma, n: int, steps: int, slowdown: float) -> list[int]:
    """`steps` choices at n rows, each step measured at `slowdown` x the forwards' cost."""
    picks = []
    for _ in range(steps):
        g = ctl.choose(n)
        picks.append(g)
        predicted = ctl.last_choice[2]
        ctl.observe_step(n, g, slowdown * predicted if g else predicted, emitted=n * 4, kept=n * 4)
    return picks


def test_steps_that_cost_what_the_forwards_say_leave_the_choice_alone():
    ctl = good_draft_controller()
    first = ctl.choose(1)
    ctl.observe_step(1, first, ctl.last_choice[2], emitted=4, kept=4)
    assert first == 4 and ctl.correction(1, 4) == pytest.approx(1.0)
    assert take_steps(ctl, 1, 20, slowdown=1.0) == [4] * 20


def test_speculative_steps_slower_than_their_forwards_switch_speculation_off():
    ctl = good_draft_controller()
    rate_before = ctl.throughput(1, 4)
    # Each speculative step takes 3x its forwards (say, the draft prefills of refilled rows):
    # the moving average of S / cost(N, G) climbs, and the predicted rate falls with it.
    picks = take_steps(ctl, 1, 30, slowdown=3.0)
    assert picks[0] == 4 and picks[-10:] == [0] * 10
    assert ctl.correction(1, picks[0]) > 2.0
    assert ctl.throughput(1, 4) < rate_before / 2


def test_a_correction_measured_at_one_gamma_carries_to_the_other_gammas_at_that_batch_only():
    ctl = good_draft_controller()
    ctl.step_correction = {3: {1: 1.5}}
    assert ctl.correction(1, 3) == 1.5
    assert ctl.correction(1, 2) == 1.5 and ctl.correction(1, 4) == 1.5  # unmeasured: G = 3's
    assert ctl.correction(1, 0) == 1.0  # plain decoding is not speculation
    assert ctl.correction(64, 3) == 1.0  # another batch size: unmeasured


def test_a_step_the_controller_did_not_choose_does_not_move_the_correction():
    ctl = good_draft_controller()
    ctl.choose(1)
    ctl.observe_step(8, 4, 100.0, emitted=40, kept=40)  # another row count than chosen
    ctl.observe_step(1, 4, 100.0, emitted=5, kept=5)  # the choice was spent on the step above
    assert ctl.step_correction == {}


def test_the_step_that_switches_drafting_on_is_not_taken_for_the_cost_of_speculating():
    """Its catch-up covers every plain step before it: a price of switching, which the choice
    prices when it switches on. Counted, it would keep speculation off after every probe."""
    ctl = good_draft_controller()
    assert take_steps(ctl, 1, 1, slowdown=3.0) == [4]  # after plain steps (none yet)
    assert ctl.step_correction == {}
    take_steps(ctl, 1, 1, slowdown=1.5)  # the next one is a speculative step like any other
    assert ctl.correction(1, 4) == pytest.approx(1.5)


def test_after_plain_steps_drafting_must_pay_for_its_catch_up_in_its_first_step():
    """A draft that has not read a row's last 200 entries reads them before it drafts; at 8 rows
    that costs more than a step of speculation gains, so the controller stays plain. Caught up
    (one plain step: the mirror probe's), the same draft pays; amid drafting steps the catch-up
    is a step's usual one, priced in c(N, G)."""
    ctl = good_draft_controller()
    assert ctl.last_gamma == 0
    assert ctl.choose(8, catch_up=2) > 0
    assert ctl.choose(8, catch_up=200) == 0
    ctl.last_gamma = 4
    assert ctl.choose(8, catch_up=200) > 0


def test_a_draft_call_between_and_past_the_measured_widths_costs_linearly_in_its_width():
    """A call's fixed cost is paid once: a 60-entry catch-up of one row costs its 5-entry
    cost plus 55 entries at the per-entry slope, not 12 times the 5-entry cost."""
    cost = CostModel()
    for t in (1, 2, 3, 4, 5, 16):
        cost.observe_draft(1, t, 0.003 + 0.0001 * t)
    assert cost.draft_cost(1, 10) == pytest.approx(0.003 + 0.0001 * 10)  # between 5 and 16
    assert cost.draft_cost(1, 60) == pytest.approx(0.003 + 0.0001 * 60)  # past 16
    only_one = CostModel()
    only_one.observe_draft(1, 4, 0.004)
    assert only_one.draft_cost(1, 8) == pytest.approx(0.008)  # no slope known: proportional


def test_no_probe_where_its_catch_up_outweighs_what_even_a_perfect_draft_gains():
    ctl = AdaptiveGamma(4, forward_costs(), probe_every=4)
    for _ in range(50):
        ctl.observe_acceptance(4, [0] * 8)  # speculation off: only probes draft
    assert [ctl.choose(8, catch_up=2) for _ in range(4)] == [0, 0, 0, 4]
    # at 8 rows, reading 200 entries a row costs 6.5 plain steps: a probe then would not pay
    assert [ctl.choose(8, catch_up=200) for _ in range(16)] == [0] * 16


def test_only_calibrated_catch_up_widths_are_refined_online():
    """A catch-up as wide as no calibrated call (a switch-on after many plain steps) is priced
    from the calibrated widths: a table begun by one online measurement would hold one batch
    size, and be read for every other."""
    torch.manual_seed(0)
    policy, draft = Transformer(CFG).eval(), Eagle3Draft.from_policy(Transformer(CFG)).eval()
    ctl = AdaptiveGamma(3, probe_every=2)
    engine = SpeculativeEngine(policy, draft, batch_size=3, gamma=3, controller=ctl, stop_ids=(7,))
    engine.generate([[1, 2, 3], [4, 5]], SamplingConfig(temperature=1.0, max_new_tokens=2))
    calibrated = set(ctl.cost.draft)
    assert {1, 2, 3, 4, 16} <= calibrated  # 1..G+1 and a wide one (64 does not fit 64 slots)
    prompts = [[1 + i % 40] * (5 + 3 * i) for i in range(6)]  # long prompts: wide catch-ups
    engine.generate(prompts, SamplingConfig(temperature=1.0, max_new_tokens=12),
                    generator=torch.Generator().manual_seed(0))
    assert set(ctl.cost.draft) == calibrated


def test_one_stalled_step_moves_the_correction_by_at_most_a_clamped_amount():
    ctl = good_draft_controller()
    ctl.last_gamma = 4  # amid speculative steps
    ctl.choose(1)
    ctl.observe_step(1, 4, 1e6 * ctl.last_choice[2], emitted=5, kept=5)  # the OS stalled it
    assert ctl.correction(1, 4) == 3.0


def test_tokens_drafted_past_a_stop_count_against_speculation():
    ctl = good_draft_controller()
    before = ctl.throughput(1, 4)
    for _ in range(200):  # of every 5 tokens a step emits, 1 is kept
        ctl.observe_step(1, 4, 0.02, emitted=5, kept=1)
    assert ctl.kept_fraction(4) == pytest.approx(0.2)
    assert ctl.kept_fraction(0) == 1.0  # plain decoding keeps every token
    assert ctl.throughput(1, 4) == pytest.approx(0.2 * before)
    assert ctl.choose(1) == 0


def test_probes_space_out_while_speculation_stays_off_and_reset_when_it_pays():
    ctl = AdaptiveGamma(4, forward_costs(), probe_every=4)
    for _ in range(50):
        ctl.observe_acceptance(4, [0] * 8)  # a useless draft: plain, with probes
    probes = [i + 1 for i, g in enumerate(ctl.choose(1) for _ in range(30)) if g]
    assert probes == [4, 12, 28] and ctl.probe_interval == 32
    for _ in range(50):
        ctl.observe_acceptance(4, [4] * 8)  # the draft got good (co-training): speculation pays
    assert ctl.choose(1) > 0 and ctl.probe_interval == 4


# ----------------------------------------------------------------------------- in the engine

CFG = ModelConfig(vocab_size=50, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2,
                  intermediate_size=64, max_seq_len=64)


class Recorder(AdaptiveGamma):
    """The adaptive controller, recording what the engine reports of every whole step."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.steps, self.catch_ups, self.choices = [], [], []

    def choose(self, n, catch_up=0):
        self.catch_ups.append(catch_up)
        self.choices.append((catch_up, self.last_gamma))
        return super().choose(n, catch_up)

    def observe_step(self, n, gamma, seconds, emitted, kept):
        self.steps.append((n, gamma, seconds, emitted, kept))
        super().observe_step(n, gamma, seconds, emitted, kept)


def test_the_engine_reports_each_whole_step_with_the_tokens_it_kept():
    torch.manual_seed(0)
    policy, draft = Transformer(CFG).eval(), Eagle3Draft.from_policy(Transformer(CFG)).eval()
    ctl = Recorder(3, probe_every=2)
    engine = SpeculativeEngine(policy, draft, batch_size=3, gamma=3, controller=ctl, stop_ids=(7,))
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10], [11, 12]]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=10)
    out = engine.generate(prompts, sampling, generator=torch.Generator().manual_seed(0))
    st = out.stats
    assert len(ctl.steps) == sum(st.gamma_counts.values())  # every step, none twice
    assert {g for _, g, *_ in ctl.steps} == set(st.gamma_counts)
    assert all(0 < kept <= emitted for *_, emitted, kept in ctl.steps)
    assert sum(e for *_, e, _ in ctl.steps) == st.step_tokens  # emitted: k + 1 per row
    # the first choice knows the draft must read every row whole: prompt and first token
    assert ctl.catch_ups[0] == max(len(p) for p in prompts[:3]) + 1
    # kept tokens: every response token but each row's first (sampled at its prefill)
    assert sum(k for *_, k in ctl.steps) == out.num_tokens - len(prompts)
    # the step's seconds are its draft + verify + other seconds (the refills are apart)
    assert 0 < sum(s for _, _, s, *_ in ctl.steps) <= (st.draft_seconds + st.verify_seconds
                                                       + st.other_seconds)
    # the next call's rows are new to the draft too: its first choice is priced as a switch-on
    # (last gamma 0), however the last call ended
    ctl.last_gamma = 3
    ctl.catch_ups.clear(), ctl.choices.clear()
    engine.generate(prompts, sampling, generator=torch.Generator().manual_seed(1))
    assert ctl.choices[0] == (max(len(p) for p in prompts[:3]) + 1, 0)


def test_the_stats_say_where_the_time_went_by_gamma_and_in_switching_drafting_on(monkeypatch):
    """The accounting, not the clock: the engine reads a clock that advances one unit per read,
    so every interval is a count of the reads inside it and the figures are exact."""
    reads = itertools.count()
    monkeypatch.setattr("cospec.rollout.speculative.synced_time", lambda like: float(next(reads)))
    torch.manual_seed(0)
    policy, draft = Transformer(CFG).eval(), Eagle3Draft.from_policy(Transformer(CFG)).eval()
    ctl = Recorder(3, probe_every=2)
    engine = SpeculativeEngine(policy, draft, batch_size=3, gamma=3, controller=ctl, stop_ids=(7,))
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10], [11, 12], [13, 14, 15]]
    out = engine.generate(prompts, SamplingConfig(temperature=1.0, max_new_tokens=12),
                          generator=torch.Generator().manual_seed(0))
    st, gammas = out.stats, [g for _, g, *_ in ctl.steps]
    by_gamma = {}
    for _, g, seconds, *_ in ctl.steps:
        by_gamma[g] = by_gamma.get(g, 0.0) + seconds
    assert st.seconds_by_gamma.keys() == by_gamma.keys()
    assert all(st.seconds_by_gamma[g] == pytest.approx(by_gamma[g]) for g in by_gamma)
    switch_ons = [i for i in range(1, len(gammas)) if gammas[i] > 0 and gammas[i - 1] == 0]
    assert switch_ons, f"the probes should switch drafting on at least once: {gammas}"
    assert st.switch_on_steps == len(switch_ons)
    assert st.switch_on_seconds == pytest.approx(sum(ctl.steps[i][2] for i in switch_ons))
    # every row the draft is called for is first prefilled into it, inside the draft's time
    # (both are counts of the fake clock's reads, not seconds of a wall clock)
    assert 0 < st.draft_prefill_seconds <= st.draft_seconds


def test_while_drafting_a_plain_step_is_taken_now_and_then_to_keep_its_cost_measured():
    ctl = AdaptiveGamma(4, forward_costs(), probe_every=4)
    for _ in range(50):
        ctl.observe_acceptance(4, [4] * 8)  # speculation pays at one row
    plain_steps = [i + 1 for i, g in enumerate(ctl.choose(1) for _ in range(90)) if g == 0]
    assert plain_steps == [4, 12, 28, 44, 60, 76]  # spaced out: 4, 8, then at most every 16


def test_a_plain_step_measured_slower_than_its_calibration_makes_speculation_win_again():
    """The mirror of the switch-off case: the compiled engine's measured trap, where plain
    decoding was known only from a few slow early steps (c(1, 0) = 1.7) and speculation was
    chosen at 0.83x of plain."""
    ctl = AdaptiveGamma(4, forward_costs(), probe_every=4)
    for _ in range(50):
        ctl.observe_acceptance(4, [0] * 8)  # a poor draft: plain wins
    ctl.step_correction = {0: {1: 1.7}, 1: {1: 1.0}}  # plain steps wrongly thought slow
    take_steps(ctl, 1, 1, slowdown=1.0)
    # plain steps measured at their forwards' cost bring c(1, 0) back down
    picks = take_steps(ctl, 1, 120, slowdown=1.0)
    assert ctl.correction(1, 0) < 1.05
    assert sum(g > 0 for g in picks[-30:]) <= 2  # plain, but for the spaced-out probes
