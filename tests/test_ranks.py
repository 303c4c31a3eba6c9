"""One model across ranks (ranks.py, engine/lockstep.py): `mlxgate serve --ranks N` on this
machine, over MLX's ring backend on loopback, against the same server in one process.

Random-weight tiny models of the families mlx-lm can shard (with the qwen3 tokenizer), and the
embedded model on 3 ranks (its 9 attention heads do not divide by 2). Tensor parallel sums each
layer's parts in another order than one process does: a token may differ only where the single
process's own log-probabilities of the two tokens differ by <= 1e-4 at that step (after which
the two answers go their own ways), as the architecture matrix does.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest

from support import tiny_models
from support.servers import RunningServer, free_port, metric, start_server, stop_server

TIES = 1e-4
QWEN3_VOCAB = 151936
# The 16 at once: prompts of different lengths, so that rows join and leave apart.
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "wizards",
    "quietly",
    "pack",
    "boxes",
]
SYSTEM = "You are a terse assistant. " * 6  # a shared prefix past the prefix cache's minimum


def conversation(index: int, user: str | None = None) -> list[dict[str, str]]:
    words = " ".join(WORDS[: 2 + index % len(WORDS)])
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": user or f"{index}: {words}"},
    ]


def ask(server: RunningServer, messages: list[dict[str, str]], **body: Any) -> dict[str, Any]:
    request = {"model": "m", "messages": messages, "max_tokens": 12, "temperature": 0, **body}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=request, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def graded(server: RunningServer, messages: list[dict[str, str]], **body: Any) -> dict[str, Any]:
    """An answer with each token's log-probability and its runner-up's (for the ties rule)."""
    return ask(server, messages, logprobs=True, top_logprobs=2, **body)


def answers(server: RunningServer) -> dict[str, Any]:
    """One conversation alone, 16 at once, and a second turn that reuses the first's prefix."""
    alone = graded(server, conversation(0))
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda i: graded(server, conversation(i)), range(1, 17)))
    reply = alone["choices"][0]["message"]["content"]
    turn_2 = [*conversation(0), {"role": "assistant", "content": reply}]
    turn_2.append({"role": "user", "content": "and then?"})
    return {"alone": alone, "together": together, "turn 2": graded(server, turn_2)}


def assert_same_tokens(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    """`got` gives `want`'s tokens, or the runner-up where `want`'s top two tie (TIES)."""
    got_tokens = got["choices"][0]["logprobs"]["content"]
    want_tokens = want["choices"][0]["logprobs"]["content"]
    for step, (mine, theirs) in enumerate(zip(got_tokens, want_tokens, strict=False)):
        if mine["bytes"] == theirs["bytes"]:
            continue
        alternatives = {bytes(a["bytes"]): a["logprob"] for a in theirs["top_logprobs"]}
        gap = abs(alternatives.get(bytes(mine["bytes"]), float("-inf")) - theirs["logprob"])
        assert gap <= TIES, (
            f"{what}: token {step} is {mine['token']!r}, one process {theirs['token']!r} "
            f"(log-probability gap {gap:.2e})"
        )
        return  # a tie: from here the two answers may go their own ways
    assert len(got_tokens) == len(want_tokens), what


def assert_same_answers(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert_same_tokens(got["alone"], want["alone"], "alone")
    for index, (mine, theirs) in enumerate(zip(got["together"], want["together"], strict=True)):
        assert_same_tokens(mine, theirs, f"{index + 1} of 16 at once")
    assert_same_tokens(got["turn 2"], want["turn 2"], "turn 2")
    cached = got["turn 2"]["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > len(SYSTEM) // 8, "turn 2 reused turn 1's keys/values on every rank"
    assert cached == want["turn 2"]["usage"]["prompt_tokens_details"]["cached_tokens"]


class Models(dict[str, Path]):
    """Model directories by family, written when first asked for."""

    def __init__(self, parent: Path) -> None:
        super().__init__()
        self.parent = parent

    def __missing__(self, arch: str) -> Path:
        self[arch] = tiny_models.directory(self.parent, arch, vocab_size=QWEN3_VOCAB)
        return self[arch]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    return Models(tmp_path_factory.mktemp("ranks-models"))


def served(tmp: Path, model: Path, *args: str) -> RunningServer:
    return start_server(tmp, "--model", str(model), *args, timeout_s=180)


def answers_of(tmp: Path, model: Path, *args: str) -> dict[str, Any]:
    server = served(tmp, model, *args)
    try:
        got = answers(server)
        if "--ranks" in args:
            assert metric(server, "mlxgate_ranks") == int(args[args.index("--ranks") + 1])
        return got
    finally:
        stop_server(server)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_tensor_parallel_on_two_ranks_answers_as_one_process(
    arch: str, models: Models, tmp_path: Path
) -> None:
    one = answers_of(tmp_path, models[arch])
    assert_same_answers(answers_of(tmp_path, models[arch], "--ranks", "2"), one)


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_pipeline_on_two_ranks_answers_as_one_process(
    arch: str, models: Models, tmp_path: Path
) -> None:
    one = answers_of(tmp_path, models[arch])
    assert_same_answers(answers_of(tmp_path, models[arch], "--ranks", "2", "--pipeline"), one)


def test_the_embedded_model_on_three_ranks_answers_as_one_process(
    server: RunningServer, tmp_path: Path
) -> None:
    """(The session's server: the embedded model at its own 8,192-token context.)"""
    question = [{"role": "user", "content": "What is the capital of France?"}]
    ranks = start_server(tmp_path, "--ranks", "3", "--context-length", "8192", timeout_s=300)
    try:
        got = graded(ranks, question, max_tokens=16)
    finally:
        stop_server(ranks)
    assert_same_tokens(got, graded(server, question, max_tokens=16), "the embedded model")


# Prefill in chunks of 32 tokens, one chunk a step: a long prompt takes many steps.
CHUNKED = ("--max-prefill-chunk", "32", "--min-prefill-chunk", "32", "--max-prefill-tokens", "32")


def slow_chunks(tmp: Path, env: pytest.MonkeyPatch) -> None:
    """Each prompt chunk a rank computes takes 50 ms more, as a larger model's would: a long
    prompt prefills for seconds, so a client can leave mid-prefill on a machine of any speed (a
    tiny model's 32-token chunk takes about a millisecond)."""
    hook = tmp / "slow_chunks"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('MLX_RANK') is not None:\n"
        "    import time\n"
        "    from mlxgate.engine.prefill import Prefill\n"
        "    forward = Prefill._forward_prompt\n"
        "    def slow(self, tokens, pending):\n"
        "        time.sleep(0.05)\n"
        "        return forward(self, tokens, pending)\n"
        "    Prefill._forward_prompt = slow\n"
    )
    env.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")]))
    )


@pytest.fixture(scope="module", params=["tensor", "pipeline"])
def pair(
    request: pytest.FixtureRequest, models: Models, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[RunningServer, RunningServer]]:
    """A tiny model in one process and on two ranks, prefilling in small chunks (slow ones on
    the ranks: `slow_chunks`): the llama tensor parallel, deepseek_v3 pipelined."""
    tmp = tmp_path_factory.mktemp("pair")
    how: tuple[str, ...]
    if request.param == "tensor":
        model, how = models["llama"], ()
    else:
        model, how = models["deepseek_v3"], ("--pipeline",)
    one = served(tmp, model, *CHUNKED)
    with pytest.MonkeyPatch.context() as env:
        slow_chunks(tmp, env)
        two = served(tmp, model, "--ranks", "2", *how, *CHUNKED)
    yield one, two
    stop_server(two)
    stop_server(one)


def test_speculation_grammars_and_choices_on_two_ranks(
    pair: tuple[RunningServer, RunningServer],
) -> None:
    """Prompt lookup guesses on rank 0 and every rank verifies them; a grammar's masks are
    rank 0's; each of n choices decodes on every rank."""
    one, two = pair
    echo = conversation(3, "repeat: " + " ".join(WORDS * 3))
    drafted = metric(two, "mlxgate_engine_drafted_tokens_total")
    want, got = ask(one, echo, max_tokens=48), ask(two, echo, max_tokens=48)
    assert got["choices"][0]["message"] == want["choices"][0]["message"]
    assert metric(two, "mlxgate_engine_drafted_tokens_total") > drafted, "guesses were verified"

    schema = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "sunny": {"type": "boolean"}},
        "required": ["city", "sunny"],
        "additionalProperties": False,
    }
    constrained = {
        "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
        "max_tokens": 64,
    }
    want, got = ask(one, conversation(4), **constrained), ask(two, conversation(4), **constrained)
    assert got["choices"][0] == want["choices"][0]
    answer = json.loads(got["choices"][0]["message"]["content"])
    assert answer["city"] in ("Paris", "Rome", "Oslo") and isinstance(answer["sunny"], bool)

    want, got = graded(one, conversation(5), n=3), graded(two, conversation(5), n=3)
    assert len(got["choices"]) == 3
    for index in range(3):
        mine = {"choices": [got["choices"][index]]}
        assert_same_tokens(mine, {"choices": [want["choices"][index]]}, f"choice {index}")


def test_a_draft_model_guesses_on_rank_0(models: Models, tmp_path: Path) -> None:
    """The draft model runs on rank 0 alone, whole; every rank verifies its guesses."""
    echo = conversation(7, "repeat: " + " ".join(WORDS * 2))
    draft = ("--draft-model", str(models["qwen3"]))
    one = served(tmp_path, models["llama"], *draft)
    try:
        want = ask(one, echo, max_tokens=32)
    finally:
        stop_server(one)
    two = served(tmp_path, models["llama"], "--ranks", "2", *draft)
    try:
        got = ask(two, echo, max_tokens=32)
        assert metric(two, "mlxgate_engine_drafted_tokens_total") > 0
    finally:
        stop_server(two)
    assert got["choices"][0]["message"] == want["choices"][0]["message"]


def test_a_cancel_mid_prefill_on_two_ranks(pair: tuple[RunningServer, RunningServer]) -> None:
    """A client that leaves while its long prompt prefills chunk by chunk: every rank drops it
    between chunks and keeps what it prefilled; the same request again resumes there, and
    answers as one process does."""
    one, two = pair
    long = conversation(6, "summarize: " + " ".join(WORDS * 150))
    request = {"model": "m", "messages": long, "max_tokens": 8, "stream": True}
    cancelled = metric(two, "mlxgate_engine_requests_cancelled_total")
    prefilled = metric(two, "mlxgate_engine_prefill_tokens_total")
    with httpx.stream("POST", f"{two.url}/v1/chat/completions", json=request, timeout=60) as r:
        assert r.status_code == 200
        # It leaves once some chunks are in (one that leaves at once may leave before the first).
        deadline = time.monotonic() + 30
        while metric(two, "mlxgate_engine_prefill_tokens_total") < prefilled + 256:
            assert time.monotonic() < deadline, "the prompt's prefill began"
            time.sleep(0.02)
    deadline = time.monotonic() + 30
    while metric(two, "mlxgate_engine_requests_cancelled_total") == cancelled:
        assert time.monotonic() < deadline, "the cancel reached the engine"
        time.sleep(0.1)
    got, want = graded(two, long, max_tokens=8), graded(one, long, max_tokens=8)
    prompt_tokens = got["usage"]["prompt_tokens"]
    cached = got["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < prompt_tokens - 32, f"resumed mid-prompt ({cached} of {prompt_tokens})"
    assert_same_tokens(got, want, "after the cancel")
    assert httpx.get(f"{two.url}/health").json()["status"] == "ok"


def rank_process(launcher: RunningServer, rank: int) -> int:
    """The pid of `rank` among the processes `--ranks` started (its MLX_RANK)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat[1]) == launcher.pid and f"MLX_RANK={rank}".encode() in environ:
            return int(entry.name)
    raise AssertionError(f"no rank {rank} under {launcher.pid}")


def test_a_rank_that_starts_late_still_joins(
    models: Models, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 starts 20 s after rank 1 (a busy machine; MLX's ring alone gives 15 s): the ranks
    wait for each other before they join, and the group serves."""
    late = tmp_path / "late"
    late.mkdir()
    (late / "sitecustomize.py").write_text(
        "import os, time\n"
        "if os.environ.get('MLX_RANK') == '0' and not os.environ.get('LATE_ALREADY'):\n"
        "    os.environ['LATE_ALREADY'] = '1'\n"
        "    time.sleep(20)\n"
    )
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(late), os.environ.get("PYTHONPATH")]))
    )
    server = served(tmp_path, models["llama"], "--ranks", "2")
    try:
        assert ask(server, conversation(0))["choices"][0]["message"]["content"]
        assert metric(server, "mlxgate_ranks") == 2
    finally:
        stop_server(server)


@pytest.mark.parametrize("fault", ["killed", "stalled"])
def test_a_dead_or_stalled_rank_fails_the_server_within_ten_seconds(
    fault: str, models: Models, tmp_path: Path
) -> None:
    """Health 503, the open stream ends with an error event, the launch exits non-zero."""
    server = served(tmp_path, models["llama"], "--ranks", "2", "--rank-timeout", "5")
    launcher = server.process
    assert launcher is not None
    follower = rank_process(server, 1)
    request = {
        "model": "m",
        "max_tokens": 3000,
        "stream": True,
        "messages": [{"role": "user", "content": "go on"}],
    }
    try:
        with httpx.stream("POST", f"{server.url}/v1/messages", json=request, timeout=30) as stream:
            lines = stream.iter_lines()
            assert any(line.startswith("event: content_block_delta") for line in lines)
            os.kill(follower, signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
            faulted = time.monotonic()
            rest = list(lines)
        ended = time.monotonic() - faulted
        assert "event: error" in rest, rest[-4:]
        assert ended < 10, f"the stream ended {ended:.1f}s after the rank was {fault}"
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503
        assert health.json()["status"] == "failed"
        assert launcher.wait(20) != 0
    finally:
        if fault == "stalled":
            with contextlib.suppress(ProcessLookupError):  # the launch has ended it
                os.kill(follower, signal.SIGCONT)
        stop_server(server)


def test_a_rank_that_cannot_load_its_shard_stops_the_launch(models: Models, tmp_path: Path) -> None:
    """Three ranks cannot split the tiny llama's 4 attention heads: every rank says so, and the
    launch ends with an error."""
    command = [sys.executable, "-m", "mlxgate", "serve", "--model", str(models["llama"])]
    started = time.monotonic()
    launched = subprocess.run(
        [*command, "--ranks", "3", "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert launched.returncode != 0
    assert "4 attention heads and its 2 key/value heads do not divide over 3 ranks" in (
        launched.stdout + launched.stderr
    )
    assert time.monotonic() - started < 60
