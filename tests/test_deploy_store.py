"""Model store: bit-exact deltas, snapshots, corruption and wrong-parent rejection."""

from __future__ import annotations

import json
import math
import shutil
import uuid
from pathlib import Path

import pytest
import torch

from modelstore.store import CorruptVersionError, ModelStore, decode_state
from schemas.manifest import state_sha256
from schemas.modelspec import load_model


def _dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.iterdir() if f.name != "manifest.json")


def _adam_steps(model, n: int, lr: float, seed: int) -> None:
    """n real AdamW steps of next-token loss on random tokens (what the learner does)."""
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(n):
        ids = torch.randint(0, model.config.vocab_size, (2, 16))
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.fixture()
def store(tmp_path, tiny_moe_dir) -> ModelStore:
    s = ModelStore(tmp_path / "store", snapshot_every=4)
    s.init_base(tiny_moe_dir)
    return s


def test_init_base_registers_v0_promoted_and_is_idempotent(store, tiny_moe_dir):
    m0 = store.manifest("v000000")
    assert m0.kind == "snapshot" and m0.parent is None
    assert [s.status for s in m0.status_history] == ["promoted"]
    ref = state_sha256(load_model(tiny_moe_dir).state_dict())
    assert {k: t.sha256 for k, t in m0.tensors.items()} == ref
    assert "lm_head.weight" in m0.tensors and "model.embed_tokens.weight" in m0.tensors  # tied: both
    assert (store.base_dir / "config.json").exists()
    again = store.init_base(tiny_moe_dir)
    assert again.created_at == m0.created_at and store.versions() == ["v000000"]
    assert state_sha256(store.load("v000000")) == ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_publish_load_round_trip_is_bit_exact(tmp_path, tiny_moe_dir, dtype):
    store = ModelStore(tmp_path / "store", snapshot_every=3)
    store.init_base(tiny_moe_dir)
    model = load_model(tiny_moe_dir, dtype=dtype)
    model.load_state_dict(store.load("v000000"))
    expected, parent = {}, "v000000"
    for i in range(4):  # v1 delta, v2 delta, v3 snapshot, v4 delta on a snapshot
        model.train()
        _adam_steps(model, 1, lr=1e-3, seed=i)
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        m = store.publish(state, parent, metrics={"step": i})
        expected[m.version] = state_sha256(state)
        assert [s.status for s in m.status_history] == ["published"]
        parent = m.version
    kinds = [store.manifest(v).kind for v in store.versions()]
    assert kinds == ["snapshot", "delta", "delta", "snapshot", "delta"]
    fresh = ModelStore(tmp_path / "store", snapshot_every=3)  # no cache: replay chains from disk
    for v, ref in expected.items():
        got = fresh.load(v)
        assert state_sha256(got) == ref, v
    # the serving-side path: build from base_dir, load_state_dict (tied weights included)
    m2 = load_model(fresh.base_dir, dtype=dtype)
    m2.load_state_dict(fresh.load("v000004"))
    assert state_sha256(m2.state_dict()) == expected["v000004"]
    assert m2.lm_head.weight.data_ptr() == m2.model.embed_tokens.weight.data_ptr()


def test_delta_is_much_smaller_than_snapshot_for_a_small_update(tmp_path, tiny_moe_dir):
    store = ModelStore(tmp_path / "store", snapshot_every=2)
    store.init_base(tiny_moe_dir)
    state = store.load("v000000")
    g = torch.Generator().manual_seed(0)
    for k, v in state.items():  # 1 % of the entries move by a small step
        mask = torch.rand(v.shape, generator=g) < 0.01
        v.add_(mask * 1e-3 * torch.randn(v.shape, generator=g))
    m1 = store.publish(state, "v000000")
    m2 = store.publish(state, "v000001")  # v2 is a full snapshot of the same weights
    assert (m1.kind, m2.kind) == ("delta", "snapshot")
    d1 = _dir_bytes(store.root / "versions" / "v000001")
    d2 = _dir_bytes(store.root / "versions" / "v000002")
    assert m1.size_bytes == d1 and m2.size_bytes == d2
    raw = sum(v.numel() * v.element_size() for v in state.values())
    assert m1.snapshot_bytes == raw
    assert d2 / d1 > 10, (d1, d2)
    assert store.load("v000001").keys() == state.keys()


def _v1(store):
    state = store.load("v000000")
    for v in state.values():
        v.mul_(1.0001)
    return store.publish(state, "v000000")


def test_flipped_byte_names_the_tensor(store):
    _v1(store)
    vdir = store.root / "versions" / "v000001"
    entries = json.loads((vdir / "index.json").read_text())["entries"]
    victim = entries[5]
    raw = bytearray((vdir / "payload.bin").read_bytes())
    raw[victim["offset"] + victim["length"] // 2] ^= 0x01
    (vdir / "payload.bin").write_bytes(bytes(raw))
    with pytest.raises(CorruptVersionError) as ei:
        ModelStore(store.root).load("v000001")
    assert ei.value.tensor == victim["name"] and "checksum" in ei.value.reason
    assert isinstance(ei.value, ValueError)


def test_truncated_payload_is_rejected(store):
    _v1(store)
    p = store.root / "versions" / "v000001" / "payload.bin"
    p.write_bytes(p.read_bytes()[: p.stat().st_size - 100])
    with pytest.raises(CorruptVersionError, match="truncated"):
        ModelStore(store.root).load("v000001")


def test_delta_on_wrong_parent_is_rejected(store):
    _v1(store)
    state = store.load("v000001")
    for v in state.values():
        v.mul_(1.0001)
    store.publish(state, "v000001")  # v2: delta on v1
    vdir = store.root / "versions" / "v000002"
    entries = json.loads((vdir / "index.json").read_text())["entries"]
    with pytest.raises(CorruptVersionError, match="wrong parent"):
        decode_state("v000002", entries, (vdir / "payload.bin").read_bytes(), store.load("v000000"))
    # a manifest edited to claim another parent is rejected too
    mf = vdir / "manifest.json"
    m = json.loads(mf.read_text())
    m["parent"] = "v000000"
    mf.write_text(json.dumps(m))
    with pytest.raises(CorruptVersionError, match="wrong parent"):
        ModelStore(store.root).load("v000002")


def test_hash_mismatch_against_manifest_is_rejected(store):
    _v1(store)
    mf = store.root / "versions" / "v000001" / "manifest.json"
    m = json.loads(mf.read_text())
    name = sorted(m["tensors"])[0]
    m["tensors"][name]["sha256"] = "0" * 64
    mf.write_text(json.dumps(m))
    with pytest.raises(CorruptVersionError) as ei:
        ModelStore(store.root).load("v000001")
    assert ei.value.tensor == name and "sha256" in ei.value.reason


def test_bad_inputs_and_status(store):
    with pytest.raises(KeyError, match="v000009"):
        store.publish(store.load("v000000"), "v000009")
    with pytest.raises(ValueError, match="state\\['x'\\]"):
        store.publish({"x": [1, 2]}, "v000000")
    with pytest.raises(ValueError, match="version"):
        store.manifest("latest")
    with pytest.raises(ValueError, match="snapshot_every"):
        ModelStore(store.root, snapshot_every=0)
    m = _v1(store)
    store.set_status(m.version, "canary", "5%")
    assert [s.status for s in store.manifest(m.version).status_history] == ["published", "canary"]
    assert store.latest() == "v000001"
    # temp dirs of an interrupted publish are not versions
    (store.root / "versions" / ".tmp-v000002-x").mkdir()
    shutil.copy(store.root / "versions" / "v000001" / "index.json", store.root / "versions" / ".tmp-v000002-x")
    assert store.versions() == ["v000000", "v000001"]


def test_delta_bench_entropy_bound_by_hand_and_bit_exact():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_delta", Path(__file__).parents[1] / "bench" / "delta.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    entropy_bound_bytes, measure = bench.entropy_bound_bytes, bench.measure

    parent = {"w": torch.zeros(8, dtype=torch.bfloat16)}
    assert entropy_bound_bytes(parent, parent) == 0.0
    raw = parent["w"].view(torch.int16).clone()
    raw[3] ^= 1  # one bit flipped in the low byte of one element
    state = {"w": raw.view(torch.bfloat16)}
    # low-byte plane: 7 zeros and one 0x01 -> 8 * H(1/8) bits; high-byte plane all zero -> 0
    h = -(7 / 8 * math.log2(7 / 8) + 1 / 8 * math.log2(1 / 8))
    assert entropy_bound_bytes(state, parent) == pytest.approx(8 * h / 8)
    m = measure(state, parent)  # raises if the round trip is not bit-exact
    assert m["changed_frac"] == 1 / 8 and m["raw"] == 16


# ------------------------------------------------------------------ fsspec URL stores
def test_memory_url_store_round_trip_corruption_and_partial_writes(tiny_moe_dir, fw_home):
    import fsspec

    url = f"memory://store-{uuid.uuid4().hex}"
    store = ModelStore(url, snapshot_every=3)
    assert store.fs is not None and store.root == url
    m0 = store.init_base(tiny_moe_dir)
    ref0 = state_sha256(load_model(tiny_moe_dir).state_dict())
    assert {k: t.sha256 for k, t in m0.tensors.items()} == ref0
    state = store.load("v000000")
    for v in state.values():
        if v.is_floating_point():
            v.add_(1e-3)
    m1 = store.publish(state, "v000000")
    assert m1.kind == "delta" and store.versions() == ["v000000", "v000001"]
    # a fresh store object on the same URL (no cache) reconstructs v1 bit-exactly
    again = ModelStore(url, snapshot_every=3)
    assert state_sha256(again.load("v000001")) == state_sha256(state)
    assert again.set_status("v000001", "canary").status_history[-1].status == "canary"
    assert ModelStore(url).manifest("v000001").status_history[-1].status == "canary"
    # base/ comes down to a local dir the model can be built from
    assert state_sha256(load_model(again.base_dir).state_dict()) == ref0
    # flip one byte of v1's payload: rejected with a clear error
    fs = fsspec.filesystem("memory")
    p = url.split("://", 1)[1] + "/versions/v000001/payload.bin"
    blob = bytearray(fs.cat_file(p))
    blob[len(blob) // 2] ^= 0x01
    fs.pipe_file(p, bytes(blob))
    with pytest.raises(CorruptVersionError, match="checksum"):
        ModelStore(url).load("v000001")
    # a version whose manifest was never written (writer died mid-publish) does not exist
    fs.pipe_file(url.split("://", 1)[1] + "/versions/v000002/payload.bin", b"partial")
    assert ModelStore(url).versions() == ["v000000", "v000001"]
    assert ModelStore(url).publish(store.load("v000000"), "v000000").version == "v000002"


def test_file_url_is_a_local_store(tmp_path, tiny_moe_dir):
    store = ModelStore(f"file://{tmp_path / 'st'}")
    assert store.fs is None and store.root == tmp_path / "st"
    store.init_base(tiny_moe_dir)
    assert ModelStore(tmp_path / "st").versions() == ["v000000"]
    assert (tmp_path / "st" / "base" / "config.json").exists() and (tmp_path / "st" / ".lock").exists()


def _publish_scaled(store: ModelStore, parent: str, scale: float) -> str:
    state = store.load(parent)
    for t in state.values():
        if t.is_floating_point():
            t.mul_(scale)
    return store.publish(state, parent).version


def test_stable_record_follows_promotions_and_rollbacks(store):
    """The stable record is what a restarted pod serves (issue 11, defect 4)."""
    rec = store.stable_record()
    assert (store.stable(), rec["actor"], [h["version"] for h in rec["history"]]) == ("v000000", "init_base",
                                                                                     ["v000000"])
    v1 = _publish_scaled(store, "v000000", 1.001)
    v2 = _publish_scaled(store, v1, 1.001)
    assert store.stable() == "v000000"  # publishing or a canary does not make a version stable
    store.set_status(v1, "canary")
    store.set_status(v1, "promoted", "canary passed", actor="controller")
    store.set_status(v2, "promoted", "manual promote", actor="alice")
    assert store.stable() == v2 and store.previous_stable(v2) == v1
    # rollback --to v000000: v2 rolled back, v0 promoted; v1 keeps its old 'promoted' status
    store.set_status(v2, "rolled_back", "bad", actor="bob")
    store.set_status("v000000", "promoted", "rollback --to", actor="bob")
    assert store.stable() == "v000000" and store.stable_record()["actor"] == "bob"
    assert ModelStore(store.root).stable() == "v000000"  # a freshly opened store (a restarted pod)
    assert store.previous_stable("v000000") == v1  # the last earlier stable not rolled back since
    # a store written before the record existed: the version most recently marked promoted
    (store.root / "stable.json").unlink()
    assert store.stable() == "v000000" and store.previous_stable("v000000") is None
    # a record naming a version the store lost: the same fallback, never a missing version
    (store.root / "stable.json").write_text(json.dumps({"version": "v000009", "history": []}))
    assert store.stable() == "v000000"
    assert store.set_stable(v1, actor="carol")["version"] == v1 and store.stable() == v1
    with pytest.raises(KeyError):
        store.set_stable("v000042")


def test_stable_record_on_a_url_store(tiny_moe_dir, fw_home):
    s = ModelStore(f"memory://stable-{uuid.uuid4().hex}/store")
    s.init_base(tiny_moe_dir)
    v1 = _publish_scaled(s, "v000000", 1.001)
    s.set_status(v1, "promoted", actor="dana")
    assert ModelStore(s.root).stable() == v1  # reopened by URL, as a restarted pod does
    assert s.stable() == v1 and [h["version"] for h in s.stable_record()["history"]] == ["v000000", v1]


def test_load_on_resident_parents_without_cache(store):
    """load(resident=..., cache=False) (a serving pod's loads): a delta is rebuilt on the
    resident parent state it is given (wrong resident bytes are caught by the manifest
    hashes), the result equals the cached path bit for bit, and nothing is cached."""
    s0 = store.load("v000000")
    s1 = {k: v + 1e-3 if "experts" in k else v.clone() for k, v in s0.items()}
    v1 = store.publish(s1, "v000000").version
    store.clear_cache()
    got = store.load(v1, resident={"v000000": s0}, cache=False)
    assert not store._cache  # nothing kept in memory by the store
    want = store.load(v1)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    store.clear_cache()
    bad = {k: v.clone() for k, v in s0.items()}
    k = next(k for k in bad if "experts" in k)
    bad[k] += 1.0  # a resident copy that is not v0's bytes
    with pytest.raises(CorruptVersionError, match=k.split(".")[-1]):
        store.load(v1, resident={"v000000": bad}, cache=False)
    assert store.load(v1, cache=False).keys() == want.keys() and not store._cache


def test_learner_trains_from_the_stable_record_not_the_newest_promoted(tiny_moe_dir, tmp_path):
    """After promote v1 and `rollback --to v000000` the learner's parent is v000000 (the same
    class of defect as a restart undoing a rollback, issue 11 defect 4)."""
    from learner.cycle import parent_version

    store = ModelStore(tmp_path / "store")
    store.init_base(tiny_moe_dir)
    state = store.load("v000000")
    m1 = store.publish(state, "v000000", metrics={})
    store.set_status(m1.version, "promoted", "canary passed")
    assert parent_version(store, "stable") == "v000001"
    store.set_stable("v000000", actor="oncall", reason="rollback --to v000000")
    assert parent_version(store, "stable") == "v000000"
    assert parent_version(store, "latest") == "v000001"
