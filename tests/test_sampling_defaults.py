"""Sampling defaults from the model (models/sampling_defaults.py, app.sampling_layers), the
penalties on the OpenAI API, and the loop guard, against real servers.

What a request leaves unset comes from, first to last: the model's --models-config table, the
flags given, the model's own (generation_config.json, a GGUF's general.sampling keys, the
embedded model's card); a request's own settings always win."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from mlxgate.config import Config
from mlxgate.engine import SamplingParams
from mlxgate.models import LoadedModel, sampling_defaults
from mlxgate.models.gguf import generation_config
from mlxgate.serving import sampling_layers
from mlxgate.specs import ModelSpec
from support import tiny_models
from support.servers import RunningServer, metric, start_server, stop_server

QWEN3_VOCAB = 151936
# A poem the embedded model, greedy, writes as one stanza over and over.
LOOPING: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Write a poem about the sea."}
]
SHORT = [{"role": "user", "content": "What is the capital of France?"}]


def test_a_model_directory_says_its_defaults_in_generation_config(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "eos_token_id": 2}
        )
    )
    assert sampling_defaults.of_directory(tmp_path) == {
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
    }
    (tmp_path / "generation_config.json").write_text("{not json")
    assert sampling_defaults.of_directory(tmp_path) == {}
    assert sampling_defaults.of_directory(tmp_path / "missing") == {}


def test_a_ggufs_sampling_keys_become_its_generation_config() -> None:
    meta = {
        "general.architecture": "llama",
        "llama.context_length": 8192,
        "general.sampling.temp": 0.7,
        "general.sampling.top_k": 40,
        "general.sampling.penalty_repeat": 1.1,
        "general.sampling.penalty_last_n": 64,
    }
    assert generation_config(meta) == {
        "temperature": 0.7,
        "top_k": 40,
        "repetition_penalty": 1.1,
        "repetition_context_size": 64,
    }
    # llama.cpp's last_n: 0 is no penalty, -1 the whole context.
    assert "repetition_penalty" not in generation_config(
        {**meta, "general.sampling.penalty_last_n": 0}
    )
    whole = generation_config({**meta, "general.sampling.penalty_last_n": -1})
    assert whole["repetition_context_size"] == 8192
    assert generation_config({"general.architecture": "llama"}) == {}


def _loaded(sampling: dict[str, float | int], source: str) -> LoadedModel:
    loaded = LoadedModel("m", None, None, 4096, "test", sampling=sampling)  # type: ignore[arg-type]
    loaded.sampling_source = source
    return loaded


def test_the_table_beats_the_flags_which_beat_the_model() -> None:
    loaded = _loaded({"temperature": 0.2, "top_p": 0.9, "top_k": 50}, "its card")
    spec = ModelSpec("m", None, sampling=(("temperature", 0.5),))
    config = Config(temperature=0.8, top_k=7, repetition_penalty=1.2)
    params, sources = SamplingParams.layered(sampling_layers(spec, config, loaded))
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (
        0.5,
        0.9,
        7,
        1.2,
    )
    assert sources == {
        "temperature": "--models-config",
        "top_k": "the flags",
        "repetition_penalty": "the flags",
        "top_p": "its card",
    }
    # --sampling-defaults server: the model's own are not read.
    server = Config(sampling_defaults="server")
    params, sources = SamplingParams.layered(sampling_layers(ModelSpec("m", None), server, loaded))
    assert params == SamplingParams() and sources == {}
    with pytest.raises(ValueError, match=r"its card: top_p = 1\.5 is out of range"):
        SamplingParams.layered(
            sampling_layers(ModelSpec("m", None), Config(), _loaded({"top_p": 1.5}, "its card"))
        )


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """Two tiny models from one directory whose generation_config.json asks for greedy decoding
    with a strong repetition penalty: `a` as its files say, `b` with a table that turns the
    penalty off; --top-k from the flags for both."""
    tmp = tmp_path_factory.mktemp("defaults")
    model = tiny_models.directory(tmp, "llama", vocab_size=QWEN3_VOCAB)
    config = json.loads((model / "generation_config.json").read_text())
    config.update(temperature=0.0, repetition_penalty=3.0)
    (model / "generation_config.json").write_text(json.dumps(config))
    table = tmp / "models.toml"
    table.write_text(
        f'[models.a]\nsource = "{model}"\ndefault = true\n'
        f'[models.b]\nsource = "{model}"\nrepetition_penalty = 0\n'
    )
    running = start_server(
        tmp, "--models-config", str(table), "--top-k", "5", "--sampling-defaults", "model"
    )
    yield running
    stop_server(running)


def _reply(client: openai.OpenAI, model: str, **extra: Any) -> str:
    response = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hello there"}], max_tokens=24, **extra
    )
    return response.choices[0].message.content or ""


def test_a_request_gets_the_models_defaults_and_its_own_settings_win(
    tiny_server: RunningServer,
) -> None:
    client = openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="x", max_retries=0)
    defaults = _reply(client, "a")
    assert defaults == _reply(client, "a", temperature=0, extra_body={"repetition_penalty": 3.0})
    plain = _reply(client, "a", temperature=0, extra_body={"repetition_penalty": 0})
    assert defaults != plain, "the model's repetition penalty changed nothing: a weak test"
    assert _reply(client, "b") == plain  # its table turns the penalty off
    models = {m["id"]: m for m in httpx.get(f"{tiny_server.url}/v1/models").json()["data"]}
    a, b = models["a"], models["b"]
    assert a["sampling_defaults"]["repetition_penalty"] == 3.0
    assert a["sampling_defaults"]["top_k"] == 5
    assert a["sampling_defaults_from"] == {
        "temperature": "generation_config.json",
        "repetition_penalty": "generation_config.json",
        "top_k": "the flags",
    }
    assert b["sampling_defaults"]["repetition_penalty"] == 0
    assert b["sampling_defaults_from"]["repetition_penalty"] == "--models-config"
    assert "repetition_penalty 3.0 (generation_config.json)" in tiny_server.log()


def test_bad_penalties_are_the_openai_400(tiny_server: RunningServer) -> None:
    bad: list[tuple[dict[str, float], str]] = [
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -3}, "presence_penalty"),
        ({"repetition_penalty": -1}, "repetition_penalty"),
        ({"repetition_context_size": 0}, "repetition_context_size"),
    ]
    for body, param in bad:
        response = httpx.post(
            f"{tiny_server.url}/v1/chat/completions",
            json={"model": "a", "messages": [{"role": "user", "content": "hi"}], **body},
        )
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and param in error["message"]


def test_frequency_penalty_changes_a_looping_reply_and_leaves_a_short_one_alone(
    server: RunningServer,
) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)

    def reply(messages: Any, **extra: Any) -> str:
        response = client.chat.completions.create(
            model="x", messages=messages, max_tokens=200, temperature=0, **extra
        )
        return response.choices[0].message.content or ""

    looping = reply(LOOPING)
    lines = [line for line in looping.splitlines() if line.strip()]
    assert max(lines.count(line) for line in lines) >= 4, looping  # greedy, it repeats
    penalized = reply(LOOPING, frequency_penalty=1.0)
    assert penalized != looping
    assert reply(SHORT, frequency_penalty=1.0) == reply(SHORT)  # it repeats nothing


def test_the_loop_guard_ends_a_reply_that_repeats_itself(server: RunningServer) -> None:
    """Greedy by the server's defaults, the poem loops: the guard ends it after a few hundred
    tokens, a length stop on Chat Completions, an end of turn on the Anthropic API (where an
    agent would continue a max_tokens stop). Asked for temperature 0 itself, the request gets no
    guard."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    before = metric(server, "mlxgate_engine_loop_stops_total")
    guarded = client.chat.completions.create(model="x", messages=LOOPING, max_tokens=1000)
    assert guarded.choices[0].finish_reason == "length"
    assert 384 <= guarded.usage.completion_tokens < 700, guarded.usage  # type: ignore[union-attr]
    assert metric(server, "mlxgate_engine_loop_stops_total") == before + 1
    exact = client.chat.completions.create(
        model="x", messages=LOOPING, max_tokens=500, temperature=0
    )
    assert exact.usage.completion_tokens == 500  # type: ignore[union-attr]
    asked = client.chat.completions.create(
        model="x", messages=LOOPING, max_tokens=500, temperature=0, extra_body={"loop_guard": True}
    )
    assert asked.usage.completion_tokens < 500  # type: ignore[union-attr]
    assert metric(server, "mlxgate_engine_loop_stops_total") == before + 2
    assert "the loop guard ended stream" in server.log()
    agent = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    with agent.messages.stream(model="x", messages=LOOPING, max_tokens=32_000) as stream:  # type: ignore[arg-type]
        message = stream.get_final_message()
    assert message.stop_reason == "end_turn" and message.usage.output_tokens < 700, message.usage
    assert metric(server, "mlxgate_engine_loop_stops_total") == before + 3
