"""Rollout controller: canary a newly published version, then promote or roll back.

Every decision is first written into the fleet's desired-state record
(:mod:`modelstore.desired`), the one record of what is stable and what is canaried; each
reconcile step then PUTs the record's target to every discovered pod not at it
(:mod:`deploy.fleet`), including pods that restarted, drifted or were unreachable before (the
pods also converge by their own watch of the record). The controller's reconcile loop is the
only Flywheel code that calls a pod's changing endpoint. A
canary an operator started (``flywheel canary start``: candidate and weight in the record, a
MANUAL_CANARY_START ledger row) is analysed and advanced like the controller's own.

Every decision goes to the ledger (DuckDB + ``flywheel.deployments``), and the ledger is
the source of truth of the rollout's history: :func:`status_from_ledger` replays it into a
:class:`RolloutStatus` (phase, candidate, step, weight, timestamps), so a controller killed
mid-canary resumes at the recorded step and takes no decision twice. The status JSON (atomic
rewrite) is a cache for the CLI and the fallback while the ledger cannot be read; both
are made to agree with the desired-state record (:func:`status_with_record`: its stable, and
a canary whose candidate left the record has ended).
:meth:`RolloutController.reconcile` performs one step acting on the stored phase (Flagger
habit). Error rate, p99 latency and tokens/s come from serving's ``/metrics``
(:mod:`deploy.metrics`).

Votes and rewards come from ingest's sample shards (``<samples_dir>/model_version=<v>/...parquet``,
read with ``union_by_name``): per version, ``sum(votes_up)`` and ``sum(votes_down)`` of samples
created after the canary started, and, per reward policy digest, the count, sum and sum of
squares of their rewards and how many were regenerated, followed up dissatisfied or copied
(:func:`canary_counts`; shards written before the reward policy have none of these columns and
count votes only). The controller does not know how serving splits traffic or how ingest labels.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import duckdb
from pydantic import AliasChoices, BeforeValidator, ConfigDict, Field
from pydantic.dataclasses import dataclass as config_dataclass

from deploy import ledger
from deploy.analysis import AnalysisConfig, ArmStats
from deploy.decide import DEADLINE_OUTCOMES, Evidence, StepAction, StepPolicy, decide_step
from modelstore.desired import HEARTBEAT_FILE, CandidateChanged, DesiredState, FleetRecord, RecordUnreadable, drop_candidate
from deploy.fleet import PodOutcome, reconcile_pods
from deploy.fleet import summary as fleet_summary
from deploy.history import user_history_covariate
from deploy.serving_client import ServingAdmin, ServingAdminError
from samplestore.votes import CanaryCounts, canary_counts
from modelstore.store import CorruptVersionError, ModelStore
from schemas.events import now_ms
from schemas.manifest import version_number

log = logging.getLogger(__name__)

DEFAULT_STEPS = (0.05, 0.25, 0.5, 1.0)


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
    failed_checks: dict = field(default_factory=dict)  # failed checks in a row per metric (analysis)
    decided_by: str | None = None  # what decided the terminal action (deploy.decide)

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
        self.updated_ms = now_ms()
        d = asdict(self)
        d["phase"] = self.phase.value
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
        tmp.write_text(json.dumps(d, indent=1))
        os.replace(tmp, path)


def parse_steps(value):
    """``steps`` as given on the command line or in ``flywheel.toml`` (``"0.05,0.25,0.5,1"``)
    or by a program (a sequence of numbers) -> a tuple of floats.

    Raises:
        ValueError: text that is not a comma-separated list of numbers (names ``steps``).
    """
    if isinstance(value, str):
        try:
            return tuple(float(x) for x in value.split(",") if x.strip())
        except ValueError:
            raise ValueError(f"steps: {value!r} is not a comma-separated list of numbers") from None
    return value


def format_steps(steps) -> str:
    """The ``--steps`` text of a tuple of shares (``0.05,0.25,0.5,1``)."""
    return ",".join(f"{s:g}" for s in steps)


@config_dataclass(config=ConfigDict(validate_by_name=True, validate_by_alias=True))
class ControllerConfig:
    """Rollout policy; each field's ``description`` is its help (the ``flywheel controller``
    option of the same name, ``[controller]`` in ``flywheel.toml``).

    Fields:
        steps: candidate traffic shares, increasing, in (0, 1]; at least two, the last 1.0,
            which is the promotion itself: a canary is analysed at the shares before it, where
            the stable version still serves (``deploy.decide.next_share``). Also given as
            text, ``"0.05,0.25,0.5,1"`` (``--steps``).
        deadline_s: a step still undecided after this long takes ``deadline_outcome`` (s);
            ``step_deadline_s`` is accepted as its name too (and read as a property).
        deadline_outcome: ``rollback`` (default, production) or ``promote``; a step whose
            data could not be judged (ERROR) rolls back either way.
        analysis: thresholds, incl. ``min_votes`` per arm (counted since the canary started).
        min_votes_per_step: new candidate votes needed within a step before it may advance
            (None = ``analysis.min_votes``, :attr:`votes_per_step`); a failing analysis rolls
            back regardless.

    Raises:
        ValueError (pydantic's ValidationError): a value out of bounds, naming the field.
    """

    steps: Annotated[tuple[float, ...], BeforeValidator(parse_steps)] = Field(
        DEFAULT_STEPS, description="candidate traffic shares, comma-separated, increasing in (0, 1], ending in 1; "
        "the canary is analysed at each share below 1 and passing the last of them promotes (the final 1 is the "
        "promotion itself, docs/decisions.md D27)", json_schema_extra={"cli": False})
    deadline_s: float = Field(3600.0, validation_alias=AliasChoices("deadline_s", "step_deadline_s"),
                              description="a step still undecided after this takes --deadline-outcome (> 0)",
                              json_schema_extra={"unit": "s"})
    deadline_outcome: str = Field("rollback", description=f"one of {', '.join(DEADLINE_OUTCOMES)}")
    analysis: AnalysisConfig = Field(default_factory=AnalysisConfig, description="the canary analysis' thresholds "
                                     "(the options of AnalysisConfig)", json_schema_extra={"cli": False})
    min_votes_per_step: Optional[int] = Field(None, ge=0, description="new candidate votes a step needs before "
                                              "it advances (default: --min-votes)", json_schema_extra={"unit": "votes"})

    def __post_init__(self):
        if not self.steps:
            raise ValueError("steps: at least one step is needed")
        if any(not 0 < s <= 1 for s in self.steps):
            raise ValueError(f"steps: each must be in (0, 1], got {self.steps}")
        if list(self.steps) != sorted(set(self.steps)):
            raise ValueError(f"steps: must be strictly increasing, got {self.steps}")
        if self.steps[-1] != 1.0:
            raise ValueError(f"steps: the last step must be 1.0, got {self.steps[-1]}")
        if len(self.steps) < 2:
            raise ValueError("steps: needs a share below 1.0 before the final 1.0: at 100 % the stable version "
                             "serves nobody, so there is nothing to compare the candidate with")
        if not self.deadline_s > 0:  # an open bound: schemas.options cannot give click gt yet
            raise ValueError(f"step_deadline_s: must be > 0, got {self.deadline_s}")
        if self.deadline_outcome not in DEADLINE_OUTCOMES:
            raise ValueError(f"deadline_outcome: must be one of {DEADLINE_OUTCOMES}, got {self.deadline_outcome!r}")

    @property
    def step_deadline_s(self) -> float:
        """``deadline_s`` under its earlier name (s)."""
        return self.deadline_s

    @property
    def votes_per_step(self) -> int:
        """``min_votes_per_step``, else ``analysis.min_votes`` (votes)."""
        return self.analysis.min_votes if self.min_votes_per_step is None else self.min_votes_per_step

    def step_policy(self) -> StepPolicy:
        """The part of this policy :func:`deploy.decide.decide_step` reads."""
        return StepPolicy(self.steps, self.deadline_s, self.deadline_outcome, self.votes_per_step, self.analysis)


_END_PHASE = {"PROMOTE": RolloutPhase.PROMOTED, "ROLLBACK": RolloutPhase.ROLLED_BACK,
              "FAILED": RolloutPhase.FAILED, "ABORT": RolloutPhase.ABORTED,
              "MANUAL_PROMOTE": RolloutPhase.PROMOTED, "MANUAL_ROLLBACK": RolloutPhase.ABORTED,
              "MANUAL_CANARY_ABORT": RolloutPhase.ABORTED}


_ANY = object()  # RolloutController._desire: no check of the record's candidate

_NOT_ROLLOUT = ("RELOAD", "RECONCILE", "FLEET_CONVERGED", "FLEET_NOT_CONVERGED")  # pod repairs, no decision


def status_from_ledger(entries: list[ledger.LedgerEntry]) -> RolloutStatus | None:
    """Replay ledger decisions (oldest first) into the rollout status they imply; None if
    no rollout was ever recorded.

    START, and MANUAL_CANARY_START (``flywheel canary start``, which puts the candidate on
    every pod itself), open a canary (candidate, stable, step 0, weight, ``canary_started_ms``);
    ADVANCE moves it to the recorded step and weight (``step_started_ms``); HOLD updates the
    last outcome; PROMOTE / ROLLBACK / FAILED / ABORT end it; MANUAL_PROMOTE and
    MANUAL_CANARY_ABORT of the candidate and any MANUAL_ROLLBACK (the CLI always drops the
    candidate) end it too. FAILED is recorded without a START. RELOAD, RECONCILE and FLEET_*
    (pod repairs and convergence reports) change nothing. Rows ``MANUAL_CANARY_*`` with neither
    ``numbers["generation"]`` nor ``numbers["pods"]`` are requests an earlier CLI recorded for the controller to act on
    (its own START / ABORT row followed): they change nothing either.
    """
    st = None
    for e in entries:
        d = e.decision
        if d in ("MANUAL_CANARY_START", "MANUAL_CANARY_ABORT") and not {"pods", "generation"} & set(e.numbers or {}):
            continue  # a request, not an action (see above)
        if d in ("START", "MANUAL_CANARY_START") or (d == "FAILED" and (st is None or st.phase != RolloutPhase.CANARY)):
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
        if d not in _NOT_ROLLOUT and (e.version == st.candidate or d.startswith("MANUAL_")):
            st.last_outcome, st.last_reason = d, e.reason
            nums = e.numbers or {}
            if d in ("START", "MANUAL_CANARY_START"):
                st.failed_checks, st.decided_by = {}, None
            elif isinstance(nums.get("failed_checks"), dict):
                st.failed_checks = dict(nums["failed_checks"])
            if nums.get("decided_by"):
                st.decided_by = nums["decided_by"]
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


def status_with_record(st: RolloutStatus, d: DesiredState | None, steps=DEFAULT_STEPS) -> RolloutStatus:
    """The rollout status made to agree with the desired-state record ``d`` (the one record of
    what is stable and what is canaried; None: unreadable, ``st`` as it is): outside a canary,
    the record's stable; in a canary whose candidate left the record, the canary ended
    (promoted when the record made it stable, else aborted: an operator's action, whose
    ledger row says who); a weight the record holds for the candidate is the canary's (its
    step when it is one of ``steps``)."""
    if d is None:
        return st
    if st.phase != RolloutPhase.CANARY:
        if d.stable:
            st.stable = d.stable
        return st
    if d.candidate != st.candidate:
        if d.candidate is None or d.stable == st.candidate:
            promoted = d.stable == st.candidate
            st.phase = RolloutPhase.PROMOTED if promoted else RolloutPhase.ABORTED
            st.weight, st.stable = 0.0, d.stable
            if not st.last_outcome.startswith("MANUAL_"):
                st.last_outcome = "PROMOTE" if promoted else "ABORT"
                st.last_reason = (f"{d.action or 'changed'} by {d.actor or '?'} (desired state generation "
                                  f"{d.generation})")
        return st  # another candidate: the controller opens its canary (RolloutController._maybe_start)
    if abs(d.weight - st.weight) > 1e-12:
        st.weight = d.weight
        if d.weight in steps:
            st.step = list(steps).index(d.weight)
    return st


def judged_policy(cc: CanaryCounts, candidate: str, stable: str) -> str | None:
    """The reward policy (digest) the canary judges: of the digests both arms' samples carry,
    the one with the most samples (ties: the smallest digest); else the candidate's most
    frequent one (the stable arm then has no rewarded sample and the reward test waits); None
    when neither arm has a sample with a reward policy (shards written before it). Rewards of
    two policies are never compared with each other."""
    rc, rs = cc.rewards.get(candidate, {}), cc.rewards.get(stable, {})
    both = set(rc) & set(rs)
    pool = both or set(rc) or set(rs)
    if not pool:
        return None

    def n(d: str) -> int:
        return rc.get(d, {}).get("rewarded", 0) + rs.get(d, {}).get("rewarded", 0)

    return min(pool, key=lambda d: (-n(d), d))


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
        arm_metrics: ``f(status) -> (candidate, stable[, skipped])``: dicts of per-version
            ``errors``, ``requests``, ``p99_ms``, ``tokens_per_s`` since the canary started,
            and ``{metric: reason}`` for metrics not available. Default: a
            :class:`deploy.metrics.ServingMetricsSource` over every pod's ``/metrics``
            (baseline in ``metrics_baseline.json`` next to ``status_path``); metrics serving
            does not export per version are SKIPPED with the reason in the ledger. An
            exception counts as ERROR (HOLD). Pass ``False`` for thumbs-up only.
        served: guard figures over every served completion (``counts(since_ms, versions)``,
            :class:`deploy.replies.ServedCompletions`); None: from the voted samples.
        discover: ``f() -> [ServingAdmin]`` asked for the current pods before every
            reconcile step (a headless Service's DNS answer: :class:`deploy.discovery.PodDiscovery`);
            ``admin`` may then be empty. A failed lookup raises ServingAdminError (HOLD).
        fleet: the desired-state record (default: the store's, :class:`modelstore.desired.FleetRecord`).
            Every decision is written there first; each step brings every pod to it.
    """

    def __init__(self, store: ModelStore, admin: ServingAdmin, samples_dir: Path, ledger_path: Path,
                 status_path: Path, config: ControllerConfig | None = None,
                 bootstrap: str | None = None, clock=None,
                 arm_metrics=None, discover=None, fleet: FleetRecord | None = None, served=None):
        self.admins: list[ServingAdmin] = list(admin) if isinstance(admin, (list, tuple)) else [admin]
        self.discover = discover  # () -> [ServingAdmin]: the pods now (deploy.discovery.PodDiscovery)
        if not self.admins and discover is None:
            raise ValueError("admin: at least one serving pod is needed")
        self.store, self.admin = store, (self.admins[0] if self.admins else None)
        self.fleet = fleet or FleetRecord(store)
        self.last_outcomes: list[PodOutcome] = []  # the last reconcile pass, one per pod
        self.samples_dir, self.ledger_path, self.status_path = Path(samples_dir), Path(ledger_path), Path(status_path)
        self.config = config or ControllerConfig()
        self.bootstrap = bootstrap
        self.clock = clock or now_ms
        if arm_metrics is None:
            from deploy.metrics import ServingMetricsSource

            arm_metrics = ServingMetricsSource(self.admins, self.status_path.with_name("metrics_baseline.json"))
        self.arm_metrics = arm_metrics or None
        self.served = served  # deploy.replies.ServedCompletions, or None: guards from the samples
        from deploy.metrics import ControllerMetrics

        self.exported = ControllerMetrics(self.config)  # Prometheus (flywheel controller --metrics-port)
        self._beat_error: str | None = None  # why the last heartbeat could not be written (logged once)

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
        self.exported.decision(decision, st, numbers or {})

    def next_candidate(self, stable: str) -> str | None:
        """Newest published version newer than ``stable`` that was never rejected, rolled
        back or failed, and whose manifest is readable; None if there is none. A version whose
        manifest is corrupt is recorded FAILED once (with the file and the reason) and skipped."""
        bad = {"rejected", "rolled_back", "failed", "aborted"}
        for v in reversed(self.store.versions()):
            if version_number(v) <= version_number(stable):
                return None
            try:
                hist = self.store.manifest(v).status_history
            except CorruptVersionError as exc:
                self._corrupt_manifest(v, exc)
                continue
            if not bad & {s.status for s in hist}:
                return v
        return None

    def _corrupt_manifest(self, version: str, exc: CorruptVersionError) -> None:
        """Record FAILED for a version whose manifest cannot be read (once per reason); the
        manifest cannot carry the status itself, so the ledger does, and the controller
        skips the version from then on."""
        reason = f"{exc}: the version is skipped (republish it under a new id)"
        last = ledger.decisions(self.ledger_path, version=version)
        if last and last[-1].decision == "FAILED" and last[-1].reason == reason:
            return
        st = RolloutStatus(phase=RolloutPhase.FAILED, candidate=version, stable=None)
        self._record(st, "FAILED", reason, {"file": f"versions/{version}/manifest.json", "failure": "corrupt"},
                     version=version)

    def _refresh_pods(self) -> None:
        """Take the pod set from ``discover`` (in place: every holder of ``admins`` sees it)."""
        if self.discover is None:
            return
        self.admins[:] = self.discover()
        self.admin = self.admins[0] if self.admins else None
        if hasattr(self.arm_metrics, "admins"):
            self.arm_metrics.admins = list(self.admins)

    # -- the desired state and the pods ---------------------------------------------------------
    def _desire(self, action: str, reason: str, actor: str = "controller", expect=_ANY, **fields) -> DesiredState:
        """Write ``fields`` into the fleet's desired-state record (one new generation), after
        checking, under the fleet lock, that its candidate is still ``expect`` (when given).

        Raises:
            modelstore.desired.CandidateChanged: the candidate changed meanwhile (an operator's
                action); nothing is written.
        """
        def fn(d: DesiredState) -> DesiredState:
            if expect is not _ANY and d.candidate != expect:
                raise CandidateChanged(f"candidate: the desired state changed meanwhile (generation {d.generation}, "
                                       f"{d.action or 'set'} by {d.actor or '?'}: candidate now {d.candidate})")
            for k, v in fields.items():
                setattr(d, k, v)
            return d
        return self.fleet.change(fn, actor, action, reason)

    def _pass(self, skip: set[str] = frozenset()) -> list[PodOutcome]:
        """One reconcile pass of every pod (but ``skip``'s URLs): the record's target PUT to each
        pod not at its generation (:func:`deploy.fleet.reconcile_pods`). Not under the fleet
        lock: a pass never delays an operator's change, and a pod refuses a target older than
        the one it has taken."""
        d = self.fleet.read()
        outcomes = reconcile_pods([a for a in self.admins if a.base_url not in skip], d)
        self.last_outcomes = outcomes
        return outcomes

    def _record_repairs(self, st: RolloutStatus, outcomes: list[PodOutcome]) -> None:
        """A pass that had to change a pod (restarted, drifted, back from unreachable) is a
        ledger row: RELOAD when it re-loaded the canary's candidate, else RECONCILE."""
        for o in outcomes:
            if not o.actions:
                continue
            nums = {"pod": o.url, "pod_name": o.pod, "actions": o.actions, "outcome": o.outcome}
            if st.phase == RolloutPhase.CANARY and f"load {st.candidate}" in o.actions:
                self._record(st, "RELOAD", f"pod {o.url} had lost candidate {st.candidate}: re-loaded at "
                             f"{st.weight:.0%}", nums)
            else:
                d = self.fleet.read()
                self._record(st, "RECONCILE", f"pod {o.pod or o.url} brought to the desired state "
                             f"({'; '.join(o.actions)}): {o.outcome}", nums, version=d.stable or "")

    def reconcile(self) -> RolloutStatus:
        """One step: read the desired-state record, bring every pod to it (one PUT of its
        target each, :meth:`_pass`), act on the stored phase, which may change the record and bring the pods to it again; returns the
        new status (also persisted). The record is the truth: a canary whose candidate left
        the record (an operator's rollback, abort or promote) has ended, and a weight the
        record holds is the canary's. Pods that do not converge are listed in
        :attr:`last_outcomes` and retried next step; the pods' own watch of the record gets
        them there too. The fleet lock is held only while the record changes.
        """
        self._refresh_pods()
        d = self.fleet.read()
        st = self._status_from(self.status, d)
        try:
            self._record_repairs(st, self._pass())
            if st.phase == RolloutPhase.CANARY:
                st = self._canary_step(st)
            else:
                st = self._maybe_start(st)
        except CandidateChanged as exc:  # an operator changed the record meanwhile: next step reads it
            log.info("step not taken: %s", exc)
        st.save(self.status_path)
        self.exported.status(st)
        return st

    def _status_from(self, st: RolloutStatus, d: DesiredState) -> RolloutStatus:
        return status_with_record(st, d, self.config.steps)

    def _maybe_start(self, st: RolloutStatus) -> RolloutStatus:
        desired = self.fleet.read()
        stable = desired.stable
        if stable is None:
            return st
        actor = "controller"
        if desired.candidate is not None:
            # a candidate in the record while the ledger has no canary of it (the ledger row of
            # `flywheel canary start`, or of this controller's START, was not written): open the
            # canary of it, so it is analysed rather than left serving unjudged
            cand = desired.candidate
            if desired.action.startswith("canary start") and desired.actor:
                actor = desired.actor
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
        weight = self.config.steps[0]  # the canary's first step, also for a candidate already in the record
        self._desire("canary start", f"canary of {cand}", actor, expect=desired.candidate, candidate=cand,
                     weight=weight)
        outcomes = self._pass()
        failed = [o for o in outcomes if not o.ok]
        if failed:
            return self._load_failed(prev, st, cand, failed[0])
        st.weight = weight
        st.step = self.config.steps.index(weight) if weight in self.config.steps else 0
        st.last_outcome, st.last_reason = "START", f"canary of {cand} against {stable} at {st.weight:.0%}"
        if actor != "controller":
            st.last_reason += f", started by {actor}"
        self.store.set_status(cand, "canary", st.last_reason)
        if hasattr(self.arm_metrics, "mark"):
            self.arm_metrics.mark(st)  # serving counters are measured from here
        self._record(st, "START", st.last_reason, {"steps": list(self.config.steps), "pods": fleet_summary(outcomes)},
                     actor=actor)
        return st

    def _load_failed(self, prev: RolloutStatus, st: RolloutStatus, cand: str, o: PodOutcome) -> RolloutStatus:
        """A pod failed while the canary of ``cand`` was being set up: take the candidate out
        of the desired record and drop it on every other pod (the failing pod too when it
        answered; a pod that timed out or could not be reached is not called again this step,
        so a wedged pod costs one timeout). A refused load (4xx: bad bytes, hashes or parent)
        marks ``cand`` failed for good; a transport failure (timeout, unreachable, 5xx) does
        not: the next reconcile retries it. Recorded as FAILED with the failure kind, once
        per distinct reason."""
        exc = o.exc
        st.phase, st.weight, st.last_outcome = RolloutPhase.FAILED, 0.0, "FAILED"
        if exc is None:  # the pod answered but ended elsewhere (a concurrent change)
            st.last_reason = f"serving pod {o.url} did not converge while loading {cand}: {o.error}"
        elif exc.transport:
            st.last_reason = (f"serving pod {exc.pod} failed while loading {cand} ({exc.kind}: {exc}); "
                              f"transport failure: {cand} is not marked failed and is retried at the next "
                              "reconcile")
        else:
            st.last_reason = f"serving pod {exc.pod} could not load {cand}: {exc.reason}"
            self.store.set_status(cand, "failed", st.last_reason)
        drop_candidate(self.fleet, cand, "controller", "canary failed", st.last_reason)
        skip = {o.url} if exc is not None and exc.transport else set()
        for o2 in self._pass(skip):
            if not o2.ok:
                log.warning("clean-up of %s on %s: %s", cand, o2.url, o2.error)
        if not (prev.phase == RolloutPhase.FAILED and prev.candidate == cand and prev.last_reason == st.last_reason):
            self._record(st, "FAILED", st.last_reason, exc.numbers() if exc is not None else {"pod": o.url})
        return st

    def arm_stats(self, st: RolloutStatus) -> tuple[ArmStats, ArmStats, int, str | None, dict[str, str], dict]:
        """Candidate and stable stats since the canary started, the candidate's evidence since
        the current step started (its rewarded samples under the judged reward policy,
        :func:`judged_policy`, when the analysis judges reward and the shards carry one; its
        votes otherwise), a source error (or None), ``{metric: skip reason}`` and the votes by
        split (``Evidence.by_split``), from one scan of the shards."""
        try:
            cc = canary_counts(self.samples_dir, st.canary_started_ms, st.step_started_ms)
        except (duckdb.Error, OSError) as exc:
            return ArmStats(), ArmStats(), 0, f"sample shards unreadable: {exc}", {}, {}
        cu, cd, _ = cc.votes.get(st.candidate, (0, 0, 0))
        su, sd, _ = cc.votes.get(st.stable, (0, 0, 0))
        su_step, sd_step = cc.step_votes.get(st.candidate, (0, 0))
        policy = judged_policy(cc, st.candidate, st.stable)
        rew_c = {**cc.rewards.get(st.candidate, {}).get(policy, {}), "reward_policy": policy} if policy else {}
        rew_s = {**cc.rewards.get(st.stable, {}).get(policy, {}), "reward_policy": policy} if policy else {}
        step_n = su_step + sd_step  # the step's evidence: candidate votes, or its rewarded samples
        if policy is not None and self.config.analysis.quality == "reward":
            step_n = cc.step_rewarded.get(st.candidate, {}).get(policy, 0)
        gc, gs = cc.guards.get(st.candidate, {}), cc.guards.get(st.stable, {})
        if self.served is not None:  # every served completion, not only the voted ones
            sc = self.served.counts(st.canary_started_ms, (st.candidate, st.stable))
            gc, gs = sc.get(st.candidate, {}), sc.get(st.stable, {})
        by_split = {split: {"candidate": list(counts.get(st.candidate, (0, 0))),
                            "stable": list(counts.get(st.stable, (0, 0)))} for split, counts in cc.by_split.items()}
        extra_c, extra_s, skipped = {}, {}, {}
        if self.arm_metrics is not None:
            try:
                got = self.arm_metrics(st)
                extra_c, extra_s = got[0], got[1]
                skipped = dict(got[2]) if len(got) > 2 else {}
            except Exception as exc:  # noqa: BLE001 - any failure of the source is an ERROR
                return ArmStats(), ArmStats(), 0, f"arm metrics: {type(exc).__name__}: {exc}", {}, by_split
        try:  # CUPED covariate: the voting users' pre-canary thumbs-up rate (deploy.history)
            cov = user_history_covariate(self.samples_dir, st.canary_started_ms, (st.candidate, st.stable))
        except (duckdb.Error, OSError) as exc:
            log.warning("user history unreadable (%s): the thumbs-up test uses the plain rates", exc)
            cov = {}
        cov_c, cov_s = (cov.get(st.candidate, {}), cov.get(st.stable, {})) if len(cov) == 2 else ({}, {})
        try:
            c = ArmStats(votes_up=cu, votes_down=cd, **gc, **extra_c, **cov_c, **rew_c)
            s = ArmStats(votes_up=su, votes_down=sd, **gs, **extra_s, **cov_s, **rew_s)
        except (TypeError, ValueError) as exc:
            return ArmStats(), ArmStats(), 0, f"bad evidence: {exc}", {}, by_split
        return c, s, step_n, None, skipped, by_split

    def evidence(self, st: RolloutStatus) -> Evidence:
        """Everything :func:`deploy.decide.decide_step` judges, read since the canary started."""
        c, s, step_votes, err, skipped, by_split = self.arm_stats(st)
        first = self.first_guards(st)
        return Evidence(c, s, step_votes, err, skipped, by_split, first,
                        self.lifetime_guards(st, st.stable) if first is not None else None)

    def first_guards(self, st: RolloutStatus) -> ArmStats | None:
        """The first version's guard figures over all its completions (the guards' second
        baseline, ``deploy.analysis``), or None when it is the stable or unknown."""
        versions = self.store.versions()
        first = versions[0] if versions else None
        if first is None or first in (st.stable, st.candidate):
            return None
        return self.lifetime_guards(st, first)

    def lifetime_guards(self, st: RolloutStatus, version: str) -> ArmStats | None:
        """``version``'s guard figures over all its completions, or None when unknown or
        unreadable (the shards are scanned once per canary, not per poll)."""
        try:
            if self.served is not None:
                g = self.served.counts(0, (version,)).get(version)
            else:
                key = st.canary_started_ms
                if getattr(self, "_lifetime_cache", (None,))[0] != key:
                    self._lifetime_cache = (key, canary_counts(self.samples_dir, 0, 0).guards)
                g = self._lifetime_cache[1].get(version)
            return ArmStats(**g) if g else None
        except (duckdb.Error, OSError, TypeError, ValueError) as exc:
            log.warning("guard figures of %s unreadable: %s", version, exc)
            return None

    def _canary_step(self, st: RolloutStatus) -> RolloutStatus:
        """Decide (pure, :func:`deploy.decide.decide_step`), write the decision into the
        desired record, bring the pods to it, record the decision with each pod's outcome.
        A pod that does not converge is retried at the next step."""
        now = self.clock()
        d = decide_step(st.step, st.step_started_ms, st.failed_checks, self.evidence(st), self.config.step_policy(),
                        now)
        st.failed_checks = d.failed_checks
        numbers = d.numbers
        if d.action == StepAction.HOLD:
            if st.last_outcome != "HOLD" or st.last_reason != d.reason:
                st.last_outcome, st.last_reason = "HOLD", d.reason
                self._record(st, "HOLD", d.reason, numbers)
            return st
        if d.action == StepAction.ROLLBACK:
            drop_candidate(self.fleet, st.candidate, "controller", "canary rollback", d.reason)
            numbers["pods"] = fleet_summary(self._pass())
            st.phase, st.weight, st.decided_by = RolloutPhase.ROLLED_BACK, 0.0, d.decided_by
            st.last_outcome, st.last_reason = "ROLLBACK", d.reason
            self.store.set_status(st.candidate, "rolled_back", d.reason)
            self._record(st, "ROLLBACK", d.reason, numbers)
            return st
        if d.action == StepAction.ADVANCE:
            self._desire("canary advance", d.reason, expect=st.candidate, weight=d.weight)
            numbers["pods"] = fleet_summary(self._pass())
            st.step, st.weight, st.step_started_ms = st.step + 1, d.weight, now
            st.last_outcome, st.last_reason = "ADVANCE", d.reason
            self._record(st, "ADVANCE", st.last_reason, numbers)
            return st
        self._desire("canary promote", d.reason, expect=st.candidate, stable=st.candidate, candidate=None, weight=0.0,
                     reload_after_ms=0)
        outcomes = self._pass()
        pauses = [o.swap_pause_ms for o in outcomes if o.swap_pause_ms is not None]
        if pauses:
            numbers["swap_pause_ms"] = max(pauses)
        numbers["pods"] = fleet_summary(outcomes)
        st.phase, st.weight, st.decided_by = RolloutPhase.PROMOTED, 0.0, d.decided_by
        st.last_outcome, st.last_reason = "PROMOTE", d.reason
        self.store.set_status(st.candidate, "promoted", d.reason, actor="controller")
        self._record(st, "PROMOTE", d.reason, numbers)
        st.stable = st.candidate
        return st

    def record_path(self) -> str:
        """Where the fleet's desired-state record lives (for messages)."""
        return self.fleet.path

    def beat(self, poll_s: float | None, error: str | None = None) -> None:
        """Write the controller's heartbeat beside the record (:meth:`modelstore.desired.FleetRecord.beat`:
        now, this host and process, ``poll_s`` (None: ``--once``) and the last step's error), by
        which ``flywheel status`` and ``canary start`` tell a running controller from none
        (``deploy.status.controller_warning``). A heartbeat that cannot be written is logged
        (once per reason), never stops the controller."""
        try:
            self.fleet.beat({"at": int(self.clock()), "host": socket.gethostname(), "pid": os.getpid(),
                             "poll_s": poll_s, "error": error})
            self._beat_error = None
        except Exception as exc:  # noqa: BLE001 - any store error (a full disk, an object store's 5xx)
            if str(exc) != self._beat_error:
                self._beat_error = str(exc)
                log.warning("controller heartbeat %s not written: %s", "/".join(HEARTBEAT_FILE), exc)

    def run_once(self, max_steps: int = 100) -> RolloutStatus:
        """Reconcile until the rollout is terminal or idle, or a step holds (no progress); the
        heartbeat (:meth:`beat`) is written before and after, whatever the step raised."""
        self.beat(None)
        try:
            st = self.reconcile()
            for _ in range(max_steps):
                if st.phase != RolloutPhase.CANARY or st.last_outcome == "HOLD":
                    break
                st = self.reconcile()
        except Exception as exc:
            self.beat(None, f"{type(exc).__name__}: {exc}")
            raise
        self.beat(None)
        return st

    def run_forever(self, poll_s: float, stop=None) -> None:
        """Reconcile every ``poll_s`` seconds until ``stop()`` returns True; any error
        (serving unreachable, ledger locked too long, ...) is logged and retried on the next
        poll. A failed step leaves the persisted phase as it was and is redone; each step
        checks serving's slots first (re-load, skip pods already promoted), so it converges.

        An unreadable desired-state record (:class:`modelstore.desired.RecordUnreadable`) is one
        ERROR line naming the file and what to do, logged again only when the reason changes,
        and one INFO line once it reads again; meanwhile no pod is called (they keep serving).

        The heartbeat (:meth:`beat`) is written before the first step and after every step,
        with the step's error, if any."""
        unreadable: str | None = None  # the reason last logged for an unreadable record
        self.beat(poll_s)
        while not (stop and stop()):
            err = None
            try:
                self.reconcile()
                if unreadable is not None:
                    log.info("desired-state record %s readable again: reconciling", self.record_path())
                    unreadable = None
            except RecordUnreadable as exc:
                self.exported.reconcile_failed()
                err = f"desired-state record unreadable: {exc}"
                if str(exc) != unreadable:
                    unreadable = str(exc)
                    log.error("desired-state record %s unreadable (%s): no pod is changed and no canary step "
                              "runs until it reads again; the pods keep serving what they serve. Repair it from "
                              "a backup, or remove it (the record then restarts from the store's stable record, "
                              "unpaused, with no candidate)", self.record_path(), exc)
            except ServingAdminError as exc:
                self.exported.reconcile_failed()
                err = str(exc)
                log.warning("reconcile: %s", exc)
            except Exception as exc:  # noqa: BLE001 - the controller must outlive one bad step
                self.exported.reconcile_failed()
                err = f"{type(exc).__name__}: {exc}"
                log.exception("reconcile failed")
            self.beat(poll_s, err)
            time.sleep(poll_s)
