"""SmolLM2 (the recipe's policy, fp32), adaptive speculation against plain decoding of the same
response lengths at one batch size (docs/results/real_model.md, "Adaptive on SmolLM2 in fp32,
after the switch-on pricing").

    python docs/results/real_model/adaptive_paired_probe.py BATCH REPEATS

Needs the EAGLE-3 draft the overrides below name (runs/smollm2-math/draft, reused as it is). Per
repeat r (seed 1 + r): plain decoding; plain decoding of responses of exactly plain's lengths
(the same work again: the timing noise); the adaptive engine; plain decoding of responses of
exactly adaptive's lengths (the rollout bench's paired baseline).
"""
import sys

import torch

from cospec.bench.rollout import _load_inputs
from cospec.config import resolve
from cospec.models.loading import with_checkpoint_model
from cospec.rollout.adaptive import AdaptiveGamma
from cospec.rollout.engine import GenerationEngine
from cospec.rollout.speculative import SpeculativeEngine

OVERRIDES = ["draft.ttt_steps=4", "draft.block_correction=true", "draft.num_train_prompts=256",
             "draft.train_steps=240", "draft.tokens_per_batch=640", "rollout.dtype=float32",
             "grpo.autocast=", "draft.autocast="]


def main(B: int, repeats: int) -> None:
    torch.set_num_threads(2)
    cfg = with_checkpoint_model(resolve("smollm2-math", overrides=OVERRIDES))
    run = _load_inputs(cfg, quick=True, workload="tasks", reuse=True, drafts=("eagle3",))
    prompts, stop, sampling = run.prompts(max(16, 2 * B) // 2), run.data.tokenizer.stop_ids, run.sampling
    plain = GenerationEngine(run.policy, batch_size=B, stop_ids=stop)
    adaptive = SpeculativeEngine(run.policy, run.drafts["eagle3"], batch_size=B, gamma=4,
                                 stop_ids=stop, controller=AdaptiveGamma(4))
    with torch.inference_mode():
        for e in (plain, adaptive):
            e.generate(prompts[:B], sampling, generator=torch.Generator().manual_seed(0))
        for r in range(repeats):
            def gen():
                return torch.Generator().manual_seed(1 + r)

            def lengths(result):
                return [len(c.tokens) for c in result.completions]

            p = plain.generate(prompts, sampling, generator=gen())
            again = plain.generate(prompts, sampling, generator=gen(), response_lengths=lengths(p))
            a = adaptive.generate(prompts, sampling, generator=gen())
            pa = plain.generate(prompts, sampling, generator=gen(), response_lengths=lengths(a))
            st = a.stats
            print(f"B{B} repeat {r}: plain {p.num_tokens} tokens {p.seconds:.1f} s (longest "
                  f"{max(lengths(p))}), again {again.seconds:.1f} s; adaptive {a.num_tokens} tokens "
                  f"{a.seconds:.1f} s (longest {max(lengths(a))}), plain on its lengths "
                  f"{pa.seconds:.1f} s: unpaired {a.tokens_per_second / p.tokens_per_second:.3f}x, "
                  f"paired {pa.seconds / a.seconds:.3f}x; gammas {dict(sorted(st.gamma_counts.items()))}, "
                  f"{st.switch_on_steps} switch-ons {st.switch_on_seconds:.2f} s", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
