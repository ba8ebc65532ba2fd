"""Specification of the EAGLE-3 draft: its shape rules, its TTT unroll, training and checkpoints.

The central property: the training-time-test unroll (`cospec.draft.ttt`) computes, for every anchor
and step, exactly the logits the draft produces in decoding (`cospec.rollout.drafter` on its KV
cache) when the drafted tokens are the sequence's own. So what the draft is trained on is what it is
asked in rollouts. Tolerance 1e-5 (fp32; the two paths differ in summation order only).
"""

import copy
import dataclasses
import random

import pytest
import torch
from ttt_answers import packed_answers

from cospec.config import ModelConfig, resolve
from cospec.draft.losses import masked_mean, soft_cross_entropy, total_variation
from cospec.draft.offline import (build_draft, fit_draft, sample_responses, task_data,
                                  train_draft_offline)
from cospec.draft.policy_outputs import policy_batches
from cospec.draft.ttt import (choose_sequences, entry_features, pad_to_bucket, select_sequences,
                              ttt_loss, ttt_steps, ttt_unroll)
from cospec.models.draft import Eagle3Draft, default_tap_layers
from cospec.models.draft_checkpoint import load_draft, save_draft
from cospec.models.llama import Transformer
from cospec.rollout.drafter import make_drafter

CFG = ModelConfig(vocab_size=50, hidden_size=32, num_layers=6, num_heads=4, num_kv_heads=2,
                  intermediate_size=64, max_seq_len=64)


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    return Transformer(CFG).eval()


def test_default_tap_layers_are_low_mid_high_and_clamped():
    assert default_tap_layers(32) == (1, 15, 28)
    assert default_tap_layers(6) == (1, 2, 3)
    assert default_tap_layers(4) == (1, 2, 3)
    assert default_tap_layers(2) == (1, 1, 1)


def test_tap_layers_outside_the_policy_are_a_clear_error():
    with pytest.raises(ValueError, match="tap_layers"):
        Eagle3Draft(CFG, tap_layers=(1, 2, 6))


def test_draft_feature_of_the_wrong_width_is_a_clear_error(policy):
    draft = Eagle3Draft.from_policy(policy)
    with pytest.raises(ValueError, match="draft feature must be"):
        draft(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3, 16))


def packed_batch(policy, draft, lengths, seed=0):
    """Random answers, every entry trained (each answer's prompt is its first token)."""
    return packed_answers(policy, draft.tap_layers, lengths, [1] * len(lengths), seed=seed)


@torch.no_grad()
@pytest.mark.parametrize("num_layers", [1, 2])
def test_ttt_unroll_equals_what_the_draft_computes_while_decoding(policy, num_layers):
    torch.manual_seed(1)
    draft = Eagle3Draft.from_policy(policy, num_layers=num_layers).eval()
    lengths, steps = [9, 5, 12], 4
    batch = packed_batch(policy, draft, lengths)
    feat = entry_features(draft, batch.taps, batch.cu_seqlens)
    inputs = ttt_steps(draft, batch, steps)
    logits, valid = ttt_unroll(draft, inputs, batch.cu_seqlens), inputs.inside_JT
    drafter = make_drafter(draft)
    for seq, (start, end) in enumerate(zip(batch.cu_seqlens[:-1].tolist(), batch.cu_seqlens[1:].tolist())):
        for anchor in range(start, end):
            # Decoding: catch up on entries start..anchor, then feed the sequence's next tokens as
            # if they had been drafted, each step on the previous step's hidden.
            cache = drafter.new_cache(1, 32)
            out, state = drafter(cache, batch.tokens[None, start:anchor + 1],
                                 feat[None, start:anchor + 1], None)
            step_logits, h = out[0, -1], state[0, -1]
            for j in range(steps):
                assert bool(valid[j][anchor]) == (anchor + j < end)
                if anchor + j >= end:
                    break
                torch.testing.assert_close(logits[j][anchor], step_logits, atol=1e-5, rtol=0,
                                           msg=lambda m: f"seq {seq} anchor {anchor} step {j + 1}: {m}")
                if anchor + j + 1 < end:
                    out, state = drafter(cache, batch.tokens[None, None, anchor + j + 1], h[None, None], None)
                    step_logits, h = out[0, -1], state[0, -1]


@pytest.mark.parametrize("num_layers", [1, 2])
def test_a_catch_up_computes_the_head_only_at_each_rows_last_entry(policy, num_layers):
    """The engine draws q_1 from each row's last caught-up entry: logits there equal the full
    call's, and the cache and hidden states are written as by the full call."""
    torch.manual_seed(2)
    draft = Eagle3Draft.from_policy(policy, num_layers=num_layers).eval()
    drafter = make_drafter(draft)
    width = torch.tensor([6, 1, 4])
    tokens = torch.randint(0, CFG.vocab_size, (3, 6))
    feats = torch.randn(3, 6, CFG.hidden_size)
    a, b = drafter.new_cache(3, 16), drafter.new_cache(3, 16)
    full, h_full = drafter(a, tokens, feats, None, width)
    last, h_last = drafter(b, tokens, feats, None, width, logits_positions_N=width - 1)
    assert last.shape == (3, 1, CFG.vocab_size)
    torch.testing.assert_close(last[:, 0], full[torch.arange(3), width - 1])
    torch.testing.assert_close(h_last, h_full, atol=0, rtol=0)
    assert torch.equal(a.lengths_B, b.lengths_B)
    assert all(torch.equal(x, y) for x, y in zip(a.keys + a.values, b.keys + b.values))


@pytest.mark.parametrize("kind", ["eagle3", "block"])
def test_a_batch_padded_to_its_token_bucket_trains_exactly_as_the_batch(policy, kind):
    """`pad_to_bucket` appends one untrained sequence up to a multiple of the bucket: the TTT
    loss, its metrics and its gradients are the unpadded batch's (anchor weights on, prompts
    in the answers)."""
    from cospec.models.block_draft import BlockDraft

    torch.manual_seed(2)
    draft = (Eagle3Draft.from_policy(policy) if kind == "eagle3" else
             BlockDraft(CFG, tap_layers=default_tap_layers(CFG.num_layers)))
    batch = packed_answers(policy, draft.tap_layers, [9, 5, 12], [3, 1, 4], seed=3)
    padded = pad_to_bucket(batch, 16)
    assert len(padded.tokens) == 32 and padded.cu_seqlens.tolist() == [0, 9, 14, 26, 32]
    assert pad_to_bucket(batch, 0) is batch and pad_to_bucket(padded, 16) is padded
    results = []
    for b in (batch, padded):
        draft.zero_grad(set_to_none=True)
        loss, metrics = ttt_loss(draft, b, num_steps=3, temperature=0.8, tv_weight=0.5,
                                 anchor_weight=2.0)
        loss.backward()
        results.append((loss.detach(), metrics, [p.grad.clone() for p in draft.parameters()
                                                 if p.grad is not None]))
    torch.testing.assert_close(results[0][0], results[1][0])
    for name in ("ce", "tv"):
        assert results[0][1][name] == pytest.approx(results[1][1][name], rel=1e-5)
    for a, b in zip(results[0][2], results[1][2]):
        torch.testing.assert_close(a, b)


def test_ttt_loss_falls_on_a_fixed_policy_and_never_reaches_the_policy():
    torch.manual_seed(2)
    policy = Transformer(CFG)
    policy.reset_parameters(std=0.3)  # peaky: the draft has a distribution worth learning
    draft = Eagle3Draft.from_policy(policy.eval())
    batch = packed_batch(policy, draft, [20, 14, 30])
    opt = torch.optim.Adam(draft.parameters(), lr=3e-3)
    losses, tvs = [], []
    for _ in range(30):
        loss, metrics = ttt_loss(draft, batch, num_steps=3)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        tvs.append(metrics["tv"])
    assert losses[-1] < 0.8 * losses[0]
    assert all(last < first for first, last in zip(tvs[0], tvs[-1]))  # every TTT step improves
    assert all(p.grad is None for p in policy.parameters())


@pytest.mark.parametrize("overrides", [["draft.kind=eagle3"], ["draft.eagle3_layers=2"],
                                       ["draft.kind=lm"]])
def test_saved_draft_loads_back_identical(tmp_path, policy, overrides):
    cfg = resolve("tiny", overrides=overrides)
    from cospec.draft.offline import build_draft, draft_fits

    policy = Transformer(cfg.model)
    draft = build_draft(cfg, policy)
    save_draft(draft, tmp_path / "d")
    loaded = load_draft(tmp_path / "d")
    assert type(loaded) is type(draft) and draft_fits(loaded, cfg, policy)
    if cfg.draft.kind == "eagle3":  # reused only where the config asks for its depth
        other = resolve("tiny", overrides=[f"draft.eagle3_layers={3 - cfg.draft.eagle3_layers}"])
        assert len(loaded.layers) == cfg.draft.eagle3_layers and not draft_fits(loaded, other, policy)
    for (n, a), (_, b) in zip(draft.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), n


def _mean_acceptance(cfg, draft, batches) -> list[float]:
    """Per draft position, the mean over `batches` of 1 - TV (teacher-forced expected acceptance)."""
    with torch.no_grad():
        per_batch = [ttt_loss(draft, b, num_steps=cfg.draft.ttt_steps,
                              temperature=cfg.sampling.temperature)[1]["acceptance"] for b in batches]
    return [sum(a[j] for a in per_batch) / len(per_batch) for j in range(cfg.draft.ttt_steps)]


def test_offline_training_raises_the_drafts_acceptance_on_held_out_answers():
    """25 steps on a tiny random policy raise the draft's acceptance at every draft position, on
    answers to prompts it did not train on (another prompt stream). Measured: ~0.25-0.31 before,
    ~0.43-0.48 after, over draft seeds 0-2; the bound asks for half the smallest gain."""
    overrides = ["draft.train_steps=25", "draft.num_train_prompts=24", "sampling.max_new_tokens=12",
                 "draft.lr=5e-3"]
    cfg = resolve("tiny", overrides=overrides + ["draft.seed=0"])
    held_out_cfg = resolve("tiny", overrides=overrides + ["draft.seed=100"])  # its own prompts, draws
    torch.manual_seed(0)
    policy = Transformer(cfg.model)
    policy.reset_parameters(std=0.2)
    policy.eval()
    data = task_data(cfg, None)
    held_out = policy_batches(cfg, policy, sample_responses(held_out_cfg, policy, data, progress=False))
    initial = build_draft(cfg, policy)
    before = _mean_acceptance(cfg, initial, held_out)
    trained, metrics = train_draft_offline(cfg, policy, draft=copy.deepcopy(initial), data=data,
                                           progress=False)
    after = _mean_acceptance(cfg, trained, held_out)
    assert metrics["num_tokens"] > 0
    assert all(a > b + 0.08 for a, b in zip(after, before)), (before, after)


def _loss_mix(draft, batch, cfg, w: float) -> float:
    """The oracle: (1 - w) x soft CE + w x TV from the losses themselves (EAGLE-3: each TTT step's,
    weighted by decay^(j-1); a draft LM: its next-token one)."""
    t = cfg.sampling.temperature
    with torch.no_grad():
        if isinstance(draft, Eagle3Draft):
            m = ttt_loss(draft, batch, num_steps=cfg.draft.ttt_steps, temperature=t)[1]
            return sum(cfg.draft.ttt_decay ** j * ((1 - w) * ce + w * tv)
                       for j, (ce, tv) in enumerate(zip(m["ce"], m["tv"])))
        logits = draft(batch.tokens[None], cu_seqlens=batch.cu_seqlens).logits[0]
        ce = masked_mean(soft_cross_entropy(logits, batch.policy_logits, t), batch.loss_mask)
        tv = masked_mean(total_variation(logits, batch.policy_logits, t), batch.loss_mask)
        return ((1 - w) * ce + w * tv).item()


@pytest.mark.parametrize("kind", ["eagle3", "lm"])
def test_offline_training_minimises_the_loss_mix_that_draft_tv_weight_names(policy, kind):
    """draft.tv_weight = w: `cospec draft-train` trains on (1 - w) x soft CE + w x TV, as
    co-training does, for an EAGLE-3 draft and a draft LM alike. The first step's loss is that mix
    computed by the losses on the step's batch from the same start, and w moves the update."""
    batch = packed_batch(policy, Eagle3Draft.from_policy(policy), [20, 14, 30])
    losses, updates = {}, {}
    for w in (0.0, 0.5, 1.0):
        cfg = resolve("tiny", overrides=[f"draft.kind={kind}", f"draft.tv_weight={w}",
                                         "draft.train_steps=1", "draft.ttt_steps=2"])
        draft = build_draft(cfg, policy)  # seeded by draft.seed: the same start for every w
        start = copy.deepcopy(draft)
        losses[w] = fit_draft(cfg, draft, [batch], [], progress=False)["loss_history"][0]
        assert losses[w] == pytest.approx(_loss_mix(start, batch, cfg, w), rel=1e-5)
        updates[w] = torch.cat([(p - p0).flatten()
                                for p, p0 in zip(draft.parameters(), start.parameters())])
    assert losses[0.0] > losses[0.5] > losses[1.0]  # CE >= H(p) > 1 >= TV here (50 ids)
    assert not torch.allclose(updates[0.0], updates[1.0])


def test_chosen_sequences_are_random_whole_sequences_within_the_token_budget(policy):
    draft = Eagle3Draft.from_policy(policy)
    lengths = [9, 5, 12, 7, 3]
    batch = packed_batch(policy, draft, lengths)
    starts = [0, 9, 14, 26, 33]
    seen = set()
    for seed in range(20):
        cut = select_sequences(batch, choose_sequences(lengths, 20, random.Random(seed)))
        kept = cut.sequence_lengths()
        assert 0 < sum(kept) <= 20 or len(kept) == 1
        # Whole sequences, in their original order, each with its own tokens, taps and logits.
        ids = [lengths.index(n) for n in kept]  # lengths are distinct
        assert ids == sorted(ids)
        index = torch.cat([torch.arange(starts[i], starts[i] + lengths[i]) for i in ids])
        assert torch.equal(cut.tokens, batch.tokens[index])
        assert torch.equal(cut.taps[draft.tap_layers[0]], batch.taps[draft.tap_layers[0]][index])
        assert torch.equal(cut.policy_logits, batch.policy_logits[index])
        seen.add(tuple(ids))
    assert len(seen) > 3  # random subsets, not always the leading sequences
    assert choose_sequences(lengths, 0, random.Random(0)) is None  # no budget: all
    assert choose_sequences(lengths, 36, random.Random(0)) is None  # all fit
    assert select_sequences(batch, None) is batch


def test_the_policy_step_captures_only_the_sequences_the_draft_will_train_on(tmp_path):
    """The co-training budget is drawn from each minibatch's sequence lengths before its forward
    and the step captures only those rows: the same data as capturing the whole minibatch and
    drawing from it after (what `cotrain_draft` draws, by the same seed)."""
    from cospec.draft.cotrain import cotrain_sampler
    from cospec.rl.trainer import GRPOTrainer

    def trainer_with(budget):
        cfg = resolve("tiny", overrides=[f"out_dir={tmp_path}", "rollout.speculative=true",
                                         "draft.mode=cotrain", f"draft.cotrain_max_tokens={budget}",
                                         "grpo.micro_steps=2", "rollout.adaptive=false"])
        torch.manual_seed(0)
        policy = Transformer(cfg.model)
        return GRPOTrainer(cfg, policy, draft=build_draft(cfg, policy), tensorboard=False)

    everything, cut = trainer_with(0), trainer_with(120)
    batch = everything.generate()
    everything.score(batch)
    everything.compute_advantages(batch)
    for trainer in (everything, cut):  # the same rollouts, the same policy updates
        trainer.train_policy(batch)
    whole = everything._draft_data
    choose = cotrain_sampler(cut.cfg.draft, len(whole), cut.g.seed * 1_000_003 + cut.step)
    expected = [select_sequences(b, choose(b.sequence_lengths())) for b in whole]
    assert len(whole) == 2 and sum(len(b.tokens) for b in whole) > 120  # the budget cuts
    assert [b.tokens.tolist() for b in cut._draft_data] == [b.tokens.tolist() for b in expected]
    for kept, want in zip(cut._draft_data, expected):
        assert torch.equal(kept.cu_seqlens, want.cu_seqlens)
        assert torch.equal(kept.policy_logits, want.policy_logits)
        assert all(torch.equal(kept.taps[k], want.taps[k]) for k in want.taps)
    assert sum(len(b.tokens) for b in cut._draft_data) <= 120 + max(
        n for b in whole for n in b.sequence_lengths())  # whole sequences, at least one


def test_a_reduced_head_keeps_its_logits_and_a_bucket_and_trains_as_on_the_whole_logits(tmp_path):
    """`draft_targets`: with a reduced draft head the policy step keeps Vd + 1 numbers a token
    for the draft (the head's logits and one bucket), not V, and the draft's co-training loss
    and gradients on them are those on the whole logits."""
    from cospec.draft.losses import compress_to_head
    from cospec.rl.trainer import GRPOTrainer

    cfg = resolve("tiny", overrides=[f"out_dir={tmp_path}", "rollout.speculative=true",
                                     "draft.mode=cotrain", "draft.cotrain_max_tokens=0",
                                     "rollout.adaptive=false", "sampling.temperature=0.7"])
    torch.manual_seed(0)
    policy = Transformer(cfg.model)
    ids = torch.tensor(sorted({2, *range(5, 50, 4)}))  # EOS and 12 more
    draft = Eagle3Draft.from_policy(policy, vocab_ids=ids)
    trainer = GRPOTrainer(cfg, policy, draft=draft, tensorboard=False)
    keep, whole = trainer.policy_step.draft_targets, []

    def recording(logits):
        whole.append(logits.clone())
        return keep(logits)

    trainer.policy_step.draft_targets = recording
    batch = trainer.generate()
    trainer.score(batch)
    trainer.compute_advantages(batch)
    trainer.train_policy(batch)
    assert len(whole) == len(trainer._draft_data) == cfg.grpo.micro_steps
    for kept, logits in zip(trainer._draft_data, whole):
        # the step's head ran at the response positions only; the rest, which no TTT loss
        # reads, is kept as zeros
        rows = kept.loss_mask > 0
        assert kept.policy_logits.shape == (len(kept.tokens), len(ids) + 1)
        assert len(logits) == rows.sum() < len(rows)
        torch.testing.assert_close(kept.policy_logits[rows], compress_to_head(logits, ids, 0.7))
        assert not kept.policy_logits[~rows].any()
        # the whole logits with noise where the step kept zeros: no loss may read those rows
        full = 5 * torch.randn(len(rows), logits.shape[-1])
        full[rows] = logits
        on_whole = dataclasses.replace(kept, policy_logits=full)
        for anchor_weight in (0.0, 3.0):
            results = []
            for b in (kept, on_whole):
                draft.zero_grad(set_to_none=True)
                loss, _ = ttt_loss(draft, b, num_steps=3, temperature=0.7, tv_weight=0.5,
                                   anchor_weight=anchor_weight)
                loss.backward()
                results.append((loss.detach(), [p.grad.clone() for p in draft.parameters()
                                                if p.grad is not None]))
            torch.testing.assert_close(results[0][0], results[1][0])
            for a, b in zip(results[0][1], results[1][1]):
                torch.testing.assert_close(a, b)


# ----------------------------------------------------------------------------- reduced draft vocabulary

def test_draft_vocabulary_is_the_most_frequent_response_tokens_plus_the_stop_ids_increasing():
    from cospec.draft.offline import draft_vocabulary

    responses = [[7, 7, 7, 3, 3, 9], [3, 7, 11, 11, 11, 11, 2]]
    # counts: 11 x4, 7 x4, 3 x3, 9 x1, 2 x1; stop id 0 is kept though never sampled
    ids = draft_vocabulary(responses, 4, 20, keep=(0,))
    assert ids.tolist() == [0, 3, 7, 11]
    assert draft_vocabulary(responses, 3, 20).tolist() == [3, 7, 11]
    with pytest.raises(ValueError, match="draft.vocab_size=20"):
        draft_vocabulary(responses, 20, 20)


def test_a_reduced_head_drafts_only_its_ids_and_the_loss_targets_p_renormalised_on_them(policy):
    ids = torch.tensor([2, 5, 8, 13, 21, 34])
    torch.manual_seed(3)
    draft = Eagle3Draft.from_policy(policy, vocab_ids=ids)
    assert draft.draft_vocab_size == 6
    torch.testing.assert_close(draft.lm_head.weight, policy.lm_head.weight[ids])  # rows copied
    logits_d = torch.randn(4, 6, dtype=torch.float64)
    full = draft.full_vocab_logits(logits_d)
    q = full.softmax(-1)
    assert torch.all(q[:, [i for i in range(policy.config.vocab_size) if i not in ids]] == 0)
    torch.testing.assert_close(q[:, ids], logits_d.softmax(-1))
    # losses against an independent computation: p restricted and renormalised (CE), the
    # policy's mass outside the head counted whole (TV = 1 - sum min(p, q) over the full vocab)
    from cospec.draft.losses import soft_cross_entropy, total_variation

    policy_logits = torch.randn(4, policy.config.vocab_size, dtype=torch.float64)
    p = (policy_logits / 0.7).softmax(-1)
    q = (full / 0.7).softmax(-1)
    p_d = p[:, ids] / p[:, ids].sum(-1, keepdim=True)
    ce_ref = -(p_d * (logits_d / 0.7).log_softmax(-1)).sum(-1)
    tv_ref = 1 - torch.minimum(p, q).sum(-1)
    torch.testing.assert_close(soft_cross_entropy(logits_d, policy_logits, 0.7, ids), ce_ref)
    torch.testing.assert_close(total_variation(logits_d, policy_logits, 0.7, ids), tv_ref)
    # the same from the head's logits plus one bucket for the rest (what offline data keeps)
    from cospec.draft.losses import compress_to_head

    small = compress_to_head(policy_logits, ids, 0.7)
    assert small.shape == (4, 7)
    torch.testing.assert_close(soft_cross_entropy(logits_d, small, 0.7, ids), ce_ref)
    torch.testing.assert_close(total_variation(logits_d, small, 0.7, ids), tv_ref)


def test_a_saved_reduced_draft_keeps_its_vocabulary_mapping(tmp_path):
    cfg = resolve("tiny", overrides=["draft.vocab_size=12", "draft.train_steps=2",
                                     "draft.num_train_prompts=8", "sampling.max_new_tokens=8"])
    torch.manual_seed(0)
    policy = Transformer(cfg.model)
    draft, _ = train_draft_offline(cfg, policy, progress=False)
    assert draft.draft_vocab_size == 12 and 2 in draft.vocab_ids.tolist()  # EOS is always kept
    from cospec.draft.offline import sample_responses, task_data

    completions = sample_responses(cfg, policy, task_data(cfg, None), progress=False)
    (batch, *_) = policy_batches(cfg, policy, completions, vocab_ids=draft.vocab_ids)
    assert batch.policy_logits.shape[-1] == 13  # the head's 12 ids and one bucket, not V
    save_draft(draft, tmp_path / "d")
    loaded = load_draft(tmp_path / "d")
    assert torch.equal(loaded.vocab_ids, draft.vocab_ids)
    for (n, a), (_, b) in zip(draft.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), n


def test_a_saved_draft_keeps_its_proposal_scale_and_one_saved_before_it_reads_as_1(tmp_path):
    import json

    from cospec.models.block_draft import BlockDraft
    from cospec.models.integrity import CheckpointError

    policy = Transformer(CFG)
    for draft in (Eagle3Draft.from_policy(policy), BlockDraft.from_policy(policy)):
        draft.proposal_scale = 1.375
        save_draft(draft, tmp_path / "d")
        assert load_draft(tmp_path / "d").proposal_scale == 1.375
        meta_path = tmp_path / "d" / "draft.json"
        meta = json.loads(meta_path.read_text())
        del meta["proposal_scale"]
        meta_path.write_text(json.dumps(meta))
        assert load_draft(tmp_path / "d").proposal_scale == 1.0
        for bad in (0, -1.0, "1.2", True):
            meta_path.write_text(json.dumps({**meta, "proposal_scale": bad}))
            with pytest.raises(CheckpointError, match="proposal_scale must be a positive"):
                load_draft(tmp_path / "d")


def test_a_frozen_embedding_stays_the_policys_while_the_rest_of_the_draft_trains():
    cfg = resolve("tiny", overrides=["draft.freeze_embedding=true", "draft.train_steps=3",
                                     "draft.num_train_prompts=8", "sampling.max_new_tokens=8"])
    torch.manual_seed(0)
    policy = Transformer(cfg.model)
    draft, _ = train_draft_offline(cfg, policy, progress=False)
    assert torch.equal(draft.embed_tokens.weight, policy.embed_tokens.weight)
    assert not torch.equal(draft.lm_head.weight, policy.lm_head.weight)
    assert not draft.embed_tokens.weight.requires_grad


def test_a_bf16_inference_copy_casts_the_weights_and_keeps_the_vocabulary_ids():
    """rollout.dtype=bfloat16: the engine's draft is a bf16 copy; its head's policy ids stay
    integers, the trained draft is untouched, and the copy still drafts ids of its head only."""
    from cospec.models.loading import inference_copy

    torch.manual_seed(0)
    policy = Transformer(resolve("tiny").model)
    draft = Eagle3Draft.from_policy(policy, vocab_ids=torch.tensor([0, 2, 5, 9, 17]))
    copy = inference_copy(draft, "bfloat16")
    assert copy.lm_head.weight.dtype == torch.bfloat16 and not copy.lm_head.weight.requires_grad
    assert copy.vocab_ids.dtype == torch.long and torch.equal(copy.vocab_ids, draft.vocab_ids)
    assert draft.lm_head.weight.dtype == torch.float32 and not copy.training
    policy_copy = inference_copy(policy, "bfloat16")
    assert policy_copy.config.dtype == "bfloat16" and policy.config.dtype == "float32"
    tokens = torch.randint(0, policy.config.vocab_size, (2, 6))
    out = policy_copy(tokens, tap_layers=copy.tap_layers)
    logits = copy.full_vocab_logits(copy(tokens, copy.project(out.taps)).logits)
    assert set(logits.argmax(-1).flatten().tolist()) <= {0, 2, 5, 9, 17}



def test_draft_autocast_runs_the_training_forwards_in_bf16_and_updates_like_fp32(policy):
    """draft.autocast=bfloat16: a co-training update under autocast moves every weight the way
    the fp32 update does (bf16 rounding apart: close, not equal, so autocast did run), and its
    loss is the fp32 loss within bf16's precision. (That the TTT attention inside stays fp32,
    without which this draft stops learning on SmolLM2, is tests/test_branch_attention.py's.)"""
    from cospec.config import DraftConfig
    from cospec.draft.cotrain import cotrain_draft

    torch.manual_seed(3)
    start = Eagle3Draft.from_policy(policy)
    batch = packed_batch(policy, start, [20, 14, 30])
    runs = {}
    for precision in ("", "bfloat16"):
        draft = copy.deepcopy(start)
        opt = torch.optim.SGD(draft.parameters(), lr=1.0)
        d = DraftConfig(autocast=precision, cotrain_max_tokens=0)
        metrics = cotrain_draft(draft, opt, [batch], d, temperature=1.0, seed=0, loss_fn=ttt_loss)
        delta = torch.cat([(p - p0).flatten()
                           for p, p0 in zip(draft.parameters(), start.parameters())])
        runs[precision] = (metrics["draft_loss"], delta)
    (loss32, delta32), (loss16, delta16) = runs[""], runs["bfloat16"]
    assert loss16 != loss32 and abs(loss16 - loss32) < 0.01 * loss32
    assert not torch.equal(delta16, delta32)
    assert torch.nn.functional.cosine_similarity(delta16, delta32, dim=0) > 0.99


@pytest.mark.parametrize("num_layers", [1, 2])
def test_draft_layers_copied_from_the_policy_start_as_the_layers_after_the_high_tap(policy,
                                                                                   num_layers):
    """With `layer_from_policy` and the embedding's columns of q, k, v silenced, the draft's hidden
    at every entry is exactly the policy's layers hi + 1 .. hi + num_layers applied to the high
    tap: the policy's own tap of its layer hi + num_layers is the oracle."""
    torch.manual_seed(1)
    draft = Eagle3Draft.from_policy(policy, num_layers=num_layers, layer_from_policy=True)
    last = max(draft.tap_layers) + num_layers
    tokens = torch.randint(4, CFG.vocab_size, (2, 9))
    with torch.no_grad():
        out = policy(tokens, tap_layers=(*draft.tap_layers, last))
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(draft.layers["0"].self_attn, name).weight[:, :CFG.hidden_size] = 0
        hidden = draft(tokens, draft.project(out.taps)).hidden
    torch.testing.assert_close(hidden, out.taps[last], atol=1e-5, rtol=1e-5)
    # the embedding and head copies stay as before
    assert torch.equal(draft.embed_tokens.weight, policy.embed_tokens.weight)


def test_a_draft_deeper_than_the_layers_after_the_high_tap_cannot_copy_them(policy):
    # taps (1, 2, 3) of 6 layers leave two layers after the high tap, not three
    with pytest.raises(ValueError, match="copies the 3 layer"):
        Eagle3Draft.from_policy(policy, num_layers=3, layer_from_policy=True)


def test_layer_from_policy_is_for_an_eagle3_draft_of_the_policys_mlp_size():
    for bad in ({"kind": "block"}, {"intermediate_size": 96}, {"init_from_policy": False}):
        with pytest.raises(ValueError, match="draft.layer_from_policy"):
            resolve("tiny", overrides=["draft.layer_from_policy=true",
                                       *(f"draft.{k}={v}" for k, v in bad.items())])
    small = Eagle3Draft(CFG, intermediate_size=96)
    with pytest.raises(ValueError, match="MLP the policy's size"):
        small.copy_layer_from_policy(Transformer(CFG))
    last = Eagle3Draft(CFG, tap_layers=(1, 3, 5))
    with pytest.raises(ValueError, match="the policy's last layer"):
        last.copy_layer_from_policy(Transformer(CFG))
