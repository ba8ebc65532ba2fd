"""`cospec <command>`: the command line.

Every command takes ``--recipe NAME``, ``--config FILE`` (YAML/TOML/JSON) and any number of
``section.field=value`` overrides, applied in that order. ``cospec config`` prints every field with
its default and doc.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

from cospec import config as config_mod
from cospec.artifacts import load_or_train_sft, load_policy, pick_device
from cospec.config import ConfigError, RunConfig, SamplingConfig
from cospec.data.prompts import TaskData
from cospec.evaluate import measure_speculation, print_accuracy
from cospec.models.integrity import CheckpointError, NonFiniteError


def _config_args(p: argparse.ArgumentParser, *, reuse: bool = True) -> None:
    p.add_argument("--recipe", default="default", help=f"named recipe ({', '.join(config_mod.RECIPES)})")
    p.add_argument("--config", dest="config_file", help="YAML/TOML/JSON file laid over the recipe")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="overrides, applied last")
    if reuse:  # the commands that load the SFT policy or the drafts out_dir keeps
        p.add_argument("--reuse", action="store_true",
                       help="reuse the SFT policy and drafts in out_dir even when they were made "
                            "with other settings (default: rebuild them, naming the settings)")


def _resolve(args, *, checkpoint_required: bool = True,
             switched_on: tuple[str, ...] = ()) -> RunConfig:
    """Recipe, file, overrides; then a checkpoint's architecture where model.path names one.
    Without `checkpoint_required` (``cospec config``), a checkpoint that cannot be read leaves the
    config as typed, with a warning: a recipe validates before its model is installed.
    ``switched_on``: switches the command sets itself whatever the config says (the rollout
    benchmark speculates and builds its --drafts; the experiments run speculative and co-training
    modes), so no field is reported as without effect for lack of them."""
    from cospec.models.loading import with_checkpoint_model
    from cospec.models.precision import slow_bf16_warnings

    cfg = config_mod.resolve(args.recipe, args.config_file, args.overrides)
    for warning in config_mod.no_effect_warnings(cfg, switched_on) + slow_bf16_warnings(cfg):
        print(f"cospec: warning: {warning}", file=sys.stderr)
    try:
        return with_checkpoint_model(cfg)
    except ConfigError:  # a field that does not fit the checkpoint's architecture
        raise
    except ValueError as e:  # a missing package or file, an unsupported architecture
        if checkpoint_required:
            raise ConfigError(str(e)) from e
        print(f"cospec: warning: {e}; the model.* fields below are the config's, not the "
              f"checkpoint's", file=sys.stderr)
        return cfg


def cmd_config(args) -> int:
    cfg = _resolve(args, checkpoint_required=False)
    print(json.dumps(cfg.to_dict(), indent=2))
    if args.describe:
        for name, default, doc in config_mod.describe():
            print(f"{name:32s} {default:>24s}  {doc}")
    return 0


def cmd_plan(args) -> int:
    """Memory per rank and collective bytes per step of the configured run, from formulas."""
    from cospec.parallel.plan import format_plan, plan

    cfg = _resolve(args)  # a model.path checkpoint gives the architecture (its config.json only)
    if args.context is not None and args.context < 1:
        raise ConfigError(f"--context: must be >= 1, got {args.context}")
    if args.context is not None and args.lengths:
        raise ConfigError("--context and --lengths: give one of them")
    if args.lengths:
        lengths = _rollout_lengths(args.lengths, cfg)
        shown = f"{min(lengths)}-{max(lengths)} (mean {sum(lengths) / len(lengths):.0f})"
        print(format_plan(cfg, plan(cfg, lengths=lengths), shown))
        return 0
    context = args.context or cfg.model.max_seq_len
    print(format_plan(cfg, plan(cfg, context=context), context))
    return 0


def _rollout_lengths(path: str, cfg: RunConfig) -> list[int]:
    """The step's rollout lengths from a file of integers (whitespace or commas between them),
    in order, repeated to fill the step's rollouts."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"--lengths: cannot read {path}: {e.strerror}") from e
    words = text.replace(",", " ").split()
    bad = [w for w in words if not w.isdigit() or int(w) < 1]
    if not words or bad:
        raise ConfigError(f"--lengths: {path} must hold positive integers (tokens per rollout), "
                          + (f"found {bad[0]!r}" if bad else "found none"))
    given = [int(w) for w in words]
    if max(given) > cfg.model.max_seq_len:
        raise ConfigError(f"--lengths: a rollout of {max(given)} tokens is longer than "
                          f"model.max_seq_len={cfg.model.max_seq_len}")
    rollouts = cfg.grpo.prompts_per_step * cfg.grpo.group_size
    return [given[k % len(given)] for k in range(rollouts)]


def cmd_sft(args) -> int:
    cfg = _resolve(args)
    if cfg.model.path:
        raise ConfigError(f"model.path={cfg.model.path}: cospec sft trains the embedded model on "
                          f"the synthetic tasks; a pretrained checkpoint is used as it is")
    device = pick_device(cfg.device)
    _, metrics = load_or_train_sft(cfg, device, force=True)
    print_accuracy(metrics)
    return 0


#: what the demo and the stale-draft experiment switch on in their modes
EXPERIMENT_SWITCHES = ("rollout.speculative=true", "draft.mode=cotrain")


def cmd_demo(args) -> int:
    """The main job (`cospec.experiments.demo`) on the resolved config."""
    from cospec.experiments.demo import run_demo

    run_demo(_resolve(args, switched_on=EXPERIMENT_SWITCHES), reuse=args.reuse,
             command="cospec demo " + " ".join(args.overrides))
    return 0


def cmd_eval(args) -> int:
    """Accuracy and response lengths of the run's starting policy by prompt family, per temperature."""
    from cospec.atomic_file import write_json_atomically
    from cospec.evaluate import evaluate_policy, format_table

    cfg = _resolve(args)
    start = load_policy(cfg, pick_device(cfg.device), reuse=args.reuse)
    data = TaskData.from_config(cfg.task, start.tokenizer)
    temps = ([float(t) for t in args.temperatures.split(",")] if args.temperatures
             else [cfg.sampling.temperature])
    results = {}
    for t in temps:
        sampling = SamplingConfig(temperature=t, max_new_tokens=cfg.sampling.max_new_tokens)
        results[t] = evaluate_policy(start.policy, data, sampling,
                                     prompts_per_family=args.prompts_per_type,
                                     batch_size=cfg.sampling.batch_size, progress=True)
    print(format_table(results))
    if args.json:
        write_json_atomically(args.json, {"results": {str(t): r for t, r in results.items()},
                                          "config": cfg.to_dict()}, indent=2)
    return 0


def cmd_export(args) -> int:
    """The run's policy (HF layout, with tokenizer files) and EAGLE-3 draft (vLLM/SpecForge layout)."""
    from cospec.export import export_run

    cfg = _resolve(args)
    try:
        export_run(cfg, args.out or f"{cfg.out_dir}/export", device=pick_device(cfg.device),
                   reuse=args.reuse)
    except CheckpointError:  # a bad file is said as one (exit 2), not as a config error
        raise
    except ValueError as e:  # what the target layouts cannot express (e.g. repeated tap layers)
        raise ConfigError(f"export: {e}") from e
    return 0


def cmd_report(args) -> int:
    from cospec.metrics.report import write_report

    path = write_report(args.run_dirs, args.out, bench_json=args.bench)
    print(f"wrote {path}")
    return 0


def cmd_draft_train(args) -> int:
    """Train a draft on the SFT policy's own samples (the frozen draft; co-training's start)."""
    from cospec.artifacts import load_or_train_draft

    cfg = _resolve(args)
    device = pick_device(cfg.device)
    start = load_policy(cfg, device, reuse=args.reuse)
    policy, data = start.policy, TaskData.from_config(cfg.task, start.tokenizer)
    draft, metrics = load_or_train_draft(cfg, policy, force=True, data=data, fresh=args.fresh)
    print(f"draft ({cfg.draft.kind}): {sum(p.numel() for p in draft.parameters()) / 1e6:.2f}M params, "
          f"{metrics['num_tokens']} policy-sampled tokens, {cfg.draft.train_steps} steps in "
          f"{metrics['train_seconds']:.0f}s, final loss {metrics['final_loss']:.3f}")
    if acc := metrics["last_batch"].get("acceptance"):
        step = "by TTT step" if len(acc) > 1 else "of the next token"  # a draft LM has one
        print(f"teacher-forced acceptance (1 - TV) {step}, last batch: {', '.join(f'{a:.2f}' for a in acc)}")
    for h in metrics["held_out"]:
        key, tau = ("acceptance" if "acceptance" in h else "ce"), h.get("expected_accept_length", [])
        print(f"  held-out ({metrics['num_held_out_answers']} answers) at step {h['step']}: {key} "
              + ", ".join(f"{a:.2f}" for a in h[key]) + "".join(f", expected tau {t:.2f}" for t in tau))
    spec, plain = measure_speculation(cfg, policy, draft, data)
    st = spec.stats
    print(f"speculative sampling on 64 held-out prompts, gamma={cfg.rollout.gamma}, batch "
          f"{cfg.sampling.batch_size}: tau {st.accept_length:.2f}, acceptance by position "
          f"{[round(a, 2) for a in st.acceptance_by_position]}, "
          f"{spec.tokens_per_second:.0f} tok/s vs plain {plain.tokens_per_second:.0f} tok/s")
    return 0


def cmd_train(args) -> int:
    """GRPO from the SFT checkpoint (made if absent), plain or speculative rollouts; under
    torchrun with parallel.dp, cp or pp > 1, distributed (cospec.parallel.train_group)."""
    from cospec.parallel.train_group import join_train_group
    from cospec.rl.layouts import check_rl_config

    cfg = _resolve(args)
    check_rl_config(cfg)
    # None on one process. The timeout also bounds the wait of ranks 1.. while rank 0 makes a
    # missing SFT checkpoint or draft (minutes on this CPU).
    group = join_train_group(cfg.parallel, timeout_s=900)
    try:
        return _train(cfg, args, group)
    finally:
        if group is not None:
            import torch.distributed as dist

            dist.destroy_process_group()


def _train(cfg, args, group) -> int:
    import torch.distributed as dist

    from cospec.artifacts import load_or_train_draft
    from cospec.models.integrity import read_json_object
    from cospec.rl.checkpoint import check_resumable, latest_checkpoint
    from cospec.rl.trainer import GRPOTrainer

    device = pick_device(cfg.device)
    lead = group is None or group.is_lead
    rl_dir = Path(cfg.out_dir) / "rl"
    last = latest_checkpoint(rl_dir / "checkpoints")
    if last is not None and not args.resume and not args.fresh:
        raise ConfigError(f"out_dir: {rl_dir} holds checkpoints; pass --resume to continue "
                          f"that run or --fresh to discard it")
    if last is not None and args.resume:  # early, before minutes of loading; the trainer checks
        try:                                # again whichever checkpoint it resumes from
            check_resumable(cfg, read_json_object(last / "config.json", "the run config"))
        except CheckpointError:
            pass  # a damaged newest checkpoint: the trainer falls back to an older one, and says so

    def load_models():
        torch.manual_seed(cfg.grpo.seed)
        start = load_policy(cfg, device, reuse=args.reuse)
        data = TaskData.from_config(cfg.task, start.tokenizer)
        draft = (load_or_train_draft(cfg, start.policy, data=data, reuse=args.reuse)[0]
                 if cfg.rollout.speculative else None)
        return start, draft

    if group is None:
        start, draft = load_models()
    else:  # rank 0 trains/saves the SFT policy and the draft if needed; the others then load them
        if lead:
            start, draft = load_models()
        dist.barrier()
        if not lead:
            start, draft = load_models()
    if last is not None and not args.resume and lead:  # --fresh: discarded once the models load
        shutil.rmtree(rl_dir)
    if group is not None:
        dist.barrier()
    trainer = GRPOTrainer(cfg, start.policy, draft=draft, tokenizer=start.tokenizer, group=group)
    history = trainer.run(resume=args.resume, progress=lead)
    if not lead:
        return 0
    from cospec.metrics.run_log import read_jsonl

    rows = read_jsonl(rl_dir / "metrics.jsonl")
    evals = [(r["step"], r["eval_reward"]) for r in rows if "eval_reward" in r]
    if history:
        share = sum(h["time"]["generate"] for h in history) / sum(h["step_seconds"] for h in history)
        line = f"GRPO: {trainer.step} steps; generation {share:.0%} of step time"
        if evals:
            line += "; held-out reward " + " -> ".join(f"{v:.3f} (step {s})" for s, v in evals)
        print(line + f"; logs in {rl_dir}/metrics.jsonl")
    return 0


def cmd_experiment(args) -> int:
    from cospec.experiments import stale_draft

    cfg = _resolve(args, switched_on=EXPERIMENT_SWITCHES)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in stale_draft.MODES]
    if unknown:
        raise ConfigError(f"--modes: unknown {unknown} (known: {', '.join(stale_draft.MODES)})")
    stale_draft.run_cli(cfg, modes=modes, out_dir=args.out, adaptive=args.adaptive,
                        reuse=args.reuse)
    return 0


def cmd_bench(args) -> int:
    from cospec.bench.command import run_bench

    return run_bench(args, lambda **kw: _resolve(args, **kw))


def _command(sub, name: str, fn, help_: str, *, config: bool = True, reuse: bool = True,
             what: list[str] | None = None) -> argparse.ArgumentParser:
    """A subcommand calling `fn`; ``what``: its first positional's choices (before the overrides);
    ``reuse``: it offers --reuse (it loads artifacts out_dir keeps)."""
    c = sub.add_parser(name, help=help_)
    if what:
        c.add_argument("what", choices=what)
    if config:
        _config_args(c, reuse=reuse)
    c.set_defaults(fn=fn)
    return c


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cospec", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = _command(sub, "config", cmd_config, "print the resolved config", reuse=False)
    c.add_argument("--describe", action="store_true", help="also list every field with its doc")
    pl = _command(sub, "plan", cmd_plan, "memory per rank and collective bytes per step of a run, "
                  "from formulas (model, context, batch and mesh from the config)", reuse=False)
    pl.add_argument("--context", type=int, default=None,
                    help="tokens of every sequence, prompt and response (default "
                    "model.max_seq_len; with ragged rollouts, give the longest)")
    pl.add_argument("--lengths", metavar="FILE",
                    help="tokens of each rollout of a step, integers in a file (e.g. from a pilot "
                    "run), repeated in order to fill the step: the activations' exact peak")
    _command(sub, "sft", cmd_sft, "supervised fine-tuning of the policy on the task suite",
             reuse=False)
    ev = _command(sub, "eval", cmd_eval, "accuracy and response lengths by prompt family and temperature")
    ev.add_argument("--temperatures", help="comma-separated (default: sampling.temperature)")
    ev.add_argument("--prompts-per-type", type=int, default=32, help="held-out prompts per family")
    ev.add_argument("--json", help="also write the results as JSON to this path")
    x = _command(sub, "export", cmd_export, "the run's policy (HF layout) and draft (EAGLE-3 layout)")
    x.add_argument("--out", help="output directory (default out_dir/export)")
    rp = _command(sub, "report", cmd_report, "HTML report (with PNGs) from runs' metrics.jsonl",
                  config=False)
    rp.add_argument("run_dirs", nargs="+", help="directories holding metrics.jsonl (one per run)")
    rp.add_argument("--out", default="report", help="output directory (report.html + PNGs)")
    rp.add_argument("--bench", help="a `cospec bench rollout --json` file for speedup vs batch size")
    _command(sub, "demo", cmd_demo, "the main job on the embedded default config")
    dt = _command(sub, "draft-train", cmd_draft_train, "train a draft on the SFT policy's samples "
                  "(resumes an interrupted one; the answers are kept in out_dir/draft_answers)")
    dt.add_argument("--fresh", action="store_true",
                    help="discard every interrupted training of this draft kind (of any settings) "
                         "instead of resuming one (the kept answers stay)")
    r = _command(sub, "train", cmd_train, "GRPO from the SFT policy (plain or speculative rollouts)")
    r.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    r.add_argument("--fresh", action="store_true", help="discard an earlier run in out_dir/rl")
    _experiment_args(_command(sub, "experiment", cmd_experiment,
                              "experiments whose figures go to docs/results", what=["stale-draft"]))
    from cospec.bench.command import BENCHMARKS, add_bench_arguments

    add_bench_arguments(_command(sub, "bench", cmd_bench, "benchmarks that print side-by-side ratios",
                                 what=list(BENCHMARKS)))
    return p


def _experiment_args(e: argparse.ArgumentParser) -> None:
    e.add_argument("--modes", default="none,frozen,cotrain-ce,cotrain-tv",
                   help="comma-separated: none, frozen, cotrain, cotrain-ce, cotrain-tv, oracle")
    e.add_argument("--adaptive", action="store_true",
                   help="keep rollout.adaptive (default: gamma fixed at rollout.gamma, so tau is "
                        "comparable across steps and modes; adaptive measures the speed users get)")
    e.add_argument("--out", default=None,
                   help="where the JSON and plots go (default out_dir/stale-draft); the SFT policy "
                        "and the offline draft are still made or reused in out_dir")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # Overrides may follow options (`bench rollout --quick out_dir=x`): argparse leaves positionals
    # after an optional unparsed, so collect them here.
    args, extra = parser.parse_known_args(argv)
    unknown = [a for a in extra if "=" not in a or a.startswith("-")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.overrides = list(getattr(args, "overrides", [])) + extra
    try:
        return args.fn(args)
    except ConfigError as e:
        print(f"cospec: config error: {e}", file=sys.stderr)
        return 2
    except CheckpointError as e:  # a bad input file: as a bad config, exit 2
        print(f"cospec: bad file: {e}", file=sys.stderr)
        return 2
    except NonFiniteError as e:  # not the user's input: the run diverged
        print(f"cospec: stopped: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("cospec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
