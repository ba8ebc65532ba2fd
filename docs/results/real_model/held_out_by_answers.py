"""Held-out acceptance against training step for several offline drafts, one figure.

    python docs/results/real_model/held_out_by_answers.py OUT.png NAME=PATH@STEPS [...]

PATH is a finished draft directory (its train_metrics.json), an interrupted training's state
file (`<draft dir>.partial/state*.pt`, whose held-out history is read as far as it got) or a
saved draft-train output (`.log`: its "held-out (N answers) at step S: acceptance ..." lines,
two decimals, for runs whose directories are gone); STEPS
is the run's `draft.train_steps`. Prints the table of the evaluations and draws, per TTT step,
acceptance against the share of each run's schedule (step / STEPS): runs of different lengths
decay their learning rate over their own steps, so equal shares compare like with like.
"""
import json
import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def held_out(path: Path) -> list[dict]:
    if path.suffix == ".log":
        found = re.findall(r"held-out \(\d+ answers\) at step (\d+): acceptance ([\d., ]+)",
                           path.read_text())
        return [{"step": int(step), "acceptance": [float(a) for a in acc.split(",")]}
                for step, acc in found]
    if path.is_dir():
        return json.loads((path / "train_metrics.json").read_text())["held_out"]
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)["held_out"]


def main(out: str, runs: list[str]) -> None:
    curves, totals = {}, {}
    for run in runs:
        name, spec = run.split("=", 1)
        path, steps = spec.rsplit("@", 1)
        # step 0 (the untrained draft, ~0 everywhere) left out: it would squash the scale
        curves[name] = [h for h in held_out(Path(path)) if h["step"] > 0]
        totals[name] = int(steps)
    for name, hist in curves.items():
        print(name)
        for h in hist:
            print(f"  {h['step']:5d}  " + " / ".join(f"{a:.3f}" for a in h["acceptance"]))
    ttt_steps = len(next(iter(curves.values()))[0]["acceptance"])
    fig, axes = plt.subplots(1, ttt_steps, figsize=(3.2 * ttt_steps, 3.2), sharey=True)
    for k, ax in enumerate(axes):
        for name, hist in curves.items():
            ax.plot([h["step"] / totals[name] for h in hist], [h["acceptance"][k] for h in hist],
                    marker="o", markersize=3, label=name)
        ax.set(title=f"TTT step {k + 1}", xlabel="share of the run's steps", xlim=(0, 1.02))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out acceptance (1 - TV)")
    # at most three names a legend row, below the panels: a single row of five ran off the figure
    rows = -(-len(curves) // 3)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=min(len(curves), 3),
               frameon=False)
    fig.tight_layout(rect=(0, 0.07 * rows + 0.03, 1, 1))
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
