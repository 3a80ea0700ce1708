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

Which pods: the serving specs recorded in the desired state (``pods``: by the controller, or
by an earlier command), else the ones given (``--serving`` / ``$FLYWHEEL_SERVING_URL``); pods
named with ``--serving`` while the record lists none are written into it with the action's
change, so the record names the pods that must converge and later commands, ``flywheel
status`` and a controller started without ``--serving`` reach the same ones. A URL that
answers as more than one pod (a load balancer) is reported as such, never taken for one pod.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from modelstore.desired import DesiredState, FleetRecord
from deploy.discovery import PodDiscovery
from deploy.fleet import PodOutcome, observe_pods_generation, summary
from deploy.serving_client import ServingAdminError


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
    """

    desired: DesiredState
    outcomes: list[PodOutcome] = field(default_factory=list)
    superseded_by: DesiredState | None = None
    elapsed_s: float = 0.0
    discovery_error: str | None = None
    raised_from: int | None = None

    @property
    def converged(self) -> bool:
        """Every pod found serves the desired state, and at least one pod was found."""
        return bool(self.outcomes) and all(o.ok for o in self.outcomes) and self.superseded_by is None

    def not_converged(self) -> list[PodOutcome]:
        return [o for o in self.outcomes if not o.ok]


def pod_specs(desired: DesiredState, given: list[str] | None, default: str) -> tuple[list[str], str | None]:
    """``(specs, note)``: the fleet's recorded pod specs when there are some (note says when
    ``given`` differs), else ``given``, else ``[default]``."""
    if desired.pods:
        note = None
        if given and set(given) != set(desired.pods):
            note = (f"acting on the fleet's pods {', '.join(desired.pods)} (recorded in its desired state by the "
                    f"controller or an earlier command); --serving {', '.join(given)} is not that list and is not "
                    "used")
        return list(desired.pods), note
    return list(given or [default]), None


def _discover(pods: PodDiscovery) -> tuple[list, str | None]:
    try:
        return pods(), None
    except ServingAdminError as exc:
        return [], str(exc)


def run_action(fleet: FleetRecord, pods: PodDiscovery, change, *, what: str, who: str, why: str,
               on_changed, record, timeout_s: float, lock_timeout_s: float | None = None,
               poll_s: float = 0.25) -> ActionResult:
    """Change the record, record the decision, watch the pods converge, record what was observed.

    Args:
        pods: the fleet's pods, read-only here (their clients' timeouts should be short: each
            read is also cut at the deadline).
        change: ``f(DesiredState) -> DesiredState``; raises ValueError to refuse (nothing is
            changed, nothing recorded here: the caller records the refusal).
        on_changed: ``f(before, after)`` run under the lock right after the record changed
            (the version statuses derived from it).
        record: ``f(decision_suffix, numbers)`` writes a ledger row: with ``""`` and the new
            generation under the lock, then with ``"converged"`` or ``"not_converged"`` and
            each pod's observed outcome when the watch ends.
        timeout_s: how long to watch (s), from the start of the action (the lock wait
            included); 0: change the record and return at once, observing each pod once.
        lock_timeout_s: how long to wait for another writer holding the fleet lock (None:
            ``timeout_s``, at least 1 s).
        poll_s: seconds between two reads of the pods.

    Raises:
        ValueError: ``change`` refused.
        modelstore.desired.LockTimeout: the lock was not free within ``lock_timeout_s``.
    """
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    budget = f"--timeout {timeout_s:g} s"
    lock_s = max(1.0, timeout_s) if lock_timeout_s is None else lock_timeout_s
    with fleet.locked(what, who, lock_s):
        before = fleet.read()
        new = fleet.change(change, who, what, why)
        on_changed(before, new)
        record("", {"generation": new.generation, "desired": new.summary()})
    admins, derr = _discover(pods)
    res = ActionResult(new, discovery_error=derr)
    while True:
        # a round is cut at the deadline; past it, one short round says where each pod is now
        cut = max(deadline, time.monotonic() + 0.5)
        res.outcomes = observe_pods_generation(admins, new, cut, budget, previous=res.outcomes or None)
        if res.converged:
            break
        if res.outcomes and all(o.ok or o.outcome == "refused" for o in res.outcomes):
            break  # a pod that tried this generation and could not load it will not succeed by waiting
        ahead = max((o.target_generation or 0 for o in res.outcomes if o.outcome == "superseded"), default=0)
        if ahead > new.generation and not res.raised_from:
            # pods took a generation the record never reached (restored or edited to an older
            # one): written again past theirs, or no pod would ever take it
            with fleet.locked(what, who, lock_s):
                if fleet.read().generation == new.generation:  # no other writer since: ours to raise
                    res.raised_from = new.generation
                    new = fleet.change(lambda d: d, who, what, why, floor=ahead)
                    res.desired = new
                    record("", {"generation": new.generation, "raised_from": res.raised_from,
                                "pods_took": ahead, "desired": new.summary()})
                    continue
        try:
            cur = fleet.read()
            if cur.generation != new.generation and _serving_fields(cur) != _serving_fields(new):
                res.superseded_by = cur
                break
        except ValueError as exc:  # the record became unreadable while we watched
            res.discovery_error = f"the desired-state record became unreadable while watching: {exc}"
            break
        if time.monotonic() >= deadline:
            break
        time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
        if not admins:
            admins, res.discovery_error = _discover(pods)
    res.elapsed_s = time.monotonic() - t0
    record("converged" if res.converged else "not_converged",
           {"generation": new.generation, "pods": summary(res.outcomes), "elapsed_s": res.elapsed_s,
            "superseded_by": res.superseded_by.generation if res.superseded_by else None,
            "discovery_error": res.discovery_error})
    return res


def _serving_fields(d: DesiredState) -> tuple:
    return d.stable, d.candidate, d.weight, d.reload_after_ms
