"""A serving pod's declarative target, shared by ``serving`` (server) and ``deploy`` (client).

Endpoints (under the admin token, ``Authorization: Bearer <admin token>``):

* ``PUT /admin/desired`` :class:`PodTarget` -> :class:`PodState`
  The fleet's desired state for this pod (the serving fields of ``fleet/desired.json`` with
  its generation). The pod converges to it idempotently: it loads from the model store what
  it lacks (hash-verified), sets the candidate's share and drops what is no longer wanted;
  a second PUT of the same target does nothing. HTTP 409 when ``generation`` is older than
  the newest generation the pod has taken (the record moved on: nothing is changed), or when
  a version cannot be loaded (bad bytes or hashes: the slots keep what they served, and the
  answer names the version and the reason).
* ``GET /admin/desired`` -> :class:`PodState`: the generation the pod serves, the newest it
  has taken, whether its slots equal that target now, and its slots.

The pod also reads ``fleet/desired.json`` itself every ``--desired-poll`` seconds and converges
through the same function (``serving.converge.PodReconciler.apply``), so a change of the
record reaches every pod whether or not a controller runs.
"""

from __future__ import annotations

import re
from typing import Annotated
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, Strict, model_validator

from schemas.admin import SlotsStatus
from schemas.manifest import VERSION_PATTERN

MAX_GENERATION = 2**53  # a generation or time past this is refused: no record counts that far

DNS_PREFIX = "dns+"  # a pod spec resolved by DNS: dns+http(s)://<headless Service>:<port>
MAX_SPEC_CHARS = 2048  # a pod spec longer than this is refused (no URL of a pod is that long)
_USERINFO = re.compile(r"^((?:dns\+)?[A-Za-z][A-Za-z0-9+.-]*://)?([^/?#@]*)@")


def redact_spec(spec: str) -> str:
    """``spec`` with any user name and password before ``@`` replaced by ``***`` (for
    messages: ``http://ops:hunter2@pod-1:8000`` -> ``http://***@pod-1:8000``)."""
    return _USERINFO.sub(lambda m: f"{m.group(1) or ''}***@", spec, count=1)


def check_pod_spec(spec, name: str = "serving") -> str:
    """``spec`` if it is a pod URL ``http(s)://host[:port]`` or a ``dns+http(s)://name:port``
    spec (a headless Service's name and the pods' port) with no user name or password in it:
    the one rule for ``--serving``, ``$FLYWHEEL_SERVING_URL`` and the fleet record's ``pods``.
    A pod's admin API takes a bearer token, never a password in the URL, and a spec may be
    recorded, written to the ledger and printed.

    Args:
        spec: the spec (a str).
        name: how the value is named in the message (``serving``, ``pods[2]``).

    Raises:
        ValueError: naming ``name``, the spec (its user name and password masked) and the form
            it must have.
    """
    if not isinstance(spec, str):
        raise ValueError(f"{name}: must be a pod URL (a string), got {type(spec).__name__} {str(spec)[:40]!r}")
    if len(spec) > MAX_SPEC_CHARS:
        raise ValueError(f"{name}: a pod spec of {len(spec)} characters (at most {MAX_SPEC_CHARS})")
    shown = redact_spec(spec)
    if shown != spec:
        raise ValueError(f"{name}: {shown!r} carries a user name or password (user:password@): refused, as a pod "
                         "spec is recorded, written to the ledger and printed; pods take the admin token "
                         "($FLYWHEEL_ADMIN_TOKEN), give the URL without it")
    if spec.startswith(DNS_PREFIX):
        try:
            u = urlsplit(spec[len(DNS_PREFIX):])
            ok = u.scheme in ("http", "https") and bool(u.hostname) and bool(u.port) and u.path in ("", "/")
        except ValueError:  # a port that is no number or out of range, an unclosed [IPv6 bracket
            ok = False
        if not ok:
            raise ValueError(f"{name}: {shown!r} is not dns+http(s)://name:port (a headless Service's "
                             f"name and the pods' port)")
        return spec
    try:
        u = urlsplit(spec)
        ok = u.scheme in ("http", "https") and bool(u.hostname) and not any(c.isspace() for c in spec)
        u.port  # noqa: B018 - raises ValueError for a port that is no number or out of range
    except ValueError:  # an unclosed [IPv6 bracket, a bad port
        ok = False
    if not ok:
        raise ValueError(f"{name}: {shown!r} is not a pod URL http(s)://host:port (or dns+http(s)://name:port)")
    return spec


def check_consistent(stable: str | None, candidate: str | None, weight: float) -> None:
    """The rules that tie a target's serving fields together, for :class:`PodTarget` and for
    the fleet's record (``modelstore.desired.DesiredState.validate``) alike: a weight needs a
    candidate, and the candidate is not the stable version.

    Raises:
        ValueError: naming the field (``weight: 0.5 with no candidate``, ``candidate: v000002
            is also the stable version``).
    """
    if candidate is None and weight:
        raise ValueError(f"weight: {weight} with no candidate")
    if candidate is not None and candidate == stable:
        raise ValueError(f"candidate: {candidate} is also the stable version")


class PodTarget(BaseModel):
    """What one pod should serve.

    Fields:
        generation: the desired-state record's generation (>= 0; 0: the record was never
            written and the target comes from the store's stable version).
        stable: the version served as stable (``vNNNNNN``).
        candidate: the version in the candidate slot, or None.
        weight: share of users (0..1) sent to the candidate; 0 without one.
        reload_after_ms: a stable loaded before this time (ms since epoch) is reloaded from
            the store, verified; 0 = no reload asked.

    Raises:
        ValueError (pydantic's ValidationError): a field out of bounds, naming it.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    generation: Annotated[int, Strict()] = Field(ge=0, le=MAX_GENERATION)
    stable: str = Field(min_length=1, pattern=VERSION_PATTERN)
    candidate: str | None = Field(None, min_length=1, pattern=VERSION_PATTERN)
    # a JSON number only: `true` or "1" would send every user to the candidate
    weight: Annotated[float, Strict()] = Field(0.0, ge=0.0, le=1.0)
    reload_after_ms: Annotated[int, Strict()] = Field(0, ge=0, le=MAX_GENERATION)

    @model_validator(mode="after")
    def _consistent(self) -> "PodTarget":
        check_consistent(self.stable, self.candidate, self.weight)
        return self

    def serving_fields(self) -> tuple:
        """``(stable, candidate, weight, reload_after_ms)``: what two targets must share to be the same."""
        return self.stable, self.candidate, self.weight, self.reload_after_ms


class PodState(BaseModel):
    """A pod's observed state against its target.

    Fields:
        pod: the pod's name.
        generation: the generation the pod serves: the newest target it fully converged to
            (0 before any).
        target_generation: the newest generation it has taken (>= ``generation``; greater while
            it converges, or when its last attempt failed: ``error``).
        converged: the slots equal the target of ``target_generation`` now.
        error: why the last attempt did not converge, or None.
        actions: what the last attempt changed, in order (``promote``, ``rollback to v000001``,
            ``reload v000001``, ``drop v000002``, ``load v000002``, ``weight 0.25``).
        slots: the pod's slots after it.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    pod: str
    generation: int = 0
    target_generation: int = 0
    converged: bool = False
    error: str | None = None
    actions: list[str] = Field(default_factory=list)
    slots: SlotsStatus
