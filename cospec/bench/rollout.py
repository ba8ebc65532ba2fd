"""`cospec bench rollout`: plain vs speculative rollouts (fixed and adaptive gamma) vs HF assisted
generation, on the run's starting policy (the SFT policy, or the checkpoint at ``model.path``) and
its trained drafts, measured side by side in one run.

Workload (``--workload``): ``tasks``, the run's prompts (``task.source``; on the default
synthetic suite, worked solutions of ~40 tokens on average with a tail to 148; the stop ids are the
tokenizer's), or ``long``, copy prompts whose answers have 24-40 tokens; the config's
sampling (temperature 1 by default), ``sampling.max_new_tokens``. Per batch size B every method
answers the same prompts (2B of them, at least 16) with the same seed; methods run interleaved,
``repeats`` times each after one warm-up, and tokens/s is total tokens over total seconds, so slow
drift of the machine hits all methods alike.

Paired speedups (``paired_speedup``, ``adaptive_paired_speedup``): each speculative run is followed
by plain decoding of responses of exactly its lengths (`GenerationEngine.generate`'s
``response_lengths``), and the ratio is taken against that. Speculation changes which random
numbers each row draws, so each method samples other answers; with few prompts one long response
decides a run's length (a batch's tail decodes one row at a time), and unpaired ratios swing by
+-10-20% from the samples alone. Since sampling is lossless, the lengths have the same
distribution under every method, so the paired ratio estimates the same speedup with that
variance removed; the machine's own timing noise stays (docs/design.md, "Paired speedups").

Ideal speedup (what the cost model predicts from the measured tau, Leviathan et al. Sec. 3.4):
    ideal = tau * verify(B, 1) / (verify(B, G + 1) + draft(B, ceil(tau)) + (G - 1) * draft(B, 1))
with verify/draft the calibrated forward costs at B rows (`cospec.rollout.adaptive`); it leaves out
prefill, sampling and bookkeeping, so measured/ideal says how much of the rest eats the gain.

For a checkpoint, batch 1 also runs HF transformers' plain sampling (``generate``) of the same file
on the same prompts, beside cospec's plain and speculative engines. For the embedded model, batch 1
also runs HF transformers' assisted generation (``generate(assistant_model=...,
do_sample=True)``: lossless, batch 1 only) with the policy and a standalone draft LM exported to HF
layout, HF's plain sampling, and cospec's speculative engine with that same draft LM. The
assistant's knobs are read from its own generation_config: num_assistant_tokens = gamma, schedule
"constant" (HF's default "heuristic" schedule changes gamma as it goes).
"""

from __future__ import annotations

import copy
import math
import platform
import random
import time
from dataclasses import dataclass

import torch

from cospec.artifacts import read_stamp
from cospec.atomic_file import write_json_atomically
from cospec.bench.workloads import check_workload, task_prompts
from cospec.config import RunConfig, SamplingConfig
from cospec.data.prompts import TaskData
from cospec.data.tokenizer import EOS, PAD
from cospec.draft.offline import draft_dir
from cospec.rollout.adaptive import AdaptiveGamma
from cospec.rollout.compiled_forward import compile_rollouts, longest_row, precompile_engine
from cospec.rollout.engine import GenerationEngine
from cospec.rollout.speculative import SpeculativeEngine


class Timer:
    """Total tokens and seconds of one method over the interleaved repeats."""

    def __init__(self):
        self.tokens, self.seconds, self.results = 0, 0.0, []

    def add(self, result) -> None:
        self.tokens += result.num_tokens
        self.seconds += result.seconds
        self.results.append(result)

    @property
    def tok_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


def bench_batch_size(policy, draft, prompts, sampling: SamplingConfig, *, batch_size: int,
                     gamma: int, repeats: int, seed: int = 0, stop_ids=(EOS,),
                     overshoot_every: int = 1, compile: bool | None = False) -> dict:
    """One row: plain, speculative and adaptive engines (all compiled with ``compile``)."""
    device = next(policy.parameters()).device
    controller = AdaptiveGamma(gamma)
    spec = dict(batch_size=batch_size, gamma=gamma, stop_ids=stop_ids, overshoot_every=overshoot_every,
                compile=compile)
    engines = {
        "plain": GenerationEngine(policy, batch_size=batch_size, stop_ids=stop_ids, compile=compile),
        "spec": SpeculativeEngine(policy, draft, **spec),
        "adaptive": SpeculativeEngine(policy, draft, controller=controller, **spec),
    }
    with torch.inference_mode():
        for name, engine in engines.items():  # warm-up, calibration, graphs: none in a timed run
            engine.generate(prompts[:batch_size], sampling,
                            generator=torch.Generator(device=device).manual_seed(seed))
            precompile_engine(engine, longest_row(prompts, sampling.max_new_tokens, gamma))
    # The ideal speedup uses the calibrated costs alone (the online averages drift with the run).
    cost = copy.deepcopy(controller.cost)
    timers = timed_runs(engines, prompts, sampling, repeats=repeats, seed=seed)
    spec_stats = [res.stats for res in timers["spec"].results]
    tau = sum(s.step_tokens for s in spec_stats) / max(sum(s.row_steps for s in spec_stats), 1)
    draft_s = cost.draft_step_cost(batch_size, gamma, math.ceil(tau), controller.block_drafter)
    ideal = tau * cost.verify_cost(batch_size, 1) / (cost.verify_cost(batch_size, gamma + 1) + draft_s)
    gamma_mix: dict[int, int] = {}
    for res in timers["adaptive"].results:
        for g, c in res.stats.gamma_counts.items():
            gamma_mix[g] = gamma_mix.get(g, 0) + c
    last = timers["spec"].results[-1].stats
    speedup = timers["spec"].tok_s / timers["plain"].tok_s
    return {"batch_size": batch_size, "num_prompts": len(prompts),
            "plain_tok_s": timers["plain"].tok_s, "spec_tok_s": timers["spec"].tok_s,
            "adaptive_tok_s": timers["adaptive"].tok_s, "speedup": speedup,
            "adaptive_speedup": timers["adaptive"].tok_s / timers["plain"].tok_s,
            "paired_speedup": timers["spec"].tok_s / timers["plain@spec"].tok_s,
            "adaptive_paired_speedup": timers["adaptive"].tok_s / timers["plain@adaptive"].tok_s,
            "accept_length": tau, "ideal_speedup": ideal, "measured_over_ideal": speedup / ideal,
            "acceptance_by_position": last.acceptance_by_position,
            "adaptive_gamma_counts": {str(k): v for k, v in sorted(gamma_mix.items())},
            "adaptive_seconds": time_split(timers["adaptive"], timers["plain"]),
            # c(N, G) after the run: measured whole-step seconds over the forwards' cost
            "adaptive_step_correction": {str(g): {str(n): c for n, c in sorted(t.items())}
                                         for g, t in sorted(controller.step_correction.items())},
            "spec_time_split": {"draft": last.draft_seconds, "verify": last.verify_seconds,
                                "other": last.other_seconds},
            "verify_cost_ratio": cost.verify_cost(batch_size, gamma + 1) / cost.verify_cost(batch_size, 1),
            "draft_cost_ratio": cost.draft_cost(batch_size, 1) / cost.verify_cost(batch_size, 1),
            # the calibrated drafting time of a step at each gamma (a catch-up of 1 entry), over
            # one plain decode forward: how the draft's cost grows with the block
            "draft_step_over_decode_by_gamma": {
                str(g): cost.draft_step_cost(batch_size, g, 1, controller.block_drafter)
                / cost.verify_cost(batch_size, 1) for g in range(1, gamma + 1)}}


def timed_runs(engines: dict, prompts, sampling: SamplingConfig, *, repeats: int,
               seed: int) -> dict[str, Timer]:
    """Each engine (plain first) answers the prompts ``repeats`` times, interleaved, seeds
    seed + 1 + r; after each other engine's run, ``plain@NAME``: the plain engine decodes
    responses of that run's lengths (the paired baseline)."""
    device = next(engines["plain"].model.parameters()).device
    timers = {k: Timer() for k in engines} | {f"plain@{k}": Timer() for k in engines if k != "plain"}
    for r in range(repeats):
        for name, engine in engines.items():
            gen = torch.Generator(device=device).manual_seed(seed + 1 + r)
            timers[name].add(result := engine.generate(prompts, sampling, generator=gen))
            if name != "plain":
                lengths = [len(c.tokens) for c in result.completions]
                gen = torch.Generator(device=device).manual_seed(seed + 1 + r)
                timers[f"plain@{name}"].add(engines["plain"].generate(
                    prompts, sampling, generator=gen, response_lengths=lengths))
    return timers


def time_split(adaptive: Timer, plain: Timer) -> dict:
    """Where adaptive's time went (its steps by gamma, the switch-on steps, the draft's prefills
    of new rows), beside the plain engine's seconds for the same prompts."""
    stats = [res.stats for res in adaptive.results]
    by_gamma: dict[int, float] = {}
    for st in stats:
        for g, sec in st.seconds_by_gamma.items():
            by_gamma[g] = by_gamma.get(g, 0.0) + sec
    return {"total": adaptive.seconds, "plain_total": plain.seconds,
            "steps_by_gamma": {str(g): v for g, v in sorted(by_gamma.items())},
            "switch_on_steps": sum(st.switch_on_steps for st in stats),
            "switch_on": sum(st.switch_on_seconds for st in stats),
            "draft_prefill": sum(st.draft_prefill_seconds for st in stats)}


def hf_generate_tok_s(model, prompts, sampling: SamplingConfig, *, assistant=None, seed: int = 0,
                      repeats: int = 1, stop_ids=(EOS,), pad_id: int = PAD) -> float:
    """HF `generate` one prompt at a time (assisted generation supports batch 1 only)."""
    tokens, seconds = 0, 0.0
    kwargs = dict(do_sample=True, temperature=sampling.temperature, top_k=0, top_p=sampling.top_p,
                  max_new_tokens=sampling.max_new_tokens, eos_token_id=list(stop_ids),
                  pad_token_id=pad_id)
    if assistant is not None:
        kwargs["assistant_model"] = assistant
    for r in range(repeats):
        torch.manual_seed(seed + r)
        for p in prompts:
            ids = torch.tensor([p])
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
            seconds += time.perf_counter() - t0
            tokens += out.shape[1] - len(p)
    return tokens / seconds


def load_hf_pair(policy_dir, draft_lm_dir, gamma: int, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    hf_policy = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=dtype).eval()
    hf_draft = AutoModelForCausalLM.from_pretrained(draft_lm_dir, dtype=dtype).eval()
    hf_draft.generation_config.num_assistant_tokens = gamma
    hf_draft.generation_config.num_assistant_tokens_schedule = "constant"
    return hf_policy, hf_draft


def format_table(rows: list[dict]) -> str:
    head = (f"{'draft':>6} {'batch':>5} {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>8} "
            f"{'paired':>7} {'adapt tok/s':>11} "
            f"{'adapt x':>8} {'paired':>7} {'tau':>5} {'ideal':>6} {'meas/ideal':>10}  adaptive gammas")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.get('draft', 'eagle3'):>6} {r['batch_size']:>5} {r['plain_tok_s']:>11.1f} "
                     f"{r['spec_tok_s']:>10.1f} {r['speedup']:>7.2f}x {r['paired_speedup']:>6.2f}x "
                     f"{r['adaptive_tok_s']:>11.1f} {r['adaptive_speedup']:>7.2f}x "
                     f"{r['adaptive_paired_speedup']:>6.2f}x "
                     f"{r['accept_length']:>5.2f} {r['ideal_speedup']:>5.2f}x {r['measured_over_ideal']:>10.2f}"
                     f"  {r['adaptive_gamma_counts']}")
    return "\n".join(lines)


@dataclass
class _BenchInputs:
    """What every measurement of one `run_cli` shares."""

    cfg: RunConfig  # the run's, at the rollout dtype when one is set
    start_policy: torch.nn.Module  # the starting policy as loaded: the drafts are trained on it
    policy: torch.nn.Module  # the copy every method decodes with
    drafts: dict[str, torch.nn.Module]  # every draft measured, by kind (eagle3, block), same dtype
    data: TaskData  # prompts, tokenizer and its stop ids
    sampling: SamplingConfig
    device: torch.device
    quick: bool
    workload: str

    @property
    def first_draft(self) -> tuple[str, torch.nn.Module]:
        """(kind, draft) of the first kind asked for: the one the HF comparisons run beside."""
        return next(iter(self.drafts.items()))

    @property
    def gamma(self) -> int:
        return self.cfg.rollout.gamma

    @property
    def repeats(self) -> int:
        return 1 if self.quick else 3

    def prompts(self, n: int, seed: int = 2024) -> list[list[int]]:
        return task_prompts(self.cfg, n, seed, workload=self.workload, data=self.data)

    def bench(self, draft, prompts, *, batch_size: int, **kwargs) -> dict:
        """`bench_batch_size` of the policy with ``draft`` at the run's sampling, gamma and
        ``rollout.compile``."""
        return bench_batch_size(self.policy, draft, prompts, self.sampling, batch_size=batch_size,
                                gamma=self.gamma, repeats=self.repeats,
                                stop_ids=self.data.tokenizer.stop_ids,
                                compile=self.cfg.rollout.compile,
                                **kwargs)


def run_cli(cfg: RunConfig, *, batch_sizes, quick: bool = False, json_path: str | None = None,
            hf: bool = True, workload: str = "tasks", reuse: bool = False,
            drafts: tuple[str, ...] = ("eagle3",)) -> dict:
    """Train (or reuse) the SFT policy and the drafts under cfg.out_dir, then measure: one row per
    draft kind (``drafts``: eagle3, block) and batch size, each with a ``draft`` field.
    ``reuse``: keep them even when made with other settings (`cospec.artifacts`)."""
    check_workload(cfg, workload)
    run = _load_inputs(cfg, quick=quick, workload=workload, reuse=reuse, drafts=drafts)
    rows = []
    for B in batch_sizes:
        prompts = run.prompts(max(16 if quick else 24, 2 * B) // (2 if quick else 1))
        for kind, draft in run.drafts.items():
            rows.append({"draft": kind, **run.bench(draft, prompts, batch_size=B,
                                                    overshoot_every=run.cfg.rollout.overshoot_every)})
            print(format_table(rows[-1:]).splitlines()[-1], flush=True)
    out = {"results": rows, "acceptance_by_family": {}}
    for kind, draft in run.drafts.items():
        out["acceptance_by_family"][kind] = by_family = acceptance_by_family(run, draft)
        print(f"{kind} acceptance by family (tau; drafts accepted / judged): " + ", ".join(
            f"{f} {v['accept_length']:.2f}; {v['acceptance']:.2f}" for f, v in by_family.items()))
    if hf and run.cfg.model.path:
        out.update(_hf_plain_on_the_checkpoint(run))
    elif hf:
        out.update(_hf_assisted_with_a_draft_lm(run, rows, reuse=reuse))
    print()
    print(format_table(rows))
    out["meta"] = _meta(run)
    if json_path:
        write_json_atomically(json_path, out, indent=2)
    return out


def acceptance_by_family(run: _BenchInputs, draft, *, per_family: int = 16, seed: int = 99) -> dict:
    """{family: {accept_length, acceptance, num_prompts}}: the draft at the run's gamma (fixed)
    on ``per_family`` prompts of each family of the prompt source, at batch 16."""
    rng = random.Random(seed)
    families = run.data.source.family_names
    examples = [run.data.source.sample_family(f, rng) for f in families for _ in range(per_family)]
    engine = SpeculativeEngine(run.policy, draft, batch_size=16, gamma=run.gamma,
                               stop_ids=run.data.tokenizer.stop_ids)
    with torch.inference_mode():
        stats = engine.generate([run.data.prompt_ids(e) for e in examples], run.sampling,
                                generator=torch.Generator(device=run.device).manual_seed(seed)).stats
    out = {}
    for f in families:
        rows = [i for i, e in enumerate(examples) if e.family == f]
        out[f] = {"accept_length": stats.pooled_accept_length(rows),
                  "acceptance": stats.pooled_acceptance(rows),
                  "num_prompts": len(rows)}
    return out


def _load_inputs(cfg: RunConfig, *, quick: bool, workload: str, reuse: bool,
                 drafts: tuple[str, ...] = ("eagle3",)) -> _BenchInputs:
    """The starting policy and the drafts asked for (each trained or reused; no other), at the
    rollout dtype; prints what is measured."""
    from cospec.artifacts import load_or_train_draft, load_policy, pick_device
    from cospec.config import apply
    from cospec.models.loading import inference_copy

    device = pick_device(cfg.device)
    start = load_policy(cfg, device, reuse=reuse)
    policy, data = start.policy, TaskData.from_config(cfg.task, start.tokenizer)
    measured = {kind: load_or_train_draft(apply(cfg, {"draft": {"kind": kind}}), policy, data=data,
                                          reuse=reuse)[0] for kind in drafts}
    if cfg.rollout.dtype:  # every method, HF's included, decodes at the rollout dtype
        policy = inference_copy(policy, cfg.rollout.dtype)
        measured = {k: inference_copy(d, cfg.rollout.dtype) for k, d in measured.items()}
        cfg = apply(cfg, {"model": {"dtype": cfg.rollout.dtype}})
    s = cfg.sampling
    sampling = SamplingConfig(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                              max_new_tokens=s.max_new_tokens)
    sizes = ", ".join(f"{k} draft {sum(p.numel() for p in d.parameters()) / 1e6:.2f}M"
                      for k, d in measured.items())
    print(f"policy {policy.num_params() / 1e6:.2f}M params, {sizes}, gamma {cfg.rollout.gamma}, "
          f"temperature {s.temperature}, workload {workload}, dtype {cfg.model.dtype}, "
          f"threads {torch.get_num_threads()}, device {device}")
    return _BenchInputs(cfg=cfg, start_policy=start.policy, policy=policy, drafts=measured, data=data,
                        sampling=sampling, device=device, quick=quick, workload=workload)


def _hf_plain_on_the_checkpoint(run: _BenchInputs) -> dict:
    """Batch 1 on a checkpoint (``model.path``): HF's plain sampling of the same file beside
    cospec's plain and speculative engines, on the same prompts."""
    import tempfile
    from pathlib import Path

    from cospec.bench.generation import load_hf_model

    prompts = run.prompts(8 if run.quick else 16, seed=77)
    with tempfile.TemporaryDirectory() as tmp:
        hf_policy = load_hf_model(run.cfg, run.policy, Path(tmp))
    kind, draft = run.first_draft
    same = run.bench(draft, prompts, batch_size=1)
    hf_tok_s = hf_generate_tok_s(hf_policy, prompts, run.sampling, repeats=run.repeats,
                                 stop_ids=run.data.tokenizer.stop_ids, pad_id=run.data.tokenizer.pad_id)
    print(f"batch 1: HF plain generate {hf_tok_s:.1f} tok/s, cospec plain "
          f"{same['plain_tok_s']:.1f}, cospec speculative ({kind}) {same['spec_tok_s']:.1f} "
          f"(tau {same['accept_length']:.2f}): {same['spec_tok_s'] / hf_tok_s:.2f}x HF")
    return {"hf_plain_tok_s": hf_tok_s, "cospec_same_prompts_spec_tok_s": same["spec_tok_s"],
            "cospec_same_prompts_plain_tok_s": same["plain_tok_s"]}


def _hf_assisted_with_a_draft_lm(run: _BenchInputs, rows: list[dict], *, reuse: bool) -> dict:
    """Batch 1 on the embedded model: HF's assisted generation with a standalone draft LM (trained
    or reused) beside HF's plain sampling and cospec's engines with the same draft LM; ``rows``
    gives cospec's figure with the first draft asked for, at the first batch size, to compare."""
    from cospec.artifacts import load_or_train_draft
    from cospec.config import apply
    from cospec.draft.offline import draft_dir
    from cospec.models.loading import inference_copy

    lm_cfg = apply(run.cfg, {"draft": {"kind": "lm"}})
    draft_lm, _ = load_or_train_draft(lm_cfg, run.start_policy, reuse=reuse)
    draft_lm = inference_copy(draft_lm, run.cfg.rollout.dtype)
    prompts = run.prompts(8 if run.quick else 16, seed=77)
    same = run.bench(draft_lm, prompts, batch_size=1)
    # The SFT checkpoint is already in HF layout; the draft LM is saved as one (save_draft).
    hf_policy, hf_draft = load_hf_pair(f"{run.cfg.out_dir}/sft", draft_dir(lm_cfg), run.gamma,
                                       dtype=next(run.policy.parameters()).dtype)
    first = rows[0]["draft"]
    hf_plain = hf_generate_tok_s(hf_policy, prompts, run.sampling, repeats=run.repeats)
    hf_assisted = hf_generate_tok_s(hf_policy, prompts, run.sampling, assistant=hf_draft,
                                    repeats=run.repeats)
    print(f"batch 1, standalone draft LM ({sum(p.numel() for p in draft_lm.parameters()) / 1e6:.2f}M): "
          f"HF plain {hf_plain:.1f} tok/s, HF assisted {hf_assisted:.1f}, "
          f"cospec plain {same['plain_tok_s']:.1f}, cospec speculative {same['spec_tok_s']:.1f} "
          f"(tau {same['accept_length']:.2f}); cospec {first} {rows[0]['spec_tok_s']:.1f}; "
          f"cospec {first} / HF assisted = {rows[0]['spec_tok_s'] / hf_assisted:.2f}x")
    return {"hf_plain_tok_s": hf_plain, "hf_assisted_tok_s": hf_assisted,
            "cospec_same_draft_tok_s": same["spec_tok_s"],
            "cospec_same_draft_plain_tok_s": same["plain_tok_s"],
            "cospec_same_draft_accept_length": same["accept_length"]}


def _meta(run: _BenchInputs) -> dict:
    """What the figures were measured on, for the JSON (with each draft's made_by.json stamp)."""
    config = run.cfg.to_dict()
    return {"model": config["model"], "task": config["task"],
            "draft_vocab_size": getattr(run.first_draft[1], "draft_vocab_size", None), "gamma": run.gamma,
            "drafts": {k: {"layers": len(d.layers), "params": sum(p.numel() for p in d.parameters()),
                           "correction": getattr(d, "has_correction", False),
                           "confidence": getattr(d, "has_confidence", False),
                           "made_by": read_stamp(draft_dir(run.cfg, k))}
                       for k, d in run.drafts.items()},
            "sampling": config["sampling"], "torch": torch.__version__, "machine": platform.machine(),
            "threads": torch.get_num_threads(), "device": str(run.device), "quick": run.quick,
            "compile": compile_rollouts(run.cfg.rollout.compile, run.device),
            "workload": run.workload}
