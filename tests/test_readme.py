"""CI runs the README's test line verbatim: the line in `.ci/run` equals the README's."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _fenced_line_after(marker: str) -> str:
    lines = (ROOT / "README.md").read_text().splitlines()
    i = lines.index(marker)
    assert lines[i + 1].startswith("```")
    return lines[i + 2]


def test_ci_runs_the_readme_test_line_verbatim():
    line = _fenced_line_after("<!-- test-line -->")
    assert "pytest" in line
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert line in ci


def test_demo_line_runs_the_main_job():
    assert "flywheel demo" in _fenced_line_after("<!-- demo-line -->")
