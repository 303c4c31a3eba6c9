"""Whole agent sessions, the same every time: the real Claude Code and Codex CLIs over several
turns against forced-output models (support/forced.py) scripted for each step of the new paths
(Claude Code's ToolSearch and a deferred tool, Codex's freeform apply_patch, each CLI's
compaction and the turns after it). tests/test_agent_sessions.py runs them and replays their
recordings; benches/record_traces.py records them into benches/traces/.

Each CLI decides to compact by the usage the server reported, so the run that is to compact
gets a limit just under what the session has reached by then (`served`: each request's tokens
from the server's log), whatever the length of the paths in its prompts."""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from mlxgate.api.compaction import INSTRUCTION, SUMMARY_HEADING
from support.agents import CodexRun, run_claude_code, run_codex
from support.forced import TOOL_RESULT, Script, answer, bash_call, call_markup, tool_call
from support.servers import RunningServer


@dataclass(frozen=True)
class Served:
    """One generation request as the server's request log reports it."""

    prompt_tokens: int
    cached_tokens: int
    output_tokens: int


_REQUEST_LINE = re.compile(
    r"POST \S+ 200 finished: (\d+) prompt tokens "
    r"\((\d+) cached(?: from [a-z-]+)?\), (\d+) generated"
)


def served(server: RunningServer) -> list[Served]:
    """The generation requests the server answered so far, in the order they ended."""
    return [
        Served(int(prompt), int(cached), int(generated))
        for prompt, cached, generated in _REQUEST_LINE.findall(server.log())
    ]


# Claude Code: Qwen3 (Hermes calls), a system turn where Claude Code sends one.
CLAUDE_CODE_FAMILY = "qwen3"
CLAUDE_CODE_SUMMARY = "1. Primary Request and Intent:\n   The user listed cron jobs and counted."
CLAUDE_CODE_RESUMED = "Resumed after the summary."
# What Claude Code asks for a compaction with, and how it hands the summary back: the opening
# words of its last user text and of the next request's first message.
CLAUDE_CODE_COMPACTION = "CRITICAL: Respond with TEXT ONLY"
CLAUDE_CODE_CONTINUED = "This session is being continued"
# The turns, each a `-p` prompt (the later ones `-c`), and the model's part in each: a
# ToolSearch that loads the deferred CronList, its call and an answer; a Bash call and an
# answer; a compaction (the summary asked for, then the answer from it); a last answer.
CLAUDE_CODE_TURNS = ("List the cron jobs.", "Count to sixty.", "Go on.", "Say goodbye.")
CLAUDE_CODE_COMPACTING_TURN = 2
CRON_SEARCH = {"query": "select:CronList", "max_results": 5}
CLAUDE_CODE_SCRIPTS = [
    Script("Goodbye.", when="Say goodbye"),
    Script(CLAUDE_CODE_RESUMED, when=CLAUDE_CODE_CONTINUED),
    Script(
        f"<analysis>\nTwo tasks, both done.\n</analysis>\n\n<summary>\n{CLAUDE_CODE_SUMMARY}\n"
        "</summary>",
        when=CLAUDE_CODE_COMPACTION,
    ),
    Script("Counted to sixty.", when="59\n60"),
    Script(bash_call(CLAUDE_CODE_FAMILY, "seq 1 60"), when="Count to sixty"),
    Script("There are no cron jobs.", when=f"{TOOL_RESULT[CLAUDE_CODE_FAMILY]}\nNo scheduled jobs"),
    # Only once ToolSearch has put CronList's definition in the prompt.
    Script(
        call_markup(CLAUDE_CODE_FAMILY, "CronList", {}),
        when=" all cron jobs scheduled via CronCreate",
    ),
    Script(call_markup(CLAUDE_CODE_FAMILY, "ToolSearch", CRON_SEARCH)),
]
# Claude Code compacts at its window less a reserve for the reply (`min(max output, 20000)`)
# and a buffer; with `--model local` its window is CLAUDE_CODE_MAX_CONTEXT_TOKENS.
_CLAUDE_CODE_MAX_OUTPUT = 2000
_CLAUDE_CODE_COMPACT_BUFFER = 13_000


def claude_code_session(server: RunningServer, workdir: Path) -> list[dict[str, object]]:
    """CLAUDE_CODE_TURNS in one session (`-p`, then `-c`), each run's JSON result. A model name
    Claude Code does not know (`local`) takes its window from CLAUDE_CODE_MAX_CONTEXT_TOKENS:
    large, except for the compacting turn, whose threshold is the usage the last request
    reported (its prompt and reply), so that the turn's new message puts it over."""
    results = []
    for number, prompt in enumerate(CLAUDE_CODE_TURNS):
        window = 1_000_000
        if number == CLAUDE_CODE_COMPACTING_TURN:
            last = served(server)[-1]
            threshold = last.prompt_tokens + last.output_tokens
            window = threshold + _CLAUDE_CODE_COMPACT_BUFFER + _CLAUDE_CODE_MAX_OUTPUT
        run = run_claude_code(
            server,
            workdir,
            "--model", "local",
            *(("-c",) if number else ()),
            "-p", prompt,
            "--allowedTools", "Bash",
            "--output-format", "json",
            "--max-turns", "4",  # a script that never matched would loop
            env={
                "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(window),
                "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(_CLAUDE_CODE_MAX_OUTPUT),
            },
        )  # fmt: skip
        results.append(claude_result(run))
    return results


def claude_result(run: subprocess.CompletedProcess[str]) -> dict[str, object]:
    assert run.returncode == 0, run.stdout + run.stderr
    result: dict[str, object] = json.loads(run.stdout)
    assert result["is_error"] is False, result
    return result


# Codex: Qwen3.5 (reasoning before each XML call, replayed by Codex), asked for as `gpt-5.5`
# so that it edits with the freeform apply_patch, with remote compaction (V2).
CODEX_FAMILY = "qwen3.5"
CODEX_MODEL = "gpt-5.5"
CODEX_PROVIDER = 'capabilities={remote_compaction="v2"}'
PATCH = "*** Begin Patch\n*** Add File: hello.txt\n+Hello from the model.\n*** End Patch"
CODEX_SUMMARY = "SUMMARY: hello.txt was added; the numbers were counted."
CODEX_RESUMED = "Resumed: the numbers are counted."
# Whole words of the compaction prompt's and of a replayed summary's opening (a trigger cut
# mid-word would not encode as it does inside the prompt).
INSTRUCTION_TRIGGER = " ".join(INSTRUCTION.split()[:6])
SUMMARY_TRIGGER = SUMMARY_HEADING.split(".")[0]
# The turns (`codex exec`, then `codex exec resume --last`): an apply_patch call and an answer;
# an exec_command call, after which Codex compacts mid-turn and the model answers from its
# summary; a last answer.
CODEX_TURNS = ("Add hello.txt.", "Count to fifty.", "Say goodbye.")
CODEX_COMPACTING_TURN = 1
CODEX_SCRIPTS = [
    Script(answer(CODEX_FAMILY, "Goodbye."), when="Say goodbye"),
    Script(answer(CODEX_FAMILY, CODEX_RESUMED), when=SUMMARY_TRIGGER),
    # A summary is asked for with thinking off: its prompt closes the reasoning block.
    Script(CODEX_SUMMARY, when=INSTRUCTION_TRIGGER),
    Script(answer(CODEX_FAMILY, "The numbers are counted."), when="49\n50"),
    Script(tool_call(CODEX_FAMILY, "exec_command", {"cmd": "seq 1 50"}), when="Count to fifty"),
    Script(answer(CODEX_FAMILY, "The file is written."), when=TOOL_RESULT[CODEX_FAMILY]),
    Script(tool_call(CODEX_FAMILY, "apply_patch", {"input": PATCH})),
]
# Codex counts the last reported usage plus an estimate of the items since. Over the limit
# between turns it compacts before the next one; over it after a reply with a call, mid-turn.
# The compacting turn's limit is this far over the last turn's usage: more than its new user
# message, less than that, the call and the call's output.
_CODEX_COMPACT_MARGIN = 50


def codex_session(server: RunningServer, workdir: Path) -> list[CodexRun]:
    """CODEX_TURNS in one Codex session (its home beside `workdir`), each run's events."""
    home = workdir.parent / "codex-home"
    runs = []
    for number, prompt in enumerate(CODEX_TURNS):
        flags: tuple[str, ...] = ()
        if number == CODEX_COMPACTING_TURN:
            last = served(server)[-1]
            limit = last.prompt_tokens + last.output_tokens + _CODEX_COMPACT_MARGIN
            flags = ("-c", f"model_auto_compact_token_limit={limit}")
        run = run_codex(
            server,
            prompt,
            workdir,
            *flags,
            model=CODEX_MODEL,
            provider_options=CODEX_PROVIDER,
            home=home,
            resume=number > 0,
        )
        assert run.returncode == 0, run.stderr
        runs.append(run)
    return runs
