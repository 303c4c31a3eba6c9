"""The real server (granian, embedded model) starting and stopping: 503 while the model loads,
a graceful drain on SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from support.servers import REPO, free_port, start_server
from support.sse import last_frames

DRAIN_S = 8


def _stream(
    url: str, path: str, body: dict[str, object], out: list[str], started: threading.Event
) -> None:
    with httpx.stream("POST", url + path, json=body, timeout=120) as response:
        assert response.status_code == 200
        text = ""
        for chunk in response.iter_text():
            text += chunk
            started.set()
        out.append(text)


def test_sigterm_lets_streams_finish_or_end_them_with_an_error(tmp_path: Path) -> None:
    server = start_server(tmp_path, "--drain-timeout", str(DRAIN_S))
    url = server.url
    threads, results, started = [], [], []
    for i in range(8):
        short = i % 2 == 0  # finishes within the drain; the others are ended by it
        # Past the model's own 8,192 tokens (the scaled rope) the model rambles on; with its own
        # rope it may end a story early.
        max_tokens = 12 if short else 9000
        if i < 4:
            path = "/v1/messages"
            messages = [{"role": "user", "content": f"Tell me a long story, number {i}."}]
            body: dict[str, object] = {
                "max_tokens": max_tokens,
                "stream": True,
                "messages": messages,
            }
        else:
            path = "/v1/chat/completions"
            messages = [{"role": "user", "content": f"Write a long essay, number {i}."}]
            body = {"max_tokens": max_tokens, "stream": True, "messages": messages}
        body["model"] = "m"
        out: list[str] = []
        ready = threading.Event()
        thread = threading.Thread(target=_stream, args=(url, path, body, out, ready))
        thread.start()
        threads.append((short, path, thread, out))
        started.append(ready)
        results.append(out)
    for ready in started:
        assert ready.wait(120)

    assert server.process is not None
    server.process.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    time.sleep(0.5)
    refused = httpx.post(
        url + "/v1/messages",
        json={"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    )
    assert refused.status_code == 503
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["type"] == "overloaded_error"
    health = httpx.get(url + "/health", timeout=30)
    assert (health.status_code, health.json()["status"]) == (503, "draining")

    assert server.process.wait(timeout=DRAIN_S + 20) == 0
    assert time.monotonic() - signalled < DRAIN_S + 10
    for short, path, thread, out in threads:
        thread.join(10)
        assert out, f"{path}: the stream was cut"
        text = out[0]
        if path == "/v1/messages":
            last = last_frames(text, 1)[0]
            if short:
                assert last.startswith("event: message_stop"), last
            else:
                assert last.startswith("event: error") and "shutting down" in last, last
        else:
            assert text.rstrip().endswith("data: [DONE]") or '"error"' in text, text[-300:]
            assert ('"finish_reason":"length"' in text) == short, text[-300:]
            if not short:
                assert "shutting down" in text, text[-300:]
    log = server.log()
    assert "refused to gracefully stop" not in log
    assert "stopping: 8 requests in flight" in log


def test_while_the_model_loads_health_says_loading_and_requests_get_503(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "server.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "mlxgate", "serve", "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
    )
    try:
        answers = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                health = httpx.get(url + "/health", timeout=5)
            except httpx.TransportError:
                time.sleep(0.02)
                continue
            answers.append((health.status_code, health.json()["status"]))
            if health.status_code == 200:
                break
            refused = httpx.post(url + "/v1/messages", json={"model": "m"}, timeout=5)
            try:
                connect(url.replace("http", "ws") + "/v1/responses", open_timeout=5).close()
                socket_status = 101
            except InvalidStatus as exc:
                socket_status = exc.response.status_code
            if httpx.get(url + "/health", timeout=5).status_code == 503:
                assert refused.status_code == 503
                assert refused.json()["error"]["message"] == "the model is loading"
                assert refused.headers["retry-after"] == "2"
                assert socket_status == 503
        assert answers[0] == (503, "loading"), answers
        assert answers[-1] == (200, "ok"), answers
    finally:
        process.terminate()
        process.wait(30)
