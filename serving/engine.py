"""The torch engine (:class:`TorchEngine`): the :class:`serving.engine_base.Engine` protocol on
HF causal LMs, MoE or dense, CPU or GPU, with continuous batching, KV cache, behavior logprobs
and expert-route capture. Pods and programs import it from here.

This file is the facade; the parts live in :mod:`serving.torch_engine`: model loading
(:mod:`~serving.torch_engine.loader`), the scheduler (:mod:`~serving.torch_engine.scheduler`),
the running batch (:mod:`~serving.torch_engine.batch`) and the sampler
(:mod:`~serving.torch_engine.sampler`). :class:`serving.engine_vllm.VLLMEngine` implements the
same protocol; both share :mod:`serving.engine_base` and import nothing from each other.

The engine knows nothing about HTTP, Kafka or the model store: it turns token ids into
token ids plus the numbers the learner needs (behavior logprobs under the raw
distribution, expert routes in vLLM's layout), on whichever :class:`LoadedModel` a request
names.

Numerics follow ``schemas.modelspec`` (DESIGN §4): fp32, eager attention and experts, left
padding with ``position_ids = cumsum(mask) - 1``, so the learner's recompute lines up.
"""

from __future__ import annotations

import concurrent.futures
import json
from pathlib import Path
from typing import Any

from schemas.manifest import BASE_VERSION
from schemas.modelspec import checkpoint_dtype, load_tokenizer
from serving.config import EngineConfig, split_settings
from serving.engine_base import CHAT_STOP, Engine, LoadedModel, check_request
from serving.params import GenRequest, ServingValidationError
from serving.torch_engine.loader import ModelLoader, context_limit
from serving.torch_engine.scheduler import Scheduler

__all__ = ["LoadedModel", "TorchEngine"]


class TorchEngine(Engine):
    """Torch engine (CPU or GPU) for HF causal LMs, MoE or dense, with iteration-level
    (continuous) batching.

    A worker thread (:class:`serving.torch_engine.scheduler.Scheduler`) keeps one
    :class:`serving.torch_engine.batch.RunningBatch` per LoadedModel being served. Every
    iteration it admits waiting requests (FIFO, up to ``max_batch`` running in all) into the
    batch of their weights (prefilled together, left-padded, in the batch's next decode
    forward when ``fused_join_pad_tokens`` allows, else by a forward of their own, then merged
    into the running KV cache), and runs one step of every running batch: sample one token per
    row from the raw logits (temperature, top_p, top_k, seed via a per-request CPU
    ``torch.Generator``: the same tokens alone or in any batch;
    :mod:`serving.torch_engine.sampler`), then one KV-cached decode forward. Finished rows
    leave the batch at once, so a new request waits at most one step to join, never for the
    longest request in the batch. Behavior logprobs are the raw ``log_softmax`` of the logits
    (temperature 1, unfiltered); expert routes ``(P + C - 1, L, k)`` are copied to the host
    after every forward. Weights are loaded by :class:`serving.torch_engine.loader.ModelLoader`.

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
            runs on those weights, and takes nobody new until its last row ends; the serving
            benchmark's baseline).
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
            ``max_waiting_tokens`` decode steps after the last join. 0 (default): any waiting
            request joins at the next step. The rule and both names are text-generation-inference's router
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
        self.max_positions = None
        self.loader = ModelLoader(self.model_dir, self.dtype, self.device, self.prefix_caching)
        self.sched = Scheduler(self, config)
        self.sched.start()

    # ------------------------------------------------------------------ weights
    def load_base(self, version: str = BASE_VERSION) -> LoadedModel:
        """The checkpoint at ``model_dir`` as served weights (hashes computed, not checked)."""
        return self._served(self.loader.load_base(version))

    def load_weights(self, state: dict, version: str, expected_hashes: dict[str, str] | None = None
                     ) -> LoadedModel:
        """Fresh model from ``model_dir``'s config holding ``state``'s tensors (no copy: see
        :func:`schemas.modelspec.build_model`; the caller hands ``state`` over), then verified.

        Args:
            state: ``{name: Tensor}`` (a full state dict; tied aliases may be omitted).
            version: version id it is served as.
            expected_hashes: ``{name: sha256}`` from the version manifest; every name must
                be present in the model and match, and every other model tensor must alias
                (share storage with) a verified one.

        Raises:
            WeightsMismatchError: missing/unexpected tensors or a hash differs.
        """
        return self._served(self.loader.load_state(state, version, expected_hashes))

    def _served(self, lm: LoadedModel) -> LoadedModel:
        """``lm``, with the engine's context limit (``max_positions``) taken from its config."""
        self.max_positions = context_limit(lm.model.config)
        return lm

    # ------------------------------------------------------------------ requests
    def submit(self, req: GenRequest) -> concurrent.futures.Future:
        """Queue ``req`` for the worker; see :meth:`Engine.submit`. The torch engine refuses
        ``req.structured`` (structured outputs are a vLLM engine feature)."""
        if self.sched.closed:
            raise RuntimeError("engine is closed")
        check_request(req)
        if req.structured is not None:
            raise ServingValidationError("response_format", req.structured, "structured outputs need the vLLM "
                                         "engine (flywheel serve --engine vllm); this pod runs the torch engine")
        return self.sched.add(req)

    def abort(self, request: "str | GenRequest") -> None:
        self.sched.abort(request)

    def queue_depth(self) -> int:
        return self.sched.queue_depth()

    def num_running(self) -> int:
        return self.sched.num_running()

    def pause(self) -> None:
        self.sched.pause()

    def resume(self) -> None:
        self.sched.resume()

    def check_health(self) -> dict:
        if self.sched.closed or not self.sched.thread.is_alive():
            raise RuntimeError("engine worker is not running")
        return {"engine": "torch", "scheduler": self.scheduler, "queue_depth": self.queue_depth(),
                "running": self.num_running(), "paused": self.sched.paused, "batches_run": self.batches_run,
                "fused_joins": self.fused_joins,
                "steps_run": self.steps_run}

    def close(self) -> None:
        self.sched.close()

    # ------------------------------------------------------------------ counters
    @property
    def batches_run(self) -> int:
        """Prefill groups admitted."""
        return self.sched.batches_run

    @property
    def fused_joins(self) -> int:
        """Prefill groups that rode in a decode forward."""
        return self.sched.fused_joins

    @property
    def steps_run(self) -> int:
        """Decode steps (one per running batch per iteration)."""
        return self.sched.steps_run

    @property
    def last_batch_size(self) -> int:
        """Rows running after the worker's last iteration."""
        return self.sched.last_batch_size
