"""Stale weights after the store changed (issue 11, defect 6): a version's files replaced
under the same id are loaded as they are now (the store's cache is keyed on the manifest
digest and file identity), and a served digest that differs from the manifest is flagged in
`/admin/slots` (``digest_ok: false``) and `flywheel status` with the command that fixes it.

A real pod (torch engine, tiny MoE, uvicorn) over a real model store; the replacement files
are a real publish of other weights under the same version id in a second store.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import typer
from typer.testing import CliRunner

from deploy.commands import register
from deploy.serving_client import ServingAdmin
from modelstore.store import CorruptVersionError, ModelStore
from schemas.manifest import digest_of_hashes, state_sha256
from serving.commands import build_pod
from servers import ServerThread
from tests.test_deploy_controller import publish_v
from tests.test_deploy_durable import desire_candidate

TOKEN = "stale-admin"


def _other_v1(tmp_path, tiny_moe_dir, scale: float, name: str):
    """A v000001 with other weights than the first one, published in a store of its own."""
    other = ModelStore(tmp_path / name)
    other.init_base(tiny_moe_dir)
    return other, publish_v(other, "v000000", scale=scale)


def _replace_v1(store: ModelStore, other: ModelStore) -> None:
    d = store.root / "versions" / "v000001"
    shutil.rmtree(d)
    shutil.copytree(other.root / "versions" / "v000001", d)


def test_store_reloads_a_version_whose_files_changed_under_the_same_id(tmp_path, tiny_moe_dir):
    store = ModelStore(tmp_path / "store")
    store.init_base(tiny_moe_dir)
    m1 = publish_v(store, "v000000", scale=1.001)
    first = store.load("v000001")
    assert digest_of_hashes(state_sha256(first)) == m1.weights_digest
    cached = store._cache["v000001"][1]
    store.set_status("v000001", "canary", "a status change rewrites the manifest, not the weights")
    store.load("v000001")
    assert store._cache["v000001"][1] is cached  # still a cache hit
    other, m1b = _other_v1(tmp_path, tiny_moe_dir, 1.002, "other")
    _replace_v1(store, other)
    again = store.load("v000001")  # was a stale cache hit, then "sha256 mismatch" in serving
    assert digest_of_hashes(state_sha256(again)) == m1b.weights_digest != m1.weights_digest
    assert not torch.equal(again["model.embed_tokens.weight"], first["model.embed_tokens.weight"])
    # bytes changed under an unchanged manifest: refused, never served from the cache
    p = store.root / "versions" / "v000001" / "payload.bin"
    raw = bytearray(p.read_bytes())
    raw[len(raw) // 3] ^= 0xFF
    p.write_bytes(bytes(raw))
    with pytest.raises(CorruptVersionError, match="checksum"):
        store.load("v000001")
    assert store.invalidate("v000001") is False  # the failed load left nothing cached
    assert store.invalidate("v000000") is True


@pytest.fixture()
def pod_env(request, tmp_path, tiny_moe_dir, fw_home, monkeypatch):
    """One pod; ``indirect`` param: its watch of the record every that many s (None: no watch)."""
    store = ModelStore(tmp_path / "store")
    store.init_base(tiny_moe_dir)
    m1 = publish_v(store, "v000000", scale=1.001)
    pod = build_pod(ModelStore(store.root), pod="stale", max_batch=2, admin_token=TOKEN, log_events=False,
                    desired_poll_s=getattr(request, "param", None))
    srv = ServerThread(pod.app).start()
    for k, v in {"FLYWHEEL_STORE": str(store.root), "FLYWHEEL_ADMIN_TOKEN": TOKEN,
                 "FLYWHEEL_SERVING_URL": srv.url, "USER": "oncall-hana"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("FLYWHEEL_KAFKA_BOOTSTRAP", raising=False)
    admin = ServingAdmin(srv.url, TOKEN, timeout_s=60)
    yield store, m1, admin
    admin.close()
    srv.stop()
    pod.close()


@pytest.mark.parametrize("pod_env", [0.2], indirect=True)  # the CLI's actions converge through the pod's watch
def test_pod_flags_and_reloads_changed_files(pod_env, tmp_path, tiny_moe_dir):
    store, m1, admin = pod_env
    app = typer.Typer()
    register(app)
    run = CliRunner().invoke
    desire_candidate(store.root, "v000001")
    s = admin.load("v000001")
    assert (s.candidate.weights_digest, s.candidate.digest_ok) == (m1.weights_digest, True)
    assert s.stable.digest_ok is True and s.stable.manifest_digest == store.manifest("v000000").weights_digest
    other, m1b = _other_v1(tmp_path, tiny_moe_dir, 1.002, "other")
    _replace_v1(store, other)
    s = admin.slots()  # the pod still serves the old bytes: flagged
    assert s.candidate.weights_digest == m1.weights_digest
    assert (s.candidate.manifest_digest, s.candidate.digest_ok) == (m1b.weights_digest, False)
    r = run(app, ["status", "--json"])
    j = json.loads(r.output)
    assert j["serving"]["candidate"]["digest_ok"] is False
    assert any("candidate v000001" in w and "files changed under the same id" in w
               and "flywheel canary start v000001 --yes" in w for w in j["warnings"]), j["warnings"]
    out = " ".join(run(app, ["status"]).output.split())
    assert "NO" in out and "warning:" in out
    s = admin.load("v000001")  # the new files load (no "sha256 mismatch" from a stale cache)
    assert (s.candidate.weights_digest, s.candidate.digest_ok) == (m1b.weights_digest, True)
    # the candidate is at weight 0 (desire_candidate's default) and no controller runs here
    w = json.loads(run(app, ["status", "--json"]).output)["warnings"]
    assert len(w) == 1 and "the candidate v000001 is held at 0 % (no user is sent to it)" in w[0], w
    assert "no controller has run" in w[0], w
    # the same for stable: promote, change the files again, the fix the warning names
    assert run(app, ["promote", "--yes"]).exit_code == 0
    other2, m1c = _other_v1(tmp_path, tiny_moe_dir, 1.003, "other2")
    _replace_v1(store, other2)
    j = json.loads(run(app, ["status", "--json"]).output)
    assert j["serving"]["stable"]["digest_ok"] is False
    assert any("stable v000001" in w and "flywheel rollback --to v000001 --yes" in w for w in j["warnings"])
    r = run(app, ["rollback", "--to", "v000001", "--yes", "--reason", "reload changed files"])
    assert r.exit_code == 0, r.output
    s = admin.slots()
    assert (s.stable.version, s.stable.weights_digest, s.stable.digest_ok) == ("v000001", m1c.weights_digest, True)
    assert json.loads(run(app, ["status", "--json"]).output)["warnings"] == []


def test_status_warns_when_served_stable_is_not_the_stable_record(pod_env):
    store, m1, admin = pod_env
    app = typer.Typer()
    register(app)
    admin.load("v000001")
    admin.promote()  # by hand on the pod, not through the CLI: the desired state still says v000000
    j = json.loads(CliRunner().invoke(app, ["status", "--json"]).output)
    assert j["stable_record"]["version"] == "v000000" and j["desired"]["stable"] == "v000000"
    assert any("serves v000001 as stable but the fleet's desired state says v000000" in w
               and "flywheel rollback --to v000001 --yes" in w for w in j["warnings"]), j["warnings"]


def test_instant_rollback_to_the_resident_version_rechecks_the_store(pod_env, tmp_path):
    """Rolling back to the version stable before the last promote reuses its resident weights
    only while they still equal the store's manifest."""
    from tests.conftest import make_tiny_moe

    store, m1, admin = pod_env
    admin.load("v000001")
    admin.promote()  # v000000 stays resident for an instant rollback
    other = ModelStore(tmp_path / "other0")
    other.init_base(make_tiny_moe(tmp_path / "seed1", seed=1))
    d0 = other.manifest("v000000").weights_digest
    assert d0 != store.manifest("v000000").weights_digest
    shutil.rmtree(store.root / "versions" / "v000000")
    shutil.copytree(other.root / "versions" / "v000000", store.root / "versions" / "v000000")
    s = admin.rollback("v000000")
    assert (s.stable.version, s.stable.weights_digest, s.stable.digest_ok) == ("v000000", d0, True)
