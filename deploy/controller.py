"""Rollout controller: canary a newly published version, then promote or roll back.

Every decision goes to the ledger (DuckDB + ``flywheel.deployments``), and the ledger is
the source of truth of the rollout: :func:`status_from_ledger` replays it into a
:class:`RolloutStatus` (phase, candidate, step, weight, timestamps), so a controller killed
mid-canary resumes at the recorded step and takes no decision twice. The status JSON (atomic
rewrite) is a cache for the CLI and the fallback while the ledger cannot be read.
:meth:`RolloutController.reconcile` performs one step acting on the stored phase (Flagger
habit). Error rate, p99 latency and tokens/s come from serving's ``/metrics``
(:mod:`deploy.metrics`).

Votes come from ingest's sample shards (``<samples_dir>/model_version=<v>/...parquet``):
per version, ``sum(votes_up)`` and ``sum(votes_down)`` of samples created after the canary
started. The controller does not know how serving splits traffic or how ingest labels.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path

import duckdb

from deploy import ledger
from deploy.analysis import AnalysisConfig, ArmStats, Check, Outcome, analyze
from deploy.serving_client import ServingAdmin, ServingAdminError
from deploy.store import ModelStore
from schemas.manifest import version_number

log = logging.getLogger(__name__)

DEFAULT_STEPS = (0.05, 0.25, 0.5, 1.0)
INCONCLUSIVE_POLICIES = ("hold", "promote_if_not_worse")


class RolloutPhase(str, Enum):
    """Phase of the current rollout."""

    IDLE = "idle"  # nothing to do: serving's stable is the newest eligible version
    CANARY = "canary"  # candidate loaded, receiving weight steps[step]
    PROMOTED = "promoted"  # candidate became stable (terminal)
    ROLLED_BACK = "rolled_back"  # candidate dropped after a failed analysis or deadline (terminal)
    FAILED = "failed"  # serving could not load the candidate (terminal)
    ABORTED = "aborted"  # an operator dropped the candidate (terminal)

    def is_terminal(self) -> bool:
        return self in (RolloutPhase.PROMOTED, RolloutPhase.ROLLED_BACK, RolloutPhase.FAILED,
                        RolloutPhase.ABORTED)


@dataclass
class RolloutStatus:
    """The persisted status record of the controller."""

    phase: RolloutPhase = RolloutPhase.IDLE
    candidate: str | None = None
    stable: str | None = None
    step: int = -1
    weight: float = 0.0
    canary_started_ms: int = 0
    step_started_ms: int = 0
    last_outcome: str = ""
    last_reason: str = ""
    updated_ms: int = 0

    @classmethod
    def load(cls, path: Path) -> "RolloutStatus":
        path = Path(path)
        if not path.exists():
            return cls()
        d = json.loads(path.read_text())
        d["phase"] = RolloutPhase(d["phase"])
        return cls(**d)

    def save(self, path: Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.updated_ms = int(time.time() * 1000)
        d = asdict(self)
        d["phase"] = self.phase.value
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
        tmp.write_text(json.dumps(d, indent=1))
        os.replace(tmp, path)


@dataclass
class ControllerConfig:
    """Rollout policy.

    Fields:
        steps: candidate traffic shares, increasing, in (0, 1]; the last must be 1.0.
        step_deadline_s: a step still inconclusive after this long rolls back (s).
        max_wait_s: fixed-budget mode: after this long an inconclusive step is decided by
            ``inconclusive_policy`` (None = off) (s).
        inconclusive_policy: ``hold`` (keep waiting until the deadline) or
            ``promote_if_not_worse`` (advance when no metric failed or errored).
        analysis: thresholds, incl. ``min_votes`` per arm (counted since the canary started).
        min_votes_per_step: new candidate votes needed within a step before it may advance
            (None = ``analysis.min_votes``); a failing analysis rolls back regardless.
    """

    steps: tuple[float, ...] = DEFAULT_STEPS
    step_deadline_s: float = 3600.0
    max_wait_s: float | None = None
    inconclusive_policy: str = "hold"
    analysis: AnalysisConfig = field(default_factory=AnalysisConfig)
    min_votes_per_step: int | None = None

    def __post_init__(self):
        if self.min_votes_per_step is None:
            self.min_votes_per_step = self.analysis.min_votes
        if self.min_votes_per_step < 0:
            raise ValueError(f"min_votes_per_step: must be >= 0, got {self.min_votes_per_step}")
        self.steps = tuple(float(s) for s in self.steps)
        if not self.steps:
            raise ValueError("steps: at least one step is needed")
        if any(not 0 < s <= 1 for s in self.steps):
            raise ValueError(f"steps: each must be in (0, 1], got {self.steps}")
        if list(self.steps) != sorted(set(self.steps)):
            raise ValueError(f"steps: must be strictly increasing, got {self.steps}")
        if self.steps[-1] != 1.0:
            raise ValueError(f"steps: the last step must be 1.0, got {self.steps[-1]}")
        if self.step_deadline_s <= 0:
            raise ValueError(f"step_deadline_s: must be > 0, got {self.step_deadline_s}")
        if self.max_wait_s is not None and self.max_wait_s <= 0:
            raise ValueError(f"max_wait_s: must be > 0, got {self.max_wait_s}")
        if self.inconclusive_policy not in INCONCLUSIVE_POLICIES:
            raise ValueError(f"inconclusive_policy: must be one of {INCONCLUSIVE_POLICIES}, "
                             f"got {self.inconclusive_policy!r}")


_END_PHASE = {"PROMOTE": RolloutPhase.PROMOTED, "ROLLBACK": RolloutPhase.ROLLED_BACK,
              "FAILED": RolloutPhase.FAILED, "ABORT": RolloutPhase.ABORTED,
              "MANUAL_PROMOTE": RolloutPhase.PROMOTED, "MANUAL_ROLLBACK": RolloutPhase.ABORTED}


def status_from_ledger(entries: list[ledger.LedgerEntry]) -> RolloutStatus | None:
    """Replay ledger decisions (oldest first) into the rollout status they imply; None if
    no rollout was ever recorded.

    START opens a canary (candidate, stable, step 0, weight, ``canary_started_ms``);
    ADVANCE moves it to the recorded step and weight (``step_started_ms``); HOLD updates the
    last outcome; PROMOTE / ROLLBACK / FAILED / ABORT end it; MANUAL_PROMOTE of the candidate
    and any MANUAL_ROLLBACK (the CLI always drops the candidate) end it too. FAILED is
    recorded without a START. RELOAD changes nothing.
    """
    st = None
    for e in entries:
        d = e.decision
        if d == "START" or (d == "FAILED" and (st is None or st.phase != RolloutPhase.CANARY)):
            st = RolloutStatus(phase=RolloutPhase.CANARY, candidate=e.version, stable=e.stable, step=e.step,
                               weight=e.weight, canary_started_ms=e.ts, step_started_ms=e.ts)
        if st is None:
            continue
        in_canary = st.phase == RolloutPhase.CANARY
        if d == "ADVANCE" and in_canary and e.version == st.candidate:
            st.step, st.weight, st.step_started_ms = e.step, e.weight, e.ts
        elif d in _END_PHASE and in_canary and (e.version == st.candidate or d == "MANUAL_ROLLBACK"):
            if d in ("PROMOTE", "MANUAL_PROMOTE"):
                st.stable = st.candidate
            st.phase, st.weight = _END_PHASE[d], 0.0
        elif d in ("MANUAL_PROMOTE", "MANUAL_ROLLBACK") and not in_canary:
            st.stable = e.version  # the version the operator made stable
        if d != "RELOAD" and (e.version == st.candidate or d.startswith("MANUAL_")):
            st.last_outcome, st.last_reason = d, e.reason
    return st


def current_status(status_path: Path, ledger_path: Path) -> RolloutStatus:
    """The rollout status, rebuilt from the ledger (:func:`status_from_ledger`), which is the
    source of truth: a controller killed between a serving action, its ledger row and the
    status file resumes at the step the ledger says, so no decision is taken twice. The
    status JSON is a cache, used only while the ledger has no rollout or cannot be read."""
    try:
        cached = RolloutStatus.load(status_path)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        log.warning("status file %s unreadable (%s): rebuilding from the ledger", status_path, exc)
        cached = RolloutStatus()
    try:
        st = status_from_ledger(ledger.decisions(ledger_path))
    except Exception as exc:  # noqa: BLE001 - ledger locked/unreadable: fall back to the cache
        log.warning("ledger %s unreadable (%s): using the status file", ledger_path, exc)
        return cached
    return cached if st is None else st


def vote_counts(samples_dir: Path, since_ms: int = 0) -> dict[str, tuple[int, int, int]]:
    """``{model_version: (votes_up, votes_down, samples)}`` of samples created at or after
    ``since_ms`` (ms), read from the hive-partitioned Parquet shards with DuckDB.
    Returns ``{}`` when there are no shards yet."""
    samples_dir = Path(samples_dir)
    if not samples_dir.exists() or not any(samples_dir.rglob("*.parquet")):
        return {}
    glob = str(samples_dir / "**" / "*.parquet").replace("'", "''")
    con = duckdb.connect()
    try:
        rows = con.execute(
            f"SELECT CAST(model_version AS VARCHAR), sum(votes_up), sum(votes_down), count(*) "
            f"FROM read_parquet('{glob}', hive_partitioning=true, hive_types_autocast=false) "
            f"WHERE created_at >= ? GROUP BY 1", [int(since_ms)]).fetchall()
    finally:
        con.close()
    return {r[0]: (int(r[1] or 0), int(r[2] or 0), int(r[3])) for r in rows}


def write_intent(path: Path, action: str, actor: str, version: str | None = None) -> dict:
    """Record an operator's intent for the controller (``abort`` the canary in progress, or
    ``start`` a canary of ``version``); the controller acts on it at its next reconcile and
    clears it. Raises ValueError on an unknown action or ``start`` without a version."""
    if action not in ("abort", "start"):
        raise ValueError(f"action: must be 'abort' or 'start', got {action!r}")
    if action == "start":
        if not version:
            raise ValueError("version: required to start a canary")
        version_number(version)
    intent = {"action": action, "version": version, "actor": actor, "at": int(time.time() * 1000)}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    tmp.write_text(json.dumps(intent))
    os.replace(tmp, path)
    return intent


def read_intent(path: Path) -> dict | None:
    path = Path(path)
    return json.loads(path.read_text()) if path.exists() else None


class RolloutController:
    """Canary newly published versions on one or more serving pods.

    Args:
        store: the model store (versions and their status history).
        admin: serving admin client, or a list (one per pod): every action is applied to
            every pod; the first pod's stable version is the baseline. A pod that fails to
            load the candidate aborts the rollout on all pods and is named in the reason.
        samples_dir: root of the sample Parquet shards.
        ledger_path: DuckDB ledger file.
        status_path: the persisted :class:`RolloutStatus` JSON.
        config: rollout policy.
        bootstrap: Kafka bootstrap for ``flywheel.deployments`` (None: ledger only).
        clock: returns ms since epoch (tests inject one).
        intent_path: operator intents (:func:`write_intent`); default ``intent.json`` next
            to ``status_path``.
        arm_metrics: ``f(status) -> (candidate, stable[, skipped])``: dicts of per-version
            ``errors``, ``requests``, ``p99_ms``, ``tokens_per_s`` since the canary started,
            and ``{metric: reason}`` for metrics not available. Default: a
            :class:`deploy.metrics.ServingMetricsSource` over every pod's ``/metrics``
            (baseline in ``metrics_baseline.json`` next to ``status_path``); metrics serving
            does not export per version are SKIPPED with the reason in the ledger. An
            exception counts as ERROR (HOLD). Pass ``False`` for thumbs-up only.
        discover: ``f() -> [ServingAdmin]`` asked for the current pods before every
            reconcile step (a headless Service's DNS answer: :class:`deploy.discovery.PodDiscovery`);
            ``admin`` may then be empty. A failed lookup raises ServingAdminError (HOLD).
    """

    def __init__(self, store: ModelStore, admin: ServingAdmin, samples_dir: Path, ledger_path: Path,
                 status_path: Path, config: ControllerConfig | None = None,
                 bootstrap: str | None = None, clock=None, intent_path: Path | None = None,
                 arm_metrics=None, discover=None):
        self.admins: list[ServingAdmin] = list(admin) if isinstance(admin, (list, tuple)) else [admin]
        self.discover = discover  # () -> [ServingAdmin]: the pods now (deploy.discovery.PodDiscovery)
        if not self.admins and discover is None:
            raise ValueError("admin: at least one serving pod is needed")
        self.store, self.admin = store, (self.admins[0] if self.admins else None)
        self.samples_dir, self.ledger_path, self.status_path = Path(samples_dir), Path(ledger_path), Path(status_path)
        self.config = config or ControllerConfig()
        self.bootstrap = bootstrap
        self.clock = clock or (lambda: int(time.time() * 1000))
        self.intent_path = Path(intent_path) if intent_path else self.status_path.with_name("intent.json")
        if arm_metrics is None:
            from deploy.metrics import ServingMetricsSource

            arm_metrics = ServingMetricsSource(self.admins, self.status_path.with_name("metrics_baseline.json"))
        self.arm_metrics = arm_metrics or None

    @property
    def status(self) -> RolloutStatus:
        """The rollout status (:func:`current_status`)."""
        return current_status(self.status_path, self.ledger_path)

    def _record(self, st: RolloutStatus, decision: str, reason: str, numbers: dict | None = None,
                version: str | None = None, actor: str = "controller") -> None:
        ledger.record(self.ledger_path, ledger.LedgerEntry(
            version=version or st.candidate or "", stable=st.stable, step=st.step, weight=st.weight,
            decision=decision, reason=reason, numbers=numbers or {}, actor=actor,
            ts=self.clock()), self.bootstrap)
        log.info("%s %s: %s", decision, version or st.candidate, reason)

    def next_candidate(self, stable: str) -> str | None:
        """Newest published version newer than ``stable`` that was never rejected, rolled
        back or failed; None if there is none."""
        bad = {"rejected", "rolled_back", "failed", "aborted"}
        for v in reversed(self.store.versions()):
            if version_number(v) <= version_number(stable):
                return None
            if not bad & {s.status for s in self.store.manifest(v).status_history}:
                return v
        return None

    def _each(self, op: str, *args) -> None:
        """Apply one admin operation to every pod (ServingAdminError names the pod's URL)."""
        for a in self.admins:
            getattr(a, op)(*args)

    def _promote_all(self, candidate: str) -> list[float]:
        """Promote on every pod; returns each pod's reported swap pause (ms)."""
        pauses = []
        for a in self.admins:
            if a.slots().stable.version == candidate:
                continue  # already promoted there (a retry after a partial failure)
            s = a.promote()
            if s.last_swap_pause_ms is not None:
                pauses.append(s.last_swap_pause_ms)
        return pauses

    def _refresh_pods(self) -> None:
        """Take the pod set from ``discover`` (in place: every holder of ``admins`` sees it)."""
        if self.discover is None:
            return
        self.admins[:] = self.discover()
        self.admin = self.admins[0]
        if hasattr(self.arm_metrics, "admins"):
            self.arm_metrics.admins = list(self.admins)

    def reconcile(self) -> RolloutStatus:
        """One step acting on the stored phase; returns the new status (also persisted).

        Raises:
            ServingAdminError: serving unreachable while reading slots (nothing changed).
        """
        self._refresh_pods()
        st = self.status
        intent = read_intent(self.intent_path)
        if intent is not None:  # consumed now; _abort re-records it if serving failed
            self.intent_path.unlink(missing_ok=True)
        try:
            if intent and intent["action"] == "abort":
                st = self._abort(st, intent)
            elif st.phase == RolloutPhase.CANARY:
                st = self._canary_step(st)
            else:
                st = self._maybe_start(st, intent)
        except Exception:
            if intent is not None and not self.intent_path.exists():  # not acted on: keep it
                write_intent(self.intent_path, intent["action"], intent["actor"], intent.get("version"))
            raise
        st.save(self.status_path)
        return st

    def _abort(self, st: RolloutStatus, intent: dict) -> RolloutStatus:
        if st.phase != RolloutPhase.CANARY:
            log.info("abort requested by %s but no canary is in progress", intent["actor"])
            return st
        reason = f"canary aborted by {intent['actor']} at step {st.step} ({st.weight:.0%})"
        try:
            self._each("rollback")
        except ServingAdminError as exc:
            st.last_outcome, st.last_reason = "HOLD", f"abort requested but serving failed: {exc}"
            write_intent(self.intent_path, "abort", intent["actor"])  # keep the intent: retry next time
            self._record(st, "HOLD", st.last_reason, actor=intent["actor"])
            return st
        st.phase, st.weight, st.last_outcome, st.last_reason = RolloutPhase.ABORTED, 0.0, "ABORT", reason
        self.store.set_status(st.candidate, "aborted", reason)
        self._record(st, "ABORT", reason, actor=intent["actor"])
        return st

    def _maybe_start(self, st: RolloutStatus, intent: dict | None = None) -> RolloutStatus:
        slots = self.admin.slots()
        stable = slots.stable.version
        actor = "controller"
        if intent and intent["action"] == "start":
            cand, actor = intent["version"], intent["actor"]
            try:
                self.store.manifest(cand)
            except KeyError as exc:
                log.warning("canary start by %s ignored: %s", actor, exc)
                cand = None
            if cand == stable:
                log.warning("canary start by %s ignored: %s is already stable", actor, cand)
                cand = None
        else:
            cand = self.next_candidate(stable)
        if cand is None:
            if st.phase.is_terminal():
                return st  # keep the last outcome visible until there is new work
            return RolloutStatus(phase=RolloutPhase.IDLE, stable=stable)
        prev = st
        now = self.clock()
        st = RolloutStatus(phase=RolloutPhase.CANARY, candidate=cand, stable=stable, step=0,
                           canary_started_ms=now, step_started_ms=now)
        try:
            for a in self.admins:
                s = a.slots()
                if s.candidate is not None and s.candidate.version != cand:
                    a.rollback()
                a.load(cand)
            self._each("set_weight", self.config.steps[0])
        except ServingAdminError as exc:
            return self._load_failed(prev, st, cand, exc)
        st.weight = self.config.steps[0]
        st.last_outcome, st.last_reason = "START", f"canary of {cand} against {stable} at {st.weight:.0%}"
        if actor != "controller":
            st.last_reason += f", started by {actor}"
        self.store.set_status(cand, "canary", st.last_reason)
        if hasattr(self.arm_metrics, "mark"):
            self.arm_metrics.mark(st)  # serving counters are measured from here
        self._record(st, "START", st.last_reason, {"steps": list(self.config.steps)}, actor=actor)
        return st

    def _load_failed(self, prev: RolloutStatus, st: RolloutStatus, cand: str,
                     exc: ServingAdminError) -> RolloutStatus:
        """A pod failed while the canary of ``cand`` was being set up: drop the candidate on
        every other pod (the failing pod too when it answered; a pod that timed out is not
        called again, so a wedged pod costs one timeout). A refused load (4xx: bad bytes,
        hashes or parent) marks ``cand`` failed for good; a transport failure (timeout,
        unreachable, 5xx) does not: the next reconcile retries it. Recorded as FAILED with
        the failure kind, once per distinct reason."""
        st.phase, st.weight, st.last_outcome = RolloutPhase.FAILED, 0.0, "FAILED"
        if exc.transport:
            st.last_reason = (f"serving pod {exc.pod} failed while loading {cand} ({exc.kind}: {exc}); "
                              f"transport failure: {cand} is not marked failed and is retried at the next "
                              "reconcile")
        else:
            st.last_reason = f"serving pod {exc.pod} could not load {cand}: {exc.reason}"
            self.store.set_status(cand, "failed", st.last_reason)
        for a in self.admins:  # abort everywhere: no pod keeps the candidate
            if exc.transport and a.base_url == exc.pod:
                continue
            try:
                a.rollback()
            except ServingAdminError as e2:
                log.warning("clean-up rollback of %s on %s failed: %s", cand, a.base_url, e2)
        if not (prev.phase == RolloutPhase.FAILED and prev.candidate == cand and prev.last_reason == st.last_reason):
            self._record(st, "FAILED", st.last_reason, exc.numbers())
        return st

    def arm_stats(self, st: RolloutStatus) -> tuple[ArmStats, ArmStats, int, str | None, dict[str, str]]:
        """Candidate and stable stats since the canary started, the candidate's votes since
        the current step started, a source error (or None) and ``{metric: skip reason}``."""
        try:
            counts = vote_counts(self.samples_dir, st.canary_started_ms)
            step_counts = vote_counts(self.samples_dir, st.step_started_ms)
        except (duckdb.Error, OSError) as exc:
            return ArmStats(), ArmStats(), 0, f"sample shards unreadable: {exc}", {}
        cu, cd, _ = counts.get(st.candidate, (0, 0, 0))
        su, sd, _ = counts.get(st.stable, (0, 0, 0))
        su_step, sd_step, _ = step_counts.get(st.candidate, (0, 0, 0))
        if self.arm_metrics is not None:
            try:
                got = self.arm_metrics(st)
                extra_c, extra_s = got[0], got[1]
                skipped = dict(got[2]) if len(got) > 2 else {}
                c = ArmStats(votes_up=cu, votes_down=cd, **extra_c)
                s = ArmStats(votes_up=su, votes_down=sd, **extra_s)
            except Exception as exc:  # noqa: BLE001 - any failure of the source is an ERROR
                return ArmStats(), ArmStats(), 0, f"arm metrics: {type(exc).__name__}: {exc}", {}
            return c, s, su_step + sd_step, None, skipped
        return (ArmStats(votes_up=cu, votes_down=cd), ArmStats(votes_up=su, votes_down=sd),
                su_step + sd_step, None, {})

    def _ensure_loaded(self, st: RolloutStatus) -> None:
        """Re-load the candidate on a pod that lost it (e.g. restarted) and restore the weight;
        recorded as RELOAD. ServingAdminError propagates (the next reconcile retries)."""
        for a in self.admins:
            s = a.slots()
            if s.stable.version == st.candidate or (s.candidate and s.candidate.version == st.candidate):
                continue
            a.load(st.candidate)
            a.set_weight(st.weight)
            self._record(st, "RELOAD", f"pod {a.base_url} had lost candidate {st.candidate}: re-loaded at "
                         f"{st.weight:.0%}", {"pod": a.base_url})

    def _canary_step(self, st: RolloutStatus) -> RolloutStatus:
        cfg = self.config
        self._ensure_loaded(st)
        cand_stats, stable_stats, step_votes, err, skipped = self.arm_stats(st)
        d = analyze(cand_stats, stable_stats, cfg.analysis, source_error=err, skipped=skipped)
        now = self.clock()
        waited_s = (now - st.step_started_ms) / 1000.0
        numbers = {**d.numbers(), "waited_s": waited_s, "step": st.step, "weight": st.weight,
                   "step_candidate_votes": step_votes, "min_votes_per_step": cfg.min_votes_per_step}
        outcome, reason = d.outcome, d.reason
        if outcome == Outcome.PROMOTE and step_votes < cfg.min_votes_per_step:
            outcome = Outcome.HOLD
            reason = (f"HOLD (inconclusive): {step_votes} new candidate votes at step {st.step} "
                      f"({st.weight:.0%}), need {cfg.min_votes_per_step}; analysis so far: {d.reason}")
        if outcome == Outcome.HOLD:
            if waited_s >= cfg.step_deadline_s:
                outcome = Outcome.ROLLBACK
                reason = f"step deadline {cfg.step_deadline_s:.0f}s exceeded after {waited_s:.0f}s; {reason}"
            elif cfg.max_wait_s is not None and waited_s >= cfg.max_wait_s:
                thumbs_ok = all(m.check not in (Check.FAIL, Check.ERROR) for m in d.metrics) and err is None
                # never promote on empty data: both arms, and this step, must have votes
                has_data = (cand_stats.votes_up + cand_stats.votes_down > 0
                            and stable_stats.votes_up + stable_stats.votes_down > 0 and step_votes > 0)
                if cfg.inconclusive_policy == "promote_if_not_worse" and thumbs_ok and not has_data:
                    reason = (f"fixed budget: max_wait_s={cfg.max_wait_s:.0f}s reached, but an arm or this "
                              f"step has no votes: holding (never decide on empty data); {reason}")
                elif cfg.inconclusive_policy == "promote_if_not_worse" and thumbs_ok:
                    outcome = Outcome.PROMOTE
                    reason = (f"fixed budget: max_wait_s={cfg.max_wait_s:.0f}s reached, inconclusive, "
                              f"policy promote_if_not_worse (no metric failed); {reason}")
                else:
                    reason = (f"fixed budget: max_wait_s={cfg.max_wait_s:.0f}s reached, policy "
                              f"{cfg.inconclusive_policy}: holding; {reason}")
        if outcome == Outcome.HOLD:
            if st.last_outcome != "HOLD" or st.last_reason != reason:
                st.last_outcome, st.last_reason = "HOLD", reason
                self._record(st, "HOLD", reason, numbers)
            return st
        if outcome == Outcome.ROLLBACK:
            try:
                self._each("rollback")
            except ServingAdminError as exc:
                st.last_outcome, st.last_reason = "HOLD", f"rollback requested but serving failed: {exc}"
                self._record(st, "HOLD", st.last_reason, numbers)
                return st
            st.phase, st.weight = RolloutPhase.ROLLED_BACK, 0.0
            st.last_outcome, st.last_reason = "ROLLBACK", reason
            self.store.set_status(st.candidate, "rolled_back", reason)
            self._record(st, "ROLLBACK", reason, numbers)
            return st
        # PROMOTE at this step: advance, or promote at the last one
        try:
            if st.step + 1 < len(cfg.steps):
                w = cfg.steps[st.step + 1]
                self._each("set_weight", w)
                st.step, st.weight, st.step_started_ms = st.step + 1, w, now
                st.last_outcome, st.last_reason = "ADVANCE", f"to {w:.0%}: {reason}"
                self._record(st, "ADVANCE", st.last_reason, numbers)
                return st
            pauses = self._promote_all(st.candidate)
            if pauses:
                numbers["swap_pause_ms"] = max(pauses)
        except ServingAdminError as exc:
            st.last_outcome, st.last_reason = "HOLD", f"serving refused: {exc}"
            self._record(st, "HOLD", st.last_reason, numbers)
            return st
        st.phase, st.weight = RolloutPhase.PROMOTED, 0.0
        st.last_outcome, st.last_reason = "PROMOTE", reason
        self.store.set_status(st.candidate, "promoted", reason)
        self._record(st, "PROMOTE", reason, numbers)
        st.stable = st.candidate
        return st

    def run_once(self, max_steps: int = 100) -> RolloutStatus:
        """Reconcile until the rollout is terminal or idle, or a step holds (no progress)."""
        st = self.reconcile()
        for _ in range(max_steps):
            if st.phase != RolloutPhase.CANARY or st.last_outcome == "HOLD":
                break
            st = self.reconcile()
        return st

    def run_forever(self, poll_s: float = 5.0, stop=None) -> None:
        """Reconcile every ``poll_s`` seconds until ``stop()`` returns True; any error
        (serving unreachable, ledger locked too long, ...) is logged and retried on the next
        poll. A failed step leaves the persisted phase as it was and is redone; each step
        checks serving's slots first (re-load, skip pods already promoted), so it converges."""
        while not (stop and stop()):
            try:
                self.reconcile()
            except ServingAdminError as exc:
                log.warning("reconcile: %s", exc)
            except Exception:  # noqa: BLE001 - the controller must outlive one bad step
                log.exception("reconcile failed")
            time.sleep(poll_s)
