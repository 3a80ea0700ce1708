"""Prometheus metrics of the learner daemon (``flywheel learn --metrics-port``).

What it exports (one learner process; figures of the last finished cycle are gauges):

* ``flywheel_learner_cycles_total{outcome}``: cycles by outcome: ``published`` (a new
  version), ``rejected`` (the eval gate refused the candidate), ``skipped`` (fewer than
  ``min_samples`` trainable samples), ``failed`` (an exception ended the cycle).
* ``flywheel_learner_cycle_duration_seconds``: histogram of the wall time of a cycle.
* ``flywheel_learner_last_cycle_timestamp_seconds``, ``..._last_publish_timestamp_seconds``:
  when the last cycle ended (the daemon's start before its first) and the last version was
  published (unix s).
* ``flywheel_learner_loss{objective, step}``: the objective's loss (``kto`` or ``pg``) at the
  cycle's ``first`` and ``last`` optimizer step.
* ``flywheel_learner_kl{estimator}``: KL(pi_theta || pi_ref) estimates ``k1`` and ``k3`` (nats
  per token) at the last step, and ``kto_z0`` (KTO's batch estimate of the sequence KL).
* ``flywheel_learner_importance_ratio{stat}``: ``mean`` and ``max`` of the importance ratio
  exp(logp_current - behavior_logp) at the last step;
  ``flywheel_learner_importance_truncated_fraction``: share above the TIS cap.
* ``flywheel_learner_mismatch{stat}``: ``mean``, ``p99``, ``max`` of
  |logp_train - behavior_logp| (nats) measured at the cycle's start (DESIGN §4).
* ``flywheel_learner_samples_used_total``: samples trained on;
  ``flywheel_learner_samples_refused_total{reason}``: samples left out, by reason
  (``stale``, ``no_routes``, ``newer_than_parent``, ...: the trainer's ``data/dropped_*``).
* ``flywheel_learner_tokens_per_second``: training throughput of the last cycle.
* ``flywheel_learner_paused``: 1 while ``flywheel pause`` holds the learner.
* ``flywheel_learner_samples_waiting``: sealed samples not yet trained on (daemon's last check).

The figures come from the cycle's namespaced metrics (``learner.trainer.train``), which are
also written to the version's manifest.
"""

from __future__ import annotations

import math
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, start_http_server

OUTCOMES = ("published", "rejected", "skipped", "failed")
CYCLE_BUCKETS = (1, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 14400)


class LearnerMetrics:
    """The learner's Prometheus metrics (see the module docstring), in their own registry."""

    def __init__(self):
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)  # process_* (start time: restarts of a crashing daemon show there)
        self.cycles = Counter("flywheel_learner_cycles", "learner cycles by outcome", ["outcome"], registry=r)
        for o in OUTCOMES:
            self.cycles.labels(o)  # exported as 0 before the first cycle of each outcome
        self.cycle_seconds = Histogram("flywheel_learner_cycle_duration_seconds", "wall time of a cycle (s)",
                                       buckets=CYCLE_BUCKETS, registry=r)
        self.last_cycle = Gauge("flywheel_learner_last_cycle_timestamp_seconds", "end of the last cycle, or the "
                                "daemon's start before its first (unix s)", registry=r)
        self.last_cycle.set(time.time())
        self.last_publish = Gauge("flywheel_learner_last_publish_timestamp_seconds",
                                  "when the last version was published (unix s)", registry=r)
        self.loss = Gauge("flywheel_learner_loss", "loss of the last cycle at its first and last step",
                          ["objective", "step"], registry=r)
        self.kl = Gauge("flywheel_learner_kl", "KL(policy || reference) estimate at the last step (nats/token)",
                        ["estimator"], registry=r)
        self.is_ratio = Gauge("flywheel_learner_importance_ratio", "importance ratio exp(logp - behavior_logp) "
                              "at the last step", ["stat"], registry=r)
        self.is_truncated = Gauge("flywheel_learner_importance_truncated_fraction",
                                  "share of importance ratios above the TIS cap at the last step", registry=r)
        self.mismatch = Gauge("flywheel_learner_mismatch", "|logp_train - behavior_logp| at the cycle's start "
                              "(nats)", ["stat"], registry=r)
        self.samples_used = Counter("flywheel_learner_samples_used", "samples trained on", registry=r)
        self.samples_refused = Counter("flywheel_learner_samples_refused", "samples left out of a cycle, by reason",
                                       ["reason"], registry=r)
        self.tokens_per_s = Gauge("flywheel_learner_tokens_per_second", "training tokens/s of the last cycle",
                                  registry=r)
        self.paused = Gauge("flywheel_learner_paused", "1 while an operator pause holds the learner", registry=r)
        self.samples_waiting = Gauge("flywheel_learner_samples_waiting", "sealed samples not yet trained on",
                                     registry=r)

    def serve(self, port: int, addr: str = "0.0.0.0"):
        """Serve ``/metrics`` on ``addr:port`` from a daemon thread (prometheus_client);
        returns the server (``shutdown()`` stops it)."""
        return start_http_server(port, addr=addr, registry=self.registry)[0]

    def cycle_done(self, outcome: str, metrics: dict, seconds: float) -> None:
        """Record one finished cycle.

        Args:
            outcome: one of :data:`OUTCOMES`.
            metrics: the cycle's namespaced metrics (``learner.trainer.train``; ``{}`` when
                the cycle produced none).
            seconds: its wall time (s).

        Raises:
            ValueError: unknown ``outcome``.
        """
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome: must be one of {OUTCOMES}, got {outcome!r}")
        self.cycles.labels(outcome).inc()
        self.cycle_seconds.observe(seconds)
        self.last_cycle.set(time.time())
        if outcome == "published":
            self.last_publish.set(time.time())
        self._figures(metrics)

    def _figures(self, m: dict) -> None:
        def num(key):
            v = m.get(key)
            return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None

        for obj in ("kto", "pg"):
            for step, key in (("first", f"{obj}/loss_first"), ("last", f"{obj}/loss")):
                if num(key) is not None:
                    self.loss.labels(obj, step).set(num(key))
        kto_kl = num("kto/kl")
        for est in ("k1", "k3"):
            if num(f"kl/{est}") is not None:
                self.kl.labels(est).set(num(f"kl/{est}"))
        if kto_kl is not None:
            self.kl.labels("kto_z0").set(kto_kl)
        for stat in ("mean", "max"):
            if num(f"is/ratio_{stat}") is not None:
                self.is_ratio.labels(stat).set(num(f"is/ratio_{stat}"))
        if num("is/truncated_frac") is not None:
            self.is_truncated.set(num("is/truncated_frac"))
        for stat in ("mean", "p99", "max"):
            if num(f"mismatch/{stat}") is not None:
                self.mismatch.labels(stat).set(num(f"mismatch/{stat}"))
        if num("data/n_samples") is not None:
            self.samples_used.inc(num("data/n_samples"))
        for key, v in m.items():
            if key.startswith("data/dropped_") or key == "data/newer_than_parent":
                reason = key.removeprefix("data/dropped_").removeprefix("data/")
                if num(key):
                    self.samples_refused.labels(reason).inc(num(key))
        if num("perf/tokens_per_s") is not None:
            self.tokens_per_s.set(num("perf/tokens_per_s"))


def cycle_outcome(manifest, state: dict, started_ms: int) -> tuple[str, dict]:
    """``(outcome, metrics)`` of a cycle from ``learner.cycle.run_cycle``'s result and the
    learner state written after it: ``published`` with the manifest's metrics, ``rejected``
    with the metrics the state's last cycle entry recorded (when it ended after
    ``started_ms``), else ``skipped``."""
    if manifest is not None:
        return "published", dict(manifest.metrics)
    cycles = state.get("cycles") or []
    if cycles and cycles[-1].get("rejected") and cycles[-1].get("at", 0) >= started_ms:
        return "rejected", dict(cycles[-1].get("metrics") or {})
    return "skipped", {}
