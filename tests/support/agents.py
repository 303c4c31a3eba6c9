"""The real coding agents the tests drive: Claude Code (bundled in the PyPI wheel
`claude-agent-sdk`) and Codex (PyPI `openai-codex-cli-bin`), each run as a new user runs it,
offline, in a throwaway home."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from support.servers import RunningServer


def claude_code_path() -> Path:
    import claude_agent_sdk

    return Path(claude_agent_sdk.__file__).parent / "_bundled" / "claude"


def codex_path() -> Path:
    from codex_cli_bin import bundled_codex_path

    return bundled_codex_path()


def run_claude_code(
    server: RunningServer,
    workdir: Path,
    *args: str,
    timeout: float = 300,
    env: Mapping[str, str] | None = None,
    input: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """The `claude` CLI as a new user runs it against a local server: no traffic but the
    server's, failures not retried (nor retried without streaming). Its home is beside
    `workdir`, shared by every run in it, so `-c` finds the previous session. `env` adds
    Claude Code's own settings (e.g. `CLAUDE_CODE_MAX_CONTEXT_TOKENS`); `input` is its stdin
    (none by default)."""
    home = workdir.parent / f"claude-home-{workdir.name}"
    home.mkdir(exist_ok=True)
    environment = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE_"))},
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": server.url,
        "ANTHROPIC_API_KEY": "sk-local",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "CLAUDE_CODE_MAX_RETRIES": "0",
        "CLAUDE_CODE_DISABLE_NONSTREAMING_FALLBACK": "1",
        **(env or {}),
    }
    return subprocess.run(
        [str(claude_code_path()), *args],
        env=environment,
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=timeout,
        **({"input": input} if input is not None else {"stdin": subprocess.DEVNULL}),
    )


@dataclass
class CodexRun:
    returncode: int
    events: list[dict[str, Any]]  # `codex exec --json`'s JSON lines
    stderr: str

    def message(self) -> str:
        return "".join(
            e["item"]["text"]
            for e in self.events
            if e["type"] == "item.completed" and e["item"]["type"] == "agent_message"
        )

    def failure(self) -> str:
        failed = [e["error"]["message"] for e in self.events if e["type"] == "turn.failed"]
        assert len(failed) == 1, self.events
        return str(failed[0])

    def usage(self) -> dict[str, int]:
        turns = [e for e in self.events if e["type"] == "turn.completed"]
        assert len(turns) == 1, self.events
        usage: dict[str, int] = turns[0]["usage"]
        return usage


def run_codex(
    server: RunningServer,
    prompt: str,
    workdir: Path,
    *flags: str,
    retries: bool = False,
    model: str = "local",
    provider_options: str = "",
    websockets: bool = False,
    home: Path | None = None,
    resume: bool = False,
) -> CodexRun:
    """`codex exec` as a new user runs it with a custom provider: no network but the server's
    (plugins and analytics off), commands run without a sandbox; failures are not retried
    unless `retries` (Codex's own default: 5). `model` is the name Codex asks for (Codex picks
    its tools by it: `gpt-5.5` gets the freeform `apply_patch`); `provider_options` are more
    `key=value` pairs of the provider's table (e.g. `capabilities={remote_compaction="v2"}`);
    `websockets`: the provider says `supports_websockets`, so Codex speaks the Responses API
    over a WebSocket. `home`: a Codex home kept between runs, where the session is saved, so
    that a later run with `resume` continues it (`codex exec resume --last`); else a
    throwaway one and an ephemeral session."""
    if home is None:
        home = workdir.parent / f"codex-home-{secrets.token_hex(4)}"
        session = ["--ephemeral"]
    else:
        session = ["resume", "--last"] if resume else []
    (home / ".codex").mkdir(parents=True, exist_ok=True)
    no_retries = "" if retries else ",stream_max_retries=0,request_max_retries=0"
    transport = ",supports_websockets=true" if websockets else ""
    options = f",{provider_options}" if provider_options else ""
    provider = (
        f'{{name="mlxgate",base_url="{server.url}/v1",wire_api="responses",'
        f'env_key="OPENAI_API_KEY"{no_retries}{transport}{options}}}'
    )
    run = subprocess.run(
        [
            str(codex_path()),
            "exec",
            *session,
            "--json",
            "--skip-git-repo-check",
            "--disable",
            "plugins",
            "-c",
            "analytics.enabled=false",
            "--dangerously-bypass-approvals-and-sandbox",
            "-c",
            "model_provider=mlxgate",
            "-c",
            f"model_providers.mlxgate={provider}",
            "-m",
            model,
            *flags,
            prompt,
        ],
        env={
            "PATH": "/usr/bin:/bin",
            "HOME": str(home),
            "CODEX_HOME": str(home / ".codex"),
            "OPENAI_API_KEY": "sk-local",
        },
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,  # exec reads an open stdin to its end first
    )
    events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    return CodexRun(run.returncode, events, run.stderr)
