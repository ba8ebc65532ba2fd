"""`cospec demo`, the main job: SFT (or the checkpoint at model.path), the initial draft, then the
same seeded GRPO run with plain rollouts, a frozen draft and a co-trained draft (the stale-draft
experiment's lockstep runner, `cospec.experiments.stale_draft`), the HTML report, a summary table
on the console and the same table as data in ``out_dir/summary.json``.
"""

from __future__ import annotations

from pathlib import Path

from cospec.artifacts import load_or_train_draft, load_policy, pick_device
from cospec.atomic_file import write_json_atomically
from cospec.config import RunConfig, apply
from cospec.data.prompts import TaskData
from cospec.evaluate import print_accuracy
from cospec.experiments import stale_draft
from cospec.metrics.report import write_report
from cospec.metrics.run_log import finite_or_none

DEMO_MODES = ("none", "frozen", "cotrain-ce")

#: summary.json's names for the stale-draft summary's fields
DEMO_SUMMARY_FIELDS = {"reward_start": "reward_first", "reward_end": "reward_last",
                       "tau_start": "tau_first", "tau_end": "tau_last",
                       "rollout_speedup": "rollout_speedup_vs_none",
                       "end_to_end_speedup": "e2e_speedup_vs_none", "cotrain_share": "train_draft_share"}


def run_demo(cfg: RunConfig, *, reuse: bool = False, command: str = "cospec demo") -> dict:
    """Run the demo on `cfg` (its grpo.steps is the budget, like every command's); returns the
    stale-draft summary by mode. ``reuse``: keep out_dir's SFT policy and draft even when they were
    made with other settings (`cospec.artifacts`)."""
    start = load_policy(cfg, pick_device(cfg.device), reuse=reuse)
    if start.sft_metrics is not None:
        print_accuracy(start.sft_metrics)
    draft, _ = load_or_train_draft(apply(cfg, {"draft": {"kind": "eagle3"}}), start.policy,
                                   data=TaskData.from_config(cfg.task, start.tokenizer), reuse=reuse)
    result = stale_draft.run_cli(cfg, modes=list(DEMO_MODES), policy=start.policy, draft=draft,
                                 tokenizer=start.tokenizer, show=False)
    out = Path(cfg.out_dir)
    bench = out / "rollout.json"
    report = write_report([out / "stale-draft" / m for m in DEMO_MODES], out / "report",
                          bench_json=bench if bench.exists() else None, config=cfg.to_dict(),
                          commands=[command])
    print(demo_summary(result["summary"]))
    write_json_atomically(out / "summary.json", finite_or_none(demo_summary_data(result["summary"])),
                          indent=1)
    print(f"report: {report}; summary: {out / 'summary.json'}")
    return result["summary"]


def demo_summary_data(summary: dict) -> dict:
    """{mode: {reward_start, reward_end, tau_start, tau_end, rollout_speedup, end_to_end_speedup,
    cotrain_share}}: the demo's table as data (None where a mode has no such figure: plain
    rollouts have no tau)."""
    return {mode: {name: r.get(key) for name, key in DEMO_SUMMARY_FIELDS.items()}
            for mode, r in summary.items()}


def demo_summary(summary: dict) -> str:
    """The table the demo ends with (one row per mode)."""
    head = f"{'mode':>11} {'reward start':>12} {'end':>6} {'tau start':>9} {'end':>6} " \
           f"{'rollout x':>9} {'end-to-end x':>12} {'co-training share':>17}"
    lines = [head, "-" * len(head)]
    for mode, r in summary.items():
        f = lambda k, fmt: format(r[k], fmt) if r.get(k) is not None else "-"  # noqa: E731
        lines.append(f"{mode:>11} {r['reward_first']:>12.3f} {r['reward_last']:>6.3f} "
                     f"{f('tau_first', '.2f'):>9} {f('tau_last', '.2f'):>6} "
                     f"{f('rollout_speedup_vs_none', '.2f'):>9} {f('e2e_speedup_vs_none', '.2f'):>12} "
                     f"{r['train_draft_share']:>17.1%}")
    return "\n".join(lines)
