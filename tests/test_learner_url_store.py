"""The learner publishes to a model store given as an fsspec URL (issue 6: any fsspec URL)."""

from __future__ import annotations

import uuid

from modelstore.store import ModelStore
from learner.cycle import run_cycle
from learner.trainer import LearnerConfig
from schemas.manifest import state_sha256
from schemas.modelspec import load_model
from test_learner_cycle import write_shard  # noqa: E402
from test_learner_replay import make_samples  # noqa: E402


def test_cycle_publishes_to_a_memory_url_store(tiny_moe_dir, tmp_path, fw_home):
    url = f"memory://flywheel-test-{uuid.uuid4().hex}/store"
    store = ModelStore(url)
    store.init_base(tiny_moe_dir)
    samples = make_samples(load_model(tiny_moe_dir), 4, version="v000000", seed=5)
    write_shard(tmp_path / "samples", samples, "v000000", "a")
    m = run_cycle(url, tmp_path / "samples", tmp_path / "state",
                  LearnerConfig(steps=1, batch_size=4, lr=1e-3), show_progress=False)
    assert m is not None and m.version == "v000001" and m.parent == "v000000" and m.kind == "delta"
    fresh = ModelStore(url)  # another process's view of the same URL
    assert fresh.versions() == ["v000000", "v000001"]
    got = state_sha256(fresh.load("v000001"))  # reconstructed from the delta, hash-verified
    assert got == {k: t.sha256 for k, t in m.tensors.items()}
