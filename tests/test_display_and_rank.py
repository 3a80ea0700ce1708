"""Two shared helpers, each the one place its rule lives.

``schemas.display.shown``: text the program did not write reaches a reader with its control
characters as escapes (D104), whether it is an operator's reason that `flywheel status` prints
or the error a controller's heartbeat carries (``modelstore.desired.Heartbeat``, read by
`flywheel status -o json`): the same hostile string gives the same escaped text through both,
and the heartbeat's 1000-character cut comes after the escaping.

``learner.rank.is_rank0``: ``$RANK`` unset or "0" is rank 0, "1" is not, and a value that names
no rank is refused naming RANK (by the cycle before it reads anything, and by ``flywheel learn``
as a usage error, exit 2) rather than taken as rank 0.

Real parts: a model store on disk with its fleet record and heartbeat file, the real deploy and
learn CLIs in-process; no pod (status reports the one it is pointed at as unreachable), no
model. Expected texts are written out by hand.
"""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from deploy.commands import register
from modelstore.desired import Heartbeat, FleetRecord
from modelstore.store import ModelStore
from schemas.display import shown
from schemas.events import now_ms

DEAD = "http://127.0.0.1:9"  # nothing listens on the discard port

# ESC [2J, BEL, the 8-bit CSI, NUL, DEL, a bidi override, a line break, a tab; and a backslash
HOSTILE = "ok\x1b[2J\x07\x9b31m\x00\x7f\u202eend\nnext\tx\\y"
ESCAPED = "ok\\x1b[2J\\x07\\x9b31m\\x00\\x7f\\u202eend\\nnext\\tx\\y"  # by hand: repr's escapes, "\\" kept


def test_shown_writes_each_unprintable_character_as_repr_does_and_keeps_printable_text():
    assert shown(HOSTILE) == ESCAPED
    assert shown("plain [bold] text \\x1b ünïcode") == "plain [bold] text \\x1b ünïcode"
    assert shown("\ud800 \u2028 \xa0") == "\\ud800 \\u2028 \\xa0"  # lone surrogate, line separator, nbsp
    assert shown("") == ""


def _beat(error):
    return json.dumps({"at": now_ms(), "host": "ctl-host", "pid": 7, "poll_s": 5.0, "error": error}).encode()


def test_the_heartbeat_error_is_escaped_then_cut():
    assert Heartbeat.parse(_beat(HOSTILE), now_ms()).error == ESCAPED
    # 995 + 2 raw characters; escaped 995 + 8 = 1003, cut to 1000: "x" * 995 + "\x1b" + "\"
    hb = Heartbeat.parse(_beat("x" * 995 + "\x1b\x1b"), now_ms())
    assert hb.error == "x" * 995 + "\\x1b\\" + "... (3 more characters)"
    assert Heartbeat.parse(_beat("x" * 1000), now_ms()).error == "x" * 1000  # at the limit: not cut


def test_a_reason_in_status_and_a_heartbeat_error_show_the_same_escaped_text(tmp_path, fw_home, monkeypatch):
    store = ModelStore(tmp_path / "store")
    for k in ("FLYWHEEL_KAFKA_BOOTSTRAP", "FLYWHEEL_ACTOR"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("FLYWHEEL_STORE", str(store.root))
    monkeypatch.setenv("FLYWHEEL_SERVING_URL", DEAD)
    pause = {"actor": "ops", "at": 1_700_000_000_000, "reason": HOSTILE}

    def fn(x):
        x.stable, x.pods, x.paused = "v000000", [DEAD], pause
        return x
    rec = FleetRecord(store)
    rec.change(fn, "ops", "pause", "test")
    rec.beat({"at": now_ms(), "host": "ctl-host", "pid": 7, "poll_s": 5.0, "error": HOSTILE})
    app = typer.Typer()
    register(app)

    r = CliRunner().invoke(app, ["status"])
    assert r.exit_code == 1, r.output  # the one pod does not answer; everything else is printed
    assert "learner: PAUSED by ops at " in r.output and f"UTC: {ESCAPED}" in r.output, r.output
    r = CliRunner().invoke(app, ["status", "-o", "json"])
    doc = json.loads(r.output)
    assert doc["learner"]["paused"]["reason"] == HOSTILE  # the record's exact value
    assert doc["controller"]["heartbeat"]["error"] == ESCAPED  # as the reader keeps it


@pytest.mark.parametrize("value,rank0", [(None, True), ("0", True), ("1", False), (" 0 ", True), ("12", False)])
def test_is_rank0(monkeypatch, value, rank0):
    from learner.rank import is_rank0

    monkeypatch.setenv("WORLD_SIZE", "16")  # as torchrun sets it beside RANK
    if value is None:
        monkeypatch.delenv("RANK", raising=False)
    else:
        monkeypatch.setenv("RANK", value)
    assert is_rank0() is rank0


@pytest.mark.parametrize("world", [None, "1", "2", "x"])
def test_a_rank_outside_its_world_is_refused_naming_both(monkeypatch, world):
    """RANK=2 with WORLD_SIZE unset (a single process's ensure_dist_env would then set it to 1),
    1, 2 or unreadable: that process would wait forever for a rank 0 in its rendezvous."""
    from learner.rank import RankError, is_rank0

    monkeypatch.setenv("RANK", "2")
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(RankError) as exc:
        is_rank0()
    assert str(exc.value) == f"RANK: 2 needs WORLD_SIZE greater than it (torchrun sets both; a single process " \
                             f"leaves both unset), got WORLD_SIZE={world!r}"
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert is_rank0() is False


@pytest.mark.parametrize("value", ["", "abc", "-1", "0.0", "1e0"])
def test_a_malformed_rank_is_refused_naming_rank(monkeypatch, value):
    from learner.rank import RankError, is_rank0

    monkeypatch.setenv("RANK", value)
    with pytest.raises(RankError) as exc:
        is_rank0()
    assert str(exc.value) == ("RANK: must be a whole number >= 0 (this process's torch.distributed rank, as "
                              f"torchrun sets it) or unset (one process, rank 0), got {value!r}")
    assert isinstance(exc.value, ValueError)


def test_a_cycle_refuses_a_malformed_rank_before_it_reads_anything(tmp_path, monkeypatch):
    from learner.config import LearnerConfig
    from learner.cycle import run_cycle
    from learner.rank import RankError

    monkeypatch.setenv("RANK", "abc")
    missing = tmp_path / "no-store"  # opening it would fail with another error
    with pytest.raises(RankError, match=r"^RANK: must be a whole number >= 0 "):
        run_cycle(missing, tmp_path / "no-samples", tmp_path / "state", LearnerConfig())
    assert not (tmp_path / "state").exists()


def test_flywheel_learn_refuses_a_malformed_rank_as_a_usage_error(tmp_path, fw_home, monkeypatch):
    from learner.commands import register as register_learn

    monkeypatch.setenv("RANK", "rank-zero")
    monkeypatch.setenv("FLYWHEEL_STORE", str(tmp_path / "no-store"))
    app = typer.Typer()
    register_learn(app)
    app.command("noop")(lambda: None)  # two commands, so `learn` is a subcommand
    r = CliRunner().invoke(app, ["learn", "--once"])
    flat = " ".join(r.output.split())
    assert r.exit_code == 2, r.output
    assert "Invalid value for $RANK: must be a whole number >= 0" in flat and "got 'rank-zero'" in flat, flat
    assert not (tmp_path / "no-store").exists()
