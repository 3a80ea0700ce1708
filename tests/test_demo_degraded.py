"""The demo's --bad-candidate (issue 10 item 6): a degraded version published on top of the
stable, whose greedy replies differ, so its canary has something real to roll back."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from modelstore.store import ModelStore
from flywheel.demo import Demo


def test_publish_degraded_noises_only_the_last_layers_mlp(tiny_moe_dir, tmp_path):
    store = ModelStore(tmp_path / "store")
    store.init_base(tiny_moe_dir)
    fake = SimpleNamespace(store=store, cfg=SimpleNamespace(seed=0), log=lambda msg: None)
    v = Demo.publish_degraded(fake, noise=0.5, layers=1)
    m = store.manifest(v)
    assert m.parent == "v000000" and "degraded" in m.metrics and m.kind == "delta"
    before, after = store.load("v000000"), store.load(v)
    n_layers = 1 + max(int(k.split(".")[2]) for k in before if k.startswith("model.layers."))
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed, "nothing was degraded"
    for k in changed:  # only MLP/expert weights of the last layer, never the router
        assert k.startswith(f"model.layers.{n_layers - 1}.") and ("mlp" in k or "experts" in k), k
        assert "gate.weight" not in k
        rel = ((after[k] - before[k]).float().std() / before[k].float().std()).item()
        assert 0.4 < rel < 0.6, (k, rel)  # noise of 0.5 x the tensor's std
