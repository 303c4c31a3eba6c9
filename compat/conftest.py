"""The compatibility suite's fixtures: a real mlxgate server (../.venv/bin/mlxgate, the embedded
model) behind a relay that keeps every byte each client sends and receives, so that a test can
show what went over the wire (the path asked, the keep-alives before the first token, the end of
the stream) whatever the client hides; and a guard that refuses any connection beyond this
machine, so no client phones home (tracing, telemetry, price lists) during the run.

This suite runs in its own venv (.venv-compat, `make compat`), which has the clients and not
mlxgate: it does not import tests/conftest.py or mlxgate.
"""

from __future__ import annotations

import bisect
import contextlib
import ipaddress
import itertools
import json
import os
import socket
import subprocess
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

REPO = Path(__file__).resolve().parent.parent
MLXGATE = REPO / ".venv" / "bin" / "mlxgate"

# Set before any test module imports a client: several read them at import.
OFFLINE_ENV = {
    "OPENAI_AGENTS_DISABLE_TRACING": "1",  # the Agents SDK exports traces to api.openai.com
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # LiteLLM fetches its price map from GitHub at import
    "LITELLM_OFFLINE_MODE": "true",  # ... and its Anthropic beta-header list, tokenizers, etc.
    "LITELLM_LOCAL_ANTHROPIC_BETA_HEADERS": "true",
    "LANGSMITH_TRACING": "false",
    "LANGCHAIN_TRACING_V2": "false",
    "HF_HUB_OFFLINE": "1",
    "DO_NOT_TRACK": "1",
    "OPENAI_API_KEY": "sk-local",  # clients that insist on a key; mlxgate checks none by default
    "ANTHROPIC_API_KEY": "sk-local",
}
os.environ.update(OFFLINE_ENV)
for variable in ("OPENAI_BASE_URL", "ANTHROPIC_BASE_URL", "OPENAI_ORG_ID", "OPENAI_PROJECT_ID"):
    os.environ.pop(variable, None)


# The guard: name lookups and connections beyond loopback fail, and are remembered so that the
# test during which one was tried fails too (a client may swallow the error).

blocked: list[str] = []
_getaddrinfo = socket.getaddrinfo
_connect = socket.socket.connect
_connect_ex = socket.socket.connect_ex


def _is_local(host: object) -> bool:
    if isinstance(host, bytes):
        host = host.decode()
    if host is None or host == "localhost":
        return True
    try:
        return ipaddress.ip_address(str(host).split("%")[0]).is_loopback
    except ValueError:
        return False


def _refuse(what: str) -> None:
    blocked.append(f"{what}\n{''.join(traceback.format_stack(limit=12)[:-2])}")
    raise OSError(f"the compat suite allows no network beyond this machine: {what}")


def _guarded_getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
    if not _is_local(host):
        _refuse(f"name lookup of {host!r}")
    return _getaddrinfo(host, *args, **kwargs)


def _guarded_connect(self: socket.socket, address: Any) -> None:
    if self.family in (socket.AF_INET, socket.AF_INET6) and not _is_local(address[0]):
        _refuse(f"connection to {address!r}")
    return _connect(self, address)


def _guarded_connect_ex(self: socket.socket, address: Any) -> int:
    if self.family in (socket.AF_INET, socket.AF_INET6) and not _is_local(address[0]):
        _refuse(f"connection to {address!r}")
    return _connect_ex(self, address)


socket.getaddrinfo = _guarded_getaddrinfo
socket.socket.connect = _guarded_connect  # type: ignore[method-assign]
socket.socket.connect_ex = _guarded_connect_ex  # type: ignore[method-assign]


@pytest.fixture(autouse=True)
def no_network() -> Iterator[None]:
    """Fails the test during which (or before which, at import) a client tried the network."""
    yield
    tried, blocked[:] = list(blocked), []
    assert not tried, "a client tried to reach beyond 127.0.0.1:\n" + "\n".join(tried)


# The relay and what it saw.


@dataclass
class Exchange:
    """One HTTP request and its response as they crossed the relay."""

    method: str
    path: str
    request_body: bytes
    status: int
    content_type: str
    body: bytes

    def events(self) -> list[dict[str, Any]]:
        """The JSON payload of every SSE event of the response, in order (not `[DONE]`)."""
        payloads = []
        for frame in self.body.decode().replace("\r\n", "\n").split("\n\n"):
            data = "\n".join(
                line[len("data:") :].removeprefix(" ")
                for line in frame.split("\n")
                if line.startswith("data:")
            )
            if data and data != "[DONE]":
                payloads.append(json.loads(data))
        return payloads

    @property
    def streamed(self) -> bool:
        return self.content_type.startswith("text/event-stream")

    def done(self) -> bool:
        """The stream reached its end: `[DONE]`, `message_stop`, or a final Responses event."""
        if self.path.endswith("/completions"):
            return self.body.rstrip().endswith(b"data: [DONE]")
        kinds = [event["type"] for event in self.events()]
        if self.path.endswith("/messages"):
            return kinds[-1:] == ["message_stop"]
        return kinds[-1:] in (["response.completed"], ["response.incomplete"])

    def text(self) -> str:
        """The answer's text as the stream sent it (every dialect's text deltas, joined)."""
        parts = []
        for event in self.events():
            for choice in event.get("choices", []):
                parts.append(choice.get("delta", {}).get("content") or choice.get("text") or "")
            if event.get("type") == "content_block_delta":
                parts.append(event["delta"].get("text", ""))
            elif event.get("type") == "response.output_text.delta":
                parts.append(event["delta"])
        return "".join(parts)

    def finish(self) -> str | None:
        """Why the answer ended, as the stream said: a Chat Completions finish_reason, an
        Anthropic stop_reason, or the Responses status (`completed`, `incomplete`)."""
        reason = None
        for event in self.events():
            for choice in event.get("choices", []):
                reason = choice.get("finish_reason") or reason
            if event.get("type") == "message_delta":
                reason = event["delta"].get("stop_reason") or reason
            elif event.get("type") in ("response.completed", "response.incomplete"):
                reason = event["response"]["status"]
        return reason

    def tool_arguments(self) -> str:
        """The arguments of the stream's tool call as the stream sent them (joined deltas)."""
        parts = []
        for event in self.events():
            for choice in event.get("choices", []):
                for call in choice.get("delta", {}).get("tool_calls") or []:
                    parts.append(call.get("function", {}).get("arguments") or "")
            if event.get("type") == "content_block_delta":
                parts.append(event["delta"].get("partial_json", ""))
            elif event.get("type") == "response.function_call_arguments.delta":
                parts.append(event["delta"])
        return "".join(parts)

    def keepalives_before_first_token(self) -> int:
        """Keep-alive events before the first generated token (text, call arguments or the end):
        Chat Completions empty chunks, Completions empty texts, and Anthropic `ping`s and
        Responses `response.in_progress` events beyond the one each stream opens with (after
        `message_start`, `response.created`). Events that open the answer before its first
        token (the role chunk, a forced call's name, `content_block_start`, `output_item.added`)
        are neither."""
        count = 0
        for event in self.events():
            kind = event.get("type") or event.get("object")
            if kind in ("chat.completion.chunk", "text_completion"):
                choices = event["choices"]
                if any(_has_token(choice) for choice in choices):
                    return count
                count += bool(choices) and all(_is_keepalive(choice) for choice in choices)
            elif kind in ("ping", "response.in_progress"):
                count += 1
            elif kind in ("content_block_delta", "message_delta") or kind.endswith(
                (".delta", "response.completed", "response.incomplete", "response.failed")
            ):
                return count - 1  # the one every Anthropic and Responses stream opens with
        raise AssertionError(f"no token in the stream of {self.path}")


def _has_token(choice: dict[str, Any]) -> bool:
    delta = choice.get("delta", {"content": choice.get("text")})
    calls = delta.get("tool_calls") or []
    return bool(
        choice.get("finish_reason")
        or delta.get("content")
        or any(call.get("function", {}).get("arguments") for call in calls)
    )


def _is_keepalive(choice: dict[str, Any]) -> bool:
    return choice.get("delta", {"content": choice.get("text")}) in ({}, {"content": ""})


class _Connection:
    def __init__(self) -> None:
        self.sent: list[tuple[int, bytes]] = []  # (sequence number, bytes) client -> server
        self.received: list[tuple[int, bytes]] = []  # server -> client


class Relay:
    """A TCP relay on a free loopback port in front of the server: every connection is piped
    through unchanged, and its bytes in both directions are kept, numbered in arrival order."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.connections: list[_Connection] = []
        self.lock = threading.Lock()
        self.sequence = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            connection = _Connection()
            with self.lock:
                self.connections.append(connection)
            for source, sink, kept in (
                (client, upstream, connection.sent),
                (upstream, client, connection.received),
            ):
                threading.Thread(target=self._pipe, args=(source, sink, kept), daemon=True).start()

    def _pipe(
        self, source: socket.socket, sink: socket.socket, kept: list[tuple[int, bytes]]
    ) -> None:
        try:
            while data := source.recv(65536):
                with self.lock:
                    self.sequence += 1
                    kept.append((self.sequence, data))
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)
            source.close()

    def mark(self) -> int:
        with self.lock:
            return self.sequence

    def exchanges(self, since: int = 0) -> list[Exchange]:
        """Every request and response that crossed the relay after `since` (a `mark()`), in the
        order the requests were sent."""
        found: list[tuple[int, Exchange]] = []
        with self.lock:
            connections = [(list(c.sent), list(c.received)) for c in self.connections]
        for sent, received in connections:
            requests = [r for r in sent if r[0] > since]
            if not requests:
                continue
            responses = _http_messages(b"".join(d for s, d in received if s > since), True)
            for (first, head, body), response in zip(
                _numbered_requests(requests), responses, strict=False
            ):
                method, path, _ = head.split(" ", 2)
                status_line, headers, response_body = response
                status = int(status_line.split(" ")[1])
                content_type = headers.get("content-type", "")
                exchange = Exchange(method, path, body, status, content_type, response_body)
                found.append((first, exchange))
        return [exchange for _, exchange in sorted(found, key=lambda item: item[0])]

    def close(self) -> None:
        self.listener.close()


def _numbered_requests(segments: list[tuple[int, bytes]]) -> list[tuple[int, str, bytes]]:
    """The requests in a connection's bytes (request line, body), each with the sequence number
    of the segment it starts in."""
    offsets = list(itertools.accumulate((len(d) for _, d in segments[:-1]), initial=0))
    messages = _http_messages(b"".join(d for _, d in segments), False, positions=True)
    return [
        (segments[bisect.bisect_right(offsets, start) - 1][0], head, body)
        for head, _headers, body, start in messages
    ]


def _http_messages(data: bytes, responses: bool, positions: bool = False) -> list[Any]:
    """HTTP/1.1 messages one after another (bodies by Content-Length or chunked); a response
    without either runs to the end of the data. Informational (1xx) responses are skipped."""
    messages: list[Any] = []
    offset = 0
    while offset < len(data):
        end = data.find(b"\r\n\r\n", offset)
        if end < 0:
            break
        start = offset
        lines = data[offset:end].decode("latin-1").split("\r\n")
        headers = {
            name.strip().lower(): value.strip()
            for name, value in (line.split(":", 1) for line in lines[1:])
        }
        offset = end + 4
        if headers.get("transfer-encoding", "").lower() == "chunked":
            body = bytearray()
            while True:
                line_end = data.find(b"\r\n", offset)
                if line_end < 0:
                    offset = len(data)
                    break
                size = int(data[offset:line_end].split(b";")[0], 16)
                offset = line_end + 2
                if size == 0:
                    trailer_end = data.find(b"\r\n", offset)
                    offset = len(data) if trailer_end < 0 else trailer_end + 2
                    break
                body += data[offset : offset + size]
                offset += size + 2
            body_bytes = bytes(body)
        elif "content-length" in headers:
            length = int(headers["content-length"])
            body_bytes, offset = data[offset : offset + length], offset + length
        elif responses:
            body_bytes, offset = data[offset:], len(data)
        else:
            body_bytes = b""
        if responses and lines[0].split(" ")[1].startswith("1"):
            continue
        message = (lines[0], headers, body_bytes)
        messages.append((*message, start) if positions else message)
    return messages


# The servers.


@dataclass
class Server:
    """A running mlxgate and the relay every client goes through."""

    process: subprocess.Popen[bytes]
    log_path: Path
    relay: Relay

    @property
    def root(self) -> str:
        """The Anthropic base URL (clients add /v1/messages)."""
        return f"http://127.0.0.1:{self.relay.port}"

    @property
    def v1(self) -> str:
        """The OpenAI base URL."""
        return f"{self.root}/v1"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(log_dir: Path, *flags: str, timeout_s: float = 300.0) -> Server:
    port = _free_port()
    log_path = log_dir / f"mlxgate-{port}.log"
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            [str(MLXGATE), "serve", "--port", str(port), *flags],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"mlxgate exited with {process.returncode}:\n{log_path.read_text()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0).status_code == 200:
                return Server(process, log_path, Relay(port))
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"mlxgate was not healthy in {timeout_s} s:\n{log_path.read_text()}")


def stop_server(server: Server) -> None:
    server.relay.close()
    server.process.terminate()
    try:
        server.process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()


# Keep-alives every second; no prefix reuse, so every prompt is prefilled afresh (in 256-token
# passes, with keep-alives between them, the default step sizes).
COMPAT_FLAGS = (
    "--context-length", "8192",
    "--prefix-cache-mb", "0",
    "--ping-interval-s", "1",
)  # fmt: skip


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = start_server(tmp_path_factory.mktemp("mlxgate"), *COMPAT_FLAGS)
    yield running
    stop_server(running)


@pytest.fixture(scope="session")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """mlxgate as a user starts it: keep-alives every 10 s, steps of up to 2,048 prompt tokens
    (the prefix cache off, so that the prompt is prefilled afresh)."""
    flags = ("--context-length", "8192", "--prefix-cache-mb", "0")
    running = start_server(tmp_path_factory.mktemp("mlxgate-default"), *flags)
    yield running
    stop_server(running)


class Wire:
    """What crossed a server's relay during one test."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.since = relay.mark()

    def streams(self, path: str) -> list[Exchange]:
        """The streamed exchanges on `path`; fails unless there is at least one, and each
        answered 200, ran to its end and carried a keep-alive before its first token."""
        everything = self.relay.exchanges(self.since)
        streams = [e for e in everything if e.streamed and e.path.endswith(path)]
        asked = [(e.method, e.path, e.status, e.content_type) for e in everything]
        assert streams, f"no stream on {path}; the client asked {asked}"
        for stream in streams:
            assert stream.status == 200, stream.body[:500]
            assert stream.done(), f"{path}: the stream did not end: {stream.body[-500:]!r}"
            assert stream.keepalives_before_first_token() >= 1, (
                f"{path}: no keep-alive before the first token (a faster machine? lengthen the "
                f"prompt): {stream.body[:1500]!r}"
            )
        return streams


@pytest.fixture
def wire(server: Server) -> Wire:
    return Wire(server.relay)
