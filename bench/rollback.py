"""Rollback benchmark (issue 6): how long `flywheel rollback --to VERSION` takes to restore
serving's weights on the default model, component by component.

`rollback --to V` makes serving (``/admin/rollback``) reconstruct V from the model store
(``ModelStore.load``: read, zstd-decode, un-XOR the delta chain, sha256-verify every tensor),
verify the hashes again against the manifest, and swap the stable slot (a pointer flip). This
script times the store-side reconstruction cold (a fresh store object: nothing cached, as
after a serving restart) and warm (the version is among the two the store keeps reconstructed,
as when rolling back to the version promoted just before), plus the engine-side work:
``load_state_dict`` into the live module and one more sha256 pass (serving's hash check).

    python bench/rollback.py [--quick] [--model-dir DIR] [--keep DIR]

Default model: the real SmolLM2 MoE (``~/.cache/flywheel/models/smollm2-135m-moe``) in fp32,
else ``schemas.settings.base_model_dir()``; ``--quick``: a tiny random MoE. Builds a store
in a temp dir (base v000000 snapshot + one delta v000001) and rolls back from v1 to v0.
Prints ``RESULT`` lines last: ``rollback_restore_s_warm`` / ``_cold`` target <= 5 s.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from modelstore.store import ModelStore  # noqa: E402
from schemas.manifest import state_sha256  # noqa: E402

REAL_MODEL = Path.home() / ".cache" / "flywheel" / "models" / "smollm2-135m-moe"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny random MoE")
    ap.add_argument("--model-dir", type=Path, default=None, help="HF checkpoint (default: the real model)")
    a = ap.parse_args(argv)
    from schemas.modelspec import load_model

    tmp = Path(tempfile.mkdtemp(prefix="fw-rollback-"))
    try:
        if a.quick:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
            from conftest import make_tiny_moe

            model_dir = a.model_dir or make_tiny_moe(tmp / "tiny", num_layers=4)
        else:
            from schemas.settings import base_model_dir

            model_dir = a.model_dir or (REAL_MODEL if (REAL_MODEL / "config.json").exists() else base_model_dir())
        t0 = time.perf_counter()
        store = ModelStore(tmp / "store")
        store.init_base(model_dir)
        t_init = time.perf_counter() - t0
        state = store.load("v000000")
        for v in state.values():  # a one-step-sized change (1e-6 relative) for the delta
            if v.is_floating_point():
                v.mul_(1 + 1e-6)
        t0 = time.perf_counter()
        store.publish(state, "v000000")
        t_pub = time.perf_counter() - t0
        del state
        model = load_model(store.base_dir)  # the live module serving runs
        model.load_state_dict(store.load("v000001"))
        raw_mb = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 1e6

        def restore(s: ModelStore) -> dict:
            t0 = time.perf_counter()
            st = s.load("v000000")  # reconstruct + verify every tensor's sha256
            t1 = time.perf_counter()
            expected = {k: m.sha256 for k, m in s.manifest("v000000").tensors.items()}
            assert state_sha256(st) == expected  # serving's second hash check
            t2 = time.perf_counter()
            model.load_state_dict(st)
            t3 = time.perf_counter()
            return {"store_load_s": t1 - t0, "verify_s": t2 - t1, "load_state_dict_s": t3 - t2, "total_s": t3 - t0}

        cold = restore(ModelStore(tmp / "store"))  # fresh object: nothing cached
        warm_store = ModelStore(tmp / "store")
        warm_store.load("v000000")
        warm_store.load("v000001")  # serving had stable v0 then promoted v1: both cached
        warm = restore(warm_store)
        print(f"model {model_dir}: {raw_mb:.0f} MB of weights; init_base {t_init:.1f}s, publish delta {t_pub:.1f}s")
        for name, r in (("cold", cold), ("warm", warm)):
            print(f"{name}: store.load {r['store_load_s']:.2f}s + hash check {r['verify_s']:.2f}s + "
                  f"load_state_dict {r['load_state_dict_s']:.2f}s = {r['total_s']:.2f}s")
        print(f"RESULT rollback_restore_s_warm={warm['total_s']:.2f} s target<=5")
        print(f"RESULT rollback_restore_s_cold={cold['total_s']:.2f} s target<=5")
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
