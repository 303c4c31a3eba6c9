"""Agent traces: recorded by the real server (`--record-trace`), read back in session order, and
replayed by `mlxgate bench --scenarios agent` against the server."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from mlxgate.api.openai.requests import ChatCompletionRequest
from mlxgate.bench.records import Record
from mlxgate.bench.replay import replayable
from mlxgate.bench.run import read_records
from mlxgate.bench.to_chat import to_chat
from mlxgate.cli import main as cli_main
from mlxgate.trace import Recorder, read, session_of, sessions
from support.servers import start_server, stop_server

ROOT = Path(__file__).resolve().parent.parent


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

        def replay(target: str, sessions: int, out: Path) -> list[Record]:
            cli_main(
                [
                    "bench", "--target", target, "--scenarios", "agent", "--trace",
                    str(replayed), "--sessions", str(sessions), "--out", str(out),
                ]
            )  # fmt: skip
            return read_records(out / "records.jsonl")

        out = tmp_path / "run"
        records = replay(f"local={url}", 3, out)
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

        # A server that speaks only chat completions gets the same sessions as such.
        records = replay(f"local={url},trace=chat", 2, tmp_path / "as-chat")
        assert sorted((r.session, r.index, r.dialect) for r in records) == [
            ("0", 0, "openai"), ("0", 1, "openai"), ("1", 0, "openai"),
        ]  # fmt: skip
        assert all(r.ok and r.output_tokens for r in records)
    finally:
        stop_server(server)


def test_an_anthropic_turn_becomes_the_same_chat_completion() -> None:
    body = {
        "model": "claude", "max_tokens": 64, "stream": True, "temperature": 0.5,
        "stop_sequences": ["END"],
        "system": [
            {"type": "text", "text": "You are terse."}, {"type": "text", "text": " Be kind."},
        ],
        "tools": [
            {"name": "Bash", "description": "Run a command.",
             "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}},
            {"type": "web_search_20250305", "name": "web_search"},  # a server tool: no schema
        ],
        "messages": [
            {"role": "user", "content": "List the files."},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "ls will do", "signature": "x"},
                {"type": "text", "text": "Listing."},
                {"type": "tool_use", "id": "t1", "name": "Bash", "input": {"command": "ls"}},
                {"type": "tool_use", "id": "t2", "name": "Bash", "input": {"command": "pwd"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1",
                 "content": [{"type": "text", "text": "a.py"}]},
                {"type": "tool_result", "tool_use_id": "t2", "content": "/work"},
                {"type": "text", "text": "Now summarise."},
            ]},
        ],
    }  # fmt: skip
    calls = [
        {"id": "t1", "type": "function",
         "function": {"name": "Bash", "arguments": '{"command": "ls"}'}},
        {"id": "t2", "type": "function",
         "function": {"name": "Bash", "arguments": '{"command": "pwd"}'}},
    ]  # fmt: skip
    assert to_chat("anthropic", body) == {
        "model": "claude", "max_tokens": 64, "stream": True, "temperature": 0.5, "stop": ["END"],
        "tools": [{"type": "function", "function": {
            "name": "Bash", "description": "Run a command.",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        }}],
        "messages": [
            {"role": "system", "content": "You are terse.\n\n Be kind."},  # as mlxgate joins them
            {"role": "user", "content": "List the files."},
            {"role": "assistant", "content": "Listing.", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "t1", "content": "a.py"},
            {"role": "tool", "tool_call_id": "t2", "content": "/work"},
            {"role": "user", "content": "Now summarise."},
        ],
    }  # fmt: skip


def test_a_responses_turn_becomes_the_same_chat_completion() -> None:
    body = {
        "model": "gpt", "max_output_tokens": 32, "stream": True, "instructions": "Be brief.",
        "tools": [
            {"type": "function", "name": "shell", "parameters": {"type": "object"}},
            {"type": "web_search"},
        ],
        "input": [
            {"type": "message", "role": "developer",
             "content": [{"type": "input_text", "text": "Sandbox: none."}]},
            {"role": "user", "content": "Where am I?"},
            {"type": "reasoning", "summary": [], "encrypted_content": "x"},
            {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": '{"a":1}'},
            {"type": "function_call", "call_id": "c2", "name": "shell", "arguments": '{"a":2}'},
            {"type": "function_call_output", "call_id": "c1", "output": "one"},
            {"type": "function_call_output", "call_id": "c2", "output": "two"},
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "Done."}]},
        ],
    }  # fmt: skip
    assert to_chat("responses", body) == {
        "model": "gpt", "max_tokens": 32, "stream": True,
        "tools": [{"type": "function", "function": {
            "name": "shell", "description": "", "parameters": {"type": "object"},
        }}],
        "messages": [
            {"role": "system", "content": "Be brief.\n\nSandbox: none."},
            {"role": "user", "content": "Where am I?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "shell", "arguments": '{"a": 1}'}},
                {"id": "c2", "type": "function",
                 "function": {"name": "shell", "arguments": '{"a": 2}'}},
            ]},
            {"role": "tool", "tool_call_id": "c1", "content": "one"},
            {"role": "tool", "tool_call_id": "c2", "content": "two"},
            {"role": "assistant", "content": "Done."},
        ],
    }  # fmt: skip


SHIPPED = sorted(path.name for path in (ROOT / "benches" / "traces").glob("*.jsonl"))


@pytest.mark.parametrize("name", SHIPPED)
def test_the_shipped_traces_replay_as_chat_completions_the_server_takes(name: str) -> None:
    """Custom tool calls and their outputs, compactions, tool_reference results and system
    messages mid-conversation included (the *-session traces)."""
    turns = read(ROOT / "benches" / "traces" / name)
    assert turns
    for turn in turns:
        dialect, body = replayable(turn, "m", 64, chat=True)
        request = ChatCompletionRequest.model_validate(body)
        assert dialect == "openai" and request.max_tokens == 64 and request.tools
        assert body["stream_options"] == {"include_usage": True}
        # Every tool call is answered, right after the assistant message that made it.
        asked = [c["id"] for m in body["messages"] for c in m.get("tool_calls", ())]
        answered = [m["tool_call_id"] for m in body["messages"] if m["role"] == "tool"]
        assert asked == answered
