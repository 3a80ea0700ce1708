"""docs/runbook.md stays identical to `flywheel runbook`, names only real commands and flags;
the rollout status replayed from ledger rows (table test)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import typer
from typer.main import get_command
from typer.testing import CliRunner

from deploy.commands import register
from deploy.controller import RolloutPhase, status_from_ledger
from deploy.ledger import LedgerEntry
from deploy.runbook import RUNBOOK, runbook_markdown

DOC = Path(__file__).resolve().parents[1] / "docs" / "runbook.md"


def _cli():
    app = typer.Typer()
    register(app)
    return app


def test_doc_embeds_the_cli_runbook_verbatim():
    assert runbook_markdown() in DOC.read_text()
    out = CliRunner().invoke(_cli(), ["runbook", "--json"]).output
    assert [(r["symptom"], r["check"], r["command"]) for r in json.loads(out)] == RUNBOOK


def test_every_command_and_flag_in_the_runbook_exists():
    from flywheel.cli import app  # the real `flywheel` CLI, every package registered

    cmd = get_command(app)
    text = DOC.read_text() + "\n".join(" ".join(r) for r in RUNBOOK)
    seen = 0
    for m in re.finditer(r"`flywheel ([a-z]+)(?: ([a-z]+))?([^`]*)`", text):
        sub = cmd.commands.get(m.group(1))
        assert sub is not None, f"runbook names unknown command flywheel {m.group(1)}"
        if hasattr(sub, "commands") and m.group(2):
            sub = sub.commands.get(m.group(2))
            assert sub is not None, f"unknown subcommand in {m.group(0)}"
        flags = {o for p in sub.params for o in getattr(p, "opts", [])}
        for flag in re.findall(r"--[a-z-]+", m.group(0)):
            assert flag in flags, f"{m.group(0)}: {flag} is not a flag of that command"
        seen += 1
    assert seen >= 20


def E(decision, version="v000002", step=0, weight=0.05, ts=0, stable="v000001", numbers=None):
    return LedgerEntry(version=version, stable=stable, step=step, weight=weight, decision=decision,
                       reason=decision.lower(), ts=ts, numbers=numbers or {})


def test_status_from_ledger_table():
    assert status_from_ledger([]) is None
    assert status_from_ledger([E("PAUSE", version="learner")]) is None
    cases = [
        # rows -> (phase, candidate, step, weight, canary_started_ms, step_started_ms, last)
        ([E("START", ts=10)], (RolloutPhase.CANARY, "v000002", 0, 0.05, 10, 10, "START")),
        ([E("START", ts=10), E("HOLD", ts=20), E("ADVANCE", step=1, weight=0.25, ts=30), E("RELOAD", step=1, ts=40)],
         (RolloutPhase.CANARY, "v000002", 1, 0.25, 10, 30, "ADVANCE")),
        ([E("START", ts=10), E("ADVANCE", step=1, weight=1.0, ts=30), E("PROMOTE", step=1, weight=1.0, ts=50)],
         (RolloutPhase.PROMOTED, "v000002", 1, 0.0, 10, 30, "PROMOTE")),
        ([E("START", ts=10), E("ROLLBACK", ts=20)], (RolloutPhase.ROLLED_BACK, "v000002", 0, 0.0, 10, 10, "ROLLBACK")),
        ([E("START", ts=10), E("ABORT", ts=20)], (RolloutPhase.ABORTED, "v000002", 0, 0.0, 10, 10, "ABORT")),
        ([E("FAILED", weight=0.0, ts=10)], (RolloutPhase.FAILED, "v000002", 0, 0.0, 10, 10, "FAILED")),
        # operator actions from the CLI end the canary
        ([E("START", ts=10), E("MANUAL_PROMOTE", step=-1, weight=0.0, ts=20)],
         (RolloutPhase.PROMOTED, "v000002", 0, 0.0, 10, 10, "MANUAL_PROMOTE")),
        ([E("START", ts=10), E("MANUAL_ROLLBACK", version="v000000", step=-1, weight=0.0, ts=20)],
         (RolloutPhase.ABORTED, "v000002", 0, 0.0, 10, 10, "MANUAL_ROLLBACK")),
        # `flywheel canary start|abort` (rows with per-pod outcomes) open and end a canary
        ([E("MANUAL_CANARY_START", step=0, weight=0.25, ts=10, numbers={"pods": {}}), E("HOLD", step=0, ts=20)],
         (RolloutPhase.CANARY, "v000002", 0, 0.25, 10, 10, "HOLD")),
        ([E("START", ts=10), E("MANUAL_CANARY_ABORT", step=0, weight=0.0, ts=20, numbers={"pods": {}})],
         (RolloutPhase.ABORTED, "v000002", 0, 0.0, 10, 10, "MANUAL_CANARY_ABORT")),
        # ... rows without them are requests an earlier CLI left for the controller: no change
        ([E("START", ts=10), E("MANUAL_CANARY_ABORT", step=-1, weight=0.0, ts=20)],
         (RolloutPhase.CANARY, "v000002", 0, 0.05, 10, 10, "START")),
        ([E("MANUAL_CANARY_START", version="v000003", step=-1, weight=0.0, ts=5), E("START", ts=10)],
         (RolloutPhase.CANARY, "v000002", 0, 0.05, 10, 10, "START")),
        # an ADVANCE of another version does not move this canary; a new START replaces it
        ([E("START", ts=10), E("ADVANCE", version="v000009", step=2, ts=20)],
         (RolloutPhase.CANARY, "v000002", 0, 0.05, 10, 10, "START")),
        ([E("START", ts=10), E("ROLLBACK", ts=20), E("START", version="v000003", ts=30)],
         (RolloutPhase.CANARY, "v000003", 0, 0.05, 30, 30, "START")),
    ]
    for rows, want in cases:
        st = status_from_ledger(rows)
        got = (st.phase, st.candidate, st.step, st.weight, st.canary_started_ms, st.step_started_ms, st.last_outcome)
        assert got == want, ([r.decision for r in rows], got)
    st = status_from_ledger([E("START", ts=10), E("PROMOTE", ts=20)])
    assert st.stable == "v000002"
