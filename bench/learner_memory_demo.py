"""Learner peak memory, cycle 2 against cycle 1, the way the full demo runs the learner.

The full demo (``flywheel.demo``) runs each cycle as its own ``flywheel learn --once``
process on the default model (SmolLM2-135M-Instruct upcycled to a 4-expert top-2 MoE, 373M
parameters, fp32) with ``DEMO_LEARNER``'s settings (REINFORCE, batch 12, 8 trained layers,
reference pass 8 samples per forward). Cycle 1 trains v000001 from v000000 (a snapshot);
the canary promotes it and cycle 2 trains v000002 from v000001, a delta on v000000, on the
samples of both versions. This bench does the same with synthetic samples of the demo's
sizes: a quarter HumanEval-like (prompt 323 tokens, the longest of the demo's 40 problems,
completion 160 = ``max_tokens``), the rest reasoning-gym-like (prompt 46-55, completion
4-48); token ids over the whole 49,152-token vocabulary, routes for all 30 layers. Each
cycle runs in a fresh process through ``learner.daemon.build_learner(...).cycle()`` (what
``flywheel learn --once`` calls), with fewer optimizer steps than the demo's 8 (``--steps``;
every step's batch holds a longest sample, so a step's peak does not depend on the draw).

Peak RSS per phase is exact: VmHWM is reset (``/proc/self/clear_refs``) when each phase
starts and read when it ends (load the parent, the reference pass, DeepSpeed's engine, each
optimizer step, publish; ``(between)`` is the most between two of them), so the cycle's
peak is the largest phase's. (``wait4``'s ``ru_maxrss`` cannot stand in: the resets lower
the high-water mark it is read from.)

Prints the per-phase table of each cycle, then, last::

    RESULT learner_peak_rss_cycle1_gb=<GB>
    RESULT learner_peak_rss_cycle2_gb=<GB>
    RESULT learner_peak_rss_cycle2_vs_cycle1=<ratio> target<=1.1

Needs the default model: ``flywheel model init`` (or ``--model-dir``). Peaks near 12 GB
(the optimizer step: batch 12 x 482 tokens x the 49,152-token vocabulary's logits);
about 12 minutes on 2 busy cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# The child: one learner cycle, as `flywheel learn --once` runs it, with exact per-phase peaks.
CHILD = r"""
import json, re, sys, time
root, steps = sys.argv[1], int(sys.argv[2])

def hwm_mb():
    return int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1)) / 1024

def reset():
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM := current RSS

phases = []  # (name, peak MB)

def probe(owner, attr, name):
    fn = getattr(owner, attr)
    def wrapped(*a, **k):
        phases.append(("(between)", hwm_mb()))
        reset()
        try:
            return fn(*a, **k)
        finally:
            phases.append((name, hwm_mb()))
            reset()
    setattr(owner, attr, wrapped)

import learner.cycle as lc
import learner.trainer as lt
from modelstore.store import ModelStore
from learner.config import LearnerConfig
from learner.daemon import DaemonConfig, build_learner
from flywheel.demo_config import DEMO_LEARNER

probe(lc, "_load_parent", "load parent")
probe(lt, "_measure_pass", "reference pass")
probe(lt, "_engine", "DeepSpeed engine")
probe(lt, "accumulate_step", "step")
probe(ModelStore, "publish", "publish")
cfg = LearnerConfig(**{**DEMO_LEARNER, "steps": steps})
learner = build_learner(cfg, DaemonConfig(store=f"{root}/store", samples=f"{root}/samples", state=f"{root}/state"),
                        say=lambda s: print(s, file=sys.stderr))
phases.append(("(start)", hwm_mb()))
reset()
t = time.time()
learner.cycle()
phases.append(("(end)", hwm_mb()))
print(json.dumps({"phases": phases, "s": time.time() - t}))
"""


def _samples(rng, n: int, versions: list[str], t0: int, vocab: int, layers: int, experts: int, top_k: int):
    """``n`` synthetic RewardedSamples of the demo's sizes (module docstring), rewards +-1."""
    import uuid

    from schemas.events import ExpertRoutes, RewardedSample, SamplingParams

    out = []
    for i in range(n):
        if i % 4 == 0:  # HumanEval-like: the longest prompt of the demo's problems, max_tokens
            P, C = 323, 160
        else:
            P, C = int(rng.integers(46, 56)), int(rng.integers(4, 49))
        r = float(rng.choice([-1.0, 1.0]))
        out.append(RewardedSample(
            completion_id=uuid.UUID(int=int(rng.integers(1 << 62)) << 64 | i), model_version=versions[i % len(versions)],
            created_at=t0 - 1000, user_hash=f"u{i % 256}", prompt_token_ids=rng.integers(3, vocab, P).tolist(),
            completion_token_ids=rng.integers(3, vocab, C).tolist(),
            behavior_logprobs=rng.uniform(-6.0, -0.1, C).tolist(), sampling=SamplingParams(),
            expert_routes=ExpertRoutes.from_array(rng.integers(0, experts, (P + C - 1, layers, top_k)).astype("uint8")),
            finish_reason="stop", reward=r, label=r > 0, n_votes=1, votes_up=int(r > 0), votes_down=int(r < 0),
            event_ids=[str(uuid.UUID(int=int(rng.integers(1 << 62)) << 64 | i))], sealed_at=t0 + i))
    return out


def _write(samples_dir: Path, samples: list) -> None:
    from samplestore import shards as writer

    for c in range(0, len(samples), 64):
        part = samples[c:c + 64]
        writer.write_shard(part, writer.shard_path(samples_dir, part[0].sealed_at))


def _cycle(root: Path, steps: int) -> dict:
    """One learner cycle in its own process; its phases' peaks (MB)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("MASTER_PORT", None)
    out = open(root / "child.out", "w+")
    err = open(root / "child.err", "w+")
    p = subprocess.run([sys.executable, "-c", CHILD, str(root), str(steps)], cwd=ROOT, env=env, stdout=out,
                       stderr=err)
    out.seek(0)
    err.seek(0)
    if p.returncode != 0:
        sys.exit(f"learner cycle failed (exit {p.returncode}):\n{err.read()[-4000:]}")
    return json.loads(out.read().strip().splitlines()[-1])


def _table(name: str, res: dict) -> float:
    """Print a cycle's phases (merged: the max of repeated names); returns its peak (MB)."""
    merged: dict[str, float] = {}
    for ph, mb in res["phases"]:
        merged[ph] = max(merged.get(ph, 0.0), mb)
    peak = max(merged.values())
    print(f"{name}: peak {peak / 1024:.2f} GB, {res['s']:.0f} s")
    for ph, mb in merged.items():
        print(f"  {ph:<18} {mb / 1024:6.2f} GB")
    return peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="the upcycled default model (default: `flywheel model init`'s cache)")
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps per cycle (the demo: 8)")
    ap.add_argument("--n1", type=int, default=24, help="samples of cycle 1 (v000000's)")
    ap.add_argument("--n2", type=int, default=48, help="samples of cycle 2 (v000000's and v000001's; twice cycle 1's)")
    ap.add_argument("--keep", type=Path, default=None, help="work directory kept afterwards (default: a temp dir)")
    a = ap.parse_args()
    import numpy as np

    from modelstore.store import ModelStore
    from schemas.events import now_ms

    model_dir = a.model_dir
    if model_dir is None:
        from schemas.settings import base_model_dir

        model_dir = base_model_dir()
    cfgj = json.loads((Path(model_dir) / "config.json").read_text())
    dims = (cfgj["vocab_size"], cfgj["num_hidden_layers"], cfgj["num_local_experts"], cfgj["num_experts_per_tok"])
    with tempfile.TemporaryDirectory(prefix="flywheel-memdemo-") as d:
        root = a.keep or Path(d)
        root.mkdir(parents=True, exist_ok=True)
        store = ModelStore(root / "store")
        if not store.versions():
            store.init_base(Path(model_dir))
        rng = np.random.default_rng(0)
        _write(root / "samples", _samples(rng, a.n1, ["v000000"], now_ms(), *dims))
        c1 = _cycle(root, a.steps)
        store.set_status(store.latest(), "promoted", reason="bench: the canary promoted it", actor="bench")
        _write(root / "samples", _samples(rng, a.n2, ["v000000", store.latest()], now_ms(), *dims))
        c2 = _cycle(root, a.steps)
        if len(store.versions()) != 3:
            sys.exit(f"expected 3 versions after two cycles, store has {store.versions()}")
    p1 = _table(f"cycle 1 (v000000 -> v000001, {a.n1} samples)", c1)
    p2 = _table(f"cycle 2 (v000001 -> v000002, {a.n2} samples)", c2)
    print(f"RESULT learner_peak_rss_cycle1_gb={p1 / 1024:.2f} GB")
    print(f"RESULT learner_peak_rss_cycle2_gb={p2 / 1024:.2f} GB")
    print(f"RESULT learner_peak_rss_cycle2_vs_cycle1={p2 / p1:.3f} target<=1.1 (default model, demo learner "
          f"settings, {a.steps} steps a cycle, each cycle its own process)")


if __name__ == "__main__":
    main()
