"""The metrics of one GRPO step: what `cospec.metrics.run_log` writes per step and the console shows.

``batch`` is the trainer's `RolloutBatch` (examples, completions, rewards, generation time and
tokens, the engine's `SpeculationStats` or None).
"""

from __future__ import annotations


def step_metrics(batch, train: dict, seconds: dict, replicas: dict | None = None) -> dict:
    """One GRPO step's log row: reward (overall, by family), accuracy, response lengths, the
    policy step's metrics (``train``), the time split (``seconds``), rollout tokens/s, and the
    speculation metrics when the rollouts were speculative.

    ``replicas`` (data parallel): the step's rollouts over every replica, as ``examples``,
    ``rewards``, ``lengths`` and ``num_tokens``; they replace this replica's for the reward,
    length and throughput figures (tokens over this replica's generation time: the replicas
    generate at once). The speculation figures stay this replica's."""
    rewards = batch.rewards.tolist() if replicas is None else replicas["rewards"]
    examples = batch.examples if replicas is None else replicas["examples"]
    by_family: dict[str, list[float]] = {}
    for ex, r in zip(examples, rewards):
        by_family.setdefault(ex.family, []).append(r)
    lengths = sorted(len(c.tokens) for c in batch.completions) if replicas is None else sorted(
        replicas["lengths"])
    num_tokens = batch.num_tokens if replicas is None else replicas["num_tokens"]
    total = sum(seconds.values())
    m = {"reward": sum(rewards) / len(rewards),
         "reward_by_family": {k: sum(v) / len(v) for k, v in sorted(by_family.items())},
         "accuracy": sum(r == 1.0 for r in rewards) / len(rewards),
         "response_length": {"mean": sum(lengths) / len(lengths),
                             "p90": lengths[int(0.9 * (len(lengths) - 1))], "max": lengths[-1]},
         **train,
         "time": {k: v for k, v in seconds.items()},
         "time_share": {k: v / total for k, v in seconds.items()},
         "step_seconds": total,
         "rollout_tok_s": num_tokens / max(batch.generate_seconds, 1e-9)}
    if batch.stats is not None:
        m.update(speculation_metrics(batch, seconds))
    return m


def speculation_metrics(batch, seconds: dict) -> dict:
    """tau and acceptance overall, per position and per task family; overshoot by position; and
    the cost account: draft-training time against the rollout time speculation saved."""
    st = batch.stats
    fam: dict[str, list[int]] = {}  # family -> the indices of its rows
    for i, ex in enumerate(batch.examples):
        fam.setdefault(ex.family, []).append(i)
    judged, accepted = sum(st.reached), sum(st.accepted)
    # Drafts accepted / drafts judged: unlike tau it leaves out the steps an adaptive controller
    # decoded plainly, so those do not dilute it (it still weighs the positions as judged, and
    # deeper positions, judged only at larger gamma, accept less).
    m = {"accept_length": st.accept_length,
         "acceptance": accepted / judged if judged else float("nan"),
         "acceptance_by_position": st.acceptance_by_position,
         "acceptance_by_family": {k: st.pooled_acceptance(rows) for k, rows in sorted(fam.items())},
         "accept_length_by_family": {k: st.pooled_accept_length(rows) for k, rows in sorted(fam.items())},
         "overshoot_by_position": st.overshoot_by_position,
         "gamma_counts": {str(k): v for k, v in sorted(st.gamma_counts.items())}}
    if st.plain_decode_estimate_seconds is not None:
        saved = st.plain_decode_estimate_seconds - st.draft_seconds - st.verify_seconds
        net = saved - seconds.get("train_draft", 0.0)
        step = sum(seconds.values())
        m["cost"] = {"rollout_saved_seconds_est": saved, "draft_train_seconds": seconds.get("train_draft", 0.0),
                     "net_saved_seconds_est": net, "e2e_speedup_est": (step + net) / step,
                     "draft_train_share": seconds.get("train_draft", 0.0) / step}
    return m


def console_line(m: dict) -> str:
    line = (f"reward {m['reward']:.3f} kl {m['kl_from_init']:.4f} len {m['response_length']['mean']:.1f} "
            f"gen {m['time_share']['generate']:.0%} {m['rollout_tok_s']:.0f} tok/s")
    if "accept_length" in m:
        line += f" tau {m['accept_length']:.2f}"
    if m.get("draft_nonfinite_skipped"):  # co-training refused some non-finite updates
        line += f" draft updates skipped (non-finite) {m['draft_nonfinite_skipped']}"
    return line
