"""Serving figures (DESIGN §6, issue 14), measured side by side in one run.

``python bench/serving.py [--quick] [--model-dir DIR] [--vllm]`` prints, as its last lines, one
line per figure: ``RESULT <metric>=<value> <unit> target<op><value>``:

* ``continuous_vs_static_throughput``: torch engine, continuous (iteration-level) vs static
  scheduler on the same model, completion tokens/s under the same open-loop Poisson load at
  the highest of three rates (0.4x, 0.8x and 1.6x the continuous engine's measured capacity,
  so the highest is above saturation), 32-token greedy completions (eos off), streamed over
  HTTP, event logging on (real broker) (target >= 1.3). Also ``..._ttft_p50`` / ``_p99``
  (continuous / static at that rate; lower is better) and every rate's figures in the log.
* ``vllm_engine_vs_vllm_server_throughput`` / ``..._ttft_p50`` (with ``--vllm``):
  ``flywheel serve --engine vllm`` vs vLLM's own OpenAI server
  (``python -m vllm.entrypoints.openai.api_server``) from the vLLM venv, same checkpoint, same
  engine options and the same Poisson load (rates from the vLLM server's measured capacity):
  throughput at the highest rate (target >= 0.9), TTFT p50 at the middle rate, below
  saturation (target <= 1.2).
* ``logging_overhead_ratio``: request latency with event logging on (real broker) / off,
  same pod, median over interleaved request pairs (40 x 32 greedy tokens; ``--quick`` 10 x 8)
  (target <= 1.02).
* ``serve_peak_rss_vs_budget``: ``bench/serve_memory.py`` (``flywheel serve`` with stable,
  candidate and previous stable resident) peak RSS / (1.3 x 3 x model bytes + 1 GiB), on the
  default model's shapes (``--quick``: 8 of its 30 layers) (target <= 1).
* with ``--hf-and-swap`` (default on without ``--quick``): ``throughput_vs_hf_generate``,
  ``throughput_same_tokens_as_hf``, ``engine_step_overhead_vs_hf_generate``,
  ``swap_failed_requests``, ``swap_pause_vs_cold_reload`` (see :func:`throughput_vs_hf`).
"""

from __future__ import annotations

import sys
from pathlib import Path as _P

sys.path.insert(0, str(_P(__file__).resolve().parents[1]))  # run from a checkout

import argparse
import concurrent.futures
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


def throughput_vs_hf(eng, lm, batch: int, max_tokens: int, trials: int) -> dict[str, float]:
    """Engine vs ``model.generate`` on the same loaded model, batch and prompts (greedy, eos off
    on both sides so each request makes exactly ``max_tokens`` tokens).

    ``trials`` interleaved pairs after one warm-up each, the order alternating per pair so
    load drift on a shared box hits both sides alike; the ratio is the median over pairs of
    (engine tokens/s) / (generate tokens/s). Both sides run their forwards from a worker thread
    (the engine's own; one persistent thread for ``generate``). Also measured, with hooks on the model's
    top-level forward: wall time per decode step spent outside the model forward (ms), i.e.
    each side's own per-step overhead. Greedy tokens must be identical on both sides.

    Returns ``{throughput_vs_hf_generate, _tp_*}`` (tokens/s, ms/step, batch, tokens).
    """
    import torch

    from schemas.events import SamplingParams
    from schemas.modelspec import left_pad
    from serving.params import GenRequest

    prompts = [[(7 * i + j) % 200 + 10 for j in range(6 + i)] for i in range(batch)]  # 6..6+B-1 tokens
    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    ids, mask = left_pad(prompts, eng.pad_id)
    fwd = {"t": 0.0, "t0": 0.0}

    def pre(_m, _a):
        fwd["t0"] = time.perf_counter()

    def post(_m, _a, _o):
        fwd["t"] += time.perf_counter() - fwd["t0"]

    def engine_side():
        eng.pause()  # queue the whole batch first: one engine batch of B requests
        futs = [eng.submit(GenRequest(prompt_token_ids=p, sampling=sp, model=lm)) for p in prompts]
        t0 = time.perf_counter()
        eng.resume()
        outs = [f.result(900) for f in futs]
        return time.perf_counter() - t0, [o.completion_token_ids for o in outs]

    def hf_generate():
        with torch.inference_mode():
            t0 = time.perf_counter()
            g = lm.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                                  min_new_tokens=max_tokens, do_sample=False, pad_token_id=eng.pad_id)
            return time.perf_counter() - t0, g[:, ids.shape[1]:].tolist()

    # generate runs on one persistent worker thread, as the engine's batches do: on this box a
    # forward from the main thread vs from a worker thread differs by up to 10x under load
    # (OpenMP scheduling), which would otherwise be measured instead of the engines
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="bench-hf-generate")

    def hf_side():
        return pool.submit(hf_generate).result()

    saved_eos = eng.eos_id
    eng.eos_id = -1  # benchmark only: generate the full budget like HF with eos disabled
    hooks = [lm.model.register_forward_pre_hook(pre), lm.model.register_forward_hook(post)]
    try:
        engine_side(), hf_side()  # warm-up
        ratios, rate = [], {"eng": [], "hf": []}
        over = {"eng": [], "hf": []}
        same = True
        for k in range(trials):
            order = (("eng", engine_side), ("hf", hf_side)) if k % 2 == 0 else (("hf", hf_side), ("eng", engine_side))
            got = {}
            for name, fn in order:
                fwd["t"] = 0.0
                wall, toks = fn()
                got[name] = toks
                rate[name].append(batch * max_tokens / wall)
                over[name].append((wall - fwd["t"]) / max_tokens * 1000)
            same &= got["eng"] == got["hf"] and all(len(t) == max_tokens for t in got["eng"])
            ratios.append(rate["eng"][-1] / rate["hf"][-1])
            print(f"throughput pair {k}: engine {rate['eng'][-1]:.2f} tok/s, generate {rate['hf'][-1]:.2f} tok/s, "
                  f"ratio {ratios[-1]:.3f}", flush=True)
    finally:
        pool.shutdown()
        for h in hooks:
            h.remove()
        eng.eos_id = saved_eos
    med = statistics.median
    return {"throughput_vs_hf_generate": med(ratios), "_tp_engine_tok_s": med(rate["eng"]),
            "_tp_hf_tok_s": med(rate["hf"]), "_tp_engine_overhead_ms_per_step": med(over["eng"]),
            "_tp_hf_overhead_ms_per_step": med(over["hf"]), "_tp_ratio_min": min(ratios),
            "_tp_ratio_max": max(ratios), "_tp_same_tokens": float(same), "_tp_batch": batch,
            "_tp_tokens": max_tokens, "_tp_trials": trials}


# ---------------------------------------------------------------------------- open-loop load
def poisson_arrivals(rate: float, n: int, seed: int) -> list[float]:
    """``n`` arrival times (s from the start) of a Poisson process of ``rate`` requests/s."""
    import random

    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


async def _one(client, url: str, body: dict, t0: float, at: float) -> dict:
    import asyncio
    import json

    await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
    start = time.perf_counter()
    first, ntok = None, 0
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            d = json.loads(line[6:])
            if d.get("usage"):
                ntok = d["usage"]["completion_tokens"]
            if first is None and any(c.get("text") for c in d.get("choices", [])):
                first = time.perf_counter()
    end = time.perf_counter()
    return {"start": start, "ttft": (first or end) - start, "end": end, "tokens": ntok}


def run_load(base_url: str, model: str, prompts: list[str], arrivals: list[float], max_tokens: "int | list[int]",
             headers: dict | None = None) -> dict[str, float]:
    """Open-loop load: request ``i`` (prompt ``i % len(prompts)``, greedy, ``max_tokens`` or
    ``max_tokens[i]``, streamed with usage) is sent at ``arrivals[i]`` whether or not earlier
    ones finished.

    Returns ``{throughput_tok_s, ttft_p50_s, ttft_p99_s, requests, tokens, wall_s}``:
    completion tokens / (last end - first start), TTFT = time to the first chunk with text.
    """
    import asyncio

    import httpx
    import numpy as np

    async def go():
        limits = httpx.Limits(max_connections=len(arrivals) + 8, max_keepalive_connections=len(arrivals) + 8)
        async with httpx.AsyncClient(timeout=1200, limits=limits, headers=headers or {}) as c:
            t0 = time.perf_counter()
            return await asyncio.gather(*[
                _one(c, base_url + "/v1/completions",
                     {"model": model, "prompt": prompts[i % len(prompts)],
                      "max_tokens": max_tokens[i] if isinstance(max_tokens, list) else max_tokens,
                      "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}, t0, at)
                for i, at in enumerate(arrivals)])

    rs = asyncio.run(go())
    wall = max(r["end"] for r in rs) - min(r["start"] for r in rs)
    ttft = np.array([r["ttft"] for r in rs])
    toks = sum(r["tokens"] for r in rs)
    return {"throughput_tok_s": toks / wall, "ttft_p50_s": float(np.percentile(ttft, 50)),
            "ttft_p99_s": float(np.percentile(ttft, 99)), "requests": len(rs), "tokens": toks, "wall_s": wall}


def capacity_rps(base_url: str, model: str, prompts: list[str], n: int, max_tokens: "int | list[int]",
                 headers: dict | None = None, load=None) -> float:
    """Requests/s the server completes when ``n`` arrive at once (closed burst); ``load``:
    the :func:`run_load` to use (default this process's)."""
    r = (load or run_load)(base_url, model, prompts, [0.0] * n, max_tokens, headers)
    return r["requests"] / r["wall_s"]


class LoadProcess:
    """:func:`run_load` in a process of its own, for pods served from this process: the load
    generator's HTTP client then never holds the pods' interpreter lock (context manager)."""

    def __enter__(self):
        import multiprocessing

        self._pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        return self

    def __call__(self, *args, **kw) -> dict[str, float]:
        return self._pool.submit(run_load, *args, **kw).result()

    def __exit__(self, *exc):
        self._pool.shutdown()


PROMPTS = ["def add(a, b):", "hello world, the quick brown fox", "Complete this Python function.",
           "the lazy dog jumps", "def fib(n):", "return a + b", "quick brown", "hello"]


def continuous_vs_static(model_dir: Path, bootstrap: str, tmp: Path, n_req: int, max_tokens: int,
                         max_batch: int, mixed: bool = False, device: str = "cpu") -> dict[str, float]:
    """Torch engine, static vs continuous scheduler, two pods on one model, logging on, eos
    off; three Poisson rates from the continuous pod's capacity (measured on the same lengths);
    per rate the two run one after the other on the same arrival times, each pod's events
    flushed to the broker before the next run; at the highest rate in the order A B B A (each
    figure the mean of its two runs, so drift on a shared box cancels to first order), at the
    others A B with the order alternating. ``mixed``: request ``i`` asks for a seeded uniform
    4..``max_tokens`` tokens (lengths as eos would make them), else exactly ``max_tokens``;
    figures named ``..._mixed_lengths`` then."""
    import random

    rng = random.Random(7)
    lengths = [rng.randint(4, max_tokens) for _ in range(n_req)] if mixed else max_tokens
    suffix = "_mixed_lengths" if mixed else ""
    from serving.commands import build_pod
    from tests.servers import ServerThread
    from serving.slots import CheckpointStore

    pods, srvs = {}, {}
    for sched in ("continuous", "static"):
        pods[sched] = build_pod(CheckpointStore(model_dir), pod=f"bench-{sched}", max_batch=max_batch,
                                bootstrap=bootstrap, journal=tmp / f"{sched}.journal", scheduler=sched,
                                device=device)
        pods[sched].engine.eos_id = -1  # benchmark only: every request makes max_tokens tokens
        srvs[sched] = ServerThread(pods[sched].app).start()
    res: dict[str, float] = {}
    try:
        with LoadProcess() as load:
            for s in srvs.values():
                load(s.url, "flywheel", PROMPTS, [0.0, 0.0], 4)  # warm-up
            cap = capacity_rps(srvs["continuous"].url, "flywheel", PROMPTS, 2 * max_batch,
                               lengths[:2 * max_batch] if mixed else max_tokens, load=load)
            res["_cs_capacity_rps"] = cap
            print(f"continuous pod capacity: {cap:.2f} req/s ({2 * max_batch} at once, {max_tokens} tokens)",
                  flush=True)
            for k, mult in enumerate((0.4, 0.8, 1.6)):
                rate = mult * cap
                arr = poisson_arrivals(rate, n_req, seed=100 + k)
                order = ("static", "continuous") if k % 2 == 0 else ("continuous", "static")
                if mult == 1.6:
                    order = order + order[::-1]
                runs: dict[str, list[dict]] = {"continuous": [], "static": []}
                for sched in order:
                    runs[sched].append(load(srvs[sched].url, "flywheel", PROMPTS, arr, lengths))
                    pods[sched].event_log.flush(60)
                got = {sched: {m: statistics.fmean(r[m] for r in rs) for m in rs[0]} for sched, rs in runs.items()}
                for sched in ("continuous", "static"):
                    g = got[sched]
                    print(f"{'mixed ' if mixed else ''}rate {rate:.2f} req/s ({mult}x capacity) {sched:<10}: "
                          f"{g['throughput_tok_s']:.1f} tok/s, "
                          f"TTFT p50 {g['ttft_p50_s'] * 1000:.0f} ms p99 {g['ttft_p99_s'] * 1000:.0f} ms, "
                          f"{g['requests']:.0f} requests, {g['tokens']:.0f} tokens in {g['wall_s']:.1f} s"
                          f"{' (mean of 2 runs)' if len(runs[sched]) > 1 else ''}", flush=True)
                    for m in ("throughput_tok_s", "ttft_p50_s", "ttft_p99_s"):
                        res[f"_cs{suffix}_{sched}_{mult}_{m}"] = g[m]
                c, st = got["continuous"], got["static"]
                ce = pods["continuous"].engine
                print(f"continuous engine so far: {ce.steps_run} steps, {ce.batches_run} joins, "
                      f"{ce.fused_joins} of them in a decode forward", flush=True)
                res["continuous_vs_static_throughput" + suffix] = c["throughput_tok_s"] / st["throughput_tok_s"]
                res["continuous_vs_static_ttft_p50" + suffix] = c["ttft_p50_s"] / st["ttft_p50_s"]
                res["continuous_vs_static_ttft_p99" + suffix] = c["ttft_p99_s"] / st["ttft_p99_s"]
    finally:
        for s in srvs.values():
            s.stop()
        for p in pods.values():
            p.close()
    return res


def _start(cmd: list[str], env: dict, log_path: Path, url: str, timeout_s: float, headers=None):
    """Start a server subprocess and wait until ``url`` answers 200 (RuntimeError otherwise)."""
    import subprocess

    import httpx

    log = open(log_path, "w")
    p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd="/")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url, timeout=5, headers=headers or {}).status_code == 200:
                return p, log
        except httpx.HTTPError:
            pass
        if p.poll() is not None or time.monotonic() > deadline:
            p.kill()
            raise RuntimeError(f"{cmd[:4]} did not start:\n" + log_path.read_text()[-3000:])
        time.sleep(2)


def vllm_vs_vllm_server(model_dir: Path, vpy: Path, tmp: Path, n_req: int, max_tokens: int, max_batch: int,
                        dtype: str, max_model_len: int, gpu_util: float | None) -> dict[str, float]:
    """``flywheel serve --engine vllm`` vs ``python -m vllm.entrypoints.openai.api_server``,
    same checkpoint, dtype, context, max_num_seqs and memory share, both servers up, the same
    Poisson arrivals sent to one then the other (rates 0.4x/0.8x/1.6x the vLLM server's
    capacity; order alternating per rate, A B B A at the highest, each figure the mean of its
    runs there). Flywheel logs events to its journal (no broker: the cost measured is
    Flywheel's serving path, not Kafka's)."""
    import os

    from schemas.settings import free_port

    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(repo), FLYWHEEL_HOME=str(tmp / "fw-home"), FLYWHEEL_USER_SALT="x")
    env.pop("FLYWHEEL_KAFKA_BOOTSTRAP", None)
    opts = ["--dtype", dtype, "--max-model-len", str(max_model_len)]
    if gpu_util:
        opts += ["--gpu-memory-utilization", str(gpu_util)]
    servers = {}
    p1 = free_port()
    servers["flywheel"] = ([str(vpy), "-m", "flywheel.cli", "serve", "--engine", "vllm", "--model-dir", str(model_dir),
                            "--port", str(p1), "--max-batch", str(max_batch), *opts], p1, "flywheel")
    p2 = free_port()
    servers["vllm"] = ([str(vpy), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--port",
                        str(p2), "--max-num-seqs", str(max_batch), "--seed", "0", "--served-model-name", "m",
                        "--gpu-memory-utilization", str(gpu_util or 0.05), "--dtype", dtype, "--max-model-len",
                        str(max_model_len)], p2, "m")
    if not gpu_util:
        servers["flywheel"][0].extend(["--gpu-memory-utilization", "0.05"])
    procs = {}
    try:
        for name in ("vllm", "flywheel"):  # both up at once, so the loads can alternate
            cmd, port, _model = servers[name]
            procs[name] = _start(cmd, env, tmp / f"{name}.log", f"http://127.0.0.1:{port}/health", 1200)
        for name, (_cmd, port, model) in servers.items():
            url = f"http://127.0.0.1:{port}"
            run_load(url, model, PROMPTS, [0.0] * 4, 4)  # warm-up (first requests pay ~27 s on CPU)
            run_load(url, model, PROMPTS, [0.0] * 4, 4)
        _c, vport, vmodel = servers["vllm"]
        cap = capacity_rps(f"http://127.0.0.1:{vport}", vmodel, PROMPTS, 2 * max_batch, max_tokens)
        rates = [m * cap for m in (0.4, 0.8, 1.6)]
        print(f"vLLM server capacity: {cap:.2f} req/s", flush=True)
        got: dict[str, dict] = {"vllm": {}, "flywheel": {}}
        for k, rate in enumerate(rates):
            arr = poisson_arrivals(rate, n_req, seed=200 + k)
            order = ("vllm", "flywheel") if k % 2 == 0 else ("flywheel", "vllm")
            if k == len(rates) - 1:  # A B B A at the highest rate: drift cancels to first order
                order = order + order[::-1]
            runs: dict[str, list[dict]] = {"vllm": [], "flywheel": []}
            for name in order:
                _c, port, model = servers[name]
                runs[name].append(run_load(f"http://127.0.0.1:{port}", model, PROMPTS, arr, max_tokens))
            for name, rs in runs.items():
                g = got[name][k] = {m: statistics.fmean(r[m] for r in rs) for m in rs[0]}
                print(f"rate {rate:.2f} req/s {name:<9}: {g['throughput_tok_s']:.1f} tok/s, TTFT p50 "
                      f"{g['ttft_p50_s'] * 1000:.0f} ms p99 {g['ttft_p99_s'] * 1000:.0f} ms ({g['tokens']:.0f} tokens)"
                      f"{' (mean of 2 runs)' if len(rs) > 1 else ''}", flush=True)
    finally:
        for proc, log in procs.values():
            proc.terminate()
            try:
                proc.wait(60)
            except Exception:  # noqa: BLE001 - a server that ignores SIGTERM
                proc.kill()
            log.close()
    f, v = got["flywheel"], got["vllm"]
    return {"vllm_engine_vs_vllm_server_throughput": f[2]["throughput_tok_s"] / v[2]["throughput_tok_s"],
            "vllm_engine_vs_vllm_server_ttft_p50": f[1]["ttft_p50_s"] / v[1]["ttft_p50_s"],
            "_vv_rates": rates}


def logging_overhead(model_dir: Path, bootstrap: str, tmp: Path, n_req: int, max_tokens: int,
                     device: str = "cpu") -> dict[str, float]:
    """Latency with logging on / off, same pod, interleaved request pairs (order alternating)."""
    import httpx

    from serving.app import create_app
    from serving.commands import build_pod
    from tests.servers import ServerThread
    from serving.slots import CheckpointStore

    res: dict[str, float] = {}
    pod = build_pod(CheckpointStore(model_dir), pod="bench", bootstrap=bootstrap, journal=tmp / "j", device=device)
    off_app = create_app(pod.slots, None, pod="bench-off", salt="x")
    on_srv, off_srv = ServerThread(pod.app).start(), ServerThread(off_app).start()
    try:
        body = {"model": "flywheel", "prompt": "def add(a, b):", "max_tokens": max_tokens, "temperature": 0}
        with httpx.Client(timeout=300) as c:
            _latency_ms(c, on_srv.url + "/v1/completions", body, 2)  # warm up
            _latency_ms(c, off_srv.url + "/v1/completions", body, 2)
            on, off = [], []
            for k in range(n_req):  # interleaved pairs, order alternating, so drift hits both alike
                legs = [(on, on_srv), (off, off_srv)]
                for acc, srv in (legs if k % 2 == 0 else legs[::-1]):
                    acc += _latency_ms(c, srv.url + "/v1/completions", body, 1)
        res["logging_overhead_ratio"] = statistics.median(a / b for a, b in zip(on, off))
        res["_log_on_ms"], res["_log_off_ms"] = statistics.median(on), statistics.median(off)
        res["_log_pairs"], res["_log_tokens"] = n_req, max_tokens
        pod.event_log.flush(30)
    finally:
        on_srv.stop()
        off_srv.stop()
        pod.close()
    return res


def swap_under_load(model_dir: Path, bootstrap: str, tmp: Path) -> dict[str, float]:
    """Failed requests while promoting under load, and the promote pause vs a cold reload."""
    import httpx

    from serving.commands import build_pod
    from tests.servers import ServerThread
    from serving.slots import CheckpointStore

    pod = build_pod(CheckpointStore(model_dir), pod="bench-swap", bootstrap=bootstrap, journal=tmp / "js")
    srv = ServerThread(pod.app).start()
    try:
        t0 = time.perf_counter()
        pod.slots.load_candidate("v000000")
        cold_ms = (time.perf_counter() - t0) * 1000
        failures, stop = [], threading.Event()
        body = {"model": "flywheel", "prompt": "def add(a, b):", "max_tokens": 4, "temperature": 0}

        def client(i):
            with httpx.Client(timeout=300) as c:
                while not stop.is_set():
                    try:
                        r = c.post(srv.url + "/v1/completions", json=body, headers={"x-flywheel-user": f"b{i}"})
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
    finally:
        srv.stop()
        pod.close()
    return {"swap_failed_requests": float(len(failures)), "swap_pause_vs_cold_reload": st.last_swap_pause_ms / cold_ms,
            "_swap_pause_ms": st.last_swap_pause_ms, "_cold_reload_ms": cold_ms}


def serve_rss(layers: int) -> dict[str, float]:
    """``bench/serve_memory.py --layers N`` in a subprocess; its RESULT figure."""
    import subprocess

    r = subprocess.run([sys.executable, str(Path(__file__).with_name("serve_memory.py")), "--layers", str(layers)],
                       capture_output=True, text=True, timeout=3600)
    lines = [x for x in r.stdout.splitlines() if "RSS" in x or x.startswith("model ")]
    print("\n".join(lines), flush=True)
    got = [x for x in r.stdout.splitlines() if x.startswith("RESULT serve_peak_rss_vs_budget=")]
    if not got:
        raise RuntimeError("serve_memory.py failed:\n" + (r.stdout + r.stderr)[-3000:])
    return {"serve_peak_rss_vs_budget": float(got[0].split("=")[1].split()[0]), "_rss_layers": layers}


def main() -> None:
    from flywheel.broker import spawn
    from schemas import settings

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests and tokens; the memory figure on 8 layers")
    ap.add_argument("--model-dir", type=Path, default=None, help="HF checkpoint (default: the base model)")
    ap.add_argument("--vllm", action="store_true", help="also flywheel serve --engine vllm vs vLLM's server")
    ap.add_argument("--vllm-python", type=Path, default=Path(".venv-vllm/bin/python").absolute(),
                    help="interpreter with vLLM (default ./.venv-vllm/bin/python)")
    ap.add_argument("--dtype", default="float32", help="vLLM comparison dtype")
    ap.add_argument("--max-model-len", type=int, default=1024, help="vLLM comparison context (tokens)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None, help="vLLM comparison (GPU: e.g. 0.3)")
    ap.add_argument("--requests", type=int, default=None, help="requests per rate (default 120, quick 48)")
    ap.add_argument("--max-batch", type=int, default=8, help="running requests per engine")
    ap.add_argument("--hf-and-swap", action=argparse.BooleanOptionalAction, default=None,
                    help="also the generate() comparison and the swap figures (default: on unless --quick)")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: cs,logging,rss")
    ap.add_argument("--device", default="cpu", help="torch engine device of the torch pods (cpu, cuda)")
    ap.add_argument("--rss-layers", type=int, default=None, help="layers of the memory figure's model "
                                                                  "(default 30 = the default model, quick 8)")
    a = ap.parse_args()
    model_dir = a.model_dir or settings.base_model_dir()
    n_req = a.requests or (48 if a.quick else 120)
    tokens = 32
    skip = set(filter(None, a.skip.split(",")))
    hf_swap = (not a.quick) if a.hf_and_swap is None else a.hf_and_swap
    r: dict[str, float] = {}
    tmp = Path(tempfile.mkdtemp(prefix="fw-bench-"))
    b = spawn()
    try:
        if "cs" not in skip:
            r.update(continuous_vs_static(model_dir, b.bootstrap, tmp, n_req, tokens, a.max_batch, mixed=True,
                                          device=a.device))
            r.update(continuous_vs_static(model_dir, b.bootstrap, tmp, n_req, tokens, a.max_batch, device=a.device))
        if "logging" not in skip:
            r.update(logging_overhead(model_dir, b.bootstrap, tmp, 10 if a.quick else 40, 8 if a.quick else 32,
                                      device=a.device))
            print(f"logging: {r['_log_pairs']} interleaved pairs of {r['_log_tokens']} greedy tokens at batch 1: "
                  f"median latency on {r['_log_on_ms']:.1f} ms, off {r['_log_off_ms']:.1f} ms")
        if hf_swap:
            from serving.engine import TorchEngine

            eng = TorchEngine(model_dir, max_batch=8)
            try:
                r.update(throughput_vs_hf(eng, eng.load_base(), batch=4 if a.quick else 8,
                                          max_tokens=16 if a.quick else 32, trials=3 if a.quick else 5))
            finally:
                eng.close()
            r.update(swap_under_load(model_dir, b.bootstrap, tmp))
    finally:
        b.stop()
    if a.vllm:
        r.update(vllm_vs_vllm_server(model_dir, a.vllm_python, tmp, n_req, tokens, a.max_batch, a.dtype,
                                     a.max_model_len, a.gpu_memory_utilization))
    if "rss" not in skip:
        r.update(serve_rss(a.rss_layers or (8 if a.quick else 30)))
    if hf_swap:
        print(f"RESULT throughput_vs_hf_generate={r['throughput_vs_hf_generate']:.3f} x target>=1.0")
        print(f"RESULT throughput_same_tokens_as_hf={int(r['_tp_same_tokens'])} bool target==1")
        print(f"RESULT engine_step_overhead_vs_hf_generate="
              f"{r['_tp_engine_overhead_ms_per_step'] / r['_tp_hf_overhead_ms_per_step']:.3f} x target<=1.0")
        print(f"RESULT swap_failed_requests={int(r['swap_failed_requests'])} requests target==0")
        print(f"RESULT swap_pause_vs_cold_reload={r['swap_pause_vs_cold_reload']:.6f} x target<=0.01")
    if "cs" not in skip:
        for k in ("throughput", "ttft_p50", "ttft_p99"):
            print(f"RESULT continuous_vs_static_{k}_mixed_lengths={r['continuous_vs_static_' + k + '_mixed_lengths']:.3f}"
                  f" x target{'>=1.3' if k == 'throughput' else '<1'}")
        print(f"RESULT continuous_vs_static_ttft_p50={r['continuous_vs_static_ttft_p50']:.3f} x target<1")
        print(f"RESULT continuous_vs_static_ttft_p99={r['continuous_vs_static_ttft_p99']:.3f} x target<1")
        print(f"RESULT continuous_vs_static_throughput={r['continuous_vs_static_throughput']:.3f} x target>=1.3")
    if a.vllm:
        print(f"RESULT vllm_engine_vs_vllm_server_throughput={r['vllm_engine_vs_vllm_server_throughput']:.3f} x "
              "target>=0.9")
        print(f"RESULT vllm_engine_vs_vllm_server_ttft_p50={r['vllm_engine_vs_vllm_server_ttft_p50']:.3f} x "
              "target<=1.2")
    if "logging" not in skip:
        print(f"RESULT logging_overhead_ratio={r['logging_overhead_ratio']:.4f} x target<=1.02")
    if "rss" not in skip:
        print(f"RESULT serve_peak_rss_vs_budget={r['serve_peak_rss_vs_budget']:.3f} x target<=1.0")


if __name__ == "__main__":
    main()
