"""When waiting requests join the torch engine's running batch: at every step vs TGI's
waiting-served ratio, side by side on the demo's traffic.

A closed loop of ``--users`` simulated users (each sends a request, waits for its reply,
sends the next) on the default model (``flywheel model init``) with prefix caching, the
demo's task mix and replies (``bench/prefix_cache.py``: basic_arithmetic, chain_sum,
HumanEval at weight 0.1, 48 new tokens, 160 for HumanEval, temperature 0.8, top-p 0.95,
eos on). Each ratio in ``--ratios`` serves the same ``--requests`` prompts; the order of the
runs rotates per repeat. Prints requests/s, completion tokens/s, prefill forwards, decode
steps and time to first token (p50, p99) per ratio, and each ratio's requests/s against
ratio 0 (a waiting request joins at the next step). docs/decisions.md D28.

    python bench/joins.py [--requests 96] [--users 32] [--ratios 0,0.3,0.6] [--repeats 1]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def _run(ratio: float, prompts, users: int, max_waiting_tokens: int) -> dict:
    from schemas import settings
    from schemas.events import SamplingParams
    from serving.engine import TorchEngine
    from serving.params import GenRequest

    eng = TorchEngine(settings.base_model_dir(), max_batch=users, prefix_caching=True,
                      waiting_served_ratio=ratio, max_waiting_tokens=max_waiting_tokens)
    try:
        base = eng.load_base("v000000")
        todo = iter(enumerate(prompts))
        lock = threading.Lock()
        results = []

        def user() -> None:
            while True:
                with lock:
                    nxt = next(todo, None)
                if nxt is None:
                    return
                i, (p, m) = nxt
                sp = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=m, seed=i)
                results.append(eng.submit(GenRequest(prompt_token_ids=p, model=base, sampling=sp)).result(3600))

        t0 = time.perf_counter()
        threads = [threading.Thread(target=user) for _ in range(users)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        ttft = sorted(r.ttft_ms for r in results)
        return {"rps": len(results) / wall, "tok_s": sum(len(r.completion_token_ids) for r in results) / wall,
                "prefills": eng.batches_run, "steps": eng.steps_run, "wall_s": wall,
                "ttft_p50_s": ttft[len(ttft) // 2] / 1000, "ttft_p99_s": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))] / 1000}
    finally:
        eng.close()


def main() -> None:
    from prefix_cache import _prompts

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--users", type=int, default=32)
    ap.add_argument("--ratios", default="0,0.3,0.6")
    ap.add_argument("--max-waiting-tokens", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ratios = [float(x) for x in a.ratios.split(",")]
    if 0.0 not in ratios:
        ratios = [0.0] + ratios
    prompts = _prompts(a.requests, a.seed)
    runs: dict[float, list[dict]] = {r: [] for r in ratios}
    for rep in range(a.repeats):
        order = ratios[rep % len(ratios):] + ratios[:rep % len(ratios)]
        for r in order:
            out = _run(r, prompts, a.users, a.max_waiting_tokens)
            runs[r].append(out)
            print(f"repeat {rep} ratio {r:g}: {out['rps']:.3f} req/s, {out['tok_s']:.1f} tokens/s, "
                  f"{out['prefills']} prefills, {out['steps']} steps, ttft p50 {out['ttft_p50_s']:.1f} s "
                  f"p99 {out['ttft_p99_s']:.1f} s", flush=True)

    def mean(r: float, k: str) -> float:
        return sum(o[k] for o in runs[r]) / len(runs[r])

    base = mean(0.0, "rps")
    fig = " ".join(f"joins_rps_ratio_{r:g}={mean(r, 'rps') / base:.2f}" for r in ratios if r)
    ttft = " ".join(f"ttft_p50_s_{r:g}={mean(r, 'ttft_p50_s'):.1f}" for r in ratios)
    print(f"RESULT {fig} rps_ratio_0={base:.3f} {ttft} requests={a.requests} users={a.users} repeats={a.repeats}")


if __name__ == "__main__":
    main()
