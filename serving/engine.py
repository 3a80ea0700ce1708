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


@dataclass
class _Item:
    """A queued request: the request, its future and when it was submitted (perf_counter s)."""

    req: GenRequest
    fut: concurrent.futures.Future
    t_submit: float


class Engine(abc.ABC):
    """What the HTTP layer needs from an engine (vLLM's EngineClient shape)."""

    @abc.abstractmethod
    def check_health(self) -> dict:
        """Raise RuntimeError if the engine cannot serve; else a dict of facts."""

    @abc.abstractmethod
    def load_weights(self, state: dict, version: str, expected_hashes: dict[str, str] | None = None
                     ) -> LoadedModel:
        """Build a fresh model with ``state`` off the request path and verify its hashes."""

    # Both engines batch from ``self._pending`` (a deque of :class:`_Item`) guarded by
    # ``self._cv`` (threading.Condition), whose worker(s) wait while ``self._paused``; the
    # queue's front end (submit, generate, abort, pause/resume, close's draining) is shared.
    _cv: threading.Condition
    _paused: bool
    _closed: bool
    _pending: "collections.deque[_Item]"
    max_queue: int

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

    async def generate(self, req: GenRequest) -> GenResult:
        """Submit and await; see :meth:`submit`. Cancelling the await aborts the request."""
        fut = self.submit(req)
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            self.abort(req)
            raise

    def generate_sync(self, req: GenRequest, timeout_s: float | None = None) -> GenResult:
        """Blocking :meth:`generate` for scripts and tests."""
        return self.submit(req).result(timeout_s)

    def abort(self, req: GenRequest) -> None:
        """Mark ``req`` aborted; the engine ends it at its next step (or, for an engine that
        cannot stop a running call, when that call returns)."""
        req.cancelled.set()

    def queue_depth(self) -> int:
        """Requests waiting for a batch."""
        return len(self._pending)

    def _stop_queue(self, workers: list[threading.Thread]) -> None:
        """Close: wake and join ``workers``; requests still waiting fail with RuntimeError."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for t in workers:
            t.join(timeout=30)
        while self._pending:
            self._pending.popleft().fut.set_exception(RuntimeError("engine closed"))

    def pause(self) -> None:
        """Stop starting new batches (running ones finish)."""
        with self._cv:
            self._paused = True

    def resume(self) -> None:
        """Undo :meth:`pause`."""
        with self._cv:
            self._paused = False
            self._cv.notify_all()


class TorchEngine(Engine):
    """Dynamic-batching torch engine (CPU or GPU) for HF causal LMs, MoE or dense.

    A worker thread takes every waiting request on the same weights (up to ``max_batch``)
    and runs them as one batch: left-padded prefill, then one token per step with the KV
    cache (``past_key_values``), per-request sampling (temperature, top_p, top_k, seed via a
    per-request ``torch.Generator``; filtering batched across rows), until eos/stop or
    ``max_tokens``. Behavior logprobs: one ``log_softmax`` + gather per step over the raw
    logits; expert routes accumulate in one preallocated uint8 tensor per batch, copied to
    the host once at the end.

    Args:
        model_dir: HF checkpoint dir (config + tokenizer; base weights).
        max_batch: requests per batch at most.
        max_queue: waiting requests at most; beyond it ``generate`` raises a 429 error.
        dtype: torch dtype of the weights (default float32).
        device: torch device of the weights (``cpu``, ``cuda``); greedy picks and logprobs
            run on it, the draw of sampled rows on CPU (per-request ``torch.Generator``), so
            seeded outputs do not depend on the device's RNG.
        threads: torch intra-op threads (None: torch's default).
        aligned_logprobs: after generation, score each completion with one unpadded batch-1
            forward in the learner's layout (:func:`schemas.modelspec.teacher_forced_inputs`,
            :func:`schemas.modelspec.token_logprobs`) and log THOSE behavior logprobs and expert
            routes. The learner's replayed forward of the sample is then the same computation
            on the same shapes, so |log π_train − behavior logprob| is exactly 0 (fp32, CPU,
            same thread count), where decode-time numbers differ by ~1e-6 (KV-cached decode
            and batched prefill are other matmul shapes). Costs one prefill-sized forward per
            completion. Tokens are still sampled from the decode-time distribution; the
            rescored logprob differs from it by that ~1e-6 (docs/decisions.md D11).
    """

    def __init__(self, model_dir: str | Path, max_batch: int = 8, max_queue: int = 256, dtype=None,
                 threads: int | None = None, device: str = "cpu", aligned_logprobs: bool = False):
        import torch

        self.device = torch.device(device)
        self.model_dir = Path(model_dir)
        self.max_batch = int(max_batch)
        self.max_queue = int(max_queue)
        self.aligned_logprobs = bool(aligned_logprobs)
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

    def _score_aligned(self, lm: LoadedModel, prompt: list[int], completion: list[int]):
        """``(behavior logprobs (C,) float32 list, routes (P + C - 1, L, k) or None)`` of one
        completion from the aligned scoring pass (see ``aligned_logprobs``)."""
        return _score_aligned_impl(lm, prompt, completion, self.device)

    # ------------------------------------------------------------------ requests
    def check_health(self) -> dict:
        if self._closed or not self._thread.is_alive():
            raise RuntimeError("engine worker is not running")
        return {"engine": "torch", "queue_depth": self.queue_depth(), "paused": self._paused,
                "batches_run": self.batches_run}

    def close(self) -> None:
        """Stop the worker; waiting requests fail with RuntimeError."""
        self._stop_queue([self._thread])

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
        """One batch: left-padded prefill, then one KV-cached decode step per token.

        Per step, the whole batch is handled with a few batched tensor ops on the model's
        device: one ``log_softmax`` over the raw logits ``(B, V)`` and one gather for the
        behavior logprobs, one ``argmax`` for greedy rows, batched temperature/top-k/top-p
        for sampled rows (only the final draw is per request, with its own CPU
        ``torch.Generator``, so a seed reproduces whatever the batch), one copy of the step's
        expert routes into a preallocated ``(B, T0 + max_new - 1, L, k)`` uint8 buffer, and one
        device -> host transfer of ``(B,)`` tokens and logprobs. The python loop that remains
        is the per-request stop/stream bookkeeping over the still-active rows.
        """
        import torch

        lm: LoadedModel = items[0].req.model
        model = lm.model
        t_batch = time.perf_counter()
        reqs = [it.req for it in items]
        B = len(reqs)
        self.batches_run += 1
        self.last_batch_size = B
        dev = self.device
        n_layers = len(lm.routers)
        top_k = moe_top_k(model) if n_layers else 0
        wide = int(getattr(model.config, "num_local_experts", 0) or 0) > 256
        route_dtype = np.uint16 if wide else np.uint8
        plen = [len(r.prompt_token_ids) for r in reqs]
        max_new = max(r.sampling.max_tokens for r in reqs)
        eos, max_pos = self.eos_id, self.max_positions

        # sampled rows (temperature > 0): per-request generator, batched filtering params
        samp = [i for i, r in enumerate(reqs) if r.sampling.temperature != 0]
        gens = []
        for i in samp:
            g = torch.Generator()
            seed = reqs[i].sampling.seed
            g.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,))))
            gens.append(g)
        samp_filter = None
        if samp:
            samp_ix = torch.tensor(samp, dtype=torch.long, device=dev)
            samp_filter = _BatchFilter([reqs[i].sampling for i in samp])
        want_top = [i for i, r in enumerate(reqs) if r.top_logprobs]
        top_n = max((reqs[i].top_logprobs for i in want_top), default=0)

        ids, mask0 = left_pad([r.prompt_token_ids for r in reqs], self.pad_id)  # (B, T0) int64
        T0 = ids.shape[1]
        W = T0 + max_new  # widest sequence the batch can reach
        mask = torch.ones((B, W), dtype=torch.long, device=dev)  # (B, W); prompt part from mask0
        mask[:, :T0] = mask0.to(dev)
        routes = None
        if n_layers:  # (B, T0 + max_new - 1, L, k): every fed token's expert selection
            routes = torch.empty((B, W - 1, n_layers, top_k), dtype=torch.int32 if wide else torch.uint8,
                                 device=dev)
        out = model(input_ids=ids.to(dev), attention_mask=mask[:, :T0], position_ids=position_ids(mask0).to(dev),
                    use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        if n_layers:
            routes[:, :T0] = torch.stack([b.view(B, T0, top_k) for b in lm.route_buf], dim=2)
        pos = torch.tensor(plen, dtype=torch.long, device=dev).unsqueeze(1)  # (B, 1) next position
        pad_col = torch.full((B, 1), self.pad_id, dtype=torch.long, device=dev)

        toks: list[list[int]] = [[] for _ in range(B)]
        lps: list[list[float]] = [[] for _ in range(B)]
        tops: list[list[list[tuple[int, float]]]] = [[] for _ in range(B)]
        finish: list[str | None] = [None] * B
        ttft = [0.0] * B
        t_end = [0.0] * B
        active = list(range(B))
        alive = torch.ones((B, 1), dtype=torch.bool, device=dev)  # rows still generating
        for step in range(max_new):
            logits = out.logits[:, -1, :].float()  # (B, V) raw logits
            logp = torch.log_softmax(logits, dim=-1)  # (B, V) raw distribution (temperature 1)
            tok = torch.argmax(logits, dim=-1)  # (B,) greedy choice
            if samp:
                picked = samp_filter.sample(logits.index_select(0, samp_ix).cpu(), gens)  # (S,) CPU
                tok = tok.index_copy(0, samp_ix, picked.to(dev))
            lp = logp.gather(1, tok.unsqueeze(1)).squeeze(1)  # (B,) behavior logprobs
            host = torch.stack([tok.double(), lp.double()]).tolist()  # the step's one device sync
            tok_l, lp_l = host
            if want_top:
                tv, ti = torch.topk(logp.index_select(0, torch.tensor(want_top, device=dev)),
                                    min(top_n, logp.shape[-1]))
                tv, ti = tv.tolist(), ti.tolist()
                for j, i in enumerate(want_top):
                    if finish[i] is None:
                        k = reqs[i].top_logprobs
                        tops[i].append(list(zip(ti[j][:k], tv[j][:k])))
            now = time.perf_counter()
            ended = []
            for i in active:
                r = reqs[i]
                t = int(tok_l[i])
                lpi = lp_l[i]
                toks[i].append(t)
                lps[i].append(lpi)
                if step == 0:
                    ttft[i] = (now - items[i].t_submit) * 1000
                if r.on_token is not None:
                    try:
                        r.on_token(t, lpi)
                    except Exception:  # noqa: BLE001 - a broken stream must not break the batch
                        log.exception("on_token callback failed")
                n = len(toks[i])
                if t == eos or t in r.stop_token_ids:
                    finish[i] = "stop"
                elif r.stop_check is not None and r.stop_check(toks[i]):
                    finish[i] = "stop"
                elif n >= r.sampling.max_tokens:
                    finish[i] = "length"
                elif r.cancelled.is_set():
                    finish[i] = "abort"
                elif max_pos and plen[i] + n >= max_pos:
                    finish[i] = "length"
                if finish[i] is not None:
                    t_end[i] = time.perf_counter()
                    ended.append(i)
            if ended:
                active = [i for i in active if finish[i] is None]
                if not active:
                    break
                alive[ended] = False
            next_tok = torch.where(alive, tok.unsqueeze(1), pad_col)  # (B, 1); finished rows get pad
            L = T0 + step + 1
            out = model(input_ids=next_tok, attention_mask=mask[:, :L], position_ids=pos, past_key_values=cache,
                        use_cache=True)
            cache = out.past_key_values
            pos = pos + 1
            if n_layers:
                routes[:, T0 + step] = torch.stack([b.view(B, top_k) for b in lm.route_buf], dim=1)  # (B, L, k)
        host_routes = routes.cpu().numpy() if n_layers else None  # one transfer for the batch
        if self.aligned_logprobs:
            for i, r in enumerate(reqs):
                if toks[i] and finish[i] != "abort":
                    t_a = time.perf_counter()
                    lps[i], rescored = self._score_aligned(lm, r.prompt_token_ids, toks[i])
                    if n_layers:  # the routes of the scoring pass go with its logprobs
                        host_routes[i, T0 - plen[i]:T0 + len(toks[i]) - 1] = rescored
                    t_end[i] += time.perf_counter() - t_a
        results = []
        for i, r in enumerate(reqs):
            if finish[i] is None:  # cannot happen: max_new bounds every request
                finish[i] = "length"
                t_end[i] = time.perf_counter()
            rt = None
            if n_layers:
                # prompt rows (left-padded) + one row per fed completion token (all but the last)
                rt = host_routes[i, T0 - plen[i]:T0 + len(toks[i]) - 1].astype(route_dtype)  # (P + C - 1, L, k)
                assert rt.shape[0] == plen[i] + len(toks[i]) - 1, rt.shape
            results.append(GenResult(
                completion_token_ids=toks[i], behavior_logprobs=lps[i], top_logprobs=tops[i],
                expert_routes=rt, finish_reason=finish[i], ttft_ms=ttft[i],
                latency_ms=(t_end[i] - items[i].t_submit) * 1000, version=lm.version, batch_size=B,
                queue_ms=max(0.0, (t_batch - items[i].t_submit) * 1000)))
        return results


def _score_aligned_impl(lm: LoadedModel, prompt: list[int], completion: list[int], device):
    import torch

    from schemas.modelspec import teacher_forced_inputs, token_logprobs

    x = {k: v.to(device) for k, v in teacher_forced_inputs(prompt, completion).items()}
    out = lm.model(input_ids=x["input_ids"], attention_mask=x["attention_mask"], position_ids=x["position_ids"],
                   use_cache=False)
    lp = token_logprobs(out.logits, x["target_ids"])[0, -len(completion):]  # (C,)
    routes = None
    if lm.route_buf:
        T = x["input_ids"].shape[1]
        routes = torch.stack([b.view(T, -1) for b in lm.route_buf], dim=1).cpu().numpy()  # (P + C - 1, L, k)
    return lp.cpu().tolist(), routes


class _BatchFilter:
    """Temperature, top-k and top-p for the sampled rows of a batch, as batched tensor ops.

    Semantics per row (same as vLLM's): divide the raw logits by the temperature; keep the
    ``top_k`` largest (0 = all; ties with the k-th kept); keep the smallest prefix of the
    sorted distribution whose mass reaches ``top_p``; draw one token from the softmax of
    what is left with the row's own ``torch.Generator``. Filtering only picks the token: the
    logged behavior logprob stays the raw one.

    Args:
        params: one :class:`schemas.events.SamplingParams` per sampled row (temperature > 0).
    """

    def __init__(self, params):
        import torch

        self.temp = torch.tensor([p.temperature for p in params], dtype=torch.float32).unsqueeze(1)  # (S, 1)
        self.k = [p.top_k if p.top_k and p.top_k > 0 else 0 for p in params]
        self.top_p = [float(p.top_p) for p in params]
        self.k_rows = [j for j, k in enumerate(self.k) if k]
        self.p_rows = [j for j, p in enumerate(self.top_p) if p < 1.0]
        if self.p_rows:
            self.p_ix = torch.tensor(self.p_rows, dtype=torch.long)
            self.p_val = torch.tensor([self.top_p[j] for j in self.p_rows], dtype=torch.float32).unsqueeze(1)

    def sample(self, logits, gens) -> Any:
        """Token ids ``(S,)`` int64 from raw logits ``(S, V)`` float32 (CPU), one generator per row."""
        import torch

        x = logits / self.temp  # (S, V)
        V = x.shape[-1]
        rows = [j for j in self.k_rows if self.k[j] < V]
        if rows:
            kmax = max(self.k[j] for j in rows)
            vals = torch.topk(x[rows], kmax, dim=-1).values  # (R, kmax) descending
            kth = vals.gather(1, torch.tensor([[self.k[j] - 1] for j in rows]))  # (R, 1) k-th largest
            xr = x[rows]
            x[rows] = xr.masked_fill(xr < kth, float("-inf"))
        if self.p_rows:
            xp = x.index_select(0, self.p_ix)  # (R, V)
            sx, si = torch.sort(xp, dim=-1, descending=True)
            probs = torch.softmax(sx, dim=-1)
            drop = probs.cumsum(-1) - probs > self.p_val  # keep the smallest prefix with mass >= top_p
            sx = sx.masked_fill(drop, float("-inf"))
            x.index_copy_(0, self.p_ix, torch.full_like(xp, float("-inf")).scatter(1, si, sx))
        probs = torch.softmax(x, dim=-1)  # (S, V)
        return torch.cat([torch.multinomial(probs[j], 1, generator=g) for j, g in enumerate(gens)])
