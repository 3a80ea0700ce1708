"""What an operator or a record file supplies (a reason, an actor, an action) reaches the
terminal of `flywheel status` and the on-call commands with its control characters shown as
escapes (``\\x1b``, ``\\n``), never as bytes a terminal acts on (``ESC [2J`` clears the screen,
``ESC ]0;`` sets the window title, the 8-bit CSI U+009B starts a sequence on terminals that take
C1 controls); the held-candidate line's 120-character cut comes after the escaping, so it never
splits a sequence into one that acts; ``-o json`` holds the exact values. `--reason` and
`--actor` refuse control characters (a tab or a line break allowed in a reason), naming the
flag, before anything is written. A long escaped value is cut in the status tables (an
ellipsis), never squeezing the other columns; ``flywheel resume --reason`` is recorded as
``pause --reason`` is. And the held-candidate line names the record's last change as
that (a pause after the eval's change included), never as the change that put the candidate
there (hostile tester, D2/D3).

Real parts: a model store on disk with its fleet record (written by ``FleetRecord.change``, as
another tool or a hand-edited file could write it), a real DuckDB ledger (``ledger.record``),
the real deploy CLI in-process (its rich console, not a terminal, so rich adds no escape of its
own). No pod runs: status reports the one it is pointed at as unreachable (exit 1) and prints
everything else. Expected escapes are written out by hand, not computed by the code under test.
"""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from deploy import ledger
from deploy.commands import register
from modelstore.desired import FleetRecord
from modelstore.store import ModelStore
from schemas import settings
from schemas.ledger import LedgerEntry

DEAD = "http://127.0.0.1:9"  # nothing listens on the discard port

# each hostile text, and how the terminal must show it (written out by hand)
HOSTILE = {
    "clear": ("\x1b[2J", "\\x1b[2J"),
    "title": ("\x1b]0;t\x07", "\\x1b]0;t\\x07"),
    "csi8": ("\x9b31m", "\\x9b31m"),
    "nul": ("a\x00b", "a\\x00b"),
    "del": ("a\x7fb", "a\\x7fb"),
    "newline": ("a\nb", "a\\nb"),
    "nel": ("a\x85b", "a\\x85b"),
}
NO_NUL = {k: v for k, v in HOSTILE.items() if k != "nul"}  # the ledger refuses NUL itself


def _bad_bytes(out: str) -> list[tuple[int, str]]:
    """Every character of ``out`` a terminal acts on: C0 but the renderer's line breaks, DEL, C1."""
    return [(i, c) for i, c in enumerate(out) if (ord(c) < 0x20 and c != "\n") or 0x7f <= ord(c) <= 0x9f]


@pytest.fixture()
def cli(tmp_path, fw_home, monkeypatch):
    """The CLI over a model store whose record holds v000001 at weight 0 (stable v000000), no pod."""
    store = ModelStore(tmp_path / "store")
    monkeypatch.delenv("FLYWHEEL_KAFKA_BOOTSTRAP", raising=False)
    monkeypatch.delenv("FLYWHEEL_ACTOR", raising=False)
    monkeypatch.setenv("FLYWHEEL_STORE", str(store.root))
    monkeypatch.setenv("FLYWHEEL_SERVING_URL", DEAD)
    monkeypatch.setenv("USER", "oncall-noa")
    app = typer.Typer()
    register(app)

    def run(*args):
        r = CliRunner().invoke(app, list(args))
        return r, r.output
    run.store = store
    return run


def _hold(actor: str, action: str, reason: str, paused: dict | None = None):
    def fn(x):
        x.stable, x.candidate, x.weight, x.pods = "v000000", "v000001", 0.0, [DEAD]
        x.paused = paused
        return x
    return fn


@pytest.mark.parametrize("name", list(HOSTILE))
def test_status_shows_control_characters_as_escapes_and_its_json_holds_the_exact_values(cli, name):
    raw, esc = HOSTILE[name]
    actor, action, reason = f"ops{raw}", f"eval{raw}", f"why {raw} end"
    pause = {"actor": f"p{raw}", "at": 1_700_000_000_000, "reason": f"stop {raw} now"}
    FleetRecord(cli.store).change(_hold(actor, action, reason, pause), actor, action, reason)
    if name in NO_NUL:
        ledger.record(settings.ledger_path(), LedgerEntry(version="v000001", stable="v000000", step=-1, weight=0.0,
                                                          decision="MANUAL_PROMOTE", reason=f"row {raw} end",
                                                          numbers={}, actor=f"a{raw}"))

    r, out = cli("status")
    assert r.exit_code == 1, out  # the one pod does not answer; everything else is printed
    assert _bad_bytes(out) == [], (name, _bad_bytes(out)[:5], out)
    flat = " ".join(out.split())
    # the held-candidate line: one line (whitespace joined, so a line break is a space there)
    sh = lambda s: " ".join(s.split()).replace(raw, esc)  # noqa: E731 - "a\nb" -> "a b", "\x1b[2J" -> "\\x1b[2J"
    assert (f"warning: the candidate v000001 is held at 0 % (no user is sent to it); the record's last change was "
            f"{sh(actor)}'s \"{sh(action)}\" (generation 1 at ") in flat, flat
    assert f"UTC: {sh(reason)}), not necessarily the one that put the candidate there; " in flat, flat
    # the desired-state line, the paused line and the decisions table: every character kept, escaped
    assert f"(last change: eval{esc} by ops{esc} at " in flat, flat
    assert f"learner: PAUSED by p{esc} at " in flat and f"UTC: stop {esc} now" in flat, flat
    if name in NO_NUL:
        assert f"a{esc}" in flat and f"row {esc} end" in flat, flat

    r, out = cli("status", "-o", "json")
    assert _bad_bytes(out) == [], (name, out)
    doc = json.loads(out)
    assert doc["candidate_held"]["last_change"] | {"updated_ms": 0} == {
        "generation": 1, "actor": actor, "action": action, "reason": reason, "updated_ms": 0}
    assert doc["desired"]["actor"] == actor and doc["learner"]["paused"] == pause
    if name in NO_NUL:
        row = doc["decisions"][-1]
        assert (row["actor"], row["reason"]) == (f"a{raw}", f"row {raw} end")


def test_the_120_character_cut_comes_after_the_escaping(cli):
    reason = "x" * 110 + "\x1b[31mRED and more words after it"
    FleetRecord(cli.store).change(_hold("ops", "fixed eval", reason), "ops", "fixed eval", reason)
    r, out = cli("status")
    assert _bad_bytes(out) == [], out
    # escaped first ("\x1b" is 4 characters), then cut to 117 + "..."
    quoted = ("x" * 110 + "\\x1b[31mRED and more words after it")[:117] + "..."
    assert quoted == "x" * 110 + "\\x1b[31..."
    assert f"UTC: {quoted}), not necessarily the one that put the candidate there; " in " ".join(out.split()), out
    doc = json.loads(cli("status", "-o", "json")[1])
    assert doc["candidate_held"]["last_change"]["reason"] == reason


def test_the_held_line_names_the_records_last_change_after_a_later_pause(cli):
    eval_reason = "fixed eval: v000001 in the candidate slot at 0 %"
    first = FleetRecord(cli.store).change(_hold("flywheel demo", "fixed eval", eval_reason), "flywheel demo",
                                          "fixed eval", eval_reason)
    r, out = cli("pause", "--yes", "--actor", "bob", "--reason", "x")
    assert r.exit_code == 0, out
    d = FleetRecord(cli.store).read()
    assert (d.generation, d.candidate, d.weight, d.actor, d.action) == (first.generation + 1, "v000001", 0.0, "bob",
                                                                        "pause")
    flat = " ".join(cli("status")[1].split())
    assert ("warning: the candidate v000001 is held at 0 % (no user is sent to it); the record's last change was "
            f"bob's \"pause\" (generation {d.generation} at ") in flat, flat
    assert "UTC: x), not necessarily the one that put the candidate there; no controller has run: " in flat, flat
    assert "left it" not in flat, flat
    doc = json.loads(cli("status", "-o", "json")[1])
    assert doc["candidate_held"] == {"version": "v000001", "weight": 0.0, "last_change": {
        "generation": d.generation, "actor": "bob", "action": "pause", "reason": "x", "updated_ms": d.updated_ms}}


@pytest.mark.parametrize("args,flag,shown", [
    (["--reason", "\x1b[2J"], "--reason", "'\\x1b'"),
    (["--reason", "ok \x9b31m"], "--reason", "'\\x9b'"),
    (["--reason", "a\x7f"], "--reason", "'\\x7f'"),
    (["--actor", "bob\nroot"], "--actor", "'\\n'"),
    (["--actor", "b\x1b]0;t\x07"], "--actor", "'\\x1b'"),
])
def test_reason_and_actor_refuse_control_characters_naming_the_flag_before_anything_is_written(cli, args, flag,
                                                                                                  shown):
    before = FleetRecord(cli.store).read()
    for cmd in (["pause", "--yes"], ["resume", "--yes"], ["rollback", "--to", "v000000", "--yes", "--timeout", "0"]):
        r, out = cli(*cmd, *args)
        assert r.exit_code == 2, (cmd, out)
        flat = " ".join(out.split())
        assert f"Invalid value for '{flag}': holds the control character {shown} at position " in flat, flat
        assert _bad_bytes(out) == [], out
    assert FleetRecord(cli.store).read() == before
    assert ledger.decisions(settings.ledger_path()) == []


def test_a_reason_may_hold_a_line_break_and_an_actor_variable_with_an_escape_is_refused(cli, monkeypatch):
    r, out = cli("pause", "--yes", "--actor", "bob", "--reason", "line one\nline two\tend")
    assert r.exit_code == 0, out
    assert FleetRecord(cli.store).read().paused["reason"] == "line one\nline two\tend"
    r, out = cli("status")
    assert "learner: PAUSED by bob at " in out and "UTC: line one\\nline two\\tend" in out, out
    r, out = cli("pause", "--yes")  # already paused: the line shows the reason escaped
    assert r.exit_code == 0 and out.rstrip("\n").endswith(": line one\\nline two\\tend"), out
    monkeypatch.setenv("FLYWHEEL_ACTOR", "ops\x1b[2J")
    r, out = cli("resume", "--yes")
    assert r.exit_code == 2, out
    assert ("error: $FLYWHEEL_ACTOR: holds the control character '\\x1b' at position 3" in " ".join(out.split())
            and _bad_bytes(out) == []), out
    assert FleetRecord(cli.store).read().paused is not None  # nothing was changed


def test_a_ledger_row_whose_numbers_another_tool_wrote_as_not_json_is_shown_not_fatal(cli):
    """The ledger is a DuckDB file other tools can write: a row whose ``numbers`` is not JSON is
    kept and shown as ``{"unreadable": <text>}``; status still prints every row (it raised
    ``JSONDecodeError`` before)."""
    import duckdb

    path = settings.ledger_path()
    ledger.record(path, LedgerEntry(version="v000001", stable="v000000", step=-1, weight=0.0,
                                    decision="MANUAL_PROMOTE", reason="good row", numbers={"n": 1}, actor="a"))
    con = duckdb.connect(str(path))
    con.execute("UPDATE decisions SET numbers = 'not json' WHERE reason = 'good row'")
    con.execute("INSERT INTO decisions SELECT * REPLACE ('second row' AS reason, '{\"n\": 2}' AS numbers) FROM decisions")
    con.close()
    rows = ledger.decisions(path)
    assert [(r.reason, r.numbers) for r in rows] == [("good row", {"unreadable": "not json"}), ("second row", {"n": 2})]
    r, out = cli("status", "-o", "json")
    assert "Traceback" not in out and [d["reason"] for d in json.loads(out)["decisions"]] == ["good row", "second row"]
    r, out = cli("status")
    assert r.exit_code == 1 and "second row" in " ".join(out.split()), out


LONG_VERSION, LONG_ACTOR = "v\x1b" * 40, "ops\x1b[2J" * 10  # 200 and 100 characters once escaped


@pytest.mark.parametrize("fmt", ["wide", "table"])
def test_a_long_escaped_value_is_cut_in_the_decisions_table_not_the_other_columns(cli, fmt):
    """A ledger row whose version and actor are long runs of control characters (each shown as a
    4-character escape): each is cut to 40 characters, the last one "…", so every column keeps its
    width (before, the time, step, weight, decision and reason columns were squeezed to nothing
    in a 200-column table); ``-o json`` keeps the whole values."""
    from deploy.commands import console

    FleetRecord(cli.store).change(_hold("ops", "set", "x"), "ops", "set", "x")
    ledger.record(settings.ledger_path(), LedgerEntry(version=LONG_VERSION, stable="v000000", step=3, weight=0.25,
                                                      decision="MANUAL_PROMOTE", reason="the reason, whole",
                                                      numbers={"n": 1}, actor=LONG_ACTOR))
    r, out = cli("status", "-o", fmt)
    assert r.exit_code == 1 and _bad_bytes(out) == [], out
    lines = out.splitlines()
    top = next(i for i, line in enumerate(lines) if "last decisions" in line)
    table = lines[top + 1:]
    assert max(len(line) for line in table) <= console.width, (console.width, out)
    heads = [c.strip() for c in table[1].strip("┃").split("┃")]
    assert heads == ["time (UTC)", "version", "stable", "step", "weight", "decision", "actor", "reason",
                     *(["numbers"] if fmt == "wide" else [])], heads
    cells = [c.strip() for c in table[3].strip("│").split("│")]
    # the 40 characters shown, written out: 7 escapes of 5 characters, then "v\x1" and the ellipsis
    assert cells[1] == "v\\x1bv\\x1bv\\x1bv\\x1bv\\x1bv\\x1bv\\x1bv\\x1…" and len(cells[1]) == 40, cells
    assert cells[6] == "ops\\x1b[2Jops\\x1b[2Jops\\x1b[2Jops\\x1b[2…" and len(cells[6]) == 40, cells
    assert cells[2:6] == ["v000000", "3", "25%", "MANUAL_PROMOTE"], cells
    assert cells[7] == "the reason, whole" and len(cells[0]) == len("01-02 03:04:05"), cells
    if fmt == "wide":
        assert cells[8] == '{"n": 1}', cells
    doc = json.loads(cli("status", "-o", "json")[1])
    row = doc["decisions"][-1]
    assert (row["version"], row["actor"]) == (LONG_VERSION, LONG_ACTOR)


def test_resume_records_its_reason_as_pause_does(cli):
    """``flywheel resume --reason`` goes where ``pause --reason`` goes: the RESUME ledger row's
    reason and the fleet record's change."""
    r, out = cli("pause", "--yes", "--actor", "bob", "--reason", "eval broken")
    assert r.exit_code == 0, out
    r, out = cli("resume", "--yes", "--actor", "ann", "--reason", "eval fixed in 4c1e\nback on")
    assert r.exit_code == 0 and "learner resumed by ann" in out, out
    rows = ledger.decisions(settings.ledger_path())
    assert [(x.decision, x.actor, x.reason) for x in rows] == [
        ("PAUSE", "bob", "learner paused by bob: eval broken"),
        ("RESUME", "ann", "learner resumed by ann: eval fixed in 4c1e\nback on")]
    assert rows[1].numbers["paused"]["reason"] == "eval broken"
    d = FleetRecord(cli.store).read()
    assert (d.paused, d.actor, d.action, d.reason) == (None, "ann", "resume", "eval fixed in 4c1e\nback on")
    assert rows[1].numbers["generation"] == d.generation
    # without --reason: the row says who, as before
    cli("pause", "--yes", "--actor", "bob")
    r, out = cli("resume", "--yes", "--actor", "ann")
    assert r.exit_code == 0 and ledger.decisions(settings.ledger_path())[-1].reason == "learner resumed by ann"
