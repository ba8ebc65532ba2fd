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
from cospec.models.block_draft import BlockDraft
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
    return make_policy(dataclasses.replace(CFG, max_seq_len=CAPACITY, num_layers=2))


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
    return results, compiled


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_compiled_plain_decoding_emits_the_eager_engines_tokens(policy, temperature):
    prompts = make_prompts(PROMPT_LENGTHS)
    sampling = SamplingConfig(temperature=temperature, max_new_tokens=CAPACITY)
    # 3 slots for 7 prompts and no EOS: refills, a tail, and rows that reach the capacity
    (eager, compiled), engine = run_both(
        lambda c: GenerationEngine(policy, batch_size=3, max_seq_len=CAPACITY, stop_ids=None,
                                   compile=c), prompts, sampling)
    forward = engine.forward
    for a, b in zip(eager.completions, compiled.completions):
        assert (b.tokens, b.finish_reason) == (a.tokens, a.finish_reason), f"prompt {a.index}"
        torch.testing.assert_close(b.logprobs, a.logprobs, atol=1e-4, rtol=0)
    # the whole-batch decodes ran compiled (over both spans), the prefills and the tail eagerly
    assert isinstance(forward, CompiledCacheForward)
    assert all(n > 0 for n in forward.compiled_calls_by_span.values()), forward.compiled_calls_by_span
    assert forward.num_eager_calls > len(prompts) - 3


@pytest.mark.parametrize("kind", ["eagle3", "eagle3-deep", "block"])
def test_compiled_speculation_emits_the_eager_engines_tokens(policy, kind):
    torch.manual_seed(1)
    draft = (BlockDraft.from_policy(policy) if kind == "block" else
             Eagle3Draft.from_policy(policy, num_layers=2 if kind == "eagle3-deep" else 1)).eval()
    prompts = make_prompts(PROMPT_LENGTHS)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=CAPACITY)
    (eager, compiled), compiled_engine = run_both(
        lambda c: SpeculativeEngine(policy, draft, batch_size=3, gamma=2, max_seq_len=CAPACITY,
                                    stop_ids=None, compile=c),
        prompts, sampling)
    forward = compiled_engine.forward
    for a, b in zip(eager.completions, compiled.completions):
        assert (b.tokens, b.finish_reason) == (a.tokens, a.finish_reason), f"prompt {a.index}"
    assert compiled.stats.acceptance_by_position == eager.stats.acceptance_by_position
    assert forward.num_compiled_calls > 0  # verification
    if kind != "block":  # and the draft's one-token steps (a block draft's stay eager)
        assert compiled_engine.drafter.forward.num_compiled_calls > 0


# Adaptive speculation compiled: test_adaptive_cost_model_leaves_out_steps_that_compiled, greedy.
def test_greedy_compiled_speculation_equals_greedy_plain_decoding(policy):
    torch.manual_seed(1)
    draft = Eagle3Draft.from_policy(policy).eval()
    prompts = make_prompts(PROMPT_LENGTHS)
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=CAPACITY)
    plain = GenerationEngine(policy, batch_size=3, max_seq_len=CAPACITY, stop_ids=None)
    spec = SpeculativeEngine(policy, draft, batch_size=3, gamma=2, max_seq_len=CAPACITY,
                             stop_ids=None, compile=True)
    for a, b in zip(plain.generate(prompts, greedy).completions,
                    spec.generate(prompts, greedy).completions):
        assert b.tokens == a.tokens, f"prompt {a.index}"


def test_rl_with_rollout_compile_decodes_with_the_updated_weights(tmp_path):
    """``rollout.compile=true`` gives the trainer a compiled engine, and a policy update reaches
    its graphs (the weight sync copies into the module they read): after a step, its greedy
    rollouts are those of an eager engine on the updated policy."""
    from cospec.config import resolve
    from cospec.models.llama import Transformer
    from cospec.rl.trainer import GRPOTrainer

    cfg = resolve("tiny", overrides=[f"out_dir={tmp_path}", "grpo.prompts_per_step=2",
                                     "grpo.group_size=2", "grpo.lr=3e-2", "rollout.compile=true"])
    torch.manual_seed(0)
    trainer = GRPOTrainer(cfg, Transformer(cfg.model), tensorboard=False)
    assert isinstance(trainer.engine.forward, CompiledCacheForward)
    prompts = [trainer.data.prompt_ids(trainer.data.source.sample(trainer.prompt_rng))
               for _ in range(8)]
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=16)
    before = trainer.engine.generate(prompts, greedy).completions
    batch = trainer.generate()
    batch.rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])  # rigged, so the update moves the policy
    trainer.compute_advantages(batch)
    trainer.train_policy(batch)
    trainer.sync_weights()
    after = trainer.engine.generate(prompts, greedy).completions
    eager = GenerationEngine(trainer.rollout_policy, batch_size=cfg.sampling.batch_size,
                             stop_ids=trainer.data.tokenizer.stop_ids).generate(prompts, greedy)
    assert [c.tokens for c in after] == [c.tokens for c in eager.completions]
    assert [c.tokens for c in after] != [c.tokens for c in before], "the update changed nothing"
    assert trainer.engine.forward.num_compiled_calls > 0


def test_precompile_compiles_only_the_spans_a_run_can_reach(policy):
    """`longest_row` bounds the slots a run's rows hold, so the spans past it are never called:
    precompiled up to it, a run compiles nothing more, and the 90-slot span was never built."""
    from cospec.rollout.compiled_forward import longest_row, precompile_engine

    engine = GenerationEngine(policy, batch_size=3, max_seq_len=CAPACITY, stop_ids=None,
                              compile=True)
    prompts, sampling = make_prompts(PROMPT_LENGTHS), SamplingConfig(max_new_tokens=20)
    precompile_engine(engine, longest_row(prompts, sampling.max_new_tokens))
    assert engine.forward.num_graphs == 1  # the 64-slot span's decode
    engine.generate(prompts, sampling)
    assert engine.forward.num_graphs == 1 and engine.forward.compiled_calls_by_span[CAPACITY] == 0
    assert engine.forward.compiled_calls_by_span[64] > 0


def test_adaptive_cost_model_leaves_out_steps_that_compiled(policy):
    """A step whose forward compiles a graph takes seconds: the controller must not read that as
    the step's cost. After `precompile_engine` no step compiles, and every step is observed.
    Adaptive picks gamma from timings, which compiling changes (so sampled runs would draw
    differently): its greedy tokens are still the plain engine's, with refills and both spans."""
    from cospec.rollout.compiled_forward import graphs_called, precompile_engine

    torch.manual_seed(1)
    engine = SpeculativeEngine(policy, Eagle3Draft.from_policy(policy).eval(), batch_size=3,
                               gamma=2, adaptive=True, max_seq_len=CAPACITY, stop_ids=None,
                               compile=True)
    prompts = make_prompts(PROMPT_LENGTHS)
    engine.generate(prompts, SamplingConfig(max_new_tokens=4))  # calibrates on the 64-slot span
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=CAPACITY)
    plain = GenerationEngine(policy, batch_size=3, max_seq_len=CAPACITY, stop_ids=None)
    plain_tokens = [c.tokens for c in plain.generate(prompts, greedy).completions]
    observed = []
    observe = engine.controller.cost.observe_verify
    engine.controller.cost.observe_verify = lambda n, t, s: (observed.append(t), observe(n, t, s))

    def run():
        observed.clear()
        before = graphs_called(engine)
        result = engine.generate(prompts, greedy)
        assert [c.tokens for c in result.completions] == plain_tokens
        return sum(result.stats.gamma_counts.values()), graphs_called(engine) - before

    steps, new_graphs = run()  # rows grow past 64 slots: the 90-slot span compiles mid-run
    assert new_graphs > 0 and len(observed) < steps
    precompile_engine(engine)
    steps, new_graphs = run()
    assert new_graphs == 0 and len(observed) == steps
