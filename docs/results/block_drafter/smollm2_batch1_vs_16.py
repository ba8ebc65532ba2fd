"""SmolLM2, the corrected block draft: batch 1 against batch 16 on the SAME 16 recipe prompts and
seeds (docs/results/block_drafter.md, "SmolLM2: why batch 1 read lower"). Per row: drafts judged
and accepted, response length; pooled acceptance by position.

Needs the drafts the section above trained (runs/smollm2-math/draft_block, reused as they are).
    python docs/results/block_drafter/smollm2_batch1_vs_16.py   # ~8 min on 2 cores, alone
"""
import json
import time

import torch

from cospec.bench.rollout import _load_inputs
from cospec.config import resolve
from cospec.models.loading import with_checkpoint_model
from cospec.rollout.speculative import SpeculativeEngine

OVERRIDES = ["draft.ttt_steps=4", "draft.block_correction=true", "draft.num_train_prompts=256",
             "draft.train_steps=240", "draft.tokens_per_batch=640", "rollout.dtype=float32",
             "grpo.autocast=", "draft.autocast="]


def main(path="docs/results/block_drafter/smollm2_batch1_vs_16.json"):
    torch.set_num_threads(2)
    cfg = with_checkpoint_model(resolve("smollm2-math", overrides=OVERRIDES))
    run = _load_inputs(cfg, quick=True, workload="tasks", reuse=True, drafts=("block",))
    prompts = run.prompts(16)
    out = {}
    for seed in (0, 1):
        for batch_size in (1, 16):
            engine = SpeculativeEngine(run.policy, run.drafts["block"], batch_size=batch_size,
                                       gamma=4, stop_ids=run.data.tokenizer.stop_ids)
            t0 = time.time()
            with torch.inference_mode():
                result = engine.generate(prompts, run.sampling,
                                         generator=torch.Generator().manual_seed(seed))
            st = result.stats
            out[f"block-{batch_size}-{seed}"] = row = {
                "judged": st.per_row_judged, "accepted": st.per_row_accepted,
                "lengths": [len(c.tokens) for c in result.completions],
                "acc": [round(a, 3) for a in st.acceptance_by_position], "reached": st.reached,
                "tau": st.accept_length, "secs": round(time.time() - t0, 1)}
            print(f"batch {batch_size} seed {seed}: {row}", flush=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
