"""The report's HTML: a first screen that answers "did speculation pay?", then the figures.

The page opens with a headline in words, per speculative run against the plain run ("none"):
rollout and end-to-end speed, how much of its tau the draft kept, what co-training cost, and a
losslessness check (each speculative run's reward against the plain run's, in standard errors).
Then one table with readable headers that fits a 1280-px window; every field of the summary stays
one click away (a closed <details>). `cospec.metrics.report` makes the figures and the summary
data this page shows.
"""

from __future__ import annotations

import base64
import html
import json
import math

#: (header, summary field, format) of the summary table, in order
TABLE = [("Run", "run", "s"), ("Reward, first", "reward_first", ".3f"),
         ("Reward, last", "reward_last", ".3f"), ("KL at the end", "kl_last", ".3f"),
         ("Tau, first", "tau_first", ".2f"), ("Tau, last", "tau_last", ".2f"),
         ("Tau kept", "tau_retained", ".0%"), ("Rollouts vs plain (time)", "rollout_speedup_vs_none", "x"),
         ("Rollouts vs plain (tokens/s)", "rollout_tok_s_speedup_vs_none", "x"),
         ("Step vs plain", "e2e_speedup_vs_none", "x"), ("Co-training share", "train_draft_share", ".1%"),
         ("Seconds per step", "step_seconds", ".2f")]


def _format(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if fmt == "s":
        return html.escape(str(value))
    return f"{value:.2f}x" if fmt == "x" else format(value, fmt)


def summary_table(summary: dict) -> str:
    """The summary as a table with readable headers (columns no run has are left out)."""
    rows = [{"run": name, **row} for name, row in summary.items()]
    cols = [(h, k, f) for h, k, f in TABLE if any(r.get(k) is not None for r in rows)]
    head = "".join(f"<th>{html.escape(h)}</th>" for h, _, _ in cols)
    body = "".join("<tr>" + "".join(f"<td>{_format(r.get(k), f)}</td>" for _, k, f in cols) + "</tr>"
                   for r in rows)
    return f'<table class="summary"><tr>{head}</tr>{body}</table>'


def reward_check(runs: dict[str, list[dict]]) -> str:
    """Lossless sampling leaves the reward distribution as it is: each speculative run's mean step
    reward against the plain run's, the difference in standard errors of the difference. (Steps
    are not independent samples, as the policy moves: a rough check, not a test.)"""
    if "none" not in runs:
        return ""

    def mean_se(hist):
        r = [m["reward"] for m in hist]
        mean = sum(r) / len(r)
        var = sum((x - mean) ** 2 for x in r) / max(len(r) - 1, 1)
        return mean, math.sqrt(var / len(r))

    base, base_se = mean_se(runs["none"])
    parts, zs = [], []
    for name, hist in runs.items():
        if name == "none":
            continue
        mean, se = mean_se(hist)
        zs.append((mean - base) / math.sqrt(se ** 2 + base_se ** 2) if se or base_se else 0.0)
        parts.append(f"{html.escape(name)} {mean:.3f} ({zs[-1]:+.1f} s.e.)")
    verdict = ("within sampling noise, as lossless sampling should be"
               if all(abs(z) < 2 for z in zs)
               else "more apart than sampling noise usually makes them: look into it")
    return (f"Mean reward over the steps: none {base:.3f}; " + "; ".join(parts) +
            f": {verdict}.")


def headline(summary: dict, runs: dict[str, list[dict]]) -> list[str]:
    """Sentences (HTML) for the first screen: per speculative run, what speculation gave and cost."""
    lines = []
    for name, r in summary.items():
        if name == "none" or r.get("tau_first") is None:
            continue
        speed = ""
        if r.get("e2e_speedup_vs_none") is not None:
            paid = r["e2e_speedup_vs_none"] > 1.0
            speed = (f"rollouts {_format(r.get('rollout_speedup_vs_none'), 'x')} plain per step "
                     f"({_format(r.get('rollout_tok_s_speedup_vs_none'), 'x')} per generated token), "
                     f"whole RL step {_format(r['e2e_speedup_vs_none'], 'x')}: speculation "
                     f"<b>{'paid' if paid else 'did not pay'}</b>; ")
        share = r.get("train_draft_share") or 0.0
        cost = (f"training the draft took {_format(share, '.1%')} of step time" if share >= 5e-4
                else "the draft was not trained")
        lines.append(f"<b>{html.escape(name)}</b>: {speed}the draft kept "
                     f"{_format(r.get('tau_retained'), '.0%')} of its tau ({r['tau_first']:.2f} "
                     f"&rarr; {r['tau_last']:.2f} tokens per policy forward); {cost}.")
    check = reward_check(runs)
    if check:
        lines.append(check)
    return lines


def page(runs: dict[str, list[dict]], summary: dict, figs: dict[str, bytes], *,
         config: dict | None = None, commands: list[str] | None = None) -> str:
    """The whole self-contained page (figures inlined as data URIs)."""
    rows = [{"run": name, **row} for name, row in summary.items()]
    cols = list(dict.fromkeys(c for row in rows for c in row))
    raw = "<table><tr>" + "".join(f"<th>{c}</th>" for c in cols) + "</tr>" + "".join(
        "<tr>" + "".join(f"<td>{_format(r.get(c), 's' if c == 'run' else '.3f')}</td>" for c in cols)
        + "</tr>" for r in rows) + "</table>"
    images = "\n".join(
        f'<figure><img alt="{n}" src="data:image/png;base64,{base64.b64encode(p).decode()}">'
        f"<figcaption>{n}</figcaption></figure>" for n, p in figs.items())
    lead = "".join(f"<li>{line}</li>" for line in headline(summary, runs))
    extra = ""
    if commands:
        extra += "<h2>Commands</h2><pre>" + html.escape("\n".join(commands)) + "</pre>"
    if config:
        extra += "<h2>Config</h2><pre>" + html.escape(json.dumps(config, indent=2)) + "</pre>"
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>cospec report</title>
<style>body{{font-family:sans-serif;max-width:1200px;margin:1.5em auto;padding:0 12px}}
table{{border-collapse:collapse;font-size:14px}}td,th{{border:1px solid #ccc;padding:3px 6px;text-align:right}}
th{{background:#f4f4f4;max-width:7.5em}}figure{{display:inline-block;margin:8px;vertical-align:top}}
img{{max-width:100%}}ul.headline li{{margin:0.35em 0}}pre{{white-space:pre-wrap}}</style></head>
<body><h1>cospec: speculative rollouts with a co-trained draft</h1>
<ul class="headline">{lead}</ul>
<h2>Summary</h2>{summary_table(summary)}
<p>Reward and tau: means over the first and the last fifth of the steps. "vs plain": the run named
none, paired step by step (above 1 is faster). Tau kept: last over first.</p>
<details><summary>Every summary field</summary>{raw}</details>
<h2>Figures</h2>{images}
{extra}
<script>
// For headless checks: how many figures decoded, and whether the page fits the window's width.
window.addEventListener("load", () => {{
  const imgs = [...document.images];
  document.body.dataset.imagesTotal = imgs.length;
  document.body.dataset.imagesLoaded = imgs.filter(i => i.complete && i.naturalWidth > 0).length;
  document.body.dataset.pageWidth = document.documentElement.scrollWidth;
  document.body.dataset.windowWidth = window.innerWidth;
}});
</script>
</body></html>
"""
