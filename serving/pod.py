"""One serving pod, assembled: engine + two weight slots + event log + HTTP API (+ uvicorn).

:func:`build_pod` builds the parts over a model store (tests and benchmarks call it directly);
:func:`run_pod` is ``flywheel serve`` without the command line: it checks the settings
(:func:`check_serve`, each refusal a :class:`serving.config.SettingError` naming the flag),
opens the store, builds the pod and serves it until SIGTERM. Settings come from the models of
:mod:`serving.config`, where each default is declared.

Heavy imports (torch, uvicorn, the engines) happen inside the functions: the CLI imports this
module at start.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from schemas.manifest import BASE_VERSION
from serving.config import DEFAULT_POD, EngineConfig, ServeConfig, SettingError, VLLMConfig, split_settings

log = logging.getLogger("flywheel.serving")


def desired_state(store):
    """The fleet's desired state (``modelstore.desired.DesiredState``) for a model store, or None
    for a one-version :class:`CheckpointStore` or an unreadable record (logged)."""
    if not hasattr(store, "stable_record"):
        return None
    from modelstore.desired import FleetRecord

    try:
        return FleetRecord(store).read()
    except (OSError, ValueError) as exc:
        log.warning("fleet desired state unreadable (%s): serving the store's stable record", exc)
        return None


def default_version(store) -> str:
    """The version a pod serves at start: the fleet's desired stable (``modelstore.desired``; the
    controller and every operator action move it, so a restart never undoes them), else the
    store's stable record; the base version (``schemas.manifest.BASE_VERSION``) when the store
    has none (or is a one-version :class:`CheckpointStore`)."""
    d = desired_state(store)
    if d is not None and d.stable:
        return d.stable
    stable = getattr(store, "stable", None)
    v = stable() if callable(stable) else None
    return v or BASE_VERSION


def pod_target(d):
    """The :class:`schemas.pod_target.PodTarget` of a desired state (``modelstore.desired.DesiredState``),
    or None when it names no stable version."""
    from schemas.pod_target import PodTarget

    if d is None or not d.stable:
        return None
    return PodTarget(generation=d.generation, stable=d.stable, candidate=d.candidate, weight=float(d.weight),
                     reload_after_ms=int(d.reload_after_ms))


def record_target(store):
    """The fleet record's target now (:func:`pod_target` of ``fleet/desired.json``), or None.

    Raises:
        modelstore.desired.RecordUnreadable: the record cannot be read (a ValueError).
        OSError: the store cannot be read.
    """
    from modelstore.desired import FleetRecord

    return pod_target(FleetRecord(store).read())


def start_desired_candidate(slots, store):
    """At start, before the pod reports ready: converge the slots (stable already loaded) to the
    fleet's desired state, so a pod (re)started mid-canary serves the same split as the others.
    Returns the pod's :class:`serving.converge.PodReconciler`; a candidate that fails to load is
    logged and the pod serves generation 0 until its watch (or the controller) gets it there."""
    from serving.converge import PodReconciler

    d = desired_state(store)
    t = pod_target(d)
    rec = PodReconciler(slots, read_record=(lambda: record_target(store)) if hasattr(store, "stable_record") else None)
    if t is None or t.stable != slots.stable.version:
        return rec
    try:
        rec.apply(t, "start")
        if t.candidate:
            log.info("fleet desired state generation %d: candidate %s at %.0f %%", t.generation, t.candidate,
                     t.weight * 100)
    except Exception as exc:  # noqa: BLE001 - serve stable; the watch and the controller retry the candidate
        log.warning("desired candidate %s not loaded at start: %s", t.candidate, exc)
    return rec


class DesiredWatch:
    """The pod's own watch of the fleet's desired-state record (a kubelet watching the API
    server): every ``poll_s`` seconds it reads ``fleet/desired.json`` from the store and
    converges through :meth:`serving.converge.PodReconciler.apply`, the function
    ``PUT /admin/desired`` runs, at each new generation. A change of the record (an operator's
    rollback, the controller's step) reaches the pod whether or not a controller runs. A pod
    changed by hand through the imperative admin routes (a debugging or evaluation session,
    ``flywheel demo``'s fixed eval) stays so until the next generation, or until the
    controller's next pass, which PUTs the record's target to a pod whose slots drifted. An
    unreadable record is one WARNING per reason (the pod keeps serving); a target that failed
    to load is retried after ``retry_s`` (a new generation at once).

    Args:
        store: the model store (``modelstore.store.ModelStore``) holding ``fleet/``.
        reconciler: the pod's :class:`serving.converge.PodReconciler`.
        poll_s: seconds between reads (``--desired-poll``).
        retry_s: seconds before a failed target is tried again.
    """

    def __init__(self, store, reconciler, poll_s: float, retry_s: float = 30.0):
        self.store, self.reconciler, self.poll_s, self.retry_s = store, reconciler, float(poll_s), float(retry_s)
        self._stop = threading.Event()
        self._said: str | None = None
        self._failed: tuple | None = None  # (target fields, monotonic time) of the last failed attempt
        self._thread = threading.Thread(target=self._run, name="desired-watch", daemon=True)

    def start(self) -> "DesiredWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _say(self, level: int, msg: str) -> None:
        if msg != self._said:
            self._said = msg
            log.log(level, msg)

    def poll(self) -> None:
        """One read of the record and, at a generation this pod has not taken (or one whose last
        attempt failed, after ``retry_s``), one converge attempt."""
        from modelstore.desired import FleetRecord
        from serving.converge import StaleTarget, plan

        try:
            t = pod_target(FleetRecord(self.store).read())
        except (OSError, ValueError) as exc:
            self._say(logging.WARNING, f"desired-state record unreadable ({exc}): serving what this pod serves")
            return
        if t is None or t.generation == 0:
            return  # no record written yet: the pod serves what it started on (--version, or the store's stable)
        rec = self.reconciler
        cur = rec.target
        if cur is not None and t.generation < cur.generation:
            self._say(logging.WARNING, f"desired-state record is at generation {t.generation}, older than "
                                       f"generation {cur.generation} this pod has taken: ignored")
            return
        if cur is not None and t.generation == cur.generation and rec.error is None:
            return  # taken already: a pod changed by hand since stays so until the next generation
        if cur is not None and t.generation == cur.generation and not plan(rec.slots.status(check_digests=False), t):
            return  # there already
        key = (t.generation, t.serving_fields())
        if self._failed is not None and self._failed[0] == key and \
                time.monotonic() - self._failed[1] < self.retry_s:
            return
        try:
            rec.apply(t, "watch")
            self._failed = None
            self._said = None
        except StaleTarget as exc:
            self._say(logging.WARNING, str(exc))
        except Exception as exc:  # noqa: BLE001 - the pod keeps serving; retried after retry_s
            self._failed = (key, time.monotonic())
            self._say(logging.WARNING, f"desired state generation {t.generation} not reached: {exc}")

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - the watch must outlive one bad read
                log.exception("desired-state watch")


def open_store(store_dir: Path | str, model_dir: Path | None = None):
    """The model store to serve from.

    With ``model_dir``: a one-version :class:`serving.slots.CheckpointStore` over it.
    Else ``modelstore.store.ModelStore(store_dir)`` (a dir, or an fsspec URL string), initialised from the base model
    (``schemas.settings.base_model_dir()``) only if it has no versions yet.

    Raises:
        FileNotFoundError: the store has no version and the base model dir holds no checkpoint.
    """
    from serving.slots import CheckpointStore

    if model_dir is not None:
        return CheckpointStore(model_dir)
    from modelstore.store import ModelStore  # the deploy package's public API
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
    watch: DesiredWatch | None = None

    def close(self) -> None:
        """Stop: events still being built go to the event log, the event log delivers what it
        holds for up to 10 s (what is left stays in its journal, sent at the next start),
        then the engine stops. Logs a line before and after, so that a SIGTERM's wait is
        not silent."""
        t0 = time.monotonic()
        if self.watch is not None:
            self.watch.stop()
        ev = self.event_log
        if ev is not None and ev.bootstrap is None:
            log.info("stopping: journaling %d queued events (no Kafka broker configured)", ev.queue_depth())
        elif ev is not None:
            log.info("stopping: delivering %d queued events and %d journal bytes to Kafka (up to 10 s)",
                     ev.queue_depth(), ev.journal_pending())
        st = getattr(getattr(self.app, "state", None), "flywheel", None)
        if st is not None:
            st.openai.close()  # feedback events still being derived go to the event log first
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


def engine_mismatch(engine: str, eng: EngineConfig, vllm: VLLMConfig) -> tuple[str, str] | None:
    """``(field, reason)`` for the first setting that does not apply to ``engine`` (a torch-only
    one changed on vLLM, a vLLM option changed on torch), None when all apply."""
    if engine == "vllm":
        torch_only = eng.torch_only_changed()
        return (torch_only[0][0], f"torch engine only ({torch_only[0][1]})") if torch_only else None
    vllm_only = vllm.changed()
    return (vllm_only[0], f"vLLM engine only (this pod runs --engine {engine})") if vllm_only else None


def make_engine(model_dir: Path, engine: str, eng: EngineConfig, vllm: VLLMConfig, loop=None):
    """The engine of a pod: :class:`serving.engine.TorchEngine` over ``eng``, or
    :class:`serving.engine_vllm.VLLMEngine` over ``vllm`` and ``eng``'s batch (imported only
    then: vLLM lives in its own venv), on ``loop`` when given.

    Raises:
        ValueError: unknown ``engine``, or a setting of the other engine (naming the field).
    """
    if engine not in ("torch", "vllm"):
        raise ValueError(f"engine: must be 'torch' or 'vllm', got {engine!r}")
    bad = engine_mismatch(engine, eng, vllm)
    if bad:
        raise ValueError(f"{bad[0]}: {bad[1]}")
    if engine == "torch":
        from serving.engine import TorchEngine

        return TorchEngine(model_dir, eng)
    from serving.engine_vllm import VLLMEngine  # lazy: vLLM lives in its own venv

    return VLLMEngine(model_dir, vllm, batch=eng, loop=loop)


def build_pod(store, version: str | None = None, *, pod: str | None = None, engine: str | None = None,
              engine_config: EngineConfig | None = None, vllm_config: VLLMConfig | None = None, loop=None,
              bootstrap: str | None = None, journal: Path | None = None, log_events: bool = True,
              api_keys: set[str] | None = None, admin_token: str | None = None, app_options: dict | None = None,
              desired_poll_s: float | None = None, **settings: Any) -> Pod:
    """Build a pod over ``store``, serving ``version`` (default :func:`default_version`, and
    then the fleet's desired candidate and weight, :func:`start_desired_candidate`).

    Args:
        pod: pod name in every event (default ``serving.config.DEFAULT_POD``).
        engine: ``torch`` or ``vllm`` (default :class:`ServeConfig`'s), see :func:`make_engine`.
        engine_config, vllm_config: the engine's settings (default the models' defaults);
            ``**settings`` overrides their fields by name (``max_batch=2``, ``device="cuda"``,
            ``scheduler="static"``, ``max_model_len=512``).
        loop: vLLM engine only: the event loop the HTTP server runs on (see VLLMEngine).
        bootstrap: Kafka bootstrap; None = ``schemas.settings.bootstrap()`` (journal only if
            no broker is configured: events wait in the journal).
        journal: event journal file (default ``$FLYWHEEL_HOME/serving/<pod>.journal``).
        log_events: False turns event logging off (benchmarks only).
        app_options: :func:`serving.app.create_app` keyword arguments (``feedback_keys``,
            ``served_model_name``, ``eval_share``, ``cors_origins``, ``salt``, ``admin_port``).
        desired_poll_s: read the fleet's desired-state record every this many seconds and
            converge to it (:class:`DesiredWatch`; ``flywheel serve --desired-poll``); None: no
            watch (the pod then changes only by ``PUT /admin/desired``).

    Raises:
        ValueError: unknown ``engine``; a setting of the other engine (``aligned_logprobs`` /
            ``prefix_caching`` / ... with vLLM); a value a model refuses (naming the field).
        TypeError: a keyword that is no setting of either engine model.
    """
    from schemas import settings as fw_settings
    from serving.app import create_app
    from serving.eventlog import EventLog
    from serving.slots import Slots

    eng, vllm = split_settings(settings, engine_config or EngineConfig(), vllm_config or VLLMConfig(),
                               where="build_pod")
    pod = DEFAULT_POD if pod is None else pod
    engine_obj = make_engine(store.base_dir, engine or ServeConfig.model_fields["engine"].default, eng, vllm, loop)
    slots = Slots(engine_obj, store, pod=pod)
    try:
        slots.start(version or default_version(store))
        if version is None:
            reconciler = start_desired_candidate(slots, store)
        else:
            from serving.converge import PodReconciler

            reconciler = PodReconciler(slots, read_record=(lambda: record_target(store)) if hasattr(store, "stable_record")
                                       else None)  # generation 0 until a target comes
    except Exception:
        engine_obj.close()
        raise
    ev = None
    if log_events:
        if bootstrap is None:
            try:
                bootstrap = fw_settings.bootstrap()
            except RuntimeError as exc:
                log.warning("%s; events wait in the journal", exc)
    names = fw_settings.topic_names()  # the process's topic names, resolved once
    if log_events:
        ev = EventLog(bootstrap, journal or fw_settings.home() / "serving" / f"{pod}.journal",
                      client_id=f"flywheel-serving-{pod}", consumer_group=names.ingest_group)
    app = create_app(slots, ev, pod=pod, api_keys=api_keys, admin_token=admin_token, topics=names,
                     **(app_options or {}))
    app.state.flywheel.reconciler = reconciler
    watch = None
    if desired_poll_s is not None and hasattr(store, "stable_record"):  # a model store has a record to watch
        watch = DesiredWatch(store, reconciler, desired_poll_s).start()
    return Pod(app=app, engine=engine_obj, slots=slots, event_log=ev, watch=watch)


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
        SettingError: no usable salt; ``flag`` is the variable to set.
    """
    from schemas.settings import SaltError, user_salt

    why = "--fleet" if fleet else ("" if is_loopback(host) else f"--host {host} is reachable from other machines")
    try:
        return user_salt(fleet=bool(why), why=why)
    except SaltError as exc:
        setting, _, msg = str(exc).partition(": ")
        raise SettingError(setting, msg) from None


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
    """Raise :class:`SettingError` naming ``--host`` or ``flag`` if ``host:port`` cannot be
    bound now (address in use, no such interface, privileged port)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise SettingError("--host", f"cannot resolve {host!r}: {exc.strerror}") from None
    fam, _, _, _, addr = infos[0]
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        try:
            s.bind(addr)
        except OSError as exc:
            raise SettingError(flag, f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def _check_engine(cfg: ServeConfig, eng: EngineConfig, vllm: VLLMConfig) -> None:
    """The engine settings apply to ``cfg.engine``, its device exists, vLLM is installed and
    knows the tool parser (before the model load). Raises :class:`SettingError`."""
    bad = engine_mismatch(cfg.engine, eng, vllm)
    if bad:
        raise SettingError("--" + bad[0].replace("_", "-"), bad[1])
    if cfg.engine == "torch" and eng.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise SettingError("--device", f"{eng.device}: torch sees no CUDA device here")
    if cfg.engine == "vllm":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise SettingError("--engine", "vllm is not installed in this interpreter (run flywheel from the "
                                           "vLLM venv, DESIGN §3)")
        if vllm.tool_call_parser != VLLMConfig.model_fields["tool_call_parser"].default:
            from vllm.tool_parsers import ToolParserManager  # refused before the model load, not on a request

            known = ToolParserManager.list_registered()
            if vllm.tool_call_parser not in known:
                raise SettingError("--tool-call-parser", f"{vllm.tool_call_parser!r} is not a vLLM tool parser "
                                                         f"(one of {', '.join(known)})")


def check_serve(cfg: ServeConfig, eng: EngineConfig, vllm: VLLMConfig) -> str:
    """Every check ``flywheel serve`` makes before the (slow) model load, in order: the engine
    settings, the ports, the admin token, the user salt, ``--model-dir``
    (:func:`check_model_dir`). Returns the salt.

    Raises:
        SettingError: the first setting that cannot work, naming its flag or variable.
    """
    _check_engine(cfg, eng, vllm)
    check_listen(cfg.host, cfg.port)
    if cfg.admin_port is not None:
        if cfg.admin_port == cfg.port:
            raise SettingError("--admin-port", f"must differ from --port ({cfg.port})")
        check_listen(cfg.host, cfg.admin_port, "--admin-port")
    if not os.environ.get("FLYWHEEL_ADMIN_TOKEN") and not is_loopback(cfg.host):
        raise SettingError("--host", f"{cfg.host} is reachable from other machines and /admin/* (load, promote, "
                                     "roll back) would have no auth: set FLYWHEEL_ADMIN_TOKEN")
    salt = fleet_salt(cfg.host, cfg.fleet)
    if cfg.model_dir is not None:
        check_model_dir(cfg.model_dir)
    return salt


def check_model_dir(model_dir: Path) -> None:
    """``--model-dir``: a Hugging Face checkpoint that passes the checks that need no model
    built (:func:`schemas.checkpoint_check.check_checkpoint_dir`, as ``flywheel model init
    --from`` runs them): config.json, the safetensors headers, the config's sizes against
    the weights, tokenizer files; then every weight read and finite (:func:`nonfinite_weights`;
    the model store's check, which the engine's own read of the files bypasses).

    Raises:
        SettingError: ``--model-dir``, naming the directory, the file or config field, and
            what is wrong: ``weights: N tensors hold NaN or infinite values: 'name': count of
            numel; ... (names as the safetensors files hold them)``, or ``<file>: tensor
            'name' cannot be read: <the reader's error>``.
    """
    from modelstore.store import describe_nonfinite
    from schemas.checkpoint_check import CheckpointError, check_checkpoint_dir

    if not (model_dir / "config.json").is_file():
        raise SettingError("--model-dir", f"{model_dir} holds no Hugging Face checkpoint (no config.json)")
    try:
        checked = check_checkpoint_dir(model_dir)
        bad = nonfinite_weights(checked.weight_files)
    except CheckpointError as exc:
        raise SettingError("--model-dir", f"{model_dir}: {exc}") from None
    if bad:  # a NaN weight serves NaN logits: nothing a pod could answer with
        reason = f"{describe_nonfinite(bad)} (names as the safetensors files hold them)"
        raise SettingError("--model-dir", f"{model_dir}: {CheckpointError('weights', reason)}")


def nonfinite_weights(files: list[Path]) -> list[tuple[str, int, int]]:
    """The tensors of the safetensors ``files`` holding NaN or infinite values, as
    :func:`modelstore.store.nonfinite_tensors` lists them (``(name, count, numel)``), the
    files' order then the reader's within a file (by name). Read with safetensors' own reader (the one the engine
    loads the weights with) one tensor at a time: one pass over the files, one tensor in
    memory (plus its boolean mask), no model built.

    Names are the files' own, which are not always the names ``flywheel model init --from``
    reports for the same checkpoint: that checks the model's state after loading it, where a
    tied ``lm_head.weight`` is a second name for the embedding and per-expert file tensors
    (``...experts.3.w1.weight``) are fused into one (``...experts.gate_up_proj``), so the
    names and the number of tensors can differ (an embedding holding inf, tied to the head:
    one tensor here, two there).

    Raises:
        CheckpointError: field the file's name, when the reader cannot open a file or load
            one of its tensors (a dtype this safetensors/torch cannot load, such as F6_E2M3;
            a file it refuses); the reason names the tensor (``repr``) and the reader's error.
    """
    from safetensors import safe_open

    from modelstore.store import nonfinite_tensors
    from schemas.checkpoint_check import CheckpointError, library_text

    bad = []
    for f in files:
        try:
            st_cm = safe_open(str(f), framework="pt")
        except Exception as exc:  # the reader's own errors (SafetensorError, OSError, ...), any of them
            raise CheckpointError(f.name, f"cannot be read: {library_text(exc)}") from None
        with st_cm as st:
            for name in st.keys():
                try:
                    t = st.get_tensor(name)
                except Exception as exc:
                    raise CheckpointError(f.name, f"tensor {name!r} cannot be read: {library_text(exc)}") from None
                bad += nonfinite_tensors({name: t})
                del t
    return bad


def open_pod_store(cfg: ServeConfig):
    """The store ``cfg`` names (``--store``, else ``$FLYWHEEL_STORE`` / ``$FLYWHEEL_HOME/store``;
    ``--model-dir`` wins), with ``--version`` in it. Raises :class:`SettingError`."""
    from modelstore.store import StoreUnusableError  # the deploy package's public API
    from schemas import settings

    try:
        st = open_store(cfg.store or settings.store_dir(), cfg.model_dir)
    except StoreUnusableError as exc:  # --store names a file or an unwritable place
        raise SettingError("--store" if cfg.store else "FLYWHEEL_STORE or FLYWHEEL_HOME", exc.strerror) from None
    except FileNotFoundError as exc:  # no model yet: say what to run, not a traceback
        raise SettingError("FLYWHEEL_MODEL_DIR or --model-dir", str(exc).split(": ", 1)[1]) from exc
    if cfg.version is not None and cfg.version not in st.versions():
        raise SettingError("--version", f"{cfg.version!r} is not in the store (it has {', '.join(st.versions())})")
    return st


def app_options(cfg: ServeConfig, salt: str) -> dict:
    """:func:`serving.app.create_app`'s keyword arguments from ``cfg`` and the environment
    (``FLYWHEEL_FEEDBACK_KEYS``, ``FLYWHEEL_CORS_ORIGINS``)."""
    from serving.app import load_keys
    from serving.signals import SignalDetector

    origins = [o for o in (cfg.cors_origin or []) if o]
    origins += [o.strip() for o in os.environ.get("FLYWHEEL_CORS_ORIGINS", "").split(",") if o.strip()]
    return {"feedback_keys": load_keys("FLYWHEEL_FEEDBACK_KEYS", cfg.feedback_keys_file),
            "served_model_name": cfg.served_model_name, "eval_share": cfg.eval_share,
            "cors_origins": origins or None, "salt": salt, "admin_port": cfg.admin_port,
            "signals": SignalDetector.from_config(cfg)}


_exit_after_close = False


def exit_after_close() -> None:
    """Ask the process's entry point (:func:`flywheel.cli.main`) to end the process with
    :func:`exit_now` once the command returns: the ``serve`` command calls it after its pod
    closed. Only the entry point acts on it, so a command invoked in process (typer's
    ``CliRunner``, a program embedding the CLI) returns normally."""
    global _exit_after_close
    _exit_after_close = True


def exit_after_close_requested() -> bool:
    """Whether :func:`exit_after_close` was called in this process."""
    return _exit_after_close


def exit_now(code: int | str | None = 0) -> None:
    """End this process once the pod is closed (:meth:`Pod.close`), as a normal exit would but
    without the interpreter's teardown: join the threads that are not daemons and run the
    ``threading`` and ``atexit`` exit hooks (Python's own first steps of an exit), flush the log
    handlers, stdout and stderr, then ``os._exit``. The teardown skipped (every module's
    objects freed and garbage-collected) holds nothing of the pod's: its event journal is
    written, fsync'd and closed by :meth:`Pod.close`. With torch and transformers loaded it is
    ~0.7 s of CPU, 10-20 s of wall time on a box whose cores are busy (D112).

    ``code`` as ``SystemExit`` takes it: None is 0, a string is printed to stderr and exits 1.
    Never returns.
    """
    import atexit
    import sys

    if code is None:
        rc = 0
    elif isinstance(code, int):
        rc = code
    else:
        print(code, file=sys.stderr)
        rc = 1
    try:
        shutdown = getattr(threading, "_shutdown", None)  # what an exit runs first: joins non-daemon threads
        if shutdown is not None and threading.current_thread() is threading.main_thread():
            shutdown()
        atexit._run_exitfuncs()  # logging.shutdown among them: the handlers flushed
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):  # closed or replaced by a broken stream
                pass
        os._exit(rc)


def run_pod(cfg: ServeConfig | None = None, eng: EngineConfig | None = None, vllm: VLLMConfig | None = None,
            *, echo: Callable[[str], Any] | None = None) -> None:
    """``flywheel serve``: check the settings, open the store, build the pod and serve it
    (uvicorn, one server on ``--port`` and ``--admin-port``) until SIGINT or SIGTERM, then
    close it (:meth:`Pod.close`). ``echo`` gets the "serving ..." line once the pod is built
    (default: printed to stdout, flushed).

    Raises:
        SettingError: a setting that cannot work, before the model load (:func:`check_serve`,
            :func:`open_pod_store`).
    """
    import asyncio

    import uvicorn

    from serving.app import load_keys

    cfg, eng, vllm = cfg or ServeConfig(), eng or EngineConfig(), vllm or VLLMConfig()
    salt = check_serve(cfg, eng, vllm)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    st = open_pod_store(cfg)
    loop = None
    if cfg.engine == "vllm":  # HTTP and AsyncLLM on one loop, as vLLM's own server
        from serving.engine_vllm import new_event_loop

        loop = new_event_loop()
        asyncio.set_event_loop(loop)
    pod = cfg.pod_name()
    p = build_pod(st, cfg.version, pod=pod, engine=cfg.engine, engine_config=eng, vllm_config=vllm, loop=loop,
                  api_keys=load_keys("FLYWHEEL_API_KEYS", cfg.api_keys_file),
                  admin_token=os.environ.get("FLYWHEEL_ADMIN_TOKEN") or None, app_options=app_options(cfg, salt),
                  desired_poll_s=cfg.desired_poll_s)
    admin_at = f", /admin and /metrics on http://{cfg.host}:{cfg.admin_port}" if cfg.admin_port else ""
    (echo or (lambda line: print(line, flush=True)))(
        f"serving {p.slots.stable.version} on http://{cfg.host}:{cfg.port}{admin_at} (pod {pod})")

    def _exit(signum, _frame):  # uvicorn re-raises SIGTERM after its graceful shutdown
        raise SystemExit(0)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit)
    # with --admin-port one server listens on both sockets; the app tells them apart by the
    # connection's local port (serving.app.PortSplitMiddleware)
    sockets = [listen_socket(cfg.host, cfg.port), listen_socket(cfg.host, cfg.admin_port)] if cfg.admin_port else None
    server = uvicorn.Server(uvicorn.Config(p.app, host=cfg.host, port=cfg.port, log_level="warning"))
    try:
        if loop is None:
            server.run(sockets=sockets)
        else:
            loop.run_until_complete(server.serve(sockets=sockets))
    finally:
        p.close()
