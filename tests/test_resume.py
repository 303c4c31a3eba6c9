"""Resumable streams (`--resume-window`) on the real server: streams cut at random points (at
event boundaries and mid-frame) and resumed with `GET /v1/streams/{id}` + `Last-Event-ID`
reassemble byte for byte; a stream nobody comes back for is cancelled after the window."""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, cast

import httpx
import pytest

from mlxgate._native import Reader
from mlxgate.api import resumable as resumable_streams
from mlxgate.api.errors import ApiError
from mlxgate.api.http import Message
from mlxgate.api.resumable import EventLog
from support.servers import RunningServer, start_server, stop_server

WINDOW_S = 6
CUTS = 200
MAX_TOKENS = 48
PROMPTS = [
    "Name three rivers and say one thing about each.",
    "Explain what a compiler does, in a few sentences.",
    "Write a short poem about the sea.",
]


@pytest.fixture(scope="module")
def resumable(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(tmp_path_factory.mktemp("resume"), "--resume-window", str(WINDOW_S))
    yield running
    stop_server(running)


def _request(
    dialect: str, prompt: str, max_tokens: int = MAX_TOKENS, **extra: object
) -> tuple[str, dict]:
    messages = [{"role": "user", "content": prompt}]
    common = {"model": "m", "stream": True, "temperature": 0, **extra}
    if dialect == "anthropic":
        return "/v1/messages", {**common, "max_tokens": max_tokens, "messages": messages}
    if dialect == "openai":
        return "/v1/chat/completions", {**common, "max_tokens": max_tokens, "messages": messages}
    return "/v1/responses", {**common, "max_output_tokens": max_tokens, "input": messages}


def _whole_frames(data: bytes) -> list[bytes]:
    """The complete frames (each with its blank line) at the start of `data`."""
    frames, start = [], 0
    while (end := data.find(b"\n\n", start)) >= 0:
        frames.append(data[start : end + 2])
        start = end + 2
    return frames


def _last_id(frames: list[bytes], before: int) -> int:
    """The id of the last event among `frames` (`before` if none has one), as an SSE client
    remembers it for `Last-Event-ID`."""
    for frame in reversed(frames):
        if frame.startswith(b"id: "):
            return int(frame[4 : frame.index(b"\n")])
    return before


@dataclass
class CutStream:
    """One stream read over several connections, each cut at a random point."""

    rng: random.Random
    frames: list[bytes] = field(default_factory=list)
    cuts: int = 0

    def read(self, response: httpx.Response) -> bool:
        """Read until a cut (True) or the stream's end (False); keep the whole frames read."""
        keep = self.rng.randint(0, 6)
        mid_frame = self.rng.random() < 0.5
        data = b""
        for chunk in response.iter_raw():
            data += chunk
            whole = _whole_frames(data)
            if len(whole) > keep:  # the frame to cut at, or inside, is in
                cut_at = sum(map(len, whole[:keep]))
                if mid_frame:
                    cut_at += self.rng.randint(1, len(whole[keep]) - 1)
                self.frames += _whole_frames(data[:cut_at])
                self.cuts += 1
                return True
        self.frames += _whole_frames(data)
        return False


def _run_cut(
    url: str, dialect: str, prompt: str, seed: int, **extra: Any
) -> tuple[bytes, bytes, int]:
    """A stream cut and resumed until it ends: what the client reassembled, what the server
    holds of the stream (replayed from the start), and the number of cuts."""
    stream = CutStream(random.Random(seed))
    path, body = _request(dialect, prompt, **extra)
    with httpx.Client(base_url=url, timeout=120) as client:
        with client.stream("POST", path, json=body) as response:
            assert response.status_code == 200
            stream_id = response.headers["request-id"]
            cut = stream.read(response)
        while cut:
            last = _last_id(stream.frames, 0)
            headers = {"last-event-id": str(last)}
            with client.stream("GET", f"/v1/streams/{stream_id}", headers=headers) as response:
                assert response.status_code == 200, response.read()
                cut = stream.read(response)
        record = client.get(f"/v1/streams/{stream_id}", headers={"last-event-id": "0"})
        assert record.status_code == 200, record.text
    return b"".join(stream.frames), record.content, stream.cuts


def _uncut(url: str, dialect: str, prompt: str) -> bytes:
    path, body = _request(dialect, prompt)
    response = httpx.post(url + path, json=body, timeout=120)
    assert response.status_code == 200
    return response.content


# What differs between two runs of one request: ids, clocks and how much of the prompt was cached.
_VARYING = re.compile(
    rb'"(?:msg|chatcmpl|resp|rs|fc|call)[_-][0-9A-Za-z]+"'
    rb'|"(?:created|created_at|cache_read_input_tokens|cache_creation_input_tokens|input_tokens'
    rb'|cached_tokens)":\d+'
)


# A message_delta says the input again where the prompt reused more than message_start said
# (another run of the same prompt was prefilling it): one run may, the other not.
_REUSED_LATER = re.compile(rb'"input_tokens":\d+,"cache_read_input_tokens":\d+,(?="output_tokens")')


def _same_run(stream: bytes) -> bytes:
    return _VARYING.sub(b"_", _REUSED_LATER.sub(b"", stream))


def test_streams_cut_at_random_points_reassemble_byte_identical(
    resumable: RunningServer,
) -> None:
    url = resumable.url
    kinds = [
        (dialect, prompt) for dialect in ("anthropic", "openai", "responses") for prompt in PROMPTS
    ]

    def cut(job: tuple[tuple[str, str], int]) -> tuple[tuple[str, str], tuple[bytes, bytes, int]]:
        return job[0], _run_cut(url, *job[0], job[1])

    with ThreadPoolExecutor(4) as pool:
        uncut = dict(zip(kinds, pool.map(lambda kind: _uncut(url, *kind), kinds), strict=True))
        cuts, seed = 0, 0
        while cuts < CUTS:
            batch = [(kinds[(seed + i) % len(kinds)], seed + i) for i in range(4)]
            seed += 4
            runs = pool.map(cut, batch)
            for kind, (reassembled, record, made) in runs:
                assert reassembled == record, kind  # nothing lost, nothing twice, byte for byte
                ids = [int(f[4 : f.index(b"\n")]) for f in _whole_frames(record)]
                assert ids == list(range(1, len(ids) + 1)), kind
                assert _same_run(record) == _same_run(uncut[kind]), kind  # as if never cut
                cuts += made
    assert cuts >= CUTS
    health = httpx.get(url + "/health", timeout=10)
    assert health.status_code == 200


def _choice_texts(stream: bytes) -> dict[int, str]:
    texts: dict[int, str] = {}
    for frame in _whole_frames(stream):
        data = frame.split(b"\ndata: ", 1)[1].strip()
        if data != b"[DONE]":
            for choice in json.loads(data)["choices"]:
                texts[choice["index"]] = texts.get(choice["index"], "") + (
                    choice["delta"].get("content") or ""
                )
    return texts


def test_choices_merged_into_one_stream_resume_too(resumable: RunningServer) -> None:
    """OpenAI's n > 1: the choices' chunks interleave as they come; cut and resumed, each
    choice reads as it does uncut."""
    alone = _choice_texts(_uncut(resumable.url, "openai", PROMPTS[2]))[0]
    for seed in range(3):
        reassembled, record, cuts = _run_cut(resumable.url, "openai", PROMPTS[2], seed, n=2)
        assert reassembled == record and cuts > 0
        assert _choice_texts(reassembled) == {0: alone, 1: alone}


def test_a_stream_nobody_resumes_is_cancelled_after_the_window(
    resumable: RunningServer,
) -> None:
    # Past the model's own 8,192 tokens (the scaled rope): it rambles on, as a short prompt with its
    # own rope does not.
    path, body = _request("anthropic", "Tell me a long story, number 1.", max_tokens=9000)
    with httpx.stream("POST", resumable.url + path, json=body, timeout=120) as response:
        stream_id = response.headers["request-id"]
        next(response.iter_raw())
    # Within the window the stream goes on: it can be resumed from the start.
    with httpx.stream("GET", f"{resumable.url}/v1/streams/{stream_id}", timeout=120) as response:
        assert response.status_code == 200
        assert next(response.iter_raw()).startswith(b"id: 1\nevent: message_start")
    time.sleep(WINDOW_S + 3)
    gone = httpx.get(
        f"{resumable.url}/v1/streams/{stream_id}",
        headers={"anthropic-version": "2023-06-01"},
        timeout=10,
    )
    assert gone.status_code == 404
    assert gone.json()["error"]["type"] == "not_found_error"
    deadline = time.monotonic() + 10
    while f"[{stream_id}]" not in resumable.log() and time.monotonic() < deadline:
        time.sleep(0.2)
    line = next(line for line in resumable.log().splitlines() if f"[{stream_id}]" in line)
    assert " cancelled: " in line, line  # its generation ended with the window, not at 9000


def test_bad_reconnects_are_refused_in_the_clients_dialect(resumable: RunningServer) -> None:
    url = resumable.url
    unknown = httpx.get(f"{url}/v1/streams/req_nothing", timeout=10)
    assert unknown.status_code == 404
    assert unknown.json()["error"]["message"].startswith("no stream 'req_nothing' to resume")
    path, body = _request("openai", PROMPTS[1], max_tokens=4)
    finished = httpx.post(url + path, json=body, timeout=60)
    stream_id = finished.headers["request-id"]
    for last, status in (("x", 400), ("99", 400), ("-1", 400)):
        response = httpx.get(
            f"{url}/v1/streams/{stream_id}", headers={"last-event-id": last}, timeout=10
        )
        assert response.status_code == status, (last, response.text)
        assert response.json()["error"]["type"] == "invalid_request_error"
    replay = httpx.get(f"{url}/v1/streams/{stream_id}", headers={"last-event-id": "2"})
    assert replay.status_code == 200
    assert replay.content == finished.content[finished.content.index(b"id: 3\n") :]


def test_without_a_window_nothing_is_kept(server: RunningServer) -> None:
    response = httpx.get(f"{server.url}/v1/streams/req_x", timeout=10)
    assert response.status_code == 404
    assert "is not a route" in response.json()["error"]["message"]


class _Connection:
    """An ASGI connection that keeps what is sent and leaves when told."""

    def __init__(self) -> None:
        self.body = b""
        self.gone = asyncio.Event()

    async def send(self, message: Message) -> None:
        self.body += message.get("body", b"")

    async def receive(self) -> Message:
        await self.gone.wait()
        return {"type": "http.disconnect"}


class _Generation:
    """What a log cancels when its window passes with nobody following."""

    def cancel(self) -> None:
        pass


@pytest.mark.anyio
async def test_the_log_holds_a_bounded_amount(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unsent, the generation waits at the bound (and the engine's stall rule ends it); sent,
    the oldest events go first, and a reconnect that needs them is told they are gone."""
    monkeypatch.setattr(resumable_streams, "BUFFER_BYTES", 100)
    forgotten: list[str] = []
    log = EventLog("req_1", cast(Reader, _Generation()), 0.05, forgotten.append)
    # As a reader hands them out: each event numbered, with the id of the chunk's last one.
    frames = [(b"id: %d\ndata: %02d-padding-padding\n\n" % (i + 1, i), i + 1) for i in range(12)]
    for frame in frames[:4]:  # 4 x 33 bytes: past the bound
        await log.append(*frame)
    blocked = asyncio.ensure_future(log.append(*frames[4]))
    await asyncio.sleep(0.01)
    assert not blocked.done()

    connection = _Connection()
    following = asyncio.ensure_future(log.follow(connection.send, connection.receive, 0))
    await asyncio.wait_for(blocked, 1)  # handed out: room again
    for frame in frames[5:]:
        await log.append(*frame)
    log.close()
    await asyncio.wait_for(following, 1)
    assert connection.body == b"".join(data for data, _ in frames)

    with pytest.raises(ApiError, match="no longer holds the events after 0"):
        log.replay_from(0)
    again = _Connection()
    await log.follow(again.send, again.receive, log.replay_from(10), skip_to=11)
    assert again.body == frames[10][0] + frames[11][0]
    await asyncio.sleep(0.1)
    assert forgotten == ["req_1"]  # the window after the last connection left
