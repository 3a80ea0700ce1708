"""Build the Grafana dashboard ``deploy/grafana/flywheel.json`` (plain Grafana JSON model).

``python deploy/grafana/build.py`` rewrites the file; ``tests/test_monitoring_rules.py``
checks that the file equals this script's output and that every series a panel queries is
exported by a Flywheel role or recorded by ``deploy/prometheus/recording_rules.yml``.

One row per role (serving, ingest, learner, controller); every panel is a time series over
the ``datasource`` variable (a Prometheus data source picked at import). The ``namespace``
variable picks one deployment when several share the Prometheus: every series a panel reads
is selected by ``namespace=~"$namespace"`` (:func:`scoped`), the label the recording rules keep
(``deploy/prometheus/recording_rules.yml``). Series without the label (one deployment, no
label configured) match the empty value.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

OUT = Path(__file__).with_name("flywheel.json")
DS = {"type": "prometheus", "uid": "${datasource}"}
NS_MATCHER = 'namespace=~"$namespace"'
_SERIES = re.compile(r"\b(flywheel[:_][A-Za-z0-9_:]*)(\{)?")

# (row title, [(panel title, unit, [(PromQL, legend)], description)])
ROWS: list[tuple[str, list[tuple[str, str, list[tuple[str, str]], str]]]] = [
    ("Serving", [
        ("Requests/s by version", "reqps", [("flywheel:version_requests:rate5m", "{{version}}")],
         "Completions routed to each model version (5 min rate)."),
        ("Server-side error ratio by version", "percentunit", [("flywheel:version_error_ratio:rate5m", "{{version}}")],
         "Engine errors and queue-full refusals over requests (alert FlywheelServingErrorRateHigh > 5 %)."),
        ("p99 engine latency by version", "s", [("flywheel:version_latency_seconds:p99_5m", "{{version}}")],
         "Prefill + decode time, no queue wait: what the canary compares."),
        ("p99 end-to-end latency and TTFT", "s", [("flywheel:e2e_request_latency_seconds:p99_5m", "e2e p99"),
                                                  ("flywheel:time_to_first_token_seconds:p99_5m", "TTFT p99")],
         "Queue wait included (alert FlywheelServingLatencyHigh > 30 s)."),
        ("Decode tokens/s by version", "short",
         [("flywheel:version_tokens_per_second:rate5m", "{{version}}")],
         "Tokens after the first over the seconds after the first token (5 min rate): what the canary "
         "compares; it does not depend on reply length."),
        ("Thumbs-up ratio by version (1 h)", "percentunit", [("flywheel:version_thumbs_up_ratio:rate1h", "{{version}}")],
         "Votes received by serving's feedback API."),
        ("Requests waiting for the engine", "short", [("flywheel_num_requests_waiting", "{{instance}}")],
         "Per pod (alert FlywheelServingQueueBacklog > 32)."),
        ("Last hot-swap pause", "s", [("flywheel_swap_pause_seconds", "{{instance}}")],
         "Pause of the last promotion's pointer flip."),
        ("HTTP 5xx ratio (all endpoints)", "percentunit", [("flywheel:http_5xx_ratio:rate5m", "5xx")],
         "Every HTTP request of every pod, by status."),
        ("Events accepted/s by kind", "short", [("flywheel:events_accepted:rate5m", "{{kind}}")],
         "Completions and feedback the API accepted (each must end in a sample or a dead letter)."),
        ("Event log: Kafka up and journal", "bytes", [("flywheel_eventlog_journal_pending_bytes", "journal {{instance}}"),
                                                      ("flywheel_eventlog_kafka_up", "kafka up {{instance}}")],
         "Journal bytes not yet in Kafka; kafka_up is 1 when the last send reached Kafka."),
    ]),
    ("Ingest", [
        ("Records consumed/s by topic", "short", [("flywheel:ingest_records_consumed:rate5m", "{{topic}}")],
         "Deliveries to the ingest workers (replays count again)."),
        ("Records joined/s by topic", "short", [("flywheel:ingest_records_joined:rate5m", "{{topic}}")],
         "New completions and folded votes."),
        ("Dead letters/s by reason", "short", [("flywheel:ingest_deadletters:rate5m", "{{topic}} {{reason}}")],
         "Alert FlywheelIngestDeadLettersHigh on their share of consumed records."),
        ("Consumer lag by topic (approximate on Tansu)", "short", [("flywheel:ingest_consumer_lag:sum", "{{topic}}")],
         "Last Fetch high watermark minus position, summed over partitions. Approximate on the embedded Tansu "
         "broker, whose ListOffsets under-reports end offsets (DESIGN §3): lag tools built on ListOffsets "
         "read wrong there."),
        ("Sample delay (completion -> sealed sample)", "s", [("flywheel:ingest_seal_delay_seconds:p50_1h", "p50"),
                                                             ("flywheel:ingest_seal_delay_seconds:p99_1h", "p99")],
         "sealed_at - created_at per sample (1 h window)."),
        ("Samples sealed/s", "short", [("flywheel:ingest_samples_sealed:rate5m", "samples")], ""),
        ("Join state", "short", [("flywheel:ingest_state_open_labels:sum", "open labels"),
                                 ("max by (table) (flywheel_ingest_state_dedupe_rows)", "dedupe {{table}}")],
         "Shared by the workers of one state: max over workers."),
        ("Seal round time p99", "s", [("histogram_quantile(0.99, sum by (le) "
                                       "(rate(flywheel_ingest_seal_round_seconds_bucket[5m])))", "p99")], ""),
    ]),
    ("Learner", [
        ("Cycles by outcome (1 h)", "short", [("sum by (outcome) (increase(flywheel_learner_cycles_total[1h]))",
                                               "{{outcome}}")], "published, rejected (gate), skipped, failed."),
        ("Cycle duration p50", "s", [("histogram_quantile(0.5, sum by (le) "
                                      "(rate(flywheel_learner_cycle_duration_seconds_bucket[6h])))", "p50")], ""),
        ("Loss (first and last step of the last cycle)", "short",
         [("flywheel_learner_loss", "{{objective}} {{step}}")], ""),
        ("KL to the reference", "short", [("flywheel_learner_kl", "{{estimator}}")], "nats per token (k1, k3)."),
        ("Importance ratio", "short", [("flywheel_learner_importance_ratio", "{{stat}}"),
                                       ("flywheel_learner_importance_truncated_fraction", "truncated share")],
         "exp(logp_current - behavior_logp) at the last step."),
        ("Train-vs-serving mismatch", "short", [("flywheel_learner_mismatch", "{{stat}}")],
         "|logp_train - behavior_logp| in nats (alert FlywheelLearnerMismatchHigh p99 > 0.1)."),
        ("Samples used and refused (1 h)", "short",
         [("sum(increase(flywheel_learner_samples_used_total[1h]))", "used"),
          ("sum by (reason) (increase(flywheel_learner_samples_refused_total[1h]))", "refused {{reason}}")], ""),
        ("Samples waiting and pause", "short", [("flywheel_learner_samples_waiting", "waiting"),
                                                ("flywheel_learner_paused", "paused")], ""),
    ]),
    ("Canary (controller)", [
        ("Phase", "short", [("flywheel_canary_phase == 1", "{{phase}}")], "The rollout's current phase."),
        ("Step and weight", "short", [("flywheel_canary_step", "step"), ("flywheel_canary_weight", "weight")],
         "Step index (-1: no canary) and the candidate's traffic share."),
        ("Votes by arm", "short", [("flywheel_canary_votes", "{{arm}} {{vote}}")], "Since the canary started."),
        ("Thumbs-up rate by arm and the always-valid interval", "short",
         [("flywheel_canary_thumbs_up_rate", "{{arm}}"),
          ("flywheel_canary_thumbs_up_diff_bound", "diff {{bound}}")], "DESIGN §5."),
        ("Error rate and p99 by arm", "short", [("flywheel_canary_error_rate", "error rate {{arm}}"),
                                                ("flywheel_canary_p99_latency_seconds", "p99 s {{arm}}")], ""),
        ("Decisions by outcome (1 h)", "short",
         [("sum by (decision) (increase(flywheel_controller_decisions_total[1h]))", "{{decision}}")], ""),
        ("Reconcile errors (1 h)", "short",
         [("sum(increase(flywheel_controller_reconcile_errors_total[1h]))", "errors")], ""),
    ]),
]


def scoped(expr: str) -> str:
    """``expr`` with every Flywheel series selected by the dashboard's deployment
    (:data:`NS_MATCHER` added to its label matchers)."""
    return _SERIES.sub(lambda m: m.group(1) + "{" + NS_MATCHER + (", " if m.group(2) else "}"), expr)


def panel(pid: int, title: str, unit: str, targets: list[tuple[str, str]], desc: str, x: int, y: int) -> dict:
    return {
        "id": pid, "type": "timeseries", "title": title, "description": desc, "datasource": DS,
        "gridPos": {"h": 8, "w": 8, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
        "targets": [{"datasource": DS, "expr": scoped(e), "legendFormat": leg, "refId": chr(ord("A") + i)}
                    for i, (e, leg) in enumerate(targets)],
    }


def build() -> dict:
    """The dashboard's JSON model (a dict)."""
    panels, pid, y = [], 1, 0
    for row, items in ROWS:
        panels.append({"id": pid, "type": "row", "title": row, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        pid, y = pid + 1, y + 1
        for i, (title, unit, targets, desc) in enumerate(items):
            panels.append(panel(pid, title, unit, targets, desc, (i % 3) * 8, y + (i // 3) * 8))
            pid += 1
        y += ((len(items) + 2) // 3) * 8
    return {
        "title": "Flywheel", "uid": "flywheel", "tags": ["flywheel"], "timezone": "utc",
        "schemaVersion": 39, "version": 1, "editable": True, "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus",
             "current": {}, "hide": 0},
            {"name": "namespace", "type": "query", "label": "Deployment (namespace)", "datasource": DS,
             "definition": 'label_values(up{job=~"flywheel-.+"}, namespace)',
             "query": {"query": 'label_values(up{job=~"flywheel-.+"}, namespace)',
                       "refId": "PrometheusVariableQueryEditor-VariableQuery"},
             "refresh": 2, "includeAll": False, "multi": False, "sort": 1, "current": {}, "hide": 0}]},
        "annotations": {"list": []},
        "panels": panels,
    }


def render() -> str:
    """The file's text: the dashboard as indented JSON with a final newline."""
    return json.dumps(build(), indent=1, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
