"""The benchmark client (`mlxgate.bench`): the times it measures against a fake server whose
timings are known, each dialect's stream and body read right (pings, keep-alives, errors), the
JSONL record round trip, and the real server read in every dialect."""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxgate.bench import scenarios, spawn
from mlxgate.bench.client import send
from mlxgate.bench.figures import Slo, summarize
from mlxgate.bench.records import DIALECTS, PATHS, Record, Tally
from mlxgate.bench.replay import replay, replayable
from mlxgate.bench.run import Target, read_records
from mlxgate.cli import main as cli_main
from mlxgate.trace import Turn
from support.servers import RunningServer

TTFT_S = 0.080
# No two alike within 10 ms, so a gap measured at the wrong event is off by 10 ms or more.
GAPS_S = (0.010, 0.030, 0.020, 0.060, 0.040, 0.050)
# How close a measured time is to the server's: the median over requests, each request paired
# with the server's own record (a loaded 2-core machine delays a frame or its record by ~2 ms).
MEASURED_WITHIN_S = 0.003


def _sse(data: dict[str, Any] | str, event: str | None = None) -> bytes:
    """One frame as a server writes it (with an `id:` line, which a client skips)."""
    payload = data if isinstance(data, str) else json.dumps(data)
    return (f"id: 7\nevent: {event}\n" if event else "id: 7\n").encode() + (
        f"data: {payload}\n\n".encode()
    )


def _frames(dialect: str) -> tuple[list[bytes], list[bytes], list[bytes]]:
    """A dialect's stream as a real server writes it: the frames before the tokens (a ping or
    keep-alive among them), one per token, and the frames after."""
    tokens = len(GAPS_S) + 1
    if dialect == "anthropic":
        usage: dict[str, Any] = {"input_tokens": 5, "cache_read_input_tokens": 3}
        start = _sse({"type": "message_start", "message": {"usage": usage}}, "message_start")
        ping = _sse({"type": "ping"}, "ping")
        delta = {"type": "content_block_delta", "index": 0, "delta": {"text": "tok "}}
        stop = {"stop_reason": "end_turn"}
        end = {"type": "message_delta", "delta": stop, "usage": {"output_tokens": tokens}}
        return (
            [start, ping],
            [_sse(delta, "content_block_delta")] * tokens,
            [ping, _sse(end, "message_delta"), _sse({"type": "message_stop"}, "message_stop")],
        )
    if dialect == "openai":
        delta = {"choices": [{"index": 0, "delta": {"content": "tok "}}]}
        finish = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
        usage = {
            "prompt_tokens": 8,
            "completion_tokens": tokens,
            "prompt_tokens_details": {"cached_tokens": 3},
        }
        return (
            [b": keep-alive\n\n"],
            [_sse(delta)] * tokens,
            [_sse(finish), _sse({"choices": [], "usage": usage}), _sse("[DONE]")],
        )
    delta = {"type": "response.output_text.delta", "delta": "tok "}
    usage = {
        "input_tokens": 8,
        "output_tokens": tokens,
        "input_tokens_details": {"cached_tokens": 3},
    }
    done = {"type": "response.completed", "response": {"status": "completed", "usage": usage}}
    return (
        [_sse({"type": "response.created", "response": {}}, "response.created")],
        [_sse(delta, "response.output_text.delta")] * tokens,
        [_sse(done, "response.completed")],
    )


class FakeServer:
    """An HTTP server on loopback, in a thread of its own, that streams each dialect's frames
    with known timings: the first token TTFT_S after the request, then GAPS_S apart. It keeps
    when it wrote each token (the same clock as the client's)."""

    def __init__(self) -> None:
        self.written: list[list[float]] = []
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self.ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        self.ready.set()
        self.loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        path = head.split(b" ")[1].decode()
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        await reader.readexactly(length)
        dialect = next(d for d in DIALECTS if path.endswith(PATHS[d]))
        before, tokens, after = _frames(dialect)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
            + b"".join(before)
        )
        await writer.drain()
        written: list[float] = []
        self.written.append(written)  # (complete before the stream's end reaches the client)
        due = time.monotonic() + TTFT_S
        for frame, gap in zip(tokens, (0.0, *GAPS_S), strict=True):
            due += gap
            await asyncio.sleep(due - time.monotonic())
            writer.write(frame)
            await writer.drain()
            written.append(time.monotonic())
        writer.write(b"".join(after))
        await writer.drain()
        writer.close()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeServer]:
    server = FakeServer()
    yield server
    server.stop()


async def _send_all(url: str, dialect: str, count: int) -> list[Record]:
    records = []
    async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
        for index in range(count):
            record = Record(index=index, dialect=dialect, sent_at=0.0)
            records.append(await send(client, url, record, {"stream": True}))
    return records


@pytest.mark.parametrize("dialect", DIALECTS)
def test_measured_times_match_the_servers_within_3_ms(fake: FakeServer, dialect: str) -> None:
    fake.written.clear()
    records = asyncio.run(_send_all(fake.url, dialect, 11))
    assert len(fake.written) == len(records)
    for record in records:
        assert record.ok, record.error
        assert record.output_tokens == len(GAPS_S) + 1 == len(record.delta_times)
        assert record.text == "tok " * (len(GAPS_S) + 1)
        assert record.cached_tokens == 3
    # Each request's measured times against the truth the server kept for that request, the
    # median over requests (a request the machine delivered late does not count; a time taken
    # at the wrong event fails every request).
    pairs = list(zip(records, fake.written, strict=True))
    assert abs(statistics.median((r.ttft_s or 0) - (w[0] - r.sent_at) for r, w in pairs)) < (
        MEASURED_WITHIN_S
    )
    assert statistics.median(w[0] - r.sent_at for r, w in pairs) >= TTFT_S
    for i, gap in enumerate(GAPS_S):
        error = statistics.median(r.gaps[i] - (w[i + 1] - w[i]) for r, w in pairs)
        assert abs(error) < MEASURED_WITHIN_S, (i, error)
        true = statistics.median(w[i + 1] - w[i] for w in fake.written)
        assert abs(true - gap) < 0.005  # the fake server kept its schedule


def _tally(dialect: str, frames: list[tuple[str | None, Any]]) -> Record:
    record = Record(index=0, dialect=dialect, sent_at=0.0)
    tally = Tally(record)
    for at, (event, data) in enumerate(frames, 1):
        tally.frame(event, data, float(at))
        if tally.ended:
            break
    return record


def test_a_side_call_is_replayed_beside_the_turn_it_came_during(fake: FakeServer) -> None:
    """A recorded session: turn 0; turn 1 arrived 50 ms after it while it still ran (no
    `after_s`: a side call); turn 2 came 100 ms after the last answer ended. The replay sends turn 1
    50 ms after turn 0 without waiting for its answer, and turn 2 100 ms after both ended."""
    body = {"model": "m", "max_tokens": 8, "stream": True, "messages": []}
    turns = [
        Turn("s", 0, 0.0, None, "/v1/messages", body),
        Turn("s", 1, 0.05, None, "/v1/messages", body),
        Turn("s", 2, 0.6, 0.1, "/v1/messages", body),
    ]
    first, side, later = sorted(asyncio.run(replay(fake.url, [turns], 1)), key=lambda r: r.index)
    assert all(r.ok for r in (first, side, later))
    assert abs(side.sent_at - first.sent_at - 0.05) < 0.02
    assert side.sent_at < first.ended_at  # beside it, not after it
    assert later.sent_at - max(first.ended_at, side.ended_at) == pytest.approx(0.1, abs=0.02)


def test_staggered_sessions_start_once_the_one_before_has_answered(fake: FakeServer) -> None:
    """`--staggered`: session 1 sends its first turn when session 0's first has its answer, so
    that it prefills beside session 0's next turns; at once, both first turns go together."""
    body = {"model": "m", "max_tokens": 8, "stream": True, "messages": []}
    first_session = [
        Turn("a", 0, 0.0, None, "/v1/messages", body),
        Turn("a", 1, 0.5, 0.0, "/v1/messages", body),
    ]
    second_session = [Turn("b", 0, 0.0, None, "/v1/messages", body)]

    def firsts(staggered: bool) -> tuple[Record, Record, Record]:
        records = asyncio.run(
            replay(fake.url, [first_session, second_session], 2, staggered=staggered)
        )
        by_key = {(r.session, r.index): r for r in records}
        return by_key[("0", 0)], by_key[("0", 1)], by_key[("1", 0)]

    first, next_turn, other = firsts(staggered=True)
    assert all(r.ok for r in (first, next_turn, other))
    assert other.sent_at >= first.ended_at
    assert other.sent_at - first.ended_at < 0.02 and next_turn.sent_at - first.ended_at < 0.02
    first, _, other = firsts(staggered=False)
    assert abs(other.sent_at - first.sent_at) < 0.02


def test_a_replayed_reply_is_held_to_the_runs_max_tokens() -> None:
    """Agents ask for up to 128,000 tokens; a replay holds each reply to `--max-tokens`, in each
    dialect's own field, and leaves a smaller recorded limit alone."""
    cases = [
        ("/v1/messages", {"max_tokens": 128_000}, "max_tokens", 64),
        ("/v1/responses", {}, "max_output_tokens", 64),
        ("/v1/chat/completions", {"max_completion_tokens": 9000}, "max_completion_tokens", 64),
        ("/v1/chat/completions", {"max_tokens": 16}, "max_tokens", 16),
    ]
    for path, recorded, key, expected in cases:
        _, body = replayable(Turn("s", 0, 0.0, None, path, recorded), "m", 64)
        assert body[key] == expected and body["model"] == "m"
    _, body = replayable(Turn("s", 0, 0.0, None, "/v1/messages", {"max_tokens": 9}), None)
    assert body == {"max_tokens": 9}  # nothing asked of it: the body as recorded


def test_error_events_are_failures_in_every_dialect() -> None:
    anthropic = _tally(
        "anthropic",
        [
            ("ping", {"type": "ping"}),
            ("content_block_delta", {"type": "content_block_delta", "delta": {"text": "a"}}),
            ("error", {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}),
        ],
    )
    assert (anthropic.error_kind, anthropic.error, anthropic.text) == ("error_event", "busy", "a")
    assert anthropic.ttft_s == 2.0  # the ping is not a token
    openai = _tally(
        "openai",
        [(None, {"error": {"message": "stream failed", "type": "server_error"}}), (None, "[DONE]")],
    )
    assert (openai.error_kind, openai.error) == ("error_event", "stream failed")
    failed = {"type": "response.failed", "response": {"error": {"message": "no"}}}
    responses = _tally("responses", [("response.failed", failed)])
    assert (responses.error_kind, responses.error) == ("error_event", "no")
    bad = _tally("openai", [(None, [1, 2])])
    assert bad.error_kind == "bad_frame"


def test_tool_call_arguments_and_reasoning_are_tokens() -> None:
    openai = _tally(
        "openai",
        [
            (None, {"choices": [{"delta": {"reasoning_content": "think"}}]}),
            (None, {"choices": [{"delta": {"tool_calls": [{"function": {"arguments": "{}"}}]}}]}),
        ],
    )
    assert openai.text == "think{}" and len(openai.delta_times) == 2
    responses = _tally(
        "responses",
        [
            (
                "response.function_call_arguments.delta",
                {"type": "response.function_call_arguments.delta", "delta": '{"a"'},
            ),
            ("response.output_item.done", {"type": "response.output_item.done", "item": {}}),
        ],
    )
    assert responses.text == '{"a"' and len(responses.delta_times) == 1


def test_records_round_trip_through_jsonl() -> None:
    record = Record(
        index=3,
        dialect="responses",
        sent_at=100.5,
        status=200,
        ttft_s=0.25,
        delta_times=[100.75, 100.8],
        output_tokens=2,
        ended_at=101.0,
        target="a",
        scenario="sweep",
    )
    line = json.dumps(record.to_json(run_started=100.0))
    assert json.loads(line)["delta_times"] == [0.25, 0.3]
    again = Record.from_json(json.loads(line), run_started=100.0)
    assert again == record


def test_a_cached_share_the_server_does_not_report_is_unknown_not_zero() -> None:
    def record(cached: int | None) -> Record:
        return Record(
            index=0, dialect="openai", sent_at=0.0, status=200, ttft_s=0.1,
            delta_times=[0.1, 0.2], output_tokens=2, input_tokens=100, cached_tokens=cached,
            ended_at=0.2,
        )  # fmt: skip

    def share(*cached: int | None) -> float | None:
        return summarize([record(c) for c in cached], 1.0, Slo())["cached_share"]

    assert share(None, None) is None  # llama-server's usage has no cached count
    assert share(0, None) == 0.0
    assert share(50, 100) == pytest.approx(0.75)


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_the_real_server_read_in_every_dialect(
    server: RunningServer, dialect: str, stream: bool
) -> None:
    question = [{"role": "user", "content": "Name three colours."}]
    body: dict[str, Any] = {"model": "m", "stream": stream, "temperature": 0}
    if dialect == "responses":
        body |= {"input": question, "max_output_tokens": 16}
    else:
        body |= {"messages": question, "max_tokens": 16}
    if dialect == "openai" and stream:
        body["stream_options"] = {"include_usage": True}

    async def one() -> Record:
        async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
            return await send(client, server.url, Record(0, dialect, 0.0), body)

    record = asyncio.run(one())
    assert record.ok, record.error
    assert record.text and record.output_tokens and 0 < record.output_tokens <= 16
    assert record.input_tokens and record.finish_reason
    if stream:
        assert 0 < len(record.delta_times) <= record.output_tokens
        assert record.ttft_s is not None and record.ttft_s <= record.ended_at - record.sent_at


def test_a_run_directory_is_complete(fake: FakeServer, tmp_path: Path) -> None:
    """Two targets, interleaved over two levels: every request's record, every run's figures,
    the report with ratios to the first target; through the CLI `mlxgate bench`."""
    out = tmp_path / "run"
    cli_main(
        [
            "bench",
            "--target", f"first={fake.url},dialect=anthropic,pid={os.getpid()}",
            "--target", f"second={fake.url},dialect=responses",
            "--concurrency", "1,2",
            "--requests-per-client", "2",
            "--slo", "ttft=1s,itl=100ms",
            "--out", str(out),
        ]
    )  # fmt: skip
    report = (out / "report.md").read_text()
    assert sorted(p.name for p in out.iterdir()) == [
        "latency.png", "records.jsonl", "report.md", "summary.json", "throughput.png"
    ]  # fmt: skip
    for plot in ("latency.png", "throughput.png"):
        assert (out / plot).read_bytes().startswith(b"\x89PNG") and f"({plot})" in report
    records = read_records(out / "records.jsonl")
    assert len(records) == (1 + 2) * 2 * 2
    assert {(r.target, r.dialect) for r in records} == {
        ("first", "anthropic"),
        ("second", "responses"),
    }
    assert all(r.ok and len(r.delta_times) == len(GAPS_S) + 1 for r in records)
    summary = json.loads((out / "summary.json").read_text())
    cpu = summary["machine"]["cpu"]  # which CPU, and which of the kernels' instruction sets
    assert f"({cpu})" in report and ("avx2" in cpu) == ("avx2" in Path("/proc/cpuinfo").read_text())
    runs = {(r["target"], r["concurrency"]): r for r in summary["runs"]}
    assert set(runs) == {("first", 1), ("second", 1), ("first", 2), ("second", 2)}
    for figures in runs.values():
        assert figures["failed"] == 0 and figures["output_tokens"] == 7 * figures["requests"]
        assert figures["goodput_tok_s"] == pytest.approx(figures["output_tok_s"])  # all meet it
        assert figures["cached_share"] == pytest.approx(3 / 8)
        assert TTFT_S <= figures["ttft_s"]["p50"] < TTFT_S + 0.05
        assert abs(figures["itl_s"]["max"] - max(GAPS_S)) < 0.01  # the schedule, give or take
    assert runs[("first", 1)]["cpu_s_per_output_token"] is not None  # this process's pid
    assert runs[("second", 1)]["cpu_s_per_output_token"] is None
    assert report.count("| first |") == 2 and report.count("| second |") == 2
    assert "| 1.00x |" in report


def test_the_edit_scenario_reports_the_guesses_kept(
    fake: FakeServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--scenarios edit`: the files asked back one after the other by one client, the decode
    rate after the first token, and the speculation counters' growth over the run."""
    counters = iter(
        [
            {"verify_passes": 10.0, "drafted_tokens": 40.0, "accepted_tokens": 20.0},
            {"verify_passes": 20.0, "drafted_tokens": 80.0, "accepted_tokens": 38.0},
        ]
    )

    async def read_counters(url: str) -> dict[str, float]:
        return next(counters)

    monkeypatch.setattr(scenarios, "speculation_counters", read_counters)
    out = tmp_path / "run"
    cli_main(["bench", "--target", f"fake={fake.url},dialect=openai", "--scenarios", "edit",
              "--quick", "--out", str(out)])  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    [run] = summary["runs"]
    assert run["scenario"] == "edit" and run["requests"] == 2 and run["failed"] == 0
    figures = run["scenario_figures"]
    assert figures["speculation"] == {
        "verify_passes": 10.0, "drafted_tokens": 40.0, "accepted_tokens": 18.0
    }  # fmt: skip
    assert figures["decode_tok_s"] == pytest.approx(len(GAPS_S) / sum(GAPS_S), rel=0.2)
    report = (out / "report.md").read_text()
    assert (
        "## Edit" in report and "18 of 40 guessed tokens kept (45%), 1.80 per verify pass" in report
    )
    assert "rgb_to_yiq renamed to rgb_to_ntsc" in scenarios.edit_prompt(*scenarios.EDITS[0]).user
    assert "--max-draft-tokens" in spawn.command("mlxgate-plain", 8080, 1)
    before_kernels = spawn.command("mlxgate-float32", 8080, 1)
    assert "--no-cpu-kernels" in before_kernels and "float32" in before_kernels
    assert "--int8-activations" in spawn.command("mlxgate-int8", 8080, 1)


def test_the_scenarios_on_the_real_server(server: RunningServer, tmp_path: Path) -> None:
    """Long prompts, head-of-line, prefix reuse and disconnect, small, through the CLI: each
    scenario's figures say what the server did (mlxgate reuses the prefix and stops computing
    for a client that left)."""
    out = tmp_path / "run"
    assert server.process is not None
    target = f"mlxgate={server.url},dialect=anthropic,pid={server.process.pid}"
    cli_main(
        [
            "bench", "--target", target, "--scenarios", "long,hol,prefix,disconnect", "--quick",
            "--out", str(out),
        ]
    )  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    runs = {r["scenario"]: r for r in summary["runs"]}
    assert set(runs) == {"long", "hol", "prefix", "disconnect"}
    assert runs["long"]["requests"] == 2 and runs["long"]["failed"] == 0
    assert all(r.input_tokens is not None and 300 < r.input_tokens < 700
               for r in read_records(out / "records.jsonl") if r.scenario == "long")  # fmt: skip
    hol = runs["hol"]["scenario_figures"]
    assert runs["hol"]["failed"] == 0 and hol["max_gap_during_s"] >= hol["median_gap_s"] > 0
    assert hol["gaps_over_time"] and hol["window_s"][1] > 0
    prefix = runs["prefix"]["scenario_figures"]
    assert prefix["cached_tokens_second"] > 500  # the ~600-token system prompt, reused
    disconnect = runs["disconnect"]["scenario_figures"]
    for case in ("decode", "prefill"):
        assert disconnect[case]["closed_early"]
        assert disconnect[case]["idle_after_s"] is not None  # it stopped working for nobody
    assert disconnect["prefill"]["closed_in_prefill"]
    report = (out / "report.md").read_text()
    for title in ("Long prompts", "Head-of-line", "Prefix reuse", "Disconnect"):
        assert f"## {title}" in report
    assert "longest gap during the" in report and "closed mid-prefill: idle" in report
    assert summary["plots"] == ["hol.png"] and "![" in report and "(hol.png)" in report
    assert (out / "hol.png").read_bytes().startswith(b"\x89PNG")


def test_spawned_servers_are_measured_and_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--spawn mlxgate --spawn mlx_lm`: both start on the embedded model (mlx_lm.server on its
    export), answer, get their CPU read, and are gone after the run; a missing llama-server is
    named with the way to build one."""
    monkeypatch.setattr(spawn, "EXPORT_DIR", tmp_path / "export")
    out = tmp_path / "run"
    cli_main(
        [
            "bench", "--spawn", "mlxgate", "--spawn", "mlx_lm", "--concurrency", "1",
            "--requests-per-client", "2", "--max-tokens", "8", "--out", str(out),
        ]
    )  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    assert [t["name"] for t in summary["targets"]] == ["mlxgate", "mlx_lm"]
    for run in summary["runs"]:
        assert run["failed"] == 0 and run["output_tokens"] > 0
        assert run["cpu_s_per_output_token"] > 0
    assert sorted(p.name for p in (out / "logs").iterdir()) == ["mlx_lm.log", "mlxgate.log"]
    assert not spawn.RUNNING
    for target in summary["targets"]:
        assert not Path(f"/proc/{target['pid']}").exists()
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"build_llama_server\.sh"):
        spawn.command("llama-server", 8080, 4)


def test_llama_server_is_spawned_to_hold_what_mlxgate_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The embedded model at mlxgate's context (YaRN x4) split over the slots, or in one slot for
    long prompts; a GGUF brought with --gguf at its own context, served by both under its name."""
    from mlxgate.models import default_model_path

    monkeypatch.setenv("LLAMA_SERVER", "/bin/true")

    many = spawn.command("llama-server", 8080, 32)
    assert many[many.index("--parallel") + 1] == "32" and "--kv-unified" not in many
    assert many[many.index("--ctx-size") + 1] == "65536" and "--jinja" in many
    long = spawn.command("llama-server-long", 8080, 32)
    assert long[long.index("--parallel") + 1] == "1"
    assert long[long.index("--ctx-size") + 1] == "32768"
    assert long[long.index("--rope-scale") + 1] == "4"
    gguf = tmp_path / "brought.gguf"
    gguf.symlink_to(default_model_path())  # (any GGUF: the embedded model's says 8192)
    brought = spawn.command("llama-server-long", 8080, 32, gguf)
    assert brought[brought.index("--model") + 1] == str(gguf)
    assert brought[brought.index("--ctx-size") + 1] == "8192" and "--rope-scaling" not in brought
    assert brought[brought.index("--alias") + 1] == spawn.served_name("mlxgate", gguf) == "brought"
    ours = spawn.command("mlxgate", 8080, 32, gguf)
    assert ours[ours.index("--model") + 1] == str(gguf)
    with pytest.raises(ValueError, match="embedded"):
        spawn.command("mlx_lm", 8080, 1, gguf)
    with pytest.raises(SystemExit):
        cli_main(["bench", "--spawn", "mlxgate", "--gguf", str(tmp_path / "missing.gguf")])


def test_targets_and_objectives_are_parsed_or_refused() -> None:
    target = Target.parse("local=http://127.0.0.1:8080/,dialect=responses,pid=42,model=m")
    assert target == Target("local", "http://127.0.0.1:8080", "responses", 42, "m")
    for bad in ("http://x", "a=ftp://x", "a=http://x,dialect=soap", "a=http://x,color=red"):
        with pytest.raises(ValueError):
            Target.parse(bad)
    assert Slo.parse("ttft=1.5s,itl=200ms") == Slo(1.5, 0.2)
    assert Slo.parse("itl=50ms") == Slo(itl_s=0.05)
    with pytest.raises(ValueError):
        Slo.parse("ttft=fast")
