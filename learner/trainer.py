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

import atexit
import hashlib
import json
import logging
import os
import random
import shutil
import signal
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from schemas.events import RewardedSample
from schemas.manifest import version_number
from schemas.routers import route_shape
from learner.batch import LearnerBatch, build_batch, filter_samples
from learner.extensions import clear_stale_locks
from learner.data import InMemorySamples, RefLogprobs, SampleSource
from learner.losses import (group_loo_baseline, kl_to_reference, kto_loss, loo_baseline, reinforce_loss, sequence_logprobs,
                            tis_weights, token_logprobs_lean)
from schemas.settings import free_port  # MASTER_PORT's default with more than one rank
from learner.config import LearnerConfig  # declared there (no torch); imported from here as well
from learner.replay import capture_routes, router_replay, stack_routes


def skip_shm_comm_op(deepspeed) -> None:
    """Mark DeepSpeed's ``deepspeed_shm_comm`` op unavailable in this process.

    ``deepspeed.comm``'s torch backend JIT-builds that op (a shared-memory all-reduce between
    ranks on one host) whenever its builder is compatible, at every process start where the
    build directory was last built with another command line (another clone's include paths):
    40-110 s of a learner cycle on 2 cores. With one rank there is no peer to reduce with, so
    the op would never run; the backend then uses plain gloo collectives.
    """
    ops = deepspeed.ops.__compatible_ops__  # the probed dict; DeepSpeed reads this same object
    ops["deepspeed_shm_comm"] = False


def destroy_process_group_at_exit() -> None:
    """Destroy the default process group, if one is still initialised (an ``atexit`` hook
    that :func:`ensure_dist_env` registers when it initialises the group).

    The gloo process group owns native threads (two ``pt_gloo_runloop`` workers, gloo's
    ``gloo_tcp_loop`` and the TCPStore's ``pt_tcpstore_uv`` server). A process that ends
    with the group alive tears them down during interpreter finalisation, where a thread
    still running can end the process with SIGABRT (``terminate called without an active
    exception``, exit status -6) instead of its own exit status. Destroying the group here,
    while the interpreter is whole, joins those threads first. A failure is logged, never
    raised: the process is ending anyway.
    """
    try:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - at exit: report, do not mask the exit status
        logging.getLogger("flywheel.learner").warning("process group teardown at exit failed: %s", exc)


LOOPBACK = "127.0.0.1"
IFF_LOOPBACK = 0x8  # Linux's flag of a loopback interface (include/uapi/linux/if.h)


def loopback_interface() -> str | None:
    """This host's loopback network interface's name (``lo`` on Linux), the first whose
    ``/sys/class/net/<name>/flags`` has :data:`IFF_LOOPBACK`; None where that directory is
    not readable (not Linux) or no interface has the flag."""
    try:
        names = sorted(os.listdir("/sys/class/net"))
    except OSError:
        return None
    for name in names:
        try:
            if int((Path("/sys/class/net") / name / "flags").read_text().strip(), 16) & IFF_LOOPBACK:
                return name
        except (OSError, ValueError):
            continue
    return None


def init_loopback_group(timeout) -> None:
    """Initialise a one-rank gloo process group that listens on the loopback interface only.

    torch's ``env://`` rendezvous starts its TCPStore server on every interface
    (``*:MASTER_PORT``, whatever ``MASTER_ADDR`` says) and gloo's device on the address the
    host name resolves to. Here the store serves a socket bound to 127.0.0.1 (port
    ``MASTER_PORT`` when set, else one the kernel picks) that this function hands it
    (``master_listen_fd``: the store owns the socket and closes it with the group), and gloo's
    device is made on the loopback interface (``GLOO_SOCKET_IFNAME`` set to it for the init
    when unset, then unset again). ``timeout`` (a ``datetime.timedelta``) bounds the store's
    and the group's waits.

    Raises:
        OSError: ``MASTER_PORT`` is set and 127.0.0.1 cannot listen on it (e.g. in use).
    """
    import socket

    port = int(os.environ.get("MASTER_PORT") or 0)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((LOOPBACK, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"MASTER_PORT={port}: cannot listen on {LOOPBACK} ({exc.strerror})") from None
    port = sock.getsockname()[1]
    fd = sock.detach()  # the store closes it
    try:
        store = torch.distributed.TCPStore(LOOPBACK, port, 1, True, timeout=timeout, wait_for_workers=False,
                                           master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise
    ifname = None if os.environ.get("GLOO_SOCKET_IFNAME") else loopback_interface()
    if ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = ifname
    try:
        torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timeout)
    finally:
        if ifname:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
    os.environ.setdefault("MASTER_PORT", str(port))  # as env:// would leave it (popped by ensure_dist_env)


def ensure_dist_env() -> None:
    """Set the single-process torch.distributed env (gloo) where unset and init DeepSpeed.

    Sets ``MASTER_ADDR=127.0.0.1``, ``WORLD_SIZE=1 RANK=0 LOCAL_RANK=0`` and
    ``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/flywheel/torch_extensions``: with more
    than one rank DeepSpeed's shm comm op is JIT-built there, ~40 s cold; with one rank it is
    skipped, :func:`skip_shm_comm_op`); removes a build lock there that a
    killed builder left behind (:func:`learner.extensions.clear_stale_locks`, else every
    later init waits on it forever). With one rank the group listens on the loopback
    interface only (:func:`init_loopback_group`); with more (torchrun) it joins through
    ``env://`` (``MASTER_PORT``: a free port where unset). A ``MASTER_PORT`` chosen here is
    removed from the environment once the process group holds it, so a child process (a
    learner subprocess started later by the same process) picks its own instead of
    colliding. A group it initialises is destroyed at exit
    (:func:`destroy_process_group_at_exit`). Idempotent.
    """
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "flywheel" / "torch_extensions"))
    clear_stale_locks(os.environ["TORCH_EXTENSIONS_DIR"])
    os.environ.setdefault("MASTER_ADDR", LOOPBACK)
    own_port = "MASTER_PORT" not in os.environ
    for k, v in (("WORLD_SIZE", "1"), ("RANK", "0"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(k, v)
    import deepspeed
    from deepspeed.constants import default_pg_timeout

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    if not torch.distributed.is_initialized():
        if os.environ["WORLD_SIZE"] == "1":
            skip_shm_comm_op(deepspeed)
            init_loopback_group(default_pg_timeout)  # DeepSpeed then wraps this group
        else:
            os.environ.setdefault("MASTER_PORT", str(free_port()))
        deepspeed.init_distributed("gloo")
        atexit.register(destroy_process_group_at_exit)
    if own_port and torch.distributed.is_initialized():
        os.environ.pop("MASTER_PORT", None)  # bound by this process now


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
    and ``batch.routes`` is set. Grad flows when called outside ``torch.no_grad``; its
    backward holds one (B, T, V) buffer (:func:`learner.losses.token_logprobs_lean`, the
    same forward bits as serving's ``token_logprobs``)."""
    with router_replay(model, batch.routes if replay else None):
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                    position_ids=batch.position_ids, use_cache=False)
    return token_logprobs_lean(out.logits, batch.target_ids)  # the graph keeps the log-softmax, not the logits


RESERVOIR = 1 << 20  # |mismatch| values kept for the p99 (exact below this many tokens)


class AbsStats:
    """Running mean, max and p99 of absolute values, in bounded memory: mean and max are
    exact; p99 is exact up to :data:`RESERVOIR` values, then over a uniform reservoir sample
    of that size (Vitter's algorithm R, seeded)."""

    def __init__(self, seed: int):
        self.n, self.sum, self.max = 0, 0.0, 0.0
        self._res: list[torch.Tensor] = []
        self._kept = 0
        self._g = torch.Generator().manual_seed(seed)

    def add(self, d: torch.Tensor) -> None:
        d = d.detach().reshape(-1).double()
        if d.numel() == 0:
            return
        self.sum += float(d.sum())
        self.max = max(self.max, float(d.max()))
        room = RESERVOIR - self._kept
        if room > 0:
            self._res.append(d[:room].clone())
            self._kept += min(room, d.numel())
        rest = d[room:] if room > 0 else d
        if rest.numel():  # algorithm R: item j (0-based overall) replaces a slot with prob R/(j+1)
            pool = torch.cat(self._res)
            j = torch.arange(self.n + max(room, 0), self.n + max(room, 0) + rest.numel(), dtype=torch.float64)
            u = torch.rand(rest.numel(), generator=self._g, dtype=torch.float64)
            slot = (u * (j + 1)).long()
            hit = slot < RESERVOIR
            pool[slot[hit]] = rest[hit]
            self._res = [pool]
        self.n += d.numel()

    def metrics(self, prefix: str) -> dict[str, float]:
        if self.n == 0:
            return {}
        pool = torch.cat(self._res)
        return {f"{prefix}/mean": self.sum / self.n, f"{prefix}/p99": float(torch.quantile(pool, 0.99)),
                f"{prefix}/max": self.max}


@dataclass
class MeasureState:
    """What the start-of-cycle pass accumulates over its chunks (see :func:`measure_start`)."""

    rep: AbsStats
    free: AbsStats
    flips: int = 0
    flip_n: int = 0
    seen: int = 0  # samples measured so far (for ``free_max``)

    @classmethod
    def new(cls) -> "MeasureState":
        return cls(AbsStats(0), AbsStats(1))

    def metrics(self) -> dict:
        out = {"mismatch/n_tokens": int(self.rep.n), **self.rep.metrics("mismatch")}
        if self.free.n or self.flip_n:
            out.update(self.free.metrics("mismatch_free"))
            out["routes/flip_frac"] = self.flips / max(self.flip_n, 1)
        return out


@torch.no_grad()
def measure_into(model, batch: LearnerBatch, parent: str, state: MeasureState, chunk: int = 1,
                 free_max: int | None = None) -> torch.Tensor:
    """Reference logprobs (B, T) float32 of ``batch`` (replayed routes), accumulating the
    mismatch and route-flip figures into ``state`` (see :func:`measure_start`)."""
    was_training = model.training
    model.eval()
    refs = []
    for s in range(0, batch.size, chunk):
        full = batch.select(list(range(s, min(s + chunk, batch.size))))
        b = full.trim()
        lp = forward_token_logprobs(model, b, replay=True)  # (b, T')
        pad = full.input_ids.shape[1] - b.input_ids.shape[1]
        refs.append(torch.nn.functional.pad(lp, (pad, 0)))  # back to (b, T)
        own = torch.tensor([v == parent for v in b.versions])
        m = b.completion_mask.bool() & own.unsqueeze(-1)
        state.rep.add((lp - b.behavior_logprobs)[m].abs())
        if b.routes is not None and (free_max is None or state.seen + s < free_max):
            cap: list = []
            with capture_routes(model, cap):
                lpf = forward_token_logprobs(model, b, replay=False)
            state.free.add((lpf - b.behavior_logprobs)[m].abs())
            free = stack_routes(cap, *b.input_ids.shape)  # (b, T, L, k)
            same = (free.sort(-1).values == b.routes.sort(-1).values).all(-1)  # (b, T, L)
            real = b.attention_mask.bool().unsqueeze(-1).expand_as(same)
            state.flips += int((~same & real).sum())
            state.flip_n += int(real.sum())
    state.seen += batch.size
    model.train(was_training)
    return torch.cat(refs)


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
    state = MeasureState.new()
    ref = measure_into(model, batch, parent, state, chunk, free_max)
    return ref, state.metrics()


def resolve_precision(model, cfg: LearnerConfig) -> LearnerConfig:
    """The cycle's training precision, with ``model`` (the parent's weights) made ready for it.

    ``"auto"`` trains in the dtype of the model's floating-point parameters, i.e. the parent
    version's: all bfloat16 -> ``"bf16"`` (DeepSpeed bf16: bf16 forward/backward, fp32 master
    weights and AdamW state), all float32 -> ``"fp32"``. ``"fp32"`` on a bf16 model casts the
    module to float32 here (exact), before the measure pass; ``"bf16"`` on an fp32 model is
    cast by DeepSpeed at ``initialize`` (the measure pass then runs in fp32). Either way the
    published tensors are cast back to the parent's dtypes (``learner.cycle``).

    Args:
        model: the causal LM holding the parent's weights.
        cfg: the cycle's config.

    Returns:
        ``cfg`` with ``precision`` ``"fp32"`` or ``"bf16"``.

    Raises:
        ValueError: with ``"auto"``, the floating-point parameters are not all float32 or
            all bfloat16 (e.g. float16, or mixed).
    """
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    precision = cfg.precision
    if precision == "auto":
        if dtypes == {torch.bfloat16}:
            precision = "bf16"
        elif dtypes == {torch.float32}:
            precision = "fp32"
        else:
            raise ValueError(f"precision: 'auto' needs the parent's weights all float32 or all bfloat16, found "
                             f"{sorted(str(d) for d in dtypes)}; set precision to 'fp32' or 'bf16'")
    if precision == "fp32" and dtypes != {torch.float32}:
        model.float()
    return cfg if precision == cfg.precision else LearnerConfig(**{**cfg.__dict__, "precision": precision})


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


def _ds_config(cfg: LearnerConfig, micro: int | None = None, gas: int = 1, world: int = 1) -> dict:
    """DeepSpeed config: ``micro`` samples per micro-batch, ``gas`` micro-batches per step."""
    micro = micro or cfg.batch_size
    return {
        "train_batch_size": micro * gas * world, "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": cfg.lr, "weight_decay": cfg.weight_decay,
                                                  "betas": [0.9, 0.999], "eps": 1e-8, "torch_adam": True}},
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": {"stage": cfg.zero_stage},
        "fp16": {"enabled": False}, "bf16": {"enabled": cfg.precision == "bf16"},
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


def step_loss(model, b: LearnerBatch, cfg: LearnerConfig, z0: torch.Tensor | None = None,
              replay: bool = True) -> tuple[torch.Tensor, dict]:
    """Loss of one (micro-)batch (with grad) and its namespaced metrics.

    KTO: per-sample KTO loss × sequence TIS weight, batch mean. z0 = clamp(mean_i(r_i), 0)
    detached: the completions are drawn from ≈ the policy, so the batch mean of the matched
    log-ratio r estimates KL(πθ ‖ π_ref) (TRL uses mismatched pairs; those have no logged
    routes to replay). ``z0`` given: the step's value over all its micro-batches
    (:func:`kto_z0`), so accumulation reproduces the full batch. REINFORCE:
    :func:`learner.losses.reinforce_loss` (token mean) with a LOO baseline (``b.baselines``
    or the batch's own); PSR: the same loss with baseline 0 over the cycle's samples of
    positive reward (:func:`train`). ``replay=False`` when the caller holds the replay context (it must
    stay open through backward under activation checkpointing).
    """
    tok = forward_token_logprobs(model, b, replay=replay and cfg.router_replay)  # (B, T)
    m = b.completion_mask
    if cfg.objective == "kto":
        pol = sequence_logprobs(tok, m)  # (B,)
        ref = sequence_logprobs(b.ref_logprobs, m)
        kl = z0 if z0 is not None else _global_mean((pol - ref).detach())
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
                                   base, cfg.is_cap, cfg.is_level, kl_coef=cfg.kl_coef)
        met["pg/loss"] = float(loss.detach())
    kl = kl_to_reference(tok, b.ref_logprobs, m)
    met["kl/k1"], met["kl/k3"] = kl["k1"], kl["k3"]
    return loss, met


@torch.no_grad()
def kto_z0(model, load: Callable[[list[int]], LearnerBatch], parts: list[list[int]], cfg: LearnerConfig
           ) -> torch.Tensor:
    """KTO's z0 input for a step split into micro-batches: mean over all the step's samples
    (and ranks) of r = log πθ(y|x) − log π_ref(y|x), detached (one no-grad forward per
    micro-batch, the same one the loss then runs with grad)."""
    tot, n = torch.zeros((), dtype=torch.float32), 0
    for p in parts:
        b = load(p)
        tok = forward_token_logprobs(model, b, replay=cfg.router_replay)
        r = sequence_logprobs(tok, b.completion_mask) - sequence_logprobs(b.ref_logprobs, b.completion_mask)
        tot += r.float().sum()
        n += b.size
    t = torch.stack([tot, torch.tensor(float(n))])
    if _world()[1] > 1:
        torch.distributed.all_reduce(t)
    return (t[0] / t[1]).detach()


def accumulate_step(model, load: Callable[[list[int]], LearnerBatch], idx: list[int], cfg: LearnerConfig,
                    completion_lens: list[int], backward: Callable[[torch.Tensor], None]) -> tuple[dict, int]:
    """Accumulate one optimizer step's gradient over ``idx`` in micro-batches.

    ``idx`` (this rank's share of the step) is cut into micro-batches of
    ``cfg.micro_batch_size`` (0: one); ``load(part) -> LearnerBatch`` builds each (ref
    logprobs and baselines filled); ``backward(loss)`` runs after each micro-batch with the
    micro-batch's loss times its share of the step's normaliser (samples for KTO, completion
    tokens for REINFORCE's token mean), so the accumulated gradient equals the full batch's
    (KTO's z0 and the LOO baselines are computed over the whole step first).
    ``completion_lens[i]`` is sample ``i``'s completion length.

    Returns ``(metrics, input tokens)``: metrics are the micro-batches' weighted means
    (``*_max`` keys: their max).
    """
    mb = cfg.micro_batch_size or len(idx)
    parts = [idx[i:i + mb] for i in range(0, len(idx), mb)]
    sizes = [len(p) if cfg.objective == "kto" else sum(completion_lens[i] for i in p) for p in parts]
    total = max(sum(sizes), 1)
    z0 = kto_z0(model, load, parts, cfg) if cfg.objective == "kto" and len(parts) > 1 else None
    met: dict[str, float] = {}
    tokens = 0
    for p, size in zip(parts, sizes):
        b = load(p)
        with router_replay(model, b.routes if cfg.router_replay else None):  # open through backward
            loss, m = step_loss(model, b, cfg, z0=z0, replay=False)
            backward(loss * (size / total))
        tokens += int(b.attention_mask.sum())
        share = len(p) / len(idx)
        for k, v in m.items():
            met[k] = max(met.get(k, v), v) if k.endswith("_max") else met.get(k, 0.0) + v * share
    return met, tokens


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


FILTER_CHUNK = 64  # samples materialised at a time by the filter and measurement passes


def _filter_pass(src: SampleSource, parent: str, cfg: LearnerConfig, L: int, k: int, E: int
                 ) -> tuple[list[int], Counter, bool]:
    """Indices of ``src`` that survive the staleness and sample checks (read in chunks),
    the drop counts by reason, and whether every kept sample has routes."""
    kept: list[int] = []
    counts: Counter = Counter()
    all_routes = True
    for c in range(0, len(src), FILTER_CHUNK):
        idx = list(range(c, min(c + FILTER_CHUNK, len(src))))
        chunk = src.take(idx)
        fresh, dropped = staleness_filter(chunk, parent, cfg.max_staleness)
        ok, refused = filter_samples(fresh, L, k, E, cfg.allow_free_routing or not cfg.router_replay)
        counts += dropped + refused
        ok_ids = {id(s) for s in ok}
        for i, s in zip(idx, chunk):
            if id(s) in ok_ids:
                kept.append(i)
                all_routes &= s.expert_routes is not None
    return kept, counts, all_routes


def _measure_pass(model, src: SampleSource, kept: list[int], parent: str, cfg: LearnerConfig, pad_id: int,
                  with_routes: bool, refs: RefLogprobs) -> dict:
    """Reference logprobs of every kept sample into ``refs`` (completion tokens only) and the
    mismatch figures, :data:`FILTER_CHUNK` samples materialised at a time. Samples go
    shortest first, so a forward of ``measure_chunk`` samples pads them to similar lengths
    (the replay-off forwards of ``measure_free_max`` thus cover the shortest samples)."""
    state = MeasureState.new()
    free_max = cfg.measure_free_max or None
    order = sorted(kept, key=lambda i: src.meta.input_lens[i])
    for c in range(0, len(order), FILTER_CHUNK):
        idx = order[c:c + FILTER_CHUNK]
        b = build_batch(src.take(idx), pad_id, with_routes=with_routes)
        ref = measure_into(model, b, parent, state, cfg.measure_chunk, free_max)  # (b, T)
        for row, i in enumerate(idx):
            C = src.meta.completion_lens[i]
            refs.put(i, ref[row, ref.shape[1] - C:].numpy())
    return state.metrics()


def _loader(src: SampleSource, refs: RefLogprobs, pad_id: int, with_routes: bool,
            baselines: dict[int, float] | None) -> Callable[[list[int]], LearnerBatch]:
    """``load(idx) -> LearnerBatch`` of those samples, with their reference logprobs and
    (REINFORCE) baselines filled in, common left padding trimmed."""
    def load(idx: list[int]) -> LearnerBatch:
        b = build_batch(src.take(idx), pad_id, with_routes=with_routes)
        T = b.input_ids.shape[1]
        ref = torch.zeros((b.size, T), dtype=torch.float32)
        for row, i in enumerate(idx):
            v = torch.from_numpy(refs.get(i).copy())
            ref[row, T - v.numel():] = v
        b.ref_logprobs = ref
        if baselines is not None:
            b.baselines = torch.tensor([baselines[i] for i in idx], dtype=torch.float32)
        return b.trim()
    return load


def _class_weights(cfg: LearnerConfig, n_des: int, n_und: int) -> LearnerConfig:
    if not (cfg.balance_classes and n_des and n_und):
        return cfg
    lam_d, lam_u = cfg.desirable_weight, cfg.undesirable_weight
    if lam_d * n_des < lam_u * n_und:
        lam_d = lam_u * n_und / n_des
    else:
        lam_u = lam_d * n_des / n_und
    return LearnerConfig(**{**cfg.__dict__, "desirable_weight": lam_d, "undesirable_weight": lam_u})


def _prompt_baselines(src: SampleSource, kept: list[int], metrics: dict) -> dict[int, float]:
    """Per-prompt leave-one-out baselines over the whole cycle (RLOO), by sample index."""
    meta = src.meta
    rewards = torch.tensor([meta.rewards[i] for i in kept], dtype=torch.float32)
    groups = [meta.prompt_keys[i] for i in kept]
    base = group_loo_baseline(rewards, groups)
    sizes = Counter(groups)
    metrics["pg/prompts"] = len(sizes)
    metrics["pg/prompts_repeated"] = sum(1 for n in sizes.values() if n > 1)
    metrics["pg/zero_advantage_frac"] = float(((rewards - base) == 0).float().mean())
    return {i: float(v) for i, v in zip(kept, base)}


def _engine(model, cfg: LearnerConfig, micro: int, gas: int, world: int):
    """``deepspeed.initialize`` over the trainable parameters (bf16 and activation
    checkpointing as configured)."""
    import deepspeed

    if cfg.activation_checkpointing:
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    dcfg = _ds_config(cfg, micro, gas, world)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                            if p.requires_grad], config=dcfg)
    return engine


def train(model, samples: list[RewardedSample] | SampleSource, parent: str, cfg: LearnerConfig, pad_id: int,
          progress: Callable[[int, dict], None] | None = None, ckpt_dir: str | Path | None = None,
          work_dir: str | Path | None = None) -> tuple[dict[str, torch.Tensor] | None, dict]:
    """Run one cycle's training on ``samples`` with the parent weights loaded in ``model``.

    Memory does not grow with the number of samples: they are read from ``samples`` (a list
    or a :class:`learner.data.SampleSource`, e.g. spilled to disk) a chunk or a micro-batch
    at a time, the reference logprobs live in a file under ``work_dir``, and each step
    accumulates micro-batches of ``cfg.micro_batch_size`` (:func:`accumulate_step`).

    Args:
        model: MoE (or dense) causal LM, weights = the parent version, float32 or bfloat16
            (the training precision follows them unless ``cfg.precision`` says otherwise:
            :func:`resolve_precision`).
        samples: candidate RewardedSamples (filtered here for staleness, split and routes;
            ``eval`` samples are refused and counted as ``data/dropped_eval_split``).
        parent: the parent version name (``v000003``).
        cfg: :class:`LearnerConfig`.
        pad_id: padding token id.
        progress: called ``progress(step, metrics)`` after each optimizer step.
        ckpt_dir: with ``cfg.checkpoint_every``, a DeepSpeed checkpoint is written there every
            that many steps, and a cycle with the same parent, samples and config resumes
            from it (e.g. after SIGKILL) and ends with the same weights bit for bit.
        work_dir: where the reference logprobs file goes (default: a temp directory).

    Returns:
        ``(state_dict or None, metrics)``; None when fewer than ``cfg.min_samples`` samples
        survive the filters (metrics then say why). Metrics are namespaced: ``data/*``
        (counts, drops by reason), ``mismatch/*``, ``mismatch_free/*``, ``routes/*``,
        ``kto/*`` or ``pg/*``, ``is/*``, ``kl/*``, ``perf/*`` (tokens/s, seconds),
        ``train/*`` (micro-batch size, accumulation steps, precision).
    """
    import tempfile

    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    cfg = resolve_precision(model, cfg)
    src = samples if hasattr(samples, "take") else InMemorySamples(samples)
    metrics: dict = {"data/n_candidates": len(src)}
    L, k, E = route_shape(model)  # L = num_hidden_layers for an MoE model (vLLM's route layout)
    kept, counts, all_routes = _filter_pass(src, parent, cfg, L, k, E)
    for reason, n in counts.items():
        key = "data/newer_than_parent" if reason == "newer_than_parent" else f"data/dropped_{reason}"
        metrics[key] = n
    if cfg.objective == "psr":  # positive sample reinforcement trains on the rewarded samples only
        positive = [i for i in kept if src.meta.rewards[i] > 0]
        metrics["data/dropped_not_positive"] = len(kept) - len(positive)
        kept = positive
    metrics["data/n_samples"] = len(kept)
    if len(kept) < cfg.min_samples:
        metrics["data/skipped_reason"] = f"{len(kept)} trainable samples < min_samples {cfg.min_samples}"
        return None, metrics
    meta = src.meta
    with_routes = bool(L) and all_routes
    metrics["data/n_desirable"] = n_des = sum(1 for i in kept if meta.labels[i])
    cfg = _class_weights(cfg, n_des, len(kept) - n_des)
    baselines = None
    if cfg.objective == "reinforce" and cfg.baseline == "prompt":
        baselines = _prompt_baselines(src, kept, metrics)
    elif cfg.objective == "psr":  # A_i = r_i: each rewarded completion's likelihood, weighted by its reward
        baselines = dict.fromkeys(kept, 0.0)
    metrics["kto/desirable_weight"] = cfg.desirable_weight
    metrics["kto/undesirable_weight"] = cfg.undesirable_weight
    metrics["data/n_completion_tokens"] = sum(meta.completion_lens[i] for i in kept)
    staleness = [max(version_number(parent) - version_number(meta.versions[i]), 0) for i in kept]
    metrics["data/staleness_mean"] = sum(staleness) / len(staleness)

    tmp = tempfile.TemporaryDirectory(prefix="flywheel-learn-") if work_dir is None else None
    refs = RefLogprobs(Path(work_dir or tmp.name) / f"ref-{os.getpid()}.f32")
    try:
        t0 = time.perf_counter()
        metrics.update(_measure_pass(model, src, kept, parent, cfg, pad_id, with_routes, refs))
        metrics["perf/measure_s"] = time.perf_counter() - t0
        state = _train_steps(model, src, kept, parent, cfg, pad_id, with_routes, refs, baselines, metrics,
                             progress, ckpt_dir)
    finally:
        refs.close()
        if tmp is not None:
            tmp.cleanup()
    return state, metrics


def _train_steps(model, src: SampleSource, kept: list[int], parent: str, cfg: LearnerConfig, pad_id: int,
                 with_routes: bool, refs: RefLogprobs, baselines: dict[int, float] | None, metrics: dict,
                 progress, ckpt_dir) -> dict[str, torch.Tensor]:
    """The K optimizer steps of a cycle with DeepSpeed; returns the new state dict."""
    ensure_dist_env()  # under torchrun the env is already set: WORLD_SIZE ranks train together
    rank, world = _world()
    # global batch bs, split evenly: each of the ``world`` ranks trains bs // world samples
    bs = max(min(cfg.batch_size, len(kept)) // world, 1) * world
    if bs > len(kept):
        raise ValueError(f"samples: {len(kept)} trainable samples for {world} ranks; need >= {world}")
    per_rank = bs // world
    micro = min(cfg.micro_batch_size or per_rank, per_rank)
    gas = -(-per_rank // micro)
    metrics["train/trainable_params"] = freeze_for_training(model, cfg.train_layers)
    engine = _engine(model, cfg, micro, gas, world)
    engine.train()
    schedule = step_schedule(len(kept), bs, cfg.steps, cfg.seed)
    hist: dict[str, list[float]] = {}
    start = 0
    ckey = None
    if ckpt_dir is not None and cfg.checkpoint_every:
        ckey = _cycle_key(parent, [src.meta.completion_ids[i] for i in kept], cfg)
        start, hist = _try_resume(engine, Path(ckpt_dir), ckey)
        metrics["train/resumed_from_step"] = start
    load = _loader(src, refs, pad_id, with_routes, baselines)

    def backward(loss: torch.Tensor) -> None:
        engine.backward(loss, scale_wrt_gas=False)  # the loss already carries its share
        engine.step()  # applies the update at the accumulation boundary (every ``gas`` calls)

    tokens, t1 = 0, time.perf_counter()
    for step in range(start, cfg.steps):
        idx = [kept[j] for j in sorted(schedule[step])[rank::world]]  # this rank's share of the step
        if baselines is None and cfg.objective == "reinforce":  # LOO over this rank's step batch
            r = torch.tensor([src.meta.rewards[i] for i in idx], dtype=torch.float32)
            step_base = dict(zip(idx, loo_baseline(r).tolist()))
            load = _loader(src, refs, pad_id, with_routes, step_base)
        met, n_tok = accumulate_step(engine.module, load, idx, cfg, src.meta.completion_lens, backward)
        tokens += n_tok
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
                    "perf/tokens": tokens, "train/steps": cfg.steps, "train/lr": cfg.lr, "train/batch_size": bs,
                    "train/micro_batch_size": micro, "train/grad_accumulation": gas,
                    "train/precision": cfg.precision})
    # No clone: the tensors stay alive through this dict while the engine (and its optimizer
    # state, 2 fp32 copies of the weights) is released.
    state = {n: t.detach() for n, t in engine.module.state_dict().items()}
    if hasattr(engine, "destroy"):
        engine.destroy()
    del engine
    import gc
    gc.collect()
    return state
