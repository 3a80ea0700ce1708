"""On-call CLI of ``deploy``: controller, status, versions, promote, rollback, canary,
pause/resume (learner), runbook.

Operator actions act on the fleet, not on one pod, and never call a pod's mutating
endpoint: each changes the fleet's desired-state record on the store's shared storage
(:mod:`modelstore.desired`) and appends the decision to the one ledger beside it, then watches
each pod's served generation (:mod:`deploy.operator`) until every pod reports it or
``--timeout`` passes, printing each pod's line; the exit status is 0 only when every pod
converged. The pods converge by themselves (each reads the record every ``--desired-poll``
seconds) and the controller's reconcile loop PUTs the record's target to every pod, so a
rollback converges with or without a controller running. ``canary start|abort`` do the same
with the candidate; the controller analyses and advances a canary an operator started like
its own.

Every action that changes traffic asks for confirmation unless ``--yes`` and is recorded in
the ledger whether it succeeded or failed (decision ``X`` or ``X_FAILED``), with who ran it
(``--actor``, else ``$FLYWHEEL_ACTOR``, else ``$USER``) and why (``--reason``). Every read of
a pod is bounded by ``--serving-timeout-s`` (else ``$FLYWHEEL_SERVING_TIMEOUT_S``) and by
:data:`WATCH_READ_S`, and the whole command by ``--timeout``.

With no model store at the configured root every command but ``status`` exits 1 naming the
root, as ``versions`` does, and creates nothing (no ``versions`` directory, no ledger);
``status`` shows the pods it is given and says the store is missing.
"""

from __future__ import annotations

import getpass
import json
import logging
import os
import time
import unicodedata
from dataclasses import replace
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from deploy import ledger
from deploy.analysis import AnalysisConfig
from deploy.controller import (DEFAULT_STEPS, ControllerConfig, RolloutController, RolloutPhase, current_status,
                               format_steps)
from modelstore.desired import DesiredState, FleetRecord, LockTimeout, RecordUnreadable, dropping
from deploy.discovery import PodDiscovery, check_spec, unique_specs
from deploy.operator import ActionResult, PodChoice, run_action
from deploy.runbook import RUNBOOK
from deploy.serving_client import (DEFAULT_TIMEOUT_S, TIMEOUT_ENV, ServingAdminError, check_timeout,
                                   timeout_from_env)
from deploy.status import (RECORD_REPAIR, STATUS_TIMEOUT_S, FleetStatus, controller_footer,  # noqa: F401
                           discover_pods, gather_status, last_decision, status_warnings)
from deploy.status import ts as _ts
from modelstore.store import CorruptVersionError, ModelStore, StoreMissingError, StoreUnusableError  # noqa: F401
from deploy.wiring import ControllerRunConfig, SetupError, admin, build_controller, rollout_status_path
from deploy.wiring import bootstrap as _bootstrap
from schemas.events import now_ms
from schemas.manifest import version_number
from schemas import settings
from schemas.display import shown
from schemas.options import config_options, model_fields
from schemas.output import OUTPUT, Format, dumps, json_safe, resolve

WATCH_READ_S = 2.0  # bound on each read of a pod while an operator command watches the fleet (s)

console = Console()
if not console.is_terminal and "COLUMNS" not in os.environ:
    console = Console(width=200)  # piped to a file or a pager: do not cut tables at 80 columns


def _data(text) -> str:
    """``text`` (anything from the operator, the record, a pod, the store or the ledger) ready
    to go into rich markup: its control and other unprintable characters shown as escapes
    (:func:`schemas.display.shown`: ``\\x1b``, ``\\n``; a terminal acts on none of them), then
    escaped for rich, so rich prints it as it is, ``[/]``, ``[word]`` and ``[fe80::1]``
    included, never as markup (an unbalanced tag would raise rich's MarkupError)."""
    return escape(shown(str(text)))


def _say(markup: str, text="") -> None:
    """Print ``markup`` (rich markup written in this module, never data) followed by ``text``
    as :func:`_data` makes it. The one way this CLI prints a line of data; a line that embeds
    data in markup passes each piece through :func:`_data`."""
    console.print(markup + _data(text))


def _fleet(store: ModelStore | None = None) -> FleetRecord:
    """The desired-state record of ``store`` (default: the configured store, :func:`_store`).

    Raises:
        StoreMissingError: no ``store`` given and no model store at the configured root.
    """
    return FleetRecord(store or _store())


def learner_paused(fleet: FleetRecord | None = None) -> dict | None:
    """The pause (``{"actor", "at" (ms), "reason"}``) in the fleet's desired state, or None."""
    try:
        return (fleet or _fleet()).read().paused
    except (OSError, ValueError) as exc:  # unreadable record (or a directory): say so rather than "running"
        return {"actor": "unknown", "at": 0, "reason": f"desired-state record unreadable: {exc}"}


def _paused_or_fail() -> dict | None:
    """The pause in the desired state; exit 1 naming the root when there is no model store
    (:func:`_read_store`, creating none), or naming the file when the record is unreadable."""
    fleet = _fleet(_read_store())
    try:
        return fleet.read().paused
    except (OSError, ValueError) as exc:
        _fail(f"{exc}; nothing was changed ({RECORD_REPAIR})")


def pause_learner(actor: str, reason: str = "", fleet: FleetRecord | None = None) -> dict:
    """Record the pause in the fleet's desired state (one generation) and a PAUSE ledger row.
    The learner reads the record before each cycle, wherever it runs.

    Raises:
        StoreMissingError: no ``fleet`` given and no model store at the configured root.
    """
    rec = {"actor": actor, "at": now_ms(), "reason": reason}

    def fn(d: DesiredState) -> DesiredState:
        d.paused = rec
        return d
    new = (fleet or _fleet()).change(fn, actor, "pause", reason)
    ledger.record(settings.ledger_path(), ledger.LedgerEntry(
        version="learner", stable=None, step=-1, weight=0.0, decision="PAUSE",
        reason=f"learner paused by {actor}" + (f": {reason}" if reason else ""), actor=actor,
        numbers={"generation": new.generation}), _bootstrap())
    return rec


def resume_learner(actor: str, reason: str = "", fleet: FleetRecord | None = None) -> dict | None:
    """Clear the pause in the desired state (one generation, its change's reason ``reason``)
    and record a RESUME ledger row (``"learner resumed by <actor>: <reason>"``), as
    :func:`pause_learner` records a pause; returns the pause it ended.

    Raises:
        StoreMissingError: no ``fleet`` given and no model store at the configured root (as
            :func:`pause_learner`).
    """
    fleet = fleet or _fleet()
    prev = fleet.read().paused

    def fn(d: DesiredState) -> DesiredState:
        d.paused = None
        return d
    new = fleet.change(fn, actor, "resume", reason)
    ledger.record(settings.ledger_path(), ledger.LedgerEntry(
        version="learner", stable=None, step=-1, weight=0.0, decision="RESUME",
        reason=f"learner resumed by {actor}" + (f": {reason}" if reason else ""),
        numbers={"paused": prev or {}, "generation": new.generation}, actor=actor), _bootstrap())
    return prev


def _text(s: str | None) -> str | None:
    """Operator text (``--reason``, ``--actor``, ``$FLYWHEEL_ACTOR``) as valid UTF-8: bytes a
    non-UTF-8 terminal sent (Python holds them as lone surrogates) become U+FFFD. A lone
    surrogate cannot be written to the ledger, a manifest or the stable record: a promote
    whose reason held one changed the pod, then failed before the stable record and the
    ledger row were written, so a restart undid it."""
    if s is None:
        return None
    try:
        return s.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    except UnicodeEncodeError:  # a surrogate outside the escape range
        return s.encode("utf-8", "replace").decode("utf-8")


REASON_CONTROLS_ALLOWED = "\t\n"  # the control characters a --reason may hold (a multi-line reason)


def _control_char(s: str, allowed: str = "") -> str | None:
    """Why ``s`` is refused as operator text, or None: it holds a control character (Unicode
    category Cc: C0 with ESC and NUL, DEL, C1 with the 8-bit CSI U+009B) not in ``allowed``,
    which a terminal printing the ledger or the record would act on (``\\x1b[2J`` clears the
    screen). The reason names the first one as ``repr`` writes it and its position."""
    i = next((i for i, c in enumerate(s) if unicodedata.category(c) == "Cc" and c not in allowed), None)
    if i is None:
        return None
    return (f"holds the control character {s[i]!r} at position {i} (a terminal printing it would act on it); "
            "write the text without it")


def _reason_text(s: str | None) -> str | None:
    """``--reason`` as :func:`_text`, refused (exit 2 naming the flag) when it holds a control
    character other than a tab or a line break (:func:`_control_char`)."""
    s = _text(s)
    why = _control_char(s or "", REASON_CONTROLS_ALLOWED)
    if why:
        raise typer.BadParameter(why)
    return s


def _actor_text(s: str | None) -> str | None:
    """``--actor`` as :func:`_text`, refused (exit 2 naming the flag) when it holds any control
    character (:func:`_control_char`): an actor is a name on one line."""
    s = _text(s)
    why = _control_char(s or "")
    if why:
        raise typer.BadParameter(why)
    return s


def _version_text(s: str | None) -> str | None:
    """A version named on the command line (``--to``): None, or a name of the form
    ``v000123`` (:func:`schemas.manifest.version_number`); anything else (a control character,
    an escape, a path) is refused before anything is read or written (exit 2 naming the flag,
    the value as ``repr`` writes it: ``'v\\x1b[2J'``)."""
    if s is None:
        return None
    s = _text(s)
    try:
        version_number(s)
    except ValueError:
        raise typer.BadParameter(f"not a version name of the form v000123, got {s!r} (`flywheel versions` lists "
                                 "the store's)") from None
    return s


def _actor(actor: str | None = None) -> str:
    """Who runs the command: ``--actor``, else ``$FLYWHEEL_ACTOR``, else ``$USER``; exit 2
    naming the variable when the one used holds a control character (:func:`_control_char`)."""
    if actor:
        return _text(actor)
    for var in ("FLYWHEEL_ACTOR", "USER"):
        v = _text(os.environ.get(var) or "")
        if v:
            why = _control_char(v)
            if why:
                _fail(f"${var}: {why}; nothing was changed", usage=True)
            return v
    return _text(getpass.getuser() or "unknown")


def _store() -> ModelStore:
    """The existing model store at ``schemas.settings.store_dir()`` (a directory or an fsspec
    URL), opened without creating anything: the on-call commands act on a store the learner or
    ``flywheel serve`` / ``flywheel model init`` started, never start one.

    Raises:
        StoreMissingError: no ``versions`` directory there (the message names the root).
        StoreUnusableError: the root cannot be a store (a file; the message names the reason).
    """
    return ModelStore(settings.store_dir(), create=False)


def _read_store() -> ModelStore:
    """The model store of every on-call command but ``status`` (``versions``, ``promote``,
    ``rollback``, ``canary start|abort``, ``pause``, ``resume``): :func:`_store`; no store
    there (or a root that cannot be one) exits 1 naming the path, before anything is read,
    asked or written, and creates nothing."""
    try:
        return _store()
    except StoreUnusableError as exc:  # StoreMissingError included
        _fail(exc.strerror or str(exc))


def _timeout(flag: float | None, default: float = DEFAULT_TIMEOUT_S) -> float:
    """``--serving-timeout-s``, else ``$FLYWHEEL_SERVING_TIMEOUT_S``, else ``default``; a
    bad value is a usage error naming the flag or the variable."""
    try:
        return check_timeout(flag, "--serving-timeout-s") if flag is not None else timeout_from_env(default)
    except ValueError as exc:
        _fail(str(exc), usage=True)


def _pods(fleet: FleetRecord, serving: list[str] | None, timeout_s: float, quiet: bool = False) -> PodDiscovery:
    """The fleet's pods (:func:`deploy.status.discover_pods`); prints where they came from
    unless ``quiet``; exit 2 on a pod spec that is no URL or ``dns+http://`` spec."""
    try:
        pods, note = discover_pods(fleet, serving, timeout_s)
    except SetupError as exc:
        _fail(str(exc), usage=True)
    if note and not quiet:
        _say("[yellow]note:[/yellow] ", note)
    return pods


def _record_action(decision: str, version: str | None, stable: str | None, reason: str, actor: str,
                   numbers: dict | None = None, step: int = -1, weight: float = 0.0) -> None:
    """One ledger row for an operator action (step -1, weight 0 unless given: a canary start
    is step 0 at its weight). A ledger that cannot be written is reported, never hides the
    action's own outcome."""
    try:
        ledger.record(settings.ledger_path(), ledger.LedgerEntry(
            version=version or "-", stable=stable, step=step, weight=weight, decision=decision, reason=reason,
            numbers=numbers or {}, actor=actor), _bootstrap())
    except Exception as exc:  # noqa: BLE001 - the operator must still see what happened
        _say(f"[red]could not record {_data(decision)} in the ledger {_data(str(settings.ledger_path()))}:[/red] ",
             exc)


def _action_failed(decision: str, what: str, version: str | None, stable: str | None, actor: str,
                   why: str, msg: str, exc: ServingAdminError | None = None, t0: float | None = None) -> None:
    """Record ``<decision>_FAILED`` (who, why, the error, the pod and failure kind), then
    exit 1 with ``msg``."""
    numbers = {"why": why, "error": msg}
    if exc is not None:
        numbers.update(exc.numbers())
    if t0 is not None:
        numbers["elapsed_s"] = time.monotonic() - t0
    reason = f"{what} by {actor} failed: {msg}" + (f" (why: {why})" if why else "")
    _record_action(f"{decision}_FAILED", version, stable, reason, actor, numbers)
    _fail(msg)


def _because(reason: str, why: str) -> str:
    return reason + (f": {why}" if why else "")


def _confirm(what: str, yes: bool) -> None:
    if not yes and not typer.confirm(f"{shown(what)}?"):
        console.print("aborted")
        raise typer.Exit(1)


def _fail(msg: str, usage: bool = False) -> None:
    """Print ``msg`` (escaped: :func:`_say`); exit 2 for a usage error (a bad flag value), else 1
    (a state or runtime error: nothing to promote, an unreachable pod, an unknown version)."""
    _say("[red]error:[/red] ", msg)
    raise typer.Exit(2 if usage else 1)


def _share(w: float) -> float:
    """A candidate traffic share for ``--weight``: in (0, 1), else a usage error."""
    if not 0.0 < w < 1.0:
        raise typer.BadParameter(f"must be in (0, 1) (a share of users; 1 would leave the stable arm empty), got {w}")
    return w


def _actor_opt():
    return typer.Option(None, "--actor", callback=_actor_text,
                        help="who does this, recorded in the ledger (default $FLYWHEEL_ACTOR, else $USER)")


def _reason_opt():
    return typer.Option("", "--reason", callback=_reason_text, help="why, recorded in the ledger")


def _timeout_opt(default_s: float = DEFAULT_TIMEOUT_S):
    return typer.Option(None, "--serving-timeout-s",
                        help=f"bound on each call to a pod (s; default ${TIMEOUT_ENV}, else {default_s:g})")


def _serving_specs(values: list[str] | None) -> list[str] | None:
    """``--serving`` of an operator command, checked when the command line is parsed, before
    anything is read or written: each a pod URL or ``dns+http://`` spec with no user name or
    password (exit 2 naming ``--serving``, a password masked), each once."""
    if not values:
        return None
    for v in values:
        try:
            check_spec(v)
        except ValueError as exc:
            _fail(f"--{exc}; nothing was changed", usage=True)
    return unique_specs(values)


def _serving_opt():
    return typer.Option(None, "--serving", callback=_serving_specs,
                        help="pod URL or dns+http:// spec (no user:password@), used only when the fleet's desired "
                        "state records no pods, and then recorded there with the change if every spec finds a pod "
                        "and every pod answers (the controller records the ones it discovers); repeatable")


def _record_pods_opt():
    return typer.Option(False, "--record-pods", help="replace the pods recorded in the fleet's desired state with "
                        "the --serving list, in this command's change (a FLEET_PODS ledger row), whatever they "
                        "answer")


def _given(serving: list[str] | None, record_pods: bool) -> tuple[list[str] | None, bool]:
    """``(--serving, --record-pods)``; ``--record-pods`` without ``--serving`` is a usage error."""
    if record_pods and not serving:
        _fail("--record-pods: needs --serving (the pods to record as the fleet's); nothing was changed", usage=True)
    return serving, record_pods


def _wait_opt():
    return typer.Option(60.0, "--timeout", min=0.0, help="how long to watch every pod converge to the changed "
                        "desired state (s); the command returns by then whatever a pod does (hung, stopped, "
                        "unreachable), with each pod's line, and exits 1 if they have not converged (the pods and "
                        "the controller keep converging after it)")


def _yes_opt():
    return typer.Option(False, "--yes", help="do not ask for confirmation")

def _read_desired(fleet: FleetRecord, decision: str, what: str, who: str, why: str) -> DesiredState:
    try:
        return fleet.read()
    except (OSError, ValueError) as exc:
        _action_failed(decision, what, None, None, who, why, f"fleet desired-state record unreadable: {exc}")


def _run(fleet, serving, serving_timeout_s, timeout_s, change, on_changed, decision, what, version, stable, who,
         why_flag, why, row=None) -> ActionResult:
    """:func:`deploy.operator.run_action` with this CLI's pods, ledger rows and failures.
    ``serving``: :func:`_given` (``--serving``, ``--record-pods``). ``row(after) -> {"stable",
    "step", "weight"}`` overrides the ledger rows' fields from the record as written (under
    the lock)."""
    specs, replace_pods = serving
    read_s = min(serving_timeout_s, WATCH_READ_S)  # reads only, each one short
    _pods(fleet, specs, read_s, quiet=True)  # a bad $FLYWHEEL_SERVING_URL: exit 2 before anything is written
    choice = PodChoice(given=specs, default=settings.serving_url(), make_admin=lambda u: admin(u, read_s),
                       replace=replace_pods, probe_s=read_s)
    t0 = time.monotonic()
    fields = {"stable": stable}

    def record(suffix: str, numbers: dict) -> None:
        dec = {"": decision, "converged": "FLEET_CONVERGED", "not_converged": "FLEET_NOT_CONVERGED",
               "pods": "FLEET_PODS"}[suffix]
        # the pod list's row names no version: it is no step of a rollout
        _record_action(dec, None if suffix == "pods" else version, reason=_row_reason(suffix, why, numbers),
                       actor=who, numbers={"why": why_flag, **numbers}, **fields)

    def statuses(before, after) -> None:  # the record changed: a status write that fails is reported, not fatal
        if row is not None:
            fields.update(row(after))
        try:
            on_changed(before, after)
        except Exception as exc:  # noqa: BLE001 - e.g. a corrupt manifest of the version replaced
            _say("[red]could not update the store's version statuses:[/red] ", exc)

    try:
        return run_action(fleet, choice, change, what=what, who=who, why=why, on_changed=statuses,
                          record=record, timeout_s=timeout_s)
    except ValueError as exc:
        _action_failed(decision, what, version, stable, who, why_flag, str(exc), t0=t0)
    except LockTimeout as exc:
        _action_failed(decision, what, version, stable, who, why_flag, f"{exc}; nothing was changed", t0=t0)


def _row_reason(suffix: str, why: str, numbers: dict) -> str:
    """The reason of an operator action's ledger row: the decision (``suffix`` ""), with the
    generation the pods took when the record was written again past it; the watch's end
    (``converged`` / ``not_converged``), with how many pods converged, or why no pod was
    watched; the pod list's change (``pods``), with the list before and after."""
    if suffix == "pods":
        how = "replaced by --record-pods" if numbers.get("replaced") else "recorded from --serving"
        return (f"{why}: the fleet's pods {how}: {', '.join(numbers['pods']) or 'none'} "
                f"(were {', '.join(numbers['was']) or 'none'})")
    if suffix == "":
        if numbers.get("raised_from") is not None:
            return (f"{why} (desired state written again as generation {numbers['generation']}, past generation "
                    f"{numbers['pods_took']} the pods took)")
        return why
    p = numbers.get("pods") or {}
    if not p.get("pods"):
        return f"{why} (no pod to watch: {numbers.get('discovery_error') or 'no pod found'})"
    return f"{why} ({p['converged']} of {p['pods']} pods converged)"


def _report(res: ActionResult, done: str, target: str, hint: str = "", footer: str | None = None) -> None:
    """Print each pod's outcome and the end (``hint`` too when not every pod converged), then
    ``footer`` as a warning when given; exit 1 unless every pod converged. Text from pods,
    the record and the store is escaped: rich prints it as it is."""
    for note in res.notes:
        _say("[yellow]note:[/yellow] ", note)
    for o in res.outcomes:
        _say("  [green]ok[/green] " if o.ok else "  [red]!![/red] ", o.line())
    if res.discovery_error:
        _say("[red]pods could not be listed:[/red] ", res.discovery_error)
    n, k = len(res.outcomes), sum(o.ok for o in res.outcomes)
    if res.superseded_by is not None:
        s = res.superseded_by
        console.print(f"[red]superseded:[/red] generation {s.generation} ({_data(str(s.action))} by "
                      f"{_data(str(s.actor))}) "
                      f"replaced this action before every pod converged; the fleet now converges to: "
                      f"{_data(s.summary())}")
        if footer:
            _say("[red]warning:[/red] ", footer)
        raise typer.Exit(1)
    if res.converged:
        console.print(f"{done} on all {n} pods ({res.elapsed_s:.2f} s; desired state generation "
                      f"{res.desired.generation})")
        if footer:
            _say("[red]warning:[/red] ", footer)
        return
    serve = (f"{k} of {n} pods serve it after {res.elapsed_s:.1f} s" if n else
             f"no pod to watch ({_data(res.discovery_error or 'no pod found')})")
    console.print(f"[red]not converged:[/red] the fleet's desired state is {_data(res.desired.summary())}; {serve}. "
                  "The record is changed: each pod converges to it by itself "
                  "when it can (it reads the record every --desired-poll s), and the controller retries it at each "
                  "poll. A pod that is stopped or hung converges once it runs again; a refused version stays "
                  "refused (`flywheel status` shows each pod; `flywheel runbook`: 'a pod does not converge')." +
                  _data(f" {hint[0].upper()}{hint[1:]}." if hint else ""))
    if footer:
        _say("[red]warning:[/red] ", footer)
    raise typer.Exit(1)


def _controller_once(ctl: RolloutController) -> None:
    """`flywheel controller --once`: reconcile, print, exit 1 when the step failed or a pod
    did not converge."""
    try:
        st = ctl.run_once()
    except (ServingAdminError, LockTimeout) as exc:
        _fail(str(exc))
    except RecordUnreadable as exc:
        _fail(f"desired-state record {ctl.record_path()} unreadable ({exc}): no pod was changed ({RECORD_REPAIR})")
    _say("", f"phase={st.phase.value} candidate={st.candidate} step={st.step} "
             f"weight={st.weight} last={last_decision(st.last_outcome, st.last_reason)}")
    bad = [o for o in ctl.last_outcomes if not o.ok]
    for o in bad:
        _say("[red]pod not converged:[/red] ", o.line())
    if st.last_outcome == "FAILED" or bad:
        _say("[red]error:[/red] ", f"the step failed ({st.last_outcome if st.last_outcome == 'FAILED' else ''}"
             f"{len(bad)} of {len(ctl.last_outcomes)} pods not converged)")
        raise typer.Exit(1)


def _version_row(store: ModelStore, v: str, stable: str | None) -> dict:
    """One row of `flywheel versions`; a version whose manifest cannot be read is ``corrupt``."""
    try:
        m = store.manifest(v)
    except CorruptVersionError as exc:
        return {"version": v, "stable": v == stable, "status": "corrupt", "error": str(exc)}
    return {"version": v, "stable": v == stable, "parent": m.parent, "kind": m.kind, "created_at": m.created_at,
            "size_bytes": m.size_bytes, "snapshot_bytes": m.snapshot_bytes,
            "delta_ratio": (m.snapshot_bytes / m.size_bytes) if m.size_bytes else None,
            "status": m.status_history[-1].status if m.status_history else "",
            "digest": m.weights_digest, "metrics": m.metrics}


def canary_start(version: str = typer.Argument(..., help="version to canary, e.g. v000003"),
                 weight: float = typer.Option(DEFAULT_STEPS[0], "--weight", callback=_share,
                                              help="share of users sent to VERSION at the "
                                              "first step, in (0, 1) (the controller's default first step)"),
                 serving: Optional[list[str]] = _serving_opt(),
                 record_pods: bool = _record_pods_opt(),
                 actor: Optional[str] = _actor_opt(), reason: str = _reason_opt(),
                 serving_timeout_s: Optional[float] = _timeout_opt(), timeout: float = _wait_opt(),
                 yes: bool = _yes_opt()) -> None:
    """Load VERSION as the candidate on every pod at --weight (also a version the controller
    skipped or rolled back); the controller then analyses and advances it like its own.
    Refused while a canary is in progress. Returns when every pod serves it or --timeout
    passes (exit 1), printing each pod's outcome."""
    who, serving_timeout_s = _actor(actor), _timeout(serving_timeout_s)  # flags first: usage errors exit 2
    serving = _given(serving, record_pods)
    store = _read_store()
    fleet = _fleet(store)
    what = f"canary start of {version}"
    if version not in store.versions():
        _action_failed("MANUAL_CANARY_START", what, version, None, who, reason,
                       f"version: {version!r} is not in the store (it has "
                       f"{', '.join(store.versions()) or 'none'})")
    try:
        store.manifest(version)
    except CorruptVersionError as exc:
        _action_failed("MANUAL_CANARY_START", what, version, None, who, reason, f"version: {exc}")
    d = _read_desired(fleet, "MANUAL_CANARY_START", what, who, reason)
    _confirm(f"start a canary of {version} at {weight:.0%} on every pod (stable {d.stable})", yes)
    why = _because(f"canary of {version} against {d.stable} at {weight:.0%}, started by {who}", reason)

    def change(x: DesiredState) -> DesiredState:  # under the fleet lock: the record as it is now
        if x.candidate is not None:
            raise ValueError(f"candidate: a canary of {x.candidate} at {x.weight:.0%} is in progress "
                             f"(generation {x.generation}, {x.action or 'set'} by {x.actor or '?'}); "
                             "`flywheel canary abort --yes` first")
        if x.stable == version:
            raise ValueError(f"version: {version} is the fleet's stable version")
        x.candidate, x.weight = version, weight
        return x

    def on_changed(before, after):
        store.set_status(version, "canary", why, actor=who)

    res = _run(fleet, serving, serving_timeout_s, timeout, change, on_changed, "MANUAL_CANARY_START", what,
               version, d.stable, who, reason, why,
               row=lambda after: {"stable": after.stable, "step": 0, "weight": after.weight})
    _report(res, f"canary of {version} at {weight:.0%} started", version,
            hint="to take the candidate back: `flywheel canary abort --yes`",
            footer=controller_footer(fleet, res.desired, 0))

def canary_abort(serving: Optional[list[str]] = _serving_opt(),
                 record_pods: bool = _record_pods_opt(),
                 actor: Optional[str] = _actor_opt(), reason: str = _reason_opt(),
                 serving_timeout_s: Optional[float] = _timeout_opt(), timeout: float = _wait_opt(),
                 yes: bool = _yes_opt()) -> None:
    """Abort the canary in progress: drop the candidate on every pod (stable takes all
    traffic) and mark it aborted (the controller does not start it again by itself).
    Returns when every pod dropped it or --timeout passes (exit 1), printing each pod's outcome."""
    who, serving_timeout_s = _actor(actor), _timeout(serving_timeout_s)  # flags first: usage errors exit 2
    serving = _given(serving, record_pods)
    store = _read_store()
    fleet = _fleet(store)
    d = _read_desired(fleet, "MANUAL_CANARY_ABORT", "canary abort", who, reason)
    st = current_status(rollout_status_path(), settings.ledger_path())
    cand = d.candidate or (st.candidate if st.phase == RolloutPhase.CANARY else None)
    if cand is None:
        _action_failed("MANUAL_CANARY_ABORT", "canary abort", st.candidate, d.stable, who, reason,
                       f"no canary in progress (phase {st.phase.value}, no candidate in the fleet's desired "
                       "state); to drop a loaded candidate use `flywheel rollback`")
    _confirm(f"abort the canary of {cand} at {d.weight:.0%} on every pod (stable {d.stable} takes all traffic)",
             yes)
    why = _because(f"canary of {cand} aborted by {who} at step {st.step} ({d.weight:.0%})", reason)
    res = _drop_candidate(store, fleet, d, cand, serving, serving_timeout_s, timeout, who, reason, why,
                          decision="MANUAL_CANARY_ABORT", what=f"canary abort of {cand}", mark="aborted",
                          outcome="MANUAL_CANARY_ABORT", step=st.step)
    _report(res, f"aborted the canary of {cand}; stable {d.stable} serves all traffic", d.stable)

def pause_cmd(reason: str = typer.Option("", callback=_reason_text, help="why (shown in status and the ledger)"),
              actor: Optional[str] = _actor_opt(),
              yes: bool = _yes_opt()) -> None:
    """Pause the learner (through the fleet's desired state, wherever the learner runs): it
    publishes nothing new until `flywheel resume` (a cycle already running finishes)."""
    cur = _paused_or_fail()
    if cur:
        _say("", f"learner already paused by {cur['actor']} at {_ts(cur['at'])}: {cur.get('reason', '')}")
        return
    _confirm("pause the learner", yes)
    pause_learner(_actor(actor), reason)
    _say("", f"learner paused by {_actor(actor)} (fleet desired state, {_fleet().read().summary()})")

def resume_cmd(reason: str = _reason_opt(),
               actor: Optional[str] = _actor_opt(),
               yes: bool = _yes_opt()) -> None:
    """Resume the learner after `flywheel pause`."""
    cur = _paused_or_fail()
    if not cur:
        console.print("learner is not paused")
        return
    _confirm(f"resume the learner (paused by {cur['actor']})", yes)
    resume_learner(_actor(actor), reason)
    _say("", f"learner resumed by {_actor(actor)}")

def runbook_cmd(as_json: bool = typer.Option(False, "--json", help="machine-readable output (-o json)"),
                output: Optional[Format] = OUTPUT) -> None:
    """On-call runbook: symptom -> what to check -> which command."""
    fmt = resolve(output, as_json)
    if fmt in (Format.json, Format.yaml):
        typer.echo(dumps([{"symptom": a, "check": b, "command": c} for a, b, c in RUNBOOK], fmt))
        return
    t = Table(title="flywheel runbook", show_lines=True)
    for c in ("symptom", "what to check", "command"):
        t.add_column(c)
    for row in RUNBOOK:
        t.add_row(*row)
    console.print(t)


def _model_error(exc: ValueError) -> str:
    """The first reason of a config model's error, without pydantic's framing."""
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return str(exc)
    e = errors()[0]
    msg = e["msg"].removeprefix("Value error, ")
    return msg if not e["loc"] or msg.startswith(f"{e['loc'][0]}:") else f"{e['loc'][0]}: {msg}"


def _setup_failed(exc: SetupError) -> None:
    """Exit for a controller that cannot be assembled: 2 for a bad setting (naming the flag), else 1."""
    if exc.param_hint:
        raise typer.BadParameter(str(exc), param_hint=exc.param_hint)
    _fail(str(exc), usage=exc.usage)


# its own options are annotated `X | None`, not Optional[X]: config_options' wrapper resolves
# them in schemas.options' namespace
@config_options(run=ControllerRunConfig, policy=ControllerConfig, analysis=AnalysisConfig)
def controller_cmd(run: ControllerRunConfig, policy: ControllerConfig, analysis: AnalysisConfig, *,
                   once: bool = typer.Option(False, "--once", help="reconcile until terminal, idle or holding, "
                                             "then exit"),
                   steps: str | None = typer.Option(None, "--steps", help=model_fields(ControllerConfig)["steps"]
                                                       .description + f" (default {format_steps(DEFAULT_STEPS)})"),
                   serving_timeout_s: float | None = _timeout_opt()) -> None:
    """Canary each newly published version (load, step traffic, analyze, promote or roll back)
    and keep every pod on the fleet's desired state. `--once` exits 1 when the step it ran
    failed (FAILED) or a pod did not converge."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        policy = replace(policy, analysis=analysis, **({} if steps is None else {"steps": steps}))
    except ValueError as exc:
        msg = _model_error(exc)
        if msg.startswith("steps:") and "not a comma-separated" in msg:
            raise typer.BadParameter(msg.removeprefix("steps: "), param_hint="--steps") from None
        _fail(msg, usage=True)
    timeout_s = _timeout(serving_timeout_s)
    try:
        ctl = build_controller(run, policy, timeout_s)
    except SetupError as exc:
        _setup_failed(exc)
    if once:
        _controller_once(ctl)
        return
    ctl.run_forever(run.poll_s)


def status_cmd(serving: Optional[list[str]] = typer.Option(
                   None, help="pod URL or dns+http:// spec, used when the fleet's desired state records no "
                              "pods (the controller records its own)"),
               as_json: bool = typer.Option(False, "--json", help="machine-readable output (-o json)"),
               output: Optional[Format] = OUTPUT,
               last: int = typer.Option(10, min=1, max=100_000, help="decisions to show (1-100000)"),
               serving_timeout_s: Optional[float] = _timeout_opt(STATUS_TIMEOUT_S)) -> None:
    """The fleet's desired state, every pod (stable, digest, candidate, weight) with its drift
    from it, the store's stable record, canary phase and step, last decisions, and a warning
    when the record holds a candidate (a canary in progress, or one held at 0 % by an eval) and
    no controller was seen running (its heartbeat older than $FLYWHEEL_CONTROLLER_SEEN_S plus
    its poll). Exits 1 when a pod does not answer or the
    desired-state record is unreadable."""
    fmt = resolve(output, as_json)
    try:
        s = gather_status(serving, _timeout(serving_timeout_s, STATUS_TIMEOUT_S), last)
    except SetupError as exc:
        _fail(str(exc), usage=True)
    if fmt in (Format.json, Format.yaml):
        typer.echo(dumps(s.to_dict(), fmt))
    else:
        if s.note and fmt == Format.table:
            _say("[yellow]note:[/yellow] ", s.note)
        _print_pods(s, fmt)
        _print_rollout(s, fmt)
    if s.failed():
        raise typer.Exit(1)  # scripts can tell "serving down" from the exit status


# `flywheel status`'s tables show a value on one line, cut to this many characters (the last one
# "…") so that one long value (a version or an actor full of escaped control characters) cannot
# squeeze the other columns to nothing; `-o json` holds the whole value. Names and versions fit
# in CELL_SHOWN_MAX, a whole sha256 digest (-o wide) in DIGEST_SHOWN_MAX, a pod's cluster DNS URL
# in URL_SHOWN_MAX. The columns of text that wraps (drift, reason, numbers) are not cut.
CELL_SHOWN_MAX = 40
DIGEST_SHOWN_MAX = 64
URL_SHOWN_MAX = 80


def _cut_column(t: Table, name: str, max_chars: int = CELL_SHOWN_MAX) -> None:
    """Add column ``name`` to ``t``: one line per cell, at most ``max_chars`` characters wide,
    a longer value cut with an ellipsis."""
    t.add_column(name, no_wrap=True, overflow="ellipsis", max_width=max_chars)


def _print_pods(s: FleetStatus, fmt: Format) -> None:
    """`flywheel status`'s desired state, pods table, drift count, errors and warnings. Every
    string read from the store, a pod or the ledger is escaped: rich prints it as it is."""
    desired = s.desired
    if desired is not None:
        console.print(f"desired state: [bold]{_data(desired.summary())}[/bold] (last change: "
                      f"{_data(desired.action or '-')} by {_data(desired.actor or '-')} at {_ts(desired.updated_ms)} "
                      "UTC)")
    elif s.record_err:
        _say("[red]error:[/red] ", s.record_err)
    t = Table(title="serving pods")
    for c in ("pod", "url", "stable", "digest", "= manifest", "candidate", "weight", "loaded at (UTC)"):
        _cut_column(t, c, {"url": URL_SHOWN_MAX, "digest": DIGEST_SHOWN_MAX}.get(c, CELL_SHOWN_MAX))
    t.add_column("drift", overflow="fold")
    ok = {True: "yes", False: "[red]NO[/red]", None: "?"}
    dig = None if fmt == Format.wide else 12  # -o wide: whole digests
    unknown = desired is None  # no record (no store, or unreadable): no pod can be called in sync
    why = "no store" if s.store_missing else "record unreadable" if s.record_err else "store unreadable"
    for url, p, e, dr in s.rows:
        if p is None:  # the failure's kind, the word operator commands print for it too
            t.add_row("?", _data(url), "", "", "", "", "", "",
                      f"[red]{_data(dr[0] if dr else 'error')}[/red]: {_data(e or '')}")
            continue
        t.add_row(_data(p.pod), _data(url), _data(p.stable.version), _data(p.stable.weights_digest[:dig]),
                  ok[p.stable.digest_ok],
                  (_data(p.candidate.version) + (" [red]digest NO[/red]" if p.candidate.digest_ok is False else ""))
                  if p.candidate else "-", f"{p.candidate_weight:.0%}", _ts(p.stable.loaded_at),
                  "[red]" + _data("; ".join(dr)) + "[/red]" if dr else f"[red]unknown[/red] ({why})"
                  if unknown else "in sync")
    console.print(t)
    n_ok = sum(1 for _, _, _, dr in s.rows if not dr)
    listed = f"{len(s.rows)} pod{'' if len(s.rows) == 1 else 's'} listed"
    if unknown and s.store_missing:
        console.print(f"[red]drift unknown:[/red] there is no model store, so no desired state to judge a pod's "
                      f"drift from ({listed})")
    elif unknown:
        console.print(f"[red]drift unknown:[/red] the desired state cannot be read, so no pod's drift from it can "
                      f"be judged ({listed})")
    else:
        console.print(f"{n_ok} of {len(s.rows)} pods serve the desired state" +
                      ("" if n_ok == len(s.rows) and s.rows else " ([red]drift[/red])"))
    if s.err:
        _say("[red]serving error:[/red] ", s.err)
    if s.stable_rec:
        console.print(f"store stable record: {_data(str(s.stable_rec['version']))} (set by "
                      f"{_data(str(s.stable_rec.get('actor') or '?'))} at {_ts(s.stable_rec.get('at') or 0)} UTC)")
    for w in s.warnings:
        _say("[red]warning:[/red] ", w)


def _print_rollout(s: FleetStatus, fmt: Format) -> None:
    """`flywheel status`'s rollout line, learner state and decisions table."""
    st, desired = s.rollout, s.desired
    console.print(f"rollout: phase=[bold]{st.phase.value}[/bold] candidate={_data(str(st.candidate))} "
                  f"stable={_data(str(st.stable))} step={st.step} weight={st.weight:.0%} "
                  f"last={_data(last_decision(st.last_outcome, st.last_reason))}")
    lp = desired.paused if desired else None
    if s.record_err:
        console.print("learner: unknown (a learner that cannot read the record does not train)")
    elif desired is None:
        console.print("learner: unknown (" + ("no store" if s.store_missing else "store unreadable") + ")")
    else:
        console.print("learner: " + (f"[yellow]PAUSED[/yellow] by {_data(str(lp.get('actor')))} at "
                                     f"{_ts(lp.get('at') or 0)} UTC: {_data(str(lp.get('reason', '')))}"
                                     if lp else "running (not paused)"))
    t = Table(title="last decisions")
    for c in ("time (UTC)", "version", "stable", "step", "weight", "decision", "actor"):
        _cut_column(t, c)
    t.add_column("reason", ratio=1, overflow="fold")
    if fmt == Format.wide:
        t.add_column("numbers", overflow="fold")
    for d in s.decisions:
        t.add_row(_ts(d.ts), _data(d.version), _data(d.stable or ""), str(d.step), f"{d.weight:.0%}",
                  _data(d.decision), _data(d.actor), _data(d.reason),
                  *([_data(json.dumps(json_safe(d.numbers), default=str))] if fmt == Format.wide else []))
    console.print(t)


def versions_cmd(as_json: bool = typer.Option(False, "--json", help="machine-readable output (-o json)"),
                 output: Optional[Format] = OUTPUT) -> None:
    """Versions in the model store: parent, kind, size, delta ratio, status (``corrupt`` when
    the manifest cannot be read, with the reason). Exits 1 when there is no model store
    (creating none)."""
    store = _read_store()
    stable = store.stable()
    rows = [_version_row(store, v, stable) for v in store.versions()]
    fmt = resolve(output, as_json)
    if fmt in (Format.json, Format.yaml):
        typer.echo(dumps(rows, fmt))
        return
    wide = fmt == Format.wide  # whole digests and the manifests' metrics
    t = Table(title=f"model store {store.root}")
    for c in ("version", "stable", "parent", "kind", "size", "snapshot/size", "status", "digest",
              "created (UTC)") + (("metrics",) if wide else ()):
        t.add_column(c, no_wrap=c != "metrics", overflow="fold")
    for r in rows:
        if r["status"] == "corrupt":
            t.add_row(_data(r["version"]), "*" if r["stable"] else "", "", "", "", "", "[red]corrupt[/red]",
                      _data(r["error"]), "")
            continue
        t.add_row(_data(r["version"]), "*" if r["stable"] else "", _data(r["parent"] or ""), _data(r["kind"]),
                  f"{r['size_bytes'] / 1e6:.2f} MB", f"{r['delta_ratio']:.1f}x" if r["delta_ratio"] else "",
                  _data(r["status"]), _data(r["digest"] if wide else r["digest"][:12]), _ts(r["created_at"]),
                  *([_data(json.dumps(json_safe(r["metrics"]), default=str))] if wide else []))
    console.print(t)

def promote_cmd(serving: Optional[list[str]] = _serving_opt(),
                record_pods: bool = _record_pods_opt(),
                actor: Optional[str] = _actor_opt(), reason: str = _reason_opt(),
                serving_timeout_s: Optional[float] = _timeout_opt(), timeout: float = _wait_opt(),
                yes: bool = _yes_opt()) -> None:
    """Promote the fleet's candidate to stable on every pod (hot swap); it becomes the store's
    stable record. Returns when every pod serves it or --timeout passes (exit 1), printing
    each pod's outcome."""
    who, serving_timeout_s = _actor(actor), _timeout(serving_timeout_s)  # flags first: usage errors exit 2
    serving = _given(serving, record_pods)
    store = _read_store()
    fleet = _fleet(store)
    d = _read_desired(fleet, "MANUAL_PROMOTE", "manual promote", who, reason)
    if d.candidate is None:
        _action_failed("MANUAL_PROMOTE", "manual promote", None, d.stable, who, reason,
                       "no candidate in the fleet's desired state: nothing to promote (`flywheel status` "
                       "shows what each pod serves)")
    cand, stable = d.candidate, d.stable
    _confirm(f"promote {cand} (replacing {stable}) on every pod", yes)
    why = _because(f"manual promote by {who}", reason)

    def change(x: DesiredState) -> DesiredState:
        if x.candidate != cand:
            raise ValueError(f"candidate: the desired state changed meanwhile (candidate now {x.candidate})")
        x.stable, x.candidate, x.weight, x.reload_after_ms = cand, None, 0.0, 0
        return x

    def on_changed(before, after):  # the version's status history, derived from the record's change
        store.set_status(cand, "promoted", why, actor=who)

    res = _run(fleet, serving, serving_timeout_s, timeout, change, on_changed, "MANUAL_PROMOTE",
               f"manual promote of {cand}", cand, stable, who, reason, why)
    _report(res, f"stable is now {cand}", cand)

def rollback_cmd(to: Optional[str] = typer.Option(None, "--to", callback=_version_text,
                                                  help="version to restore as stable (v000123)"),
                 serving: Optional[list[str]] = _serving_opt(),
                 record_pods: bool = _record_pods_opt(),
                 actor: Optional[str] = _actor_opt(), reason: str = _reason_opt(),
                 serving_timeout_s: Optional[float] = _timeout_opt(), timeout: float = _wait_opt(),
                 yes: bool = _yes_opt()) -> None:
    """Drop the fleet's candidate if there is one; otherwise (or with --to) make stable the
    version stable before it (or VERSION) on every pod, and the store's stable record.
    `--to` the version already stable reloads it from the store on every pod (verified).
    Returns when every pod serves it or --timeout passes (exit 1), printing each pod's outcome."""
    who, serving_timeout_s = _actor(actor), _timeout(serving_timeout_s)  # flags first: usage errors exit 2
    serving = _given(serving, record_pods)
    store = _read_store()
    fleet = _fleet(store)
    if to is not None:  # the store first: a version that does not exist is named as such, no pod asked
        try:
            store.manifest(to)
        except (KeyError, ValueError) as exc:
            why = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc  # str(KeyError) is its repr
            _action_failed("MANUAL_ROLLBACK", f"manual rollback to {to}", to, None, who, reason, f"--to: {why}")
    d = _read_desired(fleet, "MANUAL_ROLLBACK", "manual rollback", who, reason)
    stable, cand = d.stable, d.candidate
    if to is None and cand is not None:
        _confirm(f"drop candidate {cand} on every pod (stable {stable} keeps all traffic)", yes)
        why = _because(f"manual rollback of candidate by {who}", reason)
        res = _drop_candidate(store, fleet, d, cand, serving, serving_timeout_s, timeout, who, reason, why,
                              decision="MANUAL_ROLLBACK", what=f"manual rollback of candidate {cand}",
                              mark="rolled_back", outcome="ROLLBACK")
        _report(res, f"dropped candidate {cand}; stable is {stable}", stable)
        return
    if to is None:
        to = store.previous_stable(stable) if stable is not None else None
        if to is None:
            _action_failed("MANUAL_ROLLBACK", "manual rollback", None, stable, who, reason,
                           (f"no earlier stable version than {stable} to roll back to" if stable is not None else
                            "no stable version in the fleet's desired state: nothing to roll back to") +
                           " (see `flywheel versions`)")
    reload = to == stable
    _confirm(f"reload stable {to} from the store on every pod" if reload else f"replace stable {stable} by {to}",
             yes)
    why = _because(f"manual rollback of stable {stable} to {to} by {who}", reason)
    asked_ms = now_ms()

    def change(x: DesiredState) -> DesiredState:
        x.stable, x.candidate, x.weight = to, None, 0.0
        x.reload_after_ms = asked_ms if reload else 0
        return x

    def on_changed(before, after):
        if before.stable != to and before.stable:
            store.set_status(before.stable, "rolled_back", why)
        store.set_status(to, "promoted", why, actor=who)
        if before.candidate is not None:
            store.set_status(before.candidate, "rolled_back", why)

    res = _run(fleet, serving, serving_timeout_s, timeout, change, on_changed, "MANUAL_ROLLBACK",
               f"manual rollback of stable {stable} to {to}", to, stable, who, reason, why)
    _report(res, f"stable is now {to}" + (" (reloaded from the store, verified)" if reload else ""), to)


def _drop_candidate(store: ModelStore, fleet: FleetRecord, d: DesiredState, cand: str, serving,
                    serving_timeout_s: float, timeout: float, who: str, reason: str, why: str, *, decision: str,
                    what: str, mark: str, outcome: str, step: int = -1) -> ActionResult:
    """`flywheel rollback` (while a candidate is in the desired state) and `flywheel canary
    abort`: :func:`modelstore.desired.dropping`, the "drop the candidate" change the controller's
    rollback, abort and failed load use too. Under the fleet lock it is refused (nothing
    changed, ``<decision>_FAILED``) when the record's candidate is no longer ``d.candidate``
    (another operator or the controller changed it since ``d`` was read); else the candidate
    and its weight leave the record, ``cand`` is marked ``mark`` in the store (its status
    history), and the command watches every pod converge as in :func:`_run`. The controller's
    rollout status follows from the record and the ledger row (``outcome`` names it there)."""
    def dropped(before, after):
        store.set_status(cand, mark, why)

    return _run(fleet, serving, serving_timeout_s, timeout, dropping(d.candidate), dropped, decision, what, cand,
                d.stable, who, reason, why, row=lambda after: {"stable": after.stable, "step": step, "weight": 0.0})


def register(app: typer.Typer) -> None:
    """Add ``controller``, ``status``, ``versions``, ``promote``, ``rollback``,
    ``canary start|abort``, ``pause``, ``resume`` and ``runbook``."""
    canary = typer.Typer(help="Start or abort a canary on every pod (the fleet's desired state); the controller "
                              "analyses and advances it.", no_args_is_help=True)
    app.add_typer(canary, name="canary")
    canary.command("start")(canary_start)
    canary.command("abort")(canary_abort)
    for name, fn in (("pause", pause_cmd), ("resume", resume_cmd), ("runbook", runbook_cmd),
                     ("controller", controller_cmd), ("status", status_cmd), ("versions", versions_cmd),
                     ("promote", promote_cmd), ("rollback", rollback_cmd)):
        app.command(name)(fn)
