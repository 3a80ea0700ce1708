"""Delta benchmark (issue 6): bit-exact delta size vs full snapshot after N learner steps.

Runs real AdamW steps (fp32 master weights, next-token loss on random tokens) from the base
weights, then encodes the weights after N steps as a delta on the base, in fp32 and cast to
bf16 (what a bf16 serving engine loads). Compared in one run with: the raw snapshot, zstd of
the full snapshot (byte-plane shuffled), and the order-0 entropy bound of the XOR bytes
(sum over byte planes of n * H(plane)). Also encode/decode throughput (MB/s of raw weights).

    python -m deploy.bench_delta [--quick] [--model-dir DIR] [--lr 1e-6] [--steps 1,10,100]

``--quick`` uses a tiny random MoE built in-process. Prints ``RESULT`` lines last
(DESIGN §6): ``delta_ratio_bf16_1step`` target >= 20.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import zstandard

from deploy.store import ZSTD_LEVEL, _raw_bytes, _shuffle, decode_state, encode_state
from schemas.manifest import state_sha256


def entropy_bound_bytes(state: dict[str, torch.Tensor], parent: dict[str, torch.Tensor]) -> float:
    """Order-0 entropy (bytes) of the XOR bit patterns, per byte plane of each tensor."""
    bits = 0.0
    for k, t in state.items():
        w = t.element_size()
        x = np.bitwise_xor(_raw_bytes(t), _raw_bytes(parent[k])).reshape(-1, w)
        for plane in range(w):
            c = np.bincount(x[:, plane], minlength=256)
            p = c[c > 0] / x.shape[0]
            bits += -(p * np.log2(p)).sum() * x.shape[0]
    return bits / 8


def snapshot_zstd_bytes(state: dict[str, torch.Tensor]) -> int:
    c = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    return sum(len(c.compress(_shuffle(_raw_bytes(t), t.element_size()).tobytes())) for t in state.values())


def measure(state, parent) -> dict:
    """Sizes (bytes) and throughputs (MB/s of raw weights) of one delta; asserts bit-exactness."""
    raw = sum(t.numel() * t.element_size() for t in state.values())
    t0 = time.perf_counter()
    entries, payload = encode_state(state, parent)
    enc_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    back = decode_state("bench", entries, payload, parent)
    dec_s = time.perf_counter() - t0
    if state_sha256(back) != state_sha256(state):
        raise AssertionError("delta is not bit-exact")
    changed = sum(int((_raw_bytes(t).reshape(-1, t.element_size()) != _raw_bytes(parent[k]).reshape(
        -1, t.element_size())).any(1).sum()) for k, t in state.items())
    n = sum(t.numel() for t in state.values())
    return {"raw": raw, "delta": len(payload), "snapshot_zstd": snapshot_zstd_bytes(state),
            "entropy": entropy_bound_bytes(state, parent), "ratio": raw / len(payload),
            "changed_frac": changed / n, "enc_mb_s": raw / enc_s / 1e6, "dec_mb_s": raw / dec_s / 1e6}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny random MoE, steps 1,10")
    ap.add_argument("--model-dir", type=Path, default=None, help="HF checkpoint (default: the flywheel base model)")
    ap.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate (RL fine-tuning scale)")
    ap.add_argument("--steps", default=None, help="comma-separated step counts (default 1,10,100)")
    ap.add_argument("--seq", type=int, default=32, help="tokens per sequence of the training batch")
    a = ap.parse_args(argv)
    from schemas.modelspec import load_model

    if a.quick:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from conftest import make_tiny_moe

        model_dir = make_tiny_moe(Path(tempfile.mkdtemp()) / "tiny", num_layers=4)
    else:
        from schemas.settings import base_model_dir

        model_dir = a.model_dir or base_model_dir()
    steps = sorted(int(s) for s in (a.steps or ("1,10" if a.quick else "1,10,100")).split(","))
    torch.manual_seed(0)
    model = load_model(model_dir)
    model.train()
    base32 = {k: v.detach().clone() for k, v in model.state_dict().items()}
    base16 = {k: v.to(torch.bfloat16) for k, v in base32.items()}
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    done, results = 0, []
    for n in steps:
        while done < n:
            ids = torch.randint(0, model.config.vocab_size, (2, a.seq))
            loss = model(input_ids=ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            done += 1
        s32 = {k: v.detach().clone() for k, v in model.state_dict().items()}
        for dt, state, parent in (("fp32", s32, base32),
                                  ("bf16", {k: v.to(torch.bfloat16) for k, v in s32.items()}, base16)):
            m = measure(state, parent)
            m.update(dtype=dt, steps=n)
            results.append(m)
    print(f"model {model_dir}, lr {a.lr}")
    print(f"{'dtype':5} {'steps':>5} {'changed':>8} {'raw MB':>8} {'delta MB':>9} {'zstd snap MB':>12} "
          f"{'entropy MB':>10} {'raw/delta':>9} {'zstd/delta':>10} {'enc MB/s':>8} {'dec MB/s':>8}")
    for r in results:
        print(f"{r['dtype']:5} {r['steps']:5d} {r['changed_frac']:8.2%} {r['raw'] / 1e6:8.2f} {r['delta'] / 1e6:9.3f} "
              f"{r['snapshot_zstd'] / 1e6:12.2f} {r['entropy'] / 1e6:10.3f} {r['ratio']:9.1f} "
              f"{r['snapshot_zstd'] / r['delta']:10.1f} {r['enc_mb_s']:8.0f} {r['dec_mb_s']:8.0f}")
    one = {r["dtype"]: r for r in results if r["steps"] == steps[0]}
    print(f"RESULT delta_ratio_bf16_{steps[0]}step={one['bf16']['ratio']:.1f} x target>=20")
    print(f"RESULT delta_ratio_fp32_{steps[0]}step={one['fp32']['ratio']:.1f} x target>=1")
    print(f"RESULT delta_bit_exact=1 bool target==1")
    return 0 if math.isfinite(one["bf16"]["ratio"]) else 1


if __name__ == "__main__":
    sys.exit(main())
