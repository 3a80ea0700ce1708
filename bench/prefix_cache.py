"""Prefix caching in the torch engine: the demo's traffic served with and without it, side by side.

Both runs use one TorchEngine configuration on the default model (``flywheel init-model``),
the demo's task mix (``flywheel.workload.Workload``: basic_arithmetic, chain_sum, HumanEval
at weight 0.1, chat template applied as serving does) and the demo's replies (48 new tokens,
160 for HumanEval), ``--concurrency`` requests in flight, seeded sampling at temperature 0.8.
The order of the two runs alternates per repeat. Prints requests/s of each and their ratio,
prompt tokens the cache saved, and the largest |logprob difference| between the two runs on
the replies both made identically up to the first differing token.

    python bench/prefix_cache.py [--requests 48] [--concurrency 16] [--repeats 1]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _prompts(n: int, seed: int) -> list[tuple[list[int], int]]:
    from flywheel.workload import Workload
    from schemas import settings
    from schemas.modelspec import load_tokenizer

    tok = load_tokenizer(settings.base_model_dir())
    wl = Workload(families=("basic_arithmetic", "chain_sum", "humaneval"), weights={"humaneval": 0.1}, seed=seed)
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        t = wl.next_task(rng)
        ids = tok.apply_chat_template(t.messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        out.append((ids, 160 if t.family == "humaneval" else 48))
    return out


def _run(prefix_caching: bool, prompts, concurrency: int) -> dict:
    from schemas import settings
    from schemas.events import SamplingParams
    from serving.engine import TorchEngine
    from serving.params import GenRequest

    eng = TorchEngine(settings.base_model_dir(), max_batch=concurrency, prefix_caching=prefix_caching)
    try:
        base = eng.load_base("v000000")
        t0 = time.perf_counter()
        futs = [eng.submit(GenRequest(prompt_token_ids=p, model=base, sampling=SamplingParams(
            temperature=0.8, top_p=0.95, max_tokens=m, seed=i))) for i, (p, m) in enumerate(prompts)]
        res = [f.result(3600) for f in futs]
        wall = time.perf_counter() - t0
        pc = base.prefix_cache
        return {"wall_s": wall, "rps": len(prompts) / wall, "results": res,
                "tokens_reused": pc.tokens_reused if pc else 0, "hits": pc.hits if pc else 0,
                "prompt_tokens": sum(len(p) for p, _ in prompts)}
    finally:
        eng.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    prompts = _prompts(a.requests, a.seed)
    runs: dict[bool, list[dict]] = {True: [], False: []}
    for r in range(a.repeats):
        for pc in ((False, True) if r % 2 == 0 else (True, False)):
            out = _run(pc, prompts, a.concurrency)
            runs[pc].append(out)
            print(f"repeat {r} prefix_caching={pc}: {out['rps']:.3f} req/s ({out['wall_s']:.1f} s), "
                  f"prompt tokens reused {out['tokens_reused']}/{out['prompt_tokens']}", flush=True)
    on = sum(o["rps"] for o in runs[True]) / a.repeats
    off = sum(o["rps"] for o in runs[False]) / a.repeats
    diff = 0.0
    for x, y in zip(runs[True][0]["results"], runs[False][0]["results"]):
        for tx, ty, lx, ly in zip(x.completion_token_ids, y.completion_token_ids, x.behavior_logprobs,
                                  y.behavior_logprobs):
            diff = max(diff, abs(lx - ly))
            if tx != ty:
                break
    reused = runs[True][0]["tokens_reused"] / runs[True][0]["prompt_tokens"]
    print(f"RESULT prefix_cache_rps={on:.3f} no_prefix_cache_rps={off:.3f} prefix_cache_speedup={on / off:.2f} "
          f"prompt_tokens_reused_share={reused:.2f} max_abs_logprob_diff={diff:.2e} requests={a.requests} "
          f"concurrency={a.concurrency} repeats={a.repeats}")


if __name__ == "__main__":
    main()
