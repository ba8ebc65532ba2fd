"""What one GRPO policy micro-step costs on SmolLM2-135M's shapes, before and after the four
changes of stop 49, added one at a time and measured side by side (interleaved, medians):

    python docs/results/real_model/policy_step_cost.py [repeats]      # bf16 autocast, this CPU

- before: the head and the loss at every packed position, the packed attention in bf16 with
  its padded layout made by advanced indexing, AdamW's for-loop;
- +head: the head and the loss at the response positions only (`LocalPolicyStep` now);
- +fp32 attention: the packed attention in fp32 under autocast on a CPU;
- +padded by copy: the padded layout made by a copy into zeros and index_select, whose backwards
  are a gather and a scatter-add (`AttentionLayout.to_padded`; `sdpa_attention` now);
- after: and AdamW fused (`cospec.rl.layouts`).

Random weights of SmolLM2-135M's shapes (timing only, no model file needed); a minibatch of 8
sequences like the recipe's GRPO micro-steps (4 prompts x 8 rollouts in 4 micro-steps): chat
prompts of 71 tokens and answers of 20-110 tokens (mean 63, as the stop 48 GRPO run's). Each
call: forward under bf16 autocast, the GRPO terms, backward, clip, AdamW step.
"""
import copy
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from cospec.config import ModelConfig
from cospec.models.attention import sdpa_attention
from cospec.models.llama import Transformer
from cospec.models.precision import autocast, autocast_off
from cospec.rl.policy_step import LocalPolicyStep, PolicyMinibatch, minibatch_terms
from cospec.rollout.engine import Completion

SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
                      intermediate_size=1536, max_seq_len=512, rope_theta=100000.0,
                      tie_embeddings=True)
PROMPT, ANSWERS = 71, [20, 35, 48, 58, 66, 75, 92, 110]
LOSS = dict(temperature=0.7, clip_low=0.2, clip_high=0.28, kl_coef=0.0)


def indexed_attention(fp32: bool):
    """The packed path as it was (bf16 under autocast), or with only its dtype changed: SDPA on
    a padded layout gathered by advanced indexing (gather_NL, clamped past each end)."""
    def attend(q, k, v, layout):
        if fp32 and q.dtype == torch.bfloat16:
            with autocast_off(q.device):
                return attend(q.float(), k.float(), v.float(), layout).to(q.dtype)
        cu = layout.cu_seqlens
        scatter_T, N, L = layout.padded_index()
        gather_NL = torch.minimum(cu[:-1, None] + torch.arange(L)[None, :], (cu[1:] - 1)[:, None])
        unpack = lambda x: x[0][:, gather_NL].transpose(0, 1)  # noqa: E731
        out = F.scaled_dot_product_attention(unpack(q), unpack(k), unpack(v), is_causal=True,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return out.transpose(0, 1).reshape(q.shape[1], N * L, -1)[:, scatter_T][None]
    return attend


def full_head_step(policy, optimizer):
    """The step as it was: logits at every position, the terms over all of them."""
    def step(mb):
        with autocast("bfloat16", "cpu"):
            logits = policy(mb.tokens[None], cu_seqlens=mb.cu_seqlens).logits[0]
            loss, _ = minibatch_terms(logits, None, mb, **LOSS)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()
    return step


def variant(base, *, head: bool, attention, fused: bool):
    policy = copy.deepcopy(base).train()
    policy.attn_fn = attention
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6, betas=(0.9, 0.99), fused=fused)
    if not head:
        return full_head_step(policy, optimizer)
    step = LocalPolicyStep(policy, None, optimizer, grad_clip=1.0, autocast="bfloat16", **LOSS)
    return lambda mb: step(mb)


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    torch.manual_seed(0)
    base = Transformer(SMOLLM2)
    comps = [Completion(index=i, prompt=torch.randint(0, 49152, (PROMPT,)).tolist(),
                        tokens=torch.randint(0, 49152, (n,)).tolist(), logprobs=[-1.0] * n)
             for i, n in enumerate(ANSWERS)]
    mb = PolicyMinibatch.from_rollouts(comps, torch.randn(len(comps)), list(range(len(comps))))
    bf16, fp32 = indexed_attention(fp32=False), indexed_attention(fp32=True)
    variants = {"before": variant(base, head=False, attention=bf16, fused=False),
                "+head": variant(base, head=True, attention=bf16, fused=False),
                "+fp32 attention": variant(base, head=True, attention=fp32, fused=False),
                "+padded by copy": variant(base, head=True, attention=sdpa_attention, fused=False),
                "after (+fused AdamW)": variant(base, head=True, attention=sdpa_attention,
                                                fused=True)}
    times = {k: [] for k in variants}
    print(f"threads {torch.get_num_threads()}; {len(comps)} sequences, {len(mb.tokens)} tokens, "
          f"{mb.num_tokens} response tokens; {repeats} repeats after a warm-up")
    for r in range(repeats + 1):
        for name, step in variants.items():
            t0 = time.perf_counter()
            step(mb)
            if r:
                times[name].append(time.perf_counter() - t0)
    first = statistics.median(times["before"])
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"{name:22s} {m:6.3f} s  (min {min(ts):.3f}, max {max(ts):.3f})  "
              f"{first / m:.2f}x before")


if __name__ == "__main__":
    main()
