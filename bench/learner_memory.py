"""Learner cycle memory vs cycle size: a cycle of N samples must peak no higher than one of 64.

Issue 18's bounded-memory cycle (samples are read per micro-batch, never held whole): in one
process, after a warm-up cycle, a cycle of 64 samples and one of ``--large`` (default 512, 8x;
240 tokens each, with routes, in 64-row shards) run on a tiny MoE; VmHWM (peak RSS) is reset
before each (``/proc/self/clear_refs``), glibc's mmap threshold is fixed so freed blocks leave
RSS. Holding the larger cycle as samples plus one padded batch (as before micro-batching)
costs 17 MB more at 512 (measured for 1024: 10 MB of samples, 25 MB of padded tensors).

Prints, last:
    RESULT learner_cycle_peak_growth_mb=<large - small> MB target<=8 (64 vs N samples)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

PEAK = """
import json, re, sys, time
import torch
torch.set_num_threads(1)  # one thread: no OpenMP spin-waiting on a busy box
from learner.cycle import run_cycle
from learner.trainer import LearnerConfig
root = sys.argv[1]
cfg = LearnerConfig(steps=2, batch_size=8, micro_batch_size=4, lr=1e-4, measure_chunk=8, measure_free_max=1)
out = []
for run in ("warm", "small", "large"):  # warm: one-time allocations (DeepSpeed, gloo) before measuring
    open("/proc/self/clear_refs", "w").write("5")  # resets VmHWM, the peak RSS
    t = time.time()
    m = run_cycle(f"{root}/{run}/store", f"{root}/{run}/samples", f"{root}/{run}/state", cfg, show_progress=False)
    hwm = int(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) / 1024
    out.append({"n": m.metrics["data/n_samples"], "peak_mb": hwm, "s": time.time() - t})
print(json.dumps(out))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--large", type=int, default=512, help="samples of the large cycle (a multiple of 64)")
    a = ap.parse_args()
    import numpy as np

    from conftest import make_tiny_moe
    from modelstore.store import ModelStore
    from samplestore import shards as writer
    from schemas.events import now_ms
    from test_learner_accumulate import _random_samples

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model_dir = make_tiny_moe(tmp / "tiny")
        cfgj = json.loads((model_dir / "config.json").read_text())
        rng, t0 = np.random.default_rng(1), now_ms()
        for run, n in (("warm", 64), ("small", 64), ("large", a.large)):
            ModelStore(tmp / run / "store").init_base(model_dir)
            for c in range(0, n, 64):
                part = _random_samples(rng, 64, 240, t0 + c, cfgj["num_hidden_layers"], cfgj["num_local_experts"],
                                       cfgj["vocab_size"])
                writer.write_shard(part, writer.shard_path(tmp / run / "samples", part[0].sealed_at))
        env = {**os.environ, "PYTHONPATH": str(ROOT), "MALLOC_MMAP_THRESHOLD_": "65536"}
        env.pop("MASTER_PORT", None)
        r = subprocess.run([sys.executable, "-c", PEAK, str(tmp)], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=900)
        if r.returncode != 0:
            sys.exit(f"cycle subprocess failed:\n{r.stderr[-3000:]}")
        _, small, large = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"small cycle: {small['n']} samples, peak {small['peak_mb']:.1f} MB, {small['s']:.1f} s")
    print(f"large cycle: {large['n']} samples, peak {large['peak_mb']:.1f} MB, {large['s']:.1f} s")
    print(f"RESULT learner_cycle_peak_growth_mb={large['peak_mb'] - small['peak_mb']:.1f} MB target<=8 "
          f"({small['n']} vs {large['n']} samples, tiny MoE, 240 tokens each)")


if __name__ == "__main__":
    main()
