"""The fleet's desired state: one persisted record on the model store's shared storage.

What every serving pod should serve (stable version, candidate and its traffic share), what
the learner should do (paused or not), and a pending canary request for the controller, with a
generation number that grows by one at every change (Argo Rollouts' / Flagger's one object
per rollout). It is the one record of which version is stable: ``stable.json`` is a copy
derived from it at every change, ``ModelStore.stable_record`` reads it, and the controller's
rollout status follows it. The controller and the operator commands are its only writers,
both through :meth:`FleetRecord.change`; two reconcilers bring every pod to it through the
pod's one converge function: the pod's own watch of this file (``serving.pod.DesiredWatch``)
and the controller's ``PUT /admin/desired`` (:mod:`deploy.fleet`). A pod that starts reads it
before it reports ready (``serving.commands.build_pod``).

Layout under the store's root::

    fleet/desired.json      the record (JSON of :class:`DesiredState`)
    fleet/.lock             flock held by one writer at a time
    fleet/controller.json   the controller's heartbeat (:meth:`FleetRecord.beat`), rewritten at every poll
    fleet/ledger.duckdb     the deployment ledger beside it (``schemas.settings.ledger_path()``)

Concurrency: on a local (or NFS/RWX-mounted) store, a change holds an exclusive ``flock`` on
``fleet/.lock``, so two operator commands (or an operator and the controller) serialise: each
reads the record and changes it while the other waits, and whichever ran last is what the
pods converge to; the lock is held for the change only, never while a pod is called. A pod
refuses a target older than the newest generation it has taken, so a late call from a slow
reconciler never undoes a newer change. On an fsspec object store there is no cross-process
lock: a change is a compare-and-swap on ``generation`` (re-read right before the one-PUT
write; a lost race raises :class:`ConflictError`).

This module knows nothing about pods or HTTP.
"""

from __future__ import annotations

import copy
import fcntl
import json
import logging
import math
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields

from schemas.events import now_ms
from schemas.manifest import version_number
from schemas.display import shown
from schemas.pod_target import MAX_GENERATION, check_consistent, check_pod_spec, redact_text

log = logging.getLogger(__name__)

DESIRED_FILE = ("fleet", "desired.json")
LOCK_FILE = ("fleet", ".lock")
HEARTBEAT_FILE = ("fleet", "controller.json")
HISTORY_MAX = 200  # stable changes kept in the record (the ledger keeps them all)

# What a reader of the controller's heartbeat accepts (:class:`Heartbeat`); past these bounds
# the file is unreadable, so a damaged or hostile file can neither stall a reader nor hide
# that no controller runs.
HEARTBEAT_MAX_BYTES = 64 * 1024  # the controller writes ~200 bytes; a larger file is not read
HEARTBEAT_SKEW_S = 300.0  # how far in the future (clocks apart) a heartbeat may be dated (s)
HEARTBEAT_MAX_POLL_S = 86_400.0  # the largest --poll-s a heartbeat may declare (s): one day
HEARTBEAT_HOST_MAX = 255  # characters of a host name (RFC 1035's bound on a full name)
HEARTBEAT_ERROR_MAX = 1000  # characters of the last step's error kept (longer is cut)


class ConflictError(RuntimeError):
    """Another writer changed the record between our read and our write (object stores)."""


class RecordUnreadable(ValueError):
    """``fleet/desired.json`` exists but cannot be read as a record (bad bytes, not JSON, an
    unknown or inconsistent field); the message names the file and the field. A ValueError,
    so callers that refuse on any bad record keep catching it. The message is redacted
    (:func:`schemas.pod_target.redact_text`): whatever of the record's text it quotes, a user
    name or password never reaches a pod's log, the controller's log or the terminal."""

    def __init__(self, msg: str):
        super().__init__(redact_text(str(msg)))


class LockTimeout(TimeoutError):
    """The fleet lock was not acquired in time; ``holder`` says who holds it (dict or None)."""

    def __init__(self, timeout_s: float, holder: dict | None):
        self.holder = holder
        who = (f"{holder.get('who', '?')} ({holder.get('what', '?')}, pid {holder.get('pid', '?')})"
               if holder else "another process")
        super().__init__(f"fleet lock: {who} held it for more than {timeout_s:g} s")


def _check_str(v, name: str) -> None:
    if not isinstance(v, str):
        raise ValueError(f"{name}: must be a string, got {type(v).__name__}")


def _check_ms(v, name: str) -> None:
    """A time in whole ms since the epoch, or a generation: an int in [0, 2**53] (not a bool)."""
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_GENERATION:
        shown = repr(v) if isinstance(v, float) or (type(v) is int and abs(v) < 10**20) else type(v).__name__
        raise ValueError(f"{name}: must be a whole number in [0, 2**53], got {shown}")


def _check_paused(p) -> None:
    if not isinstance(p, dict):
        raise ValueError(f"paused: must be null or {{\"actor\", \"at\", \"reason\"}}, got {type(p).__name__}")
    unknown = sorted(set(p) - {"actor", "at", "reason"})
    if unknown:
        raise ValueError(f"paused: unknown field {unknown[0]!r}")
    for k in ("actor", "at"):
        if k not in p:
            raise ValueError(f"paused.{k}: missing")
    _check_str(p["actor"], "paused.actor")
    _check_ms(p["at"], "paused.at")
    if "reason" in p:
        _check_str(p["reason"], "paused.reason")


def _check_change(h, name: str) -> None:
    if not isinstance(h, dict):
        raise ValueError(f"{name}: must be an object (a stable change), got {type(h).__name__}")
    if "version" not in h:
        raise ValueError(f"{name}.version: missing")
    if not isinstance(h["version"], str):
        raise ValueError(f"{name}.version: must be a version id (a string), got {type(h['version']).__name__}")
    try:
        version_number(h["version"])
    except ValueError as exc:
        raise ValueError(f"{name}.version: {exc}") from None
    for k in ("at", "generation"):
        if k in h:
            _check_ms(h[k], f"{name}.{k}")
    for k in ("actor", "reason"):
        if h.get(k) is not None:
            _check_str(h[k], f"{name}.{k}")


@dataclass
class DesiredState:
    """What the fleet should serve and do.

    Fields:
        generation: grows by one at every change (0: never written; the record is then
            derived from the store's stable record).
        stable: version every pod serves as stable (``vNNNNNN``).
        candidate: version every pod holds in its candidate slot, or None.
        weight: share of users (0..1) sent to the candidate; 0 without one.
        reload_after_ms: a pod whose stable weights were loaded before this time (ms since
            epoch, the pod's ``loaded_at``) reloads ``stable`` from the store, verified
            (``flywheel rollback --to <the current stable>``); 0 = no reload asked.
        paused: ``{"actor", "at" (ms), "reason"}`` while the learner is paused, else None.
        pods: the serving specs of the pods that must converge (URLs or ``dns+http://``
            specs, :mod:`deploy.discovery`), so an operator command on any machine reaches the
            same pods: the controller's (it records the ones it discovers from), else the ones
            the first operator command named with ``--serving``; [] until either recorded them.
        history: the stable versions in the order they became stable, oldest first, the last
            being ``stable`` (``{"version", "at" (ms), "actor", "reason", "generation"}``, the
            newest :data:`HISTORY_MAX`); ``flywheel rollback`` without ``--to`` goes back
            along it. The first write takes the history of the store's ``stable.json``.
        actor, action, reason: who made the last change, what it was, why.
        updated_ms: when the last change was written (ms since epoch).
    """

    generation: int = 0
    stable: str | None = None
    candidate: str | None = None
    weight: float = 0.0
    reload_after_ms: int = 0
    paused: dict | None = None
    pods: list[str] = field(default_factory=list)
    history: list[dict] = field(default_factory=list)
    actor: str = ""
    action: str = ""
    reason: str = ""
    updated_ms: int = 0

    def validate(self) -> "DesiredState":
        """Raise ValueError naming the field when the record is inconsistent (the rules of the
        pods' :class:`schemas.pod_target.PodTarget`, so what the record holds a pod can take;
        how the serving fields tie together is :func:`schemas.pod_target.check_consistent`,
        the one place of that rule), or ``pods`` is not a list of pod specs by the rule of
        ``--serving`` (:func:`schemas.pod_target.check_pod_spec`; the message names the entry,
        ``pods[2]``), or a field of another type than the record writes: ``actor``, ``action``,
        ``reason`` strings; ``updated_ms`` a whole number of ms in [0, 2**53]; ``paused`` None or
        ``{"actor": str, "at": ms, "reason": str}`` (``reason`` may be absent); ``history`` a
        list of ``{"version": vNNNNNN, "at": ms, "actor": str or null, "reason": str or null,
        "generation": int}`` (only ``version`` required). No value it accepts is NaN or infinite, so every
        JSON document built from it is valid JSON. Returns self."""
        for name in ("generation", "reload_after_ms"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_GENERATION:
                raise ValueError(f"{name}: must be a whole number in [0, 2**53], got {v!r}")
        for name in ("stable", "candidate"):
            v = getattr(self, name)
            if v is not None:
                if not isinstance(v, str):
                    raise ValueError(f"{name}: must be a version id (a string) or null, got {type(v).__name__}")
                try:
                    version_number(v)
                except ValueError as exc:
                    raise ValueError(f"{name}: {exc}") from None
        if isinstance(self.weight, bool) or not isinstance(self.weight, (int, float)) \
                or not 0.0 <= float(self.weight) <= 1.0:
            raise ValueError(f"weight: must be in [0, 1], got {self.weight!r}")
        check_consistent(self.stable, self.candidate, self.weight)
        for name in ("actor", "action", "reason"):
            _check_str(getattr(self, name), name)
        _check_ms(self.updated_ms, "updated_ms")
        if self.paused is not None:
            _check_paused(self.paused)
        if not isinstance(self.history, list):
            raise ValueError(f"history: must be a list of stable changes, got {type(self.history).__name__}")
        for i, h in enumerate(self.history):
            _check_change(h, f"history[{i}]")
        if not isinstance(self.pods, list):
            raise ValueError(f"pods: must be a list of pod specs (http(s):// URLs or dns+http(s):// specs), got "
                             f"{type(self.pods).__name__}")
        for i, spec in enumerate(self.pods):
            check_pod_spec(spec, f"pods[{i}]")
        return self

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=1).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "DesiredState":
        """Parse the record. :class:`RecordUnreadable` (a ValueError naming the file and field)
        on bad bytes."""
        try:
            d = json.loads(raw)
        except ValueError as exc:
            raise RecordUnreadable(f"{'/'.join(DESIRED_FILE)}: not JSON: {exc}") from None
        if not isinstance(d, dict):
            raise RecordUnreadable(f"{'/'.join(DESIRED_FILE)}: expected an object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        if "intent" in d and d["intent"] is None:  # a null "intent" is accepted and dropped
            d.pop("intent")
        unknown = sorted(set(d) - known)
        if unknown:
            raise RecordUnreadable(f"{'/'.join(DESIRED_FILE)}: unknown field {unknown[0]!r}")
        try:
            return cls(**d).validate()
        except (TypeError, ValueError) as exc:
            raise RecordUnreadable(f"{'/'.join(DESIRED_FILE)}: {exc}") from None

    def summary(self) -> str:
        """One line: ``generation 7: stable v000002, candidate v000003 at 25 %, learner paused``."""
        s = f"generation {self.generation}: stable {self.stable}"
        if self.candidate:
            s += f", candidate {self.candidate} at {self.weight:.0%}"
        if self.paused:
            s += ", learner paused"
        return s


@dataclass(frozen=True)
class Heartbeat:
    """The controller's heartbeat (``fleet/controller.json``), as a reader accepts it.

    Fields:
        at: when it was written, whole ms since the epoch, in ``[0, now + HEARTBEAT_SKEW_S]``.
        host: the controller's host name (printable, at most :data:`HEARTBEAT_HOST_MAX` chars).
        pid: its process id (a whole number >= 0).
        poll_s: the ``--poll-s`` it declared (s, finite, in ``[0, HEARTBEAT_MAX_POLL_S]``), or
            None (``--once``).
        error: the last step's error, or None; its unprintable characters written as escapes
            (:func:`schemas.display.shown`: ``\\x1b``, ``\\n``), then cut to
            :data:`HEARTBEAT_ERROR_MAX` characters.
    """

    at: int
    host: str
    pid: int
    poll_s: float | None = None
    error: str | None = None

    @classmethod
    def parse(cls, raw: bytes, now: int) -> "Heartbeat":
        """The heartbeat in ``raw`` (the file's bytes), judged at ``now`` (ms since epoch).
        Keys other than the fields are ignored.

        Raises:
            ValueError: naming the field and the reason (``at: dated 3650 days in the future,
                beyond the 300 s clock skew allowed``); the file larger than
                :data:`HEARTBEAT_MAX_BYTES`, not JSON, or not an object.
        """
        if len(raw) > HEARTBEAT_MAX_BYTES:
            raise ValueError(f"larger than {HEARTBEAT_MAX_BYTES} bytes (a heartbeat is a few hundred): not read")
        try:
            b = json.loads(raw)
        except ValueError as exc:  # bad UTF-8, not JSON, an integer of more than 4300 digits
            raise ValueError(f"not JSON: {str(exc)[:200]}") from None
        if not isinstance(b, dict):
            raise ValueError(f"expected an object, got {type(b).__name__}")
        at = b.get("at")
        if isinstance(at, bool) or not isinstance(at, int):
            raise ValueError(f"at: must be a whole number of ms since the epoch, got {type(at).__name__}")
        if at < 0:
            raise ValueError("at: before the epoch (negative)")
        if at > now + HEARTBEAT_SKEW_S * 1000:
            ahead = (at - now) // 1000  # whole seconds: `at` may be too large for a float
            far = f"{ahead / 86400:.0f} days" if ahead < 10**12 else "more than 10**12 s"
            raise ValueError(f"at: dated {far} in the future, beyond the {HEARTBEAT_SKEW_S:g} s clock skew allowed")
        host = b.get("host")
        if not isinstance(host, str):
            raise ValueError(f"host: must be a string, got {type(host).__name__}")
        if len(host) > HEARTBEAT_HOST_MAX:
            raise ValueError(f"host: {len(host)} characters (at most {HEARTBEAT_HOST_MAX})")
        if not host.isprintable():
            raise ValueError("host: holds unprintable characters")
        pid = b.get("pid")
        if isinstance(pid, bool) or not isinstance(pid, int) or not 0 <= pid <= MAX_GENERATION:
            raise ValueError(f"pid: must be a whole number in [0, 2**53], got {type(pid).__name__}"
                             + (f" {pid}" if isinstance(pid, int) and abs(pid) < 10**20 else ""))
        poll = b.get("poll_s")
        if poll is not None:
            if isinstance(poll, bool) or not isinstance(poll, (int, float)):
                raise ValueError(f"poll_s: must be a number of seconds or null, got {type(poll).__name__}")
            try:
                poll = float(poll)
            except OverflowError:  # an integer too large for a float
                poll = math.inf
            if not (math.isfinite(poll) and 0 <= poll <= HEARTBEAT_MAX_POLL_S):
                raise ValueError(f"poll_s: must be a finite number of seconds in [0, {HEARTBEAT_MAX_POLL_S:g}], "
                                 f"got {poll:g}")
        err = b.get("error")
        if err is not None and not isinstance(err, str):
            raise ValueError(f"error: must be a string or null, got {type(err).__name__}")
        if err is not None:
            err = shown(err)  # escaped before the cut, as every display does (D104)
            if len(err) > HEARTBEAT_ERROR_MAX:
                err = err[:HEARTBEAT_ERROR_MAX] + f"... ({len(err) - HEARTBEAT_ERROR_MAX} more characters)"
        return cls(at=at, host=host, pid=pid, poll_s=poll, error=err)

    def to_dict(self) -> dict:
        """JSON-ready: ``{"at", "host", "pid", "poll_s", "error"}``."""
        return asdict(self)


class FleetRecord:
    """The desired-state record of one model store (``modelstore.store.ModelStore``).

    Args:
        store: the model store whose root holds ``fleet/`` (a directory or fsspec URL).
        clock: ms since epoch (tests inject one).
    """

    _local_locks: dict[str, threading.RLock] = {}
    _held = threading.local()  # per thread: {store root: depth}, shared by every instance

    def __init__(self, store, clock=None):
        self.store = store
        self.clock = clock or now_ms
        self._key = str(store.root)
        self._tlock = FleetRecord._local_locks.setdefault(self._key, threading.RLock())

    # -- reading ----------------------------------------------------------------------------
    @property
    def path(self) -> str:
        """Where the record lives, for messages (``/shared/store/fleet/desired.json``)."""
        return f"{str(self.store.root).rstrip('/')}/{'/'.join(DESIRED_FILE)}"

    def exists(self) -> bool:
        return self.store._exists(*DESIRED_FILE)

    def read(self) -> DesiredState:
        """The record; before its first write, generation 0 with the store's stable record's
        version as stable. :class:`RecordUnreadable` (a ValueError) when the file is unreadable
        (names the file)."""
        try:
            raw = self.store._read(*DESIRED_FILE)
        except FileNotFoundError:
            return DesiredState(generation=0, stable=self.store.stable())
        return DesiredState.from_json(raw)

    # -- the controller's heartbeat -----------------------------------------------------------
    def beat(self, beat: dict) -> None:
        """Replace the controller's heartbeat ``fleet/controller.json`` with ``beat`` (JSON-ready:
        ``{"at" (ms since epoch), "host", "pid", "poll_s" (s, None for --once), "error"}``; an
        error longer than :data:`HEARTBEAT_ERROR_MAX` characters is cut), beside the record on
        the shared storage, so an operator on any machine can tell a running controller from
        none. Not under the fleet lock: one writer, one atomic replace.

        Raises:
            OSError: the file could not be written (names the file).
        """
        beat = dict(beat)
        if isinstance(beat.get("error"), str) and len(beat["error"]) > HEARTBEAT_ERROR_MAX:
            beat["error"] = beat["error"][:HEARTBEAT_ERROR_MAX] + "..."
        if self.store.fs is None:
            (self.store.root / HEARTBEAT_FILE[0]).mkdir(parents=True, exist_ok=True)
        self.store._put_atomic(json.dumps(beat).encode(), *HEARTBEAT_FILE)

    def last_beat(self, now: int | None = None) -> dict | None:
        """The controller's last heartbeat (:meth:`beat`) as :meth:`Heartbeat.to_dict`, or None
        when no controller ever wrote one. At most :data:`HEARTBEAT_MAX_BYTES` (+1) bytes are
        read. ``now``: ms since epoch (default the record's clock), what the time ``at`` is
        judged against.

        Raises:
            ValueError: the file exists but is not a heartbeat (names the file, the field and the
                reason: :meth:`Heartbeat.parse`).
            OSError: the file could not be read.
        """
        try:
            raw = self.store._read_head(HEARTBEAT_MAX_BYTES + 1, *HEARTBEAT_FILE)
        except FileNotFoundError:
            return None
        try:
            return Heartbeat.parse(raw, self.clock() if now is None else now).to_dict()
        except ValueError as exc:
            raise ValueError(f"{'/'.join(HEARTBEAT_FILE)}: {exc}") from None

    # -- locking ----------------------------------------------------------------------------
    @contextmanager
    def locked(self, what: str = "", who: str = "", timeout_s: float | None = None):
        """Hold the fleet lock (re-entrant within a thread). ``what``/``who`` are shown to
        whoever waits. Raises :class:`LockTimeout` after ``timeout_s`` (None: wait)."""
        held = FleetRecord._held.__dict__.setdefault("depth", {})
        if held.get(self._key, 0):  # this thread holds it already (any instance on this store)
            held[self._key] += 1
            try:
                yield self
            finally:
                held[self._key] -= 1
            return
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if not self._tlock.acquire(timeout=-1 if timeout_s is None else timeout_s):
            raise LockTimeout(timeout_s, None)
        f = None
        try:
            if self.store.fs is None:
                d = self.store.root / LOCK_FILE[0]
                d.mkdir(parents=True, exist_ok=True)
                f = open(d / LOCK_FILE[1], "a+")
                while True:
                    try:
                        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if deadline is not None and time.monotonic() > deadline:
                            raise LockTimeout(timeout_s, self._holder(f)) from None
                        time.sleep(0.05)
                f.seek(0)
                f.truncate()
                f.write(json.dumps({"who": who, "what": what, "pid": os.getpid(), "since": self.clock()}))
                f.flush()
            held[self._key] = 1
            try:
                yield self
            finally:
                held[self._key] = 0
        finally:
            if f is not None:
                fcntl.flock(f, fcntl.LOCK_UN)
                f.close()
            self._tlock.release()

    @staticmethod
    def _holder(f) -> dict | None:
        try:
            f.seek(0)
            return json.loads(f.read() or "null")
        except (OSError, ValueError):
            return None

    # -- writing ----------------------------------------------------------------------------
    def change(self, fn, actor: str, action: str, reason: str = "", timeout_s: float | None = None,
               floor: int = 0) -> DesiredState:
        """Apply ``fn(copy of the current record) -> new record`` under the lock and write it
        with ``max(generation, floor) + 1``; returns the written record. ``fn`` raises
        ValueError to refuse (nothing is written). A no-op change (same serving fields) still
        bumps the generation: every operator action is one generation. ``floor``: a generation
        the pods have taken beyond the record's (a record restored or edited to an older
        generation), which the new one must pass for the pods to take it.

        Raises:
            ValueError: ``fn`` refused, or the new record is inconsistent (names the field).
            ConflictError: object store only: another writer won the race.
            LockTimeout: the lock was not acquired within ``timeout_s``.
        """
        with self.locked(action, actor, timeout_s):
            cur = self.read()
            new = fn(copy.deepcopy(cur))
            new.validate()
            base = cur.generation
            if cur.generation == 0:  # the first write (or the first after a removal): from stable.json
                legacy = self.store.stable_record() or {}
                base = max(0, int(legacy.get("generation") or 0))
                if not new.history:
                    new.history = [dict(h) for h in legacy.get("history") or []]
            new.generation = max(base, int(floor)) + 1
            new.actor, new.action, new.reason, new.updated_ms = actor, action, reason, self.clock()
            if new.stable and (not new.history or new.history[-1].get("version") != new.stable):
                new.history = (new.history + [{"version": new.stable, "at": new.updated_ms, "actor": actor,
                                               "reason": reason or action, "generation": new.generation}]
                               )[-HISTORY_MAX:]
            if self.store.fs is not None:  # compare-and-swap on the generation (no flock there)
                now = self.read()
                if now.generation != cur.generation:
                    raise ConflictError(f"fleet record changed under us: generation {cur.generation} -> "
                                        f"{now.generation} ({now.action} by {now.actor})")
            else:
                (self.store.root / DESIRED_FILE[0]).mkdir(parents=True, exist_ok=True)
            raw = new.to_json()
            self.store._put_atomic(raw, *DESIRED_FILE)
            try:  # the derived copy; the record above is what every reader reads
                rec = stable_record_of(raw)
                if rec is not None:
                    self.store.write_stable_copy(rec)
            except Exception as exc:  # noqa: BLE001 - a copy that could not be written is only logged
                log.warning("stable.json (the copy of the fleet record's stable) not written: %s", exc)
            return new


def stable_record_of(raw: bytes) -> dict | None:
    """The stable record (``{"version", "at", "actor", "reason", "history"}``, as
    ``modelstore.store.ModelStore.stable_record`` returns it) derived from the bytes of
    ``fleet/desired.json``; None when the record names no stable version.

    Raises:
        RecordUnreadable: the bytes are no record (names the file and the field).
    """
    d = DesiredState.from_json(raw)
    if not d.stable:
        return None
    last = d.history[-1] if d.history and d.history[-1].get("version") == d.stable else {}
    return {"version": d.stable, "at": last.get("at", d.updated_ms), "actor": last.get("actor", d.actor),
            "reason": last.get("reason", d.reason), "generation": d.generation, "history": list(d.history)}


class CandidateChanged(ValueError):
    """The record's candidate is no longer the one the caller decided about (someone else
    changed it meanwhile): nothing was changed."""


def drop_candidate(fleet: FleetRecord, expected: str | None, actor: str, action: str, reason: str = "",
                   timeout_s: float | None = None) -> DesiredState:
    """The one "drop the candidate" path (``flywheel rollback`` while a candidate is set,
    ``flywheel canary abort``, and the controller's rollback, abort and failed load): under the
    fleet lock, take the candidate and its weight out of the record, after checking that its
    candidate is still ``expected``. Returns the written record.

    Raises:
        CandidateChanged: the record's candidate is not ``expected`` any more (names the
            generation, who changed it and the candidate now); nothing is written.
        LockTimeout: the lock was not acquired within ``timeout_s``.
    """
    return fleet.change(dropping(expected), actor, action, reason, timeout_s)


def dropping(expected: str | None):
    """The change of :func:`drop_candidate` (``f(DesiredState) -> DesiredState``, run under the
    fleet lock by :meth:`FleetRecord.change`), for callers that make the change themselves
    (``deploy.operator.run_action``). Raises :class:`CandidateChanged`."""
    def drop(x: DesiredState) -> DesiredState:  # under the fleet lock: the record as it is now
        if x.candidate != expected:
            raise CandidateChanged(f"candidate: the desired state changed meanwhile (generation {x.generation}, "
                                   f"{x.action or 'set'} by {x.actor or '?'}: candidate now {x.candidate})")
        x.candidate, x.weight = None, 0.0
        return x
    return drop
