"""The real agents with their default settings against the embedded model as `make serve` serves
it (32k tokens of context, YaRN over SmolLM2's 8k, the sampling its card recommends with a
repetition penalty, the loop guard): Codex's default first request (~10k tokens) and Claude
Code's (~12.8k) fit and are answered, Claude Code's first turn ends with an answer, and its next
turn (`-c`) reuses the cached prefix. A server that caps replies (`--max-output-tokens`) gives
Codex, which asks for no limit, and Claude Code, which asks for 128,000, the cap.

Codex's reply from a 135M model at 4x its own context may still run to the cap: Codex then
reports the response incomplete, a fact about the model that the test accepts."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import pytest

from support.agents import run_claude_code, run_codex
from support.servers import RunningServer, metric, start_server, stop_server

REPLY_LIMIT = 64


# As `make serve` samples: the model's own defaults (conftest's servers are greedy).
AS_MAKE_SERVE = ("--sampling-defaults", "model")
# A reply of "a short sentence" that runs past this has repeated itself.
ENDED_WITHIN = 2000


@pytest.fixture(scope="module")
def embedded_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(
        tmp_path_factory.mktemp("agents"), *AS_MAKE_SERVE, "--max-output-tokens", str(REPLY_LIMIT)
    )
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def served_as_make_serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(tmp_path_factory.mktemp("make-serve"), *AS_MAKE_SERVE)
    yield running
    stop_server(running)


def test_a_reply_longer_than_the_cap_is_clamped(embedded_server: RunningServer) -> None:
    client = anthropic.Anthropic(base_url=embedded_server.url, api_key="sk-local", max_retries=0)
    with client.messages.stream(
        model="claude-opus-5-5",
        max_tokens=128_000,
        messages=[{"role": "user", "content": "Count from 1 to 500, one number per line."}],
    ) as stream:
        message = stream.get_final_message()
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == REPLY_LIMIT


def test_codex_default_first_request_is_answered(
    embedded_server: RunningServer, tmp_path: Path
) -> None:
    """While the prompt prefills (minutes on a CPU), the stream's keep-alive events hold Codex's
    idle timer off."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    run = run_codex(embedded_server, "Say hello.", workdir)
    # The reply reached Codex. A 135M model at 4x its own context often repeats itself until the
    # cap (then Codex reports the response incomplete): a fact about the model, not the server.
    assert run.message().strip(), json.dumps(run.events)[-2000:]
    if run.returncode != 0:
        assert run.failure() == "Incomplete response returned, reason: max_output_tokens"
    prefilled = metric(embedded_server, "mlxgate_engine_prefill_tokens_total")
    assert prefilled > 8192  # more than the model's own context


def test_claude_code_first_turn_ends_with_an_answer_and_is_continued(
    served_as_make_serve: RunningServer, tmp_path: Path
) -> None:
    """A newcomer's first turn: Claude Code's default request asks for 32,000 tokens; the reply
    ends on its own (or, looping, by the loop guard) well within that."""
    first = run_claude_code(
        served_as_make_serve,
        tmp_path,
        "-p",
        "Say hi in one short sentence.",
        "--output-format",
        "json",
        timeout=900,
    )
    result = json.loads(first.stdout)
    usage = result["usage"]
    prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
    assert prompt > 12_000, usage  # Claude Code's own system prompt and tools, prefilled
    assert first.returncode == 0 and result["result"].strip(), result
    assert usage["output_tokens"] < ENDED_WITHIN, usage

    again = run_claude_code(
        served_as_make_serve,
        tmp_path,
        "-c",
        "-p",
        "Thanks.",
        "--output-format",
        "json",
        timeout=900,
    )
    continued = json.loads(again.stdout)
    cached, computed = (continued["usage"][k] for k in ("cache_read_input_tokens", "input_tokens"))
    assert cached > 12_000 and computed < cached / 10, continued["usage"]
