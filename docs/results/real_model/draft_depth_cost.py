"""What a deeper EAGLE-3 draft costs in rollouts on SmolLM2's shapes: gamma one-token draft steps
with `draft.eagle3_layers` = 1, 2 and 3, next to the policy's verify and decode forwards.

    python docs/results/real_model/draft_depth_cost.py [dtype]     # bfloat16 (the recipe's) or float32

(docs/results/real_model.md, "A deeper draft"). Random weights of SmolLM2-135M's shapes (no
model file needed: timing only), an 8192-id draft head, 200 tokens of context in every row,
gamma 4. Per batch size: the median of 15 timed calls after 3 warm-ups; caches rolled back after
each call, so every call sees the same lengths. The last column is the tau a deeper draft needs
to break even with one layer at the one-layer draft's tau (tau_1 below), by the cost model's
step = verify + drafting (the step's other work left out, which makes it a lower bound).
"""
import sys

import torch

from block_draft_cost import (CONTEXT, GAMMA, HEAD, SMOLLM2,  # beside this script
                              eagle3_drafting_seconds, verify_and_decode_seconds)
from cospec.models.draft import Eagle3Draft
from cospec.models.llama import Transformer
from cospec.rollout.drafter import Eagle3Drafter

TAU_1 = 2.6


def main() -> None:
    dtype = getattr(torch, sys.argv[1] if len(sys.argv) > 1 else "bfloat16")
    torch.manual_seed(0)
    policy = Transformer(SMOLLM2).eval().to(dtype)
    ids = torch.arange(HEAD) * (SMOLLM2.vocab_size // HEAD)
    drafters = {n: Eagle3Drafter(Eagle3Draft(SMOLLM2, num_layers=n, vocab_ids=ids).eval().to(dtype))
                for n in (1, 2, 3)}
    print(f"threads {torch.get_num_threads()}, {dtype}, context {CONTEXT}, gamma {GAMMA}, "
          f"head {HEAD}, tau_1 {TAU_1}")
    print("batch | layers | verify(g+1) s | decode s | drafting s | drafting / verify | "
          "step / one layer's | tau to break even")
    with torch.inference_mode():
        for N in (1, 16):
            verify, decode = verify_and_decode_seconds(policy, N)
            feats = torch.randn(N, CONTEXT, 576, dtype=dtype)
            first_step = None
            for n, drafter in drafters.items():
                drafting = eagle3_drafting_seconds(drafter, feats)
                step = verify + drafting
                first_step = first_step or step
                print(f"{N:5d} | {n:6d} | {verify:.4f} | {decode:.4f} | {drafting:.4f} | "
                      f"{drafting / verify:.3f} | {step / first_step:.3f} | "
                      f"{TAU_1 * step / first_step:.2f}", flush=True)


if __name__ == "__main__":
    main()
