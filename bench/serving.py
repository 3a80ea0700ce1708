"""Serving figures (DESIGN §6), measured side by side in one run on one model.

``python bench/serving.py [--quick] [--model-dir DIR]`` prints, as its last lines, one line
per figure: ``RESULT <metric>=<value> <unit> target<op><value>``:

* ``logging_overhead_ratio``: median request latency with event logging on (real broker)
  / off, same pod, interleaved requests (target <= 1.02).
* ``throughput_vs_hf_generate``: completion tokens/s of the engine vs ``model.generate`` on
  the same weights, batch and prompts, greedy, same token budget (reported; target >= 1).
* ``swap_failed_requests``: failed requests while promoting under load (target == 0).
* ``swap_pause_vs_cold_reload``: promote pause / time to load+verify a version (<= 0.01).
"""

from __future__ import annotations

import sys
from pathlib import Path as _P

sys.path.insert(0, str(_P(__file__).resolve().parents[1]))  # run from a checkout

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path


def _latency_ms(client, url: str, body: dict, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = client.post(url, json=body)
        r.raise_for_status()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def run(model_dir: Path, quick: bool = False) -> dict[str, float]:
    """Measure every figure; returns ``{metric: value}``."""
    import httpx
    import torch

    from flywheel.broker import spawn
    from schemas.events import SamplingParams
    from schemas.modelspec import left_pad
    from serving.app import create_app
    from serving.commands import build_pod
    from serving.params import GenRequest
    from serving.server import ServerThread
    from serving.slots import CheckpointStore

    res: dict[str, float] = {}
    n_req = 10 if quick else 40
    max_tokens = 8 if quick else 32
    b = spawn()
    tmp = Path(tempfile.mkdtemp(prefix="fw-bench-"))
    pod = build_pod(CheckpointStore(model_dir), pod="bench", bootstrap=b.bootstrap, journal=tmp / "j")
    off_app = create_app(pod.slots, None, pod="bench-off", salt="x")
    on_srv, off_srv = ServerThread(pod.app).start(), ServerThread(off_app).start()
    try:
        body = {"model": "m", "prompt": "def add(a, b):", "max_tokens": max_tokens, "temperature": 0}
        with httpx.Client(timeout=300) as c:
            _latency_ms(c, on_srv.url + "/v1/completions", body, 2)  # warm up
            _latency_ms(c, off_srv.url + "/v1/completions", body, 2)
            on, off = [], []
            for _ in range(n_req):  # interleave so drift hits both equally
                on += _latency_ms(c, on_srv.url + "/v1/completions", body, 1)
                off += _latency_ms(c, off_srv.url + "/v1/completions", body, 1)
        res["logging_overhead_ratio"] = statistics.median(on) / statistics.median(off)
        pod.event_log.flush(30)

        # throughput vs HF generate, same batch and prompts, greedy, no early stop on either side
        eng, lm = pod.engine, pod.slots.stable
        B = 4 if quick else 8
        prompts = [[(7 * i + j) % 200 + 10 for j in range(6 + i)] for i in range(B)]
        sp = SamplingParams(temperature=0, max_tokens=max_tokens)
        saved_eos = eng.eos_id
        eng.eos_id = -1  # benchmark only: generate the full budget like HF with eos disabled
        try:
            eng.pause()
            futs = [eng.submit(GenRequest(prompt_token_ids=p, sampling=sp, model=lm)) for p in prompts]
            t0 = time.perf_counter()
            eng.resume()
            outs = [f.result(600) for f in futs]
            t_eng = time.perf_counter() - t0
        finally:
            eng.eos_id = saved_eos
        toks_eng = sum(len(o.completion_token_ids) for o in outs)
        ids, mask = left_pad(prompts, eng.pad_id)
        with torch.inference_mode():
            t0 = time.perf_counter()
            g = lm.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                                  min_new_tokens=max_tokens, do_sample=False, pad_token_id=eng.pad_id)
            t_hf = time.perf_counter() - t0
        toks_hf = (g.shape[1] - ids.shape[1]) * B
        res["throughput_vs_hf_generate"] = (toks_eng / t_eng) / (toks_hf / t_hf)

        # hot swap under load vs a cold reload of the same version
        t0 = time.perf_counter()
        pod.slots.load_candidate("v000000")
        cold_ms = (time.perf_counter() - t0) * 1000
        failures, stop = [], threading.Event()

        def client(i):
            with httpx.Client(timeout=300) as c:
                while not stop.is_set():
                    try:
                        r = c.post(on_srv.url + "/v1/completions", json=dict(body, max_tokens=4),
                                   headers={"x-flywheel-user": f"b{i}"})
                        if r.status_code != 200:
                            failures.append(r.status_code)
                    except httpx.HTTPError as exc:
                        failures.append(repr(exc))
        ths = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        for t in ths:
            t.start()
        time.sleep(1.0)
        st = pod.slots.promote()
        time.sleep(1.0)
        stop.set()
        for t in ths:
            t.join(60)
        res["swap_failed_requests"] = float(len(failures))
        res["swap_pause_vs_cold_reload"] = st.last_swap_pause_ms / cold_ms
        res["_swap_pause_ms"] = st.last_swap_pause_ms
        res["_cold_reload_ms"] = cold_ms
    finally:
        on_srv.stop()
        off_srv.stop()
        pod.close()
        b.stop()
    return res


def main() -> None:
    from schemas import settings

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests and tokens")
    ap.add_argument("--model-dir", type=Path, default=None, help="HF checkpoint (default: the base model)")
    a = ap.parse_args()
    r = run(a.model_dir or settings.base_model_dir(), quick=a.quick)
    print(f"swap pause {r['_swap_pause_ms']:.3f} ms, cold reload {r['_cold_reload_ms']:.1f} ms")
    print(f"RESULT logging_overhead_ratio={r['logging_overhead_ratio']:.4f} x target<=1.02")
    print(f"RESULT throughput_vs_hf_generate={r['throughput_vs_hf_generate']:.3f} x target>=1.0")
    print(f"RESULT swap_failed_requests={int(r['swap_failed_requests'])} requests target==0")
    print(f"RESULT swap_pause_vs_cold_reload={r['swap_pause_vs_cold_reload']:.6f} x target<=0.01")


if __name__ == "__main__":
    main()
