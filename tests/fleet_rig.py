"""A fleet on one box with real parts, for tests/test_fleet_haproxy.py and bench/fleet.py.

Three `flywheel serve --fleet` processes (``FLYWHEEL_FLEET=1``: a pod refuses to start without
the fleet's salt), each with its own ``FLYWHEEL_HOME`` (its own container filesystem), one
shared model store, one ``FLYWHEEL_USER_SALT`` (the fleet secret), a real
Tansu broker; HAProxy (Debian ``haproxy``) round-robin in front as the Kubernetes Service
stand-in, adding ``X-Served-By: <server>`` so a test knows which pod answered; the
controller (`flywheel controller`) discovering the three pods; two ingest workers with their
join state in a real PostgreSQL server; the learner daemon (`flywheel learn`) in its own
home, its watermark and checkpoints on the shared volume, which must see the operator's pause
through the desired-state record. The versions the canary and the rollback move between are
published with the store API (``publish_v``), so no DeepSpeed cycle runs in the incident.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx

from flywheel.broker import free_port
from flywheel.supervise import die_with_parent

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "fleet-rig-admin"
SALT = "fleet-secret-salt"


def _wait_port(port: int, timeout_s: float, proc: subprocess.Popen | None = None, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"process exited {proc.returncode}: "
                                   f"{log.read_text()[-3000:] if log else ''}") from None
            time.sleep(0.2)
    raise TimeoutError(f"port {port} not listening after {timeout_s} s: {log.read_text()[-3000:] if log else ''}")


class FleetRig:
    """Start with :meth:`start`, stop everything with :meth:`close` (every process it started)."""

    def __init__(self, tmp: Path, model_dir: Path, bootstrap: str, pg_url: str | None, n_pods: int = 3):
        self.tmp, self.model_dir, self.bootstrap, self.pg_url = Path(tmp), Path(model_dir), bootstrap, pg_url
        self.store_root = self.tmp / "shared" / "store"
        self.samples = self.tmp / "shared" / "samples"
        self.ports = [free_port() for _ in range(n_pods)]
        self.lb_port = free_port()
        self.pods: list[subprocess.Popen | None] = [None] * n_pods
        self.others: list[subprocess.Popen] = []
        self.controller: subprocess.Popen | None = None
        self.learner: subprocess.Popen | None = None
        self.workers: list[subprocess.Popen] = []
        self.op_home = self.tmp / "controller-home"  # operator commands run where the controller's ledger is

    # -- environment ------------------------------------------------------------------------
    def env(self, home: Path, **extra) -> dict:
        e = dict(os.environ, FLYWHEEL_HOME=str(home), FLYWHEEL_STORE=str(self.store_root),
                 FLYWHEEL_SAMPLES=str(self.samples), FLYWHEEL_KAFKA_BOOTSTRAP=self.bootstrap,
                 FLYWHEEL_ADMIN_TOKEN=TOKEN, FLYWHEEL_USER_SALT=SALT, FLYWHEEL_MODEL_DIR=str(self.model_dir),
                 PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", **extra)
        e.pop("FLYWHEEL_SERVING_URL", None)
        return e

    def url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.ports[i]}"

    @property
    def lb(self) -> str:
        return f"http://127.0.0.1:{self.lb_port}"

    # -- processes --------------------------------------------------------------------------
    def start_pod(self, i: int) -> subprocess.Popen:
        log = self.tmp / f"pod-{i}.log"
        p = subprocess.Popen([sys.executable, "-m", "flywheel.cli", "serve", "--port", str(self.ports[i]),
                              "--pod", f"pod-{i}", "--max-batch", "4", "--threads", "1"],
                             cwd=ROOT, env=self.env(self.tmp / f"pod-{i}-home", FLYWHEEL_FLEET="1"),
                             stdout=open(log, "ab"),
                             stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent())
        self.pods[i] = p
        return p

    def wait_pod(self, i: int, timeout_s: float = 180) -> None:
        _wait_port(self.ports[i], timeout_s, self.pods[i], self.tmp / f"pod-{i}.log")

    def start_haproxy(self) -> None:
        servers = "\n".join(f"    server pod-{i} 127.0.0.1:{p} check inter 300ms fall 2 rise 1"
                            for i, p in enumerate(self.ports))
        cfg = self.tmp / "haproxy.cfg"
        cfg.write_text(f"""global
    maxconn 256
defaults
    mode http
    timeout connect 1s
    timeout client 60s
    timeout server 60s
    retries 2
    option redispatch
frontend service
    bind 127.0.0.1:{self.lb_port}
    default_backend pods
backend pods
    balance roundrobin
    http-response set-header X-Served-By %s
{servers}
""")
        p = subprocess.Popen(["haproxy", "-f", str(cfg), "-db"], stdout=open(self.tmp / "haproxy.log", "ab"),
                             stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent())
        self.others.append(p)
        _wait_port(self.lb_port, 20, p, self.tmp / "haproxy.log")

    def start_controller(self, *extra: str) -> None:
        args = [sys.executable, "-m", "flywheel.cli", "controller", "--poll-s", "0.5", "--serving-timeout-s", "3"]
        for i in range(len(self.ports)):
            args += ["--serving", self.url(i)]
        self.controller = subprocess.Popen(args + list(extra), cwd=ROOT, env=self.env(self.op_home),
                                           stdout=open(self.tmp / "controller.log", "ab"), stderr=subprocess.STDOUT,
                                           start_new_session=True, preexec_fn=die_with_parent())

    def start_workers(self, n: int = 2) -> None:
        for i in range(n):
            extra = {"FLYWHEEL_INGEST_STATE": self.pg_url} if self.pg_url else {}
            self.workers.append(subprocess.Popen(
                [sys.executable, "-m", "ingest", "--seal-after-s", "3", "--orphan-ttl-s", "30", "--tick-s", "0.5"],
                cwd=ROOT, env=self.env(self.tmp / f"ingest-{i}-home", **extra),
                stdout=open(self.tmp / f"ingest-{i}.log", "ab"), stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent()))

    def start_learner(self) -> None:
        """The learner daemon on its own home (another node): checks every 0.5 s and trains only
        after 10,000 new samples, so in a test it idles unless paused."""
        self.learner = subprocess.Popen(
            [sys.executable, "-m", "flywheel.cli", "learn", "--poll-s", "0.5", "--every-n", "10000"],
            cwd=ROOT, env=self.env(self.tmp / "learner-home",
                                   FLYWHEEL_LEARNER_STATE=str(self.tmp / "shared" / "learner")),
            stdout=open(self.tmp / "learner.log", "ab"), stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent())
        self.others.append(self.learner)

    def operator(self, *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
        """Run a `flywheel` command as the on-call engineer (the controller's home, the Service URL)."""
        return subprocess.run([sys.executable, "-m", "flywheel.cli", *args], cwd=ROOT,
                              env=self.env(self.op_home, FLYWHEEL_SERVING_URL=self.lb, USER="oncall-ola"),
                              capture_output=True, text=True, timeout=timeout_s)

    def operator_bg(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "flywheel.cli", *args], cwd=ROOT,
                                env=self.env(self.op_home, FLYWHEEL_SERVING_URL=self.lb, USER="oncall-ola"),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    @staticmethod
    def _stop(p: subprocess.Popen | None) -> None:
        if p is None or p.poll() is not None:
            return
        try:
            os.killpg(p.pid, signal.SIGCONT)
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(5)

    def close(self) -> None:
        for p in [self.controller, *self.workers, *self.pods, *self.others]:
            self._stop(p)

    # -- reads ------------------------------------------------------------------------------
    def slots(self, i: int, timeout_s: float = 3.0) -> dict | None:
        try:
            r = httpx.get(self.url(i) + "/admin/slots", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=timeout_s)
            return r.json() if r.status_code == 200 else None
        except httpx.HTTPError:
            return None

    def serving(self) -> list[tuple | None]:
        out = []
        for i in range(len(self.ports)):
            s = self.slots(i)
            out.append(None if s is None else (s["stable"]["version"], (s["candidate"] or {}).get("version"),
                                               s["candidate_weight"]))
        return out

    def complete(self, client: httpx.Client, user: str) -> tuple[str, str, str]:
        """One completion through the Service: ``(served by, model version, completion id)``."""
        r = client.post(self.lb + "/v1/completions", headers={"x-flywheel-user": user},
                        json={"model": "flywheel", "prompt": [5, 6, 7], "max_tokens": 2})
        r.raise_for_status()
        return r.headers["x-served-by"], r.headers["x-flywheel-model-version"], r.headers["x-flywheel-completion-id"]

    def vote(self, client: httpx.Client, cid: str, value: int, event_id: str | None = None) -> str:
        eid = event_id or str(uuid.uuid4())
        r = client.post(self.lb + "/v1/feedback", json={"completion_id": cid, "value": value, "event_id": eid})
        r.raise_for_status()
        return eid


def arm_disagreement(served: list[tuple[str, str, str]], users: list[str]) -> float:
    """Share of users served by different versions on different pods (``served[i]`` is user
    ``users[i]``'s ``(pod, version, completion id)``)."""
    by_user: dict[str, set[str]] = {}
    for u, (_, v, _) in zip(users, served):
        by_user.setdefault(u, set()).add(v)
    return sum(len(vs) > 1 for vs in by_user.values()) / max(1, len(by_user))
