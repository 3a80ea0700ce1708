"""Serving pods found by DNS (a headless Service): the DNS answer is faked through the injected
resolver; the pods are real admin servers on two loopback addresses sharing one port, as
pods behind a Service share their container port."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import uvicorn

from deploy.analysis import AnalysisConfig
from deploy.controller import ControllerConfig, RolloutController, RolloutPhase
from deploy.discovery import PodDiscovery, is_dns, resolve
from deploy.serving_client import ServingAdmin, ServingAdminError
from modelstore.store import ModelStore
from test_deploy_controller import TOKEN, Clock, make_admin_app, publish_v, write_votes

NAME = "flywheel-serving-pods.flywheel.svc.cluster.local"


class FakeDNS:
    """``socket.getaddrinfo``'s signature; answers ``records[name]`` (a list of IPs)."""

    def __init__(self, records: dict[str, list[str]]):
        self.records, self.asked = records, []

    def __call__(self, host, port, family=0, type=0, proto=0, flags=0):
        self.asked.append((host, port, type))
        if host not in self.records:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        out = []
        for ip in self.records[host]:
            fam = socket.AF_INET6 if ":" in ip else socket.AF_INET
            addr = (ip, port, 0, 0) if fam == socket.AF_INET6 else (ip, port)
            out.append((fam, socket.SOCK_STREAM, 6, "", addr))
            out.append((fam, socket.SOCK_STREAM, 6, "", addr))  # getaddrinfo repeats per protocol
        return out


def test_resolve_specs():
    dns = FakeDNS({NAME: ["10.0.0.7", "10.0.0.5", "fd00::1"]})
    assert resolve(f"dns+http://{NAME}:8000", dns) == [
        "http://10.0.0.5:8000", "http://10.0.0.7:8000", "http://[fd00::1]:8000"]
    assert dns.asked == [(NAME, 8000, socket.SOCK_STREAM)]
    assert resolve("http://pod-a:8000/", dns) == ["http://pod-a:8000"] and is_dns("dns+https://x:1")
    for bad in ("dns+http://noport", "dns+ftp://x:1", "dns+http://x:1/admin"):
        with pytest.raises(ValueError, match="^serving:"):
            resolve(bad, dns)
    with pytest.raises(ServingAdminError, match="DNS lookup of nowhere.svc failed") as ei:
        resolve("dns+http://nowhere.svc:8000", dns)
    assert ei.value.transport
    with pytest.raises(ServingAdminError, match="no address"):
        resolve(f"dns+http://{NAME}:8000", lambda *a, **k: [])


def test_pod_discovery_follows_the_answer_and_keeps_clients():
    dns = FakeDNS({NAME: ["10.0.0.1", "10.0.0.2"]})
    made = []
    disc = PodDiscovery([f"dns+http://{NAME}:9000", "http://static:1"],
                        lambda u: made.append(u) or ServingAdmin(u, timeout_s=1), dns)
    a = disc()
    assert [x.base_url for x in a] == ["http://10.0.0.1:9000", "http://10.0.0.2:9000", "http://static:1"]
    dns.records[NAME] = ["10.0.0.2", "10.0.0.3"]  # pod 1 left, pod 3 came
    b = disc()
    assert [x.base_url for x in b] == ["http://10.0.0.2:9000", "http://10.0.0.3:9000", "http://static:1"]
    assert b[0] is a[1] and b[2] is a[2]  # unchanged pods keep their client
    assert made == ["http://10.0.0.1:9000", "http://10.0.0.2:9000", "http://static:1", "http://10.0.0.3:9000"]
    assert disc.dynamic and not PodDiscovery(["http://x:1"], ServingAdmin).dynamic
    with pytest.raises(ValueError, match="^serving:"):
        PodDiscovery([], ServingAdmin)


def _serve_on(store: ModelStore, host: str, port: int):
    server = uvicorn.Server(uvicorn.Config(make_admin_app(store), host=host, port=port, log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, f"admin server on {host}:{port} did not start"

    def stop():
        server.should_exit = True
        th.join(10)
    return stop


@pytest.mark.timeout(120)
def test_controller_finds_pods_by_dns_and_promotes_on_all(tmp_path, tiny_moe_dir, fw_home):
    store = ModelStore(tmp_path / "store")
    store.init_base(tiny_moe_dir)
    m1 = publish_v(store, "v000000")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stops = [_serve_on(ModelStore(store.root), ip, port) for ip in ("127.0.0.1", "127.0.0.2")]
    dns = FakeDNS({NAME: ["127.0.0.1"]})  # pod 2 not ready yet
    disc = PodDiscovery([f"dns+http://{NAME}:{port}"], lambda u: ServingAdmin(u, TOKEN, timeout_s=30), dns)
    samples, clock = tmp_path / "samples", Clock()
    try:
        ctl = RolloutController(store, [], samples, fw_home / "ledger.duckdb", fw_home / "rollout.json",
                                ControllerConfig(steps=(0.5, 1.0), analysis=AnalysisConfig(min_votes=5)),
                                clock=clock, arm_metrics=False, discover=disc)
        st = ctl.reconcile()
        assert st.phase == RolloutPhase.CANARY and [a.base_url for a in ctl.admins] == [f"http://127.0.0.1:{port}"]
        dns.records[NAME] = ["127.0.0.1", "127.0.0.2"]  # pod 2 became ready: the next step sees it
        write_votes(samples, "v000001", 40, 0, clock.t)
        write_votes(samples, "v000000", 20, 20, clock.t)
        st = ctl.reconcile()
        assert len(ctl.admins) == 2
        assert st.phase == RolloutPhase.PROMOTED, st.last_reason
        for a in ctl.admins:  # both pods serve the promoted version, same weights
            s = a.slots()
            assert s.stable.version == "v000001" and s.stable.weights_digest == m1.weights_digest
        dns.records[NAME] = []  # no ready pod: the step holds with the reason, nothing changes
        with pytest.raises(ServingAdminError, match="no address"):
            ctl.reconcile()
        assert ctl.status.phase == RolloutPhase.PROMOTED
    finally:
        for stop in stops:
            stop()


def test_cli_refuses_a_malformed_dns_spec(fw_home, monkeypatch, tmp_path):
    """`flywheel controller --serving dns+http://name` (no port) is a usage error naming --serving's value."""
    from typer.testing import CliRunner

    import flywheel.cli as cli

    monkeypatch.setenv("FLYWHEEL_STORE", str(tmp_path / "store"))
    r = CliRunner().invoke(cli.app, ["controller", "--once", "--serving", "dns+http://flywheel-serving-pods"])
    assert r.exit_code == 2, r.output
    assert "dns+http(s)://name:port" in " ".join(r.output.split())


class _Pod:
    """A pod's /metrics as the scrape provider reads it (real prometheus_client text)."""

    def __init__(self, url: str):
        from test_deploy_metrics import PerVersionServing

        self.base_url, self.serving = url, PerVersionServing()

    def metrics_text(self) -> str:
        return self.serving.text()


def test_scrape_baselines_are_per_pod_when_pods_come_and_go(tmp_path):
    """A pod found after the canary started counts from its first scrape (its history is not
    the canary's); a pod that left stops counting."""
    from deploy.controller import RolloutStatus
    from deploy.metrics import ServingMetricsSource

    a, b = _Pod("http://10.0.0.1:8000"), _Pod("http://10.0.0.2:8000")
    a.serving.serve("v000000", 30, 0.2)  # before the canary
    b.serving.serve("v000000", 100, 0.2)  # pod b's earlier life, also before it
    b.serving.serve("v000001", 50, 0.2, status="500")
    src = ServingMetricsSource([a], tmp_path / "metrics_baseline.json")
    st = RolloutStatus(candidate="v000001", stable="v000000", canary_started_ms=1_800_000_000_000)
    src.mark(st)
    a.serving.serve("v000001", 10, 0.2)
    a.serving.serve("v000000", 10, 0.2)
    src.admins = [a, b]  # b became ready (the controller's discover())
    c, s, _ = src(st)
    assert (c["requests"], c["errors"], s["requests"]) == (10, 0, 10)  # none of b's history
    b.serving.serve("v000001", 5, 0.2, status="500")
    c, s, _ = ServingMetricsSource([a, b], tmp_path / "metrics_baseline.json")(st)  # a restarted controller
    assert (c["requests"], c["errors"]) == (15, 5)
    src.admins = [b]  # a left
    c, s, _ = src(st)
    assert (c["requests"], c["errors"], s["requests"]) == (5, 5, 0)
