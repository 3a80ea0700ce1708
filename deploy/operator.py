"""Operator actions on the fleet: record the intent in the desired state, then converge.

An action (``flywheel promote``, ``rollback``, ``pause`` ...) is one change of the fleet's
desired-state record (:mod:`deploy.desired`), made under the fleet lock together with the
store's status/stable-record updates, a first reconcile pass of every pod
(:func:`deploy.fleet.reconcile_pods`, the controller's own code path) and one ledger row
carrying each pod's outcome. Pods that did not converge are retried, one pass at a time with
the lock released in between, until they do or ``timeout_s`` passes (a pod that refused, 4xx,
is not waited for). Every pass is bounded by that deadline: the action returns by
``timeout_s`` after it began whatever a pod does (hung, SIGSTOPped, unreachable), with each
pod's outcome (``timeout`` for one still in a call). If the first pass did not
converge a second ledger row (``FLEET_CONVERGED`` / ``FLEET_NOT_CONVERGED``) says how it ended.
A later change of the record by someone else (a newer generation) ends the wait: the action
was superseded, and the newer generation is what the pods are brought to.

Which pods: the serving specs the controller recorded in the desired state (``pods``), else
the ones given (``--serving`` / ``$FLYWHEEL_SERVING_URL``). A URL that answers as more than one
pod (a load balancer) is reported as such, never taken for one pod.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from deploy.desired import DesiredState, FleetRecord, LockTimeout
from deploy.discovery import PodDiscovery
from deploy.fleet import PodOutcome, reconcile_pods, summary
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
    """

    desired: DesiredState
    outcomes: list[PodOutcome] = field(default_factory=list)
    superseded_by: DesiredState | None = None
    elapsed_s: float = 0.0
    discovery_error: str | None = None

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
            note = (f"acting on the fleet's pods {', '.join(desired.pods)} (recorded by the controller); "
                    f"--serving {', '.join(given)} is not that list and is not used")
        return list(desired.pods), note
    return list(given or [default]), None


def _discover(pods: PodDiscovery) -> tuple[list, str | None]:
    try:
        return pods(), None
    except ServingAdminError as exc:
        return [], str(exc)


def run_action(fleet: FleetRecord, pods: PodDiscovery, change, *, what: str, who: str, why: str,
               on_changed, record, timeout_s: float, lock_timeout_s: float | None = None,
               poll_s: float = 0.5) -> ActionResult:
    """Change the record, converge the pods, record per-pod outcomes.

    Args:
        change: ``f(DesiredState) -> DesiredState``; raises ValueError to refuse (nothing is
            changed, nothing recorded here: the caller records the refusal).
        on_changed: ``f(before, after)`` run under the lock right after the record changed
            (the store's statuses and stable record).
        record: ``f(decision_suffix, numbers)`` writes the ledger row: called with ``""`` and
            the first pass's numbers under the lock, then, if that pass did not converge, with
            ``"converged"`` or ``"not_converged"`` and the final numbers.
        timeout_s: how long to keep retrying pods that did not converge (s).
        lock_timeout_s: how long to wait for another action holding the fleet lock (None:
            ``timeout_s``).

    Raises:
        ValueError: ``change`` refused.
        deploy.desired.LockTimeout: the lock was not free within ``lock_timeout_s``.
    """
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    budget = f"--timeout {timeout_s:g} s"
    with fleet.locked(what, who, timeout_s if lock_timeout_s is None else lock_timeout_s):
        before = fleet.read()
        new = fleet.change(change, who, what, why)
        on_changed(before, new)
        admins, derr = _discover(pods)
        res = ActionResult(new, reconcile_pods(admins, new, deadline, budget), discovery_error=derr)
        record("", {"generation": new.generation, "pods": summary(res.outcomes), "discovery_error": derr})
    first_ok = res.converged
    while not res.converged and time.monotonic() < deadline:
        if res.outcomes and all(o.ok or o.outcome == "refused" for o in res.outcomes):
            break  # a pod that answered "no" (a corrupt version) will not change its mind by waiting
        time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
        if time.monotonic() >= deadline:
            break
        try:
            with fleet.locked(what + " (retry)", who, max(0.05, deadline - time.monotonic())):
                cur = fleet.read()
                if cur.generation != new.generation and _serving_fields(cur) != _serving_fields(new):
                    res.superseded_by = cur
                    break
                admins, res.discovery_error = _discover(pods)
                res.outcomes = reconcile_pods(admins, cur, deadline, budget)
        except LockTimeout:
            break  # the controller (or another operator) holds the record past our deadline: report what we have
        except ValueError as exc:  # the record became unreadable while we waited
            res.discovery_error = f"the desired-state record became unreadable while waiting: {exc}"
            break
    res.elapsed_s = time.monotonic() - t0
    if not first_ok:
        record("converged" if res.converged else "not_converged",
               {"generation": new.generation, "pods": summary(res.outcomes), "elapsed_s": res.elapsed_s,
                "superseded_by": res.superseded_by.generation if res.superseded_by else None,
                "discovery_error": res.discovery_error})
    return res


def _serving_fields(d: DesiredState) -> tuple:
    return d.stable, d.candidate, d.weight, d.reload_after_ms
