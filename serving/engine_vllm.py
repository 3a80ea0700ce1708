"""vLLM engine (``flywheel serve --engine vllm``): the :class:`serving.engine_base.Engine` protocol
over vLLM's async engine (``vllm.v1.engine.async_llm.AsyncLLM``), returning the same
:class:`GenResult` (so the same CompletionEvents).

Imported lazily (only with ``--engine vllm``): vLLM lives in its own virtual environment
(DESIGN §3). vLLM schedules continuously (requests join and leave its running batch at every
step); every request is one ``AsyncLLM.generate`` stream with ``RequestOutputKind.DELTA``, so
tokens reach :meth:`GenRequest.emit_step` as vLLM makes them, and ``abort(request_id)`` is
vLLM's own abort (the request leaves vLLM's batch and frees its KV blocks at the next step).
All AsyncLLM instances live on one event loop: the HTTP server's when one is given (``flywheel
serve``: one thread for requests, AsyncLLM's outputs and the streamed responses, as in vLLM's
own server), else one in a background thread of this engine. Either way the engine can be
driven from any thread or event loop (``submit`` is thread-safe).

Numbers it returns:

- behavior logprobs: vLLM ``logprobs_mode="raw_logprobs"`` (log softmax of the unprocessed
  logits: temperature 1, no top-p/top-k), the same definition as the torch engine and
  ``SamplingParams.logprobs_kind == "raw"``.
- expert routes: ``CompletionOutput.routed_experts`` with ``enable_return_routed_experts=True``,
  shaped ``(prompt + completion - 1, num_hidden_layers, top_k)`` (vLLM's layout, DESIGN §2, D38: the
  last sampled token is never run through the model), on the request's last output. When vLLM
  cannot give them (the CPU build: routed-experts capture needs Triton; a dense model; an
  aborted or stop-string-cut request; a shape we do not expect) routes are None and
  ``routes_missing[reason]`` counts why.

Weight slots: each :class:`LoadedModel` is backed by one ``AsyncLLM`` instance (at most
``max_instances``: stable, candidate and the previous stable). ``load_weights`` reuses an
instance whose LoadedModel is no longer referenced (a slot dropped it after promote/rollback)
and updates its weights **in place** (no restart): the new state is written to a safetensors
file and the worker extension :class:`serving.vllm_worker.FlywheelWorkerExtension` runs vLLM's
``reload_weights`` on it, then the CPU MoE re-pack of docs/decisions.md D13
(:func:`serving.vllm_worker.repack_cpu_experts`; counts in ``reload_repairs``); then the
prefix cache is reset, so the KV/prefix cache never mixes versions. Else a new instance starts
(from ``model_dir``; no reload when the version's weights are the checkpoint's own).

Structured outputs: ``GenRequest.structured`` (e.g. ``{"json": schema}``) becomes vLLM's
``StructuredOutputsParams``. :func:`parse_tool_calls` runs one of vLLM's tool-call parsers.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import importlib.util
import logging
import os
import tempfile
import threading
import time
import weakref
from pathlib import Path

import numpy as np

from schemas.events import now_ms
from schemas.manifest import BASE_VERSION, digest_of_hashes, state_sha256
from schemas.modelspec import WeightsMismatchError
from serving.config import EngineConfig, VLLMConfig, split_settings
from serving.engine_base import CHAT_STOP, Engine, LoadedModel, check_request
from serving.params import GenRequest, GenResult, ServingValidationError, StepOutput
from serving.vllm_worker import repack_cpu_experts, to_checkpoint_names  # noqa: F401 - re-exported

log = logging.getLogger("flywheel.serving.engine_vllm")

WORKER_EXTENSION = "serving.vllm_worker.FlywheelWorkerExtension"


def _has_triton() -> bool:
    """vLLM's own answer to "is Triton usable here" (the CPU build ships a Triton without a CPU
    backend, which vLLM disables)."""
    try:
        from vllm.triton_utils import HAS_TRITON
    except ImportError:
        return importlib.util.find_spec("triton") is not None
    return bool(HAS_TRITON)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """The engine's event loop: uvloop's when installed (vLLM's own server runs AsyncLLM on
    uvloop; vLLM depends on it), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class _Instance:
    """One ``AsyncLLM`` and the LoadedModel it currently holds (weakly)."""

    def __init__(self, llm):
        self.llm = llm
        self.holder: weakref.ref | None = None
        self.lock = threading.Lock()  # one weight update at a time
        self.digest: str | None = None  # digest_of_hashes of the weights it holds

    def free(self) -> bool:
        return self.holder is None or self.holder() is None


class VLLMEngine(Engine):
    """vLLM-backed engine with the torch engine's contract (see module docstring).

    Args:
        model_dir: HF checkpoint dir (config, tokenizer, base weights).
        config: the vLLM options (:class:`serving.config.VLLMConfig`, where each default is
            declared; its fields are listed below).
        batch: the batch settings every engine has (:class:`serving.config.EngineConfig`):
            ``max_batch`` is vLLM's ``max_num_seqs`` (requests running at once per instance),
            ``max_queue`` the requests waiting beyond the running ones at most (beyond it
            ``submit`` raises a 429 error); its torch-only fields must keep their defaults.
        **settings: fields of either model by name (``VLLMEngine(d, max_batch=8, max_model_len=128)``).
        dtype: vLLM dtype string (``float32`` on CPU, ``bfloat16``/``float32`` on GPU).
        max_model_len: context length (tokens); default the model's.
        max_instances: ``AsyncLLM`` instances at most (3 = stable + candidate + the previous
            stable that :class:`serving.slots.Slots` keeps resident for instant rollback).
        gpu_memory_utilization: per instance, share of GPU memory (on the CPU build: of host
            memory, for the KV cache); default ``0.9 / max_instances`` on GPU, 0.05 on CPU.
        tensor_parallel_size: GPUs per instance (vLLM ``tensor_parallel_size``).
        quantization: vLLM ``quantization`` method (e.g. ``fp8``), or None.
        return_routes: ask vLLM for routed experts (``enable_return_routed_experts``); off
            with a counted reason when Triton is not installed (the CPU build).
        engine_kwargs: extra ``AsyncEngineArgs`` keyword arguments (e.g. ``enforce_eager``).
        tool_call_parser: vLLM tool parser for chat requests with ``tools`` (as ``vllm serve
            --tool-call-parser``; ``hermes`` fits Qwen/Hermes-style ``<tool_call>`` output).
        loop: the event loop to run AsyncLLM on, owned and run by the caller (``flywheel
            serve`` passes the loop its HTTP server runs on, so requests, AsyncLLM's output
            handler and the streamed responses share one thread, as in vLLM's own server);
            None: the engine runs its own loop in a background thread.

    Raises:
        ImportError: vLLM is not installed in this interpreter.
        ValueError: a value a model refuses (naming the field), or a torch-only setting.
        TypeError: a keyword that is no field of either model.
    """

    supports_structured = True  # GenRequest.structured and parse_tool_calls

    def __init__(self, model_dir: str | Path, config: VLLMConfig | None = None, *, batch: EngineConfig | None = None,
                 engine_kwargs: dict | None = None, loop: asyncio.AbstractEventLoop | None = None, **settings):
        batch, config = split_settings(settings, batch or EngineConfig(), config or VLLMConfig(), where="VLLMEngine")
        torch_only = batch.torch_only_changed()
        if torch_only:
            raise ValueError(f"{torch_only[0][0]}: torch engine only ({torch_only[0][1]})")
        import vllm  # noqa: F401 - fail early and clearly when vLLM is missing
        from transformers import AutoConfig

        from schemas.modelspec import load_tokenizer

        self.config = config
        self.model_dir = Path(model_dir)
        self.max_batch = batch.max_batch
        self.max_queue = batch.max_queue
        self.dtype = config.dtype
        self.max_instances = config.max_instances
        self.tensor_parallel_size = config.tensor_parallel_size
        self.quantization = config.quantization
        import torch

        self.gpu_memory_utilization = config.gpu_memory_utilization or (
            0.9 / self.max_instances if torch.cuda.is_available() else 0.05)
        self.engine_kwargs = dict(engine_kwargs or {})
        self.tool_call_parser = config.tool_call_parser
        self.tokenizer = load_tokenizer(self.model_dir)
        cfg = AutoConfig.from_pretrained(self.model_dir)
        self.max_positions = int(config.max_model_len or getattr(cfg, "max_position_embeddings", 0) or 0) or None
        from schemas.routers import adapter_for, num_experts

        moe = adapter_for(cfg) is not None  # refuses an MoE architecture with no router adapter
        # vLLM's routed_experts: one column per transformer layer (dense layers' stay 0), D38
        self.moe_layers = int(cfg.num_hidden_layers) if moe else 0
        self.top_k = int(getattr(cfg, "num_experts_per_tok", 0) or 0) if moe else 0
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        self.route_dtype = np.uint8 if num_experts(cfg) <= 256 else np.uint16
        self.pad_id = int(self.tokenizer.pad_token_id)
        eos = self.tokenizer.convert_tokens_to_ids(CHAT_STOP)
        if eos is None or eos == self.tokenizer.unk_token_id:
            eos = self.tokenizer.eos_token_id
        self.eos_id = int(eos)
        self.routes_missing: collections.Counter[str] = collections.Counter()
        self.reload_repairs: collections.Counter[str] = collections.Counter()
        self.return_routes = bool(config.return_routes and self.moe_layers)
        self._routes_off_reason: str | None = None
        if self.return_routes and not _has_triton():
            self.return_routes = False
            self._routes_off_reason = "routed experts need Triton (vLLM finds none with a backend here: CPU build)"
        self._instances: list[_Instance] = []
        self._inst_lock = threading.Lock()
        self._inflight: dict[str, tuple[GenRequest, concurrent.futures.Future]] = {}
        self._started: set[str] = set()  # request ids that have a first token
        self._lock = threading.Lock()
        self._closed = False
        self.requests_run = 0
        self._unpaused = asyncio.Event()  # bound to the loop that first waits on it
        self._unpaused.set()
        self._loop = loop or new_event_loop()
        self._thread: threading.Thread | None = None
        if loop is None:
            self._thread = threading.Thread(target=self._run_loop, name="flywheel-vllm-loop", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ event loop
    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def _call(self, coro, timeout_s: float | None = None):
        """Run ``coro`` on the engine's loop and wait for its result: from another thread
        while the loop runs, or on the loop itself before its owner runs it (startup).

        Raises:
            RuntimeError: called from a coroutine on the engine's own loop (it would wait for
                itself; run the blocking call in a thread, as the admin routes do).
        """
        if self._thread is None and not self._loop.is_running():
            return self._loop.run_until_complete(coro)
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            coro.close()
            raise RuntimeError("a blocking engine call on the engine's own event loop; run it in a thread")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    # ------------------------------------------------------------------ weights
    def _engine_args(self, routes: bool):
        from vllm.engine.arg_utils import AsyncEngineArgs

        kw = dict(model=str(self.model_dir), dtype=self.dtype, logprobs_mode="raw_logprobs", seed=0,
                  enable_prefix_caching=True, max_model_len=self.max_positions, max_num_seqs=self.max_batch,
                  gpu_memory_utilization=self.gpu_memory_utilization,
                  tensor_parallel_size=self.tensor_parallel_size, quantization=self.quantization,
                  worker_extension_cls=WORKER_EXTENSION, disable_log_stats=True,
                  enable_return_routed_experts=routes)
        kw.update(self.engine_kwargs)
        return AsyncEngineArgs(**kw)

    def _new_llm(self):
        """Start one ``AsyncLLM`` (its engine core is a separate process; minutes on a busy CPU)."""
        from vllm.v1.engine.async_llm import AsyncLLM

        try:
            return AsyncLLM.from_engine_args(self._engine_args(self.return_routes))
        except Exception as exc:  # noqa: BLE001 - e.g. a build that cannot capture routes
            if not self.return_routes:
                raise
            self._routes_off_reason = f"enable_return_routed_experts failed: {type(exc).__name__}"
            log.warning("%s (%s); serving without expert routes", self._routes_off_reason, exc)
            self.return_routes = False
            return AsyncLLM.from_engine_args(self._engine_args(False))

    def _claim_instance(self) -> _Instance:
        with self._inst_lock:
            for inst in self._instances:
                if inst.free():
                    return inst
            if len(self._instances) >= self.max_instances:
                raise RuntimeError(f"all {self.max_instances} vLLM instances hold resident versions (stable, "
                                   "candidate, previous stable); raise max_instances or drop one")
            inst = _Instance(self._new_llm())
            inst.digest = self._base_digest()  # started from model_dir: holds the base weights
            self._instances.append(inst)
            return inst

    def _base_digest(self) -> str:
        if not hasattr(self, "_base_hashes"):
            from schemas.modelspec import load_model

            self._base_hashes = state_sha256(load_model(self.model_dir).state_dict())
        return digest_of_hashes(self._base_hashes)

    def load_base(self, version: str = BASE_VERSION) -> LoadedModel:
        """The checkpoint at ``model_dir`` as served weights."""
        from schemas.modelspec import load_model

        return self.load_weights(load_model(self.model_dir).state_dict(), version)

    def load_weights(self, state: dict, version: str, expected_hashes: dict[str, str] | None = None
                     ) -> LoadedModel:
        """Put ``state`` (HF names, ``{name: Tensor}``) into a free vLLM instance, in place.

        The hashes are verified on ``state`` before it goes to vLLM (vLLM fuses and shards
        tensors, so its copy has other names); ``expected_hashes`` must cover ``state``.

        Raises:
            WeightsMismatchError: a hash differs or a tensor is missing/unexpected.
            RuntimeError: no free instance (all hold resident versions), or the in-place
                update failed (see :func:`serving.vllm_worker.repack_cpu_experts`).
        """
        t0 = time.perf_counter()
        hashes = state_sha256(state)
        if expected_hashes is not None:
            missing = sorted(set(expected_hashes) - set(hashes))
            extra = sorted(set(hashes) - set(expected_hashes))
            bad = sorted(k for k in expected_hashes if k in hashes and hashes[k] != expected_hashes[k])
            if missing or extra or bad:
                raise WeightsMismatchError(f"weights: missing {missing[:5]}, unexpected {extra[:5]}, "
                                           f"sha256 mismatch {bad[:5]}")
        inst = self._claim_instance()
        digest = digest_of_hashes(hashes)
        with inst.lock:
            if inst.digest != digest:  # an instance already holding these exact weights is reused as is
                inst.digest = None
                self._update(inst, state)
                inst.digest = digest
        return self._wrap(inst, version, hashes, t0)

    @staticmethod
    def _wrap(inst: _Instance, version: str, hashes: dict, t0: float) -> LoadedModel:
        # its own frame: the instance is free once the slots drop the LoadedModel, so no
        # longer-lived frame (vLLM's startup keeps one of _claim_instance's) may hold it
        lm = LoadedModel(version=version, model=inst, hashes=hashes, weights_digest=digest_of_hashes(hashes),
                         loaded_at=now_ms(), load_ms=(time.perf_counter() - t0) * 1000)
        inst.holder = weakref.ref(lm)
        return lm

    def _update(self, inst: _Instance, state: dict) -> None:
        """In-place update of ``inst`` (worker extension: reload_weights + D13 re-pack), then
        a prefix-cache reset. The state travels as a safetensors file in the temp dir
        (``$FLYWHEEL_VLLM_XFER_DIR`` if set), removed afterwards."""
        from safetensors.torch import save_file

        tensors = {k: v.detach().contiguous() for k, v in state.items() if not (self.tied and k == "lm_head.weight")}
        with tempfile.TemporaryDirectory(prefix="fw-vllm-weights-", dir=os.environ.get("FLYWHEEL_VLLM_XFER_DIR")) as d:
            path = str(Path(d) / "state.safetensors")
            save_file(tensors, path)
            del tensors
            res = self._call(self._update_async(inst, path))
        for r in res.values():
            self.reload_repairs[r] += 1

    async def _update_async(self, inst: _Instance, path: str) -> dict:
        out = await inst.llm.collective_rpc("flywheel_update_weights", args=(path, self.tied))
        await inst.llm.reset_prefix_cache()  # never serve a cached prefix computed by other weights
        return out[0] if out else {}

    # ------------------------------------------------------------------ requests
    def submit(self, req: GenRequest) -> concurrent.futures.Future:
        """Start ``req`` on its instance; see :meth:`Engine.submit`."""
        if self._closed:
            raise RuntimeError("engine is closed")
        check_request(req)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if len(self._inflight) >= self.max_queue + self.max_batch * len(self._instances or [0]):
                raise ServingValidationError("request", "queue", f"server queue is full ({self.max_queue})",
                                             status=429, code="queue_full")
            if req.request_id in self._inflight:
                raise ServingValidationError("request_id", req.request_id, "is already running on this engine")
            self._inflight[req.request_id] = (req, fut)
        asyncio.run_coroutine_threadsafe(self._serve(req, fut, time.perf_counter()), self._loop)
        return fut

    def abort(self, request: "str | GenRequest") -> None:
        rid = request if isinstance(request, str) else request.request_id
        with self._lock:
            got = self._inflight.get(rid)
        if got is None:
            return
        req = got[0]
        req.cancelled.set()
        if not self._loop.is_closed() and (self._thread is not None or self._loop.is_running()):
            asyncio.run_coroutine_threadsafe(req.model.model.llm.abort(rid), self._loop)

    def queue_depth(self) -> int:
        with self._lock:
            return len(self._inflight) - len(self._started)

    def num_running(self) -> int:
        with self._lock:
            return len(self._started)

    def pause(self) -> None:
        self._loop.call_soon_threadsafe(self._unpaused.clear)

    def resume(self) -> None:
        self._loop.call_soon_threadsafe(self._unpaused.set)

    def check_health(self) -> dict:
        if self._closed or self._loop.is_closed() or (self._thread is not None and not self._thread.is_alive()):
            raise RuntimeError("engine is closed")
        for inst in list(self._instances):
            if inst.llm.errored:
                raise RuntimeError(f"vLLM engine core died: {inst.llm.dead_error}")
        return {"engine": "vllm", "queue_depth": self.queue_depth(), "running": self.num_running(),
                "paused": not self._unpaused.is_set(), "requests_run": self.requests_run,
                "instances": len(self._instances), "routes_missing": dict(self.routes_missing),
                "reload_repairs": dict(self.reload_repairs)}

    def close(self) -> None:
        """Abort what runs, shut the vLLM instances down, stop the loop."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            rids = list(self._inflight)
        for rid in rids:
            self.abort(rid)
        for inst in self._instances:
            try:
                inst.llm.shutdown()
            except Exception:  # noqa: BLE001 - best effort at exit
                log.exception("vLLM shutdown failed")
        if self._thread is not None:  # its own loop: stop it; a given loop is its owner's to stop
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        with self._lock:
            left = list(self._inflight.values())
        for _req, fut in left:
            if not fut.done():
                fut.set_exception(RuntimeError("engine closed"))

    def parse_tool_calls(self, text: str, tools: list[dict]) -> tuple[str | None, list[dict]]:
        """:func:`parse_tool_calls` with this engine's tokenizer and parser."""
        return parse_tool_calls(self.tokenizer, text, {"model": "m", "messages": [{"role": "user", "content": ""}],
                                                      "tools": tools, "tool_choice": "auto"},
                                parser=self.tool_call_parser)

    # ------------------------------------------------------------------ one request
    def _sampling(self, req: GenRequest):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        sp = req.sampling
        structured = None
        if req.structured is not None:
            try:
                structured = StructuredOutputsParams(**req.structured)
            except (TypeError, ValueError) as exc:
                raise ServingValidationError("response_format", req.structured, str(exc)) from None
        return SamplingParams(
            n=1, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k if sp.top_k > 0 else 0,
            seed=sp.seed, max_tokens=sp.max_tokens, logprobs=max(req.top_logprobs, 0), flat_logprobs=True,
            stop_token_ids=list(req.stop_token_ids), include_stop_str_in_output=True,
            detokenize=structured is not None, skip_special_tokens=False, output_kind=RequestOutputKind.DELTA,
            structured_outputs=structured)

    async def _serve(self, req: GenRequest, fut: concurrent.futures.Future, t_submit: float) -> None:
        """Run ``req`` as one ``AsyncLLM.generate`` stream; resolve ``fut`` with its result."""
        if not fut.set_running_or_notify_cancel():
            self._forget(req.request_id)
            return
        try:
            res = await self._stream(req, t_submit)
        except BaseException as exc:  # noqa: BLE001 - the request's error goes to its caller
            fut.set_exception(exc if isinstance(exc, Exception) else RuntimeError(repr(exc)))
        else:
            fut.set_result(res)
        finally:
            self._forget(req.request_id)

    def _forget(self, rid: str) -> None:
        with self._lock:
            self._inflight.pop(rid, None)
            self._started.discard(rid)

    async def _stream(self, req: GenRequest, t_submit: float) -> GenResult:
        await self._unpaused.wait()
        inst: _Instance = req.model.model
        toks: list[int] = []
        lps: list[float] = []
        tops: list = []
        finish, ttft, routes_arr = None, 0.0, None
        self.requests_run += 1
        if not req.cancelled.is_set():
            async for o in inst.llm.generate({"prompt_token_ids": list(req.prompt_token_ids)}, self._sampling(req),
                                             request_id=req.request_id):
                c = o.outputs[0]
                new, new_lps, new_tops = self._delta(req, c)
                cut = self._stop_cut(req, toks, new)
                if cut is not None:
                    new, new_lps, new_tops = new[:cut], new_lps[:cut], new_tops[:cut]
                if new:
                    if not toks:
                        ttft = (time.perf_counter() - t_submit) * 1000
                        with self._lock:
                            self._started.add(req.request_id)
                    toks += new
                    lps += new_lps
                    tops += new_tops
                    req.emit_step(StepOutput(request_id=req.request_id, token_ids=new, logprobs=new_lps,
                                             top_logprobs=new_tops))
                if getattr(c, "routed_experts", None) is not None:
                    routes_arr = c.routed_experts
                if cut is not None:
                    finish = "stop"
                    await inst.llm.abort(req.request_id)
                    break
                if o.finished:
                    finish = c.finish_reason
                    break
        finish = "abort" if finish is None or finish == "abort" else ("length" if finish == "length" else "stop")
        t_end = time.perf_counter()
        return GenResult(completion_token_ids=toks, behavior_logprobs=lps, top_logprobs=tops,
                         expert_routes=self._routes(routes_arr, len(req.prompt_token_ids), len(toks), finish),
                         finish_reason=finish, ttft_ms=ttft, latency_ms=(t_end - t_submit) * 1000,
                         version=req.model.version, batch_size=1)

    @staticmethod
    def _delta(req: GenRequest, c) -> tuple[list[int], list[float], list]:
        """New tokens of one DELTA output, their raw logprobs and (if asked) top logprobs.

        ``c.logprobs`` is vLLM's ``FlatLogprobs`` (``flat_logprobs=True``: per position a range
        of parallel ``token_ids``/``logprobs``/``ranks`` lists, the sampled token first, then
        the top ``k`` by rank), read in place; a list of ``{token_id: Logprob}`` dicts (vLLM's
        other layout) is read too. A token vLLM gave no logprob for gets NaN."""
        new = list(c.token_ids)
        lp = c.logprobs
        k = req.top_logprobs
        if lp is None:
            return new, [float("nan")] * len(new), [[] for _ in new] if k else []
        if not hasattr(lp, "start_indices"):  # list of dicts
            return new, *VLLMEngine._delta_dicts(k, new, lp)
        starts, ends, ids, vals, ranks = lp.start_indices, lp.end_indices, lp.token_ids, lp.logprobs, lp.ranks
        lps, tops = [], []
        for j, t in enumerate(new):
            a, b = (starts[j], ends[j]) if j < len(starts) else (0, 0)
            # t's entry; when t is both sampled and in the top k, the last, as a dict keeps
            at = [m for m in range(a, b) if ids[m] == t]
            lps.append(float(vals[at[-1]]) if at else float("nan"))
            if k:
                best = {ids[m]: (vals[m], ranks[m]) for m in range(a, b)}
                ranked = sorted(((tid, v) for tid, v in best.items() if v[1] is not None and v[1] <= k),
                                key=lambda kv: kv[1][1])
                tops.append([(int(tid), float(v[0])) for tid, v in ranked[:k]])
        return new, lps, tops

    @staticmethod
    def _delta_dicts(k: int, new: list[int], logprobs) -> tuple[list[float], list]:
        """:meth:`_delta` for logprobs as a list of ``{token_id: Logprob}`` per position."""
        lps, tops = [], []
        for j, t in enumerate(new):
            d = logprobs[j] if j < len(logprobs) else {}
            lps.append(float(d[t].logprob) if t in d else float("nan"))
            if k:
                ranked = sorted(((tid, v) for tid, v in d.items() if v.rank is not None and v.rank <= k),
                                key=lambda kv: kv[1].rank)
                tops.append([(int(tid), float(v.logprob)) for tid, v in ranked[:k]])
        return lps, tops

    @staticmethod
    def _stop_cut(req: GenRequest, toks: list[int], new: list[int]) -> int | None:
        """How many of ``new`` to keep when a stop string ends the request in them, else None."""
        if req.stop_check is None:
            return None
        for j in range(len(new)):
            if req.stop_check(toks + new[:j + 1]):
                return j + 1
        return None

    def _routes(self, arr, prompt_len: int, completion_len: int, finish: str):
        """``(prompt + completion - 1, layers, top_k)`` routes, or None with a counted reason."""
        if not self.moe_layers:
            return None  # dense model: no routes, nothing missing
        if arr is None:
            reason = (self._routes_off_reason if not self.return_routes else
                      f"not returned by vLLM ({finish})")
            self.routes_missing[reason or "not returned by vLLM"] += 1
            return None
        arr = np.asarray(arr)
        want = prompt_len + completion_len - 1
        if arr.ndim != 3 or arr.shape[1:] != (self.moe_layers, self.top_k) or arr.shape[0] < want:
            self.routes_missing[f"unexpected shape {tuple(arr.shape)}"] += 1
            return None
        return arr[:want].astype(self.route_dtype)


def parse_tool_calls(tokenizer, text: str, request: dict, parser: str = "hermes") -> tuple[str | None, list[dict]]:
    """Tool calls in a completion's ``text``, parsed by vLLM's tool parser ``parser``
    (``vllm.tool_parsers.ToolParserManager``: the same parsers as ``vllm serve
    --tool-call-parser``).

    Args:
        tokenizer: the model's tokenizer.
        text: the generated text.
        request: the OpenAI chat request body (its ``tools`` and ``tool_choice``).
        parser: a registered parser name (``hermes``, ``mistral``, ``llama3_json``, ...).

    Returns:
        ``(content, tool_calls)``: the text outside tool calls (None when there is none) and
        OpenAI ``tool_calls`` dicts (``{"id", "type": "function", "function": {"name",
        "arguments"}}``).

    Raises:
        ServingValidationError: unknown parser (names the registered ones).
    """
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers import ToolParserManager

    try:
        cls = ToolParserManager.get_tool_parser(parser)
    except KeyError:
        raise ServingValidationError("tool_call_parser", parser, "not a vLLM tool parser") from None
    info = cls(tokenizer).extract_tool_calls(text, ChatCompletionRequest(**request))
    calls = [c.model_dump() for c in info.tool_calls] if info.tools_called else []
    return (info.content if calls else text), calls
