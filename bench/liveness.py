"""Liveness of a serving pod while it refuses or tokenises large prompts (Hardening II, defect 4).

    python bench/liveness.py [--quick] [--model-dir DIR]

Serves the model (default: the tiny random MoE with its 512-token byte-level BPE, which
tokenises slowly: the hard case; ``--model-dir``: a checkpoint such as the default model), polls
``/healthz`` every 50 ms on its own connection, and meanwhile posts (1) a 7.5 MB prompt, refused
413 by its ``Content-Length`` before it is read, and (2) a prompt just under the inference body
limit, tokenised and refused 413 for its token count. Side by side in one run: the pod as
shipped (tokenising in its thread pool) and the same pod with tokenisation on the event loop
(the baseline: how it was before). Prints ``RESULT`` lines last.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _measure(url: str, prober_cls, bodies: dict[str, bytes]) -> dict:
    took = {}
    with prober_cls(url) as probe:
        time.sleep(0.3)
        for name, body in bodies.items():
            t = time.perf_counter()
            r = httpx.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"},
                           timeout=300)
            took[name] = (time.perf_counter() - t, r.status_code)
        time.sleep(0.3)
    lat = sorted(probe.latencies)
    return {"took": took, "healthz_max_ms": lat[-1] * 1000, "healthz_p50_ms": lat[len(lat) // 2] * 1000,
            "probes": len(lat), "failures": len(probe.failures)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smaller allowed prompt (about 1 s to tokenise)")
    ap.add_argument("--model-dir", type=Path, default=None, help="checkpoint to serve (default: tiny random MoE)")
    a = ap.parse_args()

    from serving.commands import build_pod
    from tests.servers import ServerThread
    from serving.slots import CheckpointStore
    from tests.conftest import make_tiny_moe
    from tests.test_hardening_serving import _Prober

    model_dir = a.model_dir or make_tiny_moe(Path(tempfile.mkdtemp()) / "tiny")
    line = "def add(a, b): return a + b\n"
    bodies = {"7.5MB": json.dumps({"model": "flywheel", "prompt": line * 268_000, "max_tokens": 1}).encode(),
              "allowed": json.dumps({"model": "flywheel", "prompt": line * (7_000 if a.quick else 30_000),
                                     "max_tokens": 1}).encode()}
    out = {}
    for mode in ("off_loop", "on_loop"):
        pod = build_pod(CheckpointStore(model_dir), pod=f"bench-{mode}", max_batch=2, log_events=False)
        if mode == "on_loop":  # the baseline: the prompt's CPU work on the event loop, as before the fix
            async def on_loop(fn, *args):
                return fn(*args)
            pod.app.state.flywheel.openai.off_loop = on_loop
        srv = ServerThread(pod.app).start()
        try:
            out[mode] = _measure(srv.url, _Prober, bodies)
        finally:
            srv.stop()
            pod.close()
        print(mode, json.dumps(out[mode]))
    new, old = out["off_loop"], out["on_loop"]
    print(f"RESULT healthz_max_ms_during_large_prompt={new['healthz_max_ms']:.0f} ms target<=500 "
          f"(on the loop: {old['healthz_max_ms']:.0f} ms; allowed prompt {len(bodies['allowed'])} bytes, "
          f"{new['took']['allowed'][0]:.2f} s to its 413)")
    print(f"RESULT huge_prompt_413_s={new['took']['7.5MB'][0]:.2f} s target<=3 (7.5 MB body, Content-Length)")


if __name__ == "__main__":
    main()
