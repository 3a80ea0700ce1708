"""A pod's own reconciler: bring the weight slots to one declarative target.

:meth:`PodReconciler.apply` is the one function that changes what a pod serves on the
fleet's behalf. Both ways a target reaches the pod go through it: the controller's
``PUT /admin/desired`` (:mod:`serving.http.router_admin`) and the pod's own watch of the
desired-state record (:class:`serving.pod.DesiredWatch`, a kubelet watching the API server),
so a rollback an operator wrote reaches every pod with no controller running.

Each attempt compares the slots with the target and does only what is missing, in this
order: the stable version (a pointer flip when the pod holds it as its candidate; else a
load from the store, verified, or the resident previous stable), a reload of the stable
from the store when the target asks for one, the candidate (drop, or load and verify), the
weight. A second attempt with the same target does nothing. Attempts are serialised; a
target older than the newest one taken is refused (:class:`StaleTarget`), so a late PUT
never undoes a newer rollback.
"""

from __future__ import annotations

import logging
import threading

from schemas.pod_target import PodState, PodTarget
from serving.slots import SlotError

log = logging.getLogger("flywheel.serving")


class StaleTarget(SlotError):
    """The target's generation is older than the newest one this pod has taken (HTTP 409, as
    every :class:`serving.slots.SlotError`, the reason in ``detail``)."""


def plan(status, t: PodTarget) -> list[tuple[str, str, tuple]]:
    """The slot operations ``(label, Slots method, args)`` that bring ``status`` (a
    :class:`schemas.admin.SlotsStatus`) to ``t``, in order; [] when it is there."""
    out: list[tuple[str, str, tuple]] = []
    cand = status.candidate.version if status.candidate else None
    weight = status.candidate_weight
    if status.stable.version != t.stable:
        if cand == t.stable:
            out.append(("promote", "promote", ()))
        else:
            out.append((f"rollback to {t.stable}", "rollback", (t.stable,)))
        cand, weight = None, 0.0  # both drop the candidate
    elif t.reload_after_ms and status.stable.loaded_at < t.reload_after_ms:
        out.append((f"reload {t.stable}", "rollback", (t.stable,)))
        cand, weight = None, 0.0
    if cand is not None and cand != t.candidate:
        out.append((f"drop {cand}", "rollback", ()))
        cand, weight = None, 0.0
    if t.candidate is not None and cand != t.candidate:
        out.append((f"load {t.candidate}", "load_candidate", (t.candidate,)))
    if abs(weight - t.weight) > 1e-12:  # a load keeps the slot's weight (0 after a drop)
        out.append((f"weight {t.weight:g}", "set_weight", (t.weight,)))
    return out


class PodReconciler:
    """Converges one pod's :class:`serving.slots.Slots` to a :class:`PodTarget`.

    Args:
        slots: the pod's weight slots.
        target: the target the slots were started on (the record the pod read at start), or
            None (a pod started on an explicit version: generation 0 until a target comes).
        converged: whether the start reached ``target`` (else the pod serves generation 0
            and the watch retries it).
        read_record: returns the fleet record's target now (a :class:`PodTarget`, or None with
            no record), so a PUT is checked against it: a PUT carries the record's target, and
            one ahead of the record or naming other versions at its generation is refused
            (:class:`StaleTarget`). None: PUTs are not checked (a pod with no record to read).
    """

    def __init__(self, slots, target: PodTarget | None = None, converged: bool = True, read_record=None):
        self.slots = slots
        self.read_record = read_record
        self._lock = threading.Lock()
        self.target: PodTarget | None = target
        self.generation = target.generation if target is not None and converged else 0
        self.error: str | None = None
        self.actions: list[str] = []

    def state(self) -> PodState:
        """The generation served, the newest taken, whether the slots equal it now, the slots."""
        s = self.slots.status()
        t = self.target
        return PodState(pod=s.pod, generation=self.generation, target_generation=t.generation if t else 0,
                        converged=t is not None and not plan(s, t), error=self.error, actions=list(self.actions),
                        slots=s)

    def _check_against_record(self, t: PodTarget) -> None:
        """Refuse a PUT that is not the fleet record's target: ahead of the record's generation,
        or the record's generation with other versions. A record that cannot be read now does
        not block a PUT (the controller's push is what converges pods while it is repaired)."""
        if self.read_record is None:
            return
        try:
            rec = self.read_record()
        except (OSError, ValueError):
            return
        if rec is None or rec.generation == 0:
            return  # no record written: nothing to check against
        if t.generation > rec.generation or (t.generation == rec.generation
                                              and t.serving_fields() != rec.serving_fields()):
            raise StaleTarget(f"generation: {t.generation} (stable {t.stable}, candidate {t.candidate}) is not "
                              f"the fleet record's target: fleet/desired.json is at generation {rec.generation} "
                              f"(stable {rec.stable}, candidate {rec.candidate}); nothing was changed")

    def apply(self, t: PodTarget, source: str = "put") -> PodState:
        """Take ``t`` and converge to it (idempotent); ``source`` (``put`` or ``watch``) is logged.

        Raises:
            StaleTarget: ``t.generation`` is older than the newest generation taken, or the
                same generation names other versions, or (a PUT) it is not the fleet record's
                target (nothing is changed).
            serving.slots.SlotError: a version could not be loaded or verified (the slots keep
                what they served; the state's ``error`` says so until a later attempt converges).
        """
        if source == "put":
            self._check_against_record(t)
        with self._lock:
            cur = self.target
            if cur is not None and t.generation < cur.generation:
                raise StaleTarget(f"generation: {t.generation} is older than generation {cur.generation}, which "
                                  f"this pod has taken (stable {cur.stable}, candidate {cur.candidate}); the "
                                  "fleet's desired state has moved on, nothing was changed")
            if cur is not None and t.generation == cur.generation and t.generation and \
                    t.serving_fields() != cur.serving_fields():
                raise StaleTarget(f"generation: {t.generation} already names stable {cur.stable}, candidate "
                                  f"{cur.candidate} on this pod; a changed target needs a new generation")
            self.target = t
            done: list[str] = []
            try:
                # planned again after each pass: a flip to the resident previous stable keeps its
                # old load time, so a reload the target asks for is only due after it
                for _ in range(3):
                    steps = plan(self.slots.status(check_digests=False), t)
                    if not steps:
                        break
                    for label, method, args in steps:
                        getattr(self.slots, method)(*args)
                        done.append(label)
            except SlotError as exc:
                self.error = f"generation {t.generation}: {exc}"
                self.actions = done
                log.warning("desired state generation %d (%s) not reached: %s", t.generation, source, exc)
                raise
            self.actions = done if done or t.generation != self.generation else self.actions
            self.error = None
            if done:
                log.info("desired state generation %d (%s): %s", t.generation, source, "; ".join(done))
            self.generation = t.generation
            s = self.slots.status()
            return PodState(pod=s.pod, generation=t.generation, target_generation=t.generation,
                            converged=not plan(s, t), error=None, actions=done, slots=s)
