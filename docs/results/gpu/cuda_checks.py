"""The engines on the device they run on: greedy tokens of plain, speculative and adaptive decoding
compared row by row, and the device syncs a speculative step takes, counted by CUDA itself
(`torch.cuda.set_sync_debug_mode`) where there is a GPU (issue 16 asks for at most 2 a step; the
suite counts host reads with a TorchFunctionMode on the CPU, tests/test_speculative.py). Part of
the prepared GPU pass, docs/results/gpu/device_check.sh; on a machine without a GPU it runs on the
CPU and leaves the sync count out.

    python docs/results/gpu/cuda_checks.py [JSON]

Uses the embedded default's SFT policy and EAGLE-3 draft in runs/default, as they are.
"""

import json
import sys
import warnings

import torch

from cospec.bench.rollout import _load_inputs
from cospec.config import resolve
from cospec.config.sections import SamplingConfig
from cospec.rollout.engine import GenerationEngine
from cospec.rollout.speculative import SpeculativeEngine


def counting_syncs(fn):
    """fn()'s result and the device syncs it took (None without CUDA): CUDA's sync debug mode
    warns once per synchronizing call, and every warning is recorded."""
    if not torch.cuda.is_available():
        return fn(), None
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return out, sum("synchroniz" in str(w.message).lower() for w in caught)


def main(out: str | None, num_prompts: int = 32, batch: int = 8, gamma: int = 4) -> dict:
    run = _load_inputs(resolve("default", None, ["out_dir=runs/default"]), quick=True,
                       workload="tasks", reuse=True, drafts=("eagle3",))
    policy, draft, stops = run.policy, run.drafts["eagle3"], run.data.tokenizer.stop_ids
    prompts = run.prompts(num_prompts)
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=run.sampling.max_new_tokens)
    engines = {"plain": GenerationEngine(policy, batch_size=batch, stop_ids=stops),
               "speculative": SpeculativeEngine(policy, draft, batch_size=batch, gamma=gamma,
                                                stop_ids=stops),
               "adaptive": SpeculativeEngine(policy, draft, batch_size=batch, gamma=gamma,
                                             stop_ids=stops, adaptive=True)}
    report = {"device": str(run.device), "torch": torch.__version__,
              "device_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "prompts": num_prompts, "batch_size": batch, "gamma": gamma}
    with torch.inference_mode():
        tokens = {k: [c.tokens for c in e.generate(prompts, greedy).completions]
                  for k, e in engines.items()}
        for k in ("speculative", "adaptive"):
            same = sum(a == b for a, b in zip(tokens[k], tokens["plain"]))
            report[f"greedy_rows_equal_{k}"] = f"{same}/{num_prompts}"
        # syncs at the rollout temperature, after a warm-up call (allocator, first kernels)
        sampling = run.sampling
        spec = engines["speculative"]
        spec.generate(prompts[:batch], sampling, generator=torch.Generator().manual_seed(0))
        result, syncs = counting_syncs(lambda: spec.generate(
            prompts, sampling, generator=torch.Generator().manual_seed(1)))
        report["speculative_forwards"] = result.num_forwards
        report["syncs"] = syncs
        report["syncs_per_forward"] = None if syncs is None else round(syncs / result.num_forwards, 2)
        report["tau"] = round(result.stats.accept_length, 3)
    print(json.dumps(report, indent=2))
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
