"""Inference engines: the async protocol (:class:`serving.engine_base.Engine`, vLLM's
``EngineClient`` shape, re-exported here) and its torch implementation with continuous batching, KV cache, behavior logprobs and expert-route
capture (:class:`TorchEngine`, its running batch in :mod:`serving.torch_batch`).

The engine knows nothing about HTTP, Kafka or the model store: it turns token ids into
token ids plus the numbers the learner needs (behavior logprobs under the raw
distribution, expert routes in vLLM's layout), on whichever :class:`LoadedModel` a request
names. :class:`serving.engine_vllm.VLLMEngine` implements the same interface (imported lazily).

Numerics follow ``schemas.modelspec`` (DESIGN §4): fp32, eager attention and experts, left
padding with ``position_ids = cumsum(mask) - 1``, so the learner's recompute lines up.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from schemas.events import now_ms
from schemas.manifest import BASE_VERSION, digest_of_hashes, state_sha256
from schemas.modelspec import (WeightsMismatchError, attention_window, build_model, checkpoint_dtype,  # noqa: F401
                               load_model, load_tokenizer, trim_heap)
from schemas.routers import route_shape, routed_layers
from serving.config import EngineConfig, split_settings
from serving.engine_base import Engine  # noqa: F401 - the protocol TorchEngine implements
from serving.params import GenRequest, GenResult, ServingValidationError

log = logging.getLogger("flywheel.serving.engine")

CHAT_STOP = "<|im_end|>"


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
        routers / route_buf: the MoE router modules and, per transformer layer (global
            index, vLLM's layout; None for dense layers), the expert indices ``(N, k)`` of
            the last forward (filled by forward hooks); empty for a dense model. Read them
            with :meth:`layer_routes`. route_dims: ``(L, k, E)`` of the routes it logs.
        prefix_cache: this version's :class:`serving.prefix_cache.PrefixCache`, or None when
            the engine runs without prefix caching.
    """

    version: str
    model: Any
    hashes: dict[str, str]
    weights_digest: str
    loaded_at: int
    load_ms: float
    routers: list = field(default_factory=list)
    route_buf: list = field(default_factory=list)  # per layer: last indices (N, k), None = dense
    route_dims: tuple = (0, 0, 0)  # (L, k, E): schemas.routers.route_shape of the model
    prefix_cache: Any = None  # serving.prefix_cache.PrefixCache of these weights, or None (off)

    def layer_routes(self) -> list:
        """The last forward's routes per transformer layer: ``num_hidden_layers`` tensors
        ``(N, k)`` int64, zeros for dense layers (as vLLM reports them)."""
        import torch

        ref = next(b for b in self.route_buf if b is not None)
        return [torch.zeros_like(ref) if b is None else b for b in self.route_buf]


@dataclass
class _Item:
    """A queued request: the request, its future and when it was submitted (perf_counter s)."""

    req: GenRequest
    fut: concurrent.futures.Future
    t_submit: float


def check_request(req: GenRequest) -> None:
    """Refuse a request no engine can run (400 naming the field)."""
    if not req.prompt_token_ids:
        raise ServingValidationError("prompt", req.prompt_token_ids, "must have at least one token")
    if req.model is None:
        raise ServingValidationError("model", None, "no weights to run on")


class TorchEngine(Engine):
    """Torch engine (CPU or GPU) for HF causal LMs, MoE or dense, with iteration-level
    (continuous) batching.

    A worker thread keeps one :class:`serving.torch_batch.RunningBatch` per LoadedModel
    being served. Every iteration it admits waiting requests (FIFO, up to ``max_batch``
    running in all) into the batch of their weights (prefilled together, left-padded, in the
    batch's next decode forward when ``fused_join_pad_tokens`` allows, else by a forward of
    their own, then merged into the running KV cache), and runs one step of every running
    batch: sample one token per row from the raw logits (temperature, top_p, top_k, seed via a
    per-request CPU ``torch.Generator``: the same tokens alone or in any batch), then one
    KV-cached decode forward. Finished rows leave the batch at once, so a new request waits at most one step
    to join, never for the longest request in the batch. Behavior logprobs are the raw
    ``log_softmax`` of the logits (temperature 1, unfiltered); expert routes
    ``(P + C - 1, L, k)`` are copied to the host after every forward.

    Args:
        model_dir: HF checkpoint dir (config + tokenizer; base weights).
        config: the engine's settings (:class:`serving.config.EngineConfig`, where each
            default and bound is declared); ``**settings`` overrides its fields by name
            (``TorchEngine(d, max_batch=4)``). The fields:
        max_batch: requests running at once at most (all weights together).
        max_queue: waiting requests at most; beyond it ``submit`` raises a 429 error.
        dtype: torch dtype of the weights (default the checkpoint's, ``checkpoint_dtype``).
        device: torch device of the weights (``cpu``, ``cuda``); greedy picks and logprobs
            run on it, the draw of sampled rows on CPU (per-request ``torch.Generator``), so
            seeded outputs do not depend on the device's RNG.
        threads: torch intra-op threads (None: torch's default).
        scheduler: ``continuous`` (requests join and leave the running batch at every step
            boundary) or ``static`` (a batch is formed from the waiting requests when none
            runs on those weights, and takes nobody new until its last row ends: the
            pre-continuous behaviour, kept for the serving benchmark).
        aligned_logprobs: after generation, score each completion with one unpadded batch-1
            forward in the learner's layout (:func:`schemas.modelspec.teacher_forced_inputs`,
            :func:`schemas.modelspec.token_logprobs`) and log THOSE behavior logprobs and expert
            routes. The learner's replayed forward of the sample is then the same computation
            on the same shapes, so |log π_train − behavior logprob| is exactly 0 (fp32, CPU,
            same thread count), where decode-time numbers differ by ~1e-6 (KV-cached decode
            and batched prefill are other matmul shapes). Costs one prefill-sized forward per
            completion. Tokens are still sampled from the decode-time distribution; the
            rescored logprob differs from it by that ~1e-6 (docs/decisions.md D11).
        prefix_caching: keep the KV cache of prompt prefixes shared by requests (the chat
            template's system turn, a product's instructions) per loaded version and prefill
            only the rest (:mod:`serving.prefix_cache`; docs/decisions.md D26).
        waiting_served_ratio: continuous only. A join's prefill is a forward of its own; this
            trades time to first token for fewer, larger prefill forwards (on 2 CPU cores it
            halved them and gained no throughput, docs/decisions.md D28). With ``r > 0``,
            waiting requests join a running batch only once ``floor(r x running rows)`` of
            them (or as many as there is room for) can join together, or
            ``max_waiting_tokens`` decode steps after the last join. 0 (default): any waiting request joins at the next step.
            The rule and both names are text-generation-inference's router
            (``--waiting-served-ratio``, ``--max-waiting-tokens``; TGI's defaults 0.3 and 20).
            A batch with no running rows always takes its waiting requests at once.
        max_waiting_tokens: decode steps after which waiting requests join however few
            (>= 1; bounds the extra time to first token at that many steps).
        fused_join_pad_tokens: continuous only. Requests joining a running batch are
            prefilled in the same forward as the running rows' decode (vLLM mixes prefills
            into decode steps the same way) when that adds at most this many padding tokens
            (``running rows x (longest joining prompt - 1)``); else their prefill is a forward
            of its own. A forward's fixed cost (reading every weight, Python and kernel
            launches) is then paid once per step instead of twice; padding tokens cost compute,
            so the bound keeps long prompts joining a large batch out (>= 0; 0 fuses only
            one-token prompts). Not with prefix caching (its joins keep their own forward).

    Raises:
        ValueError (pydantic.ValidationError, naming the field): unknown ``scheduler``;
            ``waiting_served_ratio`` < 0 or not finite; ``max_waiting_tokens`` < 1;
            ``fused_join_pad_tokens`` < 0; ``max_batch`` or ``max_queue`` < 1.
        TypeError: a keyword that is no field of :class:`EngineConfig`.
    """

    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None, *, dtype=None, **settings: Any):
        import torch

        if settings:  # keyword settings by field name, as programs and tests pass them
            (config,) = split_settings(settings, config or EngineConfig(), where="TorchEngine")
        self.config = config = config or EngineConfig()
        self.fused_join_pad_tokens = config.fused_join_pad_tokens
        self.waiting_served_ratio = config.waiting_served_ratio
        self.max_waiting_tokens = config.max_waiting_tokens
        self._steps_since_join = 0  # decode iterations since waiting requests last joined
        self.device = torch.device(config.device)
        self.model_dir = Path(model_dir)
        self.max_batch = config.max_batch
        self.max_queue = config.max_queue
        self.scheduler = config.scheduler
        self.aligned_logprobs = config.aligned_logprobs
        self.prefix_caching = config.prefix_caching
        self.dtype = dtype or checkpoint_dtype(json.loads((self.model_dir / "config.json").read_text()))
        if config.threads:
            torch.set_num_threads(config.threads)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.pad_id = int(self.tokenizer.pad_token_id)
        eos = self.tokenizer.convert_tokens_to_ids(CHAT_STOP)
        if eos is None or eos == self.tokenizer.unk_token_id:
            eos = self.tokenizer.eos_token_id
        self.eos_id = int(eos)
        self._pending: collections.deque[_Item] = collections.deque()
        self._live: dict[str, GenRequest] = {}  # request_id -> request, queued or running
        self._running: dict[int, Any] = {}  # id(LoadedModel) -> RunningBatch
        self._cv = threading.Condition()
        self._paused = False
        self._closed = False
        self.batches_run = 0  # prefill groups admitted
        self.fused_joins = 0  # prefill groups that rode in a decode forward
        self.steps_run = 0  # decode steps (one per running batch per iteration)
        self.last_batch_size = 0  # rows running after the last iteration
        self.max_positions = None
        self._thread = threading.Thread(target=self._worker, name="flywheel-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ weights
    def load_base(self, version: str = BASE_VERSION) -> LoadedModel:
        """The checkpoint at ``model_dir`` as served weights (hashes computed, not checked)."""
        t0 = time.perf_counter()
        model = load_model(self.model_dir, dtype=self.dtype).to(self.device)
        return self._wrap(model, version, t0)

    def load_weights(self, state: dict, version: str, expected_hashes: dict[str, str] | None = None
                     ) -> LoadedModel:
        """Fresh model from ``model_dir``'s config holding ``state``'s tensors (no copy: see
        :func:`build_model`; the caller hands ``state`` over), then verified.

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
        model = build_model(self.model_dir, state, dtype=self.dtype).to(self.device)
        sd = model.state_dict()
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
        trim_heap()
        return lm

    def _wrap(self, model, version: str, t0: float) -> LoadedModel:
        hashes = state_sha256(model.state_dict())
        layers, dims = routed_layers(model), route_shape(model)
        lm = LoadedModel(version=version, model=model, hashes=hashes,
                         weights_digest=digest_of_hashes(hashes), loaded_at=now_ms(),
                         load_ms=(time.perf_counter() - t0) * 1000, routers=[r.router for r in layers],
                         route_buf=[None] * dims[0], route_dims=dims)
        if self.prefix_caching:
            from serving.prefix_cache import PrefixCache

            lm.prefix_cache = PrefixCache()
        for rl in layers:
            def hook(_mod, _inp, out, i=rl.layer, buf=lm.route_buf):
                buf[i] = out[2]  # (N, k) selected experts
            rl.router.register_forward_hook(hook)
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 0) or 0) or None
        window = attention_window(model.config)
        if window is not None:  # full KV cache, window never binds (D39)
            self.max_positions = min(self.max_positions or window, window)
        return lm

    def _score_aligned(self, lm: LoadedModel, prompt: list[int], completion: list[int]):
        """``(behavior logprobs (C,) float32 list, routes (P + C - 1, L, k) or None)`` of one
        completion from the aligned scoring pass (see ``aligned_logprobs``)."""
        return _score_aligned_impl(lm, prompt, completion, self.device)

    # ------------------------------------------------------------------ requests
    def submit(self, req: GenRequest) -> concurrent.futures.Future:
        """Queue ``req`` for the worker; see :meth:`Engine.submit`. The torch engine refuses
        ``req.structured`` (structured outputs are a vLLM engine feature)."""
        if self._closed:
            raise RuntimeError("engine is closed")
        check_request(req)
        if req.structured is not None:
            raise ServingValidationError("response_format", req.structured, "structured outputs need the vLLM "
                                         "engine (flywheel serve --engine vllm); this pod runs the torch engine")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if len(self._pending) >= self.max_queue:
                raise ServingValidationError("request", "queue", f"server queue is full ({self.max_queue})",
                                             status=429, code="queue_full")
            if req.request_id in self._live:
                raise ServingValidationError("request_id", req.request_id, "is already running on this engine")
            self._live[req.request_id] = req
            self._pending.append(_Item(req, fut, time.perf_counter()))
            self._cv.notify()
        fut.add_done_callback(lambda _f, rid=req.request_id: self._live.pop(rid, None))
        return fut

    def abort(self, request: "str | GenRequest") -> None:
        req = request if isinstance(request, GenRequest) else self._live.get(request)
        if req is not None:
            req.cancelled.set()
            with self._cv:
                self._cv.notify()

    def queue_depth(self) -> int:
        return len(self._pending)

    def num_running(self) -> int:
        return sum(len(r.seqs) + len(r.joining) for r in list(self._running.values()))

    def pause(self) -> None:
        with self._cv:
            self._paused = True

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    def check_health(self) -> dict:
        if self._closed or not self._thread.is_alive():
            raise RuntimeError("engine worker is not running")
        return {"engine": "torch", "scheduler": self.scheduler, "queue_depth": self.queue_depth(),
                "running": self.num_running(), "paused": self._paused, "batches_run": self.batches_run,
                "fused_joins": self.fused_joins,
                "steps_run": self.steps_run}

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=30)
        while self._pending:
            it = self._pending.popleft()
            if not it.fut.done():
                it.fut.set_exception(RuntimeError("engine closed"))

    # ------------------------------------------------------------------ worker
    def _admit(self) -> list[_Item] | None:
        """Wait for work; take the waiting requests that may join now (None: closed).

        Continuous: any waiting request while fewer than ``max_batch`` run. Static: only
        requests whose weights have no running batch (they form a new one together).
        """
        with self._cv:
            while not self._closed and not self._running and (self._paused or not self._pending):
                self._cv.wait(0.5)
            if self._closed:
                return None
            if self._paused or not self._pending:
                return []
            running = self.num_running()
            room = self.max_batch - running
            if self._hold_joins(running, room):
                return []
            out: list[_Item] = []
            rest: collections.deque[_Item] = collections.deque()
            while self._pending:
                it = self._pending.popleft()
                if it.req.cancelled.is_set() or (
                        room > 0 and (self.scheduler == "continuous" or id(it.req.model) not in self._running)):
                    out.append(it)
                    room -= 0 if it.req.cancelled.is_set() else 1
                else:
                    rest.append(it)
            self._pending = rest
            return out

    def _hold_joins(self, running: int, room: int) -> bool:
        """Continuous with ``waiting_served_ratio``: True while the waiting requests should
        keep waiting for company (see the class docstring). Called under ``self._cv``."""
        if self.scheduler != "continuous" or self.waiting_served_ratio <= 0 or not running:
            return False
        if self._steps_since_join >= self.max_waiting_tokens:
            return False
        if any(it.req.cancelled.is_set() for it in self._pending):  # resolve aborts at once
            return False
        waiting = len(self._pending)  # none is cancelled here
        want = min(room, math.floor(self.waiting_served_ratio * running))
        return waiting < max(want, 1)

    def _worker(self) -> None:
        import torch

        with torch.inference_mode():
            while True:
                items = self._admit()
                if items is None:
                    break
                if items:
                    self._start(items)
                    self._steps_since_join = 0
                for key, run in list(self._running.items()):
                    self._step(key, run)
                self._steps_since_join += 1
                self.last_batch_size = self.num_running()
        for run in self._running.values():
            for s in run.seqs + run.joining:
                if not s.item.fut.done():
                    s.item.fut.set_exception(RuntimeError("engine closed"))
        self._running.clear()

    def _start(self, items: list[_Item]) -> None:
        """Prefill admitted requests into the running batch of their weights."""
        from serving.torch_batch import RunningBatch

        groups: dict[int, list[_Item]] = {}
        for it in items:
            if not it.fut.set_running_or_notify_cancel():
                continue
            if it.req.cancelled.is_set():  # aborted while waiting: no token made
                it.fut.set_result(GenResult(
                    completion_token_ids=[], behavior_logprobs=[], top_logprobs=[], expert_routes=None,
                    finish_reason="abort", ttft_ms=0.0, latency_ms=(time.perf_counter() - it.t_submit) * 1000,
                    version=it.req.model.version, batch_size=0))
                continue
            groups.setdefault(id(it.req.model), []).append(it)
        now = time.perf_counter()
        for key, group in groups.items():
            run = self._running.get(key) or RunningBatch(group[0].req.model, self)
            if run.seqs:  # a running batch takes them at the end of its next step
                run.queue_join(group, now)
                self.batches_run += 1
                continue
            try:
                run.join(group, now)
            except Exception as exc:  # noqa: BLE001 - fail these requests, keep serving
                log.exception("prefill of %d requests failed", len(group))
                for it in group:
                    it.fut.set_exception(exc)
                continue
            self._running[key] = run
            self.batches_run += 1

    def _step(self, key: int, run) -> None:
        """One step of ``run``; resolve the rows that finished; drop the batch when empty."""
        try:
            done = run.step()
            self.steps_run += 1
        except Exception as exc:  # noqa: BLE001 - fail this batch's requests, keep serving
            log.exception("step of a batch of %d failed", len(run.seqs) + len(run.joining))
            for s in run.seqs + run.joining:
                if not s.item.fut.done():
                    s.item.fut.set_exception(exc)
            run.seqs, run.joining = [], []
            done = []
        for s in done:
            try:
                s.item.fut.set_result(run.result(s))
            except Exception as exc:  # noqa: BLE001 - e.g. the aligned scoring pass failed
                log.exception("finishing request %s failed", s.req.request_id)
                s.item.fut.set_exception(exc)
        if not run.seqs and not run.joining:
            self._running.pop(key, None)



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
        routes = torch.stack([b.view(T, -1) for b in lm.layer_routes()], dim=1).cpu().numpy()  # (P + C - 1, L, k)
    return lp.cpu().tolist(), routes


TOP_P_CANDIDATES = 256  # largest logits a top-p row is first filtered among (see _BatchFilter._top_p)


class _BatchFilter:
    """Temperature, top-k and top-p for the sampled rows of a batch, as batched tensor ops.

    Semantics per row (same as vLLM's): divide the raw logits by the temperature; keep the
    ``top_k`` largest (0 = all; ties with the k-th kept); keep the smallest prefix of the
    sorted distribution whose mass reaches ``top_p``; draw one token from the softmax of
    what is left with the row's own ``torch.Generator``. Filtering only picks the token: the
    logged behavior logprob stays the raw one. A row's top-p prefix is looked for among its
    ``TOP_P_CANDIDATES`` largest logits first (:meth:`_top_p`).

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

    def _top_p(self, xp) -> Any:
        """The top-p rows' logits ``(R, V)`` with everything outside each row's smallest
        sorted prefix of mass >= top_p set to -inf. A row is sorted whole only when its
        ``TOP_P_CANDIDATES`` largest logits hold less than its top_p; the kept set, hence the
        draw, does not depend on which way it was found."""
        import torch

        def keep_prefix(sx, si, probs, p_val):
            """Rows ``(n, V)``: -inf but the sorted logits ``sx`` (at ``si``, with their
            whole-row probabilities ``probs``) of each row's smallest prefix with mass >= ``p_val``."""
            drop = probs.cumsum(-1) - probs > p_val
            return sx.new_full((sx.shape[0], V), float("-inf")).scatter(1, si, sx.masked_fill(drop, float("-inf")))

        V = xp.shape[-1]
        lse = torch.logsumexp(xp, dim=-1, keepdim=True)  # (R, 1)
        sx, si = torch.topk(xp, min(TOP_P_CANDIDATES, V), dim=-1)  # (R, K) descending
        probs = torch.exp(sx - lse)
        out = keep_prefix(sx, si, probs, self.p_val)
        short = torch.nonzero(probs.sum(-1, keepdim=True) < self.p_val)[:, 0]  # (R',) prefix beyond the K
        if short.numel():
            fx, fi = torch.sort(xp.index_select(0, short), dim=-1, descending=True)
            out.index_copy_(0, short, keep_prefix(fx, fi, torch.exp(fx - lse.index_select(0, short)),
                                                  self.p_val.index_select(0, short)))
        return out

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
            x.index_copy_(0, self.p_ix, self._top_p(x.index_select(0, self.p_ix)))
        probs = torch.softmax(x, dim=-1)  # (S, V)
        return torch.cat([torch.multinomial(probs[j], 1, generator=g) for j, g in enumerate(gens)])
