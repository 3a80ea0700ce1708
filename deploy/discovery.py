"""Serving pods found by DNS instead of a fixed list of URLs.

A Kubernetes headless Service (``clusterIP: None``) answers a DNS query for its name with
one A/AAAA record per ready pod behind it. The controller is given
``dns+http://<service>.<namespace>.svc.cluster.local:8000`` and asks DNS again before each
reconcile step, so pods that come, go or move are followed without a restart. A plain
``http://`` URL is one pod, as before.

This module knows nothing about rollouts: it turns specs into pod base URLs, and keeps one
:class:`deploy.serving_client.ServingAdmin` per URL.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from typing import Callable
from urllib.parse import urlsplit

from deploy.serving_client import ServingAdmin, ServingAdminError
from schemas.pod_target import DNS_PREFIX, check_pod_spec, normalize_spec

log = logging.getLogger(__name__)

Resolver = Callable[..., list]  # socket.getaddrinfo's signature and answer


def is_dns(spec: str) -> bool:
    """True for a ``dns+http://`` / ``dns+https://`` spec."""
    return spec.startswith(DNS_PREFIX)


def check_spec(spec: str, name: str = "serving") -> str:
    """``spec`` if it is a pod URL ``http(s)://host[:port]`` or a ``dns+http(s)://name:port``
    spec with no user name or password (:func:`schemas.pod_target.check_pod_spec`, the rule
    the fleet record's ``pods`` follow too), before any pod or DNS server is asked.

    Raises:
        ValueError: naming ``name``, the spec (a password in it masked) and the form it must
            have (a usage error for the CLI).
    """
    return check_pod_spec(spec, name)


def unique_specs(specs: list[str]) -> list[str]:
    """``specs`` in order, each once: two specs of one form
    (:func:`schemas.pod_target.normalize_spec`: ``http://h:1``, ``HTTP://h:1``, ``http://h:1/``)
    are one pod; the first spelling is kept."""
    out: list[str] = []
    seen: set[str] = set()
    for s in specs:
        key = normalize_spec(s)
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


def resolve(spec: str, resolver: Resolver = socket.getaddrinfo) -> list[str]:
    """Pod base URLs behind one spec, sorted and without duplicates.

    Args:
        spec: ``dns+http://name:port`` (every address ``name`` resolves to, on ``port``) or a
            plain ``http(s)://host:port`` URL (returned in its normal form,
            :func:`schemas.pod_target.normalize_spec`: one pod has one URL).
        resolver: ``socket.getaddrinfo`` or a function with its signature and answer (tests
            pass a fake DNS answer).

    Raises:
        ValueError: a ``dns+`` spec without host or port, or with a path.
        ServingAdminError: the name does not resolve, or resolves to no address
            (``kind="unreachable"``, the URL is the spec).
    """
    if not is_dns(spec):
        return [normalize_spec(spec)]
    u = urlsplit(spec[len(DNS_PREFIX):])
    if u.scheme not in ("http", "https") or not u.hostname or not u.port or u.path not in ("", "/"):
        raise ValueError(f"serving: {spec!r} is not dns+http(s)://name:port (a headless Service's "
                         f"name and the pods' port)")
    try:
        answer = resolver(u.hostname, u.port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:  # socket.gaierror: NXDOMAIN, no answer, resolver down; a bad name
        raise ServingAdminError(spec, 0, f"DNS lookup of {u.hostname} failed: {exc}") from None
    urls = set()
    for _family, _type, _proto, _canon, sockaddr in answer:
        ip = ipaddress.ip_address(sockaddr[0])
        host = f"[{ip}]" if ip.version == 6 else str(ip)
        urls.add(f"{u.scheme}://{host}:{u.port}")
    if not urls:
        raise ServingAdminError(spec, 0, f"DNS name {u.hostname} has no address (no ready pod)")
    return sorted(urls)


class PodDiscovery:
    """``discover()`` -> the current :class:`ServingAdmin` per pod, for the controller.

    Args:
        specs: serving specs (:func:`resolve`); at least one.
        make_admin: builds the admin client of one pod URL.
        resolver: as in :func:`resolve`.

    A pod keeps its admin object (and its connection pool) while its URL stays; changes in
    the pod set are logged. Calling it raises what :func:`resolve` raises.
    """

    def __init__(self, specs: list[str], make_admin: Callable[[str], ServingAdmin],
                 resolver: Resolver = socket.getaddrinfo):
        if not specs:
            raise ValueError("serving: at least one URL or dns+http:// spec is needed")
        for spec in specs:
            check_spec(spec)
        self.specs, self.make_admin, self.resolver = list(specs), make_admin, resolver
        self._admins: dict[str, ServingAdmin] = {}

    @property
    def dynamic(self) -> bool:
        """True when any spec is resolved by DNS (the pod set may change)."""
        return any(is_dns(s) for s in self.specs)

    def urls(self) -> list[str]:
        """Current pod URLs, in spec order, each once."""
        out: list[str] = []
        for s in self.specs:
            out += [u for u in resolve(s, self.resolver) if u not in out]
        return out

    def __call__(self) -> list[ServingAdmin]:
        urls = self.urls()
        if set(urls) != set(self._admins):
            log.info("serving pods: %s (were %s)", ", ".join(urls), ", ".join(self._admins) or "none")
        self._admins = {u: self._admins.get(u) or self.make_admin(u) for u in urls}
        return [self._admins[u] for u in urls]
