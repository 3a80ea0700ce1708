"""Admin routes over the weight slots (contract: :mod:`schemas.admin`; auth: the admin token)."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from starlette.concurrency import run_in_threadpool

from schemas.admin import LoadRequest, RollbackRequest, WeightRequest
from serving.http.state import ServingState, get_state

router = APIRouter(tags=["admin"])


@router.get("/admin/slots")
async def admin_slots(st: ServingState = Depends(get_state)):
    """Stable, candidate, weight, last swap pause and whether each digest matches the store."""
    return (await run_in_threadpool(st.slots.status)).model_dump()


@router.post("/admin/load")
async def admin_load(body: LoadRequest, st: ServingState = Depends(get_state)):
    """Load and verify ``version`` into the candidate slot (409 with the reason on failure)."""
    return (await run_in_threadpool(st.slots.load_candidate, body.version)).model_dump()


@router.post("/admin/weight")
async def admin_weight(body: WeightRequest, st: ServingState = Depends(get_state)):
    """Share of users (0..1) routed to the candidate."""
    return st.slots.set_weight(body.candidate_weight).model_dump()


@router.post("/admin/promote")
async def admin_promote(st: ServingState = Depends(get_state)):
    """The candidate becomes stable (pointer flip)."""
    return st.slots.promote().model_dump()


@router.post("/admin/rollback")
async def admin_rollback(body: RollbackRequest | None = None, st: ServingState = Depends(get_state)):
    """Drop the candidate; with ``version``, replace stable by that version."""
    version = body.version if body else None
    return (await run_in_threadpool(st.slots.rollback, version)).model_dump()
