"""Specification of the expected accept length on fixed answers (`cospec.draft.expected_accept_length`).

Claim: for an answer sampled by lossless speculative decoding, the chain over anchors gives the
expected number of verify steps decoding took, given that answer. Oracles: (1) exact enumeration of
speculative decoding (Leviathan et al.'s rule, every draft and every outcome) in a made-up world of
3 tokens whose draft distributions depend on where drafting started, as EAGLE-3's do; (2) the
engine itself on a tiny random policy, whose step count the chain must predict from the answers
it sampled, with the accept probabilities taken from a TTT unroll.
"""

import itertools
import random

import pytest
import torch
from ttt_answers import packed_answers

from cospec.config import ModelConfig, SamplingConfig, resolve
from cospec.draft.expected_accept_length import (SCALE_GRID, SCALE_RANGE, accept_given_token,
                                                 expected_accept_length, expected_steps,
                                                 fit_proposal_scale)
from cospec.draft.losses import compress_to_head, rejection_posterior
from cospec.draft.offline import held_out_metrics
from cospec.draft.ttt import TTTBatch, ttt_steps, ttt_unroll
from cospec.models.draft import Eagle3Draft
from cospec.models.llama import Transformer
from cospec.rollout.speculative import SpeculativeEngine

V, G, PROMPT, M = 3, 2, (0,), 5  # vocab, gamma, prompt, response length


def _dist(*key) -> list[float]:
    """A fixed, sharply varying distribution over V tokens for each key."""
    rng = random.Random(repr(key))  # not hash(): strings hash differently in every process
    w = [rng.random() ** 3 + 0.02 for _ in range(V)]
    return [x / sum(w) for x in w]


def p_of(context: tuple) -> list[float]:
    return _dist("p", context)


def q_of(anchor_context: tuple, drafted: tuple) -> list[float]:
    """The draft's step-(len(drafted)+1) distribution: it depends on where drafting started, not
    only on the tokens (EAGLE-3's later steps read the draft's own hidden from that anchor)."""
    return _dist("q", anchor_context, drafted)


def enumerate_decoding() -> dict[tuple, tuple[float, float]]:
    """{answer: (probability, expected steps given it)} by walking every branch of speculative
    decoding: the first response token from the prefill, then steps until M tokens."""
    out: dict[tuple, list[float]] = {}

    def walk(seq: tuple, prob: float, steps: int) -> None:
        if len(seq) - len(PROMPT) >= M:
            answer = seq[:len(PROMPT) + M]
            acc = out.setdefault(answer, [0.0, 0.0])
            acc[0] += prob
            acc[1] += prob * steps
            return
        # accepted k drafts x_1..x_k, then y (residual at k + 1 < G + 1, or the bonus after G)
        for k in range(G + 1):
            for xs in itertools.product(range(V), repeat=k):
                pr = 1.0
                for i, x in enumerate(xs):
                    pr *= min(p_of(seq + xs[:i])[x], q_of(seq, xs[:i])[x])
                if pr == 0:
                    continue
                p_next = p_of(seq + xs)
                for y in range(V):
                    if k < G:
                        w = max(0.0, p_next[y] - q_of(seq, xs)[y])
                    else:
                        w = p_next[y]
                    if w > 0:
                        walk(seq + xs + (y,), prob * pr * w, steps + 1)

    for first in range(V):
        walk(PROMPT + (first,), p_of(PROMPT)[first], 0)
    return {a: (pr, s / pr) for a, (pr, s) in out.items()}


def chain_steps(answer: tuple) -> float:
    """The chain's expected steps for one answer, its accept probabilities read off the tables."""
    T = len(answer) - 1  # packed: the last token is a target only
    accept = torch.zeros(G, T, dtype=torch.float64)
    for a in range(T):
        for j in range(G):
            if a + j + 1 < T:
                x = answer[a + j + 1]
                p = p_of(answer[:a + j + 1])[x]
                q = q_of(answer[:a + 1], answer[a + 1:a + j + 1])[x]
                accept[j, a] = min(1.0, q / p)
    mask = torch.zeros(T)
    mask[len(PROMPT) - 1:] = 1  # entry t is trained when token t + 1 is a response token
    steps, tokens = expected_steps(accept, torch.tensor([0, T]), mask)
    assert tokens == M - 1
    return steps


def test_the_chain_gives_decodings_expected_steps_for_every_answer_exactly():
    answers = enumerate_decoding()
    assert sum(pr for pr, _ in answers.values()) == pytest.approx(1.0, abs=1e-12)  # lossless
    assert len(answers) == V ** M
    for answer, (_, steps) in answers.items():
        assert chain_steps(answer) == pytest.approx(steps, rel=1e-9), answer
    # The answers differ in what they cost: the chain is not one number for all.
    spread = [s for _, s in answers.values()]
    assert max(spread) - min(spread) > 1


CFG = ModelConfig(vocab_size=24, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2,
                  intermediate_size=64, max_seq_len=64)


@pytest.mark.parametrize("head_scale, stop_ids, proposal_scale",
                         [(1.0, (), 1.0), (4.0, (), 1.0), (4.0, (5,), 1.0), (4.0, (), 3.0)])
def test_the_chain_predicts_the_engines_step_count_from_the_answers_it_sampled(head_scale, stop_ids,
                                                                               proposal_scale):
    """The accept probabilities from a TTT unroll over the engine's own answers; 256 answers of
    up to 12 tokens at gamma 3, capped by length or ended by a stop token. Given the answers the
    step count still varies, so the two agree within its noise (measured at these seeds: 840
    steps against 840.3, 1,080 against 1,068.0, 856 against 853.2, 1,545 against 1,534.8), not
    exactly. A draft that proposes at another scale: the engine draws from and verifies against
    softmax(scale * logits / T), and the chain prices exactly that (at scale 1 it would expect
    1,064 steps, 31% fewer than the engine took)."""
    torch.manual_seed(0)
    policy = Transformer(CFG).eval()
    with torch.no_grad():
        policy.lm_head.weight.mul_(head_scale)  # sharper p: lower acceptance
    draft = Eagle3Draft.from_policy(policy, tap_layers=(0, 1, 2), layer_from_policy=True).eval()
    draft.proposal_scale = proposal_scale
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 24) for _ in range(rng.randrange(3, 7))] for _ in range(256)]
    engine = SpeculativeEngine(policy, draft, batch_size=16, gamma=3, stop_ids=stop_ids)
    with torch.no_grad():
        result = engine.generate(prompts, SamplingConfig(temperature=1.0, max_new_tokens=12),
                                 generator=torch.Generator().manual_seed(1))
        seqs = [c.prompt + c.tokens[:-1] for c in result.completions]  # packed: last is a target
        tokens = torch.tensor([t for s in seqs for t in s])
        cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)
        mask = torch.zeros(len(tokens))
        for c, start, end in zip(result.completions, cu[:-1].tolist(), cu[1:].tolist()):
            mask[start + len(c.prompt) - 1:end] = 1
        out = policy(tokens[None], cu_seqlens=cu, tap_layers=draft.tap_layers)
        batch = TTTBatch(tokens=tokens, cu_seqlens=cu, loss_mask=mask,
                         taps={k: v[0] for k, v in out.taps.items()}, policy_logits=out.logits[0])
        steps = ttt_steps(draft, batch, 3)
        unscaled = expected_steps(accept_given_token(ttt_unroll(draft, steps, cu), steps.targets_JTV,
                                                     tokens, 1.0, None), cu, mask)[0]
    expected, num_tokens = expected_accept_length(draft, [batch], 3, 1.0)  # at its proposal scale
    assert num_tokens == sum(len(c.tokens) - 1 for c in result.completions)
    assert expected == pytest.approx(result.stats.row_steps, rel=0.03)
    if proposal_scale != 1.0:
        assert abs(unscaled - result.stats.row_steps) > 0.2 * result.stats.row_steps


def test_step_j_at_anchor_a_judges_the_answers_token_a_plus_j_plus_1_with_a_reduced_head():
    """The alignment, entry by entry: step j + 1's logits at anchor a against p at a + j and the
    token s_{a+j+1}, for compressed targets as the offline data keeps them."""
    torch.manual_seed(3)
    policy = Transformer(CFG).eval()
    ids = torch.tensor([0, 2, 4, 5, 7, 9, 11, 12, 15, 16, 20, 23])
    draft = Eagle3Draft.from_policy(policy, tap_layers=(0, 1, 2), vocab_ids=ids).eval()
    batch = packed_answers(policy, draft.tap_layers, [10, 7], [3, 4], seed=5)
    batch.policy_logits = compress_to_head(batch.policy_logits, ids, 0.7)
    with torch.no_grad():
        steps = ttt_steps(draft, batch, 3)
        logits = ttt_unroll(draft, steps, batch.cu_seqlens)
        accept = accept_given_token(logits, steps.targets_JTV, batch.tokens, 0.7, ids)
        for j in range(3):
            for a in range(len(batch.tokens) - j - 1):
                x = batch.tokens[a + j + 1:a + j + 2]
                want = 1 - rejection_posterior(logits[j][a:a + 1], batch.policy_logits[a + j:a + j + 1],
                                               x, 0.7, ids)
                torch.testing.assert_close(accept[j, a:a + 1], want)
    off_head = ~torch.isin(batch.tokens, ids)
    assert off_head.any() and bool((accept[0, :-1][off_head[1:]] == 0).all())  # q = 0 there


def test_held_out_metrics_report_the_expected_tau_for_temperature_sampling_only():
    torch.manual_seed(4)
    policy = Transformer(CFG).eval()
    draft = Eagle3Draft.from_policy(policy, tap_layers=(0, 1, 2)).eval()
    batch = packed_answers(policy, draft.tap_layers, [12, 9], [4, 3], seed=5)
    cfg = resolve("tiny", overrides=["rollout.gamma=3", "sampling.temperature=0.7"])
    m = held_out_metrics(draft, [batch], cfg)
    with torch.no_grad():
        steps = ttt_steps(draft, batch, 3)
        accept = accept_given_token(ttt_unroll(draft, steps, batch.cu_seqlens), steps.targets_JTV,
                                    batch.tokens, 0.7, None)
    expected, tokens = expected_steps(accept, batch.cu_seqlens, batch.loss_mask)
    assert m["expected_accept_length"] == [pytest.approx(tokens / expected)]
    for warp in ("sampling.top_p=0.9", "sampling.top_k=5", "sampling.temperature=0"):
        cfg = resolve("tiny", overrides=["rollout.gamma=3", warp])
        assert "expected_accept_length" not in held_out_metrics(draft, [batch], cfg), warp


def test_the_fitted_proposal_scale_is_the_chains_best_on_the_answers_it_was_fitted_on():
    """The fit against the chain run at each scale on its own (the draft's proposal_scale set):
    its tau is the one the chain gives at its scale, and at least every grid point's. In this
    world (a sharp p, a draft copied from the policy's layer) flatter proposals pay, far below
    the grid: the fit follows them down to the end of its range."""
    torch.manual_seed(4)
    policy = Transformer(CFG).eval()
    with torch.no_grad():
        policy.lm_head.weight.mul_(4.0)
    draft = Eagle3Draft.from_policy(policy, tap_layers=(0, 1, 2), layer_from_policy=True).eval()
    batch = packed_answers(policy, draft.tap_layers, [12, 9, 14], [4, 3, 5], seed=5)

    def tau_at(k: float) -> float:
        draft.proposal_scale = k
        steps, tokens = expected_accept_length(draft, [batch], 3, 0.7)
        return tokens / steps

    fit = fit_proposal_scale(draft, [batch], 3, 0.7)
    assert fit["expected_tau"] == pytest.approx(tau_at(fit["scale"]), rel=1e-9)
    assert fit["expected_tau_at_1"] == pytest.approx(tau_at(1.0), rel=1e-9)
    assert fit["expected_tau"] >= max(tau_at(k) for k in SCALE_GRID)
    assert SCALE_RANGE[0] <= fit["scale"] < 0.3 and fit["expected_tau"] > tau_at(1.0) + 0.4


@pytest.mark.parametrize("peak", [1.3, 0.45, 3.1])
def test_the_fit_finds_the_peak_of_a_single_peaked_tau_inside_or_past_the_grid(monkeypatch, peak):
    """The search alone, on a made-up tau(k) = 3 - (log k - log peak)^2: within 5% of the peak,
    whether it lies between grid points or past either end."""
    import math

    from cospec.draft import expected_accept_length as module

    calls = []

    def made_up(draft, batches, gamma, temperature, scales):
        calls.append(list(scales))
        return {k: (100.0, round(100 * (3 - (math.log(k) - math.log(peak)) ** 2))) for k in scales}

    monkeypatch.setattr(module, "expected_steps_by_scale", made_up)
    fit = fit_proposal_scale(None, [], 3, 0.7)
    assert fit["scale"] == pytest.approx(peak, rel=0.05)
    assert all(k not in seen for i, c in enumerate(calls) for k in c
               for seen in calls[:i])  # no scale measured twice
    assert fit["expected_tau_at_1"] == pytest.approx(3 - math.log(peak) ** 2, abs=0.01)


def test_the_fit_keeps_scale_1_on_ties_and_when_the_answers_give_no_steps(monkeypatch):
    from cospec.draft import expected_accept_length as module

    monkeypatch.setattr(module, "expected_steps_by_scale",
                        lambda *a: {k: (10.0, 30) for k in a[-1]})  # tau 3 at every scale
    assert fit_proposal_scale(None, [], 3, 0.7) == {"scale": 1.0, "expected_tau_at_1": 3.0,
                                                    "expected_tau": 3.0}
    monkeypatch.setattr(module, "expected_steps_by_scale",
                        lambda *a: {k: (0.0, 0) for k in a[-1]})  # no answer tokens at all
    assert fit_proposal_scale(None, [], 3, 0.7)["scale"] == 1.0


def test_a_token_the_policy_cannot_sample_has_no_residual_share():
    policy_logits = torch.tensor([[0.0, 1.0, -float("inf")]])
    draft_logits = torch.tensor([[0.0, 0.0, 0.0]])
    got = rejection_posterior(draft_logits, policy_logits, torch.tensor([2]), 1.0, None)
    assert got.tolist() == [0.0]
