"""Issue 19 item 6: a fleet on one box with real parts (tests/fleet_rig.py), and the scripted
incident: a canary in progress; the operator pauses the learner (a daemon on another home sees
it) and rolls back through the load balancer's URL; one pod is SIGKILLed during the rollback
and restarted; another is SIGSTOPped and resumed.

Asserted: every pod converges to the desired stable; users keep one arm on every pod
(measured through HAProxy, which says which pod answered); every accepted vote is in exactly
one sample (0 lost, none double-counted, a vote re-sent through another pod counted once);
the ledger has each pod's outcome. The SIGSTOP lasts STOP_S = 4 s here (30 s in
bench/fleet.py) to fit the CI budget.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from deploy import ledger
from modelstore.desired import FleetRecord
from modelstore.store import ModelStore
from tests.fleet_rig import FleetRig, arm_disagreement
from tests.test_deploy_controller import publish_v

STOP_S = 4.0
pytestmark = [pytest.mark.skipif(not any(Path("/usr/lib/postgresql").glob("*/bin/postgres")),
                                 reason="PostgreSQL not installed (apt-get install -y postgresql)"),
              pytest.mark.skipif(not Path("/usr/sbin/haproxy").exists(),
                                 reason="HAProxy not installed (apt-get install -y haproxy)")]


def wait_for(cond, timeout_s: float, what: str, rig: FleetRig | None = None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.3)
    logs = "" if rig is None else "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in rig.tmp.glob("*.log"))
    raise AssertionError(f"timed out ({timeout_s} s) waiting for {what}\n{logs}")


def rig_ledger(rig: FleetRig) -> Path:
    """The ledger the rig's operator commands and controller write (``schemas.settings.ledger_path()``
    under their environment)."""
    from unittest import mock

    from schemas import settings

    with mock.patch.dict(os.environ, rig.env(rig.op_home), clear=True):
        return settings.ledger_path()


def samples_by_event(samples: Path) -> dict[str, int]:
    from samplestore.catalog import read_samples

    out: dict[str, int] = {}
    if not any(samples.glob("**/*.parquet")):
        return out
    for s in read_samples(samples):
        for e in s.event_ids:
            out[e] = out.get(e, 0) + 1
    return out


@pytest.mark.timeout(400)
def test_rollback_through_the_service_reaches_every_pod_through_a_sigkill_and_a_sigstop(tmp_path, tiny_moe_dir,
                                                                                      broker):
    from ingest import pglocal

    t_start = time.monotonic()
    pg = pglocal.start()
    rig = FleetRig(tmp_path, tiny_moe_dir, broker.bootstrap, pg.url)
    try:
        store = ModelStore(rig.store_root)
        store.init_base(tiny_moe_dir)
        v1 = publish_v(store, "v000000").version  # the learner's versions, published with the store API
        FleetRecord(store).change(lambda d: (setattr(d, "stable", v1), d)[1], "setup", "stable")
        store.set_status(v1, "promoted", "setup")
        publish_v(store, v1, scale=1.001)  # v000002: the controller canaries it
        for i in range(3):
            rig.start_pod(i)
        rig.start_workers(2)
        rig.start_learner()
        for i in range(3):
            rig.wait_pod(i)
        rig.start_haproxy()
        rig.start_controller("--steps", "0.5,1", "--min-votes", "100000")  # never decides: stays at 50 %
        wait_for(lambda: rig.serving() == [("v000001", "v000002", 0.5)] * 3, 90, "the canary on every pod", rig)

        # users through the Service: each lands on several pods; one arm per user everywhere
        users = [f"user-{k}" for k in range(16) for _ in range(3)]
        with httpx.Client(timeout=60) as c:
            served = [rig.complete(c, u) for u in users]
            assert len({pod for pod, _, _ in served}) == 3
            assert arm_disagreement(served, users) == 0.0
            assert {v for _, v, _ in served} == {"v000001", "v000002"}  # both arms have users
            # one vote per completion through the Service (another pod than the one that served
            # it, round robin), and every fourth vote re-sent with the same event id: counted once
            eids = []
            for k, (_, _, cid) in enumerate(served):
                eid = rig.vote(c, cid, 1 if k % 3 else -1)
                eids.append(eid)
                if k % 4 == 0:
                    rig.vote(c, cid, 1 if k % 3 else -1, event_id=eid)

        # the on-call engineer pauses the learner first: the daemon on its own home sees it
        r = rig.operator("pause", "--yes", "--reason", "incident: v1 and v2 regress")
        assert r.returncode == 0, r.stdout + r.stderr
        wait_for(lambda: "learn: paused by operator" in (tmp_path / "learner.log").read_text(), 60,
                 "the learner to see the pause", rig)
        assert rig.learner.poll() is None

        # the incident: rollback through the Service's URL; pod-1 SIGKILLed, pod-2 SIGSTOPped
        op = rig.operator_bg("rollback", "--to", "v000000", "--yes", "--serving", rig.lb, "--timeout", "150",
                             "--serving-timeout-s", "2", "--reason", "v1 and v2 regress")
        os.killpg(rig.pods[2].pid, signal.SIGSTOP)
        rig.pods[1].send_signal(signal.SIGKILL)
        rig.pods[1].wait(10)
        t_stop = time.monotonic()
        rig.start_pod(1)  # restarted: reads the desired state before it is ready
        time.sleep(max(0.0, STOP_S - (time.monotonic() - t_stop)))
        os.killpg(rig.pods[2].pid, signal.SIGCONT)
        out, _ = op.communicate(timeout=200)
        assert op.returncode == 0, out
        assert "stable is now v000000 on all 3 pods" in " ".join(out.split()), out
        assert rig.serving() == [("v000000", None, 0.0)] * 3
        d = FleetRecord(store).read()
        assert (d.stable, d.candidate) == ("v000000", None) and store.stable() == "v000000"
        rows = [r for r in ledger.decisions(rig_ledger(rig))
                if r.decision in ("MANUAL_ROLLBACK", "FLEET_CONVERGED", "FLEET_NOT_CONVERGED")]
        # the decision when the record changed, then each pod's outcome as the command observed it
        assert [r.decision for r in rows] == ["MANUAL_ROLLBACK", "FLEET_CONVERGED"], rows
        gen = rows[0].numbers["generation"]
        assert rows[0].actor == "oncall-ola" and rows[1].numbers["generation"] == gen
        final = rows[-1].numbers["pods"]
        assert set(final["by_pod"]) == {rig.url(i) for i in range(3)}
        assert final["converged"] == final["pods"] == 3, rows[-1].numbers
        assert {p["outcome"] for p in final["by_pod"].values()} == {"converged"}
        assert {p["generation"] for p in final["by_pod"].values()} == {gen}

        # votes: every accepted one in exactly one sample, none twice (the re-sends deduped)
        got = wait_for(lambda: (lambda s: s if set(eids) <= set(s) else None)(samples_by_event(rig.samples)), 90,
                       "every vote in a sample", rig)
        assert {e: got[e] for e in eids} == {e: 1 for e in eids}
        assert len(got) == len(eids)
        assert all(p.poll() is None for p in rig.workers)
        assert rig.learner.poll() is None and "published" not in (tmp_path / "learner.log").read_text()
    finally:
        rig.close()
        pg.stop()
    print(f"fleet test wall time {time.monotonic() - t_start:.1f} s")
