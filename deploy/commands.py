"""On-call CLI of ``deploy``: controller, status, versions, promote, rollback, canary,
pause/resume (learner), runbook.

Operator actions act on the fleet, not on one pod: each writes the intent into the fleet's
desired-state record on the store's shared storage (:mod:`deploy.desired`), then brings every
pod to it through the controller's own reconcile code (:mod:`deploy.operator`) and returns
when every pod serves it or ``--timeout`` passes, printing each pod's outcome; the exit status
is 0 only when every pod converged. ``canary start|abort`` do the same with the candidate
(load it at the first weight, or drop it); the controller analyses and advances a canary an
operator started like its own.

Every action that changes traffic asks for confirmation unless ``--yes`` and is recorded in
the ledger whether it succeeded or failed (decision ``X`` or ``X_FAILED``), with who ran it
(``--actor``, else ``$FLYWHEEL_ACTOR``, else ``$USER``) and why (``--reason``). Every call to
a pod is bounded by ``--serving-timeout-s`` (else ``$FLYWHEEL_SERVING_TIMEOUT_S``).
"""

from __future__ import annotations

import functools
import getpass
import json
import logging
import os
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from deploy import ledger
from deploy.analysis import AnalysisConfig
from deploy.controller import (DEADLINE_OUTCOMES, DEFAULT_STEPS, ControllerConfig, RolloutController,
                               RolloutPhase, RolloutStatus, current_status)
from deploy.desired import DesiredState, FleetRecord, LockTimeout
from deploy.discovery import PodDiscovery
from deploy.fleet import drift, observe_pods
from deploy.operator import ActionResult, pod_specs, run_action
from deploy.runbook import RUNBOOK
from deploy.serving_client import (DEFAULT_TIMEOUT_S, TIMEOUT_ENV, ServingAdmin, ServingAdminError,
                                   check_timeout, timeout_from_env)
from deploy.store import CorruptVersionError, ModelStore
from schemas.output import OUTPUT, Format, dumps, resolve
from schemas import settings

console = Console()
if not console.is_terminal and "COLUMNS" not in os.environ:
    console = Console(width=200)  # piped to a file or a pager: do not cut tables at 80 columns


def rollout_status_path() -> Path:
    """Where the controller persists its :class:`RolloutStatus` (a cache of the ledger)."""
    return settings.home() / "deploy" / "rollout.json"


def _fleet(store: ModelStore | None = None) -> FleetRecord:
    """The desired-state record of the configured store."""
    return FleetRecord(store or _store())


def learner_paused(fleet: FleetRecord | None = None) -> dict | None:
    """The pause (``{"actor", "at" (ms), "reason"}``) in the fleet's desired state, or None."""
    try:
        return (fleet or _fleet()).read().paused
    except ValueError as exc:  # unreadable record: say so rather than "running"
        return {"actor": "unknown", "at": 0, "reason": f"desired-state record unreadable: {exc}"}


RECORD_REPAIR = ("repair it from a backup, or remove it: the record then restarts from the store's stable "
                 "record, unpaused, with no candidate, and the controller reconciles every pod to that")


def _paused_or_fail() -> dict | None:
    """The pause in the desired state; exit 1 naming the file when the record is unreadable."""
    try:
        return _fleet().read().paused
    except ValueError as exc:
        _fail(f"{exc}; nothing was changed ({RECORD_REPAIR})")


def pause_learner(actor: str, reason: str = "", fleet: FleetRecord | None = None) -> dict:
    """Record the pause in the fleet's desired state (one generation) and a PAUSE ledger row.
    The learner reads the record before each cycle, wherever it runs."""
    rec = {"actor": actor, "at": int(time.time() * 1000), "reason": reason}

    def fn(d: DesiredState) -> DesiredState:
        d.paused = rec
        return d
    new = (fleet or _fleet()).change(fn, actor, "pause", reason)
    ledger.record(settings.ledger_path(), ledger.LedgerEntry(
        version="learner", stable=None, step=-1, weight=0.0, decision="PAUSE",
        reason=f"learner paused by {actor}" + (f": {reason}" if reason else ""), actor=actor,
        numbers={"generation": new.generation}), _bootstrap())
    return rec


def resume_learner(actor: str, fleet: FleetRecord | None = None) -> dict | None:
    """Clear the pause in the desired state and record a RESUME ledger row; returns the pause it ended."""
    fleet = fleet or _fleet()
    prev = fleet.read().paused

    def fn(d: DesiredState) -> DesiredState:
        d.paused = None
        return d
    new = fleet.change(fn, actor, "resume")
    ledger.record(settings.ledger_path(), ledger.LedgerEntry(
        version="learner", stable=None, step=-1, weight=0.0, decision="RESUME",
        reason=f"learner resumed by {actor}", numbers={"paused": prev or {}, "generation": new.generation},
        actor=actor), _bootstrap())
    return prev




STATUS_TIMEOUT_S = 5.0  # `flywheel status` is a read: a wedged pod must not stall on-call


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


def _actor(actor: str | None = None) -> str:
    """Who runs the command: ``--actor``, else ``$FLYWHEEL_ACTOR``, else ``$USER``."""
    return _text(actor or os.environ.get("FLYWHEEL_ACTOR") or os.environ.get("USER") or getpass.getuser()
                 or "unknown")


def _store() -> ModelStore:
    """The model store at ``schemas.settings.store_dir()`` (a directory or an fsspec URL)."""
    return ModelStore(settings.store_dir())


def _timeout(flag: float | None, default: float = DEFAULT_TIMEOUT_S) -> float:
    """``--serving-timeout-s``, else ``$FLYWHEEL_SERVING_TIMEOUT_S``, else ``default``; a
    bad value is a usage error naming the flag or the variable."""
    try:
        return check_timeout(flag, "--serving-timeout-s") if flag is not None else timeout_from_env(default)
    except ValueError as exc:
        _fail(str(exc), usage=True)


def _admin(serving: str | None, timeout_s: float) -> ServingAdmin:
    return ServingAdmin(serving or settings.serving_url(), os.environ.get("FLYWHEEL_ADMIN_TOKEN"), timeout_s=timeout_s)


def _pods(fleet: FleetRecord, serving: list[str] | None, timeout_s: float, quiet: bool = False) -> PodDiscovery:
    """The fleet's pods: the specs the controller recorded in the desired state, else
    ``--serving`` / ``$FLYWHEEL_SERVING_URL`` (:func:`deploy.operator.pod_specs`)."""
    try:
        d = fleet.read()
    except ValueError:
        d = DesiredState()
    specs, note = pod_specs(d, serving, settings.serving_url())
    if note and not quiet:
        console.print(f"[yellow]note:[/yellow] {note}")
    try:
        return PodDiscovery(specs, lambda u: _admin(u, timeout_s))
    except ValueError as exc:
        _fail(str(exc), usage=True)


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
        console.print(f"[red]could not record {decision} in the ledger {settings.ledger_path()}:[/red] {exc}")


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


def status_warnings(slots, desired: DesiredState | None) -> list[str]:
    """What `flywheel status` flags for the on-call engineer about one pod: a slot whose
    served digest differs from the store's manifest (``digest_ok`` False: the version's
    files changed under the same id), and drift from the fleet's desired state (the
    controller brings the pod back at its next poll; a restarted pod serves the record)."""
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
                   f"{desired.actor or '?'} at {_ts(desired.updated_ms)} UTC): the controller brings it to "
                   f"{desired.stable} at its next poll and a restarted pod serves {desired.stable}; to keep "
                   f"{slots.stable.version}, `flywheel rollback --to {slots.stable.version} --yes`")
    elif desired is not None:
        for what in drift(slots, desired):
            out.append(f"pod {slots.pod}: {what} (generation {desired.generation}): converging; if it stays, "
                       "see `flywheel runbook` ('a pod does not converge')")
    return out


def _bootstrap() -> str | None:
    try:
        return settings.bootstrap()
    except RuntimeError:
        return None


def _ts(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).strftime("%m-%d %H:%M:%S")


def _parse_steps(s: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in s.split(",") if x.strip())
    except ValueError as exc:
        raise typer.BadParameter(f"--steps: {s!r} is not a comma-separated list of numbers") from exc


def _confirm(what: str, yes: bool) -> None:
    if not yes and not typer.confirm(f"{what}?"):
        console.print("aborted")
        raise typer.Exit(1)


def _fail(msg: str, usage: bool = False) -> None:
    """Print ``msg``; exit 2 for a usage error (a bad flag value), else 1 (a state or runtime error:
    nothing to promote, an unreachable pod, an unknown version)."""
    console.print(f"[red]error:[/red] {msg}")
    raise typer.Exit(2 if usage else 1)


def previous_promoted(store: ModelStore, stable: str) -> str | None:
    """The version that was stable before ``stable`` (:meth:`ModelStore.previous_stable`)."""
    return store.previous_stable(stable)


def _share(w: float) -> float:
    """A candidate traffic share for ``--weight``: in (0, 1), else a usage error."""
    if not 0.0 < w < 1.0:
        raise typer.BadParameter(f"must be in (0, 1) (a share of users; 1 would leave the stable arm empty), got {w}")
    return w


def _actor_opt():
    return typer.Option(None, "--actor", callback=_text,
                        help="who does this, recorded in the ledger (default $FLYWHEEL_ACTOR, else $USER)")


def _reason_opt():
    return typer.Option("", "--reason", callback=_text, help="why, recorded in the ledger")


def _timeout_opt(default_s: float = DEFAULT_TIMEOUT_S):
    return typer.Option(None, "--serving-timeout-s",
                        help=f"bound on each call to a pod (s; default ${TIMEOUT_ENV}, else {default_s:g})")


def register(app: typer.Typer) -> None:
    """Add ``controller``, ``status``, ``versions``, ``promote``, ``rollback``,
    ``canary start|abort``, ``pause``, ``resume`` and ``runbook``."""
    canary = typer.Typer(help="Start or abort a canary on every pod (the fleet's desired state); the controller "
                              "analyses and advances it.", no_args_is_help=True)
    app.add_typer(canary, name="canary")

    @canary.command("start")
    def canary_start(version: str = typer.Argument(..., help="version to canary, e.g. v000003"),
                     weight: float = typer.Option(DEFAULT_STEPS[0], "--weight", callback=_share, help="share of users sent to VERSION at the "
                                                  "first step, in (0, 1) (the controller's default first step)"),
                     serving: Optional[list[str]] = _serving_opt(),
                     actor: Optional[str] = _actor_opt(), reason: str = _reason_opt(),
                     serving_timeout_s: Optional[float] = _timeout_opt(), timeout: float = _wait_opt(),
                     yes: bool = typer.Option(False, "--yes", help="do not ask for confirmation")) -> None:
        """Load VERSION as the candidate on every pod at --weight (also a version the controller
        skipped or rolled back); the controller then analyses and advances it like its own.
        Refused while a canary is in progress. Returns when every pod serves it or --timeout
        passes (exit 1), printing each pod's outcome."""
        who, serving_timeout_s = _actor(actor), _timeout(serving_timeout_s)  # flags first: usage errors exit 2
        store, fleet = _store(), _fleet()
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
        _report(res, f"canary of {version} at {weight:.0%} started", version, hint="to take the candidate back: `flywheel canary abort --yes`")

    @canary.command("abort")
    def canary_abort(serving: Optional[list[str]] = _serving_opt(),
                     actor: Optional[str] = _actor_opt(), reason: str = _reason_opt(),
                     serving_timeout_s: Optional[float] = _timeout_opt(), timeout: float = _wait_opt(),
                     yes: bool = typer.Option(False, "--yes", help="do not ask for confirmation")) -> None:
        """Abort the canary in progress: drop the candidate on every pod (stable takes all
        traffic) and mark it aborted (the controller does not start it again by itself).
        Returns when every pod dropped it or --timeout passes (exit 1), printing each pod's outcome."""
        who, serving_timeout_s = _actor(actor), _timeout(serving_timeout_s)  # flags first: usage errors exit 2
        store, fleet = _store(), _fleet()
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

        def change(x: DesiredState) -> DesiredState:  # under the fleet lock: the record as it is now
            if x.candidate != d.candidate:
                raise ValueError(f"candidate: the desired state changed meanwhile (generation {x.generation}, "
                                 f"{x.action or 'set'} by {x.actor or '?'}: candidate now {x.candidate})")
            x.candidate, x.weight = None, 0.0
            return x

        def on_changed(before, after):
            store.set_status(cand, "aborted", why)
            _end_rollout(cand, RolloutPhase.ABORTED, "MANUAL_CANARY_ABORT", why)

        res = _run(fleet, serving, serving_timeout_s, timeout, change, on_changed, "MANUAL_CANARY_ABORT",
                   f"canary abort of {cand}", cand, d.stable, who, reason, why,
                   row=lambda after: {"stable": after.stable, "step": st.step, "weight": 0.0})
        _report(res, f"aborted the canary of {cand}; stable {d.stable} serves all traffic", d.stable)

    @app.command("pause")
    def pause_cmd(reason: str = typer.Option("", callback=_text, help="why (shown in status and the ledger)"),
                  actor: Optional[str] = _actor_opt(),
                  yes: bool = typer.Option(False, "--yes", help="do not ask for confirmation")) -> None:
        """Pause the learner (through the fleet's desired state, wherever the learner runs): it
        publishes nothing new until `flywheel resume` (a cycle already running finishes)."""
        cur = _paused_or_fail()
        if cur:
            console.print(f"learner already paused by {cur['actor']} at {_ts(cur['at'])}: {cur.get('reason', '')}")
            return
        _confirm("pause the learner", yes)
        pause_learner(_actor(actor), reason)
        console.print(f"learner paused by {_actor(actor)} (fleet desired state, {_fleet().read().summary()})")

    @app.command("resume")
    def resume_cmd(actor: Optional[str] = _actor_opt(),
                   yes: bool = typer.Option(False, "--yes", help="do not ask for confirmation")) -> None:
        """Resume the learner after `flywheel pause`."""
        cur = _paused_or_fail()
        if not cur:
            console.print("learner is not paused")
            return
        _confirm(f"resume the learner (paused by {cur['actor']})", yes)
        resume_learner(_actor(actor))
        console.print(f"learner resumed by {_actor(actor)}")

    @app.command("runbook")
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


    @app.command("controller")
    def controller_cmd(
        serving: Optional[list[str]] = typer.Option(
            None, help="serving pod URL, or dns+http://SERVICE:PORT for every pod behind a headless Service "
                       "(asked again before each step); repeat for several; recorded in the fleet's desired state "
                       "for operator commands (default: the pods recorded there, else $FLYWHEEL_SERVING_URL)"),
        once: bool = typer.Option(False, "--once", help="reconcile until terminal, idle or holding, then exit"),
        steps: str = typer.Option("0.05,0.25,0.5,1", help="candidate traffic shares, comma-separated, "
                                   "increasing in (0, 1], ending in 1; the canary is analysed at each share "
                                   "below 1 and passing the last of them promotes (the final 1 is the "
                                   "promotion itself, docs/decisions.md D27)"),
        min_votes: int = typer.Option(10, help="votes per arm before the sequential thumbs-up test decides"),
        delta: float = typer.Option(0.2, help="relative non-inferiority margin in (0, 1): advance when the "
                                    "always-valid lower bound of rate(candidate) / rate(stable) - 1 is above -delta "
                                    "(0.2: the candidate keeps more than 80 % of the stable's thumbs-up rate)"),
        alpha: float = typer.Option(0.05, help="error level of the always-valid interval"),
        failure_limit: int = typer.Option(3, help="failed checks in a row before an operational metric or a "
                                          "reward-hacking guard fails the step"),
        min_votes_per_step: Optional[int] = typer.Option(None, help="new candidate votes a step needs before "
                                                         "it advances (default: --min-votes)"),
        deadline_s: float = typer.Option(3600.0, help="a step still undecided after this takes --deadline-outcome (s)"),
        deadline_outcome: str = typer.Option("rollback", help=f"one of {DEADLINE_OUTCOMES}"),
        poll_s: float = typer.Option(5.0, help="seconds between reconcile steps"),
        serving_timeout_s: Optional[float] = _timeout_opt(),
        metrics_port: int = typer.Option(0, min=0, max=65535, help="serve the controller's Prometheus /metrics "
                                         "on this port (0 = off)"),
        metrics_provider: str = typer.Option("scrape", help="canary metrics from 'scrape' (every pod's /metrics, "
                                             "the default) or 'prometheus' (PromQL on --prometheus-url)"),
        prometheus_url: Optional[str] = typer.Option(None, envvar="FLYWHEEL_PROMETHEUS_URL",
                                                     help="Prometheus base URL for --metrics-provider prometheus"),
        prometheus_selector: str = typer.Option("", help="label matchers added to every PromQL series, e.g. "
                                                "job=\"flywheel-serving\""),
        guards_from: str = typer.Option("samples", help="reward-hacking guards over 'samples' (voted completions) "
                                        "or 'completions' (every served completion, read from the completions "
                                        "topic; deploy/replies.py)"),
        reply_judge: Optional[str] = typer.Option(None, help="module:attribute of the workload's has_answer "
                                                  "judge for the no-answer guard (with --guards-from completions; "
                                                  "default: an empty reply has no answer)"),
    ) -> None:
        """Canary each newly published version (load, step traffic, analyze, promote or roll back)
        and keep every pod on the fleet's desired state. `--once` exits 1 when the step it ran
        failed (FAILED) or a pod did not converge."""
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
        try:
            cfg = ControllerConfig(steps=_parse_steps(steps), step_deadline_s=deadline_s,
                                   deadline_outcome=deadline_outcome, min_votes_per_step=min_votes_per_step,
                                   analysis=AnalysisConfig(min_votes=min_votes, delta=delta, alpha=alpha,
                                                           failure_limit=failure_limit))
        except ValueError as exc:
            _fail(str(exc), usage=True)
        timeout_s = _timeout(serving_timeout_s)
        fleet = _fleet()
        try:
            recorded = fleet.read().pods
        except ValueError as exc:
            _fail(f"fleet desired-state record: {exc}")
        specs = serving or recorded or [settings.serving_url()]  # --serving, else the pods recorded before
        pods = PodDiscovery(specs, lambda u: _admin(u, timeout_s))
        try:
            if fleet.read().pods != specs:  # operator commands reach the pods the controller reaches
                fleet.change(functools.partial(_with_pods, specs), "controller", "pods",
                             f"serving specs {', '.join(specs)}")
        except ValueError as exc:
            _fail(f"fleet desired-state record: {exc}")
        try:
            admins = pods()
        except ValueError as exc:
            _fail(str(exc), usage=True)
        except ServingAdminError as exc:  # no ready pod yet: the controller asks again each step
            logging.getLogger(__name__).warning("%s", exc)
            admins = []
        arm_metrics = None  # the controller's default: the scrape provider over the pods
        if metrics_provider != "scrape":
            from deploy.metrics import metric_provider

            try:
                arm_metrics = metric_provider(metrics_provider, prometheus_url=prometheus_url,
                                              selector=prometheus_selector)
            except ValueError as exc:
                raise typer.BadParameter(str(exc), param_hint="--metrics-provider/--prometheus-url") from exc
        served = None
        if guards_from not in ("samples", "completions"):
            raise typer.BadParameter(f"must be 'samples' or 'completions', got {guards_from!r}",
                                     param_hint="--guards-from")
        if guards_from == "completions":
            from deploy.replies import ServedCompletions, load_judge

            try:
                judge = load_judge(reply_judge) if reply_judge else None
            except ValueError as exc:
                raise typer.BadParameter(str(exc), param_hint="--reply-judge") from exc
            if _bootstrap() is None:
                raise typer.BadParameter("needs a Kafka bootstrap (FLYWHEEL_KAFKA_BOOTSTRAP) to read the completions "
                                         "topic", param_hint="--guards-from")
            served = ServedCompletions(_bootstrap(), judge=judge).start()
        ctl = RolloutController(_store(), admins, settings.samples_dir(),
                                settings.ledger_path(), rollout_status_path(), cfg, bootstrap=_bootstrap(),
                                discover=pods, arm_metrics=arm_metrics, fleet=fleet, served=served)
        if metrics_port:
            ctl.exported.serve(metrics_port)
        if once:
            _controller_once(ctl)
            return
        ctl.run_forever(poll_s)


    @app.command("status")
    def status_cmd(serving: Optional[list[str]] = typer.Option(
                       None, help="pod URL or dns+http:// spec, used when the fleet's desired state records no "
                                  "pods (the controller records its own)"),
                   as_json: bool = typer.Option(False, "--json", help="machine-readable output (-o json)"),
                   output: Optional[Format] = OUTPUT,
                   last: int = typer.Option(10, min=1, help="decisions to show"),
                   serving_timeout_s: Optional[float] = _timeout_opt(STATUS_TIMEOUT_S)) -> None:
        """The fleet's desired state, every pod (stable, digest, candidate, weight) with its drift
        from it, the store's stable record, canary phase and step, last decisions. Exits 1 when a
        pod is unreachable."""
        fmt = resolve(output, as_json)
        err, desired, stable_rec, record_err = None, None, None, None
        try:
            store = _store()
            stable_rec = store.stable_record()
            fleet = _fleet(store)
        except Exception as exc:  # noqa: BLE001 - status must show what it can
            err = f"model store unreadable: {exc}"
            fleet = None
        if fleet is not None:
            try:
                desired = fleet.read()
            except ValueError as exc:  # the pods are still shown, without drift (there is nothing to compare)
                record_err = f"{exc} ({RECORD_REPAIR})"
        rows = []
        if fleet is not None:
            pods = _pods(fleet, serving, _timeout(serving_timeout_s, STATUS_TIMEOUT_S), quiet=fmt != Format.table)
            try:
                rows = observe_pods(pods(), desired)
            except ServingAdminError as exc:
                err = str(exc)
        errors = [e for _, _, e, _ in rows if e]
        err = err or (errors[0] if errors else None) or (None if rows else "no serving pod found")
        first = next((s for _, s, _, _ in rows if s is not None), None)
        warnings = [w for _, s, _, _ in rows for w in status_warnings(s, desired)]
        st = current_status(rollout_status_path(), settings.ledger_path())
        decs = ledger.decisions(settings.ledger_path(), limit=last)
        if fmt in (Format.json, Format.yaml):
            sd = asdict(st)
            sd["phase"] = st.phase.value
            typer.echo(dumps({"desired": asdict(desired) if desired else None,
                              "pods": [{"url": u, "slots": s.model_dump() if s else None, "error": e, "drift": dr}
                                       for u, s, e, dr in rows],
                              "converged": bool(rows) and all(not dr for _, _, _, dr in rows),
                              "serving": first.model_dump() if first else None, "serving_error": err,
                              "stable_record": stable_rec, "warnings": warnings,
                              "rollout": sd, "pending_intent": desired.intent if desired else None,
                              "learner": {"paused": desired.paused if desired else None},
                              "desired_error": record_err,
                              "decisions": [asdict(d) for d in decs]}, fmt))
            if err or record_err:
                raise typer.Exit(1)  # scripts can tell "serving down" from the exit status
            return
        if desired is not None:
            console.print(f"desired state: [bold]{desired.summary()}[/bold] (last change: {desired.action or '-'} "
                          f"by {desired.actor or '-'} at {_ts(desired.updated_ms)} UTC)")
        t = Table(title="serving pods")
        for c in ("pod", "url", "stable", "digest", "= manifest", "candidate", "weight", "loaded at (UTC)", "drift"):
            t.add_column(c, no_wrap=c not in ("drift",), overflow="fold")
        ok = {True: "yes", False: "[red]NO[/red]", None: "?"}
        dig = None if fmt == Format.wide else 12  # -o wide: whole digests
        for url, s, e, dr in rows:
            if s is None:
                t.add_row("?", url, "", "", "", "", "", "", f"[red]unreachable[/red]: {e}")
                continue
            t.add_row(s.pod, url, s.stable.version, s.stable.weights_digest[:dig], ok[s.stable.digest_ok],
                      (s.candidate.version + (" [red]digest NO[/red]" if s.candidate.digest_ok is False else ""))
                      if s.candidate else "-", f"{s.candidate_weight:.0%}",
                      _ts(s.stable.loaded_at), "[red]" + "; ".join(dr) + "[/red]" if dr else "in sync")
        console.print(t)
        n_ok = sum(1 for _, _, _, dr in rows if not dr)
        console.print(f"{n_ok} of {len(rows)} pods serve the desired state" + ("" if n_ok == len(rows) and rows
                                                                                  else " ([red]drift[/red])"))
        if err:
            console.print(f"[red]serving unreachable:[/red] {err}")
        if stable_rec:
            console.print(f"store stable record: {stable_rec['version']} (set by {stable_rec.get('actor') or '?'} "
                          f"at {_ts(stable_rec.get('at') or 0)} UTC)")
        for w in warnings:
            console.print(f"[red]warning:[/red] {w}")
        console.print(f"rollout: phase=[bold]{st.phase.value}[/bold] candidate={st.candidate} stable={st.stable} "
                      f"step={st.step} weight={st.weight:.0%} last={st.last_outcome}: {st.last_reason}")
        lp = desired.paused if desired else None
        if record_err:
            console.print(f"[red]desired-state record unreadable:[/red] {record_err}")
            console.print("learner: unknown (a learner that cannot read the record does not train)")
        else:
            console.print("learner: " + (f"[yellow]PAUSED[/yellow] by {lp['actor']} at {_ts(lp['at'])} UTC: "
                                         f"{lp.get('reason', '')}" if lp else "running (not paused)"))
        pending = desired.intent if desired else None
        if pending:
            console.print(f"pending intent: {pending['action']} {pending.get('version') or ''} by {pending['actor']}")
        t = Table(title="last decisions")
        for c in ("time (UTC)", "version", "stable", "step", "weight", "decision", "actor"):
            t.add_column(c, no_wrap=True)
        t.add_column("reason", ratio=1, overflow="fold")
        if fmt == Format.wide:
            t.add_column("numbers", overflow="fold")
        for d in decs:
            t.add_row(_ts(d.ts), d.version, d.stable or "", str(d.step), f"{d.weight:.0%}", d.decision,
                      d.actor, d.reason, *([json.dumps(d.numbers, default=str)] if fmt == Format.wide else []))
        console.print(t)
        if err or record_err:
            raise typer.Exit(1)

    @app.command("versions")
    def versions_cmd(as_json: bool = typer.Option(False, "--json", help="machine-readable output (-o json)"),
                     output: Optional[Format] = OUTPUT) -> None:
        """Versions in the model store: parent, kind, size, delta ratio, status (``corrupt`` when
        the manifest cannot be read, with the reason)."""
        store = _store()
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
                t.add_row(r["version"], "*" if r["stable"] else "", "", "", "", "", "[red]corrupt[/red]",
                          r["error"], "")
                continue
            t.add_row(r["version"], "*" if r["stable"] else "", r["parent"] or "", r["kind"], f"{r['size_bytes'] / 1e6:.2f} MB",
                      f"{r['delta_ratio']:.1f}x" if r["delta_ratio"] else "", r["status"],
                      r["digest"] if wide else r["digest"][:12], _ts(r["created_at"]),
                      *([json.dumps(r["metrics"], default=str)] if wide else []))
        console.print(t)

    @app.command("promote")
    def promote_cmd(serving: Optional[list[str]] = _serving_opt(),
                    actor: Optional[str] = _actor_opt(), reason: str = _reason_opt(),
                    serving_timeout_s: Optional[float] = _timeout_opt(), timeout: float = _wait_opt(),
                    yes: bool = typer.Option(False, "--yes", help="do not ask for confirmation")) -> None:
        """Promote the fleet's candidate to stable on every pod (hot swap); it becomes the store's
        stable record. Returns when every pod serves it or --timeout passes (exit 1), printing
        each pod's outcome."""
        who, serving_timeout_s = _actor(actor), _timeout(serving_timeout_s)  # flags first: usage errors exit 2
        store, fleet = _store(), _fleet()
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

        def on_changed(before, after):
            store.set_status(cand, "promoted", why, actor=who)
            _end_rollout(cand, RolloutPhase.PROMOTED, "PROMOTE", why)

        res = _run(fleet, serving, serving_timeout_s, timeout, change, on_changed, "MANUAL_PROMOTE",
                   f"manual promote of {cand}", cand, stable, who, reason, why)
        _report(res, f"stable is now {cand}", cand)

    @app.command("rollback")
    def rollback_cmd(to: Optional[str] = typer.Option(None, "--to", help="version to restore as stable"),
                     serving: Optional[list[str]] = _serving_opt(),
                     actor: Optional[str] = _actor_opt(), reason: str = _reason_opt(),
                     serving_timeout_s: Optional[float] = _timeout_opt(), timeout: float = _wait_opt(),
                     yes: bool = typer.Option(False, "--yes", help="do not ask for confirmation")) -> None:
        """Drop the fleet's candidate if there is one; otherwise (or with --to) make stable the
        version stable before it (or VERSION) on every pod, and the store's stable record.
        `--to` the version already stable reloads it from the store on every pod (verified).
        Returns when every pod serves it or --timeout passes (exit 1), printing each pod's outcome."""
        who, serving_timeout_s = _actor(actor), _timeout(serving_timeout_s)  # flags first: usage errors exit 2
        store, fleet = _store(), _fleet()
        if to is not None:  # the store first: a version that does not exist is named as such, no pod asked
            try:
                store.manifest(to)
            except (KeyError, ValueError) as exc:
                _action_failed("MANUAL_ROLLBACK", f"manual rollback to {to}", to, None, who, reason, f"--to: {exc}")
        d = _read_desired(fleet, "MANUAL_ROLLBACK", "manual rollback", who, reason)
        stable, cand = d.stable, d.candidate
        if to is None and cand is not None:
            _confirm(f"drop candidate {cand} on every pod (stable {stable} keeps all traffic)", yes)
            why = _because(f"manual rollback of candidate by {who}", reason)

            def drop(x: DesiredState) -> DesiredState:
                x.candidate, x.weight = None, 0.0
                return x

            def dropped(before, after):
                store.set_status(cand, "rolled_back", why)
                _end_rollout(cand, RolloutPhase.ABORTED, "ROLLBACK", why)

            res = _run(fleet, serving, serving_timeout_s, timeout, drop, dropped, "MANUAL_ROLLBACK",
                       f"manual rollback of candidate {cand}", cand, stable, who, reason, why)
            _report(res, f"dropped candidate {cand}; stable is {stable}", stable)
            return
        if to is None:
            to = store.previous_stable(stable)
            if to is None:
                _action_failed("MANUAL_ROLLBACK", "manual rollback", None, stable, who, reason,
                               f"no earlier stable version than {stable} to roll back to (see `flywheel versions`)")
        reload = to == stable
        _confirm(f"reload stable {to} from the store on every pod" if reload else f"replace stable {stable} by {to}",
                 yes)
        why = _because(f"manual rollback of stable {stable} to {to} by {who}", reason)
        asked_ms = int(time.time() * 1000)

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
                _end_rollout(before.candidate, RolloutPhase.ABORTED, "ROLLBACK", why)

        res = _run(fleet, serving, serving_timeout_s, timeout, change, on_changed, "MANUAL_ROLLBACK",
                   f"manual rollback of stable {stable} to {to}", to, stable, who, reason, why)
        _report(res, f"stable is now {to}" + (" (reloaded from the store, verified)" if reload else ""), to)


def _with_pods(specs: list[str], d: DesiredState) -> DesiredState:
    d.pods = list(specs)
    return d


def _serving_opt():
    return typer.Option(None, "--serving", help="pod URL or dns+http:// spec, used only when the fleet's desired "
                        "state records no pods (the controller records the ones it discovers); repeatable")


def _wait_opt():
    return typer.Option(60.0, "--timeout", min=0.0, help="how long to wait for every pod to converge, retrying "
                        "the ones that did not (s); the command exits 1 if they have not by then")


def _read_desired(fleet: FleetRecord, decision: str, what: str, who: str, why: str) -> DesiredState:
    try:
        return fleet.read()
    except ValueError as exc:
        _action_failed(decision, what, None, None, who, why, f"fleet desired-state record unreadable: {exc}")


def _run(fleet, serving, serving_timeout_s, timeout_s, change, on_changed, decision, what, version, stable, who,
         why_flag, why, row=None) -> ActionResult:
    """:func:`deploy.operator.run_action` with this CLI's pods, ledger rows and failures.
    ``row(after) -> {"stable", "step", "weight"}`` overrides the ledger rows' fields from the
    record as written (under the lock)."""
    pods = _pods(fleet, serving, serving_timeout_s)
    t0 = time.monotonic()
    fields = {"stable": stable}

    def record(suffix: str, numbers: dict) -> None:
        dec = {"": decision, "converged": "FLEET_CONVERGED", "not_converged": "FLEET_NOT_CONVERGED"}[suffix]
        p = numbers.get("pods") or {}
        _record_action(dec, version, reason=f"{why} ({p.get('converged', 0)} of {p.get('pods', 0)} pods converged)",
                       actor=who, numbers={"why": why_flag, **numbers}, **fields)

    def statuses(before, after) -> None:  # the record changed: a status write that fails is reported, not fatal
        if row is not None:
            fields.update(row(after))
        try:
            on_changed(before, after)
        except Exception as exc:  # noqa: BLE001 - e.g. a corrupt manifest of the version replaced
            console.print(f"[red]could not update the store's version statuses:[/red] {exc}")

    try:
        return run_action(fleet, pods, change, what=what, who=who, why=why, on_changed=statuses, record=record,
                          timeout_s=timeout_s)
    except ValueError as exc:
        _action_failed(decision, what, version, stable, who, why_flag, str(exc), t0=t0)
    except LockTimeout as exc:
        _action_failed(decision, what, version, stable, who, why_flag, f"{exc}; nothing was changed", t0=t0)


def _report(res: ActionResult, done: str, target: str, hint: str = "") -> None:
    """Print each pod's outcome and the end (``hint`` too when not every pod converged);
    exit 1 unless every pod converged."""
    for o in res.outcomes:
        console.print(("  [green]ok[/green] " if o.ok else "  [red]!![/red] ") + o.line())
    if res.discovery_error:
        console.print(f"[red]pods could not be listed:[/red] {res.discovery_error}")
    n, k = len(res.outcomes), sum(o.ok for o in res.outcomes)
    if res.superseded_by is not None:
        s = res.superseded_by
        console.print(f"[red]superseded:[/red] generation {s.generation} ({s.action} by {s.actor}) replaced this "
                      f"action before every pod converged; the fleet now converges to: {s.summary()}")
        raise typer.Exit(1)
    if res.converged:
        console.print(f"{done} on all {n} pods ({res.elapsed_s:.2f} s; desired state generation "
                      f"{res.desired.generation})")
        return
    console.print(f"[red]not converged:[/red] the fleet's desired state is {res.desired.summary()}; {k} of {n} pods "
                  f"serve it after {res.elapsed_s:.1f} s. The controller keeps retrying the others at each poll "
                  "(`flywheel status` shows each pod; `flywheel runbook`: 'a pod does not converge')." +
                  (f" {hint[0].upper()}{hint[1:]}." if hint else ""))
    raise typer.Exit(1)


def _controller_once(ctl: RolloutController) -> None:
    """`flywheel controller --once`: reconcile, print, exit 1 when the step failed or a pod
    did not converge."""
    try:
        st = ctl.run_once()
    except (ServingAdminError, LockTimeout) as exc:
        _fail(str(exc))
    console.print(f"phase={st.phase.value} candidate={st.candidate} step={st.step} "
                  f"weight={st.weight} last={st.last_outcome}: {st.last_reason}")
    bad = [o for o in ctl.last_outcomes if not o.ok]
    for o in bad:
        console.print(f"[red]pod not converged:[/red] {o.line()}")
    if st.last_outcome == "FAILED" or bad:
        console.print(f"[red]error:[/red] the step failed ({st.last_outcome if st.last_outcome == 'FAILED' else ''}"
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


def _end_rollout(version: str, phase: RolloutPhase, outcome: str, reason: str) -> None:
    """Record the operator's action in the controller's status record if it concerns the
    rollout in progress (the controller then starts nothing for this version)."""
    p = rollout_status_path()
    st = RolloutStatus.load(p)
    if st.candidate == version and not st.phase.is_terminal():
        st.phase, st.weight, st.last_outcome, st.last_reason = phase, 0.0, outcome, reason
        st.save(p)
