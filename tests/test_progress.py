"""Progress of long work when stdout is a log file: a plain line at most once a minute and at the
end, so an hours-long run under nohup says how far it is (a live bar draws nothing there)."""

import io

from cospec.metrics.progress import _LogLines, progress_bar


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_a_log_gets_one_line_per_interval_and_one_at_the_end():
    clock, out = FakeClock(), io.StringIO()
    tick = _LogLines(total=10, label="draft-train", interval=60.0, clock=clock, stream=out)
    for step in range(10):
        clock.now += 25.0  # 25 s a step: lines after steps 3 (75 s), 6 (150 s), 9 (225 s), 10 (the end)
        tick(f"held out {step}")
    lines = out.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["3/10", "6/10", "9/10", "10/10"]
    assert lines[0] == "draft-train 3/10 (30%) 25.00 s/it, ~0:02:55 left  held out 2"
    assert lines[-1] == "draft-train 10/10 (100%) 25.00 s/it, 0:04:10 in all  held out 9"


def test_a_run_that_ends_before_a_minute_prints_only_its_last_line():
    clock, out = FakeClock(), io.StringIO()
    tick = _LogLines(total=3, label="sft", interval=60.0, clock=clock, stream=out)
    for _ in range(3):
        clock.now += 1.0
        tick()
    assert out.getvalue() == "sft 3/3 (100%) 1.00 s/it, 0:00:03 in all\n"


def test_a_resumed_run_counts_on_from_where_it_was_and_paces_only_its_own_items():
    clock, out = FakeClock(), io.StringIO()
    tick = _LogLines(total=960, label="draft-train", interval=60.0, start=480, clock=clock, stream=out)
    for _ in range(10):
        clock.now += 6.0
        tick()
    assert out.getvalue() == "draft-train 490/960 (51%) 6.00 s/it, ~0:47:00 left\n"


def test_stdout_that_is_not_a_terminal_gets_log_lines_and_disabled_gets_nothing(capsys, monkeypatch):
    for forcing in ("FORCE_COLOR", "FORCE_TERMINAL", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        monkeypatch.delenv(forcing, raising=False)  # each can make rich call any stream a terminal
    with progress_bar(True, 2, "grpo") as advance:
        assert isinstance(advance, _LogLines)  # pytest's captured stdout is not a terminal
        advance("reward 0.5")
        advance("reward 0.6")
    assert capsys.readouterr().out.startswith("grpo 2/2 (100%)")
    with progress_bar(False, 2, "grpo") as advance:
        advance("reward 0.5")
        advance("reward 0.6")
    assert capsys.readouterr().out == ""
