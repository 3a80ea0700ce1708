"""Learner throughput and memory: our DeepSpeed step vs a plain PyTorch loop, one run.

``python bench/learner.py [--quick] [--model-dir DIR]``

Both sides train the same model on the same left-padded batch with router replay, the
same KTO loss and AdamW (lr 1e-5), for the same number of steps; each side runs in its own
subprocess so its peak RSS (``ru_maxrss``) is its own. Prints, last:

    RESULT tokens_per_s_vs_plain_loop=<x> x target>=0.9
    RESULT peak_rss_vs_plain_loop=<x> x target<=1.5

Cost of finding and loading one cycle's samples vs stored history (``--history-factor``, default
20): two sample roots hold the same new cycle (256 samples of 300 tokens with routes shaped like
the default model's, 30 MoE layers x top-2) after 1x and 20x as much already-consumed history
(one 64-sample shard per hour back); the learner's path (``learner.cycle.new_shards`` from its
watermark + ``SpilledSamples.from_shards``) is timed on each, alternating, best of 11:

    RESULT cycle_load_history_ratio=<t_20x / t_1x> x target<=1.2

Full-parameter training of the default model (``--full-model DIR``, e.g. the output of
``flywheel model init``): one ``learner.trainer.train`` step over 2 samples of 48+16 tokens in
micro-batches of 1, bf16 with fp32 master weights and AdamW state under ZeRO-2, activation
checkpointing, in its own process (``ru_maxrss``); ``--save-state PATH`` keeps the new bf16
weights for ``bench/delta.py --learner-state PATH``:

    RESULT full_param_peak_rss_gb=<x> GB target<=12
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _samples(model_dir: Path, n: int, prompt_len: int, completion_len: int, seed: int = 0):
    """RewardedSamples whose behavior logprobs and routes come from a real forward."""
    import uuid

    import torch

    from learner.replay import capture_routes, stack_routes
    from schemas.events import ExpertRoutes, RewardedSample, SamplingParams
    from schemas.modelspec import load_model

    g = torch.Generator().manual_seed(seed)
    model = load_model(model_dir)
    vocab = model.config.vocab_size
    out = []
    for i in range(n):
        p = torch.randint(3, vocab, (prompt_len,), generator=g).tolist()
        c = torch.randint(3, vocab, (completion_len,), generator=g).tolist()
        ids = torch.tensor([p + c[:-1]])
        cap: list = []
        with torch.no_grad(), capture_routes(model, cap):
            logits = model(ids).logits[0].float()
        routes = stack_routes(cap, 1, ids.shape[1])[0].numpy()
        lp = torch.log_softmax(logits, -1)[len(p) - 1:].gather(-1, torch.tensor(c)[:, None])[:, 0]
        out.append(RewardedSample(
            completion_id=uuid.uuid4(), model_version="v000000", created_at=0, user_hash="u",
            prompt_token_ids=p, completion_token_ids=c, behavior_logprobs=lp.tolist(),
            sampling=SamplingParams(), expert_routes=ExpertRoutes.from_array(routes), finish_reason="length",
            reward=1.0 if i % 2 else -1.0, label=bool(i % 2), n_votes=1, votes_up=i % 2,
            votes_down=1 - i % 2, event_ids=[str(uuid.uuid4())], sealed_at=0))
    return out


def _worker(mode: str, model_dir: Path, n: int, prompt_len: int, completion_len: int, steps: int) -> dict:
    import torch

    from learner.batch import build_batch
    from learner.losses import kto_loss, sequence_logprobs
    from learner.trainer import LearnerConfig, _ds_config, ensure_dist_env, forward_token_logprobs
    from schemas.modelspec import load_model

    samples = _samples(model_dir, n, prompt_len, completion_len)
    model = load_model(model_dir)
    batch = build_batch(samples, model.config.pad_token_id or 0)
    with torch.no_grad():
        ref = forward_token_logprobs(model, batch, replay=True)
    ref_seq = sequence_logprobs(ref, batch.completion_mask)
    model.train()
    cfg = LearnerConfig(steps=steps, batch_size=n, lr=1e-5, zero_stage=2)

    def loss_of(m):
        lp = forward_token_logprobs(m, batch, replay=True)
        pol = sequence_logprobs(lp, batch.completion_mask)
        losses, _ = kto_loss(pol, ref_seq, batch.labels, torch.tensor(0.0), beta=cfg.beta,
                             desirable_weight=cfg.desirable_weight, undesirable_weight=cfg.undesirable_weight)
        return losses.mean()

    if mode == "deepspeed":
        ensure_dist_env()
        import deepspeed

        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                               config=_ds_config(cfg))
        step = lambda: (engine.backward(loss_of(engine.module)), engine.step())  # noqa: E731
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)

        def step():
            opt.zero_grad(set_to_none=True)
            loss = loss_of(model)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    step()  # warm-up (allocator, DeepSpeed buckets)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    dt = time.perf_counter() - t0
    tokens = int(batch.attention_mask.sum()) * steps
    return {"tokens_per_s": tokens / dt, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


HISTORY_SHARD_ROWS = 64
CYCLE_SAMPLES = 256


def _routed_rows(n: int, t0: int, tokens: int = 300, layers: int = 30, top_k: int = 2, experts: int = 4,
                 seed: int = 0):
    """``n`` RewardedSamples shaped like the default model's (routes (tokens-1, 30, 2))."""
    import uuid

    import numpy as np

    from schemas.events import ExpertRoutes, RewardedSample, SamplingParams

    rng = np.random.default_rng(seed)
    P = tokens // 3
    C = tokens - P
    return [RewardedSample(
        completion_id=uuid.uuid4(), model_version="v000000", created_at=t0 - 60_000, user_hash="u",
        prompt_token_ids=rng.integers(3, 49152, P).tolist(), completion_token_ids=rng.integers(3, 49152, C).tolist(),
        behavior_logprobs=(-rng.random(C) * 3).tolist(), sampling=SamplingParams(temperature=0.7),
        expert_routes=ExpertRoutes.from_array(rng.integers(0, experts, (tokens - 1, layers, top_k))),
        finish_reason="stop", reward=1.0, label=bool(i % 2), n_votes=1, votes_up=1, votes_down=0,
        event_ids=[str(uuid.uuid4())], sealed_at=t0 + i) for i in range(n)]


def bench_history(root: Path, factor: int, base_shards: int = 16, reps: int = 11) -> dict:
    """Seconds to find and load one cycle's samples after 1x and ``factor``x history: best of
    ``reps`` alternating runs (the box is shared: the minimum discounts other jobs), medians too."""
    import statistics

    from samplestore.shards import shard_path, write_shard
    from learner.cycle import consume, new_shards, new_state
    from learner.data import SpilledSamples

    hour = 3_600_000
    now = (int(time.time() * 1000) // hour) * hour
    template = write_shard(_routed_rows(HISTORY_SHARD_ROWS, now - 10**6, seed=1), root / "template.parquet")
    cycle = _routed_rows(CYCLE_SAMPLES, now, seed=2)
    lateness = 600_000
    states, roots = {}, {}
    for scale in (1, factor):
        sd = roots[scale] = root / f"x{scale}"
        hist = []
        for h in range(base_shards * scale):  # one consumed shard per hour back (hard links: no disk)
            p = shard_path(sd, now - (h + 1) * hour)
            p.parent.mkdir(parents=True, exist_ok=True)
            os.link(template, p)
        st = new_state()
        st = consume(st, new_shards(sd, st, lateness), lateness)  # history consumed by earlier cycles
        for c in range(0, CYCLE_SAMPLES, HISTORY_SHARD_ROWS):
            part = cycle[c:c + HISTORY_SHARD_ROWS]
            write_shard(part, shard_path(sd, part[0].sealed_at))
        states[scale] = st
    times: dict[int, list[float]] = {1: [], factor: []}
    finds: dict[int, list[float]] = {1: [], factor: []}
    for scale in (1, factor):  # warm-up, not timed: lazy imports, page cache
        SpilledSamples.from_shards([s.path for s in new_shards(roots[scale], states[scale], lateness)],
                                   root / "warm.arrow")
    for r in range(reps):
        for scale in ((1, factor) if r % 2 == 0 else (factor, 1)):
            t0 = time.perf_counter()
            shards = new_shards(roots[scale], states[scale], lateness)
            t1 = time.perf_counter()
            src = SpilledSamples.from_shards([s.path for s in shards], root / f"spill{scale}.arrow")
            times[scale].append(time.perf_counter() - t0)
            finds[scale].append(t1 - t0)
            assert len(src) == CYCLE_SAMPLES, (scale, len(src))
    return {"t1_s": min(times[1]), "tN_s": min(times[factor]), "t1_median_s": statistics.median(times[1]),
            "tN_median_s": statistics.median(times[factor]), "find1_ms": 1e3 * min(finds[1]),
            "findN_ms": 1e3 * min(finds[factor]),
            "history_1x": base_shards * HISTORY_SHARD_ROWS, "history_Nx": base_shards * factor * HISTORY_SHARD_ROWS}


def _full_worker(model_dir: Path, save: Path | None) -> dict:
    """One full-parameter bf16 step of the default model; peak RSS of this process."""
    import torch

    from learner.trainer import LearnerConfig, train
    from schemas.modelspec import load_model

    samples = _samples(model_dir, 2, 48, 16)
    model = load_model(model_dir)
    pad = model.config.pad_token_id or 0
    n_params = sum(p.numel() for p in model.parameters())
    cfg = LearnerConfig(steps=1, batch_size=2, micro_batch_size=1, lr=1e-5, zero_stage=2, precision="bf16",
                        activation_checkpointing=True, measure_free_max=1)
    t0 = time.perf_counter()
    state, met = train(model, samples, "v000000", cfg, pad)
    dt = time.perf_counter() - t0
    out = {"peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "train_s": dt,
           "params": n_params, "trainable": met["train/trainable_params"], "kto_loss": met.get("kto/loss")}
    if save is not None:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items() if k != "lm_head.weight" or
                   not getattr(model.config, "tie_word_embeddings", False)}, str(save))
    del state
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="HF checkpoint (default: a random 4-layer MoE, hidden 256, built here)")
    ap.add_argument("--history-factor", type=int, default=20, help="history multiple for cycle_load_history_ratio")
    ap.add_argument("--full-model", type=Path, default=None,
                    help="measure full-parameter bf16 training of this checkpoint (e.g. flywheel model init's)")
    ap.add_argument("--save-state", type=Path, default=None, help="with --full-model: write the new weights here")
    ap.add_argument("--only", choices=("all", "history", "full"), default="all",
                    help="run only the history or the full-model part")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    n, pl, cl, steps = (4, 48, 32, 3) if args.quick else (8, 128, 96, 5)
    if args.worker == "full":
        print(json.dumps(_full_worker(args.full_model, args.save_state)))
        return
    if args.worker:
        print(json.dumps(_worker(args.worker, args.model_dir, n, pl, cl, steps)))
        return
    results: list[str] = []
    if args.only in ("all", "history"):
        with tempfile.TemporaryDirectory() as d:
            h = bench_history(Path(d), args.history_factor)
        print(f"cycle find+load ({CYCLE_SAMPLES} samples), best of 11 (median): {h['t1_s']:.3f}s "
              f"({h['t1_median_s']:.3f}s) after {h['history_1x']} samples of history, {h['tN_s']:.3f}s "
              f"({h['tN_median_s']:.3f}s) after {h['history_Nx']}; find alone {h['find1_ms']:.2f} ms vs "
              f"{h['findN_ms']:.2f} ms")
        results.append(f"RESULT cycle_load_history_ratio={h['tN_s'] / h['t1_s']:.3f} x target<=1.2")
    if args.full_model is not None and args.only in ("all", "full"):
        cmd = [sys.executable, __file__, "--worker", "full", "--full-model", str(args.full_model)]
        if args.save_state:
            cmd += ["--save-state", str(args.save_state)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        if r.returncode != 0:
            sys.exit(f"full-model worker failed:\n{r.stderr[-3000:]}")
        f = json.loads(r.stdout.strip().splitlines()[-1])
        print(f"full-parameter bf16 step ({f['trainable'] / 1e6:.0f}M of {f['params'] / 1e6:.0f}M params trained, "
              f"ZeRO-2, activation checkpointing, 2 micro-batches of 64 tokens): {f['train_s']:.0f}s, "
              f"peak RSS {f['peak_rss_gb']:.2f} GB")
        results.append(f"RESULT full_param_peak_rss_gb={f['peak_rss_gb']:.2f} GB target<=12")
    if args.only != "all":
        print("\n".join(results))
        return
    tmp = tempfile.TemporaryDirectory()
    model_dir = args.model_dir
    if model_dir is None:
        sys.path.insert(0, str(ROOT / "tests"))
        from conftest import make_tiny_moe

        model_dir = make_tiny_moe(Path(tmp.name) / "m", num_layers=4)
        if not args.quick:  # a wider model so matmuls, not Python overhead, dominate
            import torch
            from transformers import MixtralConfig, MixtralForCausalLM

            cfg = MixtralConfig.from_pretrained(model_dir)
            cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads = 256, 512, 8
            cfg.num_key_value_heads = 4
            torch.manual_seed(0)
            MixtralForCausalLM(cfg).save_pretrained(model_dir)
    res = {}
    for mode in ("plain", "deepspeed"):
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
        r = subprocess.run([sys.executable, __file__, "--worker", mode, "--model-dir", str(model_dir)]
                           + (["--quick"] if args.quick else []), capture_output=True, text=True, env=env,
                           timeout=1800)
        if r.returncode != 0:
            sys.exit(f"{mode} worker failed:\n{r.stderr[-3000:]}")
        res[mode] = json.loads(r.stdout.strip().splitlines()[-1])
        print(f"{mode:10s} tokens/s {res[mode]['tokens_per_s']:9.1f}  peak RSS {res[mode]['peak_rss_mb']:8.1f} MB")
    print(f"RESULT tokens_per_s_vs_plain_loop={res['deepspeed']['tokens_per_s'] / res['plain']['tokens_per_s']:.3f} "
          "x target>=0.9")
    print(f"RESULT peak_rss_vs_plain_loop={res['deepspeed']['peak_rss_mb'] / res['plain']['peak_rss_mb']:.3f} "
          "x target<=1.5")
    print("\n".join(results))


if __name__ == "__main__":
    main()
