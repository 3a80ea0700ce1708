"""The serving pod's settings, each declared once (D53): default, type, bounds, unit, help.

Three models, one per concern:

* :class:`ServeConfig`: the pod as a process: where it listens, what it serves, its keys,
  the HTTP API's routing name, eval share and CORS origins, fleet membership.
* :class:`EngineConfig`: the batch every engine has (``max_batch``, ``max_queue``) and the
  torch engine's device and scheduler knobs (:class:`serving.engine.TorchEngine`).
* :class:`VLLMConfig`: the vLLM engine's options (:class:`serving.engine_vllm.VLLMEngine`).

``flywheel serve``'s options are generated from them (:func:`schemas.options.config_options`),
so a flag, a ``[serve]`` key of ``flywheel.toml``, a ``FLYWHEEL_SERVE__<OPTION>`` variable and a
program that builds the model meet the same default. The engines take these models (or keyword
settings applied to them by name, :func:`apply`); no function in ``serving/`` restates a default.

This module imports nothing heavy (pydantic only): the CLI imports it at start.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator

from schemas.manifest import BASE_VERSION

ENGINES = ("torch", "vllm")
SCHEDULERS = ("continuous", "static")
DEFAULT_POD = "pod-0"  # the pod name when neither --pod nor $HOSTNAME gives one
MAX_POD_BYTES = 200  # a pod name is also its journal's file name (<pod>.journal, at most 255 bytes)
MAX_THREADS = 1024  # torch intra-op threads (set_num_threads takes a C int)


class SettingError(ValueError):
    """A setting that cannot work in this pod (a flag for the other engine, a port in use, a
    missing secret). ``flag`` names what to change (``--port``, ``FLYWHEEL_ADMIN_TOKEN``),
    ``reason`` says why; ``flywheel serve`` shows it as a usage error (exit 2)."""

    def __init__(self, flag: str, reason: str):
        super().__init__(f"{flag}: {reason}")
        self.flag = flag
        self.reason = reason


def check_pod_name(v: str) -> str:
    """A pod name names the pod in every event and its journal file ``<pod>.journal``: 1 to
    :data:`MAX_POD_BYTES` bytes of UTF-8, no ``/``, no NUL, not ``.`` or ``..``.

    Raises:
        ValueError: saying which rule, with the name (cut to 80 characters).
    """
    try:
        n = len(v.encode())
    except UnicodeEncodeError:  # a lone surrogate (bytes that were not UTF-8 on the command line)
        n = -1
    if n < 1 or n > MAX_POD_BYTES or "/" in v or "\x00" in v or v in (".", ".."):
        raise ValueError(f"must be 1-{MAX_POD_BYTES} bytes of UTF-8 text without '/' or NUL (it names the pod in "
                         f"every event and its journal file <pod>.journal), got {v[:80]!r}")
    return v


def _existing_file(v: Optional[Path]) -> Optional[Path]:
    """The checks click's ``Path(exists=True, dir_okay=False, readable=True)`` made, with its words."""
    import os

    if v is None:
        return v
    if not v.exists():
        raise ValueError(f"File {str(v)!r} does not exist.")
    if v.is_dir():
        raise ValueError(f"File {str(v)!r} is a directory.")
    if not os.access(v, os.R_OK):
        raise ValueError(f"File {str(v)!r} is not readable.")
    return v


class ServeConfig(BaseModel):
    """``flywheel serve``: one pod as a process (listen, store, keys, API, fleet)."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", description="Interface to listen on.")
    port: int = Field(8000, ge=1, le=65535, description="TCP port (1-65535).")
    store: Optional[str] = Field(None, description="Model store: a dir or an fsspec URL such as s3://bucket/fw "
                                                   "(default: $FLYWHEEL_STORE, else $FLYWHEEL_HOME/store).")
    version: Optional[str] = Field(None, description="Version to serve as stable (default: the store's stable "
                                                     f"record, else {BASE_VERSION}); a pod started on a version moves "
                                                     "to the fleet's desired-state record once one is written.")
    pod: Optional[str] = Field(None, description=f"Pod name in every event (default: $HOSTNAME, else {DEFAULT_POD}).")
    engine: str = Field("torch", description="Inference engine: torch, or vllm (needs vLLM installed in this "
                                             "interpreter; see DESIGN §3).")
    model_dir: Optional[Path] = Field(None, description=f"Serve a plain HF checkpoint dir as {BASE_VERSION} "
                                                        "instead of a model store.")
    api_keys_file: Optional[Path] = Field(None, description="Bearer keys for /v1/*, one per line (also env "
                                                            "FLYWHEEL_API_KEYS, comma-separated).")
    feedback_keys_file: Optional[Path] = Field(
        None, description="Feedback-only bearer keys (a browser may hold one: POST /v1/feedback and "
                          "/v1/feedback/batch, nothing else), one per line (also env FLYWHEEL_FEEDBACK_KEYS, "
                          "comma-separated).")
    served_model_name: str = Field("flywheel", description="The `model` name that routes by the sticky "
                                                           "stable/candidate split (a version id pins that "
                                                           "version; other names get 404).")
    eval_share: float = Field(0.0, description="Share of prompts (stable hash of the token ids) whose completions "
                                               "are in the eval split, never trained on; 0..1 (a request tag "
                                               "metadata.flywheel_split or X-Flywheel-Split wins).",
                              json_schema_extra={"envvar": "FLYWHEEL_EVAL_SHARE"})
    cors_origin: Optional[list[str]] = Field(None, description="Browser origin allowed to call the API "
                                                               "(repeatable; * for any; also env "
                                                               "FLYWHEEL_CORS_ORIGINS, comma-separated).")
    admin_port: Optional[int] = Field(
        None, ge=1, le=65535, description="Serve /admin/* and /metrics on this port only, and the product API "
                                          "(/v1/*) only on --port, so a Service that exposes --port cannot reach "
                                          "/admin (/health and /healthz on both). Default: every path on --port.")
    fleet: bool = Field(False, description="This pod is one of several behind one Service: it refuses to start "
                                           "without the fleet's user salt (FLYWHEEL_USER_SALT or "
                                           "FLYWHEEL_USER_SALT_FILE, >= 16 characters), so every pod gives a "
                                           "user the same user_hash and canary arm. Implied by a --host "
                                           "reachable from other machines.",
                        json_schema_extra={"flags": "--fleet", "envvar": "FLYWHEEL_FLEET"})
    desired_poll_s: float = Field(2.0, gt=0, le=3600, description="How often this pod reads the fleet's desired-state "
                                  "record (fleet/desired.json in the store) and converges to it itself, as a "
                                  "kubelet watches the API server: an operator's rollback reaches the pod with no "
                                  "controller running.",
                                  json_schema_extra={"unit": "s", "flags": "--desired-poll",
                                                     "envvar": "FLYWHEEL_DESIRED_POLL_S"})
    derive_regenerate: bool = Field(
        True, description="Emit a `regenerate` feedback event (value 1, metadata source=serving) for a user's "
                          "completion when the same user sends the same chat messages again within "
                          "--signal-window-s (serving/signals.py). Only requests that name a user.",
        json_schema_extra={"flags": "--derive-regenerate/--no-derive-regenerate"})
    derive_followup: bool = Field(
        True, description="Emit a `followup` feedback event (+1 satisfied, -1 dissatisfied, by the rules in "
                          "serving/signals.py) for a completion whose reply comes back in the same user's next "
                          "chat request within --signal-window-s. Only requests that name a user.",
        json_schema_extra={"flags": "--derive-followup/--no-derive-followup"})
    signal_window_s: float = Field(600.0, gt=0, description="How long after a completion's request a regenerate "
                                                            "or follow-up by the same user still counts for it.",
                                   json_schema_extra={"unit": "s"})
    signal_memory: int = Field(50_000, ge=1, description="Completions this pod remembers for regenerate and "
                                                         "follow-up signals at most (least recently used out "
                                                         "first; under 1 KB each).",
                               json_schema_extra={"unit": "completions"})

    @field_validator("signal_window_s", "desired_poll_s")
    @classmethod
    def _window(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError(f"must be a finite number of seconds > 0, got {v!r}")
        return v

    @field_validator("engine")
    @classmethod
    def _engine(cls, v: str) -> str:
        if v not in ENGINES:
            raise ValueError(f"must be torch or vllm, got {v!r}")
        return v

    @field_validator("eval_share")
    @classmethod
    def _eval_share(cls, v: float) -> float:
        from schemas.split import check_share

        try:
            return check_share(v)
        except ValueError as exc:
            raise ValueError(str(exc).split(": ", 1)[-1]) from None

    @field_validator("api_keys_file", "feedback_keys_file")
    @classmethod
    def _keys_file(cls, v: Optional[Path]) -> Optional[Path]:
        return _existing_file(v)

    @field_validator("pod")
    @classmethod
    def _pod(cls, v: Optional[str]) -> Optional[str]:
        return v if v is None else check_pod_name(v)

    def pod_name(self) -> str:
        """``pod``, else ``$HOSTNAME`` (a Kubernetes pod's name), else ``pod-0``."""
        import os

        return self.pod if self.pod is not None else (os.environ.get("HOSTNAME") or DEFAULT_POD)


def _torch_only(reason: str, **extra: Any) -> dict:
    return {"torch_only": reason, **extra}


class EngineConfig(BaseModel):
    """The engine's batch (both engines) and the torch engine's device and scheduler
    (:class:`serving.engine.TorchEngine` documents what each knob does)."""

    model_config = ConfigDict(extra="forbid")

    max_batch: int = Field(8, ge=1, description="Requests per engine batch at most (>= 1); vLLM's max_num_seqs.")
    max_queue: int = Field(256, ge=1, description="Requests waiting beyond the running ones at most; beyond it a "
                                                  "request gets HTTP 429.", json_schema_extra={"cli": False})
    threads: Optional[int] = Field(None, ge=1, le=MAX_THREADS, description=f"torch intra-op threads (1-{MAX_THREADS}).")
    device: str = Field("cpu", description="Torch engine: device of the weights (cpu, cuda, cuda:N).",
                        json_schema_extra=_torch_only("vLLM picks its devices; see --tensor-parallel-size"))
    scheduler: str = Field("continuous", description="Torch engine: continuous (requests join and leave the "
                                                     "running batch at every step) or static (benchmarks).",
                           json_schema_extra=_torch_only("vLLM schedules continuously", cli=False))
    aligned_logprobs: bool = Field(False, description="Torch engine: log behavior logprobs and routes from one "
                                                      "batch-1 scoring forward in the learner's layout, so the "
                                                      "learner's recompute matches them exactly (costs one "
                                                      "prefill-sized forward per completion).",
                                   json_schema_extra=_torch_only("vLLM on GPU: VLLM_BATCH_INVARIANT=1",
                                                                 flags="--aligned-logprobs"))
    prefix_caching: bool = Field(False, description="Torch engine: keep the KV cache of prompt prefixes that "
                                                    "requests share (the chat template's system turn) and prefill "
                                                    "only the rest.",
                                 json_schema_extra=_torch_only("vLLM caches prefixes itself",
                                                               flags="--prefix-caching/--no-prefix-caching"))
    waiting_served_ratio: float = Field(
        0.0, ge=0.0, description="Torch engine: waiting requests join the running batch once floor(ratio x "
                                 "running) of them (at least 1) can be prefilled together, or after "
                                 "--max-waiting-tokens decode steps; 0 = join at every step. Fewer prefill "
                                 "forwards, a longer time to first token (no throughput gain measured on CPU, "
                                 "D28). text-generation-inference's rule; its default is 0.3.",
        json_schema_extra=_torch_only("vLLM schedules prefills into its steps"))
    max_waiting_tokens: int = Field(20, ge=1, description="Torch engine: decode steps after which waiting requests "
                                                          "join however few (>= 1).",
                                    json_schema_extra=_torch_only("vLLM schedules prefills into its steps",
                                                                  unit="steps"))
    fused_join_pad_tokens: int = Field(
        64, ge=0, description="Torch engine: requests joining a running batch are prefilled in the same forward as "
                              "its decode step when that pads the running rows by at most this many tokens "
                              "(running x (longest new prompt - 1)); else by a forward of their own. Raise it on "
                              "a GPU, where padding is cheap and a forward's fixed cost is not.",
        json_schema_extra=_torch_only("vLLM schedules prefills into its steps", unit="tokens"))

    @field_validator("scheduler")
    @classmethod
    def _scheduler(cls, v: str) -> str:
        if v not in SCHEDULERS:
            raise ValueError(f"must be 'continuous' or 'static', got {v!r}")
        return v

    @field_validator("waiting_served_ratio")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError(f"must be a finite number >= 0, got {v!r}")
        return v

    def torch_only_changed(self) -> list[tuple[str, str]]:
        """``[(field, why not vLLM)]`` for each torch-only setting that differs from its default."""
        out = []
        for name, info in type(self).model_fields.items():
            why = (info.json_schema_extra or {}).get("torch_only")
            if why and getattr(self, name) != info.default:
                out.append((name, why))
        return out


class VLLMConfig(BaseModel):
    """The vLLM engine's options (:class:`serving.engine_vllm.VLLMEngine`; vLLM's own names)."""

    model_config = ConfigDict(extra="forbid")

    max_model_len: Optional[int] = Field(None, ge=1, description="vLLM engine: context length (default the "
                                                                 "model's).", json_schema_extra={"unit": "tokens"})
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM engine: GPUs per instance.")
    dtype: str = Field("float32", description="vLLM engine: weight dtype (float32, bfloat16, float16, auto).")
    gpu_memory_utilization: Optional[float] = Field(
        None, ge=0.01, le=1.0, description="vLLM engine: share of GPU memory per instance (CPU build: of host "
                                           "memory for the KV cache); default 0.9 / max_instances on GPU, 0.05 "
                                           "on CPU.")
    quantization: Optional[str] = Field(None, description="vLLM engine: quantization method (e.g. fp8).")
    tool_call_parser: str = Field("hermes", description="vLLM engine: how chat requests with tools are parsed into "
                                                        "tool calls, as `vllm serve --tool-call-parser` (hermes, "
                                                        "llama3_json, mistral, pythonic, ...).")
    max_instances: int = Field(3, ge=1, description="AsyncLLM instances at most (stable + candidate + the previous "
                                                    "stable kept resident for instant rollback).",
                               json_schema_extra={"cli": False})
    return_routes: bool = Field(True, description="Ask vLLM for routed experts (off, with a counted reason, when "
                                                  "Triton is missing: the CPU build).",
                                json_schema_extra={"cli": False})

    def changed(self) -> list[str]:
        """The command-line options that differ from their defaults (a torch pod refuses them)."""
        return [n for n, info in type(self).model_fields.items()
                if (info.json_schema_extra or {}).get("cli", True) is not False and getattr(self, n) != info.default]


def apply(config: BaseModel, settings: dict[str, Any]) -> BaseModel:
    """``config`` with ``settings`` (field name -> value) applied and validated again.

    Raises:
        pydantic.ValidationError (a ValueError): a value the model refuses, naming the field.
    """
    if not settings:
        return config
    return type(config).model_validate({**config.model_dump(), **settings})


def split_settings(settings: dict[str, Any], *configs: BaseModel, where: str) -> tuple[BaseModel, ...]:
    """Each of ``configs`` with the ``settings`` that name one of its fields applied (:func:`apply`).

    Raises:
        TypeError: a setting that no model has (``where`` names the caller).
        pydantic.ValidationError: a value a model refuses.
    """
    rest = dict(settings)
    out = []
    for cfg in configs:
        mine = {k: rest.pop(k) for k in list(rest) if k in type(cfg).model_fields}
        out.append(apply(cfg, mine))
    if rest:
        raise TypeError(f"{where}: unexpected setting(s) {', '.join(sorted(rest))}")
    return tuple(out)
