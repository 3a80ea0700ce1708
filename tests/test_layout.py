"""What a newcomer reads: test files are named after what they test, and product code says what
is true now, not which issue or trial it came from (history lives in docs/decisions.md and git).
Reads the checkout's files; no imports of the product packages."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("schemas", "serving", "ingest", "learner", "deploy", "flywheel", "sdk")


def test_no_test_file_is_named_after_how_its_bug_was_found():
    named = sorted(p.name for p in (ROOT / "tests").glob("test_*.py")
                   if re.match(r"test_(trial|issue|stop|run)_?[a-z0-9]*_", p.name))
    assert not named, f"name these after what they test: {named}"


def test_no_issue_or_review_round_names_in_product_code():
    pattern = re.compile(r"\b([Ii]ssue \d+|[Hh]ardening [IVX]+|[Tt]rial [A-Z]\b|[Ss]top \d+)")
    hits = [f"{p.relative_to(ROOT)}:{i}" for pkg in PRODUCT for p in sorted((ROOT / pkg).rglob("*.py"))
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if pattern.search(line)]
    assert not hits, f"product code tells its history (move it to docs/decisions.md): {hits}"
