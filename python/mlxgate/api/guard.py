"""Who may call the server: the API key, the Host a request names, the browser origins allowed
(CORS), and how many requests a client may have in flight and send per minute.

A local server is reachable from the web pages its user opens: a page may `fetch()` from
`http://127.0.0.1:8080`, or point a DNS name of its own at 127.0.0.1 (DNS rebinding) and read
the answers as same-origin. Without an API key, a request must name a loopback host (or one of
`--allowed-hosts`) and may come from a browser page only if its origin is in `--cors-origins`.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import math
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from mlxgate._native import ErrorKind
from mlxgate.api.errors import ApiError
from mlxgate.api.http import Scope, client_address, header

LOOPBACK_NAMES = ("localhost", "localhost.")
PREFLIGHT_MAX_AGE_S = 600
ALLOWED_METHODS = b"GET, POST, DELETE, OPTIONS"


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address, without port) is this machine's loopback."""
    host = host.strip("[]").lower()
    if host in LOOPBACK_NAMES or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def public_bind_refused(host: str, api_key: str | None, insecure_public: bool) -> str | None:
    """Why the server must not bind `host`, if it must not: anyone who reaches a non-loopback
    address could use it without a key."""
    if api_key or insecure_public or is_loopback(host):
        return None
    return (
        f"--host {host} is reachable from other machines, and without --api-key anyone there "
        "could use the server: give --api-key KEY, or --insecure-public to serve without one"
    )


def _keys(scope: Scope) -> tuple[str, str]:
    """The keys a request presents: `x-api-key`, and the `Authorization` bearer token ("" for
    none)."""
    bearer = (header(scope, b"authorization") or "").removeprefix("Bearer ")
    return header(scope, b"x-api-key") or "", bearer


def _host_name(value: str) -> str:
    """The host of a Host header: `[::1]:8080` -> `::1`, `example.com:80` -> `example.com`."""
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rpartition(":")[0] if value.count(":") == 1 else value


@dataclass
class _Bucket:
    tokens: float
    at: float


@dataclass
class Guard:
    api_key: str | None = None
    allowed_hosts: tuple[str, ...] = ()  # "*" allows any
    cors_origins: tuple[str, ...] = ()  # "*" allows any
    max_per_client: int = 0  # generation requests in flight per client; 0: no limit
    rate_limit: float = 0  # requests per minute per client; 0: no limit
    _in_flight: Counter[str] = field(default_factory=Counter)
    _buckets: dict[str, _Bucket] = field(default_factory=dict)

    def check(self, scope: Scope) -> None:
        """Raise an ApiError unless the request may be served (before its body is read)."""
        if not self._host_allowed(scope):
            raise ApiError(
                ErrorKind.PERMISSION,
                f"the Host header {header(scope, b'host')!r} names no host this server answers "
                "without an API key (loopback, or --allowed-hosts)",
                should_retry=False,
            )
        origin = header(scope, b"origin")
        if origin is not None and not self.origin_allowed(origin):
            raise ApiError(
                ErrorKind.PERMISSION,
                f"requests from the web page origin {origin!r} are not allowed (--cors-origins)",
                should_retry=False,
            )

    def authorized(self, scope: Scope) -> bool:
        """Whether the request carries the API key (compared in constant time), if one is set."""
        if not self.api_key:
            return True
        key = self.api_key.encode()
        given, bearer = _keys(scope)
        # Both compared, whatever the first gives: the time does not tell which header was right.
        by_header = hmac.compare_digest(given.encode("latin-1"), key)
        by_bearer = hmac.compare_digest(bearer.encode("latin-1"), key)
        return by_header | by_bearer

    def origin_allowed(self, origin: str) -> bool:
        return "*" in self.cors_origins or origin in self.cors_origins

    def cors_headers(self, scope: Scope) -> list[tuple[bytes, bytes]]:
        """The CORS headers of an answer to an allowed browser origin (none otherwise)."""
        origin = header(scope, b"origin")
        if origin is None or not self.origin_allowed(origin):
            return []
        return [
            (b"access-control-allow-origin", origin.encode("latin-1")),
            (b"access-control-expose-headers", b"request-id, x-request-id, retry-after"),
            (b"vary", b"Origin"),
        ]

    def preflight_headers(self, scope: Scope) -> list[tuple[bytes, bytes]]:
        """The answer to a browser's preflight (OPTIONS) from an allowed origin, besides
        `cors_headers`."""
        asked = header(scope, b"access-control-request-headers") or ""
        return [
            (b"access-control-allow-methods", ALLOWED_METHODS),
            (b"access-control-allow-headers", asked.encode("latin-1")),
            (b"access-control-max-age", str(PREFLIGHT_MAX_AGE_S).encode()),
        ]

    def _host_allowed(self, scope: Scope) -> bool:
        if self.api_key or "*" in self.allowed_hosts:
            return True  # a rebinding page does not know the key
        host = header(scope, b"host")
        if host is None:
            return True  # HTTP/1.0 without Host: no browser sends that
        name = _host_name(host).lower()
        return is_loopback(name) or name in self.allowed_hosts

    @staticmethod
    def client(scope: Scope) -> str:
        """Who a request counts against: its API key, else its address."""
        given, bearer = _keys(scope)
        return given or bearer or client_address(scope)

    def take_token(self, client: str, now: float | None = None) -> None:
        """Count a request against the client's rate (`rate_limit` a minute, bursts up to as
        many); raise a rate-limit error, with when to retry, if it has none left."""
        if not self.rate_limit:
            return
        now = time.monotonic() if now is None else now
        per_s = self.rate_limit / 60
        bucket = self._buckets.setdefault(client, _Bucket(self.rate_limit, now))
        bucket.tokens = min(self.rate_limit, bucket.tokens + (now - bucket.at) * per_s)
        bucket.at = now
        if bucket.tokens < 1:
            raise ApiError(
                ErrorKind.RATE_LIMITED,
                f"rate limit: at most {self.rate_limit:g} requests a minute per client",
                retry_after_s=math.ceil((1 - bucket.tokens) / per_s),
                code="rate_limit_exceeded",
            )
        bucket.tokens -= 1
        if len(self._buckets) > 4096:  # forget the clients whose buckets are full again
            full = [
                c
                for c, b in self._buckets.items()
                if b.tokens + (now - b.at) * per_s >= self.rate_limit
            ]
            for name in full:
                del self._buckets[name]

    @contextlib.contextmanager
    def slot(self, client: str) -> Iterator[None]:
        """Hold one of the client's `max_per_client` generation requests while it runs."""
        limit = self.max_per_client
        if not limit:
            yield
            return
        if self._in_flight[client] >= limit:
            raise ApiError(
                ErrorKind.RATE_LIMITED,
                f"rate limit: at most {limit} concurrent requests per client",
                retry_after_s=1,
                code="rate_limit_exceeded",
            )
        self._in_flight[client] += 1
        try:
            yield
        finally:
            self._in_flight[client] -= 1
            if not self._in_flight[client]:
                del self._in_flight[client]
