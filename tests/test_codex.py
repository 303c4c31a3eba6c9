"""The real Codex CLI (PyPI `openai-codex-cli-bin`) against mlxgate's Responses API, offline in a
throwaway home: a tool round trip with a forced-output model in two families' own formats, and a
prompt over the context (test_agent_defaults.py runs Codex's default request on the embedded
model)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from support.agents import run_codex
from support.forced import TOOL_RESULT, Script, answer, forced_model_dir, serve_args, tool_call
from support.servers import RunningServer, metric, start_server, stop_server
from support.sessions import INSTRUCTION_TRIGGER, PATCH, SUMMARY_TRIGGER

# What the server counts of a Codex run: the prompt tokens it computed and reused, and the
# responses it answered over HTTP and over WebSockets.
RESPONSES_200 = {"route": "/v1/responses", "status": "200"}
COUNTED: dict[str, tuple[str, dict[str, str]]] = {
    "computed": ("mlxgate_engine_prefill_tokens_total", {}),
    "reused": ("mlxgate_engine_cache_hit_tokens_total", {}),
    "http": ("mlxgate_http_requests_total", RESPONSES_200),
    "websocket": ("mlxgate_websocket_responses_total", RESPONSES_200),
}


def counted(server: RunningServer) -> dict[str, float]:
    return {
        what: metric(server, name, headers=None, **labels)
        for what, (name, labels) in COUNTED.items()
    }


@dataclass
class CodexServer:
    family: str
    server: RunningServer
    nonce: str


# qwen3.5: reasoning before an XML call, replayed by Codex; gpt-oss: harmony, Codex's own models.
@pytest.fixture(scope="module", params=["qwen3.5", "gpt-oss"])
def codex_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CodexServer]:
    family = request.param
    tmp = tmp_path_factory.mktemp(f"codex-{family}")
    nonce = secrets.token_hex(8)
    command = f"echo '<{nonce}>' > nonce.txt"
    model = forced_model_dir(
        tmp,
        family,
        [
            Script(answer(family, "The nonce is written."), when=TOOL_RESULT[family]),
            Script(tool_call(family, "exec_command", {"cmd": command})),
        ],
    )
    running = start_server(tmp, *serve_args(model))
    yield CodexServer(family, running, nonce)
    stop_server(running)


@pytest.mark.parametrize("transport", ["http", "websocket"])
def test_codex_runs_the_models_exec_command_and_gets_the_answer(
    codex_server: CodexServer, transport: str, tmp_path: Path
) -> None:
    """Turn 1 calls exec_command (a namespaced tool and web_search are in the request too);
    Codex runs it and sends the output as a function_call_output; turn 2 answers. Codex resends
    turn 1's items byte for byte, reasoning included, so the second prompt reuses the first's KV.
    Over a WebSocket (`supports_websockets`) Codex first prewarms (`generate: false`), then
    sends each turn's new items only: the server's copy of the rest gives the same prompts."""
    server = codex_server.server
    before = counted(server)
    websockets = transport == "websocket"
    run = run_codex(server, "Write the nonce to the file.", tmp_path, websockets=websockets)
    assert run.returncode == 0, run.stderr + server.log()
    assert run.message() == "The nonce is written."
    assert (tmp_path / "nonce.txt").read_text().strip() == f"<{codex_server.nonce}>"
    served = {what: count - before[what] for what, count in counted(server).items()}
    # Two turns, and the prewarm over a WebSocket; Codex did not fall back to HTTP.
    assert (served["http"], served["websocket"]) == ((0, 3) if websockets else (2, 0)), served
    completed = [e["item"] for e in run.events if e["type"] == "item.completed"]
    commands = [item for item in completed if item["type"] == "command_execution"]
    assert [command["exit_code"] for command in commands] == [0]
    if codex_server.family == "qwen3.5":
        reasoning = [item["text"] for item in completed if item["type"] == "reasoning"]
        assert reasoning and all(text.strip() for text in reasoning)
    # Turn 2 reused nearly all of turn 1's prompt from the prefix cache (and turn 1 what an
    # earlier run on this server left of the same opening).
    reused, computed = served["reused"], served["computed"]
    usage = run.usage()
    print(
        f"\ncodex {codex_server.family} {transport}: reused {reused:.0f}, computed {computed:.0f}"
    )
    assert usage["cached_input_tokens"] == reused >= 0.95 * computed


def test_codex_stops_at_once_on_a_prompt_over_the_context(tmp_path: Path) -> None:
    """A 400 with `context_length_exceeded`: Codex (with its retries on) sends it once, stops
    and shows the message."""
    model = forced_model_dir(tmp_path, "qwen3", script="Hello.")
    server = start_server(tmp_path, *serve_args(model), "--context-length", "4096")
    try:
        workdir = tmp_path / "work"
        workdir.mkdir()
        run = run_codex(server, "Say hello.", workdir, retries=True)
        assert run.returncode == 1
        failure = run.failure()
        assert "prompt is too long: " in failure and "> 4096 maximum" in failure, failure
        metrics = httpx.get(f"{server.url}/metrics").text
        assert 'mlxgate_http_requests_total{route="/v1/responses",status="400"} 1.0' in metrics
    finally:
        stop_server(server)


# Codex's own compaction prompt (local compaction) and how it hands the summary back.
CODEX_COMPACTION = "You are performing a CONTEXT CHECKPOINT COMPACTION"
CODEX_SUMMARY = "Another language model started to solve this problem"


@pytest.fixture(scope="module")
def patching_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A Qwen3.5 forced model that edits with Codex's freeform `apply_patch`; asked for a
    summary (a compaction), it writes one; after the patch's result, or resumed from the
    summary, it answers."""
    tmp = tmp_path_factory.mktemp("codex-patch")
    model = forced_model_dir(
        tmp,
        "qwen3.5",
        [
            Script(answer("qwen3.5", "Resumed: the file is written."), when=SUMMARY_TRIGGER),
            Script(answer("qwen3.5", "Resumed: the file is written."), when=CODEX_SUMMARY),
            # The server asks for its summary with thinking off: the prompt closes the block.
            Script("SUMMARY: hello.txt was added.", when=INSTRUCTION_TRIGGER),
            Script(answer("qwen3.5", "SUMMARY: hello.txt was added."), when=CODEX_COMPACTION),
            Script(answer("qwen3.5", "The file is written."), when=TOOL_RESULT["qwen3.5"]),
            Script(tool_call("qwen3.5", "apply_patch", {"input": PATCH})),
        ],
    )
    running = start_server(tmp, *serve_args(model))
    yield running
    stop_server(running)


@pytest.mark.parametrize("transport", ["http", "websocket"])
def test_codex_applies_the_patch_the_model_wrote_as_a_custom_tool_call(
    patching_server: RunningServer, tmp_path: Path, transport: str
) -> None:
    """Asked for by a name Codex knows (`gpt-5.5`), the model gets Codex's freeform apply_patch
    (a custom tool with a Lark grammar); its call goes back as a `custom_tool_call` whose input
    is the patch, Codex applies it to the disk and sends the result as a
    `custom_tool_call_output`; turn 2 answers. Over HTTP and over a WebSocket."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    run = run_codex(
        patching_server,
        "Add hello.txt.",
        workdir,
        model="gpt-5.5",
        websockets=transport == "websocket",
    )
    assert run.returncode == 0, run.stderr + patching_server.log()
    assert (workdir / "hello.txt").read_text() == "Hello from the model.\n"
    assert run.message() == "The file is written."
    completed = [e["item"] for e in run.events if e["type"] == "item.completed"]
    changes = [item for item in completed if item["type"] == "file_change"]
    assert [change["status"] for change in changes] == ["completed"], run.events


@pytest.mark.parametrize("compaction", ["v2", "unsupported"])
def test_a_compaction_codex_asks_for_mid_turn_is_answered_and_the_turn_goes_on(
    patching_server: RunningServer, tmp_path: Path, compaction: str
) -> None:
    """A small `model_auto_compact_token_limit` makes Codex compact after the patch, before the
    follow-up. With remote compaction (`v2`, what Codex does with OpenAI's own provider) it sends
    `compaction_trigger` and needs exactly one `compaction` item, which it replays: the model's
    own summary, which the next prompt renders. Without, it asks for the summary in a plain
    request and sends it back as a user message. Either way the turn finishes."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    run = run_codex(
        patching_server,
        "Add hello.txt.",
        workdir,
        "-c",
        "model_auto_compact_token_limit=1000",
        model="gpt-5.5",
        provider_options=f'capabilities={{remote_compaction="{compaction}"}}',
    )
    assert run.returncode == 0, run.stderr + patching_server.log()
    assert (workdir / "hello.txt").read_text() == "Hello from the model.\n"
    # Resumed from the summary: the answer the model writes only after a compaction.
    assert run.message() == "Resumed: the file is written.", run.events
