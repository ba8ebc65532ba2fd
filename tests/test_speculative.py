"""Specification of cospec.rollout.speculative: speculative generation is plain generation, faster.

Oracles are independent of the engine: the plain engine (greedy equality, token for token), a full
forward of the policy over the finished sequence (logprobs), and the exact distribution of whole
responses, enumerated by full forwards over every possible prefix (losslessness).

Random policies use std 0.3 init so greedy decisions are not decided by float noise (as in
test_engine.py).
"""

import itertools
import math

import pytest
import torch

from cospec.config import ModelConfig, SamplingConfig
from cospec.draft.ttt import TTTBatch, ttt_loss
from cospec.models.block_draft import BlockDraft
from cospec.models.draft import Eagle3Draft
from cospec.models.llama import Transformer
from cospec.data.tokenizer import BOS, EOS
from cospec.rollout.adaptive import AdaptiveGamma, CostModel, expected_tokens
from cospec.rollout.engine import GenerationEngine
from cospec.rollout.sampling import sampling_logprobs_NV, warp_logits
from cospec.rollout.speculative import SpeculativeEngine

CFG = ModelConfig(vocab_size=50, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                  intermediate_size=128, max_seq_len=64)


def make_policy(cfg=CFG, std=0.3, seed=0):
    torch.manual_seed(seed)
    m = Transformer(cfg)
    m.reset_parameters(std=std)
    return m.eval()


@pytest.fixture(scope="module")
def policy():
    return make_policy()


def make_prompts(lengths, vocab=CFG.vocab_size, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [[BOS] + torch.randint(4, vocab, (n - 1,), generator=gen).tolist() for n in lengths]


def drafts_for(policy):
    """An EAGLE-3 draft (random), a standalone LM draft (a noisy copy of the policy: high but not
    perfect acceptance), the policy itself as its own draft (accepts everything), and block
    drafts (random)."""
    torch.manual_seed(1)
    eagle = Eagle3Draft.from_policy(policy).eval()
    deep = Eagle3Draft.from_policy(policy, num_layers=2).eval()  # EAGLE-3's layer and one more
    # a reduced head over every third id (and EOS): tokens outside it are never drafted
    reduced = Eagle3Draft.from_policy(policy, vocab_ids=torch.tensor(sorted({EOS, *range(4, 50, 3)})))
    noisy = make_policy(policy.config, seed=0)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(0.01 * torch.randn_like(p))
    # block drafts: parallel heads; with DSpark's correction (made non-trivial) and confidence
    block = BlockDraft.from_policy(policy, num_layers=2, correction=False, confidence=False)
    corrected = BlockDraft.from_policy(policy, correction=True)
    with torch.no_grad():
        corrected.correction.weight.normal_(std=0.1)
    block_reduced = BlockDraft.from_policy(policy, vocab_ids=reduced.vocab_ids)
    return {"eagle3": eagle, "eagle3-deep": deep, "eagle3-reduced": reduced.eval(), "lm": noisy,
            "self": policy,
            "block": block.eval(), "block-corrected": corrected.eval(),
            "block-reduced": block_reduced.eval()}


PROMPT_LENGTHS = [1, 4, 12, 7, 2, 9, 5, 3, 15, 6, 8]


@pytest.mark.parametrize("kind", ["eagle3", "eagle3-deep", "eagle3-reduced", "lm", "self",
                                  "block", "block-corrected", "block-reduced"])
@pytest.mark.parametrize("gamma,adaptive", [(1, False), (4, False), (4, True)])
def test_greedy_speculation_equals_greedy_plain_decoding_token_for_token(policy, kind, gamma,
                                                                         adaptive):
    draft = drafts_for(policy)[kind]
    prompts = make_prompts(PROMPT_LENGTHS)
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=20)
    # 3 slots for 11 prompts and a capacity of 24 that cuts long responses: refills, ragged rows,
    # EOS and length finishes all happen.
    plain = GenerationEngine(policy, batch_size=3, max_seq_len=24).generate(prompts, greedy)
    spec = SpeculativeEngine(policy, draft, batch_size=3, gamma=gamma, adaptive=adaptive,
                             max_seq_len=24).generate(prompts, greedy)
    for a, b in zip(plain.completions, spec.completions):
        assert (b.tokens, b.finish_reason) == (a.tokens, a.finish_reason), f"prompt {a.index}"
        torch.testing.assert_close(b.logprobs, a.logprobs, atol=1e-4, rtol=0)
    if kind == "self" and not adaptive:
        assert spec.stats.acceptance_by_position == [1.0] * gamma


@pytest.mark.parametrize("engine", ["plain", "speculative"])
def test_each_answer_is_handed_over_once_as_it_finishes(policy, engine):
    """`on_answer` sees every completion once, finished, before generate returns: the answers a
    caller keeps on disk as they come (`cospec.draft.answer_store`) are the ones returned."""
    prompts = make_prompts(PROMPT_LENGTHS)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=10)
    make = (lambda: GenerationEngine(policy, batch_size=3) if engine == "plain"
            else SpeculativeEngine(policy, drafts_for(policy)["lm"], batch_size=3, gamma=3))
    seen = []
    result = make().generate(prompts, sampling, seeds=list(range(len(prompts))),
                             on_answer=lambda c: seen.append((c.index, list(c.tokens), c.finish_reason)))
    assert sorted(seen) == [(c.index, c.tokens, c.finish_reason) for c in result.completions]
    assert all(reason is not None for _, _, reason in seen)


def test_returned_logprobs_equal_the_policys_full_forward_logprobs(policy):
    draft = drafts_for(policy)["lm"]
    sampling = SamplingConfig(temperature=0.8, top_p=0.95, max_new_tokens=16)
    prompts = make_prompts([3, 8, 5, 11])
    spec = SpeculativeEngine(policy, draft, batch_size=2, gamma=3).generate(
        prompts, sampling, generator=torch.Generator().manual_seed(5))
    assert spec.stats.accept_length > 1.5  # the noisy copy is a good draft: many drafts accepted
    for c in spec.completions:
        seq = c.prompt + c.tokens
        with torch.no_grad():
            logits = policy(torch.tensor([seq])).logits[0, len(c.prompt) - 1:-1]
        ref = sampling_logprobs_NV(logits, sampling).gather(-1, torch.tensor(c.tokens)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=1e-4, rtol=0)


# ----------------------------------------------------------------------------- losslessness

TINY = ModelConfig(vocab_size=6, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1,
                   intermediate_size=32, max_seq_len=16)
HORIZON = 3


@torch.no_grad()
def exact_response_distribution(policy, prompt, sampling):
    """P(response) for every response of at most HORIZON tokens (ending early only at EOS),
    by a full forward over every prefix: the oracle."""
    dist = {}

    def expand(resp, prob):
        if resp and resp[-1] == EOS or len(resp) == HORIZON:
            dist[tuple(resp)] = dist.get(tuple(resp), 0.0) + prob
            return
        logits = policy(torch.tensor([prompt + resp])).logits[0, -1:]
        probs = warp_logits(logits, sampling.temperature, sampling.top_k, sampling.top_p).softmax(-1)[0]
        for tok, pr in enumerate(probs.tolist()):
            if pr > 0:
                expand(resp + [tok], prob * pr)

    expand([], 1.0)
    return dist


def fit_tiny_draft(policy, draft, steps=60):
    """`draft` fitted for a few TTT steps on the policy's own samples (acceptance well above a
    random draft's), so both the accept and the reject paths carry real mass. Returns (draft,
    the last step's metrics)."""
    samples = GenerationEngine(policy, batch_size=32, stop_ids=None).generate(
        [[BOS, 4]] * 32, SamplingConfig(max_new_tokens=10), generator=torch.Generator().manual_seed(0))
    seqs = [c.prompt + c.tokens for c in samples.completions]
    tokens = torch.tensor([t for s in seqs for t in s[:-1]])
    cu = torch.tensor([0] + list(itertools.accumulate(len(s) - 1 for s in seqs)))
    with torch.no_grad():
        out = policy(tokens[None], cu_seqlens=cu, tap_layers=draft.tap_layers)
    batch = TTTBatch(tokens=tokens, cu_seqlens=cu, loss_mask=torch.ones(len(tokens)),
                     taps={k: v[0] for k, v in out.taps.items()}, policy_logits=out.logits[0])
    opt = torch.optim.Adam(draft.parameters(), lr=1e-2)
    for _ in range(steps):
        loss, metrics = ttt_loss(draft, batch, num_steps=3)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return draft.eval(), metrics


def trained_tiny_draft(policy, vocab_ids=None, num_layers=1):
    torch.manual_seed(2)
    return fit_tiny_draft(policy, Eagle3Draft.from_policy(policy, vocab_ids=vocab_ids,
                                                          num_layers=num_layers))[0]


def chi_square_p_value(observed, expected):
    """Pearson's test, bins with expected count < 5 pooled; p-value from the chi-square survival
    function Q(dof/2, x/2)."""
    small = [i for i, e in enumerate(expected) if e < 5]
    obs = [o for i, o in enumerate(observed) if i not in small] + [sum(observed[i] for i in small)]
    exp = [e for i, e in enumerate(expected) if i not in small] + [sum(expected[i] for i in small)]
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    dof = len(exp) - 1
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                   torch.tensor(stat / 2, dtype=torch.float64)).item()


SAMPLES_PER_PROMPT = 3000


@pytest.mark.parametrize("draft_kind,gamma,temperature,top_p", [
    ("trained", 1, 1.0, 1.0),
    ("trained", 3, 1.0, 1.0),
    ("trained", 2, 0.7, 0.9),
    ("random", 3, 1.0, 1.0),
    ("random", 2, 1.3, 0.8),
    ("trained-reduced", 3, 1.0, 1.0),
    ("trained-reduced", 2, 0.7, 0.9),
    ("trained-reduced-scaled", 3, 1.0, 1.0),
    ("trained-deep", 3, 1.0, 1.0),
])
def test_speculative_samples_follow_the_exact_sequence_distribution(draft_kind, gamma, temperature,
                                                                    top_p):
    """Chi-square p-value > 1e-3 and TV <= 0.5 * sqrt(K / n) + 0.04 for K outcomes, n samples.

    E[TV] <= 0.5 * sum_i sqrt(p_i / n) <= 0.5 * sqrt(K / n) (Cauchy-Schwarz); one sample moves
    the empirical TV by at most 1/n, so P(TV > E[TV] + 0.04) <= exp(-2 n 0.04^2) < 1e-4
    (McDiarmid). A sampler that skips the residual correction, or warps q and p differently, is
    off by far more (TV of 0.1-0.4 here).
    """
    policy = make_policy(TINY, std=0.5, seed=4)
    # the reduced head covers the 3 ids this policy samples most (0, 1 and EOS; what
    # `draft_vocabulary` picks): responses through 3, 4 and 5 (~20% of its tokens) must still come
    # out with exactly their policy probability, from the residual alone
    reduced = torch.tensor([0, 1, EOS])
    draft = {"trained": lambda: trained_tiny_draft(policy),
             "trained-reduced": lambda: trained_tiny_draft(policy, reduced),
             "trained-reduced-scaled": lambda: trained_tiny_draft(policy, reduced),
             "trained-deep": lambda: trained_tiny_draft(policy, num_layers=2),
             "random": lambda: Eagle3Draft.from_policy(policy)}[draft_kind]()
    if draft_kind.endswith("scaled"):  # it proposes from softmax(2.5 * logits / T)
        draft.proposal_scale = 2.5
    sampling = SamplingConfig(temperature=temperature, top_p=top_p, max_new_tokens=HORIZON)
    prompts = [[BOS, 4, 5], [BOS]]  # ragged
    engine = SpeculativeEngine(policy, draft, batch_size=48, gamma=gamma)
    result = engine.generate(prompts * SAMPLES_PER_PROMPT, sampling,
                             generator=torch.Generator().manual_seed(11))
    if draft_kind.startswith("trained"):
        assert result.stats.acceptance_by_position[0] > 0.5
    if draft_kind.startswith("trained-reduced"):
        drafted_outside = [t for c in result.completions for t in c.tokens if t not in reduced]
        assert drafted_outside  # they occur; the check below says with exactly their probability
    assert_follows_exact_distribution(policy, prompts, result.completions, sampling)


def assert_follows_exact_distribution(policy, prompts, completions, sampling):
    """The completions (SAMPLES_PER_PROMPT per prompt, interleaved) against the exact response
    distribution: chi-square p-value and TV bounds of the test above."""
    for which, prompt in enumerate(prompts):
        exact = exact_response_distribution(policy, prompt, sampling)
        outcomes = sorted(exact)
        counts = {o: 0 for o in outcomes}
        for c in completions[which::len(prompts)]:
            counts[tuple(c.tokens)] += 1  # KeyError: an impossible response was generated
        n = SAMPLES_PER_PROMPT
        observed = [counts[o] for o in outcomes]
        expected = [exact[o] * n for o in outcomes]
        p_value = chi_square_p_value(observed, expected)
        tv = 0.5 * sum(abs(counts[o] / n - exact[o]) for o in outcomes)
        bound = 0.5 * math.sqrt(len(outcomes) / n) + 0.04
        assert p_value > 1e-3, f"prompt {which}: chi-square p-value {p_value:.2e}"
        assert tv <= bound, f"prompt {which}: TV {tv:.3f} > {bound:.3f}"


# ----------------------------------------------------------------------------- adaptive gamma

def synthetic_costs(batch_sizes=(1, 8, 64), gamma_max=4):
    """A forward costs 10 ms + 0.3 ms per token (N * T); a draft call 1 ms + 0.05 ms per entry."""
    cost = CostModel()
    for n in batch_sizes:
        for t in range(1, gamma_max + 2):
            cost.observe_verify(n, t, 0.010 + 0.0003 * n * t)
        for t in range(1, gamma_max + 2):
            cost.observe_draft(n, t, 0.001 + 0.00005 * n * t)
    return cost


class AlwaysPlain(AdaptiveGamma):
    """A controller that never drafts (what the adaptive one does where speculation cannot pay)."""

    def choose(self, n: int, catch_up: int = 0) -> int:
        return 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_adaptive_engine_at_gamma_0_samples_the_plain_engines_tokens_bit_for_bit(policy, temperature):
    """At gamma 0 a step is the plain engine's step: same forward, same draw from the same
    generator, so the same tokens and the same logprobs, not only the same distribution."""
    prompts = make_prompts(PROMPT_LENGTHS)
    sampling = SamplingConfig(temperature=temperature, max_new_tokens=12)
    draft = drafts_for(policy)["eagle3"]
    plain = GenerationEngine(policy, batch_size=4).generate(
        prompts, sampling, generator=torch.Generator().manual_seed(9))
    ctl = AlwaysPlain(4, synthetic_costs())
    spec = SpeculativeEngine(policy, draft, batch_size=4, gamma=4, controller=ctl)
    out = spec.generate(prompts, sampling, generator=torch.Generator().manual_seed(9))
    assert [c.tokens for c in out.completions] == [c.tokens for c in plain.completions]
    assert [c.logprobs for c in out.completions] == [c.logprobs for c in plain.completions]
    assert out.stats.gamma_counts == {0: out.stats.gamma_counts[0]}


def test_adaptive_controller_turns_speculation_off_for_a_useless_draft():
    ctl = AdaptiveGamma(4, synthetic_costs(), probe_every=1000)
    for _ in range(50):
        ctl.observe_acceptance(4, [0] * 8)  # every first draft rejected
    assert ctl.choose(1) == 0 and ctl.choose(64) == 0


def test_adaptive_controller_speculates_with_a_good_draft_and_backs_off_at_large_batch():
    ctl = AdaptiveGamma(4, synthetic_costs(), probe_every=1000)
    for _ in range(50):
        ctl.observe_acceptance(4, [4, 4, 3, 4])  # 15 of 16 accepted at every position
    assert ctl.choose(1) == 4
    # At 64 rows verifying 5 tokens costs 0.106 s against 0.029 s for 1: fewer drafts pay.
    assert ctl.choose(64) < ctl.choose(1)
    expected = [ctl.throughput(64, g) for g in range(5)]
    best = max(range(5), key=lambda g: expected[g])
    # Speculation is switched on only for a predicted gain of at least the margin (10%).
    assert ctl.choose(64) == (best if expected[best] >= 1.1 * expected[0] else 0)


def test_controller_keeps_plain_decoding_when_the_predicted_gain_is_below_the_margin():
    cost = CostModel()
    for t in range(1, 6):  # verifying T tokens costs T plain steps: speculation gains nothing
        cost.observe_verify(8, t, 0.01 * t)
        cost.observe_draft(8, t, 0.0)
    ctl = AdaptiveGamma(4, cost, probe_every=3)
    for _ in range(50):
        ctl.observe_acceptance(4, [4] * 8)
    # E(G) / (G + 1) < 1 for any acceptance < 1: never worth it, and a perfect draft only ties,
    # so the controller does not even probe.
    assert [ctl.choose(8) for _ in range(10)] == [0] * 10


def test_controller_probes_after_a_run_of_plain_steps_and_spaces_out_fruitless_probes():
    ctl = AdaptiveGamma(3, synthetic_costs(gamma_max=3), probe_every=5)
    for _ in range(50):
        ctl.observe_acceptance(3, [0] * 8)
    picks = [ctl.choose(1) for _ in range(200)]
    # after 5 plain steps, then 10, 20, 40, and at most every 16 x 5 = 80 from there
    probes = [i + 1 for i, g in enumerate(picks) if g]
    assert set(picks) == {0, 3} and probes == [5, 15, 35, 75, 155]


def test_expected_tokens_matches_the_closed_form_for_equal_acceptance():
    a = 0.7
    for g in range(6):
        assert math.isclose(expected_tokens([a] * 6, g), (1 - a ** (g + 1)) / (1 - a))


# ----------------------------------------------------------------------------- errors

def test_a_draft_of_another_vocabulary_is_a_clear_error(policy):
    other = Transformer(ModelConfig(vocab_size=60, hidden_size=64, num_layers=1, num_heads=4,
                                    num_kv_heads=2, intermediate_size=64))
    with pytest.raises(ValueError, match="vocab_size"):
        SpeculativeEngine(policy, other, batch_size=2)
    eagle = Eagle3Draft(ModelConfig(vocab_size=50, hidden_size=32, num_layers=4, num_heads=4,
                                    num_kv_heads=2, intermediate_size=64))
    with pytest.raises(ValueError, match="hidden_size"):
        SpeculativeEngine(policy, eagle, batch_size=2)


def test_a_prompt_too_long_for_the_cache_is_rejected_before_any_work(policy):
    engine = SpeculativeEngine(policy, drafts_for(policy)["eagle3"], batch_size=2, max_seq_len=10)
    with pytest.raises(ValueError, match="prompts may have at most 9 tokens"):
        engine.generate([[BOS] * 10], SamplingConfig())


# ----------------------------------------------------------------------------- host reads per step

class HostReads(torch.overrides.TorchFunctionMode):
    """Counts the calls that copy a device value to the host (a device sync on CUDA): tolist,
    item, and the Python conversions of a tensor. (Data-dependent shapes, e.g. boolean indexing,
    would sync too without passing here: the engines use none.)"""

    READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "nonzero"}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += getattr(func, "__name__", "") in self.READS
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", ["plain", "eagle3", "lm", "block-corrected", "adaptive"])
def test_every_step_reads_the_device_once(policy, kind):
    """One host read per policy forward (refill or step): the accepted counts, tokens, logprobs
    and the finiteness verdict travel in one copy; the caches learn their rows' lengths from the
    host (`KVCache.expect_longest`), and a speculative generate adds one read at its end (the
    overshoot sums)."""
    drafts = drafts_for(policy)
    if kind == "plain":
        engine = GenerationEngine(policy, batch_size=3)
    else:
        engine = SpeculativeEngine(policy, drafts.get(kind, drafts["eagle3"]), batch_size=3,
                                   gamma=3, adaptive=kind == "adaptive")
        if kind == "adaptive":  # calibration measures forwards on dummy rows: not a step
            engine.generate(make_prompts([4]), SamplingConfig(temperature=1.0, max_new_tokens=2))
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=12)
    prompts = make_prompts([3, 5, 4, 6, 2])
    with HostReads() as reads:
        result = engine.generate(prompts, sampling, generator=torch.Generator().manual_seed(0))
    assert result.num_forwards > 5
    assert reads.count == result.num_forwards + (kind != "plain")
