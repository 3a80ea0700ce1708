"""Where the ingest pipeline's floor is (issue 24): what a body format can and cannot buy.

``bench/ingest.py`` measures ``pipeline_vs_raw_cpu_efficiency``: records joined and sealed
per worker CPU-second over records consumed per CPU-second by a bare aiokafka client (target
>= 0.25). This bench splits a worker's CPU per record into the parts a body format changes
and the parts it does not, all measured in one run on one data set:

1. **Raw** (the baseline): a real Tansu broker, the records produced once, then read twice by
   the worker's own Kafka client and settings with no processing
   (``bench.ingest.raw_consume``); the larger of the two rates (the stricter baseline) gives
   ``R`` records per CPU-second, i.e. ``c = 1/R`` CPU-s per record for consumption.
2. **The pipeline in process, realistic bodies**: the same records through a fresh
   in-process :class:`ingest.worker.Worker`, with the worker process's garbage-collector
   settings (``ingest.worker.configure_gc``) (``Worker.fold`` in getmany-sized batches, then
   ``Worker.seal_round`` until every label is sealed into a Parquet shard), ``--reps``
   times: fold CPU per record ``F`` and sealing CPU per label ``S`` (medians).
3. **The pipeline in process, minimal bodies**: the same number of completions and the same
   votes, but each completion has 1-3 prompt tokens, 1-3 completion tokens and routes of one
   layer, top-1 (~0.6 KiB instead of ~18 KiB): ``F0`` and ``S0``. This is what the fold and
   the sealing cost with (almost) no body to parse, check or write: the label bookkeeping
   (state reads and writes, dedupe, claims, the label, the shard's non-body columns, the
   notices, offsets). No body format, however cheap, goes below it.
4. **The body alone**, per completion (best of ``--reps``): the current contract's sealing
   validation (``ingest.join.parse_event``: pydantic ``validate_json`` + the duplicate-key
   check, as ``Joiner.validate`` runs it) and the three list columns built from its Python
   lists, against a candidate binary body: the same fields as a MessagePack array with the
   token ids as int32 and the logprobs as float32 little-endian bytes and the routes' zstd
   frame as bytes (``msgpack``, the reference implementation), decoded and checked against
   the same bounds (texts, times, ids, lengths, finite logprobs <= 0, routes rows), and
   its columns built from the buffers. The routes' zstd check (decompress to the declared
   shape) is the same for both and is not in either figure.

The worker's CPU per record, in this model, is ``c + F + S / r`` (``r``: records per label),
so its efficiency against raw is ``1 / (1 + R (F + S / r))``. Printed for the realistic
bodies (compare with ``bench/ingest.py``'s measured figure: the model leaves out the broker
round trips the worker makes), for the binary body (``S`` less the JSON body parts plus the
binary ones: an upper bound, since its smaller records would also make raw consumption
cheaper) and for the minimal body (the floor of any body format). A plot of the per-record
budget goes to ``--plot``.

Prints, last, ``RESULT`` lines: ``pipeline_model_vs_raw_cpu_efficiency``,
``pipeline_binary_body_projected_vs_raw_cpu_efficiency``,
``pipeline_floor_any_body_vs_raw_cpu_efficiency`` (target >= 0.25: issue 24's target, which
this bench shows is out of reach of any body format while the floor is below it),
``body_binary_vs_json_cpu`` and ``records_per_label``.

    python bench/ingest_floor.py [--quick] [--reps 3] [--plot out/bench/ingest_floor.png]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import itertools
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

from bench.ingest import _fold_and_seal, make_events, produce, raw_consume  # noqa: E402
from flywheel.broker import spawn  # noqa: E402
from schemas.settings import topic_names
from schemas.events import (  # noqa: E402
    FLOAT32_MAX, INT32_MAX, CompletionEvent, _check_ms, _check_text)

BINARY_BODY_VERSION = 2  # the candidate's schema_version (the first array element)


def to_binary(ev: CompletionEvent) -> bytes:
    """The candidate binary body of ``ev``: a MessagePack array, in this order: schema
    version, completion id (16 bytes), request_id, created_at (ms), model_version, pod,
    user_hash, split, finish_reason, ttft_ms, latency_ms, sampling ``[temperature, top_p,
    top_k, max_tokens, seed, logprobs_kind]``, prompt token ids (int32 LE bytes), completion
    token ids (int32 LE bytes), behavior logprobs (float32 LE bytes), routes ``[shape, dtype,
    codec, zstd frame bytes]`` or nil. A measurement candidate, not a contract."""
    import base64

    import msgpack

    s, r = ev.sampling, ev.expert_routes
    return msgpack.packb([
        BINARY_BODY_VERSION, ev.completion_id.bytes, ev.request_id, ev.created_at, ev.model_version, ev.pod,
        ev.user_hash, ev.split, ev.finish_reason, ev.ttft_ms, ev.latency_ms,
        [s.temperature, s.top_p, s.top_k, s.max_tokens, s.seed, s.logprobs_kind],
        np.asarray(ev.prompt_token_ids, "<i4").tobytes(), np.asarray(ev.completion_token_ids, "<i4").tobytes(),
        np.asarray(ev.behavior_logprobs, "<f4").tobytes(),
        None if r is None else [list(r.shape), r.dtype, r.codec, base64.b64decode(r.data)]])


def check_binary(raw: bytes) -> list:
    """Decode a :func:`to_binary` body and check it against the bounds of
    :class:`schemas.events.CompletionEvent` (texts, times, ids, lengths, finite logprobs in
    ``[-FLOAT32_MAX, 0]``, routes rows = prompt + completion - 1); returns the decoded array.

    Raises:
        ValueError: naming the field that breaks a bound."""
    import msgpack

    v = msgpack.unpackb(raw, use_list=True, strict_map_key=True)
    if not isinstance(v, list) or len(v) != 16 or v[0] != BINARY_BODY_VERSION:
        raise ValueError("value: not a version-2 completion array")
    if not isinstance(v[1], bytes) or len(v[1]) != 16:
        raise ValueError("completion_id: not 16 bytes")
    for i, name in ((2, "request_id"), (4, "model_version"), (5, "pod"), (6, "user_hash")):
        if not isinstance(v[i], str) or not 1 <= len(v[i]) <= 256:
            raise ValueError(f"{name}: not 1-256 characters")
        _check_text(v[i])
    if type(v[3]) is not int:
        raise ValueError("created_at: not an integer")
    _check_ms(v[3])
    if v[7] not in ("train", "eval") or v[8] not in ("stop", "length", "abort"):
        raise ValueError("split/finish_reason: not a known value")
    for i, name in ((9, "ttft_ms"), (10, "latency_ms")):
        if not isinstance(v[i], (int, float)) or not 0 <= v[i] <= 86_400_000:
            raise ValueError(f"{name}: out of [0, 86400000]")
    sp = v[11]
    if (not isinstance(sp, list) or len(sp) != 6 or not 0 <= sp[0] <= 2 or not 0 < sp[1] <= 1
            or not -1 <= sp[2] <= INT32_MAX or not 1 <= sp[3] <= INT32_MAX or sp[5] != "raw"):
        raise ValueError("sampling: out of bounds")
    for i, name in ((12, "prompt_token_ids"), (13, "completion_token_ids"), (14, "behavior_logprobs")):
        if not isinstance(v[i], bytes) or len(v[i]) % 4:
            raise ValueError(f"{name}: not 4-byte values")
    p, c = np.frombuffer(v[12], "<i4"), np.frombuffer(v[13], "<i4")
    lp = np.frombuffer(v[14], "<f4")
    if p.size == 0 or p.min() < 0 or (c.size and c.min() < 0):
        raise ValueError("token ids: empty prompt or a negative id")
    if lp.size != c.size:
        raise ValueError("behavior_logprobs: not one per completion token")
    if lp.size and not (np.isfinite(lp).all() and lp.max() <= 0 and lp.min() >= -FLOAT32_MAX):
        raise ValueError("behavior_logprobs: not finite in [-FLOAT32_MAX, 0]")
    r = v[15]
    if r is not None:
        if (not isinstance(r, list) or len(r) != 4 or not isinstance(r[3], bytes) or len(r[0]) != 3
                or r[1] not in ("uint8", "uint16") or r[2] != "zstd"):
            raise ValueError("expert_routes: not [shape, dtype, codec, frame]")
        if r[0][0] != p.size + c.size - 1:
            raise ValueError("expert_routes: rows != prompt + completion - 1")
    return v


def _json_body(raws: list[bytes]) -> None:
    """The current contract's body work at sealing: validation, then the list columns."""
    from ingest.join import parse_event

    tc = topic_names().completions  # resolved once, as the worker does
    evs = [parse_event(CompletionEvent, r, tc) for r in raws]
    for name, dt in (("prompt_token_ids", np.int32), ("completion_token_ids", np.int32),
                     ("behavior_logprobs", np.float32)):
        vals = [getattr(e, name) for e in evs]
        off = np.zeros(len(vals) + 1, np.int64)
        np.cumsum(np.fromiter(map(len, vals), np.int64, len(vals)), out=off[1:])
        np.fromiter(itertools.chain.from_iterable(vals), dt, int(off[-1]))


def _binary_body(raws: list[bytes]) -> None:
    """The candidate's body work: decode and check, then the list columns from the buffers."""
    vs = [check_binary(r) for r in raws]
    for i, dt in ((12, "<i4"), (13, "<i4"), (14, "<f4")):
        bufs = [v[i] for v in vs]
        off = np.zeros(len(bufs) + 1, np.int64)
        np.cumsum(np.fromiter(map(len, bufs), np.int64, len(bufs)) // 4, out=off[1:])
        np.frombuffer(b"".join(bufs), dt)


def _best_us(fn, n: int, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.process_time()
        fn()
        best = min(best, time.process_time() - t)
    return 1e6 * best / n


def _in_process(comps, fb, reps: int) -> dict:
    """Medians of ``reps`` fresh in-process workers: fold us per record, sealing us per label."""
    from ingest.worker import BATCH_MAX_RECORDS

    fold, seal = [], []
    for _ in range(reps):
        home = Path(tempfile.mkdtemp(prefix="fw-bench-floor-"))
        try:
            r = _fold_and_seal(comps, fb, home, BATCH_MAX_RECORDS)
        finally:
            shutil.rmtree(home, ignore_errors=True)
        fold.append(1e6 * r["fold_cpu_s"] / r["records"])
        seal.append(1e6 * r["seal_cpu_s"] / r["samples"])
    return {"F": sorted(fold)[len(fold) // 2], "S": sorted(seal)[len(seal) // 2],
            "r": r["records"] / r["samples"], "fold_all": fold, "seal_all": seal}


def efficiency(c_us: float, f_us: float, s_us: float, r: float) -> float:
    """Worker records per CPU-s over raw records per CPU-s: ``c / (c + F + S / r)``."""
    return c_us / (c_us + f_us + s_us / r)


def plot(path: Path, c: float, parts: dict[str, tuple[float, float, float]]) -> None:
    """Stacked bars of CPU us per record (consume, fold, seal) per case, the 0.25 budget line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(parts)
    bottoms = np.zeros(len(names))
    for i, (label, color) in enumerate((("consume (aiokafka)", "#999999"), ("fold", "#4c72b0"),
                                        ("seal (per record)", "#dd8452"))):
        vals = np.array([parts[n][i] for n in names])
        ax.bar(names, vals, bottom=bottoms, label=label, color=color)
        bottoms += vals
    ax.axhline(4 * c, color="red", linestyle="--", label="budget at 0.25 of raw (4 x consume)")
    ax.set_ylabel("worker CPU per record (us)")
    ax.set_title("Ingest pipeline CPU per record (bench/ingest_floor.py)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="3000 completions (default 10000)")
    ap.add_argument("--completions", type=int, default=None, help="completions (default 10000; quick 3000)")
    ap.add_argument("--reps", type=int, default=3, help="in-process runs per body size (medians) and body reps")
    ap.add_argument("--prompt-tokens", type=int, default=150, help="mean prompt length (tokens)")
    ap.add_argument("--completion-tokens", type=int, default=200, help="mean completion length (tokens)")
    ap.add_argument("--layers", type=int, default=30, help="MoE layers in the routes")
    ap.add_argument("--experts", type=int, default=8, help="experts per layer")
    ap.add_argument("--top-k", type=int, default=2, help="experts per token")
    ap.add_argument("--plot", type=Path, default=ROOT / "out" / "bench" / "ingest_floor.png",
                    help="where the per-record budget plot goes")
    args = ap.parse_args()
    if args.reps < 1:
        ap.error("--reps: must be >= 1")
    n = args.completions or (3000 if args.quick else 10000)
    from ingest.worker import configure_gc

    configure_gc()  # the worker process's collector settings (ingest.worker.run)
    comps, fb = make_events(n, args)
    tiny = copy.copy(args)
    tiny.prompt_tokens, tiny.completion_tokens, tiny.layers, tiny.top_k = 2, 2, 1, 1
    comps0, fb0 = make_events(n, tiny)
    print(f"events: {len(comps)} completions (mean {np.mean([len(v) for _, v in comps]) / 1024:.1f} KiB; "
          f"minimal {np.mean([len(v) for _, v in comps0]) / 1024:.2f} KiB), {len(fb)} feedback", flush=True)

    b = spawn(partitions=2)
    try:
        produce(b.bootstrap, comps, fb)
        raws = [asyncio.run(raw_consume(b.bootstrap, len(comps) + len(fb), 2)) for _ in range(2)]
    finally:
        b.stop()
    R = max(x["per_cpu_s"] for x in raws)
    c = 1e6 / R
    rates = ", ".join(f"{x['per_cpu_s']:,.0f}" for x in raws)
    print(f"raw aiokafka consume: {rates} records per CPU-s "
          f"(baseline: {R:,.0f}, {c:.1f} us per record)", flush=True)

    real, small = {"fold_all": []}, {"fold_all": []}
    for _ in range(args.reps):  # alternated, so both sizes see the same box
        for d, (cs, fs) in ((real, (comps, fb)), (small, (comps0, fb0))):
            r = _in_process(cs, fs, 1)
            for k in ("fold_all", "seal_all"):
                d.setdefault(k, []).extend(r[k])
            d["r"] = r["r"]
    for d in (real, small):
        d["F"] = sorted(d["fold_all"])[len(d["fold_all"]) // 2]
        d["S"] = sorted(d["seal_all"])[len(d["seal_all"]) // 2]
    print(f"in process, realistic bodies: fold {real['F']:.1f} us per record, sealing {real['S']:.0f} us per "
          f"label ({real['r']:.2f} records per label); runs: fold {[round(x, 1) for x in real['fold_all']]}, "
          f"sealing {[round(x) for x in real['seal_all']]}", flush=True)
    print(f"in process, minimal bodies:   fold {small['F']:.1f} us per record, sealing {small['S']:.0f} us per "
          f"label; runs: fold {[round(x, 1) for x in small['fold_all']]}, "
          f"sealing {[round(x) for x in small['seal_all']]}", flush=True)

    bodies = [v for _, v in comps]
    binary = [to_binary(CompletionEvent.model_validate_json(v)) for v in bodies]
    j_us = _best_us(lambda: _json_body(bodies), len(bodies), args.reps)
    b_us = _best_us(lambda: _binary_body(binary), len(binary), args.reps)
    print(f"body work per completion (best of {args.reps}): JSON contract {j_us:.1f} us "
          f"({np.mean([len(x) for x in bodies]) / 1024:.1f} KiB), binary candidate {b_us:.1f} us "
          f"({np.mean([len(x) for x in binary]) / 1024:.1f} KiB); the routes' zstd check is in neither", flush=True)

    s_bin = real["S"] - j_us + b_us
    cases = {"JSON body (today)": (c, real["F"], real["S"] / real["r"]),
             "binary body (projected)": (c, real["F"], s_bin / real["r"]),
             "minimal body (floor)": (c, small["F"], small["S"] / small["r"])}
    eff = {k: efficiency(c, f, s * real["r"], real["r"]) for k, (_, f, s) in cases.items()}
    for k, (cc, f, s) in cases.items():
        print(f"{k}: {cc:.1f} + {f:.1f} + {s:.1f} = {cc + f + s:.1f} us per record -> {eff[k]:.3f} of raw "
              f"(0.25 allows {4 * c:.1f})", flush=True)
    try:
        plot(args.plot, c, cases)
        print(f"plot: {args.plot}", flush=True)
    except ImportError:
        print("plot skipped: matplotlib is not installed (the demo extra has it)", flush=True)
    print(f"RESULT pipeline_model_vs_raw_cpu_efficiency={eff['JSON body (today)']:.3f} x target>=0.25")
    print(f"RESULT pipeline_binary_body_projected_vs_raw_cpu_efficiency={eff['binary body (projected)']:.3f} x "
          f"target>=0.25")
    print(f"RESULT pipeline_floor_any_body_vs_raw_cpu_efficiency={eff['minimal body (floor)']:.3f} x target>=0.25")
    print(f"RESULT body_binary_vs_json_cpu={b_us / j_us:.3f} x")
    print(f"RESULT records_per_label={real['r']:.2f} records")


if __name__ == "__main__":
    main()
