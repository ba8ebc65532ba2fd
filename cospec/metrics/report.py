"""`cospec report RUN_DIR...`: one self-contained HTML page (and its PNGs) from runs' JSONL logs.

This module makes the figures and the summary data; `cospec.metrics.report_page` the HTML.

Each RUN_DIR holds a ``metrics.jsonl`` written by the GRPO trainer (`cospec train`, or one mode of
`cospec experiment stale-draft`); its name labels the run. The page opens from disk in a browser
without a server: figures are PNGs embedded as data URIs (and also written beside the page), the
tables are plain HTML. A rollout benchmark JSON (`cospec bench rollout --json`) adds the speedup
vs batch size figure.

Figures: reward vs step; tau vs step beside the policy's KL from its start; acceptance per draft
position; acceptance per task family; overshoot (share of drafted tokens with q > p) per draft
position; step-time split; rollout speedup vs batch size.
"""

from __future__ import annotations

import io
import json
from functools import partial
from pathlib import Path

from cospec.atomic_file import write_text_atomically
from cospec.metrics.report_page import page
from cospec.metrics.run_log import finite_or_none, read_jsonl

COLORS = ["tab:gray", "tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]


def load_runs(run_dirs: list[str | Path]) -> dict[str, list[dict]]:
    """{run name: training-step rows} (evaluation-only rows are kept out)."""
    runs = {}
    for d in run_dirs:
        d = Path(d)
        path = d / "metrics.jsonl" if (d / "metrics.jsonl").exists() else d / "rl" / "metrics.jsonl"
        rows = [r for r in read_jsonl(path) if "reward" in r]
        if not rows:
            raise ValueError(f"{d}: no training steps in {path}")
        runs[d.name if d.name != "rl" else d.parent.name] = rows
    return runs


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _figure(draw, figsize=(6, 3.6)) -> bytes:
    """The PNG of a figure that ``draw(axes)`` fills (two side by side when ``figsize`` is wide)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 if figsize[0] > 8 else 1, figsize=figsize)
    draw(axes)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")  # legends sit outside the axes
    plt.close(fig)
    return buf.getvalue()


def _legend(ax) -> None:
    """The legend beside the axes, on the right: it covers no data, however the lines run."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)


def make_figures(runs: dict[str, list[dict]], bench: dict | None = None) -> dict[str, bytes]:
    """{file name: PNG} of every figure the runs (and a rollout benchmark JSON) have data for; the
    acceptance and overshoot figures need speculative runs, the speedup figure the benchmark."""
    colors = {name: COLORS[i % len(COLORS)] for i, name in enumerate(runs)}
    spec = {n: h for n, h in runs.items() if "accept_length" in h[0]}
    figs = {"reward_vs_step.png": _figure(partial(_draw_reward, runs, colors)),
            "tau_and_kl_vs_step.png": _figure(partial(_draw_tau_and_kl, runs, spec, colors),
                                              figsize=(11, 3.6))}
    if spec:
        figs.update(_acceptance_figures(spec, colors))
    figs["step_time_split.png"] = _figure(partial(_draw_step_time_split, runs))
    if bench and bench.get("results"):
        figs["rollout_speedup_vs_batch.png"] = _figure(partial(_draw_rollout_speedup, bench))
    return figs


def _draw_reward(runs: dict[str, list[dict]], colors: dict[str, str], ax) -> None:
    for n, h in runs.items():
        ax.plot([r["step"] for r in h], [r["reward"] for r in h], label=n, color=colors[n], alpha=0.8)
    ax.set(xlabel="RL step", ylabel="mean reward", title="Reward (speculation is lossless)")
    _legend(ax)


def _draw_tau_and_kl(runs: dict[str, list[dict]], spec: dict[str, list[dict]],
                     colors: dict[str, str], axes) -> None:
    for n, h in runs.items():
        if n in spec:
            axes[0].plot([r["step"] for r in h], [r["accept_length"] for r in h], label=n, color=colors[n])
        axes[1].plot([r["step"] for r in h], [r["kl_from_init"] for r in h], label=n, color=colors[n])
    axes[0].set(xlabel="RL step", ylabel="tau", title="Accept length (tokens per policy forward)")
    axes[1].set(xlabel="RL step", ylabel="KL per token", title="Policy KL from its start")
    _legend(axes[1])  # one legend for both panels (same runs, same colours), right of the pair


def _acceptance_figures(spec: dict[str, list[dict]], colors: dict[str, str]) -> dict[str, bytes]:
    """The speculative runs' acceptance per draft position and per task family, and overshoot per
    draft position, each a group of bars per run (means over the run's steps)."""
    positions = len(next(iter(spec.values()))[0]["acceptance_by_position"])
    position_labels = [str(j + 1) for j in range(positions)]
    families = sorted({f for h in spec.values() for r in h for f in r.get("acceptance_by_family", {})})
    by_position = {n: [_mean(r["acceptance_by_position"][j] for r in h) for j in range(positions)]
                   for n, h in spec.items()}
    by_family = {n: [_mean(r.get("acceptance_by_family", {}).get(f) for r in h) for f in families]
                 for n, h in spec.items()}
    overshoot = {n: [_mean(_share_q_above_p(r, j) for r in h) for j in range(positions)]
                 for n, h in spec.items()}
    return {
        "acceptance_by_position.png": _figure(partial(
            _draw_grouped_bars, by_position, position_labels, colors, "Acceptance per draft position",
            "acceptance", "draft position")),
        "acceptance_by_family.png": _figure(partial(
            _draw_grouped_bars, by_family, families, colors, "Acceptance per task family",
            "acceptance", "task family")),
        "overshoot_by_position.png": _figure(partial(
            _draw_grouped_bars, overshoot, position_labels, colors,
            "Overshoot: drafted tokens with q(x) > p(x)", "share of drafted tokens", "draft position")),
    }


def _share_q_above_p(row: dict, j: int) -> float | None:
    """A step's share of drafted tokens at draft position j+1 with q(x) > p(x); None where the step
    has no overshoot figure there (no drafted token at that position was measured)."""
    by_position = row.get("overshoot_by_position")
    return by_position[j].get("frac_q_above_p") if by_position and by_position[j] else None


def _draw_grouped_bars(values_by_run: dict[str, list[float | None]], labels: list[str],
                       colors: dict[str, str], title: str, ylabel: str, xlabel: str, ax) -> None:
    width = 0.8 / max(len(values_by_run), 1)
    for i, (n, vals) in enumerate(values_by_run.items()):
        xs = [j + i * width for j in range(len(labels))]
        ax.bar(xs, [v or 0.0 for v in vals], width=width, label=n, color=colors[n])
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))], labels)
    ax.set(title=title, ylabel=ylabel, xlabel=xlabel)
    _legend(ax)


def _draw_step_time_split(runs: dict[str, list[dict]], ax) -> None:
    parts = ["generate", "train_policy", "train_draft", "other"]
    bottom = [0.0] * len(runs)
    for part in parts:
        vals = [_mean(r["time"].get(part, 0.0) for r in h[1:] or h) for h in runs.values()]
        ax.bar(list(runs), vals, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set(ylabel="seconds per RL step", title="Step time split")
    _legend(ax)


def _draw_rollout_speedup(bench: dict, ax) -> None:
    """Paired speedups where the benchmark has them (plain decoding timed on each run's own
    response lengths: docs/design.md, "Paired speedups"), else the unpaired ones."""
    rows = bench["results"]
    bs = [r["batch_size"] for r in rows]
    paired = all("paired_speedup" in r for r in rows)
    spec, adaptive, how = (("paired_speedup", "adaptive_paired_speedup", ", paired") if paired
                           else ("speedup", "adaptive_speedup", ""))
    gamma = bench.get("meta", {}).get("gamma", "")
    ax.plot(bs, [r[spec] for r in rows], "o-", label=f"gamma {gamma}{how}")
    ax.plot(bs, [r[adaptive] for r in rows], "s-", label=f"adaptive{how}")
    ax.plot(bs, [r["ideal_speedup"] for r in rows], "x--", label="ideal (cost model)")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="batch size", ylabel="tokens/s vs plain", title="Rollout speedup vs batch size")
    _legend(ax)


def summarise(runs: dict[str, list[dict]]) -> dict:
    """{run: reward, KL, tau and draft acceptance over the first and last fifth of the run, mean
    step and generation seconds, draft-training share, and speedups against the run named "none"
    when there is one}."""
    mean = _mean
    k = max(1, len(next(iter(runs.values()))) // 5)  # first / last fifth of the run
    # Times leave out step 1, which pays each trainer's one-time warm-up.
    timed = {mode: hist[1:] or hist for mode, hist in runs.items()}
    base_step = mean([m["step_seconds"] for m in timed["none"]]) if "none" in runs else None
    base_tok_s = _tokens_per_second(timed["none"]) if "none" in runs else None
    out = {}
    for mode, hist in runs.items():
        row = {"reward_first": mean([m["reward"] for m in hist[:k]]),
               "reward_last": mean([m["reward"] for m in hist[-k:]]),
               "kl_last": mean([m["kl_from_init"] for m in hist[-k:]]),
               "step_seconds": mean([m["step_seconds"] for m in timed[mode]]),
               "generate_seconds": mean([m["time"]["generate"] for m in timed[mode]]),
               "train_draft_share": mean([m["time_share"].get("train_draft", 0.0) for m in timed[mode]]),
               # Per generated token: speculative and plain runs sample different answers (other
               # random numbers), so seconds per step also compare their lengths.
               "rollout_tok_s": _tokens_per_second(timed[mode])}
        if "accept_length" in hist[0]:
            row["tau_first"] = mean([m["accept_length"] for m in hist[:k]])
            row["tau_last"] = mean([m["accept_length"] for m in hist[-k:]])
            row["tau_retained"] = row["tau_last"] / row["tau_first"]
        if "acceptance" in hist[0]:  # drafts accepted / judged; NaN in memory, null in JSON:
            # a step that judged no draft, left out of the means
            acc = [finite_or_none(m["acceptance"]) for m in hist]
            row["acceptance_first"], row["acceptance_last"] = mean(acc[:k]), mean(acc[-k:])
            if row["acceptance_first"] not in (None, 0.0) and row["acceptance_last"] is not None:
                row["acceptance_retained"] = row["acceptance_last"] / row["acceptance_first"]
        if base_step:
            row["e2e_speedup_vs_none"] = base_step / row["step_seconds"]
            if base_tok_s and row["rollout_tok_s"]:
                row["rollout_tok_s_speedup_vs_none"] = row["rollout_tok_s"] / base_tok_s
            row["rollout_speedup_vs_none"] = (mean([m["time"]["generate"] for m in timed["none"]])
                                              / row["generate_seconds"])
        out[mode] = row
    return out


def _tokens_per_second(hist: list[dict]) -> float | None:
    """Generated tokens over generation seconds across the given steps (None without the figures)."""
    steps = [m for m in hist if m.get("rollout_tok_s") and m["time"].get("generate")]
    if not steps:
        return None
    seconds = sum(m["time"]["generate"] for m in steps)
    return sum(m["rollout_tok_s"] * m["time"]["generate"] for m in steps) / seconds


def write_report(run_dirs: list[str | Path], out_dir: str | Path, *, bench_json: str | Path | None = None,
                 config: dict | None = None, commands: list[str] | None = None) -> Path:
    """Write out_dir/report.html and the PNGs beside it; returns the HTML path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs = load_runs(run_dirs)
    bench = json.loads(Path(bench_json).read_text()) if bench_json and Path(bench_json).exists() else None
    figs = make_figures(runs, bench)
    for name, png in figs.items():
        (out / name).write_bytes(png)
    path = out / "report.html"
    write_text_atomically(path, page(runs, summarise(runs), figs, config=config, commands=commands))
    return path
