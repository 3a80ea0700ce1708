"""The pod's Prometheus metrics, in vLLM's names and units (seconds, ``_total`` counters).

Per request, labelled ``model_name`` (the served model name) and ``version`` (the weights
that produced it), as vLLM's ``vllm:*`` families are:

* ``flywheel_time_to_first_token_seconds``, ``flywheel_e2e_request_latency_seconds``,
  ``flywheel_time_per_output_token_seconds`` (histograms; e2e and TTFT include queue wait).
* ``flywheel_prompt_tokens_total``, ``flywheel_generation_tokens_total``.
* ``flywheel_request_success_total{finished_reason}`` (``stop``, ``length``, ``abort``).
* ``flywheel_num_requests_running`` / ``flywheel_num_requests_waiting`` (gauges, ``model_name``).
* ``flywheel_prefix_cache_queries_total`` / ``flywheel_prefix_cache_hits_total`` (``model_name``):
  prompt tokens looked up in the prefix cache and found there, as vLLM's
  ``vllm:prefix_cache_queries`` / ``hits``; their ratio is the hit rate (0 without
  ``--prefix-caching``).

The canary's per-version signals (read by ``deploy.metrics``): ``flywheel_version_requests_total``,
``flywheel_version_errors_total`` (server-side failures: engine error 500, queue full 429),
``flywheel_version_latency_seconds`` (engine time, no queue wait), ``flywheel_version_tokens_total``,
``flywheel_version_decode_tokens_total`` and ``flywheel_version_decode_seconds_total`` (per
completion of more than one token: its tokens after the first, and the seconds from its first
token to its last; their ratio is the version's decode rate in tokens/s, vLLM's inter-token
notion, which does not depend on reply length as tokens over engine seconds do: prefill is a
fixed cost per request), ``flywheel_version_votes_total{vote}``. Also ``flywheel_requests_total{endpoint, status}``
(every HTTP request), ``flywheel_batch_size``, ``flywheel_decode_tokens_per_second``,
``flywheel_swap_pause_seconds``, ``flywheel_events_accepted_total{kind}``, the event log's
``flywheel_eventlog_*`` and the process's ``process_*`` (CPU seconds, resident memory, open
file descriptors...).
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from serving.params import GenResult

LAT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
# geometric, 25 % apart from 10 ms to ~10 min: a p99 read off the buckets is within ~25 % of
# the true value (the canary compares arms' p99)
VERSION_LAT_BUCKETS = tuple(round(0.01 * 1.25 ** i, 6) for i in range(50))


class ServingMetrics:
    """The registry of one pod and the updates the HTTP layer makes.

    Args:
        model_name: the served model name (label ``model_name``).
        event_log: the pod's :class:`serving.eventlog.EventLog`, or None.
        queue_depth: requests waiting for the engine (no arguments).
        running: requests the engine is running (no arguments).
        swap_pause_s: the last hot swap's pause in seconds, or None (no arguments).
    """

    def __init__(self, model_name: str, event_log=None, *, queue_depth: Callable[[], float],
                 running: Callable[[], float], swap_pause_s: Callable[[], float | None]):
        self.model_name = model_name
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)
        mv = ["model_name", "version"]
        self.requests = Counter("flywheel_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.ttft = Histogram("flywheel_time_to_first_token_seconds", "time to first token, queue wait included",
                              mv, buckets=LAT_BUCKETS, registry=r)
        self.e2e = Histogram("flywheel_e2e_request_latency_seconds", "submit to last token, queue wait included",
                             mv, buckets=LAT_BUCKETS, registry=r)
        self.tpot = Histogram("flywheel_time_per_output_token_seconds", "mean time per output token after the "
                              "first, per request", mv, buckets=TPOT_BUCKETS, registry=r)
        self.prompt_tokens = Counter("flywheel_prompt_tokens", "prompt tokens processed", mv, registry=r)
        self.generation_tokens = Counter("flywheel_generation_tokens", "tokens generated", mv, registry=r)
        self.request_success = Counter("flywheel_request_success", "finished completions by finish reason",
                                       [*mv, "finished_reason"], registry=r)
        self.running = Gauge("flywheel_num_requests_running", "requests the engine is running",
                             ["model_name"], registry=r)
        self.running.labels(model_name).set_function(running)
        self.waiting = Gauge("flywheel_num_requests_waiting", "requests waiting for the engine",
                             ["model_name"], registry=r)
        self.waiting.labels(model_name).set_function(queue_depth)
        self.prefix_queries = Counter("flywheel_prefix_cache_queries", "prompt tokens looked up in the prefix "
                                      "cache", ["model_name"], registry=r)
        self.prefix_hits = Counter("flywheel_prefix_cache_hits", "prompt tokens found in the prefix cache "
                                   "(not prefilled)", ["model_name"], registry=r)
        self.tokens_per_s = Histogram("flywheel_decode_tokens_per_second", "completion tokens/s per request",
                                      buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000), registry=r)
        self.batch = Histogram("flywheel_batch_size", "requests per engine batch",
                               buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.version_requests = Counter("flywheel_version_requests", "completions routed to each model "
                                        "version (one per choice, failed ones included)", ["version"], registry=r)
        self.version_errors = Counter("flywheel_version_errors", "server-side failures by model version "
                                      "(engine error, queue full; client mistakes are refused before routing)",
                                      ["version"], registry=r)
        self.version_latency = Histogram("flywheel_version_latency_seconds", "engine time (prefill + decode, "
                                         "no queue wait) by model version", ["version"],
                                         buckets=VERSION_LAT_BUCKETS, registry=r)
        self.version_tokens = Counter("flywheel_version_tokens", "generated tokens by model version",
                                      ["version"], registry=r)
        self.version_decode_tokens = Counter("flywheel_version_decode_tokens", "tokens after the first, by model "
                                             "version (completions of more than one token)", ["version"], registry=r)
        self.version_decode_seconds = Counter("flywheel_version_decode_seconds", "seconds from the first token to "
                                              "the last, by model version (completions of more than one token)",
                                              ["version"], registry=r)
        self.version_votes = Counter("flywheel_version_votes", "thumb votes by model version",
                                     ["version", "vote"], registry=r)
        self.events_accepted = Counter("flywheel_events_accepted", "events accepted by the API", ["kind"],
                                       registry=r)
        self.swap_pause = Gauge("flywheel_swap_pause_seconds", "last hot-swap pause", registry=r)
        self.swap_pause.set_function(lambda: swap_pause_s() or 0.0)
        if event_log is not None:
            r.register(_EventLogCollector(event_log))

    def observe(self, res: GenResult, prompt_len: int) -> None:
        """Record one finished completion (choice); ``res``'s times are in ms, exported in s."""
        lab = (self.model_name, res.version)
        n_out = len(res.completion_token_ids)
        self.ttft.labels(*lab).observe(res.ttft_ms / 1000)
        self.e2e.labels(*lab).observe(res.latency_ms / 1000)
        self.prompt_tokens.labels(*lab).inc(prompt_len)
        self.generation_tokens.labels(*lab).inc(n_out)
        self.request_success.labels(*lab, res.finish_reason).inc()
        self.prefix_queries.labels(self.model_name).inc(prompt_len)
        self.prefix_hits.labels(self.model_name).inc(res.cached_tokens)
        self.batch.observe(res.batch_size)
        # engine time (prefill + decode), not queue wait: slots on one pod run in separate
        # batches, so end-to-end latency would penalise whichever arm's batch runs second
        self.version_latency.labels(res.version).observe(max(0.0, res.latency_ms - res.queue_ms) / 1000)
        self.version_tokens.labels(res.version).inc(n_out)
        # the version's decode series exist (at 0) from its first completion, as its others do
        dec_tokens = self.version_decode_tokens.labels(res.version)
        dec_seconds = self.version_decode_seconds.labels(res.version)
        if n_out > 1:
            dec_tokens.inc(n_out - 1)
            dec_seconds.inc(max(0.0, res.latency_ms - res.ttft_ms) / 1000)
            dec_s = max(res.latency_ms - res.ttft_ms, 1e-3) / 1000
            self.tpot.labels(*lab).observe(dec_s / (n_out - 1))
            self.tokens_per_s.observe((n_out - 1) / dec_s)

    def render(self) -> tuple[bytes, str]:
        """``(body, content type)`` of the text exposition."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _EventLogCollector:
    def __init__(self, event_log):
        self.event_log = event_log

    def collect(self):
        ev = self.event_log
        c = CounterMetricFamily("flywheel_eventlog_events", "event log counts by state", labels=["state"])
        for k, v in vars(ev.counters).items():
            c.add_metric([k], v)
        yield c
        yield GaugeMetricFamily("flywheel_eventlog_queue_depth", "events waiting in memory", value=ev.queue_depth())
        yield GaugeMetricFamily("flywheel_eventlog_journal_pending_bytes", "journal bytes not yet in Kafka",
                                value=ev.journal_pending())
        yield GaugeMetricFamily("flywheel_eventlog_kafka_up", "1 when the last send reached Kafka",
                                value=1.0 if ev.kafka_up else 0.0)


class RequestCountMiddleware:
    """ASGI middleware counting every HTTP request in ``flywheel_requests_total`` by route
    template (``unmatched`` when no route matched) and status."""

    def __init__(self, app, metrics: ServingMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def _send(msg):
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
            await send(msg)

        try:
            await self.app(scope, receive, _send)
        finally:
            route = scope.get("route")
            self.metrics.requests.labels(getattr(route, "path", "unmatched"), str(status)).inc()
