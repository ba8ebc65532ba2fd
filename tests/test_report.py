"""Specification of `cospec report`: a self-contained page whose every figure loads in a browser.

The runs come from a tiny stale-draft experiment (2 RL steps per mode). The browser check renders
the page from disk in headless Chromium (no server) and reads back how many <img> decoded; it is
skipped only where Chromium is not installed (.ci/run installs it).
"""

import re
import shutil
import subprocess

import matplotlib.pyplot as plt
import pytest
import torch

from cospec.cli import main
from cospec.metrics.report import _draw_rollout_speedup, write_report

MODES = ("none", "frozen", "cotrain-ce")
FIGURES = ("reward_vs_step.png", "tau_and_kl_vs_step.png", "acceptance_by_position.png",
           "acceptance_by_family.png", "overshoot_by_position.png", "step_time_split.png",
           "rollout_speedup_vs_batch.png")
EARLIER_RUNS_CHECKPOINT = "step_000020"  # left where the fixture's run writes, as by an earlier run


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    (out / "stale-draft" / "frozen" / "checkpoints" / EARLIER_RUNS_CHECKPOINT).mkdir(parents=True)
    assert main(["experiment", "stale-draft", "--modes", ",".join(MODES), "--recipe", "tiny",
                 f"out_dir={out}", "grpo.steps=2", "sft.steps=3", "sft.warmup_steps=1",
                 "sft.eval_prompts_per_family=2", "draft.train_steps=3", "grpo.checkpoint_every=3",
                 "draft.num_train_prompts=8", "sampling.max_new_tokens=12"]) == 0
    bench = out / "rollout.json"
    bench.write_text('{"results": [{"batch_size": 1, "speedup": 1.4, "adaptive_speedup": 1.3, '
                     '"ideal_speedup": 1.6}, {"batch_size": 16, "speedup": 1.1, '
                     '"adaptive_speedup": 1.1, "ideal_speedup": 1.4}], "meta": {"gamma": 4}}')
    return write_report([out / "stale-draft" / m for m in MODES], out / "report", bench_json=bench,
                        commands=["cospec experiment stale-draft"])


def test_the_page_embeds_every_figure_and_a_summary_row_per_run(report):
    page = report.read_text()
    assert page.count('src="data:image/png;base64,') == len(FIGURES)
    for name in FIGURES:
        assert (report.parent / name).stat().st_size > 1000, name
        assert f"<figcaption>{name}</figcaption>" in page
    for mode in MODES:
        assert f"<td>{mode}</td>" in page
    assert "http://" not in page and "https://" not in page  # nothing fetched: opens offline


def _chromium():
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.mark.skipif(_chromium() is None, reason="Chromium not installed (.ci/run installs it)")
def test_every_figure_loads_and_the_page_fits_1280_px_in_headless_chromium(report):
    dom = subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu",
                          "--window-size=1280,900", "--virtual-time-budget=5000", "--dump-dom",
                          report.as_uri()], capture_output=True, text=True, timeout=120).stdout
    found = {k: re.search(rf'data-{k}="(\d+)"', dom)
             for k in ("images-total", "images-loaded", "page-width", "window-width")}
    assert all(found.values()), dom[:500]
    n = {k: int(m.group(1)) for k, m in found.items()}
    assert n["images-total"] == len(FIGURES) == n["images-loaded"]
    assert n["window-width"] == 1280 and n["page-width"] <= 1280, n  # no horizontal scrollbar


def test_the_first_screen_says_in_words_what_speculation_gave_and_cost(report):
    page = report.read_text()
    head = page[page.index('<ul class="headline">'):page.index("<h2>Summary</h2>")]
    for mode in ("frozen", "cotrain-ce"):
        assert f"<b>{mode}</b>: rollouts " in head
    assert head.count("speculation <b>paid</b>") + head.count("speculation <b>did not pay</b>") == 2
    assert "of its tau" in head and "Mean reward over the steps: none" in head
    assert "training the draft took" in head and "the draft was not trained" in head  # cotrain, frozen
    table = page[page.index('<table class="summary">'):page.index("</table>")]
    assert "<th>Tau kept</th>" in table and "reward_first" not in table  # readable headers


def test_the_reward_check_flags_runs_apart_beyond_noise():
    from cospec.metrics.report_page import reward_check

    def run(rewards):
        return [{"reward": r} for r in rewards]

    near = reward_check({"none": run([0.5, 0.6, 0.4, 0.5]), "frozen": run([0.45, 0.55, 0.5, 0.6])})
    far = reward_check({"none": run([0.5, 0.52, 0.48, 0.5]), "frozen": run([0.9, 0.92, 0.88, 0.9])})
    assert "within sampling noise" in near and "look into it" in far


def test_the_summary_compares_rollouts_per_generated_token_as_well_as_per_step():
    """Speculative and plain runs sample different answers: a run whose answers are half as long
    looks 2x faster per step; per generated token it is as fast."""
    from cospec.metrics.report import summarise

    def step(i, generate_s, tok_s):
        return {"step": i, "reward": 0.5, "kl_from_init": 0.0, "step_seconds": generate_s + 10.0,
                "time": {"generate": generate_s}, "time_share": {}, "rollout_tok_s": tok_s}

    runs = {"none": [step(i, 20.0, 100.0) for i in range(1, 4)],
            "frozen": [step(i, 10.0, 100.0) for i in range(1, 4)]}
    row = summarise(runs)["frozen"]
    assert row["rollout_speedup_vs_none"] == 2.0
    assert row["rollout_tok_s"] == 100.0 and row["rollout_tok_s_speedup_vs_none"] == 1.0


def test_the_speedup_figure_shows_paired_speedups_where_the_benchmark_has_them():
    """Paired (plain timed on each run's own lengths) when every row has them; older benchmark
    files without them still draw, unpaired."""
    row = {"batch_size": 1, "speedup": 0.8, "adaptive_speedup": 0.9, "ideal_speedup": 1.5,
           "paired_speedup": 1.1, "adaptive_paired_speedup": 1.0}
    for rows, expected in [([row], {"gamma 4, paired": 1.1, "adaptive, paired": 1.0}),
                           ([{k: v for k, v in row.items() if "paired" not in k}],
                            {"gamma 4": 0.8, "adaptive": 0.9})]:
        fig, ax = plt.subplots()
        _draw_rollout_speedup({"results": rows, "meta": {"gamma": 4}}, ax)
        lines = {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}
        plt.close(fig)
        assert {k: lines[k] for k in expected} == {k: [v] for k, v in expected.items()}


def test_the_summary_reads_draft_freshness_as_acceptance_too_which_plain_steps_do_not_dilute():
    """Under adaptive gamma tau counts the steps decoded plainly (tau 1), so a controller that
    speculates less looks like a staler draft; drafts accepted / judged does not. Steps where no
    draft was judged (NaN) are left out of the means."""
    from cospec.metrics.report import summarise

    def step(i, tau, acceptance):
        return {"step": i, "reward": 0.5, "kl_from_init": 0.0, "step_seconds": 10.0,
                "time": {"generate": 5.0}, "time_share": {}, "accept_length": tau,
                "acceptance": acceptance}

    hist = [step(1, 2.0, 0.6), step(2, 1.2, 0.6), step(3, 1.0, float("nan")), step(4, 1.2, 0.6),
            step(5, 1.1, 0.3), step(6, 1.1, 0.3), step(7, 1.0, None)]  # None: NaN read from JSON
    row = summarise({"cotrain": hist})["cotrain"]  # fifths of 7 steps: the first and last one
    assert row["tau_first"] == 2.0 and row["tau_last"] == 1.0
    assert row["acceptance_first"] == 0.6 and row["acceptance_last"] is None
    assert "acceptance_retained" not in row
    row = summarise({"cotrain": hist[:6]})["cotrain"]
    assert (row["acceptance_first"], row["acceptance_last"]) == (0.6, 0.3)
    assert row["acceptance_retained"] == 0.5
    row = summarise({"cotrain": [step(1, 1.0, 0.0), *hist[1:6]]})["cotrain"]  # nothing accepted
    assert row["acceptance_first"] == 0.0 and "acceptance_retained" not in row


def test_a_steps_draft_acceptance_is_drafts_accepted_over_drafts_judged():
    """Row a accepts 2 of 4 drafts (3 judged: the third is the rejection), row b all 4; a plain
    step (gamma 0) judges nothing and changes nothing: 6 of 7."""
    from types import SimpleNamespace

    from cospec.rl.step_metrics import speculation_metrics
    from cospec.rollout.speculation_stats import SpeculationStats

    st = SpeculationStats(reached=[0] * 4, accepted=[0] * 4)
    counts = [[0] * 4, [0] * 4]
    st.add_step(4, [2, 4], counts)
    st.add_step(0, [0, 0], counts)
    st.set_rows(counts)
    batch = SimpleNamespace(stats=st, examples=[SimpleNamespace(family="add")] * 2)
    m = speculation_metrics(batch, {"generate": 1.0})
    assert m["acceptance"] == 6 / 7 and m["acceptance_by_family"] == {"add": 6 / 7}
    assert m["accept_length"] == (3 + 5 + 1 + 1) / 4


def test_a_familys_tau_is_its_tokens_over_its_steps_as_the_overall_tau_is():
    """Row a (add) takes one step of 5 tokens, row b (add) four steps of 1, row c (mul) two
    steps of 3 and 1: the add family's tau is 9 / 5, not the mean of its rows' 5 and 1 (which
    would read 3, above the overall 13 / 7 that the same rows make)."""
    from types import SimpleNamespace

    from cospec.rl.step_metrics import speculation_metrics
    from cospec.rollout.speculation_stats import SpeculationStats

    st = SpeculationStats(reached=[0] * 4, accepted=[0] * 4)
    counts = [[0] * 4 for _ in range(3)]
    st.add_step(4, [4, 0, 2], counts)
    for _ in range(3):
        st.add_step(4, [0], counts[1:2])
    st.add_step(4, [0], counts[2:3])
    st.set_rows(counts)
    families = [SimpleNamespace(family=f) for f in ("add", "add", "mul")]
    m = speculation_metrics(SimpleNamespace(stats=st, examples=families), {"generate": 1.0})
    assert m["accept_length"] == 13 / 7
    assert m["accept_length_by_family"] == {"add": 9 / 5, "mul": 4 / 2}
    assert st.per_row_accept_length == [5.0, 1.0, 2.0]  # each row's own ratio is still there
    assert m["acceptance_by_family"] == {"add": 4 / 8, "mul": 2 / 4}  # drafts accepted / judged


def test_the_stale_draft_experiment_keeps_each_modes_draft_as_the_run_left_it(report):
    """frozen's is the offline draft untouched; the co-trained one has moved; plain has none."""
    from cospec.models.draft_checkpoint import load_draft

    out = report.parent.parent
    offline = load_draft(out / "draft").state_dict()
    frozen = load_draft(out / "stale-draft" / "frozen" / "draft").state_dict()
    cotrained = load_draft(out / "stale-draft" / "cotrain-ce" / "draft").state_dict()
    assert not (out / "stale-draft" / "none" / "draft").exists()
    assert all(torch.equal(offline[k], frozen[k]) for k in offline)
    assert any(not torch.equal(offline[k], cotrained[k]) for k in offline)


def test_the_stale_draft_experiment_checkpoints_every_mode_as_train_does(report):
    """At the last step (2 here, checkpoint_every 3) each mode has a whole checkpoint of its own
    run (`cospec train`'s format, which its tests specify: policy, trainer state, config), with
    the draft as the run left it, and no earlier run's checkpoint survives to pass for it. (The
    tiny runs earn no reward, so their policies do not move: what a saved policy holds is
    specified with the trainer's checkpoints, not here.)"""
    from cospec.experiments.stale_draft import MODES as MODE_SETTINGS
    from cospec.models.draft_checkpoint import load_draft
    from cospec.rl.checkpoint import latest_checkpoint, load_checkpoint

    out = report.parent.parent
    assert not (out / "stale-draft" / "frozen" / "checkpoints" / EARLIER_RUNS_CHECKPOINT).exists()
    for mode in MODES:
        path = latest_checkpoint(out / "stale-draft" / mode / "checkpoints")
        assert path is not None and path.name == "step_000002", mode
        ckpt = load_checkpoint(path)
        assert ckpt["trainer_state"]["step"] == 2
        assert ckpt["config"]["rollout"]["speculative"] == MODE_SETTINGS[mode]["rollout"]["speculative"]
        assert ckpt["config"]["out_dir"] == str(out / "stale-draft" / mode)
        if mode == "none":
            assert ckpt["draft"] is None
            continue
        kept = load_draft(out / "stale-draft" / mode / "draft").state_dict()
        saved = ckpt["draft"].state_dict()
        assert kept.keys() == saved.keys() and all(torch.equal(kept[k], saved[k]) for k in kept), mode
