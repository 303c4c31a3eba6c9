"""Several models in one server (registry.py): each request answered by the model it names, one
not loaded loaded when named, idle ones unloaded after their TTL or a request's keep_alive, the
least recently used idle one unloaded to make room under --max-model-memory (never a pinned one
nor one with running streams), a model too large refused, the load/unload endpoints, /v1/models
and /metrics per model; and the real Claude Code CLI pointed at the second model."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from mlxgate.api.requests import keep_alive_seconds
from mlxgate.models import DEFAULT_MODEL, stored_bytes
from mlxgate.serving import Turns
from mlxgate.specs import ModelSpec, read_specs
from support.agents import run_claude_code
from support.forced import answer, forced_model_dir
from support.servers import RunningServer, metric, start_server, stop_server

SCRIPT = "I am the scripted model."
QUESTION: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is the capital of France?"}
]


def states(server: RunningServer, headers: dict[str, str] | None = None) -> dict[str, str]:
    listed = httpx.get(f"{server.url}/v1/models", headers=headers).json()["data"]
    return {model["id"]: model["state"] for model in listed}


def wait_for(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def ask(server: RunningServer, model: str, answered_by: str | None = None, **extra: Any) -> str:
    """The reply to QUESTION from `model`; it must say it is `answered_by`'s (`model`'s)."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    reply = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=24, temperature=0, **extra
    )
    assert reply.model == (answered_by or model)
    return reply.choices[0].message.content or ""


@pytest.fixture(scope="module")
def scripted_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second model (Qwen3's tokenizer and template) that answers SCRIPT to anything."""
    return forced_model_dir(
        tmp_path_factory.mktemp("scripted"), "qwen3", script=answer("qwen3", SCRIPT)
    )


@pytest.fixture(scope="module")
def two_models(
    tmp_path_factory: pytest.TempPathFactory, scripted_dir: Path
) -> Iterator[RunningServer]:
    """The embedded model (the default) and the scripted one, loaded when named."""
    tmp = tmp_path_factory.mktemp("two-models")
    args = ["--model", "embedded", "--model", f"scripted={scripted_dir}", "--trust-remote-code"]
    running = start_server(tmp, *args)
    yield running
    stop_server(running)


def test_a_request_is_answered_by_the_model_it_names_loaded_when_named(
    two_models: RunningServer,
) -> None:
    assert states(two_models) == {DEFAULT_MODEL: "loaded", "scripted": "unloaded"}
    alone = ask(two_models, DEFAULT_MODEL)
    # Streamed: the response starts while the model loads (an SSE comment meanwhile), and the
    # SDK reads it as any stream.
    client = openai.OpenAI(base_url=f"{two_models.url}/v1", api_key="x", max_retries=0)
    stream = client.chat.completions.create(
        model="scripted", messages=QUESTION, max_tokens=24, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == SCRIPT
    assert states(two_models) == {DEFAULT_MODEL: "loaded", "scripted": "loaded"}
    assert "s loading the model)" in two_models.log()  # the request log counts the wait
    # Interleaved and at once, the scripted model loading while the embedded one generates:
    # each gets its own model's answer, the embedded one's as alone.
    httpx.post(f"{two_models.url}/v1/models/scripted/unload").raise_for_status()
    names = [DEFAULT_MODEL, "scripted"] * 3
    with ThreadPoolExecutor(len(names)) as pool:
        answers = list(pool.map(lambda name: ask(two_models, name), names))
    assert answers == [alone, SCRIPT] * 3
    anthropic_client = anthropic.Anthropic(base_url=two_models.url, api_key="x", max_retries=0)
    message = anthropic_client.messages.create(
        model="scripted",
        max_tokens=24,
        messages=QUESTION,  # type: ignore[arg-type]
    )
    assert message.model == "scripted" and message.content[0].text == SCRIPT  # type: ignore[union-attr]
    # Each engine's metrics under its model's label.
    assert metric(two_models, "mlxgate_engine_decode_tokens_total", model="scripted") > 0
    assert metric(two_models, "mlxgate_model_state", model="scripted", state="loaded") == 1


def test_an_unknown_model_is_not_found_in_each_dialect(two_models: RunningServer) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        ask(two_models, "gpt-9")
    assert "'gpt-9' is not served here" in str(caught.value)
    client = anthropic.Anthropic(base_url=two_models.url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-9", max_tokens=4, messages=QUESTION)  # type: ignore[arg-type]


def test_the_endpoints_and_keep_alive_unload_and_load(two_models: RunningServer) -> None:
    ask(two_models, "scripted")
    unloaded = httpx.post(f"{two_models.url}/v1/models/scripted/unload")
    assert unloaded.status_code == 200 and unloaded.json()["state"] == "unloaded"
    assert states(two_models)["scripted"] == "unloaded"
    loaded = httpx.post(f"{two_models.url}/v1/models/scripted/load", timeout=60)
    assert loaded.status_code == 200 and loaded.json()["state"] == "loaded"
    assert httpx.post(f"{two_models.url}/v1/models/nothing/load").status_code == 404
    # A request's keep_alive of 0: unloaded once it is idle.
    assert ask(two_models, "scripted", extra_body={"keep_alive": 0}) == SCRIPT
    wait_for(lambda: states(two_models)["scripted"] == "unloaded")
    client = openai.OpenAI(base_url=f"{two_models.url}/v1", api_key="x", max_retries=0)
    for stream in (False, True):  # refused before a streamed answer starts, too
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(
                model="scripted", messages=QUESTION, stream=stream, extra_body={"keep_alive": "x"}
            )
    assert states(two_models)["scripted"] == "unloaded"
    assert metric(two_models, "mlxgate_model_unloads_total", model="scripted", reason="idle") == 1


def test_claude_code_answered_by_a_second_model_loaded_on_demand(
    two_models: RunningServer, tmp_path: Path
) -> None:
    httpx.post(f"{two_models.url}/v1/models/scripted/unload")
    workdir = tmp_path / "work"
    workdir.mkdir()
    run = run_claude_code(
        two_models,
        workdir,
        "--bare",
        "--system-prompt",
        "You are a helpful assistant.",
        "--tools",
        "Bash",
        "-p",
        "Who are you?",
        env={"ANTHROPIC_MODEL": "scripted", "ANTHROPIC_SMALL_FAST_MODEL": DEFAULT_MODEL},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip() == SCRIPT


# --- memory: copies of the embedded model under a budget of two ----------------------------


@pytest.fixture(scope="module")
def budgeted(
    tmp_path_factory: pytest.TempPathFactory, scripted_dir: Path
) -> Iterator[RunningServer]:
    """Three copies of the embedded model (a the default, kept), a budget that holds two, and
    a model whose weights alone are larger than the budget."""
    tmp = tmp_path_factory.mktemp("budgeted")
    huge = tmp / "huge"
    huge.mkdir()
    for item in scripted_dir.iterdir():
        (huge / item.name).symlink_to(item)
    with (huge / "more.safetensors").open("wb") as sparse:
        sparse.truncate(1 << 40)  # a terabyte, on paper
    config = tmp / "models.toml"
    config.write_text(
        '[models.a]\nsource = "embedded"\ndefault = true\n'
        '[models.b]\nsource = "embedded"\n'
        '[models.c]\nsource = "embedded"\naliases = ["c-too"]\n'
        f'[models.huge]\nsource = "{huge}"\n'
    )
    budget_gb = 2.6 * stored_bytes(None) / 2**30
    args = ["--models-config", str(config), "--max-model-memory", f"{budget_gb:.3f}"]
    running = start_server(tmp, *args, "--trust-remote-code")
    yield running
    stop_server(running)


def test_the_budget_unloads_the_least_recently_used_idle_model(budgeted: RunningServer) -> None:
    assert states(budgeted) == {
        "a": "loaded",
        "b": "unloaded",
        "c": "unloaded",
        "c-too": "unloaded",
        "huge": "unloaded",
    }
    reference = ask(budgeted, "a")
    assert ask(budgeted, "b") == reference
    # c (by its alias): no room for three, b goes (a is the default: kept).
    assert ask(budgeted, "c-too", answered_by="c") == reference
    assert states(budgeted)["b"] == "unloaded" and states(budgeted)["c"] == "loaded"
    assert metric(budgeted, "mlxgate_model_unloads_total", model="b", reason="memory") == 1
    # A name no model has is the default model's (the models file chose one).
    assert ask(budgeted, "anything", answered_by="a") == reference


def test_a_model_with_running_streams_is_not_unloaded_under_them(budgeted: RunningServer) -> None:
    ask(budgeted, "c")
    # Seconds of prefill, then up to 2000 tokens nobody reads: c runs all through the test.
    words = " ".join(f"word{i}" for i in range(3000))
    long = [{"role": "user", "content": f"Repeat these words: {words}"}]
    body = {"model": "c", "messages": long, "max_tokens": 2000, "stream": True}
    with httpx.stream("POST", f"{budgeted.url}/v1/chat/completions", json=body, timeout=60) as held:
        chunks = held.iter_raw()  # (held: a dropped iterator closes the response)
        next(chunks)  # admitted (its first chunk); the rest stays unread
        client = openai.OpenAI(base_url=f"{budgeted.url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as caught:  # 503: retry later
            client.chat.completions.create(model="b", messages=QUESTION, max_tokens=4)
        assert caught.value.status_code == 503
        assert "are busy or pinned: retry later" in str(caught.value)
        assert states(budgeted)["c"] == "loaded"
        assert metric(budgeted, "mlxgate_engine_open_streams", model="c") == 1
        del chunks
    wait_for(lambda: metric(budgeted, "mlxgate_engine_open_streams", model="c") == 0)
    ask(budgeted, "b")  # now c is idle: it goes
    assert states(budgeted)["c"] == "unloaded" and states(budgeted)["a"] == "loaded"


def test_a_model_larger_than_the_budget_is_a_clear_error(budgeted: RunningServer) -> None:
    client = anthropic.Anthropic(base_url=budgeted.url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model="huge", max_tokens=4, messages=QUESTION)  # type: ignore[arg-type]
    assert "more than the models' memory budget" in str(caught.value)
    assert states(budgeted)["huge"] == "unloaded"
    assert ask(budgeted, "a")  # and the server goes on


def test_the_unload_endpoint_waits_for_running_streams_even_of_a_pinned_model(
    budgeted: RunningServer,
) -> None:
    words = " ".join(f"word{i}" for i in range(3000))
    long = [{"role": "user", "content": f"Repeat these words: {words}"}]
    body = {"model": "a", "messages": long, "max_tokens": 2000, "stream": True}
    with httpx.stream("POST", f"{budgeted.url}/v1/chat/completions", json=body, timeout=60) as held:
        chunks = held.iter_raw()  # (held: a dropped iterator closes the response)
        next(chunks)
        asked = httpx.post(f"{budgeted.url}/v1/models/a/unload")
        assert asked.status_code == 202 and asked.json()["unloading"]
        assert states(budgeted)["a"] == "loaded"
        del chunks
    wait_for(lambda: states(budgeted)["a"] == "unloaded")
    assert metric(budgeted, "mlxgate_model_unloads_total", model="a", reason="request") == 1
    assert ask(budgeted, "a")  # loaded again when named
    assert states(budgeted)["a"] == "loaded"


# --- the TTL: an idle model's memory comes back ---------------------------------------------


def test_an_idle_model_is_unloaded_after_its_ttl_and_its_memory_freed(tmp_path: Path) -> None:
    running = start_server(
        tmp_path,
        "--model",
        "embedded",
        "--model",
        "copy=embedded",
        "--model-ttl",
        "3",
        "--api-key",
        "sk-right",
    )
    auth = {"authorization": "Bearer sk-right"}
    try:
        before = metric(running, "mlxgate_mlx_active_bytes", auth)
        assert httpx.post(f"{running.url}/v1/models/copy/load").status_code == 401
        assert (
            httpx.post(f"{running.url}/v1/models/copy/load", headers=auth, timeout=60).status_code
            == 200
        )
        weights = metric(running, "mlxgate_model_memory_bytes", auth, model="copy")
        assert weights > 0.8 * stored_bytes(None)
        assert metric(running, "mlxgate_mlx_active_bytes", auth) >= before + weights * 0.9
        wait_for(lambda: states(running, auth)["copy"] == "unloaded", timeout_s=20)
        assert states(running, auth)[DEFAULT_MODEL] == "loaded"  # the default stays
        after = metric(running, "mlxgate_mlx_active_bytes", auth)
        assert after < before + 0.1 * weights
    finally:
        stop_server(running)


# --- configuration ----------------------------------------------------------------------------


def test_the_models_file_and_model_flags_make_the_specs(tmp_path: Path) -> None:
    config = tmp_path / "models.toml"
    config.write_text(
        '[models.coder]\nsource = "models/coder.gguf"\naliases = ["claude-sonnet"]\n'
        'context_length = 16384\ntool_format = "qwen3_coder"\npinned = true\nttl = 60\n'
    )
    base = ModelSpec("", None, rope_scaling="linear")
    chosen = read_specs(["embedded", "small=org/small"], str(config), base, model_ttl_s=30)
    assert [s.name for s in chosen.specs] == [DEFAULT_MODEL, "small", "coder"]
    assert chosen.default == DEFAULT_MODEL and not chosen.answers_any_name
    default, small, coder = chosen.specs
    assert default.source is None and default.pinned
    assert small.source == "org/small" and small.ttl_s == 30 and not small.pinned
    assert small.rope_scaling == "linear"  # the server-wide setting
    assert coder.aliases == ("claude-sonnet",) and coder.context_length == 16384
    assert coder.tool_format == "qwen3_coder" and coder.pinned and coder.ttl_s == 60
    one = read_specs([], None, base, aliases={"claude-local": DEFAULT_MODEL})
    assert one.answers_any_name and one.specs[0].aliases == ("claude-local",)
    for bad, message in [
        ('[models.x]\nsource = "a"\ncolour = "red"\n', "unknown key 'colour'"),
        ("[models.x]\ncontext_length = 5\n", "no source"),
        ('[models.x]\nsource = "a"\npinned = "yes"\n', "pinned = 'yes' has the wrong type"),
        ("models = 3\n", "no [models.NAME] tables"),
        ("[models.x\n", "--models-config"),
    ]:
        config.write_text(bad)
        with pytest.raises(ValueError, match=re.escape(message)):
            read_specs([], str(config), base)
    with pytest.raises(ValueError, match="'small' is given twice"):
        read_specs(["small=a", "small=b"], None, base)
    with pytest.raises(ValueError, match="no model is served as 'other'"):
        read_specs(["a=x"], None, base, aliases={"b": "other"})


def test_keep_alive_takes_seconds_and_durations() -> None:
    assert keep_alive_seconds(None) is None
    assert keep_alive_seconds(0) == 0
    assert keep_alive_seconds(-1) == -1
    assert keep_alive_seconds("5m") == 300
    assert keep_alive_seconds("1h30m") == 5400
    assert keep_alive_seconds("1.5s") == 1.5
    assert keep_alive_seconds("-1m") == -60
    from mlxgate.api.errors import ApiError

    for bad in ("soon", "5", "5 m", ""):
        with pytest.raises(ApiError):
            keep_alive_seconds(bad)


def test_engines_take_equal_shares_of_the_time_not_of_the_steps() -> None:
    """A model whose steps take 4x as long as another's still gets half the time, not 4/5 of it
    (taking turns step by step), and one that was idle is not owed the time it did not use."""
    turns = Turns()
    computed = {"fast": 0.0, "slow": 0.0}
    stop = threading.Event()

    def engine(name: str, step_s: float) -> None:
        while not stop.is_set():
            with turns.turn(name):
                time.sleep(step_s)  # (a step: the turn is held for its length)
                computed[name] += step_s

    fast = threading.Thread(target=engine, args=("fast", 0.004))
    fast.start()
    time.sleep(0.5)  # the fast one alone for a while
    before = dict(computed)
    slow = threading.Thread(target=engine, args=("slow", 0.016))
    slow.start()
    time.sleep(1.0)
    stop.set()
    fast.join()
    slow.join()
    fast_share = (computed["fast"] - before["fast"]) / (
        computed["fast"] - before["fast"] + computed["slow"]
    )
    assert 0.35 < fast_share < 0.65, computed
