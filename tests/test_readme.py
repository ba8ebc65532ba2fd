"""The README's first two lines are the two commands, and CI runs the second verbatim."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    lines = (ROOT / "README.md").read_text().splitlines()
    main_cmd, test_cmd = lines[0].strip(), lines[1].strip()
    assert main_cmd.endswith("cospec demo")
    assert "pytest" in test_cmd
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_cmd in [line.strip() for line in ci]
