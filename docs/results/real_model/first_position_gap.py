"""SmolLM2 (the recipe, fp32): why is real first-position acceptance below held-out
teacher-forced acceptance? Real speculative rollouts (64 prompts, batch 16, gamma 4, T 0.7)
with a hook on each step recording the engine's own expected first-position acceptance,
sum_x min(p, q), at every drafting step and what the row's previous step accepted; then, for the
finished rollouts, the same acceptance teacher-forced at every response position (one policy
forward and one draft pass over each whole answer). docs/results/real_model.md, "Where drafting
starts".

    python docs/results/real_model/first_position_gap.py DRAFT_DIR [SEED]

Prints: the engine's expected and observed first-position acceptance; the engine against the
teacher-forced recomputation at 3% of the steps (they must agree: the same draft, the same
features); acceptance split by where the row's previous step ended (after a rejection, after all
gamma accepted, a row's first step); teacher-forced acceptance at the positions real drafting
started from against all other response positions, by the kind of token predicted; and the
expected steps of the chain over anchors on the same answers (`cospec.draft.
expected_accept_length`) against the steps the engine took.
"""
import random
import sys

import torch

import cospec.rollout.speculative as speculative
from cospec.artifacts import load_policy, pick_device
from cospec.config import resolve
from cospec.data.prompts import TaskData
from cospec.draft.expected_accept_length import expected_accept_length
from cospec.draft.policy_outputs import policy_batches
from cospec.draft.ttt import entry_features
from cospec.models.draft_checkpoint import load_draft
from cospec.models.loading import with_checkpoint_model
from cospec.rollout.drafter import make_drafter
from cospec.rollout.sampling import probs_from_logits
from cospec.rollout.speculative import SpeculativeEngine

OVERRIDES = ["rollout.dtype=float32", "grpo.autocast=", "draft.autocast="]


def main(draft_dir: str, seed: int) -> None:
    torch.set_num_threads(2)
    cfg = with_checkpoint_model(resolve("smollm2-math", overrides=OVERRIDES))
    start = load_policy(cfg, pick_device(cfg.device))
    policy, data, tok = start.policy.eval(), TaskData.from_config(cfg.task, start.tokenizer), start.tokenizer
    draft = load_draft(draft_dir, device=next(policy.parameters()).device).eval()
    drafter, ids, t = make_drafter(draft), draft.vocab_ids, cfg.sampling.temperature
    rng = random.Random(seed)
    prompts = [data.prompt_ids(data.source.sample(rng)) for _ in range(64)]

    steps, checks, pending, last = [], [], [], {}  # last: slot -> (n, accepted) of its previous step
    original_draft, original_verify = SpeculativeEngine._draft, speculative.verify_drafts
    pick = random.Random(0)

    def recording_draft(self, active, rows_t, rows_N, n_N, gamma, sampling, generator):
        pending[:] = [(s, n, self.seq_BS[s, :n + 1].clone()) for s, n in zip(active, n_N.tolist())]
        return original_draft(self, active, rows_t, rows_N, n_N, gamma, sampling, generator)

    def recording_verify(dist, q, draft_NG, generator=None, check=True):
        rows = torch.arange(draft_NG.shape[0])
        expected = torch.minimum(dist.probs[:, 0], q.row(rows, torch.zeros_like(rows))).sum(-1)
        verdict = original_verify(dist, q, draft_NG, generator, check=check)
        for (s, n, ctx), a, k in zip(pending, expected.tolist(), verdict.num_accepted.tolist()):
            prev = last.get(s)
            where = ("a row's first step" if prev is None or prev[0] >= n else
                     "after all gamma accepted" if prev[1] == draft_NG.shape[1] else "after a rejection")
            steps.append((tuple(ctx.tolist()), a, k, where))
            last[s] = (n, k)
            if pick.random() < 0.03:
                checks.append((ctx, a))
        return verdict

    SpeculativeEngine._draft, speculative.verify_drafts = recording_draft, recording_verify
    engine = SpeculativeEngine(policy, draft, batch_size=16, gamma=4, stop_ids=tok.stop_ids)
    with torch.inference_mode():
        generator = torch.Generator(device=next(policy.parameters()).device).manual_seed(seed)
        result = engine.generate(prompts, cfg.sampling, generator=generator)
    st = result.stats
    print(f"tau {st.accept_length:.3f}, acceptance by position "
          f"{[round(a, 3) for a in st.acceptance_by_position]}")
    mean = lambda xs: sum(xs) / max(len(xs), 1)  # noqa: E731
    print(f"{len(steps)} drafting steps: engine's expected first-position acceptance "
          f"{mean([a for _, a, _, _ in steps]):.4f}, observed {mean([k > 0 for _, _, k, _ in steps]):.4f}")
    for where in ("after a rejection", "after all gamma accepted", "a row's first step"):
        xs = [a for _, a, _, w in steps if w == where]
        print(f"  {where:25s} {len(xs):5d} steps: expected first-position acceptance {mean(xs):.3f}")

    @torch.inference_mode()
    def teacher_forced(tokens: torch.Tensor) -> torch.Tensor:
        """sum_x min(p, q) at every entry of ``tokens`` (entry i predicts token i + 1)."""
        out = policy(tokens[None], tap_layers=draft.tap_layers)
        feats = entry_features(draft, {k: v[0] for k, v in out.taps.items()},
                               torch.tensor([0, len(tokens)]))  # entry i: position i - 1
        logits, _ = drafter(drafter.new_cache(1, len(tokens) + 8), tokens[None], feats[None], None)
        q = probs_from_logits(logits[0], t, 0, 1.0)
        p = probs_from_logits(out.logits[0], t, 0, 1.0)[:, ids]
        return torch.minimum(p, q).sum(-1)

    diffs = [(a, teacher_forced(ctx)[-1].item()) for ctx, a in checks]
    print(f"{len(diffs)} steps recomputed teacher-forced: engine {mean([a for a, _ in diffs]):.4f}, "
          f"teacher-forced {mean([b for _, b in diffs]):.4f}, largest difference "
          f"{max(abs(a - b) for a, b in diffs):.1e}")

    starts, by = {s[0] for s in steps}, {}
    for c in result.completions:
        full = c.prompt + c.tokens
        acc = teacher_forced(torch.tensor(full))
        for i in range(len(c.prompt) - 1, len(full) - 1):
            digit = any(ch.isdigit() for ch in tok.decode([full[i + 1]], stop_at_eos=False))
            key = ("where drafting started" if tuple(full[:i + 1]) in starts else "elsewhere",
                   "a digit token" if digit else "other tokens")
            by.setdefault(key, []).append(acc[i].item())
    print("teacher-forced acceptance over the finished rollouts' response positions:")
    for key in sorted(by):
        print(f"  {key[0]:22s} {key[1]:13s} {len(by[key]):5d} positions: {mean(by[key]):.3f}")
    everything = [a for xs in by.values() for a in xs]
    print(f"  all positions {len(everything)}: {mean(everything):.3f}")
    # The chain over anchors (cospec.draft.expected_accept_length) on these same answers: the
    # steps decoding should have taken on them, against the steps it took.
    with torch.inference_mode():
        batches = policy_batches(cfg, policy, result.completions, vocab_ids=ids)
        expected, tokens = expected_accept_length(draft, batches, 4, t)
    print(f"expected steps on these answers {expected:.1f} (tau {tokens / expected:.3f}, {tokens} "
          f"tokens), engine's steps {st.row_steps} (tau {st.accept_length:.3f}, {st.step_tokens} tokens)")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 4321)
