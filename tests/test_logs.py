"""The request log of the real server: one JSON line per request with `--log-format json`."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx

from support.servers import start_server, stop_server

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _request_lines(log: str) -> dict[str, dict[str, Any]]:
    lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    return {line["id"]: line for line in lines if line["logger"] == "mlxgate.requests"}


def test_each_request_leaves_one_json_line(tmp_path: Path) -> None:
    server = start_server(tmp_path, "--log-format", "json")
    try:
        url = server.url
        body = {"model": "m", "max_tokens": 8, "messages": QUESTION}
        done = httpx.post(f"{url}/v1/messages", json=body, timeout=60)
        with httpx.stream(
            "POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=60
        ) as streamed:
            streamed.read()
        bad = httpx.post(f"{url}/v1/messages", json={"model": "m"}, timeout=60)
        with httpx.stream(
            "POST", f"{url}/v1/messages", json={**body, "max_tokens": 2000, "stream": True}
        ) as dropped:
            for chunk in dropped.iter_raw():
                if b"content_block_delta" in chunk:
                    break
        time.sleep(1.0)
        lines = _request_lines(server.log())
    finally:
        stop_server(server)

    line = lines[done.headers["request-id"]]
    assert line["route"] == "/v1/messages" and line["dialect"] == "anthropic"
    assert line["status"] == 200 and line["end"] == "finished"
    usage = done.json()["usage"]
    assert line["prompt_tokens"] == usage["input_tokens"] + usage["cache_read_input_tokens"]
    assert line["output_tokens"] == usage["output_tokens"]
    assert 0 < line["ttft_s"] < line["duration_s"]
    assert line["model"] == "SmolLM2-135M-Instruct"
    line = lines[streamed.headers["x-request-id"]]
    assert (line["dialect"], line["end"], line["output_tokens"]) == ("openai", "finished", 8)
    line = lines[bad.headers["request-id"]]
    assert (line["status"], line["end"]) == (400, "error")
    assert "output_tokens" not in line
    line = lines[dropped.headers["request-id"]]
    assert line["end"] == "cancelled" and 0 < line["output_tokens"] < 2000
    assert all(set(line) >= {"time", "level", "message"} for line in lines.values())
