"""On-call CLI of ``deploy``: controller, status, versions, promote, rollback, canary,
pause/resume (learner), runbook.

Every action that changes traffic asks for confirmation unless ``--yes`` and is recorded in
the ledger whether it succeeded or failed (decision ``X`` or ``X_FAILED``), with who ran it
(``--actor``, else ``$FLYWHEEL_ACTOR``, else ``$USER``) and why (``--reason``). Every call to
a pod is bounded by ``--serving-timeout-s`` (else ``$FLYWHEEL_SERVING_TIMEOUT_S``).
"""

from __future__ import annotations

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
from deploy.controller import (DEADLINE_OUTCOMES, ControllerConfig, RolloutController, RolloutPhase,
                               RolloutStatus, current_status, read_intent, write_intent)
from deploy.discovery import PodDiscovery
from deploy.runbook import RUNBOOK
from deploy.serving_client import (DEFAULT_TIMEOUT_S, TIMEOUT_ENV, ServingAdmin, ServingAdminError,
                                   check_timeout, timeout_from_env)
from deploy.store import ModelStore
from flywheel.output import OUTPUT, Format, dumps, resolve
from schemas import settings

console = Console()
if not console.is_terminal and "COLUMNS" not in os.environ:
    console = Console(width=200)  # piped to a file or a pager: do not cut tables at 80 columns


def rollout_status_path() -> Path:
    """Where the controller persists its :class:`RolloutStatus`."""
    return settings.home() / "deploy" / "rollout.json"


def intent_path() -> Path:
    """Where CLI commands record operator intent for the controller."""
    return rollout_status_path().with_name("intent.json")


def learner_pause_path() -> Path:
    """Flag file the learner daemon checks before each cycle (JSON: actor, at, reason)."""
    return settings.home() / "learner" / "paused"


def learner_paused() -> dict | None:
    """The pause record (``{"actor", "at" (ms), "reason"}``) or None when the learner runs."""
    p = learner_pause_path()
    if not p.exists():
        return None
    try:
        return json.loads(p.read_text())
    except ValueError:
        return {"actor": "unknown", "at": int(p.stat().st_mtime * 1000), "reason": "unreadable pause record"}


def pause_learner(actor: str, reason: str = "") -> dict:
    """Record the pause intent (atomic write of the flag file) and a PAUSE ledger row."""
    rec = {"actor": actor, "at": int(time.time() * 1000), "reason": reason}
    p = learner_pause_path()
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".paused.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(rec))
    os.replace(tmp, p)
    ledger.record(settings.ledger_path(), ledger.LedgerEntry(
        version="learner", stable=None, step=-1, weight=0.0, decision="PAUSE",
        reason=f"learner paused by {actor}" + (f": {reason}" if reason else ""), actor=actor), _bootstrap())
    return rec


def resume_learner(actor: str) -> dict | None:
    """Remove the pause flag and record a RESUME ledger row; returns the pause it ended."""
    prev = learner_paused()
    learner_pause_path().unlink(missing_ok=True)
    ledger.record(settings.ledger_path(), ledger.LedgerEntry(
        version="learner", stable=None, step=-1, weight=0.0, decision="RESUME",
        reason=f"learner resumed by {actor}", numbers={"paused": prev or {}}, actor=actor), _bootstrap())
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


def _record_action(decision: str, version: str | None, stable: str | None, reason: str, actor: str,
                   numbers: dict | None = None) -> None:
    """One ledger row for an operator action (step -1, weight 0). A ledger that cannot be
    written is reported, never hides the action's own outcome."""
    try:
        ledger.record(settings.ledger_path(), ledger.LedgerEntry(
            version=version or "", stable=stable, step=-1, weight=0.0, decision=decision, reason=reason,
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


def status_warnings(slots, stable_record: dict | None) -> list[str]:
    """What `flywheel status` flags for the on-call engineer: a slot whose served digest
    differs from the store's manifest (``digest_ok`` False: the version's files changed
    under the same id), and a served stable that is not the store's stable record (a
    restarted pod would serve the record's version)."""
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
    if stable_record and stable_record.get("version") != slots.stable.version:
        rv = stable_record["version"]
        out.append(f"pod {slots.pod} serves {slots.stable.version} as stable but the store's stable record says {rv} "
                   f"(set by {stable_record.get('actor') or '?'} at {_ts(stable_record.get('at') or 0)} UTC): a "
                   f"restarted pod would serve {rv}; to keep {slots.stable.version}, "
                   f"`flywheel rollback --to {slots.stable.version} --yes`")
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
    canary = typer.Typer(help="Ask the controller to start or abort a canary (recorded intent).",
                         no_args_is_help=True)
    app.add_typer(canary, name="canary")

    @canary.command("start")
    def canary_start(version: str = typer.Argument(..., help="version to canary, e.g. v000003"),
                     actor: Optional[str] = _actor_opt(), reason: str = _reason_opt(),
                     yes: bool = typer.Option(False, "--yes", help="do not ask for confirmation")) -> None:
        """Canary VERSION at the next reconcile (also one the controller skipped or rolled back)."""
        who = _actor(actor)
        store = _store()
        if version not in store.versions():
            _action_failed("MANUAL_CANARY_START", f"canary start of {version}", version, None, who, reason,
                           f"version: {version!r} is not in the store (it has "
                           f"{', '.join(store.versions()) or 'none'})")
        _confirm(f"start a canary of {version}", yes)
        write_intent(intent_path(), "start", who, version)
        _record_action("MANUAL_CANARY_START", version, None,
                       _because(f"canary start of {version} requested by {who}", reason), who, {"why": reason})
        console.print(f"recorded: start canary of {version}; the controller acts at its next reconcile")

    @canary.command("abort")
    def canary_abort(actor: Optional[str] = _actor_opt(), reason: str = _reason_opt(),
                     yes: bool = typer.Option(False, "--yes", help="do not ask for confirmation")) -> None:
        """Abort the canary in progress: the controller drops the candidate (all traffic to stable)."""
        who = _actor(actor)
        st = current_status(rollout_status_path(), settings.ledger_path())
        if st.phase != RolloutPhase.CANARY:
            _action_failed("MANUAL_CANARY_ABORT", "canary abort", st.candidate, st.stable, who, reason,
                           f"no canary in progress (phase {st.phase.value}); to drop a loaded candidate use "
                           "`flywheel rollback`")
        _confirm(f"abort the canary of {st.candidate} at {st.weight:.0%}", yes)
        write_intent(intent_path(), "abort", who)
        _record_action("MANUAL_CANARY_ABORT", st.candidate, st.stable,
                       _because(f"abort of the canary of {st.candidate} requested by {who}", reason), who,
                       {"why": reason, "step": st.step, "weight": st.weight})
        console.print(f"recorded: abort canary of {st.candidate}; the controller acts at its next reconcile")

    @app.command("pause")
    def pause_cmd(reason: str = typer.Option("", callback=_text, help="why (shown in status and the ledger)"),
                  actor: Optional[str] = _actor_opt(),
                  yes: bool = typer.Option(False, "--yes", help="do not ask for confirmation")) -> None:
        """Pause the learner: its daemon publishes nothing new until `flywheel resume` (a cycle
        already running finishes)."""
        cur = learner_paused()
        if cur:
            console.print(f"learner already paused by {cur['actor']} at {_ts(cur['at'])}: {cur.get('reason', '')}")
            return
        _confirm("pause the learner", yes)
        pause_learner(_actor(actor), reason)
        console.print(f"learner paused by {_actor(actor)} (flag {learner_pause_path()})")

    @app.command("resume")
    def resume_cmd(actor: Optional[str] = _actor_opt(),
                   yes: bool = typer.Option(False, "--yes", help="do not ask for confirmation")) -> None:
        """Resume the learner after `flywheel pause`."""
        cur = learner_paused()
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
            None, help="serving base URL, or dns+http://SERVICE:PORT for every pod behind a headless Service "
                       "(asked again before each step); repeat for several (default $FLYWHEEL_SERVING_URL)"),
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
        """Canary each newly published version: load, step traffic, analyze, promote or roll back."""
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
        try:
            cfg = ControllerConfig(steps=_parse_steps(steps), step_deadline_s=deadline_s,
                                   deadline_outcome=deadline_outcome, min_votes_per_step=min_votes_per_step,
                                   analysis=AnalysisConfig(min_votes=min_votes, delta=delta, alpha=alpha,
                                                           failure_limit=failure_limit))
        except ValueError as exc:
            _fail(str(exc), usage=True)
        timeout_s = _timeout(serving_timeout_s)
        pods = PodDiscovery(serving or [settings.serving_url()], lambda u: _admin(u, timeout_s))
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
                                discover=pods if pods.dynamic else None, arm_metrics=arm_metrics, served=served)
        if metrics_port:
            ctl.exported.serve(metrics_port)
        if once:
            try:
                st = ctl.run_once()
            except ServingAdminError as exc:
                _fail(str(exc))
            console.print(f"phase={st.phase.value} candidate={st.candidate} step={st.step} "
                          f"weight={st.weight} last={st.last_outcome}: {st.last_reason}")
            return
        ctl.run_forever(poll_s)

    @app.command("status")
    def status_cmd(serving: Optional[str] = typer.Option(None, help="serving base URL"),
                   as_json: bool = typer.Option(False, "--json", help="machine-readable output (-o json)"),
                   output: Optional[Format] = OUTPUT,
                   last: int = typer.Option(10, min=1, help="decisions to show"),
                   serving_timeout_s: Optional[float] = _timeout_opt(STATUS_TIMEOUT_S)) -> None:
        """Serving slots and weights (and whether each served digest equals the store's
        manifest), the store's stable record, canary phase and step, last decisions."""
        fmt = resolve(output, as_json)
        slots, err = None, None
        try:
            slots = _admin(serving, _timeout(serving_timeout_s, STATUS_TIMEOUT_S)).slots()
        except ServingAdminError as exc:
            err = str(exc)
        try:
            stable_rec = _store().stable_record()
        except Exception as exc:  # noqa: BLE001 - status must show what it can
            stable_rec, err = None, err or f"model store unreadable: {exc}"
        warnings = status_warnings(slots, stable_rec)
        st = current_status(rollout_status_path(), settings.ledger_path())
        decs = ledger.decisions(settings.ledger_path(), limit=last)
        if fmt in (Format.json, Format.yaml):
            sd = asdict(st)
            sd["phase"] = st.phase.value
            typer.echo(dumps({"serving": slots.model_dump() if slots else None, "serving_error": err,
                              "stable_record": stable_rec, "warnings": warnings,
                              "rollout": sd, "pending_intent": read_intent(intent_path()),
                              "learner": {"paused": learner_paused()},
                              "decisions": [asdict(d) for d in decs]}, fmt))
            if err:
                raise typer.Exit(1)  # scripts can tell "serving down" from the exit status
            return
        t = Table(title="serving")
        for c in ("slot", "version", "weight", "weights digest", "digest = manifest", "loaded at (UTC)"):
            t.add_column(c, no_wrap=True)
        ok = {True: "yes", False: "[red]NO[/red]", None: "?"}
        if slots:
            dig = None if fmt == Format.wide else 12  # -o wide: whole digests
            t.add_row("stable", slots.stable.version, f"{1 - slots.candidate_weight:.0%}",
                      slots.stable.weights_digest[:dig], ok[slots.stable.digest_ok], _ts(slots.stable.loaded_at))
            if slots.candidate:
                t.add_row("candidate", slots.candidate.version, f"{slots.candidate_weight:.0%}",
                          slots.candidate.weights_digest[:dig], ok[slots.candidate.digest_ok],
                          _ts(slots.candidate.loaded_at))
        console.print(t)
        if err:
            console.print(f"[red]serving unreachable:[/red] {err}")
        if stable_rec:
            console.print(f"store stable record: {stable_rec['version']} (set by {stable_rec.get('actor') or '?'} "
                          f"at {_ts(stable_rec.get('at') or 0)} UTC; what a restarted pod serves)")
        for w in warnings:
            console.print(f"[red]warning:[/red] {w}")
        console.print(f"rollout: phase=[bold]{st.phase.value}[/bold] candidate={st.candidate} stable={st.stable} "
                      f"step={st.step} weight={st.weight:.0%} last={st.last_outcome}: {st.last_reason}")
        lp = learner_paused()
        console.print("learner: " + (f"[yellow]PAUSED[/yellow] by {lp['actor']} at {_ts(lp['at'])} UTC: "
                                     f"{lp.get('reason', '')}" if lp else "running (not paused)"))
        pending = read_intent(intent_path())
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
        if err:
            raise typer.Exit(1)

    @app.command("versions")
    def versions_cmd(as_json: bool = typer.Option(False, "--json", help="machine-readable output (-o json)"),
                     output: Optional[Format] = OUTPUT) -> None:
        """Versions in the model store: parent, kind, size, delta ratio, status."""
        store = _store()
        stable = store.stable()
        rows = []
        for v in store.versions():
            m = store.manifest(v)
            rows.append({"version": v, "stable": v == stable, "parent": m.parent, "kind": m.kind, "created_at": m.created_at,
                         "size_bytes": m.size_bytes, "snapshot_bytes": m.snapshot_bytes,
                         "delta_ratio": (m.snapshot_bytes / m.size_bytes) if m.size_bytes else None,
                         "status": m.status_history[-1].status if m.status_history else "",
                         "digest": m.weights_digest, "metrics": m.metrics})
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
            t.add_row(r["version"], "*" if r["stable"] else "", r["parent"] or "", r["kind"], f"{r['size_bytes'] / 1e6:.2f} MB",
                      f"{r['delta_ratio']:.1f}x" if r["delta_ratio"] else "", r["status"],
                      r["digest"] if wide else r["digest"][:12], _ts(r["created_at"]),
                      *([json.dumps(r["metrics"], default=str)] if wide else []))
        console.print(t)

    @app.command("promote")
    def promote_cmd(serving: Optional[str] = typer.Option(None, help="serving base URL"),
                    actor: Optional[str] = _actor_opt(), reason: str = _reason_opt(),
                    serving_timeout_s: Optional[float] = _timeout_opt(),
                    yes: bool = typer.Option(False, "--yes", help="do not ask for confirmation")) -> None:
        """Promote the loaded candidate to stable now (hot swap); it becomes the store's
        stable record (what a restarted pod serves)."""
        who, t0 = _actor(actor), time.monotonic()
        admin = _admin(serving, _timeout(serving_timeout_s))
        try:
            slots = admin.slots()
        except ServingAdminError as exc:
            _action_failed("MANUAL_PROMOTE", "manual promote", None, None, who, reason, str(exc), exc, t0)
        stable = slots.stable.version
        if slots.candidate is None:
            _action_failed("MANUAL_PROMOTE", "manual promote", None, stable, who, reason,
                           "no candidate is loaded: nothing to promote")
        cand = slots.candidate.version
        _confirm(f"promote {cand} (replacing {stable})", yes)
        t0 = time.monotonic()
        try:
            after = admin.promote()
        except ServingAdminError as exc:
            _action_failed("MANUAL_PROMOTE", f"manual promote of {cand}", cand, stable, who, reason, str(exc), exc, t0)
        why = _because(f"manual promote by {who}", reason)
        _store().set_status(cand, "promoted", why, actor=who)
        _end_rollout(cand, RolloutPhase.PROMOTED, "PROMOTE", why)
        _record_action("MANUAL_PROMOTE", cand, stable, why, who,
                       {"why": reason, "elapsed_s": time.monotonic() - t0, "digest": after.stable.weights_digest})
        console.print(f"promoted {cand}")

    @app.command("rollback")
    def rollback_cmd(to: Optional[str] = typer.Option(None, "--to", help="version to restore as stable"),
                     serving: Optional[str] = typer.Option(None, help="serving base URL"),
                     actor: Optional[str] = _actor_opt(), reason: str = _reason_opt(),
                     serving_timeout_s: Optional[float] = _timeout_opt(),
                     yes: bool = typer.Option(False, "--yes", help="do not ask for confirmation")) -> None:
        """Drop the candidate if one is loaded; otherwise (or with --to) restore stable to the
        version stable before it (or VERSION), which becomes the store's stable record.
        `--to` the version already stable reloads it from the store (verified)."""
        who, t0 = _actor(actor), time.monotonic()
        admin = _admin(serving, _timeout(serving_timeout_s))
        store = _store()
        if to is not None:  # the store first: a version that does not exist is named as such, no pod asked
            try:
                store.manifest(to)
            except (KeyError, ValueError) as exc:
                _action_failed("MANUAL_ROLLBACK", f"manual rollback to {to}", to, None, who, reason, f"--to: {exc}")
        try:
            slots = admin.slots()
        except ServingAdminError as exc:
            _action_failed("MANUAL_ROLLBACK", "manual rollback", to, None, who, reason, str(exc), exc, t0)
        stable = slots.stable.version
        if to is None and slots.candidate is not None:
            _drop_candidate(admin, store, slots, who, reason, yes)
            return
        if to is None:
            to = store.previous_stable(stable)
            if to is None:
                _action_failed("MANUAL_ROLLBACK", "manual rollback", None, stable, who, reason,
                               f"no earlier stable version than {stable} to roll back to (see `flywheel versions`)")
        try:
            store.manifest(to)
        except (KeyError, ValueError) as exc:
            _action_failed("MANUAL_ROLLBACK", f"manual rollback to {to}", to, stable, who, reason, f"--to: {exc}")
        _confirm(f"replace stable {stable} by {to}", yes)
        t0 = time.monotonic()
        try:
            after = admin.rollback(to)
        except ServingAdminError as exc:
            _action_failed("MANUAL_ROLLBACK", f"manual rollback of stable {stable} to {to}", to, stable, who,
                           reason, str(exc), exc, t0)
        elapsed = time.monotonic() - t0
        why = _because(f"manual rollback of stable {stable} to {to} by {who}", reason)
        if to != stable:
            store.set_status(stable, "rolled_back", why)
        store.set_status(to, "promoted", why, actor=who)
        if slots.candidate is not None:
            store.set_status(slots.candidate.version, "rolled_back", why)
            _end_rollout(slots.candidate.version, RolloutPhase.ABORTED, "ROLLBACK", why)
        _record_action("MANUAL_ROLLBACK", to, stable, why, who,
                       {"why": reason, "elapsed_s": elapsed, "from": stable, "digest": after.stable.weights_digest})
        console.print(f"stable is now {after.stable.version} ({elapsed:.2f} s)")


def _drop_candidate(admin: ServingAdmin, store: ModelStore, slots, who: str, reason: str, yes: bool) -> None:
    """`flywheel rollback` with a candidate loaded: drop it; stable keeps all traffic."""
    cand, stable = slots.candidate.version, slots.stable.version
    _confirm(f"drop candidate {cand} (stable {stable} keeps all traffic)", yes)
    t0 = time.monotonic()
    try:
        admin.rollback()
    except ServingAdminError as exc:
        _action_failed("MANUAL_ROLLBACK", f"manual rollback of candidate {cand}", cand, stable, who, reason,
                       str(exc), exc, t0)
    why = _because(f"manual rollback of candidate by {who}", reason)
    store.set_status(cand, "rolled_back", why)
    _end_rollout(cand, RolloutPhase.ABORTED, "ROLLBACK", why)
    _record_action("MANUAL_ROLLBACK", cand, stable, why, who, {"why": reason, "elapsed_s": time.monotonic() - t0})
    console.print(f"dropped candidate {cand}; stable is {stable}")


def _end_rollout(version: str, phase: RolloutPhase, outcome: str, reason: str) -> None:
    """Record the operator's action in the controller's status record if it concerns the
    rollout in progress (the controller then starts nothing for this version)."""
    p = rollout_status_path()
    st = RolloutStatus.load(p)
    if st.candidate == version and not st.phase.is_terminal():
        st.phase, st.weight, st.last_outcome, st.last_reason = phase, 0.0, outcome, reason
        st.save(p)

