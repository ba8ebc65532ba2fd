"""What one co-training update of the recipe's draft costs on SmolLM2's shapes:

    python docs/results/real_model/cotrain_update_cost.py [sequences ...]    # default 4 16

Random weights of SmolLM2-135M's shapes and an EAGLE-3 draft with an 8,192-id head, taps of
layers 1, 15 and 28, its embedding frozen (the recipe's), targets kept compressed as the policy
step keeps them; batches of whole sequences of a 71-token chat prompt and a 20-110-token answer
(4 sequences: ~450 tokens, a GRPO step's co-training share per minibatch at
draft.cotrain_max_tokens=2048 and 4 micro-steps; 16: ~2,070 tokens). Each update: the 4-step
TTT loss (0.75 TV) under bf16 autocast, backward, clip, fused AdamW. Median of 5 after 2
warm-ups. Stop 49 ran it at d3e90e5 and at its parent (the losses over every anchor) to measure
that commit (docs/results/real_model.md, "The policy step and co-training, cheaper").

    python docs/results/real_model/cotrain_update_cost.py --varying 0     # then --varying 32

instead times 30 updates of 4 sequences whose answer lengths are drawn anew for every update,
as a GRPO step's co-training sees them, padded to draft.token_bucket (0: off; 32, the
default), after 10 updates of warm-up, in a fresh process whose allocator keeps freed memory
as the trainer's does (`keep_freed_host_memory`).
"""
import random
import statistics
import sys
import time

import torch

from cospec.config import ModelConfig
from cospec.draft.losses import draft_targets
from cospec.draft.ttt import TTTBatch, pad_to_bucket, ttt_loss
from cospec.models.draft import Eagle3Draft
from cospec.models.llama import Transformer
from cospec.models.precision import autocast
from cospec.rollout.host_memory import keep_freed_host_memory

SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
                      intermediate_size=1536, max_seq_len=512, rope_theta=100000.0,
                      tie_embeddings=True)
ANSWERS = [20, 35, 48, 58, 66, 75, 92, 110, 30, 44, 52, 61, 70, 80, 40, 50]
PROMPT, TAPS, TEMPERATURE = 71, (1, 15, 28), 0.7


def batch_of(sequences: int, vocab_ids: torch.Tensor) -> TTTBatch:
    lengths = [(PROMPT, n) for n in ANSWERS[:sequences]]
    T = sum(a + b for a, b in lengths)
    cu = torch.tensor([0] + [a + b for a, b in lengths]).cumsum(0)
    mask = torch.zeros(T)
    for (prompt, answer), start in zip(lengths, cu[:-1].tolist()):
        mask[start + prompt - 1:start + prompt + answer - 1] = 1  # positions predicting the answer
    keep = draft_targets(vocab_ids, TEMPERATURE)
    return TTTBatch(tokens=torch.randint(0, SMOLLM2.vocab_size, (T,)), cu_seqlens=cu, loss_mask=mask,
                    taps={t: torch.randn(T, SMOLLM2.hidden_size) for t in TAPS},
                    policy_logits=keep(torch.randn(T, SMOLLM2.vocab_size)))


def update(draft, optimizer, batch: TTTBatch) -> float:
    t0 = time.perf_counter()
    with autocast("bfloat16", "cpu"):
        loss, _ = ttt_loss(draft, batch, num_steps=4, temperature=TEMPERATURE, tv_weight=0.75)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
    optimizer.step()
    return time.perf_counter() - t0


def varying(draft, optimizer, vocab_ids: torch.Tensor, bucket: int) -> None:
    keep_freed_host_memory()
    rng, times = random.Random(0), []
    for i in range(40):
        ANSWERS[:4] = [rng.randint(20, 110) for _ in range(4)]
        seconds = update(draft, optimizer, pad_to_bucket(batch_of(4, vocab_ids), bucket))
        if i >= 10:
            times.append(seconds)
    print(f"token_bucket {bucket}: {statistics.median(times):.3f} s an update (median of "
          f"{len(times)}, a new answer mix each)")


def main() -> None:
    torch.manual_seed(0)
    vocab_ids = torch.arange(8192) * 6
    draft = Eagle3Draft.from_policy(Transformer(SMOLLM2), vocab_ids=vocab_ids, tap_layers=TAPS)
    draft.embed_tokens.requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-4,
                                  fused=True)
    if sys.argv[1:2] == ["--varying"]:
        return varying(draft, optimizer, vocab_ids, int(sys.argv[2]))
    for sequences in [int(a) for a in sys.argv[1:]] or [4, 16]:
        batch = batch_of(sequences, vocab_ids)
        times = [update(draft, optimizer, batch) for _ in range(7)][2:]
        print(f"{sequences} sequences, {len(batch.tokens)} tokens ({int(batch.loss_mask.sum())} "
              f"trained): {statistics.median(times):.3f} s an update (min {min(times):.3f})")


if __name__ == "__main__":
    main()
