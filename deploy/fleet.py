"""Bring every serving pod to the fleet's desired state (:mod:`deploy.desired`).

One reconcile pass reads each pod's slots (``GET /admin/slots``), compares them with the
record and does what is missing, in this order: the stable version (``promote`` when the pod
holds the desired stable as its candidate, a hot swap; else ``rollback`` to it, which loads
and verifies it from the store), a reload of the stable version from the store when the
record asks for one (``reload_after_ms``), the candidate (drop, or ``load``), the weight. The
pods are reconciled in parallel, each with its own bounded calls, so a wedged pod costs one
timeout and never delays the others; with a ``deadline`` a pass returns by it whatever a pod
does (hung, SIGSTOPped, unreachable), reporting such a pod as ``timeout``. Used by the
controller at every poll and by the operator commands, through the same function.

Pure of files and locks: the callers hold the fleet lock (:meth:`FleetRecord.locked`).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace

from deploy.desired import DesiredState
from deploy.serving_client import ServingAdmin, ServingAdminError

CONVERGED = "converged"


@dataclass
class PodOutcome:
    """What one reconcile pass did on one pod and where the pod ended.

    Fields:
        url: the pod's admin base URL.
        pod: the pod's own name (``SlotsStatus.pod``), None if it never answered.
        outcome: ``converged``, or why not: ``timeout`` / ``unreachable`` / ``server``
            (transport failures: retried at the next pass) or ``refused`` (the pod said no,
            e.g. 409 for a corrupt version).
        actions: what was done, in order (``promote``, ``rollback to v000001``,
            ``reload v000001``, ``drop v000002``, ``load v000002``, ``weight 0.25``).
        stable, stable_digest, candidate, weight: the pod's slots after the pass (last known).
        error: the failing call's message, or None.
        failed_action: the action that failed, or None.
    """

    url: str
    pod: str | None = None
    outcome: str = CONVERGED
    actions: list[str] = field(default_factory=list)
    stable: str | None = None
    stable_digest: str | None = None
    candidate: str | None = None
    weight: float = 0.0
    error: str | None = None
    failed_action: str | None = None
    swap_pause_ms: float | None = None
    exc: ServingAdminError | None = field(default=None, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return self.outcome == CONVERGED

    def line(self) -> str:
        """One human line: ``pod-1 (http://...): converged: stable v000000 [rollback to v000000]``."""
        where = f"{self.pod or '?'} ({self.url})"
        serves = f"stable {self.stable or '?'}" + (f", candidate {self.candidate} at {self.weight:.0%}"
                                                    if self.candidate else "")
        did = f" [{'; '.join(self.actions)}]" if self.actions else ""
        if self.ok:
            return f"{where}: converged: {serves}{did}"
        return f"{where}: NOT converged ({self.outcome}{': ' + self.failed_action if self.failed_action else ''}): " \
               f"{self.error}; serves {serves}{did}"

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("exc", None)
        return d


def drift(slots, d: DesiredState) -> list[str]:
    """How a pod's slots (:class:`schemas.admin.SlotsStatus`) differ from ``d`` ([] = none)."""
    out = []
    if d.stable is not None and slots.stable.version != d.stable:
        out.append(f"stable {slots.stable.version}, desired {d.stable}")
    elif d.reload_after_ms and slots.stable.loaded_at < d.reload_after_ms:
        out.append(f"stable {d.stable} not reloaded from the store since the request")
    have = slots.candidate.version if slots.candidate else None
    if have != d.candidate:
        out.append(f"candidate {have}, desired {d.candidate}")
    elif d.candidate is not None and abs(slots.candidate_weight - d.weight) > 1e-9:
        out.append(f"weight {slots.candidate_weight:.0%}, desired {d.weight:.0%}")
    return out


def _steps(slots, d: DesiredState) -> list[tuple[str, str, tuple]]:
    """The admin calls (label, method, args) that bring ``slots`` to ``d``, in order; the
    next pass re-reads the slots, so a partial pass resumes where it stopped."""
    out: list[tuple[str, str, tuple]] = []
    cand = slots.candidate.version if slots.candidate else None
    if d.stable is not None and slots.stable.version != d.stable:
        if cand == d.stable:
            out.append(("promote", "promote", ()))
            cand = None
        else:
            out.append((f"rollback to {d.stable}", "rollback", (d.stable,)))
            cand = None  # rollback drops the candidate too
    elif d.reload_after_ms and slots.stable.loaded_at < d.reload_after_ms:
        out.append((f"reload {d.stable}", "rollback", (d.stable,)))
        cand = None
    weight = slots.candidate_weight if cand is not None else 0.0
    if cand is not None and cand != d.candidate:
        out.append((f"drop {cand}", "rollback", ()))
        cand, weight = None, 0.0
    if d.candidate is not None and cand != d.candidate:
        out.append((f"load {d.candidate}", "load", (d.candidate,)))
        weight = None  # a load keeps the pod's weight: always set it after
    if d.candidate is not None and (weight is None or abs(weight - d.weight) > 1e-9):
        out.append((f"weight {d.weight:g}", "set_weight", (d.weight,)))
    return out


def reconcile_pod(admin: ServingAdmin, d: DesiredState, progress: PodOutcome | None = None) -> PodOutcome:
    """One pass on one pod: read its slots, apply :func:`_steps`, report. Never raises a
    ServingAdminError: a failed call ends the pass with its kind as the outcome.
    ``progress`` (optional) is filled in as the pass goes (pod name, actions done, the call in
    flight), so a caller that stops waiting can say how far it got."""
    o = progress if progress is not None else PodOutcome(url=admin.base_url)
    try:
        s = admin.slots()
        o.pod = s.pod
        for label, method, args in _steps(s, d):
            o.failed_action = label
            s = getattr(admin, method)(*args)
            if s.pod != o.pod:  # a load balancer: each call may reach another pod
                o.outcome = "load_balancer"
                o.error = (f"{admin.base_url} answered as pod {o.pod}, then as pod {s.pod}: it is a load "
                           "balancer, not a pod; give each pod's URL or a dns+http:// headless Service")
                _fill(o, s)
                return o
            o.actions.append(label)
            if method == "promote":
                o.swap_pause_ms = s.last_swap_pause_ms
        o.failed_action = None
        _fill(o, s)
        left = drift(s, d)
        if left:  # the pod answered but is not where it should be (e.g. a concurrent change)
            o.outcome, o.error = "drift", "; ".join(left)
    except ServingAdminError as exc:
        o.outcome, o.error, o.exc = exc.kind, str(exc), exc
    return o


def _fill(o: PodOutcome, s) -> None:
    o.pod = s.pod
    o.stable, o.stable_digest = s.stable.version, s.stable.weights_digest
    o.candidate = s.candidate.version if s.candidate else None
    o.weight = s.candidate_weight


def reconcile_pods(admins: list[ServingAdmin], d: DesiredState, deadline: float | None = None,
                   budget: str = "") -> list[PodOutcome]:
    """One pass over every pod, in parallel; outcomes in the order of ``admins``.

    Args:
        deadline: ``time.monotonic()`` value by which the pass returns whatever a pod does
            (None: each pod's calls are bounded by its own client timeout only). A pod still
            in a call then is reported with outcome ``timeout``, naming the call in flight and
            ``budget`` (e.g. ``--timeout 8 s``); its call goes on in a daemon thread, which
            never delays the caller or the exit of its process.
        budget: how the deadline is named in a timed-out pod's error.
    """
    if not admins:
        return []
    if deadline is None:
        if len(admins) == 1:
            return [reconcile_pod(admins[0], d)]
        with ThreadPoolExecutor(min(16, len(admins))) as ex:
            return list(ex.map(lambda a: reconcile_pod(a, d), admins))
    progress = [PodOutcome(url=a.base_url) for a in admins]
    results: list[PodOutcome | None] = [None] * len(admins)

    def run(i: int) -> None:
        results[i] = reconcile_pod(admins[i], d, progress[i])

    threads = [threading.Thread(target=run, args=(i,), daemon=True, name=f"reconcile {a.base_url}")
               for i, a in enumerate(admins)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    out = []
    for i, r in enumerate(results):
        if r is None:  # still in a call at the deadline: hung, stopped, or slower than the budget
            p = progress[i]
            r = replace(p, actions=list(p.actions), outcome="timeout", failed_action=p.failed_action or "read slots",
                        error=f"no answer by the deadline{' (' + budget + ')' if budget else ''}: the pod is hung, "
                              "stopped or slower than that; its call goes on without this command")
        out.append(r)
    return out


def observe_pods(admins: list[ServingAdmin], d: DesiredState | None) -> list[tuple[str, object, str | None, list[str]]]:
    """Read-only: ``(url, slots or None, error or None, drift)`` per pod, in parallel; no drift
    is computed when the desired state ``d`` is unknown (None: its record is unreadable)."""
    def one(a):
        try:
            s = a.slots()
        except ServingAdminError as exc:
            return a.base_url, None, str(exc), ["unreachable"]
        return a.base_url, s, None, (drift(s, d) if d is not None else [])

    if not admins:
        return []
    with ThreadPoolExecutor(min(16, len(admins))) as ex:
        return list(ex.map(one, admins))


def summary(outcomes: list[PodOutcome]) -> dict:
    """JSON-ready per-pod outcomes for the ledger: ``{"converged": n, "pods": n, "by_pod": {url: {...}}}``."""
    return {"converged": sum(o.ok for o in outcomes), "pods": len(outcomes),
            "by_pod": {o.url: {"pod": o.pod, "outcome": o.outcome, "actions": o.actions, "stable": o.stable,
                               "candidate": o.candidate, "weight": o.weight, "error": o.error}
                       for o in outcomes}}
