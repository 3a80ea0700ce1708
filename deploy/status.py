"""What ``flywheel status`` shows, gathered: the fleet's desired state, every pod with its
drift from it, the store's stable record, the rollout status and the last decisions.

:func:`gather_status` reads; it never changes anything and shows what it can when a part
cannot be read (the part's error is in the result). Rendering stays in ``deploy.commands``.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone

from deploy import ledger
from deploy.controller import RolloutPhase, RolloutStatus, current_status, status_with_record
from modelstore.desired import DESIRED_FILE, HEARTBEAT_FILE, DesiredState, FleetRecord
from deploy.discovery import PodDiscovery
from deploy.fleet import drift, observe_pods
from deploy.operator import pod_specs
from deploy.serving_client import ServingAdminError
from modelstore.store import ModelStore, StoreMissingError
from deploy.wiring import SetupError, admin, rollout_status_path
from schemas import settings
from schemas.display import shown
from schemas.events import now_ms
from schemas.output import json_safe

STATUS_TIMEOUT_S = 5.0  # `flywheel status` is a read: a wedged pod must not stall on-call

CONTROLLER_SEEN_ENV = "FLYWHEEL_CONTROLLER_SEEN_S"
# A controller counts as running while its heartbeat (fleet/controller.json, rewritten after
# every poll) is younger than this plus the --poll-s it declares there (s). Past it, `flywheel
# status` and `flywheel canary start` warn that nothing advances a canary in progress, and
# `flywheel status` says a candidate held at 0 % would become one once a controller runs.
CONTROLLER_SEEN_S = 60.0

RECORD_REPAIR = ("repair it from a backup, or remove it: the record then restarts from the store's stable.json "
                 "(the copy of its last stable version and generation), unpaused, with no candidate, and every pod "
                 "converges to that")


def ts(ms: int) -> str:
    """``MM-DD HH:MM:SS`` (UTC) of a time in ms since the epoch; ``?`` for one no calendar
    holds (a damaged file's time must not stop a read command)."""
    try:
        return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).strftime("%m-%d %H:%M:%S")
    except (ValueError, OverflowError, OSError, TypeError):
        return "?"


def last_decision(outcome: str, reason: str) -> str:
    """The rollout's last decision on one line: ``"<outcome>: <reason>"``, the outcome once
    when the reason already starts with it (the analysis writes ``"ROLLBACK: ..."``);
    ``outcome`` alone for an empty reason."""
    outcome, reason = str(outcome or ""), str(reason or "")
    if reason.startswith(f"{outcome}:") and outcome:
        return reason
    return f"{outcome}: {reason}" if reason else outcome


def controller_seen_s() -> float:
    """How recently a controller must have written its heartbeat to count as running, before
    its own ``--poll-s`` is added (s): ``$FLYWHEEL_CONTROLLER_SEEN_S``, else
    :data:`CONTROLLER_SEEN_S`.

    Raises:
        ValueError: the variable is not a number of seconds > 0 (names it).
    """
    raw = os.environ.get(CONTROLLER_SEEN_ENV, "").strip()
    if not raw:
        return CONTROLLER_SEEN_S
    try:
        v = float(raw)
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"{CONTROLLER_SEEN_ENV}: must be a number of seconds > 0, got {raw!r}")
    return v


def controller_seen_s_or_default() -> tuple[float, str | None]:
    """:func:`controller_seen_s`, and None; or, when ``$FLYWHEEL_CONTROLLER_SEEN_S`` is bad,
    :data:`CONTROLLER_SEEN_S` and the warning to show (naming the variable, the reason and the
    default used): the variable only tunes a warning, so a bad value never stops a command."""
    try:
        return controller_seen_s(), None
    except ValueError as exc:
        return CONTROLLER_SEEN_S, f"{exc}; using the default {CONTROLLER_SEEN_S:g} s"


def controller_seen(fleet: FleetRecord, seen_s: float, now: int | None = None) -> dict:
    """Whether a controller runs, judged by its heartbeat (``fleet/controller.json``,
    :meth:`modelstore.desired.FleetRecord.beat`, read through the bounds of
    :class:`modelstore.desired.Heartbeat`): ``{"heartbeat": the last one or None, "file": its
    path, "age_s": seconds since it was written (0 for one dated ahead, within the clock skew
    allowed) or None, "limit_s": seen_s plus the controller's declared poll_s, "running": bool,
    "error": why the file is unreadable (the field and the reason) or None}``. ``now``: ms
    since epoch (default now). Never raises: whatever the file holds, the answer is "running"
    or not, with the reason."""
    now = now_ms() if now is None else now
    path = f"{str(fleet.store.root).rstrip('/')}/{'/'.join(HEARTBEAT_FILE)}"
    out = {"heartbeat": None, "file": path, "age_s": None, "limit_s": seen_s, "running": False, "error": None}
    try:
        b = fleet.last_beat(now)
    except (OSError, ValueError) as exc:
        out["error"] = str(exc)
        return out
    except Exception as exc:  # noqa: BLE001 - a store's own error class: the heartbeat is unreadable
        out["error"] = f"{type(exc).__name__}: {exc}"
        return out
    if b is None:
        return out
    limit = seen_s + (b["poll_s"] or 0.0)
    age = max(0.0, (now - b["at"]) / 1000)  # bounded: Heartbeat.parse refuses a time outside [0, now + skew]
    out.update(heartbeat=b, age_s=age, limit_s=limit, running=age <= limit)
    return out


REASON_SHOWN_MAX = 120  # characters of the record's reason the held-candidate line quotes (the rest is cut: "...")
NAME_SHOWN_MAX = 120  # characters of the record's actor and action the held-candidate line quotes


def _quote(s: str, limit: int) -> str:
    """``s`` on one line (runs of whitespace, line breaks included, become one space),
    :func:`schemas.display.shown`, cut to ``limit`` characters (the last 3 of them "...")."""
    s = shown(" ".join(s.split()))
    return s if len(s) <= limit else s[:limit - 3] + "..."


def candidate_held(desired: DesiredState | None) -> dict | None:
    """The record's candidate when it is held at weight 0 (in every pod's candidate slot, no
    user sent to it: a version asked by id, today only the demo's fixed eval puts one there,
    since ``flywheel canary start --weight`` is in (0, 1) and the controller's steps in (0, 1]):
    ``{"version", "weight" (0.0), "last_change": {"generation", "actor", "action", "reason",
    "updated_ms" (ms since epoch)}}``, ``last_change`` being the record's last change, whatever
    it was (a pause or a resume after the eval's change included: the record keeps only its last
    change, so it does not say who put the candidate there); None without a candidate, at a
    weight > 0 or when the record is unreadable (None). ``flywheel status -o json`` holds it as
    ``candidate_held``, whether or not a controller runs (one that runs opens a canary of it),
    with the exact strings of the record."""
    if desired is None or desired.candidate is None or desired.weight != 0:
        return None
    return {"version": desired.candidate, "weight": 0.0,
            "last_change": {"generation": desired.generation, "actor": desired.actor, "action": desired.action,
                            "reason": desired.reason, "updated_ms": desired.updated_ms}}


def _no_controller(seen: dict) -> str:
    """Why no controller counts as running (``seen``: :func:`controller_seen`, not running)."""
    b = seen["heartbeat"]
    if seen["error"]:
        return f"its heartbeat {seen['file']} is unreadable ({seen['error']})"
    if b is None:
        return (f"no controller has run: {seen['file']} (the heartbeat `flywheel controller` writes at every poll) "
                "does not exist")
    return (f"no controller has been seen for {seen['age_s']:.0f} s: its last heartbeat ({seen['file']}, "
            f"{b['host'] or '?'} pid {b['pid']}, at {ts(b['at'])} UTC) is older than "
            f"{seen['limit_s']:g} s (${CONTROLLER_SEEN_ENV} plus its --poll-s)")


def controller_warning(seen: dict, desired: DesiredState | None, step: int | None = None) -> str | None:
    """What to tell the operator when a candidate is in the fleet's desired state and no
    controller was seen running (``seen``: :func:`controller_seen`); None otherwise. ``step``:
    the canary's step, when known. Plain text (the caller escapes it for rich).

    At a weight > 0 it is a canary in progress that nothing analyses, advances, promotes or
    rolls back until a controller runs. At weight 0 (:func:`candidate_held`) no user is sent to
    the candidate and no canary is in progress: the line names the record's last change
    (actor, action, generation, time, the reason), says it need not be the change that put the
    candidate there (the record keeps only its last change: a later pause or resume replaces
    it), and says that a controller started now would open a canary of it
    (``RolloutController._maybe_start`` takes a candidate in the record for one). The actor,
    the action and the reason are quoted on one line through :func:`shown`, each cut at
    :data:`NAME_SHOWN_MAX` / :data:`REASON_SHOWN_MAX` characters."""
    if desired is None or desired.candidate is None or seen["running"]:
        return None
    why = _no_controller(seen)
    held = candidate_held(desired)
    if held is not None:
        last = held["last_change"]
        reason = _quote(last["reason"], REASON_SHOWN_MAX)
        actor = _quote(last["actor"], NAME_SHOWN_MAX) or "?"
        action = _quote(last["action"], NAME_SHOWN_MAX) or "set"
        return (f"the candidate {held['version']} is held at 0 % (no user is sent to it); the record's last change "
                f"was {actor}'s \"{action}\" (generation {last['generation']} at {ts(last['updated_ms'])} UTC"
                + (f": {reason}" if reason else "") + "), not necessarily the one that put the candidate there; "
                f"{why}: a controller started now would open a canary of it")
    at = f"step {step} ({desired.weight:.0%})" if step is not None and step >= 0 else f"{desired.weight:.0%}"
    return (f"the canary of {desired.candidate} is in progress but {why}; it stays at {at} until a controller "
            "runs: start `flywheel controller` (or step it with `flywheel controller --once`), or end it by hand "
            "(`flywheel promote --yes` / `flywheel canary abort --yes`)")


def controller_footer(fleet: FleetRecord, desired: DesiredState | None, step: int | None = None) -> str | None:
    """:func:`controller_warning` for a command that already changed the record (``flywheel
    canary start``), with the warning about a bad ``$FLYWHEEL_CONTROLLER_SEEN_S`` if any;
    computed defensively: whatever goes wrong becomes a line of the warning, never an error
    of a command whose change is made."""
    try:
        seen_s, bad = controller_seen_s_or_default()
        w = controller_warning(controller_seen(fleet, seen_s), desired, step)
        return "; ".join(x for x in (bad, w) if x) or None
    except Exception as exc:  # noqa: BLE001 - the change is made: report, never fail on the warning
        return f"could not tell whether a controller runs ({type(exc).__name__}: {exc})"


def discover_pods(fleet: FleetRecord | None, serving: list[str] | None,
                  timeout_s: float) -> tuple[PodDiscovery, str | None]:
    """The fleet's pods: the specs the controller recorded in the desired state (none without
    a ``fleet``), else ``serving`` / ``$FLYWHEEL_SERVING_URL`` (:func:`deploy.operator.pod_specs`), each call
    bounded by ``timeout_s`` (s); and the note to show about where they came from, or None.

    Raises:
        SetupError: a pod spec that is no URL or ``dns+http://`` spec (``usage``).
    """
    unreadable = False
    try:
        d = fleet.read() if fleet is not None else DesiredState()
    except (OSError, ValueError):
        d, unreadable = DesiredState(), True
    specs, note = pod_specs(d, serving, settings.serving_url())
    if unreadable:
        note = (f"the fleet's pod list is in the unreadable desired-state record: showing {', '.join(specs)} "
                "(--serving, else $FLYWHEEL_SERVING_URL)")
    try:
        return PodDiscovery(specs, lambda u: admin(u, timeout_s)), note
    except ValueError as exc:
        raise SetupError(str(exc), usage=True) from None


def status_warnings(slots, desired: DesiredState | None) -> list[str]:
    """What `flywheel status` flags for the on-call engineer about one pod: a slot whose
    served digest differs from the store's manifest (``digest_ok`` False: the version's
    files changed under the same id), and drift from the fleet's desired state (the
    pod's own watch and the controller bring the pod back; a restarted pod serves the record)."""
    out: list[str] = []
    if slots is None:
        return out
    for name, si in (("stable", slots.stable), ("candidate", slots.candidate)):
        if si is not None and si.digest_ok is False:
            fix = (f"`flywheel rollback --to {si.version} --yes` reloads it from the store" if name == "stable"
                   else f"`flywheel rollback --yes` drops it, then `flywheel canary start {si.version} --yes`")
            out.append(f"pod {slots.pod}: {name} {si.version} serves weights digest {si.weights_digest[:12]} but the "
                       f"store's manifest now says {(si.manifest_digest or '')[:12]} (files changed under the same "
                       f"id): {fix}")
    if desired is not None and desired.stable and desired.stable != slots.stable.version:
        out.append(f"pod {slots.pod} serves {slots.stable.version} as stable but the fleet's desired state says "
                   f"{desired.stable} (generation {desired.generation}, {desired.action or 'set'} by "
                   f"{desired.actor or '?'} at {ts(desired.updated_ms)} UTC): the pod's own watch of the record "
                   f"(--desired-poll) and the controller bring it to {desired.stable}, and a restarted pod serves "
                   f"{desired.stable}; to keep "
                   f"{slots.stable.version}, `flywheel rollback --to {slots.stable.version} --yes`")
    elif desired is not None:
        for what in drift(slots, desired):
            out.append(f"pod {slots.pod}: {what} (generation {desired.generation}): converging; if it stays, "
                       "see `flywheel runbook` ('a pod does not converge')")
    return out


@dataclass
class FleetStatus:
    """Everything ``flywheel status`` shows.

    Fields:
        desired: the fleet's desired state (None when unreadable: ``record_err`` says why).
        stable_rec: the stable record, derived from the desired-state record
            (``ModelStore.stable_record``; None when the store is unreadable: ``err``).
        rows: ``(url, slots or None, error or None, drift lines)`` per pod.
        err: the first error reaching the store or a pod ("no serving pod found" when none).
        record_err: the desired-state record's path and why it cannot be read, with how to
            repair it; the pods' drift is then unknown (never "in sync").
        warnings: :func:`status_warnings` of every pod, then :func:`controller_warning` (a
            canary with no controller, or a candidate held at 0 % with none).
        controller: :func:`controller_seen` (None when the store is unreadable).
        rollout: the controller's rollout status; decisions: the last ledger rows.
        note: where the pods came from, when worth saying (table output only).
        store_missing: there is no model store at the configured root (``err`` says so; none
            is created); ``desired`` is then None and the learner's state unknown.
    """

    desired: DesiredState | None = None
    stable_rec: dict | None = None
    rows: list = field(default_factory=list)
    err: str | None = None
    record_err: str | None = None
    warnings: list[str] = field(default_factory=list)
    rollout: RolloutStatus = field(default_factory=RolloutStatus)
    decisions: list = field(default_factory=list)
    note: str | None = None
    controller: dict | None = None
    store_missing: bool = False

    @property
    def first(self):
        """The slots of the first pod that answered, or None."""
        return next((s for _, s, _, _ in self.rows if s is not None), None)

    def failed(self) -> bool:
        """True when a pod or the store is unreachable or the record unreadable (exit 1)."""
        return bool(self.err or self.record_err)

    def to_dict(self) -> dict:
        """The ``-o json|yaml`` document, valid JSON whatever the pods, the record and the
        ledger hold (:func:`json_safe`: no NaN or infinity). ``candidate_held``:
        :func:`candidate_held` of the record (None unless a candidate is at weight 0)."""
        sd = asdict(self.rollout)
        sd["phase"] = self.rollout.phase.value
        d, first = self.desired, self.first
        return json_safe({"desired": asdict(d) if d else None,
                "pods": [{"url": u, "slots": s.model_dump() if s else None, "error": e, "drift": dr}
                         for u, s, e, dr in self.rows],
                "converged": None if d is None else bool(self.rows) and all(not dr for _, _, _, dr in self.rows),
                "serving": first.model_dump() if first else None, "serving_error": self.err,
                "stable_record": self.stable_rec, "warnings": self.warnings,
                "rollout": sd,
                "learner": {"paused": d.paused if d else None},
                "desired_error": self.record_err,
                "controller": self.controller,
                "candidate_held": candidate_held(d),
                "decisions": [asdict(x) for x in self.decisions]})


def gather_status(serving: list[str] | None, timeout_s: float = STATUS_TIMEOUT_S, last: int = 10) -> FleetStatus:
    """Read the fleet's status: the store at ``schemas.settings.store_dir()``, its desired-state
    record, every pod (``serving`` when the record lists none; each call bounded by
    ``timeout_s``, s), the rollout status, the controller's heartbeat and the ``last`` ledger
    decisions.

    A bad ``$FLYWHEEL_CONTROLLER_SEEN_S`` is a warning (the default is used).

    Raises:
        SetupError: a pod spec that is no URL or ``dns+http://`` spec (``usage``).
    """
    seen_s, bad_seen = controller_seen_s_or_default()
    out = FleetStatus()
    missing = False
    try:
        store = ModelStore(settings.store_dir(), create=False)
        out.stable_rec = store.stable_record()
        fleet = FleetRecord(store)
    except StoreMissingError as exc:  # said, and none created; the pods given are still shown
        out.err, fleet, missing = exc.strerror, None, True
        out.store_missing = True
    except Exception as exc:  # noqa: BLE001 - status must show what it can
        out.err = f"model store unreadable: {exc}"
        fleet = None
    if fleet is not None:
        try:
            out.desired = fleet.read()
        except (OSError, ValueError) as exc:  # the pods are still shown, their drift unknown
            why = str(exc).removeprefix(f"{'/'.join(DESIRED_FILE)}: ")
            out.record_err = f"desired-state record unreadable: {fleet.path}: {why} ({RECORD_REPAIR})"
        out.controller = controller_seen(fleet, seen_s)
    if fleet is not None or missing:
        pods, out.note = discover_pods(fleet, serving, timeout_s)
        try:
            out.rows = observe_pods(pods(), out.desired)
        except ServingAdminError as exc:
            out.err = out.err or str(exc)
    errors = [e for _, _, e, _ in out.rows if e]
    out.err = out.err or (errors[0] if errors else None) or (None if out.rows else "no serving pod found")
    out.warnings = [w for _, s, _, _ in out.rows for w in status_warnings(s, out.desired)]
    out.rollout = status_with_record(current_status(rollout_status_path(), settings.ledger_path()), out.desired)
    if bad_seen:
        out.warnings.append(bad_seen)
    if out.controller is not None:
        w = controller_warning(out.controller, out.desired,
                               out.rollout.step if out.rollout.phase == RolloutPhase.CANARY else None)
        if w:
            out.warnings.append(w)
    out.decisions = ledger.decisions(settings.ledger_path(), limit=last)
    return out
