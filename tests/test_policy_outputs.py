"""Offline draft training keeps the policy's outputs over its answers, or recomputes them per read
(`draft.keep_policy_outputs`): the same batches and the same draft either way, one batch held when
recomputed, and a clear error up front when keeping them would not fit."""

import dataclasses
import gc
import sys
import weakref

import pytest
import torch

from cospec.config import ConfigError, resolve
from cospec.draft import policy_outputs
from cospec.draft.losses import compress_to_head
from cospec.draft.offline import sample_responses, task_data, train_draft_offline
from cospec.draft.policy_outputs import KeptBatches, RecomputedBatches, pack_answers, policy_batches
from cospec.models.draft import default_tap_layers
from cospec.models.llama import MASKED_LOGIT, Transformer

OVERRIDES = ["draft.num_train_prompts=12", "draft.num_eval_prompts=4", "sampling.max_new_tokens=10",
             "draft.tokens_per_batch=40", "draft.train_steps=6", "draft.eval_every=3",
             "draft.vocab_size=12"]


@pytest.fixture(scope="module")
def setup():
    cfg = resolve("tiny", overrides=OVERRIDES)
    torch.manual_seed(0)
    policy = Transformer(cfg.model).eval()
    answers = sample_responses(cfg, policy, task_data(cfg, None), progress=False)
    return cfg, policy, answers


def test_answers_pack_in_order_within_the_token_budget_and_each_answer_once(setup):
    cfg, _, answers = setup
    packed = pack_answers(answers, cfg.draft.tokens_per_batch)
    sequences = [p.cu_seqlens.diff().tolist() for p in packed]
    assert sum(len(s) for s in sequences) == len([a for a in answers if a.tokens])
    assert [n for s in sequences for n in s] == [len(a.prompt) + len(a.tokens) - 1
                                                for a in answers if a.tokens]
    assert all(sum(s) <= cfg.draft.tokens_per_batch or len(s) == 1 for s in sequences)
    assert len(packed) > 2  # the budget splits these answers: several batches to draw from


@pytest.fixture(scope="module")
def narrow():
    """A policy narrower (C = 16) than a 24-id draft head: what is kept of a position is then its
    normed hidden state and a bucket (17 numbers), not the head's 25 logits, as for SmolLM2. Like
    SmolLM2 too: a head tied to the embedding, a final norm that is not all ones, T = 0.7."""
    cfg = resolve("tiny", overrides=OVERRIDES + NARROW + ["model.tie_embeddings=true",
                                                          "sampling.temperature=0.7"])
    torch.manual_seed(0)
    policy = Transformer(cfg.model).eval()
    with torch.no_grad():
        policy.norm.weight.uniform_(0.5, 1.5)
    answers = sample_responses(cfg, policy, task_data(cfg, None), progress=False)
    return cfg, policy, answers


NARROW = ["model.hidden_size=16", "model.num_heads=2", "model.num_kv_heads=1",
          "model.intermediate_size=32"]
# A head narrower than the policy (12 ids < C = 64: its logits kept) and one wider (24 > C = 16).
HEADS = [("setup", torch.arange(0, 24, 2)), ("narrow", torch.arange(1, 49, 2))]


@pytest.mark.parametrize("world, ids", HEADS)
def test_a_batch_holds_the_policys_own_taps_and_its_logits_on_the_head_plus_a_bucket(world, ids, request):
    """Against the policy called directly on the packed answers and `compress_to_head` (kept as
    hidden states, the head's columns come from a matmul over its own rows: equal up to rounding)."""
    cfg, policy, answers = request.getfixturevalue(world)
    packed = pack_answers(answers, cfg.draft.tokens_per_batch)[1]
    taps = default_tap_layers(cfg.model.num_layers)
    with torch.no_grad():
        out = policy(packed.tokens, cu_seqlens=packed.cu_seqlens, tap_layers=taps)
    for keep in (True, False):
        batch = policy_batches(cfg, policy, answers, vocab_ids=ids, keep=keep)[1]
        assert torch.equal(batch.tokens, packed.tokens[0])
        assert torch.equal(batch.loss_mask, packed.loss_mask[0])
        assert batch.taps.keys() == set(taps)  # the default low, mid and high taps
        assert all(torch.equal(batch.taps[k], out.taps[k][0]) for k in batch.taps)
        torch.testing.assert_close(batch.policy_logits,
                                   compress_to_head(out.logits[0], ids, cfg.sampling.temperature),
                                   rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("world, ids", HEADS)
def test_under_draft_autocast_the_targets_are_the_policys_forward_in_that_precision(world, ids, request):
    """draft.autocast=bfloat16 runs the policy's forward that makes the targets in bf16 autocast,
    as the rollouts' bf16 policy and the GRPO step's forward (grpo.autocast) compute p: the batch
    is that forward's, kept or recomputed, and not the fp32 one."""
    cfg, policy, answers = request.getfixturevalue(world)
    bf16 = dataclasses.replace(cfg, draft=dataclasses.replace(cfg.draft, autocast="bfloat16"))
    packed = pack_answers(answers, cfg.draft.tokens_per_batch)[1]
    taps = default_tap_layers(cfg.model.num_layers)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = policy(packed.tokens, cu_seqlens=packed.cu_seqlens, tap_layers=taps)
    fp32 = policy_batches(cfg, policy, answers, vocab_ids=ids, keep=False)[1]
    for keep in (True, False):
        batch = policy_batches(bf16, policy, answers, vocab_ids=ids, keep=keep)[1]
        assert all(torch.equal(batch.taps[k], out.taps[k][0]) for k in batch.taps)
        assert not any(torch.equal(batch.taps[k], fp32.taps[k]) for k in batch.taps)
        # kept as hidden states (narrow), the head's columns come from an fp32 matmul over the
        # autocast forward's hidden state: its logits up to their bf16 rounding
        tol = 1e-5 if world == "setup" else 4e-3
        torch.testing.assert_close(batch.policy_logits,
                                   compress_to_head(out.logits[0], ids, cfg.sampling.temperature),
                                   rtol=tol, atol=tol)
        assert batch.policy_logits.dtype == torch.float32


def test_a_kept_position_holds_the_fewer_numbers_hidden_and_bucket_or_the_heads_logits(setup, narrow):
    """K C + min(C + 1, Vd + 1) numbers a kept position: SmolLM2's 3 x 576 + 577 instead of
    3 x 576 + 8193 (policy_outputs' docstring)."""
    for (cfg, policy, answers), ids in [(setup, HEADS[0][1]), (narrow, HEADS[1][1])]:
        kept = policy_batches(cfg, policy, answers, vocab_ids=ids)
        C, K = cfg.model.hidden_size, len(set(default_tap_layers(cfg.model.num_layers)))
        assert policy_outputs.kept_bytes_per_token(kept.outputs[0]) == 4 * (K * C + min(C, len(ids)) + 1)
        assert (kept.outputs[0].normed is not None) == (len(ids) > C)


def test_a_head_id_the_policy_never_samples_reads_as_masked_from_kept_hidden_states(narrow):
    """An id past the tokenizer's vocabulary carries MASKED_LOGIT in the forward's logits; read
    back from a kept hidden state it must too (else the target would give it mass)."""
    cfg, policy, answers = narrow
    policy.sampled_vocab_size = 45
    try:
        ids = torch.arange(1, 49, 2)  # 45 and 47 are past it
        packed = pack_answers(answers, cfg.draft.tokens_per_batch)[0]
        with torch.no_grad():
            out = policy(packed.tokens, cu_seqlens=packed.cu_seqlens)
        batch = policy_batches(cfg, policy, answers, vocab_ids=ids)[0]
        assert (batch.policy_logits[:, -3:-1] == MASKED_LOGIT).all()
        torch.testing.assert_close(batch.policy_logits,
                                   compress_to_head(out.logits[0], ids, cfg.sampling.temperature),
                                   rtol=1e-6, atol=1e-6)
    finally:
        policy.sampled_vocab_size = None


@pytest.mark.parametrize("world, ids", HEADS)
def test_recomputed_batches_are_the_kept_ones_bit_for_bit(world, ids, request):
    cfg, policy, answers = request.getfixturevalue(world)
    kept = policy_batches(cfg, policy, answers, vocab_ids=ids)
    lazy = policy_batches(cfg, policy, answers, vocab_ids=ids, keep=False)
    assert isinstance(kept, KeptBatches) and isinstance(lazy, RecomputedBatches)
    assert len(kept) == len(lazy) > 2
    assert len(kept[1:3]) == 2 and torch.equal(kept[1:3][0].policy_logits, kept[1].policy_logits)
    for a, b in zip(kept, lazy):
        assert a.policy_logits.shape[-1] == len(ids) + 1  # the head's columns and one bucket
        for field in ("tokens", "cu_seqlens", "loss_mask", "policy_logits"):
            assert torch.equal(getattr(a, field), getattr(b, field)), field
        assert a.taps.keys() == b.taps.keys()
        assert all(torch.equal(a.taps[k], b.taps[k]) for k in a.taps)


def test_recomputed_batches_hold_nothing_and_run_one_policy_forward_per_read(setup, monkeypatch):
    cfg, policy, answers = setup
    calls = []
    forward = policy.forward
    monkeypatch.setattr(policy, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    lazy = policy_batches(cfg, policy, answers, keep=False)
    assert not calls and len(lazy) > 2
    first, again = lazy[1], lazy[1]
    assert len(calls) == 2 and torch.equal(first.policy_logits, again.policy_logits)
    read = weakref.ref(first.policy_logits)
    del first, again
    gc.collect()
    assert read() is None  # the sequence kept no reference to what it computed
    with pytest.raises(IndexError):
        lazy[len(lazy)]


@pytest.mark.parametrize("kind, narrow", [("eagle3", False), ("block", False), ("eagle3", True)])
def test_draft_train_makes_the_same_draft_with_outputs_kept_or_recomputed(kind, narrow, monkeypatch):
    """The whole offline path (answers, vocabulary, batches, steps, held-out measurements): the
    drafts and their metrics are equal bit for bit; kept, each batch's forward ran once, up front;
    recomputed, once per training step (the held-out answers' stay kept)."""
    runs, reads = {}, []
    read = RecomputedBatches.kept_outputs  # the policy forward of a batch, kept or recomputed
    monkeypatch.setattr(RecomputedBatches, "kept_outputs", lambda self, i: reads.append(i) or read(self, i))
    for keep in ("true", "false"):
        reads.clear()
        cfg = resolve("tiny", overrides=OVERRIDES + [f"draft.kind={kind}", "draft.ttt_steps=2",
                                                     f"draft.keep_policy_outputs={keep}"]
                      + (NARROW + ["draft.vocab_size=24"] if narrow else []))
        torch.manual_seed(0)
        policy = Transformer(cfg.model).eval()
        runs[keep] = train_draft_offline(cfg, policy, progress=False)
        batches, held = runs[keep][1]["num_batches"], runs[keep][1]["num_held_out_batches"]
        assert len(reads) == (batches if keep == "true" else 6) + held  # draft.train_steps=6
    (kept, m_kept), (lazy, m_lazy) = runs["true"], runs["false"]
    assert all(torch.equal(a, b) for a, b in zip(kept.state_dict().values(), lazy.state_dict().values()))
    assert m_kept["loss_history"] == m_lazy["loss_history"]
    assert m_kept["held_out"] == m_lazy["held_out"] and len(m_kept["held_out"]) == 3  # steps 0, 3, 6


def test_keeping_outputs_past_the_available_memory_fails_before_the_second_forward(setup, monkeypatch):
    cfg, policy, answers = setup
    calls = []
    forward = policy.forward
    monkeypatch.setattr(policy, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    per_batch = policy_batches(cfg, policy, answers[:1])[0]
    per_token = sum(t[0].numel() * t.element_size()
                    for t in [per_batch.policy_logits, *per_batch.taps.values()])
    total_tokens = sum(p.tokens.shape[1] for p in pack_answers(answers, cfg.draft.tokens_per_batch))
    calls.clear()
    need = per_token * total_tokens
    monkeypatch.setattr(policy_outputs, "available_memory", lambda device: int(need / 0.91))
    with pytest.raises(ConfigError, match="draft.keep_policy_outputs=false"):
        policy_batches(cfg, policy, answers)  # 91% of the memory: past the 90% they may take
    assert len(calls) == 1
    monkeypatch.setattr(policy_outputs, "available_memory", lambda device: int(need / 0.89))
    assert len(policy_batches(cfg, policy, answers)) > 2
    monkeypatch.setattr(policy_outputs, "available_memory", lambda device: None)  # cannot be told
    assert len(policy_batches(cfg, policy, answers)) > 2


def test_the_hosts_available_memory_is_read_where_it_can_be():
    available = policy_outputs.available_memory("cpu")
    if sys.platform == "linux":
        assert available is not None and available > 0
    if torch.cuda.is_available():
        assert policy_outputs.available_memory("cuda") > 0
