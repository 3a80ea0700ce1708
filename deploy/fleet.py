"""Bring every serving pod to the fleet's desired state (:mod:`modelstore.desired`), and watch it get there.

A pod takes one declarative target (``PUT /admin/desired``, :mod:`schemas.pod_target`): the
record's generation with its stable, candidate, weight and reload request; the pod converges
itself (loads from the store what it lacks, sets the split, drops what is no longer wanted)
and answers with the generation it serves. :func:`reconcile_pods` is the controller's pass:
it reads each pod's state (``GET /admin/desired``) and PUTs the target to each pod not yet at
it, in parallel. :func:`observe_pods_generation` is the operator's read-only watch: each pod's
served generation, with short per-request bounds. With a ``deadline`` both return by it
whatever a pod does (hung, SIGSTOPped, unreachable), reporting such a pod as ``timeout``.

Pure of files and locks: the callers hold the fleet lock (:meth:`FleetRecord.locked`) where
they need it.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace

from modelstore.desired import DesiredState
from deploy.serving_client import ServingAdmin, ServingAdminError
from schemas.pod_target import PodTarget

CONVERGED = "converged"


@dataclass
class PodOutcome:
    """What one reconcile pass did on one pod and where the pod ended.

    Fields:
        url: the pod's admin base URL.
        pod: the pod's own name (``SlotsStatus.pod``), None if it never answered.
        outcome: ``converged``, or why not: ``timeout`` / ``unreachable`` / ``server``
            (transport failures: retried at the next pass), ``refused`` (the pod said no,
            e.g. 409 for a corrupt version), ``behind`` (it answers but serves an older
            generation), ``superseded`` (it took a newer generation than the one asked) or
            ``load_balancer``.
        actions: what the pod did for the target, in order (``promote``, ``rollback to v000001``,
            ``reload v000001``, ``drop v000002``, ``load v000002``, ``weight 0.25``).
        generation: the generation the pod serves (last known), None if it never answered.
        target_generation: the newest generation the pod has taken (last known), or None.
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
    generation: int | None = None
    target_generation: int | None = None
    exc: ServingAdminError | None = field(default=None, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return self.outcome == CONVERGED

    def line(self) -> str:
        """One human line: ``pod-1 (http://...): converged (generation 7): stable v000000 [rollback to v000000]``."""
        where = f"{self.pod or '?'} ({self.url})"
        serves = f"stable {self.stable or '?'}" + (f", candidate {self.candidate} at {self.weight:.0%}"
                                                    if self.candidate else "")
        gen = f" (generation {self.generation})" if self.generation is not None else ""
        did = f" [{'; '.join(self.actions)}]" if self.actions else ""
        if self.ok:
            return f"{where}: converged{gen}: {serves}{did}"
        if self.outcome == "behind":
            return f"{where}: NOT converged: still at generation {self.generation}: {self.error}; serves {serves}{did}"
        if self.outcome == "timeout":
            return f"{where}: NOT converged (timeout): {self.error}" + \
                (f"; last seen serving {serves}{gen}" if self.stable else "")
        return f"{where}: NOT converged ({self.outcome}{': ' + self.failed_action if self.failed_action else ''}): " \
               f"{self.error}" + (f"; serves {serves}{gen}{did}" if self.stable else "")

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


def target_of(d: DesiredState) -> PodTarget:
    """The pod target of a desired state (its generation and serving fields).

    Raises:
        ValueError: the record names no stable version (an empty store).
    """
    if not d.stable:
        raise ValueError("stable: the fleet's desired state names no stable version (empty store?)")
    return PodTarget(generation=d.generation, stable=d.stable, candidate=d.candidate, weight=float(d.weight),
                     reload_after_ms=int(d.reload_after_ms))


STALE_PREFIX = "generation:"  # how a pod's 409 for an older generation begins (serving.converge.StaleTarget)


def _at(st, d: DesiredState) -> bool:
    """Whether a pod's state serves ``d``: its slots equal ``d``'s serving fields, and it
    converged to ``d``'s generation or took no newer one (a change of other fields, such as a
    pause or the pod list, needs nothing from a pod). The slots are always compared with the
    record itself: a pod that took the record's generation number with other versions (a PUT
    not from this record) does not serve it."""
    if drift(st.slots, d):
        return False
    if st.generation == d.generation and st.converged:
        return True
    return st.target_generation <= d.generation and not st.error


def _judge(o: PodOutcome, st, d: DesiredState) -> None:
    """Fill ``o`` from a pod's :class:`schemas.pod_target.PodState` against ``d``."""
    _fill(o, st.slots)
    o.generation, o.target_generation = st.generation, st.target_generation
    if _at(st, d):
        o.outcome, o.error = CONVERGED, None
    elif st.target_generation > d.generation:
        o.outcome, o.error = "superseded", (f"the pod took generation {st.target_generation}, newer than "
                                            f"{d.generation}")
    elif st.error and st.target_generation == d.generation:  # it tried this generation and could not
        o.outcome, o.error = "refused", st.error
    else:
        o.outcome = "behind"
        o.error = st.error or (f"taking generation {st.target_generation}" if st.target_generation == d.generation
                               else f"not yet given generation {d.generation}")
        left = drift(st.slots, d)
        if left and not st.error:
            o.error += f" ({'; '.join(left)})"


def reconcile_pod(admin: ServingAdmin, d: DesiredState, progress: PodOutcome | None = None) -> PodOutcome:
    """One pass on one pod: read its state; unless it serves ``d``'s generation already, PUT
    ``d``'s target and report. Never raises a ServingAdminError: a failed call ends the pass
    with its kind as the outcome (a 409 for an older generation is ``superseded``, not a
    refusal of the version). ``progress`` (optional) is filled in as the pass goes (pod name,
    the call in flight), so a caller that stops waiting can say how far it got."""
    o = progress if progress is not None else PodOutcome(url=admin.base_url)
    try:
        o.failed_action = "read state"
        st = admin.desired_state()
        o.pod = st.pod
        _fill(o, st.slots)
        o.generation = st.generation
        if d.generation == 0:  # no record written yet: nothing declared to PUT; the pod is judged by its slots
            o.failed_action = None
            left = drift(st.slots, d)
            o.outcome, o.error = (CONVERGED, None) if not left else ("behind", "; ".join(left))
            return o
        if not _at(st, d):
            o.failed_action = f"put generation {d.generation}"
            st2 = admin.put_desired(target_of(d))
            if st2.pod != o.pod:  # a load balancer: each call may reach another pod
                o.outcome = "load_balancer"
                o.error = (f"{admin.base_url} answered as pod {o.pod}, then as pod {st2.pod}: it is a load "
                           "balancer, not a pod; give each pod's URL or a dns+http:// headless Service")
                _fill(o, st2.slots)
                return o
            st = st2
            o.actions = list(st.actions)
            if "promote" in st.actions:
                o.swap_pause_ms = st.slots.last_swap_pause_ms
        o.failed_action = None
        _judge(o, st, d)
    except ServingAdminError as exc:
        if exc.kind == "refused" and exc.reason.startswith(STALE_PREFIX):
            o.outcome, o.error = "superseded", str(exc)
        else:
            o.outcome, o.error, o.exc = exc.kind, str(exc), exc
    return o


def observe_pod(admin: ServingAdmin, d: DesiredState, progress: PodOutcome | None = None) -> PodOutcome:
    """Read-only: where one pod stands against ``d`` (``GET /admin/desired``): ``converged``
    when it serves ``d``'s generation; else ``behind``, ``superseded``, or the failure kind."""
    o = progress if progress is not None else PodOutcome(url=admin.base_url)
    try:
        o.failed_action = "read state"
        st = admin.desired_state()
        if o.pod is not None and st.pod != o.pod:
            o.outcome = "load_balancer"
            o.error = (f"{admin.base_url} answered as pod {o.pod}, then as pod {st.pod}: it is a load balancer, "
                       "not a pod; give each pod's URL or a dns+http:// headless Service")
            return o
        o.pod, o.failed_action, o.exc = st.pod, None, None
        if st.target_generation == d.generation:
            o.actions = list(st.actions)  # what the pod did for this generation
        _judge(o, st, d)
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
    """The controller's pass: :func:`reconcile_pod` on every pod, in parallel; outcomes in the
    order of ``admins``.

    Args:
        deadline: ``time.monotonic()`` value by which the pass returns whatever a pod does
            (None: each pod's calls are bounded by its own client timeout only). A pod still
            in a call then is reported with outcome ``timeout``, naming the call in flight and
            ``budget`` (e.g. ``--timeout 8 s``); its call goes on in a daemon thread, which
            never delays the caller or the exit of its process.
        budget: how the deadline is named in a timed-out pod's error.
    """
    return _each(reconcile_pod, admins, d, deadline, budget)


def observe_pods_generation(admins: list[ServingAdmin], d: DesiredState, deadline: float | None = None,
                            budget: str = "", previous: list[PodOutcome] | None = None) -> list[PodOutcome]:
    """The operator's watch: :func:`observe_pod` on every pod, in parallel, read-only (no pod
    is changed); outcomes in the order of ``admins``. ``previous`` (the last round's outcomes,
    same order) carries each pod's name, so a URL that answers as another pod is reported as
    a load balancer, and what a pod that stopped answering last served. ``deadline`` and
    ``budget`` as in :func:`reconcile_pods`."""
    seeds = None
    if previous is not None and len(previous) == len(admins):
        seeds = [PodOutcome(url=p.url, pod=p.pod, stable=p.stable, stable_digest=p.stable_digest,
                            candidate=p.candidate, weight=p.weight, generation=p.generation) for p in previous]
    return _each(observe_pod, admins, d, deadline, budget, seeds)


def _each(fn, admins, d, deadline, budget, seeds=None) -> list[PodOutcome]:
    """``fn(admin, d, progress)`` on every admin in parallel, bounded by ``deadline``."""
    if not admins:
        return []
    progress = seeds or [PodOutcome(url=a.base_url) for a in admins]
    if deadline is None:
        if len(admins) == 1:
            return [fn(admins[0], d, progress[0])]
        with ThreadPoolExecutor(min(16, len(admins))) as ex:
            return list(ex.map(lambda i: fn(admins[i], d, progress[i]), range(len(admins))))
    results: list[PodOutcome | None] = [None] * len(admins)

    def run(i: int) -> None:
        results[i] = fn(admins[i], d, progress[i])

    threads = [threading.Thread(target=run, args=(i,), daemon=True, name=f"pod {a.base_url}")
               for i, a in enumerate(admins)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    out = []
    for i, r in enumerate(results):
        if r is None:  # still in a call at the deadline: hung, stopped, or slower than the budget
            p = progress[i]
            r = replace(p, actions=list(p.actions), outcome="timeout", failed_action=p.failed_action or "read state",
                        error=f"no answer by the deadline{' (' + budget + ')' if budget else ''}: the pod is hung, "
                              "stopped or slower than that; its call goes on without this command")
        out.append(r)
    return out


def observe_pods(admins: list[ServingAdmin], d: DesiredState | None) -> list[tuple[str, object, str | None, list[str]]]:
    """Read-only: ``(url, slots or None, error or None, drift)`` per pod, in parallel. A pod
    that did not answer has the failure's kind as its drift (``timeout``, ``unreachable``,
    ``server``, ``refused``: the words of :attr:`PodOutcome.outcome`, so ``flywheel status``
    and an operator command name one state alike); no drift is computed when the desired
    state ``d`` is unknown (None: its record is unreadable)."""
    def one(a):
        try:
            s = a.slots()
        except ServingAdminError as exc:
            return a.base_url, None, str(exc), [exc.kind]
        return a.base_url, s, None, (drift(s, d) if d is not None else [])

    if not admins:
        return []
    with ThreadPoolExecutor(min(16, len(admins))) as ex:
        return list(ex.map(one, admins))


def summary(outcomes: list[PodOutcome]) -> dict:
    """JSON-ready per-pod outcomes for the ledger: ``{"converged": n, "pods": n, "by_pod": {url: {...}}}``."""
    return {"converged": sum(o.ok for o in outcomes), "pods": len(outcomes),
            "by_pod": {o.url: {"pod": o.pod, "outcome": o.outcome, "actions": o.actions, "stable": o.stable,
                               "candidate": o.candidate, "weight": o.weight, "generation": o.generation,
                               "error": o.error}
                       for o in outcomes}}
