"""Throughput of the plain generation engine: tokens per second at several batch sizes.

The workload is fixed-length so batch sizes compare like for like: random prompts of ``prompt_len``
tokens (BOS + random ids), EOS disabled, every row decodes exactly ``max_new_tokens`` tokens.
``num_prompts`` defaults to the batch size (one wave: no refills). Each batch size gets a short
warm-up run first (allocator, kernels), then one timed run.

    python -m cospec.bench.generation          # default ModelConfig, random weights
"""

from __future__ import annotations

import torch

from cospec.config import SamplingConfig
from cospec.data.tokenizer import BOS
from cospec.rollout.engine import GenerationEngine


def random_prompts(num_prompts: int, prompt_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    body = torch.randint(4, vocab_size, (num_prompts, prompt_len - 1), generator=gen)
    return [[BOS] + row for row in body.tolist()]


def run(model, batch_sizes=(1, 16, 64), *, num_prompts: int | None = None, prompt_len: int = 20,
        max_new_tokens: int = 64, temperature: float = 1.0, seed: int = 0,
        show: bool = True) -> list[dict]:
    """Time `GenerationEngine.generate` per batch size; one dict per batch size (and a table).

    Keys: batch_size, num_prompts, num_tokens, num_forwards, seconds, tokens_per_second,
    ms_per_forward, speedup (tokens/s relative to the first batch size).
    """
    device = next(model.parameters()).device
    sampling = SamplingConfig(temperature=temperature, max_new_tokens=max_new_tokens)
    rows = []
    for batch_size in batch_sizes:
        engine = GenerationEngine(model, batch_size=batch_size, stop_ids=None)
        prompts = random_prompts(num_prompts or batch_size, prompt_len, model.config.vocab_size, seed)
        gen = torch.Generator(device=device).manual_seed(seed)
        engine.generate(prompts[:batch_size], SamplingConfig(temperature=temperature, max_new_tokens=4),
                        generator=gen)  # warm-up
        result = engine.generate(prompts, sampling, generator=gen)
        rows.append({
            "batch_size": batch_size, "num_prompts": len(prompts), "num_tokens": result.num_tokens,
            "num_forwards": result.num_forwards, "seconds": result.seconds,
            "tokens_per_second": result.tokens_per_second,
            "ms_per_forward": 1000 * result.seconds / result.num_forwards,
        })
    for r in rows:
        r["speedup"] = r["tokens_per_second"] / rows[0]["tokens_per_second"]
    if show:
        print(format_table(rows))
    return rows


def format_table(rows: list[dict]) -> str:
    head = f"{'batch':>6} {'prompts':>8} {'tokens':>8} {'forwards':>9} {'seconds':>8} " \
           f"{'tok/s':>9} {'ms/fwd':>8} {'vs first':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['batch_size']:>6} {r['num_prompts']:>8} {r['num_tokens']:>8} "
                     f"{r['num_forwards']:>9} {r['seconds']:>8.2f} {r['tokens_per_second']:>9.1f} "
                     f"{r['ms_per_forward']:>8.2f} {r['speedup']:>8.2f}x")
    return "\n".join(lines)


def run_cli(cfg, *, batch_sizes, json_path: str | None = None) -> list[dict]:
    """`cospec bench generation`: the model of cfg.model with random weights (speed does not
    depend on the weights), on cfg.device; rows also written to json_path when given."""
    import json
    import platform

    from cospec.starting_policy import pick_device
    from cospec.models.llama import Transformer

    torch.manual_seed(0)
    policy = Transformer(cfg.model).to(pick_device(cfg.device)).eval()
    print(f"policy: {policy.num_params() / 1e6:.2f}M parameters, random weights, "
          f"device={next(policy.parameters()).device}, threads={torch.get_num_threads()}")
    rows = run(policy, batch_sizes, max_new_tokens=cfg.sampling.max_new_tokens)
    if json_path:
        meta = {"model": cfg.to_dict()["model"], "torch": torch.__version__,
                "machine": platform.machine(), "threads": torch.get_num_threads()}
        with open(json_path, "w") as f:
            json.dump({"results": rows, "meta": meta}, f, indent=2)
    return rows


if __name__ == "__main__":
    from cospec.config import RunConfig

    run_cli(RunConfig(), batch_sizes=(1, 16, 64))
