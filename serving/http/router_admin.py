"""Admin routes over the weight slots (contracts: :mod:`schemas.pod_target`, :mod:`schemas.admin`;
auth: the admin token).

``PUT /admin/desired`` is how Flywheel changes a pod: one declarative target that the pod
converges to (:class:`serving.converge.PodReconciler`, the same function as the pod's own watch
of the desired-state record); ``GET /admin/desired`` reports the generation it serves.
The imperative routes (``load``, ``weight``, ``promote``, ``rollback``) are kept for driving a
single pod by hand (benchmarks, debugging, tests); no Flywheel component calls them, and a
pod changed by hand is brought back to the fleet's target by its watch or the controller.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends
from starlette.concurrency import run_in_threadpool

from schemas.admin import LoadRequest, RollbackRequest, WeightRequest
from schemas.pod_target import PodTarget
from serving.http.state import ServingState, get_state, reconciler

router = APIRouter(tags=["admin"])


@router.get("/admin/slots")
async def admin_slots(st: ServingState = Depends(get_state)):
    """Stable, candidate, weight, last swap pause and whether each digest matches the store."""
    return (await run_in_threadpool(st.slots.status)).model_dump()


@router.put("/admin/desired")
async def admin_put_desired(body: PodTarget, st: ServingState = Depends(get_state)):
    """Converge to the fleet's target (idempotent). 409 for a generation older than the newest
    taken (the record moved on) or a version that cannot be loaded (the reason named)."""
    return (await run_in_threadpool(reconciler(st).apply, body, "put")).model_dump()


@router.get("/admin/desired")
async def admin_get_desired(st: ServingState = Depends(get_state)):
    """The generation this pod serves, the newest it has taken, whether it is there, its slots."""
    return (await run_in_threadpool(reconciler(st).state)).model_dump()


@router.post("/admin/load")
async def admin_load(body: LoadRequest, st: ServingState = Depends(get_state)):
    """By hand: load and verify ``version`` into the candidate slot (409 with the reason on failure)."""
    return (await run_in_threadpool(st.slots.load_candidate, body.version)).model_dump()


@router.post("/admin/weight")
async def admin_weight(body: WeightRequest, st: ServingState = Depends(get_state)):
    """By hand: share of users (0..1) routed to the candidate."""
    return st.slots.set_weight(body.candidate_weight).model_dump()


@router.post("/admin/promote")
async def admin_promote(st: ServingState = Depends(get_state)):
    """By hand: the candidate becomes stable (pointer flip)."""
    return st.slots.promote().model_dump()


@router.post("/admin/rollback")
async def admin_rollback(body: RollbackRequest | None = None, st: ServingState = Depends(get_state)):
    """By hand: drop the candidate; with ``version``, replace stable by that version."""
    version = body.version if body else None
    return (await run_in_threadpool(st.slots.rollback, version)).model_dump()
