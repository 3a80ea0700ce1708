"""A real Prometheus server (Debian's ``prometheus``, its own process on a free port, a temp
config loading deploy/prometheus/*.yml) scrapes real pods: a ``flywheel serve`` subprocess
on the tiny MoE, an ingest worker subprocess (``--worker-port``) and the controller's own
``/metrics``. Then, on the same pods and the same canary window, the two canary metric
providers agree: ``scrape`` (the controller reads every pod's /metrics) and ``prometheus``
(PromQL deltas since the canary's start, ``histogram_quantile``): same requests and error rate, the same
p99 (the same bucket of the latency histogram, and the same interpolation), the same tokens/s;
and a controller configured with the prometheus provider decides on those numbers. A cheaper
test (no model) checks that both providers and the recording rule give tokens/s as the decode
rate, the same for short and long replies at the same speed per token."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from deploy import ledger
from deploy.analysis import AnalysisConfig
from deploy.controller import ControllerConfig, RolloutController, RolloutPhase, RolloutStatus
from deploy.metrics import PrometheusMetricsSource, PrometheusQueryError, ServingMetricsSource
from deploy.serving_client import ServingAdmin
from modelstore.store import ModelStore
from schemas.settings import free_port
from tests.test_deploy_controller import publish_v
from flywheel.supervise import die_with_parent

ROOT = Path(__file__).resolve().parents[1]
PROMETHEUS = "/usr/bin/prometheus"
TOKEN = "admin-t"
pytestmark = pytest.mark.skipif(not Path(PROMETHEUS).exists(), reason="Debian package prometheus not installed "
                                "(apt-get install -y prometheus; .ci/run installs it)")


def wait_for(cond, timeout_s: float, what: str, procs=()):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for name, p, log in procs:
            if p.poll() is not None:
                raise AssertionError(f"{name} exited {p.returncode}: {Path(log).read_text()[-3000:]}")
        try:
            got = cond()
        except (httpx.HTTPError, PrometheusQueryError, KeyError):
            got = None
        if got:
            return got
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def spawn(args, env, log: Path) -> subprocess.Popen:
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=die_with_parent())


def stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


class FailingPod:
    """A second pod's exporter shaped like serving's per-version families (prometheus_client on
    its own port) whose requests fail as told: serving has no fault injection, and the two
    providers must also agree on an error rate that is not 0."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

        from serving.http.metrics import VERSION_LAT_BUCKETS

        r = CollectorRegistry()
        self.req = Counter("flywheel_version_requests", "routed", ["version"], registry=r)
        self.err = Counter("flywheel_version_errors", "failed", ["version"], registry=r)
        self.lat = Histogram("flywheel_version_latency_seconds", "engine s", ["version"], buckets=VERSION_LAT_BUCKETS,
                             registry=r)
        self.tok = Counter("flywheel_version_tokens", "generated", ["version"], registry=r)
        self.dec_tok = Counter("flywheel_version_decode_tokens", "after the first", ["version"], registry=r)
        self.dec_s = Counter("flywheel_version_decode_seconds", "after the first token", ["version"], registry=r)
        for v in ("v000000", "v000001"):  # exported at 0 before the canary, as serving's are
            for m in (self.req, self.err, self.lat, self.tok, self.dec_tok, self.dec_s):
                m.labels(v)
        self.port = free_port()
        self.server = start_http_server(self.port, addr="127.0.0.1", registry=r)[0]
        self.base_url = f"http://127.0.0.1:{self.port}"

    def metrics_text(self) -> str:
        return httpx.get(self.base_url + "/metrics", timeout=5).text

    def serve(self, version: str, n: int, errors: int, latency_s: float) -> None:
        for i in range(n):
            self.req.labels(version).inc()
            if i < errors:
                self.err.labels(version).inc()
            else:
                self.lat.labels(version).observe(latency_s)
                self.tok.labels(version).inc(6)
                self.dec_tok.labels(version).inc(5)  # the first token at half the latency
                self.dec_s.labels(version).inc(latency_s / 2)


class MetricsPod:
    """A pod's real :class:`serving.http.metrics.ServingMetrics` (``tests.test_deploy_metrics.ServingPod``)
    served over HTTP by prometheus_client on its own port, without a model."""

    def __init__(self):
        from prometheus_client import start_http_server

        from tests.test_deploy_metrics import ServingPod

        self.pod = ServingPod()
        self.port = free_port()
        self.server = start_http_server(self.port, addr="127.0.0.1", registry=self.pod.m.registry)[0]
        self.base_url = f"http://127.0.0.1:{self.port}"

    def metrics_text(self) -> str:
        return httpx.get(self.base_url + "/metrics", timeout=5).text


def prometheus_config(path: Path, jobs: dict[str, list[int]]) -> Path:
    lines = ["global:", "  scrape_interval: 1s", "  scrape_timeout: 1s", "  evaluation_interval: 1s",
             "rule_files:"]
    lines += [f"  - {ROOT / 'deploy' / 'prometheus' / f}" for f in ("recording_rules.yml", "alert_rules.yml")]
    lines.append("scrape_configs:")
    for job, port in jobs.items():  # port: the job's ports
        targets = ", ".join(f"'127.0.0.1:{p}'" for p in port)
        lines += [f"  - job_name: {job}", "    static_configs:", f"      - targets: [{targets}]"]
    path.write_text("\n".join(lines) + "\n")
    return path


def bucket_index(v: float) -> int:
    """Index of serving's version-latency bucket holding ``v`` seconds (0.01 * 1.25**i)."""
    return max(math.ceil(math.log(v / 0.01) / math.log(1.25) - 1e-9), 0)


@pytest.mark.timeout(300)
def test_prometheus_scrapes_real_pods_and_both_providers_agree(tiny_moe_dir, broker, fw_home, tmp_path):
    ports = {"flywheel-serving": free_port(), "flywheel-ingest": free_port(), "flywheel-controller": free_port()}
    prom_port = free_port()
    env = dict(os.environ, FLYWHEEL_HOME=str(fw_home), FLYWHEEL_MODEL_DIR=str(tiny_moe_dir),
               FLYWHEEL_KAFKA_BOOTSTRAP=broker.bootstrap, FLYWHEEL_ADMIN_TOKEN=TOKEN)
    store_root = tmp_path / "store"
    logs = {k: tmp_path / f"{k}.log" for k in ("serve", "ingest", "prometheus")}
    procs = []
    try:
        serve = spawn([sys.executable, "-m", "flywheel.cli", "serve", "--port", str(ports["flywheel-serving"]),
                       "--store", str(store_root), "--pod", "pod-a", "--max-batch", "4"], env, logs["serve"])
        procs.append(("serve", serve, logs["serve"]))
        ingest = spawn([sys.executable, "-m", "ingest", "--tick-s", "0.5", "--seal-after-s", "2",
                        "--worker-port", str(ports["flywheel-ingest"])], env, logs["ingest"])
        procs.append(("ingest", ingest, logs["ingest"]))
        failing = FailingPod()
        cfg = prometheus_config(tmp_path / "prometheus.yml", {**{j: [p] for j, p in ports.items()},
                                                              "flywheel-serving": [ports["flywheel-serving"],
                                                                                   failing.port]})
        prom = spawn([PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                      f"--web.listen-address=127.0.0.1:{prom_port}"], env, logs["prometheus"])
        procs.append(("prometheus", prom, logs["prometheus"]))
        serving_url = f"http://127.0.0.1:{ports['flywheel-serving']}"
        prom_url = f"http://127.0.0.1:{prom_port}"
        wait_for(lambda: httpx.get(serving_url + "/healthz", timeout=1).status_code == 200, 120, "serving", procs)
        wait_for(lambda: httpx.get(prom_url + "/-/ready", timeout=1).status_code == 200, 60, "prometheus", procs)

        store = ModelStore(store_root)  # serve initialised v000000 from the model dir
        publish_v(store, "v000000")
        admin = ServingAdmin(serving_url, TOKEN)
        ctl = RolloutController(store, [admin], tmp_path / "samples", fw_home / "ledger.duckdb",
                                fw_home / "deploy" / "rollout.json",
                                ControllerConfig(steps=(0.5, 1.0), analysis=AnalysisConfig(min_votes=5)),
                                arm_metrics=PrometheusMetricsSource(prom_url))
        exported = ctl.exported.serve(ports["flywheel-controller"], addr="127.0.0.1")
        st = ctl.reconcile()
        assert st.phase == RolloutPhase.CANARY and st.candidate == "v000001", st.last_reason

        def complete(model: str) -> None:
            r = httpx.post(serving_url + "/v1/completions", timeout=60,
                           json={"model": model, "prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 1.0})
            assert r.status_code == 200, r.text
            assert r.headers["x-flywheel-model-version"] == model

        # a version's series exist from its first request: one each, seen by Prometheus,
        # before the window both providers measure opens
        complete("v000000")
        complete("v000001")
        q = PrometheusMetricsSource(prom_url)
        wait_for(lambda: sorted(v for _, v in q.query("flywheel_version_latency_seconds_count")) == [0, 0, 1, 1],
                 30, "both versions' first request in Prometheus")
        scrape = ServingMetricsSource([admin, failing], tmp_path / "baseline.json")
        window = RolloutStatus(phase=RolloutPhase.CANARY, candidate="v000001", stable="v000000", step=0,
                               weight=0.5, canary_started_ms=int(time.time() * 1000))
        scrape.mark(window)
        time.sleep(2.5)  # a scrape inside the window, before the traffic
        n = {"v000000": 24, "v000001": 16}
        for v, k in n.items():
            for _ in range(k):
                complete(v)
        failing.serve("v000000", 20, 1, 0.05)
        failing.serve("v000001", 20, 5, 0.3)
        for name, total in (("flywheel_version_requests_total", {"v000000": 45, "v000001": 37}),
                            ("flywheel_version_latency_seconds_count", {"v000000": 44, "v000001": 32})):
            wait_for(lambda: {lab["version"]: v for lab, v in q.query(f"sum by (version) ({name})")} == total, 30,
                     f"Prometheus to scrape the last requests' {name}")

        c_s, s_s, skipped_s = scrape(window)
        c_p, s_p, skipped_p = PrometheusMetricsSource(prom_url)(window)
        assert skipped_s == {} and skipped_p == {}
        assert (c_s["requests"], c_s["errors"], s_s["requests"], s_s["errors"]) == (36, 5, 44, 1)
        # PromQL over the same counters from the canary's start: the same figures; the p99
        # interpolates inside the same bucket of serving's geometric histogram (25 % apart)
        for a, b in ((c_s, c_p), (s_s, s_p)):
            assert (b["requests"], b["errors"], b["latency_samples"]) == (a["requests"], a["errors"],
                                                                          a["latency_samples"]), (a, b)
            assert b["errors"] / b["requests"] == a["errors"] / a["requests"]
            assert a["p99_ms"] > 0 and bucket_index(a["p99_ms"] / 1000) == bucket_index(b["p99_ms"] / 1000), (a, b)
            assert b["p99_ms"] == pytest.approx(a["p99_ms"], rel=1e-6)
            assert b["tokens_per_s"] == pytest.approx(a["tokens_per_s"], rel=1e-6)

        # the controller reads its canary metrics from Prometheus: too few votes, HOLD, with
        # the latency figures of PromQL in the ledger
        c_ctl, _, _ = PrometheusMetricsSource(prom_url)(ctl.status)  # its window: since START
        ctl.reconcile()
        last = ledger.decisions(fw_home / "ledger.duckdb")[-1]
        assert last.decision in ("HOLD", "ROLLBACK"), last.reason
        assert last.numbers["p99_latency"]["candidate"] == pytest.approx(c_ctl["p99_ms"]), last.numbers
        assert c_ctl["requests"] == 37  # the warm-up request was after START
        assert last.numbers["error_rate"]["candidate_rate"] == pytest.approx(5 / 37), last.numbers

        # every target is up; the rules loaded and evaluate
        targets = httpx.get(prom_url + "/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
        assert len(targets) == 4 and all(t["health"] == "up" for t in targets), targets
        assert {t["labels"]["job"] for t in targets} == set(ports)
        groups = httpx.get(prom_url + "/api/v1/rules", timeout=5).json()["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        assert len(rules) >= 30 and all(r["health"] == "ok" for r in rules), [r for r in rules if r["health"] != "ok"]
        got = wait_for(lambda: q.query("flywheel:version_requests:rate5m"), 20, "a recording rule's series")
        assert {lab["version"] for lab, _ in got} == {"v000000", "v000001"}
        # the ingest worker consumed the completions serving logged; the controller's phase
        wait_for(lambda: sum(v for _, v in q.query('flywheel_ingest_records_consumed_total{topic=~".*completions"}'))
                 >= 42, 60, "ingest to consume the 42 completions", procs)
        assert q.query('flywheel_canary_phase{phase="canary"}')[0][1] == 1.0
        assert q.query("flywheel_canary_weight")[0][1] == 0.5
        # the controller's HOLD reaches Prometheus at its next scrape (1 s interval)
        wait_for(lambda: [v for _, v in q.query('flywheel_controller_decisions_total{decision="HOLD"}') if v >= 1],
                 30, "the controller's HOLD in Prometheus")
        with pytest.raises(PrometheusQueryError, match="bad_data.*sum\\("):  # Prometheus's own error, and the query
            q.query("sum(")
    finally:
        for _, p, _ in reversed(procs):
            stop(p)
        for srv in (getattr(locals().get("failing"), "server", None), locals().get("exported")):
            if srv is not None:
                srv.shutdown()


@pytest.mark.timeout(120)
def test_prometheus_tokens_per_s_is_the_decode_rate_whatever_the_reply_length(tmp_path):
    """The live run's false rollback, through a real Prometheus: a candidate answering in 5
    tokens and stable in 40, both 20 ms a token after a 200 ms first token. The prometheus
    provider (PromQL deltas of the decode counters) and the scrape provider both give 50
    tokens/s to each arm (by hand: 4 / 0.08 s and 39 / 0.78 s), ratio 1.0; so does the
    recording rule flywheel:version_tokens_per_second:rate5m."""
    pod = MetricsPod()
    prom_port = free_port()
    prom_url = f"http://127.0.0.1:{prom_port}"
    cfg = prometheus_config(tmp_path / "prometheus.yml", {"flywheel-serving": [pod.port]})
    log = tmp_path / "prometheus.log"
    prom = spawn([PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                  f"--web.listen-address=127.0.0.1:{prom_port}"], dict(os.environ), log)
    procs = [("prometheus", prom, log)]
    try:
        wait_for(lambda: httpx.get(prom_url + "/-/ready", timeout=1).status_code == 200, 60, "prometheus", procs)
        q = PrometheusMetricsSource(prom_url)
        for v, n in (("v000001", 5), ("v000000", 40)):  # each version's series exist before the window
            pod.pod.complete(v, n, 200.0, 20.0, queue_ms=50.0)
        wait_for(lambda: sorted(v for _, v in q.query("flywheel_version_decode_tokens_total")) == [4, 39], 30,
                 "the first requests in Prometheus", procs)
        window = RolloutStatus(phase=RolloutPhase.CANARY, candidate="v000001", stable="v000000", step=0,
                               weight=0.5, canary_started_ms=int(time.time() * 1000))
        scrape = ServingMetricsSource([pod], tmp_path / "baseline.json")
        scrape.mark(window)
        time.sleep(2.5)  # a scrape inside the window, before the traffic
        for _ in range(10):
            pod.pod.complete("v000001", 5, 200.0, 20.0, queue_ms=50.0)
            pod.pod.complete("v000000", 40, 200.0, 20.0, queue_ms=50.0)
        wait_for(lambda: sorted(v for _, v in q.query("flywheel_version_decode_tokens_total")) == [44, 429], 30,
                 "the window's requests in Prometheus", procs)
        c_p, s_p, skipped_p = PrometheusMetricsSource(prom_url)(window)
        c_s, s_s, skipped_s = scrape(window)
        assert skipped_p == {} and skipped_s == {}
        for f in (c_p, s_p, c_s, s_s):
            assert f["tokens_per_s"] == pytest.approx(50.0), (c_p, s_p, c_s, s_s)
        assert c_p["tokens_per_s"] / s_p["tokens_per_s"] == pytest.approx(1.0)
        # tokens over engine seconds in the same window (by hand 50 / 2.3 s vs 400 / 9.3 s) would fail 0.67
        since = q.delta("flywheel_version_tokens_total", window.canary_started_ms, q.clock())
        toks = q.query(f"sum by (version) ({since})")
        assert {lab["version"]: v for lab, v in toks} == {"v000001": 50.0, "v000000": 400.0}
        assert (50 / 2.3) / (400 / 9.3) < 0.67
        def rule() -> dict[str, float] | None:  # NaN (0 / 0) until the burst is in the 5 min window
            got = {lab["version"]: v for lab, v in q.query("flywheel:version_tokens_per_second:rate5m")}
            return got if len(got) == 2 and all(math.isfinite(v) for v in got.values()) else None

        got = wait_for(rule, 30, "the recording rule over the window's requests", procs)
        assert got == {"v000001": pytest.approx(50.0), "v000000": pytest.approx(50.0)}
    finally:
        stop(prom)
        pod.server.shutdown()
