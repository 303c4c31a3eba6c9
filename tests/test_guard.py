"""Who may call a local server: DNS rebinding, web pages (CORS), public binds, keys, rates.

The real server (granian, embedded model): `server` has the default flags; `open_server` lets
one web origin in, answers one more host name and limits each client's request rate.
"""

from __future__ import annotations

import hmac
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxgate.api.guard import Guard, is_loopback, public_bind_refused
from support.servers import REPO, RunningServer, free_port, start_server, stop_server

MESSAGE = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
CHAT = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
APP = "https://app.example"
RATE = 4


@pytest.fixture(scope="module")
def open_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(
        tmp_path_factory.mktemp("open"),
        "--cors-origins", APP,
        "--allowed-hosts", "my-box.lan,other.lan",
        "--rate-limit", str(RATE),
    )  # fmt: skip
    yield running
    stop_server(running)


def _post(server: RunningServer, path: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


def _preflight(server: RunningServer, path: str, headers: str) -> httpx.Response:
    """What a browser asks before a cross-origin POST from APP with `headers`."""
    return httpx.options(
        server.url + path,
        headers={
            "origin": APP,
            "access-control-request-method": "POST",
            "access-control-request-headers": headers,
        },
    )


def test_a_rebinding_host_is_refused_in_each_dialect(server: RunningServer) -> None:
    """A page at evil.example whose DNS now says 127.0.0.1 sends Host: evil.example."""
    anthropic = _post(server, "/v1/messages", MESSAGE, host="evil.example:8080")
    assert anthropic.status_code == 403
    assert anthropic.json()["error"]["type"] == "permission_error"
    assert "evil.example:8080" in anthropic.json()["error"]["message"]
    openai = _post(server, "/v1/chat/completions", CHAT, host="evil.example")
    assert openai.status_code == 403
    assert "error" in openai.json()
    assert httpx.get(f"{server.url}/health", headers={"host": "evil.example"}).status_code == 403
    for host in ("localhost:1234", "127.0.0.1", "[::1]:80", "api.localhost"):
        response = httpx.get(f"{server.url}/v1/models", headers={"host": host})
        assert response.status_code == 200, host


def test_without_cors_origins_a_web_page_is_refused(server: RunningServer) -> None:
    preflight = _preflight(server, "/v1/messages", "content-type,x-api-key")
    assert preflight.status_code == 403
    assert "access-control-allow-origin" not in preflight.headers
    # A "simple" cross-origin POST is not preflighted: it must not run either.
    simple = _post(server, "/v1/messages", MESSAGE, origin=APP)
    assert simple.status_code == 403
    assert "--cors-origins" in simple.json()["error"]["message"]


def test_an_allowed_origin_gets_its_preflight_and_cors_headers(open_server: RunningServer) -> None:
    preflight = _preflight(open_server, "/v1/chat/completions", "authorization,content-type")
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == APP
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert preflight.headers["access-control-allow-headers"] == "authorization,content-type"
    models = httpx.get(f"{open_server.url}/v1/models", headers={"origin": APP})
    assert models.status_code == 200
    assert models.headers["access-control-allow-origin"] == APP
    assert "request-id" in models.headers["access-control-expose-headers"]
    other = httpx.get(f"{open_server.url}/v1/models", headers={"origin": "https://evil.example"})
    assert other.status_code == 403
    assert "access-control-allow-origin" not in other.headers


def test_allowed_hosts_are_answered(open_server: RunningServer) -> None:
    for host in ("my-box.lan:8080", "other.lan"):
        assert httpx.get(f"{open_server.url}/v1/models", headers={"host": host}).status_code == 200
    refused = httpx.get(f"{open_server.url}/v1/models", headers={"host": "third.lan"})
    assert refused.status_code == 403


def test_a_client_over_its_rate_gets_429_with_retry_after(open_server: RunningServer) -> None:
    path = "/v1/messages/count_tokens"
    statuses = [_post(open_server, path, MESSAGE, **{"x-api-key": "a"}) for _ in range(RATE + 1)]
    assert [r.status_code for r in statuses] == [200] * RATE + [429]
    limited = statuses[-1]
    assert limited.json()["error"]["type"] == "rate_limit_error"
    assert int(limited.headers["retry-after"]) >= 1
    # Another client has its own bucket; OpenAI's envelope for an OpenAI route.
    other = _post(open_server, "/v1/chat/completions", CHAT, authorization="Bearer b")
    assert other.status_code == 200
    for _ in range(RATE):
        last = _post(open_server, "/v1/chat/completions", CHAT, authorization="Bearer b")
    assert last.status_code == 429
    assert last.json()["error"]["code"] == "rate_limit_exceeded"


def test_every_answer_names_its_request(server: RunningServer) -> None:
    first = httpx.get(f"{server.url}/v1/models")
    second = _post(server, "/v1/messages", {"bad": True})
    for response in (first, second):
        assert response.headers["request-id"].startswith("req_")
        assert response.headers["x-request-id"] == response.headers["request-id"]
    assert first.headers["request-id"] != second.headers["request-id"]


def test_streams_tell_proxies_not_to_buffer(server: RunningServer) -> None:
    with httpx.stream(
        "POST", f"{server.url}/v1/messages", json={**MESSAGE, "stream": True}, timeout=60
    ) as response:
        assert response.headers["x-accel-buffering"] == "no"
        assert response.headers["cache-control"] == "no-cache"
        response.read()


def test_a_public_bind_without_a_key_is_refused_at_start_up(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "mlxgate", "serve", "--host", "0.0.0.0", "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert run.returncode != 0
    assert "--host 0.0.0.0 is reachable from other machines" in run.stderr
    assert public_bind_refused("0.0.0.0", "key", insecure_public=False) is None
    assert public_bind_refused("192.168.1.5", None, insecure_public=True) is None
    assert public_bind_refused("::1", None, insecure_public=False) is None
    assert is_loopback("127.0.0.2") and not is_loopback("10.0.0.1")


def test_the_key_is_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every check goes through hmac.compare_digest, for both headers whatever the first says,
    and only the exact key passes."""
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr("mlxgate.api.guard.hmac.compare_digest", spy)
    guard = Guard(api_key="sk-secret")

    def scope(**headers: str) -> dict[str, Any]:
        return {"headers": [(k.encode(), v.encode()) for k, v in headers.items()]}

    assert guard.authorized(scope(**{"x-api-key": "sk-secret"}))
    assert guard.authorized(scope(authorization="Bearer sk-secret"))
    for wrong in ("sk-secre", "sk-secret2", "SK-SECRET", ""):
        assert not guard.authorized(scope(**{"x-api-key": wrong}))
        assert not guard.authorized(scope(authorization=f"Bearer {wrong}"))
    assert not guard.authorized(scope())
    assert len(compared) == 2 * (2 + 8 + 1)


def test_the_rate_refills_over_time() -> None:
    guard = Guard(rate_limit=60)  # one a second
    for _ in range(60):
        guard.take_token("c", now=100.0)
    with pytest.raises(Exception, match="60 requests a minute") as refused:
        guard.take_token("c", now=100.0)
    assert refused.value.retry_after_s == 1  # type: ignore[attr-defined]
    guard.take_token("c", now=101.0)
    with pytest.raises(Exception, match="rate limit"):
        guard.take_token("c", now=101.5)
