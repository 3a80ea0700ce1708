"""Operator actions on the fleet: change the desired-state record, then watch the fleet converge.

As Argo Rollouts' CLI patches the Rollout object and leaves acting to the controller, an
action (``flywheel promote``, ``rollback``, ``canary start|abort`` ...) is one change of the
fleet's desired-state record (:mod:`modelstore.desired`), made under the fleet lock together with
the version statuses derived from it and the decision's ledger row. The operator's process
then only WATCHES: it reads each pod's served generation (``GET /admin/desired``, short
per-request bounds) until every pod reports the new generation or ``timeout_s`` passes, and
appends each pod's observed outcome to the ledger (``FLEET_CONVERGED`` /
``FLEET_NOT_CONVERGED``). It never calls a pod's mutating endpoint: the pods get there by
their own watch of the record (``serving.pod.DesiredWatch``, every ``--desired-poll`` s) and
by the controller's reconcile loop, whichever comes first; with no controller running the
pods still converge. The action returns by ``timeout_s`` whatever a pod does (hung,
SIGSTOPped, unreachable). A later change of the record by someone else (a newer generation
with other serving fields) ends the watch: the action was superseded.

Which pods (:class:`PodChoice`), decided from the record as the action wrote it, under the
fleet lock, so two operators at once watch the same pods: the serving specs recorded in the
desired state (``pods``: by the controller, by an earlier command, or by ``--record-pods``),
else the ones given (``--serving``), else ``$FLYWHEEL_SERVING_URL`` (used, never recorded: it is
often a Service's URL). ``--serving`` given while the record lists none is written into it
with the action's change only when every spec found at least one pod and every pod found
answered a read before the change (so a typo is never recorded); otherwise the command says
why it was not recorded. ``--record-pods`` replaces the record's list with ``--serving`` in the
action's change, whatever the pods answer. A URL that answers as more than one pod (a load
balancer) is reported as such, never taken for one pod.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from typing import Callable

from modelstore.desired import DesiredState, FleetRecord, LockTimeout
from deploy.discovery import PodDiscovery, resolve
from deploy.fleet import PodOutcome, observe_pods_generation, summary
from deploy.serving_client import ServingAdmin, ServingAdminError
from schemas.pod_target import normalize_spec


@dataclass
class ActionResult:
    """How an operator action ended.

    Fields:
        desired: the record the action wrote.
        outcomes: each pod's outcome after the last pass.
        superseded_by: the newer record that replaced ours while waiting, or None.
        elapsed_s: from the record change to the end (s).
        discovery_error: why pods could not be listed (DNS), or None.
        raised_from: the generation first written, when the pods had taken a newer one (a
            record restored or edited to an older generation) and the record was written
            again past theirs; None otherwise.
        notes: what to tell the operator about which pods were watched and whether the record's
            pod list changed (:func:`choose_pods`).
    """

    desired: DesiredState
    outcomes: list[PodOutcome] = field(default_factory=list)
    superseded_by: DesiredState | None = None
    elapsed_s: float = 0.0
    discovery_error: str | None = None
    raised_from: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def converged(self) -> bool:
        """Every pod found serves the desired state, and at least one pod was found."""
        return bool(self.outcomes) and all(o.ok for o in self.outcomes) and self.superseded_by is None

    def not_converged(self) -> list[PodOutcome]:
        return [o for o in self.outcomes if not o.ok]


def pod_specs(desired: DesiredState, given: list[str] | None, default: str) -> tuple[list[str], str | None]:
    """``(specs, note)``: the fleet's recorded pod specs when there are some (note says when
    ``given`` is another set of pods, compared in :func:`schemas.pod_target.normalize_spec`'s
    form), else ``given``, else ``[default]``."""
    if desired.pods:
        note = None
        if given and {normalize_spec(g) for g in given} != {normalize_spec(p) for p in desired.pods}:
            note = (f"acting on the fleet's pods {', '.join(desired.pods)} (recorded in its desired state by the "
                    f"controller or an earlier command); --serving {', '.join(given)} is not that list and is not "
                    "used (`--record-pods` with --serving replaces the list)")
        return list(desired.pods), note
    return list(given or [default]), None


@dataclass
class PodChoice:
    """Which pods an operator action watches, and how it may change the record's pod list.

    Fields:
        given: the ``--serving`` specs (checked, each once), or None.
        default: ``$FLYWHEEL_SERVING_URL``, watched when the record lists no pods and none is
            given; never recorded.
        make_admin: the admin client of one pod URL (its reads bounded short).
        replace: ``--record-pods``: ``given`` replaces the record's ``pods`` in the action's change.
        probe_s: the bound on the read of each given pod before the change (s), when the record
            lists none.
        resolver: ``socket.getaddrinfo`` or a function with its signature (tests).
    """

    given: list[str] | None
    default: str | None
    make_admin: Callable[[str], ServingAdmin]
    replace: bool = False
    probe_s: float = 2.0
    resolver: Callable = socket.getaddrinfo


def probe_pods(choice: PodChoice, deadline: float) -> str | None:
    """Why ``choice.given`` must not be recorded as the fleet's pods, or None when every spec
    found at least one pod and every pod found answered one read (``GET /admin/desired``, any
    state), by ``deadline`` (``time.monotonic()``). Read-only."""
    urls, why = [], []
    for spec in choice.given or []:
        try:
            found = resolve(spec, choice.resolver)
        except (ValueError, ServingAdminError) as exc:
            why.append(f"{spec} found no pod ({exc})")
            continue
        urls += [u for u in found if u not in urls]
    if urls:
        outcomes = observe_pods_generation([choice.make_admin(u) for u in urls], DesiredState(), deadline)
        for o in outcomes:
            if o.exc is not None or o.pod is None or o.outcome in ("timeout", "load_balancer"):
                why.append(f"{o.url} did not answer ({o.outcome})")
    return "; ".join(why) or None


def choose_pods(choice: PodChoice, before: DesiredState, after: DesiredState,
                not_recorded: str | None) -> tuple[list[str], list[str]]:
    """``(specs, notes)``: the pods an action watches, from the record as it wrote it
    (``after``; ``before``: the record under the lock before the change), and what to tell
    the operator: the record's pods when it lists some (a note when ``--serving`` is another
    list), else ``--serving``, else the default. ``not_recorded``: why ``--serving`` was not
    written into a record that lists none."""
    given, notes = choice.given, []
    if after.pods != before.pods:
        notes.append(f"the fleet's pods are now {', '.join(after.pods)} (written into its desired state, generation "
                     f"{after.generation}{'; were ' + ', '.join(before.pods) if before.pods else ''})")
    if after.pods:
        specs, note = pod_specs(after, given, choice.default or "")
        notes += [note] if note else []
        return specs, notes
    if given:
        notes.append(f"--serving {', '.join(given)} was not recorded as the fleet's pods: "
                     f"{not_recorded or 'the record listed pods when this command started'}; it is used for this "
                     "command only (`--record-pods` with --serving records a list whatever its pods answer)")
        return list(given), notes
    return [choice.default or ""], notes


def _discover(pods: PodDiscovery | None, why: str | None = None) -> tuple[list, str | None]:
    if pods is None:
        return [], why
    try:
        return pods(), None
    except ServingAdminError as exc:
        return [], str(exc)


def run_action(fleet: FleetRecord, pods: PodChoice, change, *, what: str, who: str, why: str,
               on_changed, record, timeout_s: float, lock_timeout_s: float | None = None,
               poll_s: float = 0.25) -> ActionResult:
    """Change the record, record the decision, watch the pods converge, record what was observed.

    Args:
        pods: which pods to watch and how the record's pod list may change
            (:class:`PodChoice`); the pods are chosen from the record as written
            (:func:`choose_pods`). Their clients' timeouts should be short: each read is also
            cut at the deadline.
        change: ``f(DesiredState) -> DesiredState``; raises ValueError to refuse (nothing is
            changed, nothing recorded here: the caller records the refusal).
        on_changed: ``f(before, after)`` run under the lock right after the record changed
            (the version statuses derived from it).
        record: ``f(decision_suffix, numbers)`` writes a ledger row: with ``""`` and the new
            generation under the lock (then ``"pods"`` with ``{"generation", "pods", "was",
            "replaced"}`` when the record's pod list changed), then with ``"converged"`` or
            ``"not_converged"`` and each pod's observed outcome when the watch ends.
        timeout_s: how long to watch (s), from the start of the action (the lock wait
            included); 0: change the record and return at once, observing each pod once. A
            ``--serving`` list checked before the change adds one read of each of its pods.
        lock_timeout_s: how long to wait for another writer holding the fleet lock (None:
            ``timeout_s``, at least 1 s).
        poll_s: seconds between two reads of the pods.

    Raises:
        ValueError: ``change`` refused.
        modelstore.desired.LockTimeout: the lock was not acquired within ``lock_timeout_s``.
    """
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    lock_s = max(1.0, timeout_s) if lock_timeout_s is None else lock_timeout_s
    write = _RecordWrite(fleet, what, who, why, lock_s, record)
    not_recorded = _probe_unrecorded(fleet, pods)
    before, new = write.change(change, pods, not_recorded, on_changed)
    specs, notes = choose_pods(pods, before, new, None if not_recorded is _UNPROBED else not_recorded)
    try:
        disc, derr = PodDiscovery(specs, pods.make_admin, pods.resolver), None
    except ValueError as exc:  # $FLYWHEEL_SERVING_URL changed meaning between the check and now
        disc, derr = None, str(exc)
    res = ActionResult(new, notes=notes)
    _watch(write, res, disc, derr, deadline, f"--timeout {timeout_s:g} s", poll_s)
    res.elapsed_s = time.monotonic() - t0
    record("converged" if res.converged else "not_converged",
           {"generation": res.desired.generation, "pods": summary(res.outcomes), "elapsed_s": res.elapsed_s,
            "superseded_by": res.superseded_by.generation if res.superseded_by else None,
            "discovery_error": res.discovery_error})
    return res


_UNPROBED = object()  # --serving was not probed: the record lists pods, or none was given, or it is replaced


def _probe_unrecorded(fleet: FleetRecord, pods: PodChoice):
    """Why ``--serving`` must not be recorded (:func:`probe_pods`: None when all of it
    answered), when the record lists no pods and it is given without ``--record-pods``;
    :data:`_UNPROBED` otherwise. A typo is never recorded."""
    if not pods.given or pods.replace:
        return _UNPROBED
    try:
        listed = fleet.read().pods
    except (OSError, ValueError):  # the change reads it again and refuses, naming it
        return _UNPROBED
    return probe_pods(pods, time.monotonic() + pods.probe_s) if listed == [] else _UNPROBED


@dataclass
class _RecordWrite:
    """One action's writes of the fleet record and its ledger rows, under the fleet lock."""

    fleet: FleetRecord
    what: str
    who: str
    why: str
    lock_s: float
    record: Callable

    def change(self, change, pods: PodChoice, not_recorded, on_changed) -> tuple[DesiredState, DesiredState]:
        """Apply ``change`` (and the pod list ``pods`` asks for) under the lock; record the
        decision row (and a ``pods`` row when the list changed). Returns ``(before, after)``."""

        def change_with_pods(x: DesiredState) -> DesiredState:
            x = change(x)
            if pods.replace and pods.given:
                x.pods = list(pods.given)
            elif pods.given and not x.pods and not_recorded is None:
                x.pods = list(pods.given)
            return x

        with self.fleet.locked(self.what, self.who, self.lock_s):
            before = self.fleet.read()
            new = self.fleet.change(change_with_pods, self.who, self.what, self.why)
            on_changed(before, new)
            self.record("", {"generation": new.generation, "desired": new.summary()})
            if new.pods != before.pods:
                self.record("pods", {"generation": new.generation, "pods": list(new.pods), "was": list(before.pods),
                                     "replaced": bool(pods.replace)})
        return before, new

    def raise_past(self, res: ActionResult, ahead: int) -> bool:
        """Write the record again past generation ``ahead`` that the pods took (a record
        restored or edited to an older generation), if no other writer changed it since;
        True when written (``res.desired`` and ``res.raised_from`` set). Raises OSError or
        ValueError when the record became unreadable."""
        try:
            with self.fleet.locked(self.what, self.who, self.lock_s):
                if self.fleet.read().generation != res.desired.generation:
                    return False  # another writer: its record is read by the watch like any newer one
                res.raised_from = res.desired.generation
                res.desired = self.fleet.change(lambda d: d, self.who, self.what, self.why, floor=ahead)
                self.record("", {"generation": res.desired.generation, "raised_from": res.raised_from,
                                 "pods_took": ahead, "desired": res.desired.summary()})
                return True
        except LockTimeout:
            return False


def _watch(write: _RecordWrite, res: ActionResult, disc, derr: str | None, deadline: float, budget: str,
           poll_s: float) -> None:
    """Read the pods until they serve ``res.desired`` (or cannot: every pod refused it), the
    record is superseded or unreadable, or ``deadline`` passes; fills ``res``."""
    admins, res.discovery_error = _discover(disc, derr)
    while True:
        # a round is cut at the deadline; past it, one short round says where each pod is now
        cut = max(deadline, time.monotonic() + 0.5)
        res.outcomes = observe_pods_generation(admins, res.desired, cut, budget, previous=res.outcomes or None)
        if res.converged:
            return
        if res.outcomes and all(o.ok or o.outcome == "refused" for o in res.outcomes):
            return  # a pod that tried this generation and could not load it will not succeed by waiting
        try:
            ahead = max((o.target_generation or 0 for o in res.outcomes if o.outcome == "superseded"), default=0)
            if ahead > res.desired.generation and not res.raised_from and write.raise_past(res, ahead):
                continue  # pods took a generation the record never reached: written again past theirs
            cur = write.fleet.read()
        except (OSError, ValueError) as exc:  # the record became unreadable (or a directory) while we watched
            res.discovery_error = f"the desired-state record {write.fleet.path} became unreadable while watching: {exc}"
            return
        if cur.generation != res.desired.generation and _serving_fields(cur) != _serving_fields(res.desired):
            res.superseded_by = cur
            return
        if time.monotonic() >= deadline:
            return
        time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
        if not admins:
            admins, res.discovery_error = _discover(disc, derr)


def _serving_fields(d: DesiredState) -> tuple:
    return d.stable, d.candidate, d.weight, d.reload_after_ms
