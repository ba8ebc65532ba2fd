"""How much the adaptive controller's calibration varies from one calibration to the next, with
the default 2 timed calls per cost (the fastest kept) and with 8 (docs/results/rollout.md,
"Paired speedups, and what this machine's timing noise is").

    python docs/results/worked/calibration_spread.py

The default SFT policy and EAGLE-3 draft in runs/default; 10 calibrations each at batch 1 and 16;
prints the range of verify(5)/verify(1) and draft(1)/verify(1).
"""
import statistics

import torch

from cospec.bench.rollout import _load_inputs
from cospec.config import resolve
from cospec.rollout.adaptive import AdaptiveGamma, CostModel
from cospec.rollout.calibration import calibrate
from cospec.rollout.speculative import SpeculativeEngine


def main() -> None:
    torch.set_num_threads(2)
    run = _load_inputs(resolve("default", None, ["out_dir=runs/default"]), quick=False,
                       workload="tasks", reuse=True, drafts=("eagle3",))
    for B in (1, 16):
        engine = SpeculativeEngine(run.policy, run.drafts["eagle3"], batch_size=B, gamma=4,
                                   stop_ids=run.data.tokenizer.stop_ids, controller=AdaptiveGamma(4))
        for repeats in (2, 8):
            verify, draft = [], []
            for _ in range(10):
                engine.controller.cost = CostModel()
                calibrate(engine, repeats=repeats)
                cost = engine.controller.cost
                verify.append(cost.verify_cost(B, 5) / cost.verify_cost(B, 1))
                draft.append(cost.draft_cost(B, 1) / cost.verify_cost(B, 1))
            print(f"batch {B}, {repeats} timed calls: verify(5)/verify(1) {min(verify):.2f}-"
                  f"{max(verify):.2f} (median {statistics.median(verify):.2f}), draft(1)/verify(1) "
                  f"{min(draft):.3f}-{max(draft):.3f}", flush=True)


if __name__ == "__main__":
    main()
