"""A rollout across two real serving pods on different ports (issue 6, "many pods").

Both pods are real `serving` apps (torch engine, tiny MoE, uvicorn on their own ports, event
log to the real broker) over one model store. The controller canaries v000001 on both;
after promotion both serve the learner's hashes. A pod whose store copy is corrupt fails to
load the candidate: the rollout aborts, is reported, and both pods keep serving v000000.
"""

from __future__ import annotations

import shutil

import httpx

from deploy.analysis import AnalysisConfig
from deploy.controller import ControllerConfig, RolloutController, RolloutPhase
from deploy.ledger import decisions
from deploy.serving_client import ServingAdmin
from modelstore.store import ModelStore
from serving.commands import build_pod
from servers import ServerThread
from tests.test_deploy_controller import Clock, publish_v, write_votes

TOKEN = "admin-secret"


def _pod(store_root, name):
    pod = build_pod(ModelStore(store_root), pod=name, max_batch=4, admin_token=TOKEN)
    srv = ServerThread(pod.app).start()
    return pod, srv


def test_rollout_across_two_real_pods(tmp_path, tiny_moe_dir, fw_home, broker_env):
    store = ModelStore(tmp_path / "store")
    store.init_base(tiny_moe_dir)
    v0 = store.manifest("v000000")
    # pod-b reads its own copy of the store, which we corrupt for the second rollout
    root_b = tmp_path / "store-b"
    shutil.copytree(store.root, root_b)
    pods = [_pod(store.root, "pod-a"), _pod(root_b, "pod-b")]
    admins = [ServingAdmin(srv.url, TOKEN) for _, srv in pods]
    assert len({srv.port for _, srv in pods}) == 2
    samples = tmp_path / "samples"
    ledger_path = fw_home / "ledger.duckdb"
    try:
        m1 = publish_v(store, "v000000")
        shutil.rmtree(root_b / "versions", ignore_errors=True)
        shutil.copytree(store.root / "versions", root_b / "versions")
        clock = Clock()

        def ctl():
            return RolloutController(store, admins, samples, ledger_path, fw_home / "rollout.json",
                                     ControllerConfig(steps=(0.5, 1.0), analysis=AnalysisConfig(
                                         min_votes=5, delta=0.9, tau=0.3, min_guard_completions=5)),
                                     clock=clock, arm_metrics=False)

        st = ctl().reconcile()
        assert st.phase == RolloutPhase.CANARY
        for a in admins:  # both pods reconstructed v000001 from the delta and verified it
            s = a.slots()
            assert s.candidate.version == "v000001" and s.candidate.weights_digest == m1.weights_digest
            assert s.candidate_weight == 0.5
        write_votes(samples, "v000001", 5, 1, clock.t)
        write_votes(samples, "v000000", 5, 1, clock.t)
        st = ctl().reconcile()
        assert st.phase == RolloutPhase.PROMOTED, st.last_reason
        for a, (_, srv) in zip(admins, pods):
            s = a.slots()
            assert s.stable.version == "v000001" and s.stable.weights_digest == m1.weights_digest
            r = httpx.post(srv.url + "/v1/completions", json={"model": "flywheel", "prompt": [5, 6, 7], "max_tokens": 2},
                           timeout=60)
            assert r.status_code == 200 and r.headers["x-flywheel-model-version"] == "v000001"

        # second rollout: pod-b's copy of v000002 is corrupt -> it fails to load; aborted, reported
        m2 = publish_v(store, "v000001")
        shutil.copytree(store.root / "versions" / m2.version, root_b / "versions" / m2.version)
        payload = root_b / "versions" / m2.version / "payload.bin"
        raw = bytearray(payload.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        payload.write_bytes(bytes(raw))
        st = ctl().reconcile()
        assert st.phase in (RolloutPhase.FAILED, RolloutPhase.ABORTED), st.last_reason
        assert "pod-b" in st.last_reason or admins[1].base_url in st.last_reason
        last = decisions(ledger_path, "v000002")[-1]
        assert last.decision in ("FAILED", "ABORT")
        for a in admins:  # nobody serves the broken rollout; stable untouched on both pods
            s = a.slots()
            assert s.stable.version == "v000001" and s.candidate is None
        assert v0.weights_digest != m1.weights_digest
    finally:
        for a in admins:
            a.close()
        for pod, srv in pods:
            srv.stop()
            pod.close()
