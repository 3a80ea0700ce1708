"""What the routes reach through ``request.app.state.flywheel``: one object per app."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from serving.http.completion_log import CompletionLogger
from serving.http.metrics import ServingMetrics
from serving.http.serving_feedback import FeedbackServing
from serving.http.serving_openai import OpenAIServing
from serving.slots import Slots
from serving.converge import PodReconciler


@dataclass
class ServingState:
    """The pod's parts the HTTP layer uses.

    Attributes:
        pod: the pod's name.
        slots: stable/candidate weights over the engine.
        event_log: the event log, or None (logging off).
        metrics: the Prometheus registry and its updates.
        completions_log: completion events and the completion -> version memory.
        openai: inference endpoints' logic.
        feedback: feedback endpoints' logic.
        reconciler: converges the slots to the fleet's target (:class:`serving.converge.PodReconciler`;
            :func:`reconciler` makes one on first use when the app was built without it).
    """

    pod: str
    slots: Slots
    event_log: object
    metrics: ServingMetrics
    completions_log: CompletionLogger
    openai: OpenAIServing
    feedback: FeedbackServing
    reconciler: PodReconciler | None = None


async def get_state(request: Request) -> ServingState:
    """FastAPI dependency: the app's :class:`ServingState` (async: FastAPI would run a plain
    function in its thread pool, one thread hop per request)."""
    return request.app.state.flywheel


def reconciler(st: ServingState) -> PodReconciler:
    """The pod's reconciler (one per app; made over its slots on first use)."""
    if st.reconciler is None:
        st.reconciler = PodReconciler(st.slots)
    return st.reconciler
