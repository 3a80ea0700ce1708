"""The controller's own Prometheus metrics (``deploy.metrics.ControllerMetrics``) read over
real HTTP after a real analysis; the metric provider's argument and query errors."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deploy.analysis import AnalysisConfig, ArmStats, analyze
from deploy.controller import ControllerConfig, RolloutPhase, RolloutStatus
from deploy.metrics import (ControllerMetrics, PrometheusMetricsSource, PrometheusQueryError,
                            ServingMetricsSource, metric_provider)
from schemas.settings import free_port


def scrape(url: str) -> dict:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url, timeout=5).text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_controller_metrics_follow_status_and_decisions():
    c = ArmStats(votes_up=30, votes_down=10, errors=4, requests=100, p99_ms=250.0, tokens_per_s=40.0)
    s = ArmStats(votes_up=25, votes_down=15, errors=1, requests=100, p99_ms=200.0, tokens_per_s=50.0)
    d = analyze(c, s, AnalysisConfig(min_votes=5, min_requests=10))
    m = ControllerMetrics(ControllerConfig(steps=(0.25, 1.0), step_deadline_s=1800))
    st = RolloutStatus(phase=RolloutPhase.CANARY, candidate="v000002", stable="v000001", step=0, weight=0.25,
                       canary_started_ms=1_700_000_000_000, step_started_ms=1_700_000_060_000)
    port = free_port()
    srv = m.serve(port, addr="127.0.0.1")
    try:
        m.decision("START", st, {})
        m.decision("HOLD", st, d.numbers())
        m.status(st)
        x = scrape(f"http://127.0.0.1:{port}/metrics")
        arm = lambda name, a: x[(name, (("arm", a),))]  # noqa: E731
        assert x[("flywheel_canary_votes", (("arm", "candidate"), ("vote", "up")))] == 30
        assert x[("flywheel_canary_votes", (("arm", "stable"), ("vote", "down")))] == 15
        assert arm("flywheel_canary_thumbs_up_rate", "candidate") == pytest.approx(30 / 40)
        assert arm("flywheel_canary_thumbs_up_rate", "stable") == pytest.approx(25 / 40)
        assert arm("flywheel_canary_error_rate", "candidate") == pytest.approx(0.04)
        assert arm("flywheel_canary_error_rate", "stable") == pytest.approx(0.01)
        assert arm("flywheel_canary_p99_latency_seconds", "candidate") == pytest.approx(0.25)
        assert arm("flywheel_canary_tokens_per_second", "stable") == pytest.approx(50.0)
        th = d.numbers()["thumbs_up"]
        assert x[("flywheel_canary_thumbs_up_diff_bound", (("bound", "lower"),))] == pytest.approx(th["ci_lo"])
        assert x[("flywheel_canary_thumbs_up_diff_bound", (("bound", "upper"),))] == pytest.approx(th["ci_hi"])
        assert x[("flywheel_canary_check", (("check", th["check"]), ("metric", "thumbs_up")))] == 1
        assert x[("flywheel_controller_decisions_total", (("decision", "HOLD"),))] == 1
        assert x[("flywheel_controller_decisions_total", (("decision", "ROLLBACK"),))] == 0
        assert x[("flywheel_canary_phase", (("phase", "canary"),))] == 1
        assert x[("flywheel_canary_phase", (("phase", "idle"),))] == 0
        assert (x[("flywheel_canary_step", ())], x[("flywheel_canary_weight", ())]) == (0, 0.25)
        assert x[("flywheel_canary_step_deadline_seconds", ())] == 1800
        assert x[("flywheel_canary_step_started_timestamp_seconds", ())] == 1_700_000_060
        assert x[("flywheel_canary_info", (("candidate", "v000002"), ("stable", "v000001")))] == 1
        m.status(RolloutStatus(phase=RolloutPhase.IDLE, stable="v000002"))
        m.reconcile_failed()
        x = scrape(f"http://127.0.0.1:{port}/metrics")
        assert (x[("flywheel_canary_step", ())], x[("flywheel_canary_weight", ())]) == (-1, 0)
        assert not [k for k in x if k[0] == "flywheel_canary_info"]
        assert x[("flywheel_controller_reconcile_errors_total", ())] == 1
        assert x[("flywheel_controller_last_reconcile_timestamp_seconds", ())] > 1_700_000_000
    finally:
        srv.shutdown()


def test_metric_provider_arguments_and_query_errors(tmp_path):
    assert isinstance(metric_provider("scrape", [], tmp_path / "b.json"), ServingMetricsSource)
    assert isinstance(metric_provider("prometheus", prometheus_url="http://p:9090"), PrometheusMetricsSource)
    with pytest.raises(ValueError, match="metrics provider: must be 'scrape' or 'prometheus'"):
        metric_provider("datadog")
    with pytest.raises(ValueError, match="prometheus_url: required"):
        metric_provider("prometheus")
    with pytest.raises(ValueError, match="url: must start with http"):
        PrometheusMetricsSource("prometheus:9090")
    with pytest.raises(ValueError, match="selector: label matchers without braces"):
        PrometheusMetricsSource("http://p:9090", selector='{job="x"}')
    src = PrometheusMetricsSource(f"http://127.0.0.1:{free_port()}", selector='job="flywheel-serving"', timeout_s=2)
    assert src.delta("x_total", 1000, 61_000) == ('((x_total{job="flywheel-serving"} - x_total{job="flywheel-serving"} '
                                                  'offset 60000ms) >= 0 or x_total{job="flywheel-serving"})')
    st = RolloutStatus(phase=RolloutPhase.CANARY, candidate="v000001", stable="v000000", canary_started_ms=0)
    with pytest.raises(PrometheusQueryError, match="flywheel_version_requests_total"):
        src(st)  # nothing listens there: the error names the URL and the query


def test_controller_cli_refuses_a_bad_metric_provider(fw_home):
    from typer.testing import CliRunner

    from flywheel.cli import app

    r = CliRunner().invoke(app, ["controller", "--once", "--metrics-provider", "prometheus"])
    assert r.exit_code == 2 and "--prometheus-url" in r.output and "required" in r.output, r.output
    r = CliRunner().invoke(app, ["controller", "--once", "--metrics-provider", "datadog",
                                 "--prometheus-url", "http://p:9090"])
    assert r.exit_code == 2 and "'scrape' or 'prometheus'" in r.output and "datadog" in r.output, r.output


def test_controller_metrics_show_the_reward_test():
    # 40 rewarded samples per arm: candidate rewards sum 12 (mean 0.3), stable sum 8 (mean 0.2)
    c = ArmStats(votes_up=3, votes_down=1, requests=100, rewarded=40, reward_sum=12.0, reward_sq_sum=20.0,
                 reward_min=-1.0, reward_max=1.0, reward_policy="0123456789abcdef")
    s = ArmStats(votes_up=2, votes_down=2, requests=100, rewarded=40, reward_sum=8.0, reward_sq_sum=20.0,
                 reward_min=-1.0, reward_max=1.0, reward_policy="0123456789abcdef")
    d = analyze(c, s, AnalysisConfig(min_votes=5, min_requests=10, reward_clip=1.0))
    rw = d.numbers()["reward"]
    m = ControllerMetrics()
    port = free_port()
    srv = m.serve(port, addr="127.0.0.1")
    try:
        m.decision("HOLD", RolloutStatus(phase=RolloutPhase.CANARY, candidate="v000002", stable="v000001"),
                   d.numbers())
        x = scrape(f"http://127.0.0.1:{port}/metrics")
        assert x[("flywheel_canary_reward_mean", (("arm", "candidate"),))] == pytest.approx(12.0 / 40)
        assert x[("flywheel_canary_reward_mean", (("arm", "stable"),))] == pytest.approx(8.0 / 40)
        assert x[("flywheel_canary_rewarded_samples", (("arm", "candidate"),))] == 40
        assert x[("flywheel_canary_reward_diff_bound", (("bound", "lower"),))] == pytest.approx(rw["ci_lo"])
        assert x[("flywheel_canary_reward_diff_bound", (("bound", "upper"),))] == pytest.approx(rw["ci_hi"])
        assert rw["ci_lo"] < 0.5 < rw["ci_hi"]  # the relative difference 0.3 / 0.2 - 1 = 0.5 lies inside
    finally:
        srv.shutdown()
