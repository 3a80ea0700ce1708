"""On-call CLI of ``deploy``: controller, status, versions, promote, rollback, canary,
pause/resume (learner), runbook.

Every action that changes traffic asks for confirmation unless ``--yes`` and is recorded in
the ledger with who ran it (``$USER``).
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
from deploy.controller import (INCONCLUSIVE_POLICIES, ControllerConfig, RolloutController, RolloutPhase,
                               RolloutStatus, current_status, read_intent, write_intent)
from deploy.runbook import RUNBOOK
from deploy.serving_client import ServingAdmin, ServingAdminError
from deploy.store import ModelStore
from schemas import settings
from schemas.manifest import version_number

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


def _actor() -> str:
    return os.environ.get("USER") or getpass.getuser() or "unknown"


def _store() -> ModelStore:
    """The model store at ``schemas.settings.store_dir()`` (a directory or an fsspec URL)."""
    return ModelStore(settings.store_dir())


def _admin(serving: str | None, timeout_s: float = 120.0) -> ServingAdmin:
    return ServingAdmin(serving or settings.serving_url(), os.environ.get("FLYWHEEL_ADMIN_TOKEN"), timeout_s=timeout_s)


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


def _fail(msg: str) -> None:
    console.print(f"[red]error:[/red] {msg}")
    raise typer.Exit(2)


def _last_status(store: ModelStore, v: str) -> str:
    h = store.manifest(v).status_history
    return h[-1].status if h else ""


def previous_promoted(store: ModelStore, stable: str) -> str | None:
    """Newest version older than ``stable`` whose latest status is ``promoted``."""
    for v in reversed(store.versions()):
        if version_number(v) < version_number(stable) and _last_status(store, v) == "promoted":
            return v
    return None


def register(app: typer.Typer) -> None:
    """Add ``controller``, ``status``, ``versions``, ``promote``, ``rollback``,
    ``canary start|abort``, ``pause``, ``resume`` and ``runbook``."""
    canary = typer.Typer(help="Ask the controller to start or abort a canary (recorded intent).",
                         no_args_is_help=True)
    app.add_typer(canary, name="canary")

    @canary.command("start")
    def canary_start(version: str = typer.Argument(..., help="version to canary, e.g. v000003"),
                     yes: bool = typer.Option(False, "--yes", help="do not ask for confirmation")) -> None:
        """Canary VERSION at the next reconcile (also one the controller skipped or rolled back)."""
        store = _store()
        if version not in store.versions():
            _fail(f"version: {version!r} is not in the store (it has {', '.join(store.versions()) or 'none'})")
        _confirm(f"start a canary of {version}", yes)
        write_intent(intent_path(), "start", _actor(), version)
        console.print(f"recorded: start canary of {version}; the controller acts at its next reconcile")

    @canary.command("abort")
    def canary_abort(yes: bool = typer.Option(False, "--yes", help="do not ask for confirmation")) -> None:
        """Abort the canary in progress: the controller drops the candidate (all traffic to stable)."""
        st = current_status(rollout_status_path(), settings.ledger_path())
        if st.phase != RolloutPhase.CANARY:
            _fail(f"no canary in progress (phase {st.phase.value}); to drop a loaded candidate use "
                  "`flywheel rollback`")
        _confirm(f"abort the canary of {st.candidate} at {st.weight:.0%}", yes)
        write_intent(intent_path(), "abort", _actor())
        console.print(f"recorded: abort canary of {st.candidate}; the controller acts at its next reconcile")

    @app.command("pause")
    def pause_cmd(reason: str = typer.Option("", help="why (shown in status and the ledger)"),
                  yes: bool = typer.Option(False, "--yes", help="do not ask for confirmation")) -> None:
        """Pause the learner: its daemon publishes nothing new until `flywheel resume` (a cycle
        already running finishes)."""
        cur = learner_paused()
        if cur:
            console.print(f"learner already paused by {cur['actor']} at {_ts(cur['at'])}: {cur.get('reason', '')}")
            return
        _confirm("pause the learner", yes)
        pause_learner(_actor(), reason)
        console.print(f"learner paused by {_actor()} (flag {learner_pause_path()})")

    @app.command("resume")
    def resume_cmd(yes: bool = typer.Option(False, "--yes", help="do not ask for confirmation")) -> None:
        """Resume the learner after `flywheel pause`."""
        cur = learner_paused()
        if not cur:
            console.print("learner is not paused")
            return
        _confirm(f"resume the learner (paused by {cur['actor']})", yes)
        resume_learner(_actor())
        console.print(f"learner resumed by {_actor()}")

    @app.command("runbook")
    def runbook_cmd(as_json: bool = typer.Option(False, "--json", help="machine-readable output")) -> None:
        """On-call runbook: symptom -> what to check -> which command."""
        if as_json:
            print(json.dumps([{"symptom": a, "check": b, "command": c} for a, b, c in RUNBOOK], indent=1))
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
            None, help="serving base URL, repeat for several pods (default $FLYWHEEL_SERVING_URL)"),
        once: bool = typer.Option(False, "--once", help="reconcile until terminal, idle or holding, then exit"),
        steps: str = typer.Option("0.05,0.25,0.5,1", help="candidate traffic shares, comma-separated"),
        min_votes: int = typer.Option(20, help="votes per arm before the thumbs-up test runs"),
        max_wait_s: Optional[float] = typer.Option(None, help="fixed budget per step (s), then --inconclusive-policy"),
        inconclusive_policy: str = typer.Option(
            "hold", "--inconclusive-policy", "--inconclusive",
            help=f"what an inconclusive step does after --max-wait-s: one of {INCONCLUSIVE_POLICIES}"),
        deadline_s: float = typer.Option(3600.0, help="a step still inconclusive after this rolls back (s)"),
        poll_s: float = typer.Option(5.0, help="seconds between reconcile steps"),
    ) -> None:
        """Canary each newly published version: load, step traffic, analyze, promote or roll back."""
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
        try:
            cfg = ControllerConfig(steps=_parse_steps(steps), step_deadline_s=deadline_s, max_wait_s=max_wait_s,
                                   inconclusive_policy=inconclusive_policy,
                                   analysis=AnalysisConfig(min_votes=min_votes))
        except ValueError as exc:
            _fail(str(exc))
        admins = [_admin(u) for u in serving] if serving else [_admin(None)]
        ctl = RolloutController(_store(), admins, settings.samples_dir(),
                                settings.ledger_path(), rollout_status_path(), cfg, bootstrap=_bootstrap())
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
                   as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
                   last: int = typer.Option(10, min=1, help="decisions to show")) -> None:
        """Serving slots and weights, canary phase and step, last decisions with their numbers."""
        slots, err = None, None
        try:
            slots = _admin(serving, timeout_s=5.0).slots()  # a read: a wedged pod must not stall on-call
        except ServingAdminError as exc:
            err = str(exc)
        st = current_status(rollout_status_path(), settings.ledger_path())
        decs = ledger.decisions(settings.ledger_path(), limit=last)
        if as_json:
            sd = asdict(st)
            sd["phase"] = st.phase.value
            print(json.dumps({"serving": slots.model_dump() if slots else None, "serving_error": err,
                              "rollout": sd, "pending_intent": read_intent(intent_path()),
                              "learner": {"paused": learner_paused()},
                              "decisions": [asdict(d) for d in decs]}, indent=1))
            if err:
                raise typer.Exit(1)  # scripts can tell "serving down" from the exit status
            return
        t = Table(title="serving")
        for c in ("slot", "version", "weight", "weights digest", "loaded at (UTC)"):
            t.add_column(c, no_wrap=True)
        if slots:
            t.add_row("stable", slots.stable.version, f"{1 - slots.candidate_weight:.0%}",
                      slots.stable.weights_digest[:12], _ts(slots.stable.loaded_at))
            if slots.candidate:
                t.add_row("candidate", slots.candidate.version, f"{slots.candidate_weight:.0%}",
                          slots.candidate.weights_digest[:12], _ts(slots.candidate.loaded_at))
        console.print(t)
        if err:
            console.print(f"[red]serving unreachable:[/red] {err}")
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
        for d in decs:
            t.add_row(_ts(d.ts), d.version, d.stable or "", str(d.step), f"{d.weight:.0%}", d.decision,
                      d.actor, d.reason)
        console.print(t)
        if err:
            raise typer.Exit(1)

    @app.command("versions")
    def versions_cmd(as_json: bool = typer.Option(False, "--json", help="machine-readable output")) -> None:
        """Versions in the model store: parent, kind, size, delta ratio, status."""
        store = _store()
        rows = []
        for v in store.versions():
            m = store.manifest(v)
            rows.append({"version": v, "parent": m.parent, "kind": m.kind, "created_at": m.created_at,
                         "size_bytes": m.size_bytes, "snapshot_bytes": m.snapshot_bytes,
                         "delta_ratio": (m.snapshot_bytes / m.size_bytes) if m.size_bytes else None,
                         "status": m.status_history[-1].status if m.status_history else "",
                         "digest": m.weights_digest, "metrics": m.metrics})
        if as_json:
            print(json.dumps(rows, indent=1, default=str))
            return
        t = Table(title=f"model store {store.root}")
        for c in ("version", "parent", "kind", "size", "snapshot/size", "status", "digest", "created (UTC)"):
            t.add_column(c, no_wrap=True)
        for r in rows:
            t.add_row(r["version"], r["parent"] or "", r["kind"], f"{r['size_bytes'] / 1e6:.2f} MB",
                      f"{r['delta_ratio']:.1f}x" if r["delta_ratio"] else "", r["status"], r["digest"][:12],
                      _ts(r["created_at"]))
        console.print(t)

    @app.command("promote")
    def promote_cmd(serving: Optional[str] = typer.Option(None, help="serving base URL"),
                    yes: bool = typer.Option(False, "--yes", help="do not ask for confirmation")) -> None:
        """Promote the loaded candidate to stable now (hot swap)."""
        admin = _admin(serving)
        try:
            slots = admin.slots()
        except ServingAdminError as exc:
            _fail(str(exc))
        if slots.candidate is None:
            _fail("no candidate is loaded: nothing to promote")
        cand, stable = slots.candidate.version, slots.stable.version
        _confirm(f"promote {cand} (replacing {stable})", yes)
        try:
            admin.promote()
        except ServingAdminError as exc:
            _fail(str(exc))
        store = _store()
        reason = f"manual promote by {_actor()}"
        store.set_status(cand, "promoted", reason)
        _end_rollout(cand, RolloutPhase.PROMOTED, "PROMOTE", reason)
        ledger.record(settings.ledger_path(), ledger.LedgerEntry(
            version=cand, stable=stable, step=-1, weight=0.0, decision="MANUAL_PROMOTE", reason=reason,
            actor=_actor()), _bootstrap())
        console.print(f"promoted {cand}")

    @app.command("rollback")
    def rollback_cmd(to: Optional[str] = typer.Option(None, "--to", help="version to restore as stable"),
                     serving: Optional[str] = typer.Option(None, help="serving base URL"),
                     yes: bool = typer.Option(False, "--yes", help="do not ask for confirmation")) -> None:
        """Drop the candidate if one is loaded; otherwise (or with --to) restore stable to the
        previous promoted version."""
        admin = _admin(serving)
        store = _store()
        try:
            slots = admin.slots()
        except ServingAdminError as exc:
            _fail(str(exc))
        stable = slots.stable.version
        actor = _actor()
        t0 = time.monotonic()
        if to is None and slots.candidate is not None:
            cand = slots.candidate.version
            _confirm(f"drop candidate {cand} (stable {stable} keeps all traffic)", yes)
            try:
                admin.rollback()
            except ServingAdminError as exc:
                _fail(str(exc))
            reason = f"manual rollback of candidate by {actor}"
            store.set_status(cand, "rolled_back", reason)
            _end_rollout(cand, RolloutPhase.ABORTED, "ROLLBACK", reason)
            ledger.record(settings.ledger_path(), ledger.LedgerEntry(
                version=cand, stable=stable, step=-1, weight=0.0, decision="MANUAL_ROLLBACK", reason=reason,
                numbers={"elapsed_s": time.monotonic() - t0}, actor=actor), _bootstrap())
            console.print(f"dropped candidate {cand}; stable is {stable}")
            return
        if to is None:
            to = previous_promoted(store, stable)
            if to is None:
                _fail(f"no promoted version older than stable {stable} to roll back to")
        try:
            store.manifest(to)
        except (KeyError, ValueError) as exc:
            _fail(f"--to: {exc}")
        _confirm(f"replace stable {stable} by {to}", yes)
        try:
            after = admin.rollback(to)
        except ServingAdminError as exc:
            _fail(str(exc))
        elapsed = time.monotonic() - t0
        reason = f"manual rollback of stable {stable} to {to} by {actor}"
        if to != stable:
            store.set_status(stable, "rolled_back", reason)
        store.set_status(to, "promoted", reason)
        if slots.candidate is not None:
            store.set_status(slots.candidate.version, "rolled_back", reason)
            _end_rollout(slots.candidate.version, RolloutPhase.ABORTED, "ROLLBACK", reason)
        ledger.record(settings.ledger_path(), ledger.LedgerEntry(
            version=to, stable=stable, step=-1, weight=0.0, decision="MANUAL_ROLLBACK", reason=reason,
            numbers={"elapsed_s": elapsed, "from": stable, "digest": after.stable.weights_digest},
            actor=actor), _bootstrap())
        console.print(f"stable is now {after.stable.version} ({elapsed:.2f} s)")


def _end_rollout(version: str, phase: RolloutPhase, outcome: str, reason: str) -> None:
    """Record the operator's action in the controller's status record if it concerns the
    rollout in progress (the controller then starts nothing for this version)."""
    p = rollout_status_path()
    st = RolloutStatus.load(p)
    if st.candidate == version and not st.phase.is_terminal():
        st.phase, st.weight, st.last_outcome, st.last_reason = phase, 0.0, outcome, reason
        st.save(p)

