"""`cospec experiment stale-draft`: does a draft trained once go stale as GRPO moves the policy, and
does co-training keep it fresh?

The same seeded RL run (same SFT policy, same prompt stream, same rollout seeds) under:
    none           plain rollouts (the reference for reward and for step time)
    frozen         speculative rollouts with the offline-trained draft, never updated
    cotrain        the same draft co-trained every step with the run's own loss mix
                   (draft.tv_weight, as `cospec train` co-trains; a recipe may set it)
    cotrain-ce     ... with soft cross-entropy alone (tv_weight 0)
    cotrain-tv     ... with total variation (= 1 - acceptance)
    oracle         (--oracle) the draft retrained offline on the current policy every
                   draft.oracle_every steps: the upper bound co-training should approach
Speculation is lossless, so reward curves must agree up to sampling noise; tau per step shows the
draft's freshness; the policy's KL from its start shows how far it moved. Gamma is fixed
(rollout.gamma, adaptive off) so tau is comparable across steps and modes; ``--adaptive`` keeps
rollout.adaptive, for the rollout speed users get. Paired step times give
the end-to-end speedup of each mode over `none` measured, not estimated.

The modes' answers differ (each speculative mode draws its own random numbers, and a co-trained
draft differs from run to run), and so do their lengths, which decide much of a step's rollout
time. So after each step of a speculative mode a plain engine answers that step's prompts again
with responses of exactly the speculative answers' lengths (``paired_plain_generate``, seconds;
docs/design.md, "Paired speedups"): the speculative rollouts' time compares with it on the same
work. It costs one plain generation per step and speculative mode, outside the step's timed
parts. The plain engine is `none`'s where that mode runs; else one over the first speculative
mode's rollout policy (a forward's time does not depend on the weights' values), so
``--modes frozen,cotrain`` is paired too without paying for a plain GRPO run.

Writes ``<out>/stale_draft.json`` ({"modes": {mode: [per-step metrics]}, "summary": {...},
"config": ..., "start_draft": {"path", "made_by"}}: the draft the modes started from and the
fields it was made with, which ``--reuse`` may have kept although the config's draft section says
otherwise), PNG plots beside it, and each speculative mode's draft as the run left it in
``<out>/<mode>/draft`` (frozen: the offline draft; co-trained: after its last update), so what
co-training did can be measured on fixed text afterwards. Each mode is also checkpointed as
`cospec train` checkpoints (``<out>/<mode>/checkpoints/step_NNNNNN``: the policy, the draft and the
trainer state; every grpo.checkpoint_every steps and at the last), so the policy a mode moved to
can be measured too: how stale a frozen draft is against it is a question about both. (SmolLM2
in fp32: ~1.8 GB a checkpoint, AdamW's moments included.) A rerun into the same ``<out>`` first
removes its modes' earlier checkpoints.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import torch

from cospec.atomic_file import save_figure_atomically, write_json_atomically
from cospec.config import RunConfig, apply
from cospec.metrics.report import summarise
from cospec.metrics.run_log import finite_or_none

MODES = {
    "none": {"rollout": {"speculative": False}, "draft": {"mode": "frozen"}},  # (no draft is used)
    "frozen": {"rollout": {"speculative": True}, "draft": {"mode": "frozen"}},
    "cotrain": {"rollout": {"speculative": True}, "draft": {"mode": "cotrain"}},
    "cotrain-ce": {"rollout": {"speculative": True}, "draft": {"mode": "cotrain", "tv_weight": 0.0}},
    "cotrain-tv": {"rollout": {"speculative": True}, "draft": {"mode": "cotrain", "tv_weight": 1.0}},
    "oracle": {"rollout": {"speculative": True}, "draft": {"mode": "oracle"}},
}
COLORS = {"none": "tab:gray", "frozen": "tab:blue", "cotrain": "tab:purple",
          "cotrain-ce": "tab:orange",
          "cotrain-tv": "tab:green", "oracle": "tab:red"}  # one color per mode in every plot


def make_trainer(cfg: RunConfig, mode: str, policy, draft, out: Path, tokenizer=None, *,
                 adaptive: bool = False):
    from cospec.rl.trainer import GRPOTrainer

    mcfg = apply(cfg, {**MODES[mode], "out_dir": str(out / mode)})
    if not adaptive:
        mcfg = apply(mcfg, {"rollout": {"adaptive": False}})
    return GRPOTrainer(mcfg, copy.deepcopy(policy),
                       draft=copy.deepcopy(draft) if mcfg.rollout.speculative else None,
                       tokenizer=tokenizer, out_dir=str(out / mode), tensorboard=False)


def run_lockstep(trainers: dict, steps: int, out: Path) -> dict[str, list[dict]]:
    """Step t of every mode, then step t + 1 of every mode, ...: slow drift of a shared machine
    then hits all modes alike, which makes their step times comparable (paired). Each mode is
    checkpointed every grpo.checkpoint_every steps and at the last one, once every mode has run
    that step: outside every step's timed part (the disk's writeback may still overlap the next)."""
    from cospec.metrics.progress import progress_bar
    from cospec.metrics.run_log import RunLog
    from cospec.rl.step_metrics import console_line

    runs: dict[str, list[dict]] = {m: [] for m in trainers}
    logs = {m: RunLog(out / m / "metrics.jsonl") for m in trainers}
    plain_engine = paired_plain_engine(trainers)
    with progress_bar(True, steps * len(trainers), "stale-draft") as advance:
        for step in range(1, steps + 1):
            for mode, trainer in trainers.items():
                metrics = trainer.run_step()
                if trainer.cfg.rollout.speculative:
                    metrics["paired_plain_generate"] = paired_plain_seconds(plain_engine, trainer)
                logs[mode].log(trainer.step, metrics)
                runs[mode].append({"step": trainer.step, **metrics})
                advance(f"{mode}: {console_line(metrics)}")
            for trainer in trainers.values():  # as `cospec train` does: policy, draft, trainer state
                if step % trainer.g.checkpoint_every == 0 or step == steps:
                    trainer.save()
    return runs


def paired_plain_engine(trainers: dict):
    """The plain engine that times the speculative modes' answers: `none`'s, else a plain one
    over the first speculative mode's rollout policy (None where no mode speculates). A new
    engine's first timing includes its warm-up, as `none`'s first step does
    (grpo_per_token.py skips step 1)."""
    if "none" in trainers:
        return trainers["none"].engine
    spec = next((t for t in trainers.values() if t.cfg.rollout.speculative), None)
    return None if spec is None else spec.make_engine(plain=True)


def paired_plain_seconds(plain_engine, speculative) -> float:
    """Seconds ``plain_engine`` takes to answer the prompts of ``speculative``'s last step
    with responses of exactly its answers' lengths (stop ids ignored, each row cut there): what
    plain decoding costs for the same work (docs/design.md, "Paired speedups")."""
    answers = speculative.last_batch.completions
    result = plain_engine.generate([c.prompt for c in answers], speculative.rollout_sampling(),
                                   seeds=list(range(len(answers))),
                                   response_lengths=[len(c.tokens) for c in answers])
    return result.seconds


def plot(runs: dict[str, list[dict]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, hist in runs.items():
        steps = [m["step"] if "step" in m else i + 1 for i, m in enumerate(hist)]
        if "accept_length" in hist[0]:
            ax1.plot(steps, [m["accept_length"] for m in hist], label=mode, color=COLORS[mode])
        ax2.plot(steps, [m["kl_from_init"] for m in hist], label=mode, color=COLORS[mode])
    ax1.set(xlabel="RL step", ylabel="tau (tokens per policy forward)", title="Draft freshness")
    ax2.set(xlabel="RL step", ylabel="KL(policy || initial policy) per token", title="Policy movement")
    ax1.legend()
    if any(finite_or_none(m["kl_from_init"]) is not None for hist in runs.values() for m in hist):
        ax2.legend()
    else:  # an empty frame would read as "no movement"
        ax2.text(0.5, 0.5, "not measured\n(grpo.log_kl=false)", ha="center", va="center",
                 transform=ax2.transAxes)
        ax2.set(xticks=[], yticks=[])
    fig.tight_layout()
    paths.append(out / "tau_vs_step.png")
    save_figure_atomically(fig, paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, hist in runs.items():
        ax.plot(range(1, len(hist) + 1), [m["reward"] for m in hist], label=mode, alpha=0.8,
                color=COLORS[mode])
    ax.set(xlabel="RL step", ylabel="mean reward", title="Reward (speculation is lossless)")
    ax.legend()
    fig.tight_layout()
    paths.append(out / "reward_vs_step.png")
    save_figure_atomically(fig, paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    parts = ["generate", "train_policy", "train_draft", "other"]
    bottom = [0.0] * len(runs)
    for part in parts:
        vals = [sum(m["time"].get(part, 0.0) for m in h) / len(h) for h in runs.values()]
        ax.bar(list(runs), vals, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set(ylabel="seconds per RL step", title="Step time split")
    ax.legend()
    fig.tight_layout()
    paths.append(out / "step_time_split.png")
    save_figure_atomically(fig, paths[-1], dpi=110)
    plt.close(fig)
    return paths


def run_cli(cfg: RunConfig, *, modes: list[str], out_dir: str | None = None, policy=None,
            draft=None, tokenizer=None, show: bool = True, adaptive: bool = False,
            reuse: bool = False) -> dict:
    """Run the modes (making or reusing the starting policy and the offline draft unless given;
    a given policy comes with its tokenizer, or the run's is loaded). ``reuse``: keep out_dir's
    artifacts even when made with other settings (`cospec.artifacts`)."""
    from cospec.data.prompts import TaskData
    from cospec.artifacts import load_or_train_draft, read_stamp
    from cospec.draft.offline import draft_dir
    from cospec.models.draft_checkpoint import save_draft
    from cospec.models.loading import load_tokenizer
    from cospec.artifacts import load_policy, pick_device

    out = Path(out_dir or f"{cfg.out_dir}/stale-draft")
    out.mkdir(parents=True, exist_ok=True)
    for mode in modes:  # a rerun replaces its outputs: no earlier run's checkpoint may pass for its
        old = out / mode / "checkpoints"
        if old.exists():
            print(f"removing {old}, an earlier stale-draft run's checkpoints")
            shutil.rmtree(old)
    if policy is None:
        start = load_policy(cfg, pick_device(cfg.device), reuse=reuse)
        policy, tokenizer = start.policy, start.tokenizer
    elif tokenizer is None:
        tokenizer = load_tokenizer(cfg.model)
    start_draft = None  # a draft passed in says nothing of where it came from
    if draft is None:
        kind = "eagle3" if cfg.draft.kind == "lm" else cfg.draft.kind  # eagle3 or block
        draft_cfg = apply(cfg, {"draft": {"kind": kind}})
        draft, _ = load_or_train_draft(draft_cfg, policy, reuse=reuse,
                                       data=TaskData.from_config(cfg.task, tokenizer))
        path = draft_dir(draft_cfg)
        start_draft = {"path": str(path), "made_by": read_stamp(path)}
    trainers = {}
    for mode in modes:
        torch.manual_seed(cfg.grpo.seed)
        trainers[mode] = make_trainer(cfg, mode, policy, draft, out, tokenizer, adaptive=adaptive)
    runs = run_lockstep(trainers, cfg.grpo.steps, out)
    for mode, trainer in trainers.items():  # what the run made of the draft, to measure offline
        if trainer.draft is not None:
            save_draft(trainer.draft, out / mode / "draft")
    result = {"modes": runs, "summary": summarise(runs), "config": cfg.to_dict(),
              "start_draft": start_draft}
    write_json_atomically(out / "stale_draft.json", finite_or_none(result), indent=1)
    plot(runs, out)
    if show:
        print(format_summary(result["summary"]))
    print(f"wrote {out / 'stale_draft.json'} and plots in {out}")
    return result


def format_summary(summary: dict) -> str:
    head = (f"{'mode':>11} {'reward first':>12} {'last':>6} {'KL last':>8} {'tau first':>9} {'last':>6} "
            f"{'kept':>6} {'acc first':>9} {'last':>5} "
            f"{'step s':>7} {'rollout x':>9} {'tok/s x':>7} {'e2e x':>6} {'draft share':>11}")
    lines = [head, "-" * len(head)]
    for mode, r in summary.items():
        f = lambda k, fmt: format(r[k], fmt) if r.get(k) is not None else "-"  # noqa: E731
        lines.append(f"{mode:>11} {r['reward_first']:>12.3f} {r['reward_last']:>6.3f} {f('kl_last', '.3f'):>8} "
                     f"{f('tau_first', '.2f'):>9} {f('tau_last', '.2f'):>6} {f('tau_retained', '.0%'):>6} "
                     f"{f('acceptance_first', '.2f'):>9} {f('acceptance_last', '.2f'):>5} "
                     f"{r['step_seconds']:>7.2f} {f('rollout_speedup_vs_none', '.2f'):>9} "
                     f"{f('rollout_tok_s_speedup_vs_none', '.2f'):>7} "
                     f"{f('e2e_speedup_vs_none', '.2f'):>6} {r['train_draft_share']:>11.1%}")
    return "\n".join(lines)
