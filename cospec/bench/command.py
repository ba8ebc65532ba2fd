"""`cospec bench WHAT`: the options and the dispatch to each benchmark module (imported when run)."""

from __future__ import annotations

import argparse

from cospec.config import ConfigError

#: the benchmarks `cospec bench` runs
BENCHMARKS = ("generation", "rollout", "compile", "cp", "pp", "train-step", "rollout-dp")


def add_bench_arguments(b: argparse.ArgumentParser) -> None:
    """The options of `cospec bench` (each says which benchmarks read it)."""
    b.add_argument("--batch-sizes", help="comma-separated (default 1,4,16,64)")
    b.add_argument("--quick", action="store_true",
                   help="generation/rollout/compile: fewer prompts and repeats; cp: short lengths")
    b.add_argument("--no-hf", action="store_true", help="rollout: skip HF assisted generation")
    b.add_argument("--workload", choices=["tasks", "long"], default="tasks",
                   help="rollout: the RL prompt mix, or long copy answers (24-40 tokens)")
    b.add_argument("--drafts", default="eagle3",
                   help="rollout: comma-separated draft kinds to measure (eagle3, block), one row each")
    b.add_argument("--tokens", help="cp: comma-separated packed lengths (default 4096,8192)")
    b.add_argument("--cp", default="1,2,4", help="cp: comma-separated context-parallel sizes")
    b.add_argument("--layouts", default=None,
                   help="train-step: comma-separated single, single@THREADS, cpN, ppN, dpN "
                        "(default single,single@2,cp2,pp2,dp2); rollout-dp: single, "
                        "single@THREADS, dpN (default single,single@2,dp2)")
    b.add_argument("--json", help="also write the rows as JSON to this path")


def run_bench(args, resolve) -> int:
    """Run the benchmark ``args.what``; ``resolve(**kw)``: the run config from the command line
    (``switched_on``: switches the benchmark sets itself)."""
    from cospec.bench import generation

    if args.what == "rollout":
        from cospec.bench import rollout

        drafts = tuple(args.drafts.split(","))
        unknown = set(drafts) - {"eagle3", "block", "lm"}
        if unknown:
            raise ConfigError(f"--drafts: unknown draft kind(s) {sorted(unknown)} (eagle3, block, lm)")
        cfg = resolve(switched_on=("rollout.speculative=true",
                                          *(f"draft.kind={k}" for k in drafts)))
        sizes = args.batch_sizes or ("1,16" if args.quick else "1,4,16,64")
        rollout.run_cli(cfg, batch_sizes=[int(b) for b in sizes.split(",")], quick=args.quick,
                        json_path=args.json, hf=not args.no_hf, workload=args.workload,
                        reuse=args.reuse, drafts=drafts)
        return 0
    if args.what == "compile":
        from cospec.bench import compile as compile_bench

        cfg = resolve(switched_on=("rollout.speculative=true",))
        sizes = args.batch_sizes or ("1,16" if args.quick else "1,4,16,64")
        compile_bench.run_cli(cfg, batch_sizes=[int(b) for b in sizes.split(",")],
                              quick=args.quick, json_path=args.json, reuse=args.reuse)
        return 0
    if args.what == "generation":
        sizes = args.batch_sizes or ("1,16" if args.quick else "1,4,16,64")
        rows = generation.run_cli(resolve(), batch_sizes=[int(b) for b in sizes.split(",")],
                                  repeats=1 if args.quick else 2, json_path=args.json)
        return 0 if rows else 1
    if args.what == "cp":
        from cospec.bench import cp

        return 0 if cp.run_cli(args.quick, args.tokens, args.cp, args.json) else 1
    if args.what == "pp":
        from cospec.bench import pp

        pp.run_cli(resolve(), quick=args.quick, json_path=args.json)
        return 0
    if args.what == "train-step":
        from cospec.bench import train_step

        train_step.run_cli(resolve(), layouts=args.layouts or "single,single@2,cp2,pp2,dp2",
                           quick=args.quick, json_path=args.json)
        return 0
    if args.what == "rollout-dp":
        from cospec.bench import rollout_dp

        rollout_dp.run_cli(resolve(), layouts=args.layouts or "single,single@2,dp2",
                           quick=args.quick, json_path=args.json, reuse=args.reuse)
        return 0
    raise ConfigError(f"bench: unknown benchmark {args.what!r}")
