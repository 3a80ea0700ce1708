"""Learner throughput and memory: our DeepSpeed step vs a plain PyTorch loop, one run.

``python bench/learner.py [--quick] [--model-dir DIR]``

Both sides train the same model on the same left-padded batch with router replay, the
same KTO loss and AdamW (lr 1e-5), for the same number of steps; each side runs in its own
subprocess so its peak RSS (``ru_maxrss``) is its own. Prints, last:

    RESULT tokens_per_s_vs_plain_loop=<x> x target>=0.9
    RESULT peak_rss_vs_plain_loop=<x> x target<=1.5
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
        losses, _ = kto_loss(pol, ref_seq, batch.labels, torch.tensor(0.0), beta=0.1)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="HF checkpoint (default: a random 4-layer MoE, hidden 256, built here)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    n, pl, cl, steps = (4, 48, 32, 3) if args.quick else (8, 128, 96, 5)
    if args.worker:
        print(json.dumps(_worker(args.worker, args.model_dir, n, pl, cl, steps)))
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


if __name__ == "__main__":
    main()
