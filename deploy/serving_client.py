"""Client of serving's admin API (contract: ``schemas/admin.py``).

Flywheel changes a pod only with :meth:`ServingAdmin.put_desired` (one declarative target,
``schemas/pod_target.py``), called by the controller's reconcile loop; operator commands only
read (:meth:`ServingAdmin.desired_state`). The imperative calls (load, weight, promote,
rollback) remain for driving one pod by hand.

Every call to a pod is bounded by one timeout (seconds): the ``timeout_s`` given, else
``$FLYWHEEL_SERVING_TIMEOUT_S``, else :data:`DEFAULT_TIMEOUT_S`; the deploy CLI sets it with
``--serving-timeout-s``. A failure says which it was (:attr:`ServingAdminError.kind`):
the pod did not answer in time, could not be reached, answered 5xx (all three *transport*
failures: nothing is known about the version), or refused the request (4xx, e.g. 409 when
the version's bytes or hashes are wrong: a *bad artifact*).
"""

from __future__ import annotations

import math
import os

import httpx

from schemas.admin import LoadRequest, RollbackRequest, SlotsStatus, WeightRequest
from schemas.pod_target import PodState, PodTarget

TIMEOUT_ENV = "FLYWHEEL_SERVING_TIMEOUT_S"
TIMEOUT_FLAG = "--serving-timeout-s"
DEFAULT_TIMEOUT_S = 120.0  # a load reconstructs and hash-verifies the whole model
CONNECT_TIMEOUT_S = 5.0  # at most this for the TCP connect, whatever the timeout

KINDS = ("timeout", "unreachable", "server", "refused", "not_a_pod")
BODY_SHOWN = 80  # characters of a body that is no answer of a pod quoted in the error


def timeout_from_env(default: float = DEFAULT_TIMEOUT_S) -> float:
    """``$FLYWHEEL_SERVING_TIMEOUT_S`` as seconds, or ``default`` when unset or empty.

    Raises:
        ValueError: the variable is not a finite number > 0 (the message names it).
    """
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return default
    return check_timeout(raw, TIMEOUT_ENV)


def check_timeout(value, name: str = "timeout_s") -> float:
    """``value`` as a finite number of seconds > 0; ValueError naming ``name`` otherwise."""
    try:
        t = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: must be a number of seconds > 0, got {value!r}") from None
    if not math.isfinite(t) or t <= 0:
        raise ValueError(f"{name}: must be a finite number of seconds > 0, got {value!r}")
    return t


class ServingAdminError(RuntimeError):
    """A call to a pod's admin API failed.

    Attributes:
        url: the URL called.
        status: HTTP status, 0 when no answer came.
        reason: the server's message, or what went wrong on the way.
        kind: ``timeout`` (no answer within ``timeout_s``), ``unreachable`` (connection
            refused, DNS, reset, or a URL no HTTP client can call: an invalid host name, a
            control character), ``server`` (HTTP 5xx), ``refused`` (HTTP 4xx: the pod
            answered and said no, e.g. 409 for a corrupt version), ``not_a_pod`` (HTTP 2xx
            with a body that is no answer of a pod's admin API: not JSON, or not its shape).
        timeout_s: the timeout the call ran under (s).
    """

    def __init__(self, url: str, status: int, reason: str, kind: str | None = None,
                 timeout_s: float | None = None):
        if kind is None:
            kind = "unreachable" if status == 0 else "server" if status >= 500 else "refused"
        if kind not in KINDS:
            raise ValueError(f"kind: must be one of {KINDS}, got {kind!r}")
        self.url, self.status, self.reason, self.kind, self.timeout_s = url, status, reason, kind, timeout_s
        if kind == "timeout":
            msg = (f"serving admin {url}: no answer within {timeout_s:g} s (timeout set by {TIMEOUT_FLAG} "
                   f"or {TIMEOUT_ENV}): {reason}")
        elif kind == "not_a_pod":
            msg = f"serving admin {url}: not a pod: {reason}"
        elif status == 0:
            msg = f"serving admin {url}: unreachable: {reason}"
        else:
            msg = f"serving admin {url}: HTTP {status}: {reason}"
        super().__init__(msg)

    @property
    def transport(self) -> bool:
        """True when the pod did not give an answer about the request (timeout, unreachable,
        5xx, not a pod): the version asked for may be perfectly good; retry, do not mark it failed."""
        return self.kind != "refused"

    @property
    def pod(self) -> str:
        """The pod's base URL (``url`` without the ``/admin/...`` or ``/metrics`` path)."""
        for cut in ("/admin", "/metrics"):
            if cut in self.url:
                return self.url.rsplit(cut, 1)[0]
        return self.url

    def numbers(self) -> dict:
        """The failure as ledger numbers (pod, url, http_status, failure kind, transport, timeout_s)."""
        return {"pod": self.pod, "url": self.url, "http_status": self.status, "failure": self.kind,
                "transport": self.transport, "timeout_s": self.timeout_s}


class ServingAdmin:
    """Drive one serving pod's model slots.

    Args:
        base_url: serving base URL, e.g. ``http://127.0.0.1:8000``.
        admin_token: sent as ``Authorization: Bearer``; None sends no header.
        timeout_s: bound on each call (s): no answer within it raises
            :class:`ServingAdminError` with ``kind="timeout"``. None:
            :func:`timeout_from_env` (``$FLYWHEEL_SERVING_TIMEOUT_S``, default 120 s; loads
            reconstruct and verify whole models). Connecting takes at most
            ``min(timeout_s, 5)`` s.

    Every failure of a call is a :class:`ServingAdminError` with its kind, whatever the URL or
    the answer: a URL no HTTP client can call (an invalid host name, a control character) is
    ``unreachable`` at each call (building the client never raises for it); a 2xx answer that
    is not JSON, or not the admin API's shape, is ``not_a_pod``.

    Raises:
        ValueError: ``timeout_s`` (or the environment variable) is not a number > 0.
    """

    def __init__(self, base_url: str, admin_token: str | None = None, timeout_s: float | None = None):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_from_env() if timeout_s is None else check_timeout(timeout_s)
        headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        timeout = httpx.Timeout(self.timeout_s, connect=min(self.timeout_s, CONNECT_TIMEOUT_S))
        self._bad_url: str | None = None  # why no call can be made to base_url, or None
        try:
            self._client = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)
        except (httpx.InvalidURL, UnicodeError, ValueError) as exc:  # idna.IDNAError is a UnicodeError
            self._bad_url = f"invalid URL ({type(exc).__name__}: {exc})"
            self._client = None

    def _request(self, method: str, path: str, body=None) -> httpx.Response:
        url = self.base_url + path
        if self._client is None:
            raise ServingAdminError(url, 0, self._bad_url, "unreachable", self.timeout_s)
        try:
            return self._client.request(method, path, json=body.model_dump() if body is not None else None)
        except httpx.TimeoutException as exc:
            raise ServingAdminError(url, 0, f"{type(exc).__name__}", "timeout", self.timeout_s) from exc
        except httpx.HTTPError as exc:
            raise ServingAdminError(url, 0, f"{type(exc).__name__}: {exc}", "unreachable", self.timeout_s) from exc
        except (httpx.InvalidURL, UnicodeError, ValueError) as exc:  # a host httpx or IDNA cannot encode
            raise ServingAdminError(url, 0, f"invalid URL ({type(exc).__name__}: {exc})", "unreachable",
                                    self.timeout_s) from exc

    def _parse(self, r: httpx.Response, path: str, model):
        """A 2xx answer as ``model``; ServingAdminError ``not_a_pod`` when the body is not JSON or
        not the admin API's shape (something else answers on that port)."""
        try:
            return model.model_validate(r.json())
        except (ValueError, TypeError, RecursionError) as exc:  # JSON, UTF-8, pydantic's ValidationError
            body = r.text[:BODY_SHOWN] if isinstance(exc, ValueError) and not hasattr(exc, "errors") else None
            why = (f"HTTP {r.status_code} with a body that is not JSON ({body!r})" if body is not None else
                   f"HTTP {r.status_code} with JSON that is no {model.__name__} ({type(exc).__name__}: "
                   f"{str(exc)[:200]})")
            raise ServingAdminError(self.base_url + path, r.status_code, why, "not_a_pod", self.timeout_s) from None

    def _call(self, method: str, path: str, body=None, model=SlotsStatus):
        r = self._request(method, path, body)
        if not r.is_success:
            try:
                j = r.json()
                reason = j
                if isinstance(j, dict):  # FastAPI {"detail": ..} or OpenAI {"error": {"message": ..}}
                    err = j.get("error")
                    reason = j.get("detail") or (err.get("message") if isinstance(err, dict) else err) or j
            except ValueError:
                reason = r.text[:500]
            raise ServingAdminError(self.base_url + path, r.status_code, str(reason), timeout_s=self.timeout_s)
        return self._parse(r, path, model)

    def slots(self) -> SlotsStatus:
        """Current stable/candidate slots and the candidate's traffic weight."""
        return self._call("GET", "/admin/slots")

    def put_desired(self, target: PodTarget) -> PodState:
        """``PUT /admin/desired``: the pod converges to ``target`` (idempotent) and answers with
        the generation it serves. A refusal (409: a generation older than the pod's, a version
        that cannot be loaded) raises :class:`ServingAdminError` of kind ``refused``."""
        return self._call("PUT", "/admin/desired", target, PodState)

    def desired_state(self) -> PodState:
        """``GET /admin/desired``: the generation the pod serves, the newest it has taken,
        whether its slots equal that target, and its slots (read-only)."""
        return self._call("GET", "/admin/desired", None, PodState)

    # -- by hand: the imperative routes (Flywheel's reconcilers use put_desired only) --------
    def load(self, version: str) -> SlotsStatus:
        """Load ``version`` into the candidate slot (hash-verified by serving)."""
        return self._call("POST", "/admin/load", LoadRequest(version=version))

    def set_weight(self, w: float) -> SlotsStatus:
        """Send share ``w`` (0..1) of traffic to the candidate. ValueError if out of range."""
        if not 0.0 <= w <= 1.0:
            raise ValueError(f"candidate_weight: must be in [0, 1], got {w}")
        return self._call("POST", "/admin/weight", WeightRequest(candidate_weight=w))

    def promote(self) -> SlotsStatus:
        """Candidate becomes stable (hot swap)."""
        return self._call("POST", "/admin/promote")

    def rollback(self, version: str | None = None) -> SlotsStatus:
        """Drop the candidate; with ``version``, replace stable by that version."""
        return self._call("POST", "/admin/rollback", RollbackRequest(version=version))

    def metrics_text(self) -> str:
        """Serving's Prometheus ``/metrics`` text."""
        r = self._request("GET", "/metrics")
        if not r.is_success:
            raise ServingAdminError(self.base_url + "/metrics", r.status_code, r.text[:200], timeout_s=self.timeout_s)
        return r.text

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
