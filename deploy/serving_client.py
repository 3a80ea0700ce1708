"""Client of serving's admin API (contract: ``schemas/admin.py``)."""

from __future__ import annotations

import httpx

from schemas.admin import LoadRequest, RollbackRequest, SlotsStatus, WeightRequest


class ServingAdminError(RuntimeError):
    """The admin API answered non-2xx (``status`` is the HTTP code, ``reason`` the
    server's message) or could not be reached (``status`` = 0)."""

    def __init__(self, url: str, status: int, reason: str):
        self.url, self.status, self.reason = url, status, reason
        super().__init__(f"serving admin {url}: HTTP {status}: {reason}")


class ServingAdmin:
    """Drive one serving pod's model slots.

    Args:
        base_url: serving base URL, e.g. ``http://127.0.0.1:8000``.
        admin_token: sent as ``Authorization: Bearer``; None sends no header.
        timeout_s: per-request timeout (s); loads reconstruct and verify weights, so the
            default is generous.
    """

    def __init__(self, base_url: str, admin_token: str | None = None, timeout_s: float = 120.0):
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self._client = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout_s)

    def _call(self, method: str, path: str, body=None) -> SlotsStatus:
        url = self.base_url + path
        try:
            r = self._client.request(method, path, json=body.model_dump() if body is not None else None)
        except httpx.HTTPError as exc:
            raise ServingAdminError(url, 0, f"unreachable: {exc}") from exc
        if not r.is_success:
            try:
                j = r.json()
                reason = j
                if isinstance(j, dict):  # FastAPI {"detail": ..} or OpenAI {"error": {"message": ..}}
                    err = j.get("error")
                    reason = j.get("detail") or (err.get("message") if isinstance(err, dict) else err) or j
            except ValueError:
                reason = r.text
            raise ServingAdminError(url, r.status_code, str(reason))
        return SlotsStatus.model_validate(r.json())

    def slots(self) -> SlotsStatus:
        """Current stable/candidate slots and the candidate's traffic weight."""
        return self._call("GET", "/admin/slots")

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
        try:
            r = self._client.get("/metrics")
        except httpx.HTTPError as exc:
            raise ServingAdminError(self.base_url + "/metrics", 0, f"unreachable: {exc}") from exc
        if not r.is_success:
            raise ServingAdminError(self.base_url + "/metrics", r.status_code, r.text[:200])
        return r.text

    def close(self) -> None:
        self._client.close()
