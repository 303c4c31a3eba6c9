"""Records the agent traces `make bench` replays (benches/traces/): the real Claude Code and Codex
CLIs against `mlxgate serve --record-trace` with forced-output models
(tests/support/forced.py), so a session is the same every time it is recorded.

    PYTHONPATH=tests .venv/bin/python benches/record_traces.py [NAME ...]  # default: all

`claude-code` and `codex`: each CLI asked to write a nonce to a file (the model calls the
agent's shell tool, then answers once the tool's result is in its prompt). Claude Code runs with
its default settings (its ~12k-token system prompt and tools), then `-c` continues the session;
Codex runs `codex exec` with its defaults (~10k tokens).

`claude-code-session` and `codex-session`: the longer sessions of tests/support/sessions.py,
through
tool search, a custom tool, each CLI's compaction and the turns after it
(tests/test_agent_sessions.py replays them).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

from support import sessions
from support.agents import run_claude_code, run_codex  # the tests' own drivers
from support.forced import (
    TOOL_RESULT,
    Script,
    answer,
    bash_call,
    forced_model_dir,
    serve_args,
    tool_call,
)
from support.servers import start_server, stop_server

BENCHES = Path(__file__).resolve().parent

FAMILY = "qwen3"
NONCE = "5eed5eed5eed5eed"
TASK = "Write the nonce to the file."
TRACES = BENCHES / "traces"


def record(agent: str, tmp: Path) -> Path:
    workdir = tmp / "work"
    workdir.mkdir(parents=True)
    command = f"echo '<{NONCE}>' > nonce.txt"
    call = (
        bash_call(FAMILY, command, timeout=5000)
        if agent == "claude-code"
        else tool_call(FAMILY, "exec_command", {"cmd": command})
    )
    model = forced_model_dir(
        tmp,
        FAMILY,
        [Script(answer(FAMILY, "The nonce is written."), when=TOOL_RESULT[FAMILY]), Script(call)],
    )
    trace = tmp / "trace.jsonl"
    server = start_server(tmp, *serve_args(model), "--record-trace", str(trace))
    try:
        if agent == "claude-code":
            args = ("--allowedTools", "Bash", "--output-format", "json")
            first = run_claude_code(server, workdir, "-p", TASK, *args)
            again = run_claude_code(server, workdir, "-c", "-p", "Thanks.", *args)
            for run in (first, again):
                if run.returncode != 0:
                    raise RuntimeError(f"claude failed: {run.stdout}{run.stderr}")
        else:
            codex = run_codex(server, TASK, workdir)
            if codex.returncode != 0:
                raise RuntimeError(f"codex failed: {codex.stderr}")
    finally:
        stop_server(server)
    if (workdir / "nonce.txt").read_text().strip() != f"<{NONCE}>":
        raise RuntimeError(f"{agent} did not run the model's command")
    out = TRACES / f"{agent}.jsonl"
    shutil.copy(trace, out)
    return out


def record_session(agent: str, tmp: Path) -> Path:
    """One of tests/support/sessions.py's sessions (`claude-code`, `codex`) as `<agent>-session`."""
    workdir = tmp / "work"
    workdir.mkdir(parents=True)
    if agent == "claude-code":
        family, scripts = sessions.CLAUDE_CODE_FAMILY, sessions.CLAUDE_CODE_SCRIPTS
    else:
        family, scripts = sessions.CODEX_FAMILY, sessions.CODEX_SCRIPTS
    trace = tmp / "trace.jsonl"
    server = start_server(
        tmp, *serve_args(forced_model_dir(tmp, family, scripts)), "--record-trace", str(trace)
    )
    try:
        if agent == "claude-code":
            sessions.claude_code_session(server, workdir)
        else:
            sessions.codex_session(server, workdir)
    finally:
        stop_server(server)
    out = TRACES / f"{agent}-session.jsonl"
    shutil.copy(trace, out)
    return out


# Each trace by its file's name: how it is recorded, and by which agent.
RECORDERS = {
    "claude-code": (record, "claude-code"),
    "codex": (record, "codex"),
    "claude-code-session": (record_session, "claude-code"),
    "codex-session": (record_session, "codex"),
}


def main() -> None:
    """Records the traces named on the command line, else all of them."""
    TRACES.mkdir(exist_ok=True)
    for name in sys.argv[1:] or RECORDERS:
        recorder, agent = RECORDERS[name]
        with tempfile.TemporaryDirectory() as tmp:
            out = recorder(agent, Path(tmp))
        turns = [json.loads(line) for line in out.read_text().splitlines()]
        recorded = {turn["session"] for turn in turns}
        print(f"{out}: {len(turns)} requests in {len(recorded)} session(s)")


if __name__ == "__main__":
    main()
