"""Operator text that is not valid UTF-8 (issue 11: operator actions are durable and always
in the ledger). A `--reason` typed in a Latin-1 terminal reaches Python as a lone surrogate
(``'caf\\udce9'``); it could not be written to the ledger, the version's manifest or the
store's stable record, so `flywheel promote --reason ...` swapped the pod, then crashed
before the stable record and the ledger row were written: a restart undid the promote and
nothing recorded it. Real pods (the admin servers of ``test_deploy_faults``) over a real
model store, through the real deploy CLI.
"""

from __future__ import annotations

from serving.commands import default_version
from modelstore.store import ModelStore
from tests.test_deploy_durable import desire_candidate
from tests.test_deploy_faults import _last, env  # noqa: F401 - the fixture

LATIN1_REASON = "caf\udce9 broke"  # b"caf\xe9 broke" from argv, as Python decodes it
LATIN1_ACTOR = "jos\udce9"


def test_a_promote_and_a_rollback_with_non_utf8_text_are_recorded_and_survive_a_restart(env, monkeypatch):
    env.pods[0].app.state.watch()  # the pod converges to the record by itself, as a real pod does
    desire_candidate(env.store.root, "v000001")
    r, _, out = env.cli("promote", "--yes", "--reason", LATIN1_REASON, "--actor", LATIN1_ACTOR)
    assert r.exit_code == 0, (out, r.exception)
    assert default_version(ModelStore(env.store.root)) == "v000001"  # what a restarted pod serves
    last = _last(env)
    assert (last.decision, last.version, last.actor) == ("MANUAL_PROMOTE", "v000001", "jos\ufffd")
    assert "caf\ufffd broke" in last.reason and last.numbers["why"] == "caf\ufffd broke"
    assert env.store.stable_record()["actor"] == "jos\ufffd"

    monkeypatch.setenv("FLYWHEEL_ACTOR", "m\udcfcller")  # an env value with a non-UTF-8 byte
    r, _, out = env.cli("rollback", "--to", "v000000", "--yes", "--reason", "\ud800 lone")
    assert r.exit_code == 0, (out, r.exception)
    assert default_version(ModelStore(env.store.root)) == "v000000"
    last = _last(env)
    assert (last.decision, last.version, last.actor) == ("MANUAL_ROLLBACK", "v000000", "m\ufffdller")
    assert last.numbers["why"] == "? lone"
    # a failed action is recorded too
    r, _, out = env.cli("promote", "--yes", "--reason", LATIN1_REASON)
    assert r.exit_code == 1 and "could not record" not in out, out
    assert _last(env).decision == "MANUAL_PROMOTE_FAILED"
    r, _, out = env.cli("pause", "--yes", "--reason", LATIN1_REASON)
    assert r.exit_code == 0 and "could not record" not in out, (out, r.exception)
    assert _last(env).decision == "PAUSE"
