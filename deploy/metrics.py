"""Per-version serving metrics for the canary analysis, read from serving's ``/metrics``.

What is read (Prometheus text, summed over pods; counters are cumulative, so each figure is
the difference between now and a baseline taken when the canary started):

* requests per version: ``flywheel_version_requests_total{version}`` (completions served).
* errors per version: ``flywheel_requests_total{version, status}`` with status >= 500, or
  ``flywheel_version_errors_total{version}``; then requests come from the same family.
* p99 latency (ms): histogram ``flywheel_version_latency_ms{version, le}`` (or
  ``flywheel_request_latency_seconds`` / ``flywheel_version_latency_seconds``), quantile by linear interpolation inside the bucket
  (Prometheus ``histogram_quantile``) over the bucket counts observed since the baseline.
* tokens/s: ``flywheel_decode_tokens_per_second{version}`` histogram mean (sum / count) since
  the baseline, else ``flywheel_version_tokens_total{version}`` over the summed seconds of
  ``flywheel_version_latency_ms{version}``.

A family without a ``version`` label cannot tell the arms apart: that metric is SKIPPED with
the reason naming what serving would have to export. Too few requests
since the baseline leaves latency/tokens unmeasured (None -> SKIPPED) and error rate
INCONCLUSIVE, as for any other metric.

The baseline is persisted (JSON, atomic rewrite) keyed by candidate and canary start, so a
restarted controller keeps measuring from the canary's start, not from its own restart.
"""

from __future__ import annotations

import json
import math
import os
import uuid
from collections import defaultdict
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

REQUESTS = "flywheel_version_requests"
HTTP_REQUESTS = "flywheel_requests"
ERRORS = "flywheel_version_errors"
LATENCY = ("flywheel_version_latency_ms", "flywheel_request_latency_seconds", "flywheel_version_latency_seconds")
VERSION_TOKENS = "flywheel_version_tokens"
VERSION_LATENCY_MS = "flywheel_version_latency_ms"
TOKENS_PER_S = "flywheel_decode_tokens_per_second"

# Flat sample map: (sample name, sorted label items) -> value
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    """Prometheus text exposition -> ``{(sample_name, labels): value}``.

    Raises:
        ValueError: the text is not valid exposition format.
    """
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            out[key] = out.get(key, 0.0) + float(s.value)
    return out


def merge(many: list[Samples]) -> Samples:
    """Sum the samples of several pods (counters and histogram buckets add up)."""
    out: Samples = defaultdict(float)
    for m in many:
        for k, v in m.items():
            out[k] += v
    return dict(out)


def delta(now: Samples, base: Samples) -> Samples:
    """``now - base`` per sample; a sample that went down (pod restarted, counter reset)
    counts from zero: its current value."""
    return {k: (v - base.get(k, 0.0) if v >= base.get(k, 0.0) else v) for k, v in now.items()}


def _by_version(s: Samples, name: str, **match: str) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for (n, labels), v in s.items():
        d = dict(labels)
        if n == name and "version" in d and all(d.get(k) == val for k, val in match.items()):
            out[d["version"]] += v
    return out


def _has_family(s: Samples, name: str) -> bool:
    return any(n == name for n, _ in s)


def _has_version_label(s: Samples, name: str) -> bool:
    return any(n == name and "version" in dict(labels) for n, labels in s)


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Quantile ``q`` of a cumulative histogram ``[(le, count), ...]`` (Prometheus
    ``histogram_quantile``: linear interpolation inside the bucket; the highest finite bound
    when the rank falls in ``+Inf``). None when the histogram is empty."""
    b = sorted(buckets)
    if not b or b[-1][1] <= 0:
        return None
    rank = q * b[-1][1]
    prev_le, prev_c = 0.0, 0.0
    for le, c in b:
        if c >= rank:
            if math.isinf(le):
                return prev_le
            if c == prev_c:
                return le
            return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
        prev_le, prev_c = le, c
    return prev_le


def arm_metrics(d: Samples, version: str) -> tuple[dict, dict[str, str]]:
    """Per-version figures from the delta samples ``d``.

    Returns:
        ``(fields, skipped)``: ``fields`` for :class:`deploy.analysis.ArmStats` (``errors``,
        ``requests``, ``p99_ms`` in ms, ``tokens_per_s``, ``latency_samples``: the
        histogram's observations since the baseline), and ``{metric: reason}`` for the
        metrics serving does not export per version.
    """
    fields: dict = {}
    skipped: dict[str, str] = {}
    if _has_version_label(d, HTTP_REQUESTS + "_total"):
        by_status = defaultdict(float)
        for (n, labels), v in d.items():
            lab = dict(labels)
            if n == HTTP_REQUESTS + "_total" and lab.get("version") == version:
                by_status[lab.get("status", "")] += v
        fields["requests"] = int(sum(by_status.values()))
        fields["errors"] = int(sum(v for st, v in by_status.items() if st[:1] == "5"))
    elif _has_version_label(d, ERRORS + "_total"):
        fields["requests"] = int(_by_version(d, REQUESTS + "_total").get(version, 0.0))
        fields["errors"] = min(int(_by_version(d, ERRORS + "_total").get(version, 0.0)), fields["requests"])
    else:
        skipped["error_rate"] = (f"serving exports no per-version error count ({HTTP_REQUESTS}_total or "
                                 f"{ERRORS}_total with a version label)")
    if "requests" not in fields and _has_version_label(d, REQUESTS + "_total"):
        # request counts still gate latency/tokens (min_requests) even without an error family
        fields["requests"] = int(_by_version(d, REQUESTS + "_total").get(version, 0.0))
    lat = next((n for n in LATENCY if _has_version_label(d, n + "_bucket")), None)
    if lat is None:
        skipped["p99_latency"] = f"serving exports no per-version latency histogram ({LATENCY[0]} with a version label)"
    else:
        buckets = [(float(dict(labels)["le"]), v) for (n, labels), v in d.items()
                   if n == lat + "_bucket" and dict(labels).get("version") == version]
        p99 = histogram_quantile(0.99, buckets)
        to_ms = 1.0 if lat.endswith("_ms") else 1000.0
        fields["p99_ms"] = None if p99 is None else p99 * to_ms
        # completions observed since the baseline: includes requests routed before it and
        # finished after it (not in the request counter's delta), so it gates p99 and tokens/s
        fields["latency_samples"] = int(max((c for le, c in buckets if math.isinf(le)), default=0.0))
    if (not _has_version_label(d, TOKENS_PER_S + "_count") and _has_version_label(d, VERSION_TOKENS + "_total")
            and _has_version_label(d, VERSION_LATENCY_MS + "_sum")):
        # serving's per-version counters: generated tokens / summed end-to-end seconds
        toks = _by_version(d, VERSION_TOKENS + "_total").get(version, 0.0)
        secs = _by_version(d, VERSION_LATENCY_MS + "_sum").get(version, 0.0) / 1000.0
        fields["tokens_per_s"] = toks / secs if secs > 0 else None
    elif not _has_version_label(d, TOKENS_PER_S + "_count"):
        skipped["tokens_per_s"] = f"serving exports no per-version tokens/s ({TOKENS_PER_S} with a version label)"
    else:
        n = _by_version(d, TOKENS_PER_S + "_count").get(version, 0.0)
        s = _by_version(d, TOKENS_PER_S + "_sum").get(version, 0.0)
        fields["tokens_per_s"] = s / n if n > 0 else None
    return fields, skipped


class ServingMetricsSource:
    """``arm_metrics`` callable for :class:`deploy.controller.RolloutController`: scrapes
    every pod's ``/metrics``, subtracts the baseline taken at the canary's start and returns
    ``(candidate_fields, stable_fields, skipped)``.

    Args:
        admins: :class:`deploy.serving_client.ServingAdmin` per pod.
        baseline_path: JSON file holding the baseline (survives a controller restart).

    Raises (from ``__call__``):
        ServingAdminError: a pod's ``/metrics`` is unreachable (the controller records ERROR).
        ValueError: a pod's ``/metrics`` text does not parse.
    """

    def __init__(self, admins, baseline_path: Path):
        self.admins = list(admins)
        self.baseline_path = Path(baseline_path)

    def scrape(self) -> Samples:
        return merge([parse(a.metrics_text()) for a in self.admins])

    def _baseline(self, key: str, now: Samples) -> Samples:
        try:
            saved = json.loads(self.baseline_path.read_text())
        except (OSError, ValueError):
            saved = {}
        if saved.get("key") == key:
            return {(n, tuple(tuple(x) for x in labels)): v for n, labels, v in saved["samples"]}
        self.baseline_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.baseline_path.with_name(f".{self.baseline_path.name}.{uuid.uuid4().hex}")
        tmp.write_text(json.dumps({"key": key, "samples": [[n, list(labels), v] for (n, labels), v in now.items()]}))
        os.replace(tmp, self.baseline_path)
        return now

    def mark(self, st) -> None:
        """Take the baseline now for the canary ``st`` just started (called by the controller
        at START; if it fails, the first analysis takes it)."""
        try:
            self.baseline_path.unlink(missing_ok=True)
            self._baseline(f"{st.candidate}@{st.canary_started_ms}", self.scrape())
        except Exception:  # noqa: BLE001 - best effort; __call__ retries and reports errors
            pass

    def __call__(self, st) -> tuple[dict, dict, dict[str, str]]:
        now = self.scrape()
        base = self._baseline(f"{st.candidate}@{st.canary_started_ms}", now)
        d = delta(now, base)
        c, skipped = arm_metrics(d, st.candidate)
        s, _ = arm_metrics(d, st.stable)
        return c, s, skipped
