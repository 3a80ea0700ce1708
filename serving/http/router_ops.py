"""Operations routes, open without auth: ``/health`` (vLLM's: 200 empty or 503),
``/healthz`` (facts as JSON) and ``/metrics`` (Prometheus text)."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import Response

from serving.http.errors import json_response
from serving.http.state import ServingState, get_state

router = APIRouter(tags=["ops"])


@router.get("/health")
async def health(st: ServingState = Depends(get_state)):
    """200 with an empty body when the engine can serve, else 503 with the reason."""
    try:
        st.slots.engine.check_health()
    except RuntimeError as exc:
        return json_response({"ok": False, "reason": str(exc)}, 503)
    return Response(status_code=200)


@router.get("/healthz")
async def healthz(st: ServingState = Depends(get_state)):
    """Engine facts, pod, served versions and whether the event log reaches Kafka."""
    try:
        facts = st.slots.engine.check_health()
    except RuntimeError as exc:
        return json_response({"ok": False, "reason": str(exc)}, 503)
    s = st.slots.status(check_digests=False)
    facts.update({"ok": True, "pod": st.pod, "stable": s.stable.version,
                  "candidate": s.candidate.version if s.candidate else None,
                  "kafka_up": st.event_log.kafka_up if st.event_log else None})
    return facts


@router.get("/metrics")
async def metrics(st: ServingState = Depends(get_state)):
    """Prometheus text exposition of the pod's registry."""
    body, ctype = st.metrics.render()
    return Response(body, media_type=ctype)
