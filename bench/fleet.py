"""Fleet benchmark (issue 19 item 6): an operator rollback through the Service reaches every pod.

Three `flywheel serve` processes (tiny random MoE, own homes, one store, one user salt)
behind HAProxy round-robin, the controller discovering them (``tests/fleet_rig.py``). Measured
side by side in one run:

* ``fleet_rollback_converge_s``: `flywheel rollback --to X --yes --serving <Service URL>` from
  its start until every pod serves X (checked on each pod's ``/admin/slots``), alternating X,
  median of 5 (3 with ``--quick``), with NO controller running: the command changes the record
  and watches, and each pod converges through its own watch of the record (``--desired-poll``,
  2 s by default).
  ``fleet_rollback_inside_command_s``: the part of it from the record change to every pod
  converged, as the command reports it (the rest is the CLI's start).
* the baseline, what the CLI did before the desired state: one ``POST /admin/rollback`` to the
  Service URL; the pods that then serve X are counted (1 of 3 expected).
* ``fleet_incident_converge_s``: the same rollback while one pod is SIGKILLed and restarted
  and another is SIGSTOPped for 30 s (5 s with ``--quick``) and resumed.
* ``fleet_arm_disagreement``: with a canary at 50 % on every pod, the share of 40 users
  (3 requests each through the Service) served by different versions on different pods.

Usage: ``python bench/fleet.py [--quick]``. Timings on a shared 2-core box are noisy.
"""

from __future__ import annotations

import argparse
import re
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from modelstore.desired import FleetRecord  # noqa: E402
from deploy.serving_client import ServingAdmin  # noqa: E402
from modelstore.store import ModelStore  # noqa: E402
from flywheel.broker import spawn  # noqa: E402
from tests.conftest import make_tiny_moe  # noqa: E402
from tests.fleet_rig import TOKEN, FleetRig, arm_disagreement  # noqa: E402
from tests.test_deploy_controller import publish_v  # noqa: E402


def wait(cond, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise TimeoutError(what)


def rollback(rig: FleetRig, to: str) -> tuple[float, float]:
    """``(end to end s, s inside the command from the record change to convergence)``."""
    t0 = time.monotonic()
    r = rig.operator("rollback", "--to", to, "--yes", "--serving", rig.lb, "--timeout", "120",
                     "--serving-timeout-s", "3")
    if r.returncode != 0:
        raise RuntimeError(r.stdout + r.stderr)
    wait(lambda: [s and s[0] for s in rig.serving()] == [to] * 3, 60, f"every pod on {to}")
    total = time.monotonic() - t0
    m = re.search(r"on all 3 pods \(([0-9.]+) s;", " ".join(r.stdout.split()))
    return total, float(m.group(1)) if m else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 repetitions, a 5 s SIGSTOP")
    args = ap.parse_args()
    reps, stop_s = (3, 5.0) if args.quick else (5, 30.0)
    tmp = Path(tempfile.mkdtemp(prefix="fleet-bench-"))
    broker = spawn()
    model = make_tiny_moe(tmp / "model")
    rig = FleetRig(tmp, model, broker.bootstrap, None)
    try:
        store = ModelStore(rig.store_root)
        store.init_base(model)
        publish_v(store, "v000000")
        for i in range(3):
            rig.start_pod(i)
        for i in range(3):
            rig.wait_pod(i)
        rig.start_haproxy()
        rig.start_controller("--steps", "0.5,1", "--min-votes", "100000")
        wait(lambda: rig.serving() == [("v000000", "v000001", 0.5)] * 3, 120, "canary on every pod")
        users = [f"user-{k}" for k in range(40) for _ in range(3)]
        with httpx.Client(timeout=60) as c:
            served = [rig.complete(c, u) for u in users]
        disagreement = arm_disagreement(served, users)
        pods_hit = len({p for p, _, _ in served})
        rig.controller.send_signal(signal.SIGTERM)  # no controller from here: the pods' own watch converges them
        rig.controller.wait(15)
        rig.controller = None

        times, inside = [], []
        for k in range(reps):
            total, conv = rollback(rig, "v000000" if k % 2 == 0 else "v000001")
            times.append(total)
            inside.append(conv)
            print(f"rollback {k}: {total:.2f} s end to end, {conv:.2f} s from the record change to every pod", flush=True)
        # the baseline: one admin call to the Service URL (what the CLI did before)
        cur = rig.serving()[0][0]
        target = "v000001" if cur == "v000000" else "v000000"
        lb = ServingAdmin(rig.lb, TOKEN, timeout_s=60)
        lb.rollback(target)
        lb.close()
        reached = sum(1 for s in rig.serving() if s and s[0] == target)
        assert FleetRecord(store).read().stable == cur  # the record still says `cur`: converge back
        rollback(rig, cur)

        # the incident: SIGKILL + restart one pod, SIGSTOP another for stop_s, during the rollback
        target = "v000001" if cur == "v000000" else "v000000"
        t0 = time.monotonic()
        op = rig.operator_bg("rollback", "--to", target, "--yes", "--serving", rig.lb, "--timeout", str(stop_s + 120),
                             "--serving-timeout-s", "3")
        os.killpg(rig.pods[2].pid, signal.SIGSTOP)
        rig.pods[1].send_signal(signal.SIGKILL)
        rig.pods[1].wait(10)
        rig.start_pod(1)
        time.sleep(max(0.0, stop_s - (time.monotonic() - t0)))
        os.killpg(rig.pods[2].pid, signal.SIGCONT)
        out, _ = op.communicate(timeout=stop_s + 200)
        if op.returncode != 0:
            raise RuntimeError(out)
        wait(lambda: [s and s[0] for s in rig.serving()] == [target] * 3, 120, "incident convergence")
        incident = time.monotonic() - t0
    finally:
        rig.close()
        broker.stop()
    print(f"users through the Service reached {pods_hit} pods; rollbacks: {', '.join(f'{t:.2f}' for t in times)} s")
    print(f"baseline, the CLI before the desired state (one admin call to the Service URL): {reached} of 3 pods "
          "reached; the fleet rollback reached 3 of 3 every time")
    print(f"RESULT fleet_rollback_inside_command_s={statistics.median(inside):.2f} s target<5 "
          "(record change to every pod converged, median)")
    print(f"RESULT fleet_incident_converge_s={incident:.1f} s target<{stop_s + 60:.0f} "
          f"(SIGKILL+restart and a {stop_s:.0f} s SIGSTOP)")
    print(f"RESULT fleet_rollback_converge_s={statistics.median(times):.2f} s target<10 (3 pods, median of {reps})")
    print(f"RESULT fleet_arm_disagreement={disagreement:.3f} share target=0")


if __name__ == "__main__":
    main()
