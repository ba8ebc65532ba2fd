"""Held-out acceptance against training step for several offline drafts, one figure.

    python docs/results/real_model/held_out_by_answers.py OUT.png NAME=PATH@STEPS [...]

PATH is a finished draft directory (its train_metrics.json) or an interrupted training's state
file (`<draft dir>.partial/state*.pt`, whose held-out history is read as far as it got); STEPS
is the run's `draft.train_steps`. Prints the table of the evaluations and draws, per TTT step,
acceptance against the share of each run's schedule (step / STEPS): runs of different lengths
decay their learning rate over their own steps, so equal shares compare like with like.
"""
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def held_out(path: Path) -> list[dict]:
    if path.is_dir():
        return json.loads((path / "train_metrics.json").read_text())["held_out"]
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)["held_out"]


def main(out: str, runs: list[str]) -> None:
    curves, totals = {}, {}
    for run in runs:
        name, spec = run.split("=", 1)
        path, steps = spec.rsplit("@", 1)
        curves[name], totals[name] = held_out(Path(path)), int(steps)
    for name, hist in curves.items():
        print(name)
        for h in hist[1:]:
            print(f"  {h['step']:5d}  " + " / ".join(f"{a:.3f}" for a in h["acceptance"]))
    ttt_steps = len(next(iter(curves.values()))[0]["acceptance"])
    fig, axes = plt.subplots(1, ttt_steps, figsize=(3.2 * ttt_steps, 3.2), sharey=True)
    for k, ax in enumerate(axes):
        for name, hist in curves.items():
            ax.plot([h["step"] / totals[name] for h in hist[1:]], [h["acceptance"][k] for h in hist[1:]],
                    marker="o", markersize=3, label=name)
        ax.set(title=f"TTT step {k + 1}", xlabel="share of the run's steps", xlim=(0, 1.02))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out acceptance (1 - TV)")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=len(curves),
               frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
