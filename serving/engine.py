"""Inference engines: one interface (:class:`Engine`), a torch implementation with dynamic
batching, KV cache, behavior logprobs and expert-route capture (:class:`TorchEngine`).

The engine knows nothing about HTTP, Kafka or the model store: it turns token ids into
token ids plus the numbers the learner needs (behavior logprobs under the raw
distribution, expert routes in vLLM's layout), on whichever :class:`LoadedModel` a request
names. :class:`serving.engine_vllm.VLLMEngine` implements the same interface (imported lazily).

Numerics follow ``schemas.modelspec`` (DESIGN §4): fp32, eager attention and experts, left
padding with ``position_ids = cumsum(mask) - 1``, so the learner's recompute lines up.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from schemas.events import now_ms
from schemas.manifest import digest_of_hashes, state_sha256
from schemas.modelspec import left_pad, load_model, load_tokenizer, moe_routers, moe_top_k, position_ids
from serving.params import GenRequest, GenResult, ServingValidationError

log = logging.getLogger("flywheel.serving.engine")

CHAT_STOP = "<|im_end|>"


class WeightsMismatchError(ValueError):
    """Loaded weights do not have the expected per-tensor sha256 (names listed)."""


@dataclass
class LoadedModel:
    """One set of weights ready to serve (a weight slot's content).

    Attributes:
        version: version id (``v000123``).
        model: the torch module (eval mode), never mutated after load; KV caches are per
            request, so requests on different versions never share state.
        hashes: ``{tensor name: sha256}`` verified at load (``schemas.manifest.state_sha256``).
        weights_digest: ``digest_of_hashes(hashes)``.
        loaded_at: ms since epoch; load_ms: time to build + verify (ms).
    """

    version: str
    model: Any
    hashes: dict[str, str]
    weights_digest: str
    loaded_at: int
    load_ms: float
    routers: list = field(default_factory=list)
    route_buf: list = field(default_factory=list)  # per MoE layer: last indices (N, k)


class Engine(abc.ABC):
    """What the HTTP layer needs from an engine (vLLM's EngineClient shape)."""

    @abc.abstractmethod
    async def generate(self, req: GenRequest) -> GenResult:
        """Run one request (batched with concurrent ones); raises ServingValidationError
        (429) when the queue is full."""

    @abc.abstractmethod
    def abort(self, req: GenRequest) -> None:
        """Stop a running request; it returns with finish_reason ``abort``."""

    @abc.abstractmethod
    def check_health(self) -> dict:
        """Raise RuntimeError if the engine cannot serve; else a dict of facts."""

    @abc.abstractmethod
    def load_weights(self, state: dict, version: str, expected_hashes: dict[str, str] | None = None
                     ) -> LoadedModel:
        """Build a fresh model with ``state`` off the request path and verify its hashes."""

    # Both engines batch from a queue guarded by ``self._cv`` (threading.Condition) whose
    # worker(s) wait while ``self._paused``; pause/resume are the same for both.
    _cv: threading.Condition
    _paused: bool

    def pause(self) -> None:
        """Stop starting new batches (running ones finish)."""
        with self._cv:
            self._paused = True

    def resume(self) -> None:
        """Undo :meth:`pause`."""
        with self._cv:
            self._paused = False
            self._cv.notify_all()


@dataclass
class _Item:
    req: GenRequest
    fut: concurrent.futures.Future
    t_submit: float


class TorchEngine(Engine):
    """Dynamic-batching torch engine (CPU or GPU) for HF causal LMs, MoE or dense.

    A worker thread takes every waiting request on the same weights (up to ``max_batch``)
    and runs them as one batch: left-padded prefill, then one token per step with the KV
    cache (``past_key_values``), per-request sampling (temperature, top_p, top_k, seed via a
    per-request ``torch.Generator``), until eos/stop or ``max_tokens``.

    Args:
        model_dir: HF checkpoint dir (config + tokenizer; base weights).
        max_batch: requests per batch at most.
        max_queue: waiting requests at most; beyond it ``generate`` raises a 429 error.
        dtype: torch dtype of the weights (default float32).
        device: torch device of the weights (``cpu``, ``cuda``); sampling runs on CPU
            (per-request ``torch.Generator``), so seeded outputs do not depend on the device.
        threads: torch intra-op threads (None: torch's default).
    """

    def __init__(self, model_dir: str | Path, max_batch: int = 8, max_queue: int = 256, dtype=None,
                 threads: int | None = None, device: str = "cpu"):
        import torch

        self.device = torch.device(device)
        self.model_dir = Path(model_dir)
        self.max_batch = int(max_batch)
        self.max_queue = int(max_queue)
        self.dtype = dtype or torch.float32
        if threads:
            torch.set_num_threads(threads)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.pad_id = int(self.tokenizer.pad_token_id)
        eos = self.tokenizer.convert_tokens_to_ids(CHAT_STOP)
        if eos is None or eos == self.tokenizer.unk_token_id:
            eos = self.tokenizer.eos_token_id
        self.eos_id = int(eos)
        self._pending: collections.deque[_Item] = collections.deque()
        self._cv = threading.Condition()
        self._paused = False
        self._closed = False
        self.batches_run = 0
        self.last_batch_size = 0
        self._thread = threading.Thread(target=self._worker, name="flywheel-engine", daemon=True)
        self._thread.start()
        self.max_positions = None

    # ------------------------------------------------------------------ weights
    def load_base(self, version: str = "v000000") -> LoadedModel:
        """The checkpoint at ``model_dir`` as served weights (hashes computed, not checked)."""
        t0 = time.perf_counter()
        model = load_model(self.model_dir, dtype=self.dtype).to(self.device)
        return self._wrap(model, version, t0)

    def load_weights(self, state: dict, version: str, expected_hashes: dict[str, str] | None = None
                     ) -> LoadedModel:
        """Fresh model from ``model_dir``'s config with ``state`` loaded, then verified.

        Args:
            state: ``{name: Tensor}`` (a full state dict; tied aliases may be omitted).
            version: version id it is served as.
            expected_hashes: ``{name: sha256}`` from the version manifest; every name must
                be present in the model and match, and every other model tensor must alias
                (share storage with) a verified one.

        Raises:
            WeightsMismatchError: missing/unexpected tensors or a hash differs.
        """
        t0 = time.perf_counter()
        model = load_model(self.model_dir, dtype=self.dtype).to(self.device)
        res = model.load_state_dict(state, strict=False)
        if res.unexpected_keys:
            raise WeightsMismatchError(f"weights: unexpected tensors {sorted(res.unexpected_keys)[:5]}")
        sd = model.state_dict()
        ptr_of_loaded = {sd[k].data_ptr() for k in state if k in sd}
        missing = [k for k in res.missing_keys if sd[k].data_ptr() not in ptr_of_loaded]
        if missing:
            raise WeightsMismatchError(f"weights: tensors missing from the version: {sorted(missing)[:5]}")
        lm = self._wrap(model, version, t0)
        if expected_hashes is not None:
            bad = [k for k, h in expected_hashes.items() if lm.hashes.get(k) != h]
            if bad:
                raise WeightsMismatchError(
                    f"weights: sha256 mismatch after load for {len(bad)} tensors, e.g. {sorted(bad)[:5]}")
            verified = {sd[k].data_ptr() for k in expected_hashes}
            extra = [k for k in lm.hashes if k not in expected_hashes and sd[k].data_ptr() not in verified]
            if extra:
                raise WeightsMismatchError(f"weights: tensors not in the manifest: {sorted(extra)[:5]}")
            lm.hashes = dict(expected_hashes)
            lm.weights_digest = digest_of_hashes(lm.hashes)
        lm.load_ms = (time.perf_counter() - t0) * 1000
        return lm

    def _wrap(self, model, version: str, t0: float) -> LoadedModel:
        hashes = state_sha256(model.state_dict())
        routers = moe_routers(model)
        lm = LoadedModel(version=version, model=model, hashes=hashes,
                         weights_digest=digest_of_hashes(hashes), loaded_at=now_ms(),
                         load_ms=(time.perf_counter() - t0) * 1000, routers=routers,
                         route_buf=[None] * len(routers))
        for i, r in enumerate(routers):
            def hook(_mod, _inp, out, i=i, buf=lm.route_buf):
                buf[i] = out[2]  # (N, k) selected experts
            r.register_forward_hook(hook)
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 0) or 0) or None
        return lm

    # ------------------------------------------------------------------ requests
    async def generate(self, req: GenRequest) -> GenResult:
        """Submit and await; see :meth:`submit`."""
        fut = self.submit(req)
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            self.abort(req)
            raise

    def submit(self, req: GenRequest) -> concurrent.futures.Future:
        """Queue ``req`` for the batching worker; the future resolves to a :class:`GenResult`.

        Raises:
            ServingValidationError: 429 when ``max_queue`` requests already wait; 400 for an
                empty prompt or a missing model.
            RuntimeError: the engine is closed.
        """
        if self._closed:
            raise RuntimeError("engine is closed")
        if not req.prompt_token_ids:
            raise ServingValidationError("prompt", req.prompt_token_ids, "must have at least one token")
        if req.model is None:
            raise ServingValidationError("model", None, "no weights to run on")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if len(self._pending) >= self.max_queue:
                raise ServingValidationError("request", "queue", f"server queue is full ({self.max_queue})",
                                             status=429, code="queue_full")
            self._pending.append(_Item(req, fut, time.perf_counter()))
            self._cv.notify()
        return fut

    def generate_sync(self, req: GenRequest, timeout_s: float | None = None) -> GenResult:
        """Blocking :meth:`generate` for scripts and tests."""
        return self.submit(req).result(timeout_s)

    def abort(self, req: GenRequest) -> None:
        req.cancelled.set()

    def queue_depth(self) -> int:
        """Requests waiting for a batch."""
        return len(self._pending)

    def check_health(self) -> dict:
        if self._closed or not self._thread.is_alive():
            raise RuntimeError("engine worker is not running")
        return {"engine": "torch", "queue_depth": self.queue_depth(), "paused": self._paused,
                "batches_run": self.batches_run}

    def close(self) -> None:
        """Stop the worker; waiting requests fail with RuntimeError."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=30)
        while self._pending:
            it = self._pending.popleft()
            it.fut.set_exception(RuntimeError("engine closed"))

    # ------------------------------------------------------------------ worker
    def _take_batch(self) -> list[_Item] | None:
        with self._cv:
            while not self._closed and (self._paused or not self._pending):
                self._cv.wait(0.5)
            if self._closed:
                return None
            first = self._pending.popleft()
            batch, rest = [first], collections.deque()
            while self._pending:
                it = self._pending.popleft()
                if len(batch) < self.max_batch and it.req.model is first.req.model:
                    batch.append(it)
                else:
                    rest.append(it)
            self._pending.extendleft(reversed(rest))
            return batch

    def _worker(self) -> None:
        while True:
            batch = self._take_batch()
            if batch is None:
                return
            live = [it for it in batch if it.fut.set_running_or_notify_cancel()]
            if not live:
                continue
            try:
                results = self._run_batch(live)
                for it, r in zip(live, results):
                    it.fut.set_result(r)
            except Exception as exc:  # noqa: BLE001 - fail the batch's requests, keep serving
                log.exception("batch of %d failed", len(live))
                for it in live:
                    if not it.fut.done():
                        it.fut.set_exception(exc)

    def _run_batch(self, items: list[_Item]) -> list[GenResult]:
        import torch

        with torch.inference_mode():
            return self._run_batch_inner(items)

    def _run_batch_inner(self, items: list[_Item]) -> list[GenResult]:
        import torch

        lm: LoadedModel = items[0].req.model
        model = lm.model
        t_batch = time.perf_counter()
        reqs = [it.req for it in items]
        B = len(reqs)
        self.batches_run += 1
        self.last_batch_size = B
        n_layers = len(lm.routers)
        top_k = moe_top_k(model) if n_layers else 0
        route_dtype = np.uint8 if int(getattr(model.config, "num_local_experts", 0) or 0) <= 256 else np.uint16
        gens = []
        for r in reqs:
            g = torch.Generator()
            g.manual_seed(r.sampling.seed if r.sampling.seed is not None else int(torch.randint(0, 2**62, (1,))))
            gens.append(g)
        ids, mask = left_pad([r.prompt_token_ids for r in reqs], self.pad_id)  # (B, T) int64
        pos = position_ids(mask)  # (B, T)
        T = ids.shape[1]
        dev = self.device
        ids, mask, pos = ids.to(dev), mask.to(dev), pos.to(dev)
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        logits = out.logits[:, -1, :].float().cpu()  # (B, V)
        routes: list[list[np.ndarray]] = [[] for _ in range(B)]
        if n_layers:
            per_layer = torch.stack([b.view(B, T, top_k) for b in lm.route_buf], dim=2).cpu()  # (B, T, L, k)
            for i, r in enumerate(reqs):
                routes[i].append(per_layer[i, T - len(r.prompt_token_ids):].numpy().astype(route_dtype))
        toks: list[list[int]] = [[] for _ in range(B)]
        lps: list[list[float]] = [[] for _ in range(B)]
        tops: list[list[list[tuple[int, float]]]] = [[] for _ in range(B)]
        finish: list[str | None] = [None] * B
        ttft = [0.0] * B
        t_end = [0.0] * B
        max_new = max(r.sampling.max_tokens for r in reqs)
        for step in range(max_new):
            logp = torch.log_softmax(logits, dim=-1)  # (B, V) raw distribution, fp32
            next_tok = torch.full((B, 1), self.pad_id, dtype=torch.long)
            for i, r in enumerate(reqs):
                if finish[i] is not None:
                    continue
                tok = _sample(logits[i], r.sampling, gens[i])
                lp = float(logp[i, tok])
                toks[i].append(tok)
                lps[i].append(lp)
                if r.top_logprobs:
                    v, ix = torch.topk(logp[i], min(r.top_logprobs, logp.shape[-1]))
                    tops[i].append([(int(a), float(b)) for a, b in zip(ix, v)])
                if step == 0:
                    ttft[i] = (time.perf_counter() - items[i].t_submit) * 1000
                if r.on_token is not None:
                    try:
                        r.on_token(tok, lp)
                    except Exception:  # noqa: BLE001 - a broken stream must not break the batch
                        log.exception("on_token callback failed")
                if tok == self.eos_id or tok in r.stop_token_ids:
                    finish[i] = "stop"
                elif r.stop_check is not None and r.stop_check(toks[i]):
                    finish[i] = "stop"
                elif len(toks[i]) >= r.sampling.max_tokens:
                    finish[i] = "length"
                elif r.cancelled.is_set():
                    finish[i] = "abort"
                elif self.max_positions and len(r.prompt_token_ids) + len(toks[i]) >= self.max_positions:
                    finish[i] = "length"
                if finish[i] is not None:
                    t_end[i] = time.perf_counter()
                else:
                    next_tok[i, 0] = tok
            active = [i for i in range(B) if finish[i] is None]
            if not active:
                break
            mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype, device=dev)], dim=1)  # (B, T+s+1)
            pos = mask.sum(dim=1, keepdim=True) - 1  # (B, 1)
            out = model(input_ids=next_tok.to(dev), attention_mask=mask, position_ids=pos, past_key_values=cache,
                        use_cache=True)
            cache = out.past_key_values
            logits = out.logits[:, -1, :].float().cpu()
            if n_layers:
                step_routes = torch.stack([b.view(B, top_k) for b in lm.route_buf], dim=1).cpu()  # (B, L, k)
                for i in active:
                    routes[i].append(step_routes[i:i + 1].numpy().astype(route_dtype))
        results = []
        for i, r in enumerate(reqs):
            if finish[i] is None:  # cannot happen: max_new bounds every request
                finish[i] = "length"
                t_end[i] = time.perf_counter()
            rt = None
            if n_layers:
                rt = np.concatenate(routes[i], axis=0)  # (prompt + completion - 1, L, k)
                assert rt.shape[0] == len(r.prompt_token_ids) + len(toks[i]) - 1, rt.shape
            results.append(GenResult(
                completion_token_ids=toks[i], behavior_logprobs=lps[i], top_logprobs=tops[i],
                expert_routes=rt, finish_reason=finish[i], ttft_ms=ttft[i],
                latency_ms=(t_end[i] - items[i].t_submit) * 1000, version=lm.version, batch_size=B,
                queue_ms=max(0.0, (t_batch - items[i].t_submit) * 1000)))
        return results


def _sample(logits, sp, gen) -> int:
    """Sample one token id from ``logits`` (V,) float32 with temperature/top_k/top_p.

    temperature 0 = greedy (argmax of the raw logits). Filtering is applied only to pick the
    token; the logged behavior logprob is always the raw one.
    """
    import torch

    if sp.temperature == 0:
        return int(torch.argmax(logits))
    x = logits / sp.temperature
    if sp.top_k and sp.top_k > 0 and sp.top_k < x.shape[-1]:
        kth = torch.topk(x, sp.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if sp.top_p < 1.0:
        sx, si = torch.sort(x, descending=True)
        probs = torch.softmax(sx, dim=-1)
        drop = probs.cumsum(-1) - probs > sp.top_p  # keep the smallest prefix with mass >= top_p
        sx = sx.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(0, si, sx)
    probs = torch.softmax(x, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))
