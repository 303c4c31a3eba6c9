"""Whole agent sessions (support/sessions.py): the real Claude Code through its auto-compaction and
Codex through a remote compaction, each going on after it; and their recordings
(benches/traces/*-session.jsonl) replayed turn by turn against a fresh server, each turn's
prompt read from the prefix cache as far as it matches an earlier one."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from mlxgate import prompts
from mlxgate.api.anthropic import requests as anthropic
from mlxgate.api.responses import requests as responses
from mlxgate.bench.replay import replay
from mlxgate.trace import Turn, read
from support import sessions
from support.forced import forced_model_dir, serve_args, tokenizer
from support.servers import RunningServer, start_server, stop_server

ROOT = Path(__file__).resolve().parent.parent
# What each agent's sessions are served by: its forced model's family and scripts.
MODELS = {
    "claude-code": (sessions.CLAUDE_CODE_FAMILY, sessions.CLAUDE_CODE_SCRIPTS),
    "codex": (sessions.CODEX_FAMILY, sessions.CODEX_SCRIPTS),
}
# The share of a turn's prompt the prefix cache must supply when the agent sent the turns
# before it unchanged.
CACHED_SHARE = 0.95


def serve(agent: str, tmp: Path, *extra: str) -> RunningServer:
    family, scripts = MODELS[agent]
    return start_server(tmp, *serve_args(forced_model_dir(tmp, family, scripts)), *extra)


def text_of(content: str | list[dict[str, Any]]) -> str:
    """A Messages API message's text (its text blocks, joined)."""
    if isinstance(content, str):
        return content
    return "".join(block.get("text", "") for block in content)


def compacting(turn: Turn) -> bool:
    """The request asks for a summary of the conversation: Claude Code's last user text, or
    Codex's `compaction_trigger`."""
    if turn.path == "/v1/messages":
        last = turn.body["messages"][-1]
        content = last["content"]
        text = content if isinstance(content, str) else text_of(content[-1:])
        return last["role"] == "user" and text.startswith(sessions.CLAUDE_CODE_COMPACTION)
    return turn.body["input"][-1].get("type") == "compaction_trigger"


def print_shares(title: str, rows: list[tuple[int, int, str]]) -> None:
    """Each request's prompt and cached tokens (and what it was), as the output of `-s`."""
    print(f"\n{title}")
    for number, (prompt, cached, kind) in enumerate(rows):
        print(f"  {number}: {cached:>6} of {prompt:>6} cached ({cached / prompt:6.1%}) {kind}")


def test_claude_code_compacts_and_the_session_goes_on(tmp_path: Path) -> None:
    """Claude Code compacts on its own side: before each request it adds the usage the server
    last reported to an estimate of the new messages, and over its threshold (with `--model
    local`: CLAUDE_CODE_MAX_CONTEXT_TOKENS less its reserves) it first asks for a summary in a
    plain request ("CRITICAL: Respond with TEXT ONLY", `<analysis>` then `<summary>`), then
    sends the turn again with the summary in place of the conversation. The model answers
    that turn only when its prompt starts with the summary ("This session is being
    continued"); the session goes on with `-c` after it. Before, a ToolSearch loads the
    deferred CronList (a `tool_reference` rendered as its definition) and the model calls it;
    then a Bash call: a few rounds of history to summarize."""
    trace = tmp_path / "trace.jsonl"
    server = serve("claude-code", tmp_path, "--record-trace", str(trace))
    workdir = tmp_path / "work"
    workdir.mkdir()
    try:
        results = sessions.claude_code_session(server, workdir)
        served = sessions.served(server)
    finally:
        stop_server(server)
    assert [r["result"] for r in results] == [
        "There are no cron jobs.",
        "Counted to sixty.",
        sessions.CLAUDE_CODE_RESUMED,
        "Goodbye.",
    ], results
    turns = read(trace)
    kinds = ["compaction" if compacting(t) else "" for t in turns]
    assert kinds.count("compaction") == 1, kinds
    asked = kinds.index("compaction")
    # The summary the model wrote (its <summary> block) opens the request after it, which
    # the model answered (the third run's result above).
    first = text_of(turns[asked + 1].body["messages"][0]["content"])
    assert first.startswith(sessions.CLAUDE_CODE_CONTINUED), first[:200]
    assert f"Summary:\n{sessions.CLAUDE_CODE_SUMMARY}" in first, first
    # The tool search before: CronList declared (deferred) once ToolSearch found it.
    loaded = [
        t.turn
        for t in turns
        if any(tool["name"] == "CronList" and tool.get("defer_loading") for tool in t.body["tools"])
    ]
    assert loaded and loaded[0] > 0 and loaded == list(range(loaded[0], len(turns)))
    kinds[asked + 1] = "after the compaction"
    rows = [(s.prompt_tokens, s.cached_tokens, k) for s, k in zip(served, kinds, strict=True)]
    print_shares("Claude Code, live:", rows)


def test_codex_compacts_mid_turn_and_the_session_goes_on(tmp_path: Path) -> None:
    """Codex (`gpt-5.5`: the freeform apply_patch; remote compaction V2) over three runs of one
    session (`codex exec`, then `exec resume --last`): the patch applied and answered; a
    command whose output puts the session over `model_auto_compact_token_limit`, so Codex
    compacts mid-turn (`compaction_trigger`, answered with one `compaction` item) and sends
    the turn on from the summary; a last turn after it."""
    trace = tmp_path / "trace.jsonl"
    server = serve("codex", tmp_path, "--record-trace", str(trace))
    workdir = tmp_path / "work"
    workdir.mkdir()
    try:
        runs = sessions.codex_session(server, workdir)
        served = sessions.served(server)
    finally:
        stop_server(server)
    assert [run.message() for run in runs] == [
        "The file is written.",
        sessions.CODEX_RESUMED,
        "Goodbye.",
    ]
    assert (workdir / "hello.txt").read_text() == "Hello from the model.\n"
    turns = read(trace)
    assert len({t.session for t in turns}) == 1, "resumed runs are the same session"
    kinds = ["compaction" if compacting(t) else "" for t in turns]
    assert kinds.count("compaction") == 1, kinds
    asked = kinds.index("compaction")
    items = [item.get("type") for item in turns[asked].body["input"]]
    assert "custom_tool_call" in items and "custom_tool_call_output" in items, items
    # Every later request carries the compaction item the server wrote.
    for turn in turns[asked + 1 :]:
        assert [i for i in turn.body["input"] if i.get("type") == "compaction"], turn.body
    kinds[asked + 1] = "after the compaction"
    rows = [(s.prompt_tokens, s.cached_tokens, k) for s, k in zip(served, kinds, strict=True)]
    print_shares("Codex, live:", rows)


def prompt_ids(renderer: prompts.Renderer, turn: Turn) -> list[int]:
    """The prompt the server renders for a recorded turn (its dialect's own conversion)."""
    if turn.path == "/v1/messages":
        request = anthropic.MessagesRequest.model_validate(turn.body)
        return renderer.render(anthropic.conversation(request)).ids
    asked = responses.ResponsesRequest.model_validate(turn.body)
    return renderer.render(responses.conversation(asked, [], responses.tools(asked))).ids


def shared(prompt: list[int], earlier: list[list[int]]) -> int:
    """How many of the prompt's first tokens an earlier prompt has too (the most of any)."""
    most = 0
    for other in earlier:
        same = 0
        for a, b in zip(prompt, other, strict=False):
            if a != b:
                break
            same += 1
        most = max(most, same)
    return most


@pytest.mark.parametrize("agent", ["claude-code", "codex"])
def test_a_recorded_session_replays_from_the_prefix_cache(agent: str, tmp_path: Path) -> None:
    """The recorded session, each turn's body as sent, replayed in order by `mlxgate bench`'s
    replayer against a fresh server with the same model: every turn after the first reads
    from the prefix cache all of its prompt that an earlier prompt shares (the engine caches
    prompts, so all but the earlier prompt's last token when it is the whole earlier prompt),
    and at least 95% of it on every turn but Claude Code's rewrites around its compaction: its
    summary request adds ~1.4k tokens of instructions, and after it the conversation starts
    over from the summary right after the system prompt and tools; there what the prompt
    shares with an earlier one is all that can be reused. Codex's turn after its compaction
    holds 95% too: it moves its context messages after the first user message, and they join
    the instructions wherever they come before the model's first turn."""
    turns = read(ROOT / "benches" / "traces" / f"{agent}-session.jsonl")
    assert len({t.session for t in turns}) == 1
    server = serve(agent, tmp_path)
    try:
        records = asyncio.run(replay(server.url, [turns], 1))
    finally:
        stop_server(server)
    records.sort(key=lambda r: r.index)
    assert [r.index for r in records] == [t.turn for t in turns]
    assert all(r.ok for r in records), [r.error for r in records]

    renderer = prompts.Renderer(tokenizer(MODELS[agent][0]))
    sent = [prompt_ids(renderer, turn) for turn in turns]
    # The turns Claude Code rewrites (the server's own summary instruction, which Codex's
    # compaction gets, is ~100 tokens).
    rewritten = {"after the compaction", "compaction"} if agent == "claude-code" else set()
    rows = []
    kind = ""
    for number, (turn, record, prompt) in enumerate(zip(turns, records, sent, strict=True)):
        assert record.input_tokens == len(prompt), "the server renders the prompt as here"
        cached = record.cached_tokens or 0
        reusable = shared(prompt, sent[:number])
        kind = (
            "compaction"
            if compacting(turn)
            else "after the compaction"
            if kind == "compaction"
            else ""
        )
        assert cached >= reusable - 1, (number, cached, reusable)
        if number and kind not in rewritten:
            assert cached >= CACHED_SHARE * len(prompt), (number, cached, len(prompt))
        shares = f" (shares {reusable} tokens with an earlier prompt)" if kind else ""
        rows.append((len(prompt), cached, kind + shares))
    print_shares(f"{agent}-session.jsonl, replayed:", rows)
