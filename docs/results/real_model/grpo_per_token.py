"""Per-step and per-answer-token figures of a stale-draft run's JSON (docs/results/real_model.md,
the GRPO sections): the time split per step, and each mode's rollout and whole-step speedup
over plain per answer token (the modes' answers differ in length: per token is the fair unit).

    python docs/results/real_model/grpo_per_token.py OUT/stale_draft.json [first_step]

first_step (default 2): the means skip the steps before it (step 1 pays warm-ups). Where the
run timed plain decoding on each speculative step's own answers (``paired_plain_generate``,
runs since stop 49's paired timing), it also prints the paired ratios: rollouts = plain's time
for the same answers over the mode's generate time, and the whole step with the mode's generate
time replaced by that plain time, over the mode's step (docs/design.md, "Paired speedups").
"""
import json
import statistics
import sys


def main() -> None:
    modes = json.load(open(sys.argv[1]))["modes"]
    first = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    means = {}
    for mode, steps in modes.items():
        for s in steps:
            t = s["time"]
            s["num_tokens"] = round(s["rollout_tok_s"] * t["generate"])  # what the step generated
            print(f"{mode:8s} step {s['step']}: step {s['step_seconds']:.1f} s, generate "
                  f"{t['generate']:.1f}, train policy {t['train_policy']:.1f}, co-train "
                  f"{t['train_draft']:.2f}, answer tokens {s['num_tokens']}, rollout "
                  f"{s['rollout_tok_s']:.1f} tok/s, tau {s.get('accept_length', '-')}")
        kept = [s for s in steps if s["step"] >= first]
        mean = lambda f: statistics.mean(f(s) for s in kept)  # noqa: E731
        if all("paired_plain_generate" in s for s in kept):
            paired = sum(s["paired_plain_generate"] for s in kept)
            spec = sum(s["time"]["generate"] for s in kept)
            steps_s = sum(s["step_seconds"] for s in kept)
            print(f"{mode}: paired, steps {first}+: rollouts {paired / spec:.2f}x, whole step "
                  f"{(steps_s - spec + paired) / steps_s:.2f}x (plain decoding of its own answers "
                  f"{paired / len(kept):.2f} s a step against its {spec / len(kept):.2f} s)")
        means[mode] = {"step": mean(lambda s: s["step_seconds"]),
                       "generate": mean(lambda s: s["time"]["generate"]),
                       "train_policy": mean(lambda s: s["time"]["train_policy"]),
                       "co_train": mean(lambda s: s["time"]["train_draft"]),
                       "tokens": mean(lambda s: s["num_tokens"])}
    plain = means.get("none")  # a run without the none mode has only the paired ratios
    for mode, m in means.items():
        share = m["co_train"] / m["step"]
        line = ", ".join(f"{k} {v:.2f}" for k, v in m.items())
        print(f"{mode}: steps {first}+ means: {line}, co-train share {share:.1%}")
        if mode == "none" or plain is None:
            continue
        per_tok = lambda x, key: x[key] / x["tokens"]  # noqa: E731
        print(f"{mode}: per answer token: rollouts "
              f"{per_tok(plain, 'generate') / per_tok(m, 'generate'):.2f}x, whole step "
              f"{per_tok(plain, 'step') / per_tok(m, 'step'):.2f}x; answer tokens "
              f"{m['tokens'] / plain['tokens']:.2f} of plain's")


if __name__ == "__main__":
    main()
