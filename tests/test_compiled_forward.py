"""Specification of cospec.rollout.compiled_forward (``rollout.compile``): the compiled decode and
verification forwards change how fast the engines run, never what they produce.

Oracles: SDPA (the attention), the eager engines (token for token, greedy and seeded sampling:
the compiled logits differ from eager only by float rounding, so the same uniforms draw the same
tokens). Policies use std 0.3 init so greedy decisions are not decided by float noise (as in
test_speculative.py). Each engine compiles a few graphs (seconds each on 2 cores), so the cases
are few and small.
"""

import dataclasses

import pytest
import torch

from cospec.config import SamplingConfig
from cospec.models.attention import AttentionLayout, cache_mask, matmul_cache_attention, sdpa_attention
from cospec.models.draft import Eagle3Draft
from cospec.rollout.compiled_forward import CompiledCacheForward, span_buckets
from cospec.rollout.engine import GenerationEngine
from cospec.rollout.speculative import SpeculativeEngine
from tests.test_speculative import CFG, make_policy, make_prompts

# A capacity past the smallest span (64), so runs cross from one span bucket to the next
CAPACITY = 90
PROMPT_LENGTHS = [1, 4, 12, 7, 2, 9, 5]


@pytest.fixture(scope="module")
def policy():
    return make_policy(dataclasses.replace(CFG, max_seq_len=CAPACITY))


def test_matmul_attention_equals_sdpa_on_ragged_rows_with_grouped_heads():
    torch.manual_seed(0)
    B, H, Hkv, T, S, D = 3, 8, 2, 5, 40, 16
    q, k, v = torch.randn(B, H, T, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
    layout = AttentionLayout(mask=cache_mask(torch.tensor([0, 11, 35]), T, S))
    torch.testing.assert_close(matmul_cache_attention(q, k, v, layout),
                               sdpa_attention(q, k, v, layout), atol=1e-5, rtol=0)


def test_spans_are_powers_of_two_from_64_ending_at_the_cache_size():
    assert span_buckets(40) == [40]
    assert span_buckets(90) == [64, 90]
    assert span_buckets(260) == [64, 128, 256, 260]
    assert span_buckets(256) == [64, 128, 256]


def run_both(make_engine, prompts, sampling, seed=0):
    eager, compiled = make_engine(False), make_engine(True)
    results = [e.generate(prompts, sampling, generator=torch.Generator().manual_seed(seed))
               for e in (eager, compiled)]
    return results, compiled.forward


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_compiled_plain_decoding_emits_the_eager_engines_tokens(policy, temperature):
    prompts = make_prompts(PROMPT_LENGTHS)
    sampling = SamplingConfig(temperature=temperature, max_new_tokens=CAPACITY)
    # 3 slots for 7 prompts and no EOS: refills, a tail, and rows that reach the capacity
    (eager, compiled), forward = run_both(
        lambda c: GenerationEngine(policy, batch_size=3, max_seq_len=CAPACITY, stop_ids=None,
                                   compile=c), prompts, sampling)
    for a, b in zip(eager.completions, compiled.completions):
        assert (b.tokens, b.finish_reason) == (a.tokens, a.finish_reason), f"prompt {a.index}"
        torch.testing.assert_close(b.logprobs, a.logprobs, atol=1e-4, rtol=0)
    # the whole-batch decodes ran compiled (over both spans), the prefills and the tail eagerly
    assert isinstance(forward, CompiledCacheForward)
    assert all(n > 0 for n in forward.compiled_calls_by_span.values()), forward.compiled_calls_by_span
    assert forward.num_eager_calls > len(prompts) - 3


def test_compiled_speculative_verification_emits_the_eager_engines_tokens(policy):
    torch.manual_seed(1)
    draft = Eagle3Draft.from_policy(policy).eval()
    prompts = make_prompts(PROMPT_LENGTHS)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=CAPACITY)
    (eager, compiled), forward = run_both(
        lambda c: SpeculativeEngine(policy, draft, batch_size=3, gamma=2, max_seq_len=CAPACITY,
                                    stop_ids=None, compile=c),
        prompts, sampling)
    for a, b in zip(eager.completions, compiled.completions):
        assert (b.tokens, b.finish_reason) == (a.tokens, a.finish_reason), f"prompt {a.index}"
    assert compiled.stats.acceptance_by_position == eager.stats.acceptance_by_position
    assert forward.num_compiled_calls > 0


# Adaptive picks gamma from timings, which compiling changes (so sampled runs draw differently);
# its greedy tokens are still the policy's.
@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_compiled_speculation_equals_greedy_plain_decoding(policy, adaptive):
    torch.manual_seed(1)
    draft = Eagle3Draft.from_policy(policy).eval()
    prompts = make_prompts(PROMPT_LENGTHS)
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=CAPACITY)
    plain = GenerationEngine(policy, batch_size=3, max_seq_len=CAPACITY, stop_ids=None)
    spec = SpeculativeEngine(policy, draft, batch_size=3, gamma=2, adaptive=adaptive,
                             max_seq_len=CAPACITY, stop_ids=None, compile=True)
    for a, b in zip(plain.generate(prompts, greedy).completions,
                    spec.generate(prompts, greedy).completions):
        assert b.tokens == a.tokens, f"prompt {a.index}"
