"""What drafting gamma tokens costs on SmolLM2's shapes, next to the policy's verify forward:
EAGLE-3 (gamma draft forwards), the block draft (one forward, all heads at once) and the block
draft with the sequential correction (one forward, then the heads one position at a time).

    python docs/results/real_model/block_draft_cost.py            # fp32, this CPU's threads

(docs/results/block_drafter.md, "SmolLM2: what the later block positions lack"). Random weights
of SmolLM2-135M's shapes (no model file needed: timing only), an 8192-id draft head, 200 tokens
of context in every row. Per batch size: the median of 15 timed calls after 3 warm-ups of
- verify: the policy's forward of gamma + 1 tokens a row against the KV cache;
- decode: the policy's forward of 1 token a row;
- eagle3: gamma EAGLE-3 draft forwards of one token a row (its drafting, less the catch-up);
- block / block+corr: `BlockDrafter.draft` (the block forward, the heads, the draws).
Caches are rolled back after each call, so every call sees the same lengths.
"""
import statistics
import time

import torch

from cospec.config import ModelConfig, SamplingConfig
from cospec.models.block_draft import BlockDraft
from cospec.models.draft import Eagle3Draft
from cospec.models.llama import Transformer
from cospec.rollout.drafter import BlockDrafter, Eagle3Drafter
from cospec.rollout.kv_cache import KVCache

SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
                      intermediate_size=1536, max_seq_len=512, rope_theta=100000.0)
CONTEXT, GAMMA, HEAD = 200, 4, 8192


def median_seconds(fn, cache: KVCache, repeats: int = 15, warmup: int = 3) -> float:
    lengths, times = cache.lengths_B.clone(), []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        cache.lengths_B.copy_(lengths)
    return statistics.median(times)


def verify_and_decode_seconds(policy: Transformer, N: int) -> tuple[float, float]:
    """The policy's (gamma + 1)-token verify and one-token decode forwards over N rows of CONTEXT
    tokens of cache."""
    cache = KVCache.for_model(policy, N, CONTEXT + 16)
    policy(torch.randint(0, 1000, (N, CONTEXT)), kv_cache=cache)
    verify = median_seconds(lambda: policy(torch.randint(0, 1000, (N, GAMMA + 1)), kv_cache=cache),
                            cache)
    decode = median_seconds(lambda: policy(torch.randint(0, 1000, (N, 1)), kv_cache=cache), cache)
    return verify, decode


def eagle3_drafting_seconds(drafter: Eagle3Drafter, feats: torch.Tensor) -> float:
    """An EAGLE-3 drafter's gamma one-token steps after the CONTEXT entries of feats' rows."""
    N = feats.shape[0]
    dc = drafter.new_cache(N, CONTEXT + 16)
    drafter(dc, torch.randint(0, 1000, (N, CONTEXT)), feats, None)

    def steps():
        h = feats[:, -1:]
        for _ in range(GAMMA):
            _, h = drafter(dc, torch.randint(0, 1000, (N, 1)), h, None)
    return median_seconds(steps, dc)


def main() -> None:
    torch.manual_seed(0)
    policy = Transformer(SMOLLM2).eval()
    ids = torch.arange(HEAD) * (SMOLLM2.vocab_size // HEAD)
    drafts = {"eagle3": Eagle3Drafter(Eagle3Draft(SMOLLM2, vocab_ids=ids).eval()),
              "block": BlockDrafter(BlockDraft(SMOLLM2, vocab_ids=ids).eval()),
              "block+corr": BlockDrafter(BlockDraft(SMOLLM2, vocab_ids=ids, correction=True).eval())}
    sampling = SamplingConfig(temperature=0.7, max_new_tokens=GAMMA)
    gen = torch.Generator().manual_seed(0)
    print(f"threads {torch.get_num_threads()}, context {CONTEXT}, gamma {GAMMA}, head {HEAD}")
    print("batch | verify(g+1) s | decode s | eagle3 / verify | block / verify | "
          "block+corr / verify | corr / block")
    with torch.inference_mode():
        for N in (1, 16):
            verify, decode = verify_and_decode_seconds(policy, N)
            feats = torch.randn(N, CONTEXT, 576)
            cost = {}
            for name, drafter in drafts.items():
                if name == "eagle3":  # the context entries, then gamma one-token steps
                    cost[name] = eagle3_drafting_seconds(drafter, feats)
                else:
                    dc = drafter.new_cache(N, CONTEXT + 16)
                    drafter.add_context(dc, feats, None, CONTEXT)
                    cost[name] = median_seconds(
                        lambda drafter=drafter, dc=dc: drafter.draft(
                            dc, torch.randint(0, 1000, (N,)), GAMMA, None, sampling, gen), dc)
            print(f"{N:5d} | {verify:.4f} | {decode:.4f} | {cost['eagle3'] / verify:.3f} | "
                  f"{cost['block'] / verify:.3f} | {cost['block+corr'] / verify:.3f} | "
                  f"{cost['block+corr'] / cost['block']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
