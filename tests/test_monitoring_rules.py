"""Prometheus rules, alert runbook entries and the Grafana dashboard (deploy/prometheus,
deploy/grafana): ``promtool check rules`` and ``promtool test rules`` (Debian's prometheus
package) pass; every alert names an entry of docs/runbook.md's "Alerts" section, and every
entry there is an alert; the dashboard file is the generator's output; every series that a
rule or a panel reads is exported by a Flywheel role or recorded by a rule."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from schemas.settings import topic_names
import yaml

ROOT = Path(__file__).resolve().parents[1]
PROM = ROOT / "deploy" / "prometheus"
RULE_FILES = [PROM / "recording_rules.yml", PROM / "alert_rules.yml"]
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool missing: apt-get install -y prometheus "
                                    "(.ci/run installs it)")


def rules() -> list[dict]:
    return [r for f in RULE_FILES for g in yaml.safe_load(f.read_text())["groups"] for r in g["rules"]]


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


def alert_entries() -> dict[str, str]:
    """``{anchor: heading}`` of the ### entries in docs/runbook.md's "## Alerts" section."""
    text = (ROOT / "docs" / "runbook.md").read_text()
    m = re.search(r"^## Alerts\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, 'docs/runbook.md has no "## Alerts" section'
    return {slug(h): h for h in re.findall(r"^### (.+?)\s*$", m.group(1), re.M)}


@needs_promtool
def test_promtool_check_rules():
    r = subprocess.run([PROMTOOL, "check", "rules", *map(str, RULE_FILES)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("SUCCESS") == len(RULE_FILES)


@needs_promtool
def test_promtool_check_example_config():
    r = subprocess.run([PROMTOOL, "check", "config", str(PROM / "prometheus.example.yml")], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    jobs = {j["job_name"] for j in yaml.safe_load((PROM / "prometheus.example.yml").read_text())["scrape_configs"]}
    assert jobs == {"flywheel-serving", "flywheel-ingest", "flywheel-learner", "flywheel-controller"}


@needs_promtool
def test_promtool_unit_tests_of_the_alerts():
    r = subprocess.run([PROMTOOL, "test", "rules", "alert_rules_test.yml"], cwd=PROM, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_alert_names_its_runbook_entry_and_back():
    entries = alert_entries()
    alerts = [r for r in rules() if "alert" in r]
    assert len(alerts) >= 15
    for a in alerts:
        url = a["annotations"]["runbook_url"]
        path, _, anchor = url.partition("#")
        assert path == "docs/runbook.md", url
        assert anchor in entries, f"{a['alert']}: {url} has no entry in docs/runbook.md (Alerts)"
        assert entries[anchor] == a["alert"], (entries[anchor], a["alert"])
        assert a["labels"]["severity"] in ("page", "ticket"), a["alert"]
        assert a["annotations"]["summary"] and a["annotations"]["description"], a["alert"]
    assert set(entries.values()) == {a["alert"] for a in alerts}, "runbook entries without an alert"


def test_dashboard_file_is_the_generators_output():
    import importlib.util

    spec = importlib.util.spec_from_file_location("grafana_build", ROOT / "deploy" / "grafana" / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    text = (ROOT / "deploy" / "grafana" / "flywheel.json").read_text()
    assert text == mod.render(), "run: python deploy/grafana/build.py"
    d = json.loads(text)
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)) and d["uid"] == "flywheel"


def exported_series() -> set[str]:
    """Every series name the four roles export (their registries, built in-process)."""
    from deploy.metrics import ControllerMetrics
    from ingest.metrics import IngestMetrics
    from learner.metrics import LearnerMetrics
    from serving.http.metrics import ServingMetrics

    regs = [IngestMetrics(topic_names()).registry, LearnerMetrics().registry, ControllerMetrics().registry,
            ServingMetrics("m", None, queue_depth=lambda: 0, running=lambda: 0, swap_pause_s=lambda: None).registry]
    names = set()
    for reg in regs:
        for fam in reg.collect():
            if fam.type == "counter":
                names.add(fam.name + "_total")
            elif fam.type == "histogram":
                names.update(fam.name + s for s in ("_bucket", "_sum", "_count"))
            else:
                names.add(fam.name)
    # families the serving event log adds when a pod has one (serving/http/metrics.py)
    names.update({"flywheel_eventlog_events_total", "flywheel_eventlog_queue_depth",
                  "flywheel_eventlog_journal_pending_bytes", "flywheel_eventlog_kafka_up"})
    return names


def series_in(expr: str) -> set[str]:
    expr = re.sub(r'"[^"]*"', '""', expr)  # label values
    return {n for n in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", expr) if n.startswith("flywheel")}


def test_every_series_read_is_exported_or_recorded():
    import importlib.util

    spec = importlib.util.spec_from_file_location("grafana_build", ROOT / "deploy" / "grafana" / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    recorded = {r["record"] for r in rules() if "record" in r}
    known = exported_series() | recorded
    exprs = [r["expr"] for r in rules()]
    exprs += [t["expr"] for p in mod.build()["panels"] for t in p.get("targets", [])]
    missing = {n: e for e in exprs for n in series_in(e) if n not in known}
    assert not missing, f"series nobody exports or records: {missing}"
    used = set().union(*(series_in(e) for e in exprs))
    assert recorded <= used, f"recorded but unused: {recorded - used}"


AGGREGATION = re.compile(r"\b(sum|max|min|avg|count|topk|bottomk|quantile|stddev|stdvar)\s*(by\s*\(([^)]*)\))?\s*\(")


def test_every_aggregation_keeps_the_deployment_label():
    """Several deployments on one Prometheus: every rule that aggregates keeps ``namespace``
    (promtool's unit test of two namespaces in alert_rules_test.yml shows the values)."""
    seen = 0
    for r in rules():
        for m in AGGREGATION.finditer(r["expr"]):
            seen += 1
            by = [x.strip() for x in (m.group(3) or "").split(",")]
            assert m.group(2) and "namespace" in by, f"{r.get('record') or r.get('alert')}: {m.group(0)!r}"
    assert seen >= 20


def _grafana():
    import importlib.util

    spec = importlib.util.spec_from_file_location("grafana_build", ROOT / "deploy" / "grafana" / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@needs_promtool
def test_dashboard_selects_one_deployment(tmp_path):
    """Every Flywheel series a panel reads has the ``namespace`` matcher of the dashboard's
    deployment variable, and every panel query still parses (``promtool check rules``)."""
    mod = _grafana()
    d = json.loads((ROOT / "deploy" / "grafana" / "flywheel.json").read_text())
    assert [v["name"] for v in d["templating"]["list"]] == ["datasource", "namespace"]
    exprs = [t["expr"] for p in d["panels"] for t in p.get("targets", [])]
    for e in exprs:
        names = re.findall(r"\b(flywheel[:_][A-Za-z0-9_:]*)(\{[^}]*\})?", e)
        assert names and all(mod.NS_MATCHER in (sel or "") for _, sel in names), e
    assert mod.scoped('a_b + flywheel_x{k="v"} / flywheel:y') == \
        'a_b + flywheel_x{namespace=~"$namespace", k="v"} / flywheel:y{namespace=~"$namespace"}'
    f = tmp_path / "panels.yml"
    f.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": [
        {"record": f"panel:q{i}", "expr": e.replace("$namespace", "team-a")} for i, e in enumerate(exprs)]}]}))
    r = subprocess.run([PROMTOOL, "check", "rules", str(f)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
