"""Specification of the block draft (cospec.models.block_draft, cospec.draft.block_ttt,
cospec.rollout.drafter.BlockDrafter): one forward proposes a block, trained on blocks anchored everywhere.

Oracles: a dense per-anchor forward written here from the model's parts and plain masked SDPA
(training attention, forward and backward), the decoding path with a KV cache (train and decode
see the same thing) and the exact response distribution (losslessness, from test_speculative;
greedy equality with the plain engine is test_speculative's, whose drafts include block ones).
"""

import itertools

import pytest
import torch
import torch.nn.functional as F

from cospec.config import ModelConfig, SamplingConfig
from cospec.data.tokenizer import BOS, EOS
from cospec.draft.ttt import TTTBatch, ttt_steps
from cospec.draft.block_ttt import block_unroll
from cospec.models.block_draft import BlockDraft
from cospec.models.draft_checkpoint import load_draft, save_draft
from cospec.models.llama import apply_rope, rope_cos_sin
from cospec.rollout.adaptive import AdaptiveGamma
from cospec.rollout.kv_cache import KVCache
from cospec.rollout.speculative import SpeculativeEngine
from test_speculative import (HORIZON, SAMPLES_PER_PROMPT, TINY, assert_follows_exact_distribution,
                              fit_tiny_draft, make_policy)

CFG = ModelConfig(vocab_size=50, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                  intermediate_size=128, max_seq_len=64)


def packed_batch(policy, draft, lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    V = policy.config.vocab_size
    seqs = [[BOS] + torch.randint(4, V, (n - 1,), generator=gen).tolist() for n in lengths]
    tokens = torch.tensor([t for s in seqs for t in s])
    cu = torch.tensor([0] + list(itertools.accumulate(lengths)))
    with torch.no_grad():
        out = policy(tokens[None], cu_seqlens=cu, tap_layers=draft.tap_layers)
    return TTTBatch(tokens=tokens, cu_seqlens=cu, loss_mask=torch.ones(len(tokens)),
                    taps={k: v[0] for k, v in out.taps.items()}, policy_logits=out.logits[0])


def dense_block_logits(draft: BlockDraft, batch: TTTBatch, G: int) -> torch.Tensor:
    """[T, G, Vd] by brute force: for each anchor t, the context entries 0..t of its sequence and
    the block's G queries, one masked SDPA per layer over [context ; block] keys."""
    steps = ttt_steps(draft, batch, G)
    cu, cfg = batch.cu_seqlens.tolist(), draft.config
    feats = draft.fc(steps.feat_raw_TF)
    out = []
    for s0, s1 in zip(cu[:-1], cu[1:]):
        for t in range(s0, s1):
            n = t - s0  # the anchor's position; context entries 0..n
            ctx = feats[s0:t + 1][None]
            x = draft.block_inputs(batch.tokens[t:t + 1], G)
            ccos, csin = rope_cos_sin(torch.arange(n + 1)[None], cfg)
            bcos, bsin = rope_cos_sin(torch.arange(n, n + G)[None], cfg)
            # query i sees all n + 1 context keys and block keys 0..i
            mask = torch.cat([torch.ones(G, n + 1, dtype=torch.bool),
                              torch.ones(G, G, dtype=torch.bool).tril()], 1)
            for lid, layer in draft.layers.items():
                a = layer.self_attn
                ck, cv = draft.context_kv(int(lid), ctx, ccos, csin)
                h = layer.input_layernorm(x)
                q = apply_rope(a.q_proj(h).view(1, G, a.num_heads, -1).transpose(1, 2), bcos, bsin)
                k = apply_rope(a.k_proj(h).view(1, G, a.num_kv_heads, -1).transpose(1, 2), bcos, bsin)
                v = a.v_proj(h).view(1, G, a.num_kv_heads, -1).transpose(1, 2)
                o = F.scaled_dot_product_attention(q, torch.cat([ck, k], 2), torch.cat([cv, v], 2),
                                                   attn_mask=mask, enable_gqa=True)
                x = x + a.o_proj(o.transpose(1, 2).reshape(1, G, -1))
                x = x + layer.mlp(layer.post_attention_layernorm(x))
            ys = [batch.tokens[min(t + i, s1 - 1)] for i in range(G)]  # the token at t + i
            out.append(torch.stack([draft.logits(draft.corrected(x[0, i], ys[i])) for i in range(G)]))
    return torch.stack(out)


def trained_like(draft):
    """Non-trivial correction and mask weights (they start at zero or near it)."""
    with torch.no_grad():
        if draft.has_correction:
            draft.correction.weight.normal_(std=0.1)
        draft.mask_embedding.normal_(std=1.0)
    return draft


@pytest.mark.parametrize("num_layers,correction", [(1, True), (2, False), (2, True)])
def test_block_training_attention_equals_a_dense_masked_reference_forward_and_backward(num_layers,
                                                                                     correction):
    policy = make_policy(CFG)
    torch.manual_seed(3)
    draft = trained_like(BlockDraft.from_policy(policy, num_layers=num_layers,
                                                correction=correction)).double()
    batch = packed_batch(policy.double(), draft, [5, 1, 7])
    G = 3
    steps = ttt_steps(draft, batch, G)
    logits, _ = block_unroll(draft, steps, batch.cu_seqlens)
    got = torch.stack(logits, 1)  # [T, G, V]
    want = dense_block_logits(draft, batch, G)
    # only where the target exists (position i at anchor t inside the sequence)
    inside = steps.inside_JT.T[..., None]
    torch.testing.assert_close(got * inside, want * inside, atol=1e-10, rtol=1e-10)
    weights = torch.randn_like(got) * inside
    g_got = torch.autograd.grad((got * weights).sum(), list(draft.parameters()), allow_unused=True)
    g_want = torch.autograd.grad((want * weights).sum(), list(draft.parameters()), allow_unused=True)
    for (name, _), a, b in zip(draft.named_parameters(), g_got, g_want):
        if a is None or b is None:
            assert a is None and b is None or float((a if a is not None else b).abs().max()) == 0, name
            continue
        # fp64 throughout but RMSNorm's fp32 core, whose rounding the reference pays once per
        # anchor (it recomputes the context for each): agreement to ~1e-7 of the largest entry
        torch.testing.assert_close(a, b, atol=1e-6 * float(b.abs().max()), rtol=1e-6,
                                   msg=lambda m: f"{name}: {m}")


def test_the_decoding_path_proposes_what_training_computes():
    """add_context + propose with a KV cache (ragged rows, several calls) gives the training
    unroll's logits at the same anchor: the draft is used as it is trained."""
    policy = make_policy(CFG)
    torch.manual_seed(4)
    draft = trained_like(BlockDraft.from_policy(policy, num_layers=2, correction=True)).eval()
    batch = packed_batch(policy, draft, [6, 9])
    G = 4
    steps = ttt_steps(draft, batch, G)
    with torch.no_grad():
        logits, _ = block_unroll(draft, steps, batch.cu_seqlens)
        train = torch.stack(logits, 1)
        feats = draft.fc(steps.feat_raw_TF)
        cache = KVCache.for_model(draft, 2, 64)
        rows = torch.tensor([0, 1])
        # context in two ragged calls: entries 0..2 / 0..4, then up to the anchors 4 / 7
        cu = batch.cu_seqlens.tolist()
        first, anchors = [3, 5], [4, 7]
        W = max(first)
        def pad(r, a, b):  # entries a..b-1 of sequence r, padded to W with its first entry
            return torch.cat([feats[cu[r] + a:cu[r] + b], feats[cu[r]:cu[r] + 1].expand(W - (b - a), -1)])
        draft.add_context(cache, torch.stack([pad(r, 0, first[r]) for r in range(2)]), rows,
                          torch.tensor(first))
        W = max(a + 1 - f for a, f in zip(anchors, first))
        draft.add_context(cache, torch.stack([pad(r, first[r], anchors[r] + 1) for r in range(2)]),
                          rows, torch.tensor([a + 1 - f for a, f in zip(anchors, first)]))
        anchor_tokens = torch.tensor([int(batch.tokens[cu[r] + anchors[r]]) for r in range(2)])
        hidden = draft.propose(cache, anchor_tokens, G, rows)
        for r in range(2):
            t = cu[r] + anchors[r]
            for i in range(G):
                if not steps.inside_JT[i, t]:
                    continue
                y = steps.tokens_JT[i, t]
                got = draft.logits(draft.corrected(hidden[r, i], y))
                torch.testing.assert_close(got, train[t, i], atol=1e-5, rtol=1e-5)
    assert cache.lengths_B.tolist() == [a + 1 for a in anchors]  # the block is not kept


@pytest.mark.parametrize("correction", [False, True])
def test_a_row_is_drafted_alike_whether_the_step_addresses_the_whole_batch_or_its_row(correction):
    """Batch 1 drafts through the whole-batch path (rows None), a batch of 4 holding one row
    through the indexed one: the same prompt gets the same q at every step (the row's random
    stream is its prompt's, so both runs draw alike, emit the same tokens and reach the same
    anchors; not greedy, whose q is one-hot and would hide a wrong logit). Worth a test: a
    batch-1 benchmark on SmolLM2 once read a lower acceptance than batch 16 (the sample's doing,
    docs/results/block_drafter.md, "SmolLM2: why batch 1 read lower")."""
    policy = make_policy(CFG)
    torch.manual_seed(3)
    draft = trained_like(BlockDraft.from_policy(policy, correction=correction)).eval()
    prompt, sampling = [BOS, 5, 6, 7, 8], SamplingConfig(temperature=1.0, max_new_tokens=48)

    def q_by_anchor(batch_size):
        engine = SpeculativeEngine(policy, draft, batch_size=batch_size, gamma=3, stop_ids=None)
        drafted, draft_block = {}, engine.drafter.draft

        def recorded(cache, anchor_N, gamma, rows_N, *args):
            drafts, q, conf = draft_block(cache, anchor_N, gamma, rows_N, *args)
            drafted[engine.n[0 if rows_N is None else int(rows_N[0])]] = q[0]
            return drafts, q, conf
        engine.drafter.draft = recorded
        result = engine.generate([prompt], sampling, generator=torch.Generator().manual_seed(0))
        tokens = result.completions[0].tokens
        return drafted, tokens

    (whole, tokens_whole), (indexed, tokens_indexed) = q_by_anchor(1), q_by_anchor(4)
    assert tokens_whole == tokens_indexed and len(whole) > 10 and whole.keys() == indexed.keys()
    for n in whole:
        torch.testing.assert_close(whole[n], indexed[n], atol=1e-6, rtol=0, msg=f"anchor {n}")


def trained_tiny_block_draft(policy, vocab_ids=None, steps=80, correction=False):
    """A block draft fitted on the policy's own samples: (draft, last metrics)."""
    torch.manual_seed(2)
    draft = BlockDraft.from_policy(policy, vocab_ids=vocab_ids, correction=correction)
    return fit_tiny_draft(policy, draft, steps)


def confident_controller(gamma):
    """A controller whose cost model makes every draft cost: verifying k drafts costs 1 + 0.15 k,
    so the last drafts of a block, rarely reached, are not worth verifying. No probes: a plain
    step it took to measure plain decoding would read as a block cut to nothing."""
    c = AdaptiveGamma(gamma, probe_every=10 ** 6)
    for n in (1, 2, 4, 8, 16, 32, 48, 64):
        for t in range(1, gamma + 2):
            c.cost.observe_verify(n, t, 1.0 + 0.15 * (t - 1))
            c.cost.observe_draft(n, t, 0.01)
        for g in range(1, gamma + 1):
            c.cost.observe_block(n, g, 0.01)
    c.margin = -1.0  # always draft: the verify length is what this exercises
    return c


@pytest.mark.parametrize("variant,gamma,temperature,top_p", [
    ("trained", 3, 1.0, 1.0),
    ("trained", 2, 0.7, 0.9),
    ("trained-reduced", 3, 1.0, 1.0),
    ("trained-scaled", 3, 1.0, 1.0),
    ("confidence-scheduled", 3, 1.0, 1.0),
])
def test_block_speculative_samples_follow_the_exact_sequence_distribution(variant, gamma,
                                                                          temperature, top_p):
    """As test_speculative's losslessness test (same bounds), with the block drafter; the
    confidence-scheduled variant verifies a confidence-chosen prefix of each block."""
    policy = make_policy(TINY, std=0.5, seed=4)
    reduced = torch.tensor([0, 1, EOS])
    # the sequential correction (heads drawn one position at a time) in the plain "trained" cases
    draft, _ = trained_tiny_block_draft(policy, reduced if variant == "trained-reduced" else None,
                                        correction=variant in ("trained", "trained-scaled"))
    if variant == "trained-scaled":  # with the correction: scaled in each position's own draw
        draft.proposal_scale = 1.6
    sampling = SamplingConfig(temperature=temperature, top_p=top_p, max_new_tokens=HORIZON)
    prompts = [[BOS, 4, 5], [BOS]]
    controller = confident_controller(gamma) if variant == "confidence-scheduled" else None
    engine = SpeculativeEngine(policy, draft, batch_size=48, gamma=gamma, controller=controller)
    engine._calibrated = True  # the synthetic costs stand
    result = engine.generate(prompts * SAMPLES_PER_PROMPT, sampling,
                             generator=torch.Generator().manual_seed(11))
    assert result.stats.acceptance_by_position[0] > 0.5
    if variant == "confidence-scheduled":  # the schedule cut blocks, and not to nothing
        counts = result.stats.gamma_counts
        assert 0 not in counts and any(0 < k < gamma for k in counts), counts
    assert_follows_exact_distribution(policy, prompts, result.completions, sampling)


def test_the_verify_length_maximises_the_expected_rate_from_the_confidences():
    c = confident_controller(4)  # verify(k drafts) = 1 + 0.15 k, spent 0.1
    # E(k) = 1 + sum of the products: rates (1, 1.9, 2.71, 2.953, 2.9773) / (1.1 + 0.15 k)
    assert c.verify_length(1, [[0.9, 0.9, 0.3, 0.1]], 0.1) == 2
    assert c.verify_length(1, [[0.99, 0.99, 0.99, 0.99]], 0.1) == 4
    assert c.verify_length(1, [[0.05, 0.9, 0.9, 0.9]], 0.1) == 0
    # batch-wide: two sure rows outweigh an unsure one
    assert c.verify_length(3, [[0.99] * 4, [0.99] * 4, [0.05] * 4], 0.1) == 4


def test_the_confidence_head_learns_the_acceptance_it_predicts():
    """After fitting, the head's mean error against 1 - TV is small next to a constant guess."""
    policy = make_policy(TINY, std=0.5, seed=4)
    _, metrics = trained_tiny_block_draft(policy, steps=120)
    accept = metrics["acceptance"]
    assert accept[0] > 0.5 and len(metrics["confidence_error"]) == 3
    assert max(metrics["confidence_error"]) < 0.15


def test_a_block_draft_saves_and_loads_bit_exactly(tmp_path):
    policy = make_policy(CFG)
    draft = trained_like(BlockDraft.from_policy(policy, num_layers=2, correction=True,
                                                confidence=False,
                                                vocab_ids=torch.tensor([0, 1, 2, 7, 9])))
    save_draft(draft, tmp_path / "d")
    loaded = load_draft(tmp_path / "d")
    assert isinstance(loaded, BlockDraft)
    assert (len(loaded.layers), loaded.has_correction, loaded.has_confidence) == (2, True, False)
    for (name, a), (_, b) in zip(draft.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name


def test_a_co_trained_block_draft_run_resumes_bit_exactly(tmp_path):
    """GRPO with speculative rollouts and a co-trained block draft (tiny recipe, 2 steps): the
    draft learns during the run, and a run resumed from its step-1 checkpoint ends with the
    uninterrupted run's policy and block draft, bit for bit (with a fixed gamma; see below)."""
    import shutil

    from cospec.cli import main
    from cospec.rl.checkpoint import latest_checkpoint, load_checkpoint

    args = ["train", "--recipe", "tiny", "grpo.steps=2", "grpo.checkpoint_every=1",
            "rollout.speculative=true", "draft.kind=block", "draft.mode=cotrain", "draft.ttt_steps=4",
            # fixed gamma: the adaptive controller's choices follow measured times, and the tokens
            # drawn follow the choices (the same distribution, not the same draws)
            "rollout.adaptive=false"]
    ref = tmp_path / "ref"
    assert main(args + [f"out_dir={ref}"]) == 0
    run = tmp_path / "resumed"
    shutil.copytree(ref, run)
    shutil.rmtree(run / "rl" / "checkpoints" / "step_000002")  # as if killed during step 2
    assert main(args + [f"out_dir={run}", "--resume"]) == 0
    a = load_checkpoint(latest_checkpoint(ref / "rl" / "checkpoints"))
    b = load_checkpoint(latest_checkpoint(run / "rl" / "checkpoints"))
    assert a["trainer_state"]["step"] == b["trainer_state"]["step"] == 2
    assert isinstance(a["draft"], BlockDraft)
    offline = load_draft(ref / "draft_block")
    assert any(not torch.equal(x, y) for x, y in zip(offline.state_dict().values(),
                                                      a["draft"].state_dict().values()))
    for key in ("policy", "draft"):
        for (name, x), (_, y) in zip(a[key].state_dict().items(), b[key].state_dict().items()):
            assert torch.equal(x, y), f"{key} {name}"


def test_the_block_drafts_loss_runs_under_autocast_where_cuda_refuses_binary_cross_entropy(
        monkeypatch):
    """draft.autocast on CUDA: autocast raises on binary_cross_entropy (the confidence head's
    loss). Mimicked on the CPU by a binary_cross_entropy that refuses to run under autocast: the
    block draft's TTT loss still runs in a bf16 autocast region, and equals the fp32 one closely."""
    from cospec.draft.ttt import ttt_loss

    real = F.binary_cross_entropy

    def refused_under_autocast(*args, **kwargs):
        if torch.is_autocast_enabled("cpu"):
            raise RuntimeError("binary_cross_entropy is unsafe to autocast")
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "binary_cross_entropy", refused_under_autocast)
    policy = make_policy(TINY, std=0.5, seed=4)
    torch.manual_seed(2)
    draft = BlockDraft.from_policy(policy)
    batch = packed_batch(policy, draft, [9, 14])
    fp32, _ = ttt_loss(draft, batch, num_steps=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16, metrics = ttt_loss(draft, batch, num_steps=3)
    assert len(metrics["confidence_error"]) == 3
    assert bf16.item() != fp32.item() and abs(bf16.item() - fp32.item()) < 0.02 * fp32.item()
