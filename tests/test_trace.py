"""Agent traces: recorded by the real server (`--record-trace`), read back in session order, and
replayed by `mlxgate bench --scenarios agent` against the server."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx

from conftest import start_server, stop_server
from mlxgate.bench.run import read_records
from mlxgate.cli import main as cli_main
from mlxgate.trace import Recorder, read, session_of, sessions


def test_a_recorder_keeps_sessions_turns_and_the_time_between_them(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    recorder = Recorder(path)
    recorder.started("a", "/v1/messages", b'{"turn": 0}')
    recorder.started("b", "/v1/responses", b'{"turn": 0}')
    recorder.ended("a")
    time.sleep(0.05)
    recorder.started("a", "/v1/messages", b'{"turn": 1}')
    recorder.started("a", "/v1/messages", b"{not json")  # refused by the server: not kept
    a, b = sessions(read(path))
    assert [(t.session, t.turn, t.body) for t in a] == [
        ("a", 0, {"turn": 0}),
        ("a", 1, {"turn": 1}),
    ]
    assert a[0].after_s is None and a[1].after_s is not None and a[1].after_s >= 0.05
    assert a[1].at_s >= a[1].after_s
    assert [(t.session, t.path) for t in b] == [("b", "/v1/responses")]


def test_the_session_is_the_agents_header_else_the_client() -> None:
    assert session_of([(b"x-claude-code-session-id", b"cc-1")], "127.0.0.1") == "cc-1"
    assert session_of([(b"session_id", b"codex-1"), (b"host", b"x")], "127.0.0.1") == "codex-1"
    assert session_of([(b"host", b"x")], "127.0.0.1") == "client:127.0.0.1"


def test_a_trace_recorded_by_the_server_replays_against_it(tmp_path: Path) -> None:
    trace = tmp_path / "agents.jsonl"
    server = start_server(tmp_path, "--record-trace", str(trace))
    try:
        url = server.url
        question = [{"role": "user", "content": "Name a colour."}]
        claude = {"x-claude-code-session-id": "cc-1", "anthropic-version": "2023-06-01"}
        for max_tokens in (8, 12):
            body = {"model": "m", "max_tokens": max_tokens, "stream": True, "messages": question}
            assert httpx.post(url + "/v1/messages", json=body, headers=claude).status_code == 200
        codex = {"session_id": "codex-1"}
        body = {"model": "m", "max_output_tokens": 8, "stream": True, "input": question}
        assert httpx.post(url + "/v1/responses", json=body, headers=codex).status_code == 200
        count = {"model": "m", "messages": question}  # counting generates nothing: not kept
        httpx.post(url + "/v1/messages/count_tokens", json=count, headers=claude)

        recorded = sessions(read(trace))
        assert [[(t.session, t.turn, t.path) for t in s] for s in recorded] == [
            [("cc-1", 0, "/v1/messages"), ("cc-1", 1, "/v1/messages")],
            [("codex-1", 0, "/v1/responses")],
        ]
        assert recorded[0][1].body["max_tokens"] == 12 and recorded[0][1].after_s is not None

        recording = trace.read_bytes()  # the server records the replay too: replay a copy
        replayed = tmp_path / "replayed.jsonl"
        replayed.write_bytes(recording)
        out = tmp_path / "run"
        cli_main(
            [
                "bench", "--target", f"local={url}", "--scenarios", "agent",
                "--trace", str(replayed), "--sessions", "3", "--out", str(out),
            ]
        )  # fmt: skip
        records = read_records(out / "records.jsonl")
        # Sessions 0 and 2 replay cc-1 (two turns), session 1 replays codex-1.
        assert sorted((r.session, r.index, r.dialect) for r in records) == [
            ("0", 0, "anthropic"), ("0", 1, "anthropic"), ("1", 0, "responses"),
            ("2", 0, "anthropic"), ("2", 1, "anthropic"),
        ]  # fmt: skip
        assert all(r.ok and r.output_tokens for r in records)
        summary = json.loads((out / "summary.json").read_text())
        (agent,) = [r for r in summary["runs"] if r["scenario"] == "agent"]
        assert agent["requests"] == 5 and len(agent["turn_ttft_s_p50"]) == 2
        assert agent["cached_share"] > 0  # the second turn and the repeated sessions reuse KV
        assert "TTFT p50 by turn" in (out / "report.md").read_text()
        assert summary["plots"] == ["turns.png"]
        assert (out / "turns.png").read_bytes().startswith(b"\x89PNG")
    finally:
        stop_server(server)
