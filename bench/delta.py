"""Delta benchmark (issue 6): bit-exact delta size vs the full snapshot after N learner steps.

Runs AdamW steps from the base weights, then encodes the weights after N steps as a delta on
the base with ``modelstore.store.encode_state`` (XOR of bit patterns, byte-plane shuffle, zstd),
in fp32 (master weights) and cast to bf16 (what a bf16 serving engine loads). Compared in one
run with: the raw snapshot, zstd of the full snapshot (byte-plane shuffled, same level), and
the order-0 entropy bound of the XOR bytes (sum over byte planes of n * H(plane)). Also
encode/decode throughput (MB/s of raw weights) and a bit-exactness check of every round trip.

    python bench/delta.py [--quick] [--model-dir DIR] [--lr 1e-6] [--steps 1,10,100]
                          [--grads random|loss]
    python bench/delta.py --learner-state STATE.safetensors --model-dir DIR
    python bench/delta.py --store-cycle [--quick | --model-dir DIR] [--lr 1e-5] [--samples 8]

``--learner-state``: the weights after one real full-parameter learner step in bf16 (written by
``bench/learner.py --full-model DIR --save-state STATE``: KTO under router replay, fp32 master
weights and AdamW state under ZeRO-2, lr 1e-5), encoded as a delta on the bf16 parent (the
base cast to bf16): ``RESULT delta_ratio_bf16_full_param_learner_step`` target >= 20.

``--store-cycle``: the path a bf16 model takes in production, end to end: the model saved as a
bf16 checkpoint, taken into a fresh store with ``flywheel.modelinit.import_checkpoint``
(``v000000``, bf16), samples logged from its own bf16 forward (behavior logprobs and routes),
one real learner cycle (``learner.cycle.run_cycle``: KTO under router replay, DeepSpeed bf16
with fp32 master weights, precision ``auto``, ``--lr``, one step) publishing ``v000001`` as a
bf16 delta; its size is compared with the raw and the zstd'd bf16 snapshot of the same
weights, and ``v000001`` is reloaded from disk (every tensor's sha256 verified):
``RESULT delta_ratio_bf16_store_cycle`` target >= 20.

Models: ``--quick`` builds a tiny random MoE in-process (steps 1,10, next-token loss on random
tokens). Otherwise the real upcycled SmolLM2 MoE (``~/.cache/flywheel/models/smollm2-135m-moe``,
~373M params) when present, else ``schemas.settings.base_model_dir()``.

Gradients: ``loss`` = next-token loss on random tokens (forward + backward); ``random`` =
standard-normal gradients (default on the real model: the CPU is shared). AdamW's update is
``lr * m_hat / (sqrt(v_hat) + eps)``, whose size is ~``lr`` per element at the first steps
whatever the gradient's scale, so for the *size of the update* (what the delta encodes)
random gradients are representative; their signs are less correlated across steps than
real ones, so after 10-100 steps they move weights about as far or farther (conservative).

Prints ``RESULT`` lines last (DESIGN §6): ``delta_ratio_bf16_1step`` target >= 20.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from modelstore.codec import ZSTD_LEVEL, _raw_bytes, _shuffle, decode_state, encode_state  # noqa: E402
from schemas.manifest import state_sha256  # noqa: E402

REAL_MODEL = Path.home() / ".cache" / "flywheel" / "models" / "smollm2-135m-moe"


def entropy_bound_bytes(state: dict[str, torch.Tensor], parent: dict[str, torch.Tensor]) -> float:
    """Order-0 entropy (bytes) of the XOR bit patterns, per byte plane of each tensor:
    ``sum_tensors sum_planes n * H(plane) / 8`` with H in bits."""
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
    """Bytes of zstd (level ``ZSTD_LEVEL``) of the byte-plane shuffled full snapshot."""
    c = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    return sum(len(c.compress(_shuffle(_raw_bytes(t), t.element_size()).tobytes())) for t in state.values())


def measure(state: dict[str, torch.Tensor], parent: dict[str, torch.Tensor]) -> dict:
    """Sizes (bytes), changed fraction and throughputs (MB/s of raw weights) of one delta.

    Raises:
        AssertionError: the decoded tensors' sha256 differ from ``state``'s (not bit-exact).
    """
    raw = sum(t.numel() * t.element_size() for t in state.values())
    t0 = time.perf_counter()
    entries, payload = encode_state(state, parent)
    enc_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    back = decode_state("bench", entries, payload, parent)
    dec_s = time.perf_counter() - t0
    if state_sha256(back) != state_sha256(state):
        raise AssertionError("delta is not bit-exact")
    del back
    changed = sum(int((_raw_bytes(t).reshape(-1, t.element_size()) != _raw_bytes(parent[k]).reshape(
        -1, t.element_size())).any(1).sum()) for k, t in state.items())
    n = sum(t.numel() for t in state.values())
    return _finish({"raw": raw, "delta": len(payload), "snapshot_zstd": snapshot_zstd_bytes(state),
                    "entropy": entropy_bound_bytes(state, parent), "changed": changed, "n": n,
                    "enc_s": enc_s, "dec_s": dec_s})


_SUMMED = ("raw", "delta", "snapshot_zstd", "entropy", "changed", "n", "enc_s", "dec_s")


def _finish(m: dict) -> dict:
    """Add the derived ratio, changed fraction and MB/s to summed byte counts and times."""
    return {**m, "ratio": m["raw"] / m["delta"], "changed_frac": m["changed"] / m["n"],
            "enc_mb_s": m["raw"] / m["enc_s"] / 1e6, "dec_mb_s": m["raw"] / m["dec_s"] / 1e6}


def streamed_random_adamw(base32: dict[str, torch.Tensor], trainable: set[str], steps: list[int],
                          lr: float) -> list[dict]:
    """AdamW on standard-normal gradients, one tensor at a time, measuring fp32 and bf16
    deltas after each step count in ``steps`` and summing over tensors.

    AdamW is elementwise, so with independent random gradients running it per tensor gives
    exactly the weights a whole-model run would; memory stays at the base weights plus one
    tensor's optimizer state (a whole-model run of a 373M model needs ~12 GB). Tensors not
    in ``trainable`` (buffers) are measured unchanged.
    """
    sums = {(dt, n): dict.fromkeys(_SUMMED, 0.0) for dt in ("fp32", "bf16") for n in steps}
    g = torch.Generator().manual_seed(0)
    for i, (k, b) in enumerate(sorted(base32.items())):
        p = torch.nn.Parameter(b.clone())
        opt = torch.optim.AdamW([p], lr=lr, weight_decay=0.0)
        done = 0
        for n in steps:
            while done < n and k in trainable:
                p.grad = torch.randn(p.shape, generator=g)
                opt.step()
                done += 1
            s32 = p.detach().clone()
            for dt, st, par in (("fp32", s32, b), ("bf16", s32.to(torch.bfloat16), b.to(torch.bfloat16))):
                m = measure({k: st}, {k: par})
                for f in _SUMMED:
                    sums[(dt, n)][f] += m[f]
        if i % 20 == 0:
            print(f"  tensor {i + 1}/{len(base32)}", file=sys.stderr, flush=True)
    return [_finish({**v, "dtype": dt, "steps": n}) for (dt, n), v in sums.items()]


def learner_step_delta(state_path: Path, model_dir: Path) -> int:
    """Delta of one real bf16 full-parameter learner step on the bf16 parent (see module doc)."""
    from safetensors.torch import load_file

    from schemas.modelspec import load_model

    model = load_model(model_dir, dtype=torch.float32)
    parent = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()
              if not (k == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False))}
    del model
    state = load_file(str(state_path))
    if state.keys() != parent.keys():
        raise SystemExit(f"{state_path}: tensors differ from {model_dir}'s "
                         f"({sorted(state.keys() ^ parent.keys())[:5]})")
    state = {k: v.to(torch.bfloat16) for k, v in state.items()}
    r = measure(state, parent)
    print(f"one full-parameter bf16 learner step on {model_dir}: {r['changed_frac']:.2%} of weights changed, "
          f"raw {r['raw'] / 1e6:.1f} MB, delta {r['delta'] / 1e6:.2f} MB, zstd snapshot "
          f"{r['snapshot_zstd'] / 1e6:.1f} MB, entropy bound {r['entropy'] / 1e6:.2f} MB")
    print(f"RESULT delta_ratio_bf16_full_param_learner_step={r['ratio']:.1f} x target>=20")
    print(f"RESULT delta_changed_frac_bf16_full_param_learner_step={r['changed_frac']:.4f} frac target<=0.02")
    print("RESULT delta_bit_exact=1 bool target==1")
    return 0


def store_cycle_delta(model_dir: Path, lr: float, n_samples: int) -> int:
    """One real bf16 learner cycle through the model store (see module doc, ``--store-cycle``)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_learner_replay import make_samples  # samples logged as serving logs them

    tmp = Path(tempfile.mkdtemp(prefix="flywheel-delta-"))
    try:
        return _store_cycle(tmp, model_dir, lr, n_samples, make_samples)
    finally:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


def _store_cycle(tmp: Path, model_dir: Path, lr: float, n_samples: int, make_samples) -> int:
    from modelstore.store import ModelStore
    from flywheel.modelinit import import_checkpoint
    from samplestore import shards as writer
    from learner.cycle import run_cycle
    from learner.trainer import LearnerConfig
    from schemas.modelspec import load_model, load_tokenizer

    ckpt = tmp / "bf16"
    load_model(model_dir, dtype=torch.bfloat16).save_pretrained(ckpt, safe_serialization=True)
    load_tokenizer(model_dir).save_pretrained(ckpt)
    _, m0 = import_checkpoint(ckpt, tmp / "store", log=lambda s: print(s, file=sys.stderr))
    store = ModelStore(tmp / "store")
    model = load_model(store.base_dir)
    samples = make_samples(model, n_samples, version="v000000", seed=0, p_len=(8, 24), c_len=(8, 24))
    del model
    writer.write_shard(samples, writer.shard_path(tmp / "samples", min(s.sealed_at for s in samples), "a"))
    cfg = LearnerConfig(steps=1, batch_size=n_samples, micro_batch_size=1, lr=lr, measure_free_max=1)
    t0 = time.perf_counter()
    m1 = run_cycle(store.root, tmp / "samples", tmp / "state", cfg, show_progress=False)
    cycle_s = time.perf_counter() - t0
    if m1 is None or m1.kind != "delta":
        raise SystemExit(f"the cycle published {m1 and m1.kind}, expected a delta")
    dtypes = {t.dtype for t in m1.tensors.values()}
    v1 = ModelStore(store.root).load("v000001")  # from disk; raises if any sha256 differs
    v0 = store.load("v000000")
    changed = sum(int((_raw_bytes(t).reshape(-1, 2) != _raw_bytes(v0[k]).reshape(-1, 2)).any(1).sum())
                  for k, t in v1.items())
    n = sum(t.numel() for t in v1.values())
    snap_zstd = snapshot_zstd_bytes(v1)
    ratio = m1.snapshot_bytes / m1.size_bytes
    print(f"store cycle on {model_dir} in bf16 ({n / 1e6:.1f}M weights, {dtypes}): KTO, 1 step, lr {lr}, "
          f"{n_samples} samples, cycle {cycle_s:.0f}s; {changed / n:.2%} of weights changed; raw snapshot "
          f"{m1.snapshot_bytes / 1e6:.2f} MB, zstd snapshot {snap_zstd / 1e6:.2f} MB, delta "
          f"{m1.size_bytes / 1e6:.3f} MB; mismatch max {m1.metrics.get('mismatch/max')}")
    print(f"RESULT delta_ratio_bf16_store_cycle={ratio:.1f} x target>=20")
    print(f"RESULT delta_vs_zstd_snapshot_bf16_store_cycle={snap_zstd / m1.size_bytes:.1f} x target>=1")
    print(f"RESULT delta_changed_frac_bf16_store_cycle={changed / n:.4f} frac target<=0.02")
    print(f"RESULT delta_store_cycle_bf16=%d bool target==1" % int(dtypes == {"torch.bfloat16"}))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny random MoE, steps 1,10")
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="HF checkpoint (default: the real SmolLM2 MoE if cached, else the flywheel base model)")
    ap.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate (RL fine-tuning scale, 1e-6..1e-5)")
    ap.add_argument("--steps", default=None, help="comma-separated step counts (default 1,10,100; quick 1,10)")
    ap.add_argument("--grads", choices=("random", "loss"), default=None,
                    help="gradient source (default: loss with --quick, random on the real model)")
    ap.add_argument("--seq", type=int, default=32, help="tokens per sequence of the loss batch (--grads loss)")
    ap.add_argument("--learner-state", type=Path, default=None,
                    help="safetensors of the weights after a real bf16 learner step (bench/learner.py --save-state)")
    ap.add_argument("--store-cycle", action="store_true",
                    help="one real bf16 learner cycle through the model store (import, samples, KTO, publish)")
    ap.add_argument("--samples", type=int, default=8, help="--store-cycle: samples in the cycle")
    a = ap.parse_args(argv)
    from schemas.modelspec import load_model

    if a.learner_state is not None:
        return learner_step_delta(a.learner_state, a.model_dir or REAL_MODEL)
    if a.store_cycle:
        if a.quick and a.model_dir is None:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
            from conftest import make_tiny_moe

            a.model_dir = make_tiny_moe(Path(tempfile.mkdtemp()) / "tiny", num_layers=4)
        return store_cycle_delta(a.model_dir or REAL_MODEL, a.lr if "--lr" in (argv or sys.argv) else 1e-5,
                                 a.samples)

    if a.quick:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from conftest import make_tiny_moe

        model_dir = a.model_dir or make_tiny_moe(Path(tempfile.mkdtemp()) / "tiny", num_layers=4)
    else:
        from schemas.settings import base_model_dir

        model_dir = a.model_dir or (REAL_MODEL if (REAL_MODEL / "config.json").exists() else base_model_dir())
    grads = a.grads or ("loss" if a.quick else "random")
    steps = sorted(int(s) for s in (a.steps or ("1,10" if a.quick else "1,10,100")).split(","))
    torch.manual_seed(0)
    model = load_model(model_dir, dtype=torch.float32)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    done, results, t_train = 0, [], 0.0
    if grads == "random":  # per tensor, low memory (see streamed_random_adamw)
        base32 = {k: v.detach().clone() for k, v in model.state_dict().items()}
        trainable = {k for k, _ in model.named_parameters()}
        # tied weights (lm_head = embed_tokens) are one parameter: measure the state-dict
        # entries named by parameters plus any buffers, once each
        base32 = {k: v for k, v in base32.items() if k in trainable or not v.is_floating_point()}
        del model
        t0 = time.perf_counter()
        results = streamed_random_adamw(base32, trainable, steps, a.lr)
        t_train = time.perf_counter() - t0
        steps_iter: list[int] = []
    else:
        base32 = {k: v.detach().clone() for k, v in model.state_dict().items()}
        base16 = {k: v.to(torch.bfloat16) for k, v in base32.items()}
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
        steps_iter = steps
    for n in steps_iter:
        t0 = time.perf_counter()
        while done < n:
            opt.zero_grad()
            if grads == "loss":
                ids = torch.randint(0, model.config.vocab_size, (2, a.seq))
                model(input_ids=ids, labels=ids).loss.backward()
            else:
                for p in model.parameters():
                    p.grad = torch.randn_like(p)
            opt.step()
            done += 1
        t_train += time.perf_counter() - t0
        s32 = {k: v.detach().clone() for k, v in model.state_dict().items()}
        for dt, state, parent in (("fp32", s32, base32),
                                  ("bf16", {k: v.to(torch.bfloat16) for k, v in s32.items()}, base16)):
            m = measure(state, parent)
            m.update(dtype=dt, steps=n)
            results.append(m)
            print(f"  measured {dt} after {n} steps", file=sys.stderr, flush=True)
        del s32
    print(f"model {model_dir} ({n_params / 1e6:.0f}M params), AdamW lr {a.lr}, grads {grads}, "
          f"zstd level {ZSTD_LEVEL}, training{'+measuring' if grads == 'random' else ''} {t_train:.0f}s")
    print(f"{'dtype':5} {'steps':>5} {'changed':>8} {'raw MB':>8} {'delta MB':>9} {'zstd snap MB':>12} "
          f"{'entropy MB':>10} {'raw/delta':>9} {'zstd/delta':>10} {'delta/entr':>10} {'enc MB/s':>8} {'dec MB/s':>8}")
    for r in results:
        print(f"{r['dtype']:5} {r['steps']:5d} {r['changed_frac']:8.2%} {r['raw'] / 1e6:8.2f} {r['delta'] / 1e6:9.3f} "
              f"{r['snapshot_zstd'] / 1e6:12.2f} {r['entropy'] / 1e6:10.3f} {r['ratio']:9.1f} "
              f"{r['snapshot_zstd'] / r['delta']:10.1f} {r['delta'] / max(r['entropy'], 1):10.2f} "
              f"{r['enc_mb_s']:8.0f} {r['dec_mb_s']:8.0f}")
    by = {(r["dtype"], r["steps"]): r for r in results}
    for n in steps:
        for dt in ("bf16", "fp32"):
            r = by[(dt, n)]
            tgt = "target>=20" if (dt, n) == ("bf16", 1) else "target>=1"
            print(f"RESULT delta_ratio_{dt}_{n}step={r['ratio']:.1f} x {tgt}")
    one = by[("bf16", steps[0])]
    print(f"RESULT delta_vs_zstd_snapshot_bf16_{steps[0]}step={one['snapshot_zstd'] / one['delta']:.1f} x target>=1")
    print(f"RESULT delta_encode_bf16_{steps[0]}step={one['enc_mb_s']:.0f} MB/s target>0")
    print(f"RESULT delta_decode_bf16_{steps[0]}step={one['dec_mb_s']:.0f} MB/s target>0")
    print("RESULT delta_bit_exact=1 bool target==1")
    return 0 if math.isfinite(one["ratio"]) else 1


if __name__ == "__main__":
    sys.exit(main())
