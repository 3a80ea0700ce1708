"""Canary metrics from serving's Prometheus ``/metrics``: parsing real prometheus_client
output, deltas since the canary's baseline, p99 by bucket interpolation (checked by hand),
skip-with-reason for metrics serving does not export per version, and the controller acting
on them over real HTTP."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from deploy import ledger
from deploy.controller import RolloutPhase
from deploy.metrics import arm_metrics, delta, histogram_quantile, merge, parse
from serving.http.metrics import VERSION_LAT_BUCKETS
from tests.test_deploy_controller import Clock, controller, env, publish_v, write_votes  # noqa: F401

LAT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)  # serving's buckets


class PerVersionServing:
    """Registry shaped like serving's, with a ``version`` label on requests/latency/tokens."""

    def __init__(self, per_version: bool = True):
        self.r = r = CollectorRegistry()
        v = ["version"] if per_version else []
        self.requests = Counter("flywheel_requests", "HTTP requests", ["endpoint", "status", *v], registry=r)
        self.latency = Histogram("flywheel_version_latency_seconds", "engine latency", v,
                                 buckets=LAT_BUCKETS, registry=r)
        self.tps = Histogram("flywheel_decode_tokens_per_second", "tokens/s", v,
                             buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000), registry=r)
        self.version_requests = Counter("flywheel_version_requests", "completions by version", ["version"], registry=r)
        self.per_version = per_version

    def serve(self, version: str, n: int, latency_s: float, tokens_per_s: float = 50.0, status: str = "200"):
        for _ in range(n):
            lab = {"version": version} if self.per_version else {}
            self.requests.labels(endpoint="/v1/chat/completions", status=status, **lab).inc()
            if status == "200":
                (self.latency.labels(**lab) if lab else self.latency).observe(latency_s)
                (self.tps.labels(**lab) if lab else self.tps).observe(tokens_per_s)
                self.version_requests.labels(version).inc()

    def text(self) -> str:
        return generate_latest(self.r).decode()


def test_histogram_quantile_by_hand():
    # 10 in (0, 1], 10 in (1, 2]: p50 -> rank 10 -> le 1; p75 -> rank 15 -> 1 + 1 * 5/10
    b = [(1.0, 10.0), (2.0, 20.0), (float("inf"), 20.0)]
    assert histogram_quantile(0.5, b) == pytest.approx(1.0)
    assert histogram_quantile(0.75, b) == pytest.approx(1.5)
    assert histogram_quantile(0.99, [(1.0, 0.0), (float("inf"), 4.0)]) == 1.0  # +Inf: highest finite bound
    assert histogram_quantile(0.99, [(1.0, 0.0), (float("inf"), 0.0)]) is None


def test_errors_latency_tokens_per_version_since_baseline():
    s = PerVersionServing()
    s.serve("v000000", 30, 5.0)  # before the canary: must not count
    base = parse(s.text())
    s.serve("v000000", 40, 0.2, tokens_per_s=60.0)
    s.serve("v000001", 35, 0.2, tokens_per_s=30.0)
    s.serve("v000001", 5, 0.2, status="500")
    d = delta(merge([parse(s.text())]), base)
    c, skipped = arm_metrics(d, "v000001")
    st, _ = arm_metrics(d, "v000000")
    assert skipped == {}
    assert (c["requests"], c["errors"]) == (40, 5) and (st["requests"], st["errors"]) == (40, 0)
    assert c["p99_ms"] == pytest.approx((0.1 + 0.15 * 0.99) * 1000)  # rank 0.99*35 in (0.1, 0.25]
    assert st["p99_ms"] == pytest.approx((0.1 + 0.15 * 0.99) * 1000)  # the 5 s before baseline are gone
    assert (c["tokens_per_s"], st["tokens_per_s"]) == (pytest.approx(30.0), pytest.approx(60.0))
    # a pod restart resets counters: the current value counts from zero
    assert delta({("x", ()): 3.0}, {("x", ()): 10.0}) == {("x", ()): 3.0}
    # two pods add up
    assert merge([{("x", ()): 1.0}, {("x", ()): 2.0}]) == {("x", ()): 3.0}


def test_current_serving_shape_skips_with_reasons_and_thumbs_decide(env):
    s = PerVersionServing(per_version=False)  # what serving/app.py exports today
    env.app.state.metrics_text = s.text()
    publish_v(env.store, "v000000")
    clock = Clock()
    controller(env, clock, steps=(0.5, 1.0), min_votes=5).reconcile()
    s.serve("v000000", 30, 0.2)
    s.serve("v000001", 30, 3.0)  # slow, but serving cannot say which version was slow
    env.app.state.metrics_text = s.text()
    write_votes(env.samples, "v000001", 30, 10, clock.t)
    write_votes(env.samples, "v000000", 30, 10, clock.t)
    clock.t += 1000
    st = controller(env, clock, steps=(0.5, 1.0), min_votes=5).reconcile()
    assert st.last_outcome == "PROMOTE", st.last_reason  # 50 % is the last analysed share
    nums = ledger.decisions(env.ledger)[-1].numbers
    for m in ("error_rate", "p99_latency", "tokens_per_s"):
        assert nums[m]["check"] == "SKIPPED" and "version label" in nums[m]["skipped"], nums[m]
    assert nums["thumbs_up"]["check"] == "PASS"


def test_slow_candidate_is_rolled_back_on_p99_from_metrics(env):
    s = PerVersionServing()
    s.serve("v000000", 30, 5.0)  # slow stable traffic before the canary (excluded by the baseline)
    env.app.state.metrics_text = s.text()
    publish_v(env.store, "v000000")
    clock = Clock()
    controller(env, clock, steps=(0.5, 1.0), min_votes=5).reconcile()
    s.serve("v000000", 40, 0.2)
    s.serve("v000001", 40, 2.0)
    env.app.state.metrics_text = s.text()
    write_votes(env.samples, "v000001", 6, 4, clock.t)
    write_votes(env.samples, "v000000", 6, 4, clock.t)
    clock.t += 1000
    st = controller(env, clock, steps=(0.5, 1.0), min_votes=5).reconcile()
    assert st.phase == RolloutPhase.ROLLED_BACK and "p99_latency" in st.last_reason, st.last_reason
    assert env.admin.slots().candidate is None
    p99 = ledger.decisions(env.ledger)[-1].numbers["p99_latency"]
    # candidate: 40 in (1, 2.5] -> 1 + 1.5 * 0.99 s; stable: 40 in (0.1, 0.25] -> 0.1 + 0.15 * 0.99 s
    assert p99["candidate"] == pytest.approx((1 + 1.5 * 0.99) * 1000)
    assert p99["stable"] == pytest.approx((0.1 + 0.15 * 0.99) * 1000)
    assert p99["ratio"] == pytest.approx(10.0) and p99["check"] == "FAIL"
    errs = ledger.decisions(env.ledger)[-1].numbers["error_rate"]
    assert (errs["candidate_requests"], errs["stable_requests"], errs["check"]) == (40, 40, "PASS")


def test_unreachable_metrics_hold_as_error(env):
    publish_v(env.store, "v000000")
    clock = Clock()
    controller(env, clock, steps=(0.5, 1.0), min_votes=5).reconcile()
    env.app.state.metrics_text = "this is { not prometheus"
    write_votes(env.samples, "v000001", 6, 4, clock.t)
    write_votes(env.samples, "v000000", 6, 4, clock.t)
    st = controller(env, clock, steps=(0.5, 1.0), min_votes=5).reconcile()
    assert st.last_outcome == "HOLD" and "HOLD (error)" in st.last_reason and "arm metrics" in st.last_reason


def test_serving_per_version_families_give_error_rate_p99_and_tokens_per_s():
    """A pod of an older release: version_errors, version_latency_ms (ms), version_tokens."""
    from deploy.metrics import arm_metrics, delta, parse

    def text(n_req, n_err, buckets, lat_sum_ms, toks):
        lines = [f'flywheel_version_requests_total{{version="v1"}} {n_req}',
                 f'flywheel_version_errors_total{{version="v1"}} {n_err}',
                 f'flywheel_version_tokens_total{{version="v1"}} {toks}',
                 f'flywheel_version_latency_ms_sum{{version="v1"}} {lat_sum_ms}',
                 f'flywheel_version_latency_ms_count{{version="v1"}} {n_req}']
        lines += [f'flywheel_version_latency_ms_bucket{{le="{le}",version="v1"}} {c}' for le, c in buckets]
        return "\n".join(["# TYPE flywheel_version_requests counter", "# TYPE flywheel_version_errors counter",
                          "# TYPE flywheel_version_tokens counter", "# TYPE flywheel_version_latency_ms histogram",
                          *lines]) + "\n"

    base = parse(text(10, 0, [("100.0", 10), ("1000.0", 10), ("+Inf", 10)], 500.0, 100))
    # since the baseline: 100 requests, 2 errors; 50 in (0,100] ms, 50 in (100,1000] ms
    now = parse(text(110, 2, [("100.0", 60), ("1000.0", 110), ("+Inf", 110)], 500.0 + 40_000.0, 100 + 8_000))
    fields, skipped = arm_metrics(delta(now, base), "v1")
    assert fields["requests"] == 100 and fields["errors"] == 2
    # p99: rank 99 of 100 lies in (100, 1000] at (99 - 50) / 50 of the way -> 100 + 900 * 0.98
    assert fields["p99_ms"] == pytest.approx(982.0)
    assert fields["tokens_per_s"] == pytest.approx(8_000 / 40.0)  # tokens / summed seconds
    assert "p99_latency" not in skipped and "tokens_per_s" not in skipped and "error_rate" not in skipped


def test_requests_in_flight_at_the_baseline_gate_latency_by_observations():
    """The quick demo's rollback of v000002: requests routed to the candidate before the
    canary's baseline finished after it, so the request counter's delta was 0 while the
    latency histogram held their (slow, contended) latencies. A p99 of 3 completions vs 1
    must not roll back: the gate counts the histogram's observations since the baseline."""
    from deploy.analysis import AnalysisConfig, ArmStats, Check, Outcome, analyze

    r = CollectorRegistry()
    req = Counter("flywheel_version_requests", "routed", ["version"], registry=r)
    lat = Histogram("flywheel_version_latency_seconds", "engine s", ["version"],
                    buckets=VERSION_LAT_BUCKETS, registry=r)  # serving's family
    tok = Counter("flywheel_version_tokens", "generated", ["version"], registry=r)
    req.labels("v000002").inc(3)  # routed to the candidate, still running ...
    req.labels("v000001").inc(1)
    base = parse(generate_latest(r).decode())  # ... when the canary takes its baseline
    for _ in range(3):
        lat.labels("v000002").observe(24.0)
        tok.labels("v000002").inc(64)
    lat.labels("v000001").observe(10.0)
    tok.labels("v000001").inc(64)
    d = delta(parse(generate_latest(r).decode()), base)
    c, _ = arm_metrics(d, "v000002")
    s, _ = arm_metrics(d, "v000001")
    assert (c["requests"], s["requests"]) == (0, 0)  # nothing routed since the baseline
    assert (c["latency_samples"], s["latency_samples"]) == (3, 1)  # but 3 and 1 finished
    assert c["tokens_per_s"] == pytest.approx(3 * 64 / 72.0)  # 192 tokens over 72 s
    cfg = AnalysisConfig(min_votes=2, min_requests=20, failure_limit=1)
    dec = analyze(ArmStats(**c), ArmStats(**s), cfg)
    m = {x.name: x for x in dec.metrics}
    assert m["p99_latency"].check == Check.INCONCLUSIVE and "3 vs 1 completions, need 20" in m["p99_latency"].reason
    assert m["tokens_per_s"].check == Check.INCONCLUSIVE
    assert dec.outcome == Outcome.HOLD
    # with enough completions on both arms the same latencies do fail (ratio 2.4 > 1.5)
    many = analyze(ArmStats(**{**c, "latency_samples": 20}), ArmStats(**{**s, "latency_samples": 20}), cfg)
    assert next(x for x in many.metrics if x.name == "p99_latency").check == Check.FAIL


class ServingPod:
    """One pod's real :class:`serving.http.metrics.ServingMetrics`, read as the scrape provider
    reads a pod (``base_url``, ``metrics_text()``)."""

    def __init__(self, base_url: str = "http://pod-a"):
        from serving.http.metrics import ServingMetrics

        self.base_url = base_url
        self.m = ServingMetrics("m", None, queue_depth=lambda: 0, running=lambda: 0, swap_pause_s=lambda: None)

    def complete(self, version: str, n_out: int, ttft_ms: float, ms_per_token: float, queue_ms: float = 0.0):
        """One completion of ``n_out`` tokens: first token after ``ttft_ms`` (queue wait
        included), then one every ``ms_per_token``."""
        from serving.params import GenResult

        self.m.version_requests.labels(version).inc()  # as serving's routing does
        self.m.version_errors.labels(version)
        self.m.observe(GenResult(completion_token_ids=list(range(n_out)), behavior_logprobs=[0.0] * n_out,
                                 top_logprobs=[], expert_routes=None, finish_reason="stop", ttft_ms=ttft_ms,
                                 latency_ms=ttft_ms + (n_out - 1) * ms_per_token, version=version,
                                 queue_ms=queue_ms), prompt_len=8)

    def metrics_text(self) -> str:
        return self.m.render()[0].decode()


def test_tokens_per_s_is_the_decode_rate_whatever_the_reply_length(tmp_path):
    """The live run's false rollback: a candidate that learned to answer in 5 tokens where
    stable takes 40, decoding at the same 20 ms a token after the same 200 ms to the first
    token (50 ms of it queue wait). Tokens per engine second counts each reply's 150 ms of
    prefill once, so the short replies read half as fast; the decode rate reads the same."""
    from deploy.analysis import AnalysisConfig, ArmStats, Check, analyze
    from deploy.controller import RolloutStatus
    from deploy.metrics import ServingMetricsSource

    pod = ServingPod()
    for _ in range(5):  # before the canary, slower (100 ms a token): not in the window
        pod.complete("v000000", 40, 200.0, 100.0, queue_ms=50.0)
    src = ServingMetricsSource([pod], tmp_path / "baseline.json")
    st = RolloutStatus(phase=RolloutPhase.CANARY, candidate="v000001", stable="v000000", step=0, weight=0.5,
                       canary_started_ms=1_000)
    src.mark(st)
    base = parse(pod.metrics_text())
    for _ in range(10):
        pod.complete("v000001", 5, 200.0, 20.0, queue_ms=50.0)
        pod.complete("v000000", 40, 200.0, 20.0, queue_ms=50.0)
    c, s, skipped = src(st)
    assert skipped == {}
    # by hand: candidate 10 * 4 tokens after the first over 10 * 4 * 0.02 s = 50 tokens/s;
    # stable 10 * 39 over 10 * 39 * 0.02 s = 50 tokens/s
    assert c["tokens_per_s"] == pytest.approx(50.0) and s["tokens_per_s"] == pytest.approx(50.0)
    assert c["tokens_per_s"] / s["tokens_per_s"] == pytest.approx(1.0)
    # the old formula on the same requests, by hand: engine time = 200 + (n - 1) * 20 - 50 ms,
    # candidate 50 tokens / (10 * 0.23 s), stable 400 tokens / (10 * 0.93 s): ratio 0.505
    old_c, old_s = 5 / 0.23, 40 / 0.93
    assert old_c / old_s == pytest.approx(0.50543, abs=1e-5) and old_c / old_s < 0.67
    # ... and what a pod of an older release (without the decode counters) gives for them
    older = {k: v for k, v in delta(parse(pod.metrics_text()), base).items()
             if not k[0].startswith("flywheel_version_decode_")}
    assert arm_metrics(older, "v000001")[0]["tokens_per_s"] == pytest.approx(old_c)
    assert arm_metrics(older, "v000000")[0]["tokens_per_s"] == pytest.approx(old_s)
    cfg = AnalysisConfig(min_votes=2, min_requests=10)
    tps = next(m for m in analyze(ArmStats(**c), ArmStats(**s), cfg).metrics if m.name == "tokens_per_s")
    assert tps.check == Check.PASS, tps.reason


def test_serving_decode_counters_by_hand():
    """``flywheel_version_decode_{tokens,seconds}_total``: tokens after the first and the
    seconds after the first token, per version; a one-token reply adds nothing (its series
    exist at 0), and queue wait, part of both TTFT and latency, is not decode time."""
    pod = ServingPod()
    pod.complete("v000003", 1, 120.0, 0.0, queue_ms=30.0)
    d = parse(pod.metrics_text())
    assert d[("flywheel_version_decode_tokens_total", (("version", "v000003"),))] == 0.0
    assert d[("flywheel_version_decode_seconds_total", (("version", "v000003"),))] == 0.0
    pod.complete("v000003", 11, 120.0, 15.0, queue_ms=30.0)  # 10 tokens in 150 ms after the first
    pod.complete("v000003", 3, 500.0, 40.0, queue_ms=400.0)  # 2 tokens in 80 ms
    d = parse(pod.metrics_text())
    assert d[("flywheel_version_decode_tokens_total", (("version", "v000003"),))] == 12.0
    assert d[("flywheel_version_decode_seconds_total", (("version", "v000003"),))] == pytest.approx(0.23)
    assert arm_metrics(d, "v000003")[0]["tokens_per_s"] == pytest.approx(12 / 0.23)
