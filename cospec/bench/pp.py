"""`cospec bench pp`: a pipelined training step with the draft's taps moved three ways.

# T packed tokens per microbatch, C hidden size, M microbatches, P pipeline stages

Methods, on the same stages, weights and microbatches (1F1B; the last stage waits for every tap of
microbatch m right after m's backward, and does nothing else with them, so the rows differ only in
how the taps travel):
- no_tap: the policy step alone;
- tap_channel: `TapChannel` (own group, receives posted before the step, sends posted from the
  forward hooks, waited only where consumed);
- blocking: what prior co-training code does: after a stage's forward of m (and its pipeline send)
  each tap goes by a blocking send on the tap group; the draft stage receives them with blocking
  receives right after its own forward of m.
A fourth configuration, tap_channel with the draft's TTT co-training on the last stage, is reported
apart (``draft_rows``): it adds the draft's compute, which no transport can hide. It co-trains the
way the GRPO trainer does (`TapCapture` in the schedule, then `cotrain_draft` with the default
draft config after the step), so it measures the trainer's own code path.

Step time is rank 0's wall time from a barrier before the step to a barrier after it (so it is the
slowest rank's), the median over ``repeats``; methods are interleaved, in rotating order, within
each repeat so that a noisy neighbour hits all of them alike, and ``paired_vs_no_tap`` is the
median of the per-repeat ratios. ``tap_post_seconds`` is the busiest rank's own time spent posting
taps (TapChannel: hook copies and isends; blocking: the blocking sends, stall included), the
transport's direct cost to the schedule's thread. Every rank runs with one thread.

    python -m cospec.bench.pp --pp 2,4 --microbatches 8 --json pp.json
    cospec bench pp [--quick] [--json PATH] [model.hidden_size=...]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import time
from dataclasses import asdict, dataclass
from functools import partial

import torch
import torch.distributed as dist

from cospec.atomic_file import write_json_atomically
from cospec.config import ModelConfig
from cospec.models.draft import Eagle3Draft, default_tap_layers
from cospec.models.llama import Transformer
from cospec.parallel.launch import spawn
from cospec.config import DraftConfig
from cospec.draft.cotrain import cotrain_draft
from cospec.draft.ttt import ttt_loss
from cospec.parallel.pipeline import (Microbatch, PipelineStep, PipeTransport, TapCapture,
                                      build_stage, pipeline_groups, split_layers, token_nll)
from cospec.data.packing import pack_examples
from cospec.data.tokenizer import BOS, EOS
from cospec.parallel.tap_channel import TapChannel, tap_owners

METHODS = ("no_tap", "tap_channel", "blocking")


@dataclass(frozen=True)
class BenchSettings:
    model: ModelConfig
    num_microbatches: int = 8
    seqs_per_microbatch: int = 4
    seq_len: int = 64  # positions per sequence: T = seqs_per_microbatch * seq_len
    repeats: int = 7
    warmup: int = 1


class BlockingTaps:
    """The baseline transport: blocking send/recv of the taps after the forward, on the tap group."""

    #: its blocking sends wait for the draft stage, which first waits for this stage's activation:
    #: the pipeline must have posted that send before `after_forward` (see `PipelineStep`)
    sends_in_after_forward = True

    def __init__(self, group, *, stage: int, stage_layers: list[range], tap_layers, hidden_size: int,
                 dtype: torch.dtype = torch.float32):
        self.owner = tap_owners(tap_layers, stage_layers)
        self.group, self.stage, self.hidden_size, self.dtype = group, stage, hidden_size, dtype
        self.draft_stage = len(stage_layers) - 1
        self.ranks = dist.get_process_group_ranks(group)
        self.bytes_sent, self.wait_seconds, self.post_seconds = 0, 0.0, 0.0
        self._m, self._counts, self._pending, self._got = None, [], {}, {}

    def attach(self, model) -> list:
        mine = [layer for layer, s in self.owner.items() if s == self.stage]
        return [model.layers[str(layer)].register_forward_hook(partial(self._on_tap, layer))
                for layer in mine]

    def _on_tap(self, layer, module, inputs, output) -> None:
        if self._m is not None:
            self._pending[layer] = output.detach()[0]

    def begin_step(self, step: int, token_counts: list[int]) -> None:
        self._counts = list(token_counts)

    def set_microbatch(self, m: int) -> None:
        self._m = m

    def after_forward(self, m: int) -> None:
        self._m = None
        if self.stage != self.draft_stage:
            start = time.perf_counter()
            for layer in sorted(self._pending):  # blocks until the draft stage's forward of m
                feat = self._pending.pop(layer).contiguous()
                dist.send(feat, self.ranks[self.draft_stage], group=self.group)
                self.bytes_sent += feat.numel() * feat.element_size()
            self.post_seconds += time.perf_counter() - start
            return
        start = time.perf_counter()
        for layer, source in self.owner.items():
            if source == self.stage:
                self._got[(m, layer)] = self._pending.pop(layer)
            else:
                buf = torch.empty(self._counts[m], self.hidden_size, dtype=self.dtype)
                dist.recv(buf, self.ranks[source], group=self.group)
                self._got[(m, layer)] = buf
        self.wait_seconds += time.perf_counter() - start

    def wait(self, m: int, layers=None) -> dict:
        return {layer: self._got.pop((m, layer)) for layer in (layers or list(self.owner))}

    def end_step(self) -> None:
        self._got.clear()


def bench_microbatches(s: BenchSettings) -> list:
    rng = random.Random(0)
    mbs = []
    prompt_len = s.seq_len // 4
    for m in range(s.num_microbatches):
        seqs = [[BOS] + [rng.randrange(4, s.model.vocab_size) for _ in range(s.seq_len - 1)] + [EOS]
                for _ in range(s.seqs_per_microbatch)]
        examples = [(ids, [0] * prompt_len + [1] * (len(ids) - prompt_len)) for ids in seqs]
        mbs.append(Microbatch.from_packed(pack_examples(examples), index=m))
    return mbs


def bench_ranks(rank: int, num_ranks: int, s: BenchSettings) -> list[dict]:
    """Per repeat and configuration: this rank's step seconds, tap wait and tap bytes."""
    torch.manual_seed(0)
    policy = Transformer(s.model)
    draft = Eagle3Draft.from_policy(policy)
    draft_opt = torch.optim.AdamW(draft.parameters(), lr=1e-4)  # the trainer's co-training, below
    mbs = bench_microbatches(s)
    pipe_group, tap_group = pipeline_groups()
    layers = split_layers(s.model.num_layers, num_ranks)
    model = build_stage(policy, layers[rank], stage=rank, num_stages=num_ranks)
    last, taps = rank == num_ranks - 1, default_tap_layers(s.model.num_layers)
    max_tokens = max(len(mb.tokens) for mb in mbs)
    transports = {
        "no_tap": None,
        "tap_channel": TapChannel(tap_group, stage=rank, stage_layers=layers, tap_layers=taps,
                                  max_microbatches=len(mbs), max_tokens=max_tokens,
                                  hidden_size=s.model.hidden_size),
        "blocking": BlockingTaps(tap_group, stage=rank, stage_layers=layers, tap_layers=taps,
                                 hidden_size=s.model.hidden_size)}
    configs = [(m, False) for m in METHODS] + [("tap_channel", True)]
    loss_fn = partial(token_nll, num_step_tokens=int(sum(mb.loss_mask.sum() for mb in mbs)))
    rows = []
    for rep in range(s.warmup + s.repeats):
        for i in range(len(configs)):
            method, with_draft = configs[(i + rep) % len(configs)]
            row = _timed_step(model, mbs, transports[method], pipe_group, loss_fn, rank, num_ranks,
                              (draft, draft_opt) if (with_draft and last) else None, step=rep)
            if rep >= s.warmup:
                rows.append({"method": method, "with_draft": with_draft, **row})
    return rows


def _timed_step(model, mbs, taps, pipe_group, loss_fn, rank, num_ranks, draft, step) -> dict:
    """One step; ``draft``: (draft, optimizer) on the last stage when it co-trains, the trainer's
    way: `TapCapture` in the schedule, then `cotrain_draft` on the step's captured inputs (the
    step's time includes it)."""
    handles = taps.attach(model) if taps is not None else []
    consumer = None
    if taps is not None and rank == num_ranks - 1:
        consumer = (TapCapture(taps, draft[0].tap_layers) if draft is not None
                    else (lambda mb, logits, num_microbatches: taps.wait(mb.index)))
    runner = PipelineStep(model, PipeTransport(pipe_group, rank, num_ranks), loss_fn, taps=taps,
                          on_last_backward=consumer)
    before = _counters(taps)
    dist.barrier()  # on the world group: neither the pipeline's nor the taps'
    start = time.perf_counter()
    runner.run(mbs, step=step)
    if draft is not None:
        cotrain_draft(draft[0], draft[1], [consumer.take()], DraftConfig(), temperature=1.0,
                      seed=step, loss_fn=ttt_loss)
    dist.barrier()
    seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    for h in handles:
        h.remove()
    after = _counters(taps)
    return {"seconds": seconds, **{k: after[k] - before[k] for k in after}}


def _counters(taps) -> dict:
    if taps is None:
        return {"tap_wait_seconds": 0.0, "tap_post_seconds": 0.0, "tap_bytes": 0}
    return {"tap_wait_seconds": taps.wait_seconds, "tap_post_seconds": taps.post_seconds,
            "tap_bytes": taps.bytes_sent}


def summarize(num_ranks: int, per_rank: list[list[dict]], s: BenchSettings) -> list[dict]:
    """One row per configuration. step_seconds: median over repeats of rank 0's time;
    paired_vs_no_tap: median over repeats of (this config / no_tap in the same repeat), the ratio a
    noisy machine disturbs least; tap_wait_seconds: the last stage's, median; tap_post_seconds: the
    busiest rank's time posting taps, median; tap_bytes: per step, summed over ranks."""
    configs = [(m, False) for m in METHODS] + [("tap_channel", True)]

    def pick(rank, method, with_draft):
        return [r for r in per_rank[rank] if r["method"] == method and r["with_draft"] == with_draft]

    base = [r["seconds"] for r in pick(0, "no_tap", False)]
    out = []
    for method, with_draft in configs:
        times = [r["seconds"] for r in pick(0, method, with_draft)]
        posts = zip(*[[r["tap_post_seconds"] for r in pick(rank, method, with_draft)]
                      for rank in range(num_ranks)])
        out.append({"pp": num_ranks, "method": method, "with_draft": with_draft,
                    "step_seconds": statistics.median(times),
                    "tap_wait_seconds": statistics.median(
                        r["tap_wait_seconds"] for r in pick(num_ranks - 1, method, with_draft)),
                    "tap_post_seconds": statistics.median(max(p) for p in posts),
                    "tap_bytes": sum(pick(rank, method, with_draft)[0]["tap_bytes"]
                                     for rank in range(num_ranks)),
                    "vs_no_tap": statistics.median(times) / statistics.median(base),
                    "paired_vs_no_tap": statistics.median(t / b for t, b in zip(times, base)),
                    "num_microbatches": s.num_microbatches,
                    "tokens_per_microbatch": s.seqs_per_microbatch * s.seq_len,
                    "step_seconds_all": times})
    return out


def format_table(rows: list[dict]) -> str:
    head = (f"{'pp':>3} {'method':>18} {'step s':>7} {'vs no_tap':>10} {'paired':>7} "
            f"{'tap wait s':>11} {'wait/step':>10} {'post s':>7} {'tap MB':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        name = r["method"] + ("+draft" if r["with_draft"] else "")
        lines.append(f"{r['pp']:>3} {name:>18} {r['step_seconds']:>7.3f} {r['vs_no_tap']:>9.3f}x "
                     f"{r['paired_vs_no_tap']:>6.3f}x {r['tap_wait_seconds']:>11.4f} "
                     f"{r['tap_wait_seconds'] / r['step_seconds']:>9.1%} "
                     f"{r['tap_post_seconds']:>7.4f} {r['tap_bytes'] / 1e6:>7.2f}")
    return "\n".join(lines)


def run(pp_sizes=(2, 4), settings: BenchSettings | None = None, json_path: str | None = None) -> list[dict]:
    s = settings or BenchSettings(model=ModelConfig())
    rows = []
    for num_ranks in pp_sizes:
        per_rank = spawn(bench_ranks, num_ranks, s, timeout_s=900, deadline_s=900)
        rows += summarize(num_ranks, per_rank, s)
    print(f"policy {s.model.num_layers} layers x {s.model.hidden_size}, {s.num_microbatches} "
          f"microbatches of {s.seqs_per_microbatch * s.seq_len} tokens, 1F1B, {s.repeats} repeats "
          f"(median), 1 thread per rank, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print(format_table(rows))
    if json_path:
        meta = {"settings": {**asdict(s), "model": asdict(s.model)}, "torch": torch.__version__,
                "machine": platform.machine(), "cpus": os.cpu_count(), "processor": platform.processor()}
        write_json_atomically(json_path, {"results": [r for r in rows if not r["with_draft"]],
                                          "draft_rows": [r for r in rows if r["with_draft"]],
                                          "meta": meta}, indent=2)
    return rows


def run_cli(cfg, *, quick: bool = False, json_path: str | None = None) -> list[dict]:
    """`cospec bench pp`: cfg.model with random weights; pp 2 and 4 (2 with --quick)."""
    s = BenchSettings(model=cfg.model, repeats=3 if quick else 7)
    return run((2,) if quick else (2, 4), s, json_path)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", default="2,4", help="comma-separated pipeline sizes")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--seqs-per-microbatch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json")
    a = p.parse_args(argv)
    s = BenchSettings(model=ModelConfig(), num_microbatches=a.microbatches,
                      seqs_per_microbatch=a.seqs_per_microbatch, seq_len=a.seq_len, repeats=a.repeats)
    run(tuple(int(x) for x in a.pp.split(",")), s, a.json)


if __name__ == "__main__":
    main()
