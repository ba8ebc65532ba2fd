"""Plain generation throughput: cospec's engine against HF transformers' `generate`, same model,
same prompts, same sampling, runs interleaved.

    cospec bench generation [model.path=smollm2] [--batch-sizes 1,4,16,64] [--json PATH]

The model is the run's: the checkpoint at ``model.path`` (HF directory or GGUF; transformers loads
the same file for its side), or the embedded model's shape with random weights (speed does not
depend on the weights; it is saved as an HF checkpoint in a temporary directory for transformers).
The prompts are the run's task prompts (``task.source``, rendered by the tokenizer and its chat
template), ``B`` of them per batch size B: one wave, no refills, so both sides do the same work.
Stopping is disabled on both sides (cospec: no stop ids; HF: ``min_new_tokens``), so every row
decodes exactly ``sampling.max_new_tokens`` tokens and tokens per second compare like for like.
HF pads a batch on the left (its batched decoding needs it); cospec keeps per-row lengths.

Each batch size gets a short warm-up per side, then ``repeats`` rounds of (cospec, HF); the
medians of tokens/s are reported with their ratio (cospec / HF, > 1 means cospec is faster).
"""

from __future__ import annotations

import random
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch

from cospec.atomic_file import write_json_atomically
from cospec.config import RunConfig, SamplingConfig
from cospec.data.prompts import TaskData
from cospec.rollout.engine import GenerationEngine


def task_prompts(data: TaskData, n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [data.prompt_ids(data.source.sample(rng)) for _ in range(n)]


def cospec_tok_s(engine: GenerationEngine, prompts, sampling: SamplingConfig, seed: int) -> float:
    device = engine.cache.lengths_B.device
    result = engine.generate(prompts, sampling,
                             generator=torch.Generator(device=device).manual_seed(seed))
    return result.tokens_per_second


def hf_tok_s(model, prompts, sampling: SamplingConfig, *, pad_id: int, seed: int) -> float:
    """One batched `generate` over all prompts (left-padded), exactly max_new_tokens each."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    n = sampling.max_new_tokens
    greedy = sampling.temperature == 0
    kwargs = dict(do_sample=not greedy, max_new_tokens=n, min_new_tokens=n, pad_token_id=pad_id)
    if not greedy:
        kwargs.update(temperature=sampling.temperature, top_k=sampling.top_k or None,
                      top_p=sampling.top_p)
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids.to(device), attention_mask=mask.to(device), **kwargs)
    seconds = time.perf_counter() - t0
    return (out.shape[1] - width) * len(prompts) / seconds


def run(policy, hf_model, data: TaskData, batch_sizes, sampling: SamplingConfig, *,
        repeats: int = 2, seed: int = 0, show: bool = True) -> list[dict]:
    """Interleaved cospec / HF rounds per batch size; one row per batch size."""
    rows = []
    warm = SamplingConfig(temperature=sampling.temperature, max_new_tokens=4)
    for B in batch_sizes:
        prompts = task_prompts(data, B, seed)
        engine = GenerationEngine(policy, batch_size=B, stop_ids=None)
        cospec_tok_s(engine, prompts, warm, seed)
        hf_tok_s(hf_model, prompts, warm, pad_id=data.tokenizer.pad_id, seed=seed)
        ours, theirs = [], []
        for r in range(repeats):
            ours.append(cospec_tok_s(engine, prompts, sampling, seed + r))
            theirs.append(hf_tok_s(hf_model, prompts, sampling, pad_id=data.tokenizer.pad_id,
                                   seed=seed + r))
        row = {"batch_size": B, "num_prompts": B, "prompt_tokens_mean": sum(map(len, prompts)) / B,
               "max_new_tokens": sampling.max_new_tokens, "cospec_tok_s": statistics.median(ours),
               "hf_tok_s": statistics.median(theirs), "cospec_runs": ours, "hf_runs": theirs}
        row["cospec_over_hf"] = row["cospec_tok_s"] / row["hf_tok_s"]
        rows.append(row)
        if show:
            print(format_table(rows[-1:], header=len(rows) == 1), flush=True)
    return rows


def format_table(rows: list[dict], header: bool = True) -> str:
    head = f"{'batch':>6} {'prompt toks':>11} {'new toks':>8} {'cospec tok/s':>12} {'HF tok/s':>9} {'cospec/HF':>9}"
    lines = [head, "-" * len(head)] if header else []
    for r in rows:
        lines.append(f"{r['batch_size']:>6} {r['prompt_tokens_mean']:>11.1f} {r['max_new_tokens']:>8} "
                     f"{r['cospec_tok_s']:>12.1f} {r['hf_tok_s']:>9.1f} {r['cospec_over_hf']:>8.2f}x")
    return "\n".join(lines)


def load_hf_model(cfg: RunConfig, policy, tmp: Path):
    """transformers' own load of the run's model: the same file for a checkpoint, else the
    random-weight policy saved as an HF checkpoint under `tmp`."""
    from transformers import AutoModelForCausalLM

    from cospec.data.model_files import resolve_model_path
    from cospec.models.hf_checkpoint import save_hf
    from cospec.models.loading import DTYPES

    dtype = DTYPES[cfg.model.dtype]
    if not cfg.model.path:
        save_hf(policy, tmp / "policy")
        return AutoModelForCausalLM.from_pretrained(tmp / "policy", dtype=dtype).eval()
    path = resolve_model_path(cfg.model.path)
    if path.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                    dtype=dtype).eval()
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()


def run_cli(cfg: RunConfig, *, batch_sizes, repeats: int = 2, json_path: str | None = None) -> list[dict]:
    """`cospec bench generation`: rows also written to json_path when given."""
    import platform

    from cospec.models.llama import Transformer
    from cospec.models.loading import DTYPES, load_pretrained, load_tokenizer
    from cospec.artifacts import pick_device

    device = pick_device(cfg.device)
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(cfg.model)
    t1 = time.perf_counter()
    load = {}
    if cfg.model.path:
        policy = load_pretrained(cfg.model, tokenizer, device=device)
        # peak resident memory of this process so far: the loaded policy plus the interpreter
        load = {"tokenizer_seconds": t1 - t0, "model_seconds": time.perf_counter() - t1,
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
        print(f"loaded {cfg.model.path}: tokenizer {load['tokenizer_seconds']:.1f} s, weights "
              f"{load['model_seconds']:.1f} s, peak RSS {load['peak_rss_mb']:.0f} MB")
        what = f"{cfg.model.path} ({cfg.model.dtype})"
    else:
        torch.manual_seed(0)
        policy = Transformer(cfg.model).to(device=device, dtype=DTYPES[cfg.model.dtype]).eval()
        what = "the embedded model, random weights"
    data = TaskData.from_config(cfg.task, tokenizer)
    s = cfg.sampling
    sampling = SamplingConfig(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                              max_new_tokens=s.max_new_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        hf_model = load_hf_model(cfg, policy, Path(tmp)).to(device)
        print(f"policy: {what}, {policy.num_params() / 1e6:.1f}M parameters, prompts from "
              f"task.source={cfg.task.source}, temperature {s.temperature}, {s.max_new_tokens} new "
              f"tokens per row, device={device}, threads={torch.get_num_threads()}")
        rows = run(policy, hf_model, data, batch_sizes, sampling, repeats=repeats)
    if json_path:
        import transformers

        meta = {"model": cfg.to_dict()["model"], "task": cfg.to_dict()["task"],
                "sampling": cfg.to_dict()["sampling"], "torch": torch.__version__,
                "transformers": transformers.__version__, "machine": platform.machine(),
                "threads": torch.get_num_threads(), "repeats": repeats, "load": load}
        write_json_atomically(json_path, {"results": rows, "meta": meta}, indent=2)
    return rows
