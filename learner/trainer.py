"""One learner cycle's training on already-loaded samples, with DeepSpeed (DESIGN §3-4).

Order of a cycle: (1) staleness filter and route checks (dropped samples counted by reason),
(2) a no-grad pass with the parent weights that gives the frozen reference logprobs
(reference = the parent policy of this cycle) and the train-vs-serving mismatch before any
update (with router replay, and with free routing: route-flip fraction), (3) K optimizer
steps of KTO (or REINFORCE) with truncated importance sampling under router replay.

Reference choice: π_ref is the parent version (the policy being improved), frozen for the
cycle. Its logprobs are computed once at the start, so no second model is kept in memory.

This module knows nothing about Parquet or the model store (see ``learner.cycle``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import signal
import socket
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

import torch

from schemas.events import RewardedSample
from schemas.manifest import version_number
from schemas.modelspec import moe_routers, moe_top_k
from learner.batch import LearnerBatch, build_batch, filter_samples
from learner.losses import (group_loo_baseline, kl_to_reference, kto_loss, loo_baseline, reinforce_loss, sequence_logprobs,
                            tis_weights, token_logprobs)
from learner.replay import capture_routes, router_replay, stack_routes


@dataclass
class LearnerConfig:
    """Configuration of one learner cycle; validated on construction.

    Optimisation (DeepSpeed, CPU, gloo, fp32):
        steps: K optimizer steps per cycle (>= 1).
        batch_size: samples per step (>= 1); sampled without replacement, reshuffled per epoch.
        lr: AdamW learning rate (>= 0; 0 leaves weights unchanged).
        grad_clip: global grad-norm clip (> 0).
        weight_decay: AdamW decoupled weight decay (>= 0).
        zero_stage: ZeRO stage, 1 or 2.
        seed: RNG seed (sample order, torch).

    Objective:
        objective: ``"kto"`` (Ethayarajh et al. 2024, arXiv:2402.01306) or ``"reinforce"``
            (REINFORCE with leave-one-out baseline, Kool et al. 2019).
        beta: KTO β (> 0).
        desirable_weight, undesirable_weight: KTO λ_D, λ_U (> 0).
        balance_classes: set λ_D, λ_U per cycle so that λ_D·n_D = λ_U·n_U (the minority
            class's weight is raised; the other stays as given). The KTO paper (§4.2,
            arXiv:2402.01306) recommends λ_D·n_D / (λ_U·n_U) in [1, 4/3]; product feedback
            is mostly one class (a 10 % thumbs-up rate gives 9 undesirable per desirable),
            and unbalanced KTO then mostly pushes sampled completions down.
        kl_coef: REINFORCE k3 KL penalty to the reference (>= 0).
        baseline: REINFORCE baseline. ``"batch"``: leave-one-out mean of the step's batch
            (Kool et al. 2019). ``"prompt"``: leave-one-out mean of the other completions of
            the same prompt in the whole cycle (RLOO, arXiv:2402.14740), so prompts whose
            completions all got the same vote contribute no gradient; a prompt seen once
            falls back to the cycle's LOO mean.

    Off-policy correction:
        is_cap: truncation of the importance ratio exp(log πθ − log μ) (> 0).
        is_level: ``"sequence"`` or ``"token"`` (KTO supports ``"sequence"`` only).
        max_staleness: samples produced by a version more than this many versions older
            than the parent are dropped and counted (>= 0).
        min_samples: skip the cycle (publish nothing, consume nothing) below this many
            trainable samples (>= 1).
        measure_chunk: samples per forward in the start-of-cycle reference/mismatch pass
            (1 = each sample alone, unpadded).
        measure_free_max: samples that also get a replay-off forward for the route-flip
            and free-routing mismatch figures (0 = all; each costs one more forward).

    Trainable set:
        train_layers: 0 trains every parameter; N > 0 trains only the last N decoder layers
            (attention, router and experts) and freezes the rest (embeddings, earlier
            layers, final norm). Frozen layers keep no activations and get no optimizer
            state, so memory and backward time shrink roughly by N / num_layers; frozen
            tensors are bit-identical in the new version, so the delta skips them.
        checkpoint_every: write a resumable DeepSpeed checkpoint every this many steps
            (0 = never).

    Evaluation gate (``learner.gate``):
        holdout_frac: fraction of new samples held out (by completion-id hash) to score
            parent and candidate; 0 = no built-in gate.
        max_regression: the candidate is not published if its score is below the parent's
            minus this (score units: nats/token for the built-in preference margin).

    Router replay:
        router_replay: replay logged expert routes in the training forward.
        allow_free_routing: train samples without usable routes on free routing instead of
            refusing them (off by default: such samples are refused and counted).
    """

    steps: int = 4
    batch_size: int = 8
    lr: float = 1e-5
    grad_clip: float = 1.0
    weight_decay: float = 0.0
    zero_stage: int = 2
    seed: int = 0
    objective: Literal["kto", "reinforce"] = "kto"
    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    balance_classes: bool = False
    kl_coef: float = 0.0
    baseline: Literal["batch", "prompt"] = "batch"
    is_cap: float = 2.0
    is_level: Literal["sequence", "token"] = "sequence"
    max_staleness: int = 4
    measure_chunk: int = 1
    checkpoint_every: int = 0
    holdout_frac: float = 0.0
    max_regression: float = 0.0
    router_replay: bool = True
    allow_free_routing: bool = False
    min_samples: int = 1
    train_layers: int = 0
    measure_free_max: int = 0

    def __post_init__(self):
        checks = [
            ("steps", self.steps >= 1, "must be >= 1"), ("batch_size", self.batch_size >= 1, "must be >= 1"),
            ("lr", self.lr >= 0, "must be >= 0"), ("grad_clip", self.grad_clip > 0, "must be > 0"),
            ("weight_decay", self.weight_decay >= 0, "must be >= 0"),
            ("zero_stage", self.zero_stage in (1, 2), "must be 1 or 2"),
            ("objective", self.objective in ("kto", "reinforce"), "must be 'kto' or 'reinforce'"),
            ("beta", self.beta > 0, "must be > 0"),
            ("desirable_weight", self.desirable_weight > 0, "must be > 0"),
            ("undesirable_weight", self.undesirable_weight > 0, "must be > 0"),
            ("kl_coef", self.kl_coef >= 0, "must be >= 0"), ("is_cap", self.is_cap > 0, "must be > 0"),
            ("baseline", self.baseline in ("batch", "prompt"), "must be 'batch' or 'prompt'"),
            ("baseline", self.objective == "reinforce" or self.baseline == "batch",
             "is REINFORCE's baseline: use it with objective 'reinforce'"),
            ("is_level", self.is_level in ("sequence", "token"), "must be 'sequence' or 'token'"),
            ("is_level", not (self.objective == "kto" and self.is_level == "token"),
             "KTO's loss is per sequence: use 'sequence'"),
            ("max_staleness", self.max_staleness >= 0, "must be >= 0"),
            ("min_samples", self.min_samples >= 1, "must be >= 1"),
            ("train_layers", self.train_layers >= 0, "must be >= 0 (0 = all)"),
            ("measure_free_max", self.measure_free_max >= 0, "must be >= 0 (0 = all)"),
            ("measure_chunk", self.measure_chunk >= 1, "must be >= 1"),
            ("checkpoint_every", self.checkpoint_every >= 0, "must be >= 0"),
            ("holdout_frac", 0 <= self.holdout_frac < 1, "must be in [0, 1)"),
            ("max_regression", self.max_regression >= 0, "must be >= 0"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"{name}: {why}, got {getattr(self, name)!r}")


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_dist_env() -> None:
    """Set the single-process torch.distributed env (gloo) where unset and init DeepSpeed.

    Sets ``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``, ``WORLD_SIZE=1 RANK=0 LOCAL_RANK=0``
    and ``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/flywheel/torch_extensions``: DeepSpeed's
    shm comm op is JIT-built there once, ~40 s cold). Idempotent.
    """
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "flywheel" / "torch_extensions"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    for k, v in (("WORLD_SIZE", "1"), ("RANK", "0"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(k, v)
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed("gloo")


def staleness_filter(samples: list[RewardedSample], parent: str, max_staleness: int
                     ) -> tuple[list[RewardedSample], Counter]:
    """Drop samples whose producing version is more than ``max_staleness`` versions older
    than ``parent`` (staleness = number(parent) − number(model_version)).

    Returns ``(kept, Counter)`` with drop reasons ``stale`` and ``bad_version`` (unparsable
    name). Samples from a version numbered above the parent (a sibling canary that was not
    promoted) are kept (their behavior logprobs still give exact importance ratios) and
    counted as ``newer_than_parent``.
    """
    p = version_number(parent)
    keep, dropped = [], Counter()
    for s in samples:
        try:
            st = p - version_number(s.model_version)
        except ValueError:
            dropped["bad_version"] += 1
            continue
        if st < 0:
            dropped["newer_than_parent"] += 1
            keep.append(s)
        elif st > max_staleness:
            dropped["stale"] += 1
        else:
            keep.append(s)
    return keep, dropped


def forward_token_logprobs(model, batch: LearnerBatch, replay: bool = True) -> torch.Tensor:
    """log π(y_t) for every position, (B, T) float32, under router replay when ``replay``
    and ``batch.routes`` is set. Grad flows when called outside ``torch.no_grad``."""
    with router_replay(model, batch.routes if replay else None):
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                    position_ids=batch.position_ids, use_cache=False)
    return token_logprobs(out.logits, batch.target_ids)


def _abs_stats(d: torch.Tensor, prefix: str) -> dict[str, float]:
    if d.numel() == 0:
        return {}
    return {f"{prefix}/mean": float(d.mean()), f"{prefix}/p99": float(torch.quantile(d.double(), 0.99)),
            f"{prefix}/max": float(d.max())}


@torch.no_grad()
def measure_start(model, batch: LearnerBatch, parent: str, chunk: int = 1,
                  free_max: int | None = None) -> tuple[torch.Tensor, dict]:
    """The start-of-cycle pass with the parent weights (no grad, eval mode).

    Forwards run ``chunk`` samples at a time with common padding trimmed (chunk 1 = each
    sample alone, unpadded, like a batch-1 prefill). On CPU, fp32 matmuls of different
    row counts may differ in the last bit (measured: up to ~1e-6 in logprob between a
    batch of 8 left-padded samples and each alone), so the batch layout is part of what
    "exactly 0" means.

    Returns ``(ref_logprobs (B, T) float32, metrics)``: the reference logprobs, and the
    mismatch |log π_train − log μ| over completion tokens of samples produced by ``parent``
    itself (``mismatch/mean|p99|max``, ``mismatch/n_tokens``); with routes, also the same
    with free routing (``mismatch_free/*``) and ``routes/flip_frac`` = fraction of real
    (token, layer) pairs whose free top-k expert set differs from the logged one.
    ``free_max`` bounds how many samples get the extra replay-off forward (None: all);
    the replayed pass, which gives the reference logprobs, always covers every sample.
    """
    was_training = model.training
    model.eval()
    refs, flips, flip_n, d_rep, d_free = [], 0, 0, [], []
    for s in range(0, batch.size, chunk):
        full = batch.select(list(range(s, min(s + chunk, batch.size))))
        b = full.trim()
        lp = forward_token_logprobs(model, b, replay=True)  # (b, T')
        pad = full.input_ids.shape[1] - b.input_ids.shape[1]
        refs.append(torch.nn.functional.pad(lp, (pad, 0)))  # back to (b, T)
        own = torch.tensor([v == parent for v in b.versions])
        m = b.completion_mask.bool() & own.unsqueeze(-1)
        d_rep.append((lp - b.behavior_logprobs)[m].abs())
        if b.routes is not None and (free_max is None or s < free_max):
            cap: list = []
            with capture_routes(model, cap):
                lpf = forward_token_logprobs(model, b, replay=False)
            d_free.append((lpf - b.behavior_logprobs)[m].abs())
            free = stack_routes(cap, *b.input_ids.shape)  # (b, T, L, k)
            same = (free.sort(-1).values == b.routes.sort(-1).values).all(-1)  # (b, T, L)
            real = b.attention_mask.bool().unsqueeze(-1).expand_as(same)
            flips += int((~same & real).sum())
            flip_n += int(real.sum())
    model.train(was_training)
    d = torch.cat(d_rep)
    metrics = {"mismatch/n_tokens": int(d.numel()), **_abs_stats(d, "mismatch")}
    if d_free:
        metrics.update(_abs_stats(torch.cat(d_free), "mismatch_free"))
        metrics["routes/flip_frac"] = flips / max(flip_n, 1)
    return torch.cat(refs), metrics


def freeze_for_training(model, train_layers: int) -> int:
    """Freeze all but the last ``train_layers`` decoder layers (0: train everything).

    Returns:
        number of trainable parameters.

    Raises:
        ValueError: ``train_layers`` exceeds the model's layer count.
    """
    if train_layers:
        layers = model.model.layers
        if train_layers > len(layers):
            raise ValueError(f"train_layers: {train_layers} > {len(layers)} layers in the model")
        for p in model.parameters():
            p.requires_grad_(False)
        for layer in layers[len(layers) - train_layers:]:
            for p in layer.parameters():
                p.requires_grad_(True)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _ds_config(cfg: LearnerConfig) -> dict:
    return {
        "train_batch_size": cfg.batch_size, "train_micro_batch_size_per_gpu": cfg.batch_size,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": cfg.lr, "weight_decay": cfg.weight_decay,
                                                  "betas": [0.9, 0.999], "eps": 1e-8, "torch_adam": True}},
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": {"stage": cfg.zero_stage},
        "fp16": {"enabled": False}, "bf16": {"enabled": False},
        "steps_per_print": 1 << 30, "wall_clock_breakdown": False,
    }


def _world() -> tuple[int, int]:
    """``(rank, world_size)`` of the initialised process group, ``(0, 1)`` without one."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _global_mean(x: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` (B,) over all ranks' rows (each rank holds an equal share)."""
    rank, world = _world()
    if world == 1:
        return x.mean()
    t = torch.stack([x.sum(), torch.tensor(float(x.numel()), dtype=x.dtype)])
    torch.distributed.all_reduce(t)
    return t[0] / t[1]


def step_loss(model, b: LearnerBatch, cfg: LearnerConfig) -> tuple[torch.Tensor, dict]:
    """Loss of one training batch (with grad) and its namespaced metrics.

    KTO: per-sample KTO loss × sequence TIS weight, batch mean. z0 = clamp(mean_i(r_i), 0)
    detached: the completions are drawn from ≈ the policy, so the batch mean of the matched
    log-ratio r estimates KL(πθ ‖ π_ref) (TRL uses mismatched pairs; those have no logged
    routes to replay). REINFORCE: :func:`learner.losses.reinforce_loss` with a LOO baseline.
    """
    tok = forward_token_logprobs(model, b, replay=cfg.router_replay)  # (B, T)
    m = b.completion_mask
    if cfg.objective == "kto":
        pol = sequence_logprobs(tok, m)  # (B,)
        ref = sequence_logprobs(b.ref_logprobs, m)
        kl = _global_mean((pol - ref).detach())
        losses, rewards = kto_loss(pol, ref, b.labels, kl, cfg.beta, cfg.desirable_weight, cfg.undesirable_weight)
        w, ratio = tis_weights(tok, b.behavior_logprobs, m, cfg.is_cap, "sequence")
        loss = (w * losses).mean()
        met = {"kto/loss": float(loss.detach()), "kto/loss_unweighted": float(losses.detach().mean()),
               "kto/kl": float(kl.clamp(min=0)),
               "kto/reward_desirable": float(rewards[b.labels].mean()) if b.labels.any() else 0.0,
               "kto/reward_undesirable": float(rewards[~b.labels].mean()) if (~b.labels).any() else 0.0,
               "is/ratio_mean": float(ratio.mean()), "is/ratio_max": float(ratio.max()),
               "is/truncated_frac": float((ratio > cfg.is_cap).float().mean())}
    else:
        base = b.baselines if b.baselines is not None else loo_baseline(b.rewards)
        loss, met = reinforce_loss(tok, b.behavior_logprobs, b.ref_logprobs, m, b.rewards,
                                   base, cfg.is_cap, cfg.is_level, cfg.kl_coef)
        met["pg/loss"] = float(loss.detach())
    kl = kl_to_reference(tok, b.ref_logprobs, m)
    met["kl/k1"], met["kl/k3"] = kl["k1"], kl["k3"]
    return loss, met


def step_schedule(n: int, bs: int, steps: int, seed: int) -> list[list[int]]:
    """Sample indices of every step: epochs of a seeded shuffle of ``range(n)``, ``bs`` per
    step. Deterministic in ``(n, bs, steps, seed)``, so a resumed cycle sees the same batches."""
    rng = random.Random(seed)
    order: list[int] = []
    out = []
    for _ in range(steps):
        while len(order) < bs:
            perm = list(range(n))
            rng.shuffle(perm)
            order += perm
        out.append(order[:bs])
        order = order[bs:]
    return out


def _cycle_key(parent: str, ids: list[str], cfg: LearnerConfig) -> str:
    h = hashlib.sha256(json.dumps([parent, sorted(ids), cfg.__dict__], sort_keys=True, default=str).encode())
    return h.hexdigest()


def _save_ckpt(engine, d: Path, key: str, step: int, hist: dict) -> None:
    """DeepSpeed checkpoint (module + ZeRO optimizer partitions) and ``meta.json`` last."""
    d.mkdir(parents=True, exist_ok=True)
    tag = f"step{step:06d}"
    engine.save_checkpoint(str(d), tag=tag, client_state={"step": step, "hist": hist})
    if _world()[0] != 0:
        return
    tmp = d / ".meta.json.tmp"
    tmp.write_text(json.dumps({"key": key, "tag": tag, "step": step}))
    tmp.replace(d / "meta.json")


def _try_resume(engine, d: Path, key: str) -> tuple[int, dict]:
    """Load the checkpoint in ``d`` if it belongs to this cycle (same parent, samples and
    config); returns ``(start_step, metric history)``, ``(0, {})`` otherwise."""
    f = d / "meta.json"
    if not f.exists():
        return 0, {}
    meta = json.loads(f.read_text())
    if meta.get("key") != key:
        shutil.rmtree(d, ignore_errors=True)
        return 0, {}
    _, client = engine.load_checkpoint(str(d), tag=meta["tag"])
    return int(client["step"]), dict(client.get("hist", {}))


def train(model, samples: list[RewardedSample], parent: str, cfg: LearnerConfig, pad_id: int,
          progress: Callable[[int, dict], None] | None = None, ckpt_dir: str | Path | None = None
          ) -> tuple[dict[str, torch.Tensor] | None, dict]:
    """Run one cycle's training on ``samples`` with the parent weights loaded in ``model``.

    Args:
        model: MoE (or dense) causal LM, fp32, weights = the parent version.
        samples: candidate RewardedSamples (filtered here for staleness and routes).
        parent: the parent version name (``v000003``).
        cfg: :class:`LearnerConfig`.
        pad_id: padding token id.
        progress: called ``progress(step, metrics)`` after each optimizer step.
        ckpt_dir: with ``cfg.checkpoint_every``, a DeepSpeed checkpoint is written there every
            that many steps, and a cycle with the same parent, samples and config resumes
            from it (e.g. after SIGKILL) and ends with the same weights bit for bit.

    Returns:
        ``(state_dict or None, metrics)``; None when fewer than ``cfg.min_samples`` samples
        survive the filters (metrics then say why). Metrics are namespaced: ``data/*``
        (counts, drops by reason), ``mismatch/*``, ``mismatch_free/*``, ``routes/*``,
        ``kto/*`` or ``pg/*``, ``is/*``, ``kl/*``, ``perf/*`` (tokens/s, seconds).
    """
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    metrics: dict = {"data/n_candidates": len(samples)}
    kept, dropped = staleness_filter(samples, parent, cfg.max_staleness)
    routers = moe_routers(model)
    L, k = len(routers), moe_top_k(model)
    E = routers[0].num_experts if routers else 0
    kept, refused = filter_samples(kept, L, k, E, cfg.allow_free_routing or not cfg.router_replay)
    for reason, n in (dropped + refused).items():
        key = "data/newer_than_parent" if reason == "newer_than_parent" else f"data/dropped_{reason}"
        metrics[key] = n
    metrics["data/n_samples"] = len(kept)
    if len(kept) < cfg.min_samples:
        metrics["data/skipped_reason"] = f"{len(kept)} trainable samples < min_samples {cfg.min_samples}"
        return None, metrics
    with_routes = bool(L) and all(s.expert_routes is not None for s in kept)
    batch = build_batch(kept, pad_id, with_routes=with_routes)
    metrics["data/n_desirable"] = n_des = int(batch.labels.sum())
    n_und = batch.size - n_des
    if cfg.balance_classes and n_des and n_und:
        lam_d, lam_u = cfg.desirable_weight, cfg.undesirable_weight
        if lam_d * n_des < lam_u * n_und:
            lam_d = lam_u * n_und / n_des
        else:
            lam_u = lam_d * n_des / n_und
        cfg = LearnerConfig(**{**cfg.__dict__, "desirable_weight": lam_d, "undesirable_weight": lam_u})
    if cfg.objective == "reinforce" and cfg.baseline == "prompt":
        groups = [tuple(s.prompt_token_ids) for s in kept]
        batch.baselines = group_loo_baseline(batch.rewards, groups)
        adv = batch.rewards - batch.baselines
        sizes: dict = {}
        for g in groups:
            sizes[g] = sizes.get(g, 0) + 1
        metrics["pg/prompts"] = len(sizes)
        metrics["pg/prompts_repeated"] = sum(1 for n in sizes.values() if n > 1)
        metrics["pg/zero_advantage_frac"] = float((adv == 0).float().mean())
    metrics["kto/desirable_weight"] = cfg.desirable_weight
    metrics["kto/undesirable_weight"] = cfg.undesirable_weight
    metrics["data/n_completion_tokens"] = batch.n_completion_tokens
    staleness = [max(version_number(parent) - version_number(v), 0) for v in batch.versions]
    metrics["data/staleness_mean"] = sum(staleness) / len(staleness)

    t0 = time.perf_counter()
    batch.ref_logprobs, mm = measure_start(model, batch, parent, cfg.measure_chunk,
                                               cfg.measure_free_max or None)
    metrics.update(mm)
    metrics["perf/measure_s"] = time.perf_counter() - t0

    ensure_dist_env()  # under torchrun the env is already set: WORLD_SIZE ranks train together
    import deepspeed

    rank, world = _world()
    # global batch bs, split evenly: each of the ``world`` ranks trains bs // world samples
    bs = max(min(cfg.batch_size, batch.size) // world, 1) * world
    if bs > batch.size:
        raise ValueError(f"samples: {batch.size} trainable samples for {world} ranks; need >= {world}")
    n_trainable = freeze_for_training(model, cfg.train_layers)
    metrics["train/trainable_params"] = n_trainable
    dcfg = _ds_config(LearnerConfig(**{**cfg.__dict__, "batch_size": bs}))
    dcfg["train_micro_batch_size_per_gpu"] = bs // world
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                            if p.requires_grad], config=dcfg)
    engine.train()
    schedule = step_schedule(batch.size, bs, cfg.steps, cfg.seed)
    hist: dict[str, list[float]] = {}
    start = 0
    ckey = None
    if ckpt_dir is not None and cfg.checkpoint_every:
        ckey = _cycle_key(parent, batch.completion_ids, cfg)
        start, hist = _try_resume(engine, Path(ckpt_dir), ckey)
        metrics["train/resumed_from_step"] = start
    tokens, t1 = 0, time.perf_counter()
    for step in range(start, cfg.steps):
        mine = sorted(schedule[step])[rank::world]  # this rank's share of the global batch
        b = batch.select(mine).trim()  # drop columns that are padding in every row
        loss, met = step_loss(engine.module, b, cfg)
        engine.backward(loss)
        engine.step()
        tokens += int(b.attention_mask.sum())
        if world > 1:  # metrics of the global batch: mean of the ranks' (equal-size) shares
            names = sorted(met)
            t = torch.tensor([float(met[n]) for n in names], dtype=torch.float64)
            torch.distributed.all_reduce(t)
            met = {n: float(v) / world for n, v in zip(names, t)}
        for name, v in met.items():
            hist.setdefault(name, []).append(v)
        if ckey is not None and (step + 1) % cfg.checkpoint_every == 0 and step + 1 < cfg.steps:
            _save_ckpt(engine, Path(ckpt_dir), ckey, step + 1, hist)
        if progress:
            progress(step + 1, met)
        crash = os.environ.get("FLYWHEEL_LEARN_SIGKILL_AFTER_STEP")  # fault injection for tests
        if crash and int(crash) == step + 1:
            os.kill(os.getpid(), signal.SIGKILL)
    train_s = time.perf_counter() - t1
    for key, vs in hist.items():
        metrics[key] = vs[-1]  # last step
        metrics[f"{key}_first"] = vs[0]  # first step (before any update)
    metrics.update({"perf/train_s": train_s, "perf/tokens_per_s": tokens / max(train_s, 1e-9),
                    "perf/tokens": tokens, "train/steps": cfg.steps, "train/lr": cfg.lr, "train/batch_size": bs})
    # No clone: the tensors stay alive through this dict while the engine (and its optimizer
    # state, 2 fp32 copies of the weights) is released.
    state = {n: t.detach() for n, t in engine.module.state_dict().items()}
    if hasattr(engine, "destroy"):
        engine.destroy()
    del engine
    import gc
    gc.collect()
    return state, metrics
