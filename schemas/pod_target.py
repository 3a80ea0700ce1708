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

import ipaddress
import re
from typing import Annotated
from urllib.parse import urlsplit

import idna
from pydantic import BaseModel, ConfigDict, Field, Strict, model_validator

from schemas.admin import SlotsStatus
from schemas.manifest import VERSION_PATTERN

MAX_GENERATION = 2**53  # a generation or time past this is refused: no record counts that far

DNS_PREFIX = "dns+"  # a pod spec resolved by DNS: dns+http(s)://<headless Service>:<port>
MAX_SPEC_CHARS = 2048  # a pod spec longer than this is refused (no URL of a pod is that long)
MAX_HOST_CHARS = 253  # a host name's length, its labels joined by dots (RFC 1035)
MAX_LABEL_CHARS = 63  # one label of a host name (RFC 1035)
DEFAULT_PORTS = {"http": 80, "https": 443}
_ASCII_LABEL = re.compile(r"^[A-Za-z0-9_-]+$")  # letters, digits, '-', and '_' (compose service names)
_IPV4_STYLE = re.compile(r"^[0-9.]+$")  # digits and dots: an IPv4 address or nothing
_PORT = re.compile(r"^[0-9]{1,5}$")  # ASCII digits only ('+1', '1_0', Arabic-Indic digits are no port)
_URL_TEXT = re.compile(r"((?:[A-Za-z][A-Za-z0-9+.-]*:)?//)")
_WORD_AT = re.compile(r"""[^\s'"]*@""")


def redact_spec(spec) -> str:
    """``spec`` with everything between ``://`` (or a leading ``//``, or the start when it has
    neither) and its LAST ``@`` replaced by ``***``, whatever a URL parser would make of it
    (``http://ops:hunter2@pod-1:8000`` -> ``http://***@pod-1:8000``; ``http://ops:p/ss@pod:1``,
    ``http:///ops:pw@pod:1``, `` http://ops:pw@pod:1`` -> ``http://***@pod:1``); leading and
    trailing whitespace is trimmed when something is masked. A spec without ``@`` is returned
    as it is. For messages: a password in a spec is never printed, logged or recorded."""
    spec = spec if isinstance(spec, str) else str(spec)
    at = spec.rfind("@")
    if at < 0:
        return spec
    s = spec.strip()
    at = s.rfind("@")
    i = s.find("://")
    start = i + 3 if 0 <= i < at else 2 if s.startswith("//") else 0
    return s[:start] + "***" + s[at:]


def redact_text(text: str) -> str:
    """``text`` (a message that may quote a spec or a record's bytes) with everything from the
    first ``scheme://`` or ``//`` not already followed by ``***@`` to the text's last ``@``
    replaced by ``***``, and in a text with ``@`` but no ``//`` each word's part up to its last
    ``@`` (``stable: 'ops:pw@h'`` -> ``stable: '***@h'``):
    a user name or password never reaches a log, the ledger or the terminal, whatever else is
    masked with it. A text whose specs are masked already is returned as it is."""
    if "@" not in text:
        return text
    for m in _URL_TEXT.finditer(text):
        if text.startswith("***@", m.end(1)):  # masked by redact_spec already
            continue
        at = text.rfind("@")
        if at < m.end(1):
            break
        return text[:m.end(1)] + "***" + text[at:]
    if _URL_TEXT.search(text):
        return text
    return _WORD_AT.sub("***@", text)


def normalize_spec(spec: str) -> str:
    """The form two pod specs are compared in (duplicates count once): scheme and host in
    lower case, the scheme's default port dropped from a URL (``http://h:80`` is ``http://h``), a trailing
    ``/`` and an empty fragment or query dropped. ``HTTP://Pod:1/`` -> ``http://pod:1``. A spec
    that is no URL is returned stripped of its trailing ``/`` only."""
    prefix = DNS_PREFIX if spec[:len(DNS_PREFIX)].lower() == DNS_PREFIX else ""
    try:
        u = urlsplit(spec[len(prefix):])
        scheme, host, port = u.scheme.lower(), u.hostname or "", u.port
    except ValueError:
        return spec.rstrip("/#?")
    if ":" in host:
        host = f"[{host}]"
    if port is not None and (prefix or port != DEFAULT_PORTS.get(scheme)):  # a dns+ spec keeps its port
        host += f":{port}"
    path = u.path.rstrip("/")
    rest = path + (f"?{u.query}" if u.query else "") + (f"#{u.fragment}" if u.fragment else "")
    return f"{prefix}{scheme}://{host}{rest}"


def _host_error(host: str) -> str | None:
    """Why ``host`` (from a URL's authority, brackets kept) is no host a pod can have, or None:
    an IP literal, or a name of IDNA-encodable labels of 1-63 characters, at most 253 in all."""
    if host.startswith("["):
        if not host.endswith("]"):
            return "an unclosed [ of an IPv6 address"
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return f"{host} is no IPv6 address"
        return None
    if not host:
        return "no host"
    if _IPV4_STYLE.match(host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return f"{host} is no IPv4 address"
        return None
    name = host
    if not name.isascii():
        try:
            name = idna.encode(name.lower()).decode("ascii")
        except (idna.IDNAError, UnicodeError, ValueError) as exc:
            return f"the host name is not IDNA-encodable ({exc})"
    name = name[:-1] if name.endswith(".") else name
    if len(name) > MAX_HOST_CHARS:
        return f"a host name of {len(name)} characters (at most {MAX_HOST_CHARS})"
    for label in name.split("."):
        if not label:
            return "an empty label in the host name (two dots, or a leading dot)"
        if len(label) > MAX_LABEL_CHARS:
            return f"a host name label of {len(label)} characters (at most {MAX_LABEL_CHARS})"
        if not _ASCII_LABEL.match(label):
            return f"the host name label {label!r} holds characters other than letters, digits, '-' and '_'"
        if label[:4].lower() == "xn--":
            try:
                idna.decode(label.lower())
            except (idna.IDNAError, UnicodeError, ValueError) as exc:
                return f"the host name label {label!r} is no valid IDNA A-label ({exc})"
    return None


def _url_error(url: str, need_port: bool) -> str | None:
    """Why ``url`` (a spec without its ``dns+`` prefix) is no ``http(s)://host[:port]``, or None."""
    u = urlsplit(url)
    if u.scheme.lower() not in ("http", "https") or not url[len(u.scheme):].startswith("://"):
        return "the scheme is not http:// or https://"
    if u.query or "?" in url:
        return "a query (?...) is not part of a pod's URL"
    if u.fragment:
        return "a fragment (#...) is not part of a pod's URL"
    if u.path not in ("", "/"):
        return f"a path ({u.path[:40]!r}) other than / is not part of a pod's URL"
    netloc = u.netloc
    if netloc.startswith("["):
        end = netloc.find("]")
        host, rest = (netloc, "") if end < 0 else (netloc[:end + 1], netloc[end + 1:])
        if rest and not rest.startswith(":"):
            return f"{rest!r} after the IPv6 address"
        port = rest[1:] if rest else None
    else:
        host, sep, port = netloc.rpartition(":")
        if not sep:
            host, port = netloc, None
    err = _host_error(host)
    if err:
        return err
    if port is not None:
        if port == "":
            return "an empty port (':' with no number)"
        if not _PORT.match(port) or not 1 <= int(port) <= 65535:
            return f"the port {port[:20]!r} is not a number in [1, 65535]"
    elif need_port:
        return "no port"
    return None


def check_pod_spec(spec, name: str = "serving") -> str:
    """``spec`` if it is a pod URL ``http(s)://host[:port]`` or a ``dns+http(s)://name:port``
    spec (a headless Service's name and the pods' port) with no user name or password in it:
    the one rule for ``--serving``, ``$FLYWHEEL_SERVING_URL`` and the fleet record's ``pods``.
    A pod's admin API takes a bearer token, never a password in the URL, and a spec may be
    recorded, written to the ledger and printed.

    The host is an IP literal (``[::1]`` for IPv6) or a name whose labels are 1-63 characters
    (letters, digits, ``-``, ``_``; a non-ASCII name must be IDNA-encodable, an ``xn--`` label a
    valid A-label), at most 253 in all; the port, when given, a number in [1, 65535]; no query,
    no fragment, no path but ``/``, no whitespace or control character, no ``@`` anywhere.

    Args:
        spec: the spec (a str).
        name: how the value is named in the message (``serving``, ``pods[2]``).

    Raises:
        ValueError: naming ``name``, the spec (its user name and password masked,
            :func:`redact_spec`), the reason and the form it must have.
    """
    if not isinstance(spec, str):
        raise ValueError(f"{name}: must be a pod URL (a string), got {type(spec).__name__} "
                         f"{redact_spec(str(spec))[:40]!r}")
    if len(spec) > MAX_SPEC_CHARS:
        raise ValueError(f"{name}: a pod spec of {len(spec)} characters (at most {MAX_SPEC_CHARS})")
    shown = redact_spec(spec)
    if "@" in spec:
        raise ValueError(f"{name}: {shown!r} carries a user name or password (user:password@): refused, as a pod "
                         "spec is recorded, written to the ledger and printed; pods take the admin token "
                         "($FLYWHEEL_ADMIN_TOKEN), give the URL without it")
    dns = spec.startswith(DNS_PREFIX)
    form = ("dns+http(s)://name:port (a headless Service's name and the pods' port)" if dns
            else "a pod URL http(s)://host:port (or dns+http(s)://name:port)")
    bad = next((c for c in spec if c.isspace() or not c.isprintable()), None)
    if bad is not None:
        why = f"it holds the control or space character {bad!r}"
    else:
        try:
            why = _url_error(spec[len(DNS_PREFIX):] if dns else spec, need_port=dns)
        except ValueError as exc:  # anything urlsplit itself refuses
            why = str(exc)
    if why:
        raise ValueError(f"{name}: {shown!r} is not {form}: {why}")
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
