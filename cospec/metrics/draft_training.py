"""The figure of an offline draft training: its loss, and its acceptance on held-out answers.

`cospec draft-train` saves it as training_curve.png beside the draft: whether the draft was still
learning when the run stopped (the held-out acceptance still rising) or had begun to learn its
training answers by heart (the loss falling while the held-out acceptance stays flat) is read off
it at a glance, and that decides whether more steps or more answers come next.
"""

from __future__ import annotations

from pathlib import Path

from cospec.atomic_file import save_figure_atomically


def _series_label(key: str, series: int, j: int) -> str:
    if key != "acceptance":
        return "cross-entropy"
    return "next token" if series == 1 else f"TTT step {j + 1}"  # a draft LM has one series


def plot_draft_training(metrics: dict, path: str | Path) -> Path:
    """Two panels: the training loss by step (and its 20-step mean); the held-out acceptance
    (1 - TV) of each TTT step (a draft LM: of its next token), or the held-out cross-entropy where
    only that was kept, at each evaluation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    losses = metrics.get("loss_history", [])
    held = metrics.get("held_out", [])
    fig, (ax_loss, ax_held) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    steps = range(1, len(losses) + 1)
    ax_loss.plot(steps, losses, color="0.75", lw=0.8, label="per step")
    if len(losses) >= 20:
        mean = [sum(losses[i - 20:i]) / 20 for i in range(20, len(losses) + 1)]
        ax_loss.plot(range(20, len(losses) + 1), mean, color="C0", label="mean of 20 steps")
    ax_loss.set(xlabel="optimizer step", ylabel="training loss", title="Training loss")
    ax_loss.legend(loc="upper right", frameon=False)
    key = "acceptance" if held and "acceptance" in held[0] else "ce"
    if held:
        x = [h["step"] for h in held]
        for j in range(len(held[0][key])):
            ax_held.plot(x, [h[key][j] for h in held], marker="o", ms=3,
                         label=_series_label(key, len(held[0][key]), j))
        ax_held.legend(loc="lower right" if key == "acceptance" else "upper right", frameon=False)
        if any("expected_accept_length" in h for h in held):
            # tau on its own axis; a run resumed from before it was kept has gaps
            ax_tau = ax_held.twinx()
            tau = [h.get("expected_accept_length", [float("nan")])[0] for h in held]
            ax_tau.plot(x, tau, color="k", ls="--", marker="s", ms=3,
                        label="expected tau on these answers (right)")
            ax_tau.set(ylabel="expected tau (tokens per verify step)", ylim=(1, None))
            ax_tau.legend(loc="lower left", frameon=False)
    else:
        ax_held.text(0.5, 0.5, "no held-out answers (draft.num_eval_prompts=0)",
                     ha="center", va="center", transform=ax_held.transAxes)
    label = "acceptance (1 - TV), teacher-forced" if key == "acceptance" else "cross-entropy"
    ax_held.set(xlabel="optimizer step", ylabel=label, title="On held-out answers")
    if key == "acceptance":
        ax_held.set_ylim(0, 1)
    save_figure_atomically(fig, path, dpi=100)
    plt.close(fig)
    return Path(path)
