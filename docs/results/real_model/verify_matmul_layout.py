"""SmolLM2 (fp32, batch 1): a 1-token and a 5-token cached forward (decode and gamma-4 verify)
under three matmul layouts, interleaved over 3 rounds: nn.Linear as PyTorch computes it
(x @ W^T, W row-major as loaded), the same on a copy whose weights are laid out column-major
(W^T contiguous, so BLAS reads it untransposed), and W @ x^T transposed back
(docs/results/real_model.md, "GRPO on the recipe with the 2,048-answer draft", the verify-cost
paragraph). A probe: it patches nn.Linear.forward in this process only.

    python docs/results/real_model/verify_matmul_layout.py [BATCH]
"""
import copy
import sys
import time

import torch
from torch import nn

from cospec.config import resolve
from cospec.models.loading import load_pretrained, load_tokenizer, with_checkpoint_model
from cospec.rollout.engine import prefill_slots, score_tokens
from cospec.rollout.kv_cache import KVCache


def linear_w_xt(self, x):
    y = torch.mm(self.weight, x.reshape(-1, x.shape[-1]).t()).t()
    y = y if self.bias is None else y + self.bias
    return y.reshape(*x.shape[:-1], -1)


def main(batch: int) -> None:
    torch.set_num_threads(2)
    cfg = with_checkpoint_model(resolve("smollm2-math", overrides=["rollout.dtype=float32"]))
    policy = load_pretrained(cfg.model, load_tokenizer(cfg.model), device=torch.device("cpu"))
    policy.eval().requires_grad_(False)
    prompt = list(range(1000, 1100))

    column_major = copy.deepcopy(policy)
    for m in column_major.modules():
        if isinstance(m, nn.Linear):  # same values, W^T contiguous (unties the head)
            m.weight = nn.Parameter(m.weight.detach().t().contiguous().t(), requires_grad=False)
    with torch.inference_mode():
        x = torch.tensor([prompt])
        differ = (column_major(x).logits - policy(x).logits).abs().max().item()
        print(f"column-major against as loaded: largest logit difference {differ:.1e}", flush=True)

    def forward_ms(model, tokens: int, reps: int = 20) -> float:
        cache = KVCache.for_model(model, batch, 512)
        prefill_slots(model, cache, torch.arange(batch), [prompt] * batch)
        toks, back = torch.full((batch, tokens), 1234), torch.full((batch,), len(prompt))
        for i in range(reps + 2):  # two warm-ups
            if i == 2:
                start = time.perf_counter()
            score_tokens(model, cache, toks)
            cache.truncate(back)
        return (time.perf_counter() - start) / reps * 1e3

    plain = nn.Linear.forward
    layouts = {"x @ W^T": (policy, plain), "column-major W": (column_major, plain),
               "(W @ x^T)^T": (policy, linear_w_xt)}
    with torch.inference_mode():
        for rnd in range(3):
            for name, (model, forward) in layouts.items():
                nn.Linear.forward = forward
                one, five = forward_ms(model, 1), forward_ms(model, 5)
                print(f"batch {batch} round {rnd} {name:14s}: 1 token {one:.1f} ms, 5 tokens "
                      f"{five:.1f} ms, ratio {five / one:.2f}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
