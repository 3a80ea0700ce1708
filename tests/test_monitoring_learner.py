"""The learner daemon's Prometheus ``/metrics`` (``learner.metrics``): a real ``flywheel learn``
daemon subprocess trains one DeepSpeed cycle on a tiny MoE; its scraped figures equal the
metrics the published version's manifest recorded; the operator pause shows as a gauge."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from learner.metrics import LearnerMetrics, cycle_outcome
from schemas.modelspec import load_model
from schemas.settings import free_port
from tests.test_learner_cycle import write_shard
from tests.test_learner_replay import make_samples
from flywheel.supervise import die_with_parent

REPO = Path(__file__).resolve().parents[1]


def scrape(url: str) -> dict:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url, timeout=5).text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_cycle_outcome_and_unknown_outcome():
    assert cycle_outcome(None, {"cycles": []}, 0) == ("skipped", {})
    st = {"cycles": [{"rejected": "score fell", "at": 10, "metrics": {"kto/loss": 0.5}}]}
    assert cycle_outcome(None, st, 5) == ("rejected", {"kto/loss": 0.5})
    assert cycle_outcome(None, st, 11) == ("skipped", {})  # an older cycle's rejection
    with pytest.raises(ValueError, match="outcome"):
        LearnerMetrics().cycle_done("exploded", {}, 1.0)


@pytest.mark.timeout(600)
def test_learn_daemon_exports_its_cycle(tiny_moe_dir, tmp_path):
    from modelstore.store import ModelStore

    store = ModelStore(tmp_path / "store")
    store.init_base(tiny_moe_dir)
    store.publish(store.load("v000000"), parent="v000000", metrics={})  # v000001: samples of v000000 are stale
    model = load_model(store.base_dir)
    samples_dir = tmp_path / "samples"
    write_shard(samples_dir, make_samples(model, 6, version="v000001", seed=1), "v000001", "a")
    write_shard(samples_dir, make_samples(model, 2, version="v000000", seed=2), "v000000", "b")
    home = tmp_path / "home"
    port = free_port()
    env = {**os.environ, "FLYWHEEL_HOME": str(home)}
    env.pop("MASTER_PORT", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "flywheel.cli", "learn", "--store", str(store.root), "--samples", str(samples_dir),
         "--state", str(tmp_path / "state"), "--steps", "2", "--batch-size", "4", "--lr", "1e-4",
         "--max-staleness", "0", "--parent", "latest", "--every-n", "1", "--poll-s", "0.3",
         "--metrics-port", str(port)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent())
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        deadline = time.monotonic() + 540  # a cold DeepSpeed JIT build takes minutes
        m = {}
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            try:
                m = scrape(url)
            except httpx.HTTPError:
                m = {}
            if m.get(("flywheel_learner_cycles_total", (("outcome", "published"),))) == 1:
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"no published cycle in 540 s: {m}")
        met = store.manifest("v000002").metrics
        assert m[("flywheel_learner_samples_used_total", ())] == met["data/n_samples"] == 6
        assert m[("flywheel_learner_samples_refused_total", (("reason", "stale"),))] == 2
        assert m[("flywheel_learner_loss", (("objective", "kto"), ("step", "last")))] == pytest.approx(met["kto/loss"])
        assert m[("flywheel_learner_loss", (("objective", "kto"), ("step", "first")))] == pytest.approx(
            met["kto/loss_first"])
        assert m[("flywheel_learner_kl", (("estimator", "k3"),))] == pytest.approx(met["kl/k3"])
        assert m[("flywheel_learner_importance_ratio", (("stat", "mean"),))] == pytest.approx(met["is/ratio_mean"])
        for stat in ("mean", "p99", "max"):
            assert m[("flywheel_learner_mismatch", (("stat", stat),))] == pytest.approx(met[f"mismatch/{stat}"])
        assert m[("flywheel_learner_cycle_duration_seconds_count", ())] == 1
        assert m[("flywheel_learner_cycles_total", (("outcome", "failed"),))] == 0
        assert m[("flywheel_learner_last_publish_timestamp_seconds", ())] > time.time() - 300
        assert m[("flywheel_learner_samples_waiting", ())] == 0
        assert m[("flywheel_learner_paused", ())] == 0
        from modelstore.desired import FleetRecord  # `flywheel pause` writes the fleet's desired state

        FleetRecord(store).change(lambda d: (setattr(d, "paused", {"actor": "test", "at": 0, "reason": "maintenance"}),
                                             d)[1], "test", "pause")
        deadline = time.monotonic() + 30
        while scrape(url)[("flywheel_learner_paused", ())] != 1:
            assert time.monotonic() < deadline, "the pause never showed"
            time.sleep(0.3)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
