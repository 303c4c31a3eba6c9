"""`--context-length`: past the model's own context through its rope scaling, served exactly as
mlx-lm runs the same scaled model; below it, prompts capped there; a model whose rope cannot take
the scaling refused at start-up.

Tiny random-weight models (support/tiny_models.py) written as mlx-lm model directories whose own
context is NATIVE tokens, so that prompts go past it cheaply.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from test_architectures import CHUNK

import mlxgate  # noqa: F401  (preloads OpenBLAS before mlx.core)
from mlxgate import models
from mlxgate.models.context import ContextLengthError
from support import tiny_models
from support.servers import REPO, RunningServer, free_port, start_server, stop_server
from support.tiny_engine import STEPS, Served, assert_same, prompts, reference

NATIVE = 256
SCALED = 4 * NATIVE


def model_dir(parent: Path, arch: str, **config: Any) -> Path:
    """A random-weight `arch` model directory (qwen3's tokenizer) whose own context is NATIVE."""
    return tiny_models.directory(parent, arch, max_position_embeddings=NATIVE, **config)


def mlx_lm_model(directory: Path, rope_scaling: dict[str, Any] | None = None) -> Any:
    """The model as mlx-lm loads it, with `rope_scaling` written into its config."""
    from mlx_lm.utils import load_model

    overrides = {"rope_scaling": rope_scaling} if rope_scaling else None
    return load_model(directory, model_config=overrides)[0]


@pytest.mark.parametrize(
    ("arch", "scaling", "described"),
    [
        ("llama", "yarn", "1024 (YaRN x4 over 256, its own rope within)"),
        ("qwen3", "yarn", "1024 (YaRN x4 over 256, its own rope within)"),
        ("llama", "linear", "1024 (linear x4 over 256, its own rope within)"),
        # Scales its global layers only; the sliding-window layers keep their own rope.
        ("gemma3_text", "yarn", "1024 (YaRN x4 over 256, its own rope within)"),
    ],
)
def test_past_the_native_context_output_equals_mlx_lm_on_the_scaled_model(
    tmp_path: Path, arch: str, scaling: str, described: str
) -> None:
    """A sequence that may outgrow the native context is served as mlx-lm serves the scaled
    model; one that fits it, as mlx-lm serves the model as it is: alone and batched together."""
    import mlx.core as mx

    directory = model_dir(tmp_path, arch)
    loaded = models.load(str(directory), context_length=SCALED, rope_scaling=scaling)
    assert loaded.context_length == SCALED
    assert loaded.describe_context() == described
    assert loaded.context is not None and loaded.context.native_window
    # What a user of mlx-lm gets by writing the scaling into config.json.
    rope_scaling = {"type": scaling, "factor": 4.0, "original_max_position_embeddings": NATIVE}
    scaled = mlx_lm_model(directory, rope_scaling)
    native = mlx_lm_model(directory)
    long_prompt = prompts(1, 3 * NATIVE + 40, 3 * NATIVE + 41, seed=1)[0]
    short_prompt = [5, 17, 3, 99]
    for prompt in (long_prompt, short_prompt):
        scaled_logits = scaled(mx.array([prompt]))
        native_logits = native(mx.array([prompt]))
        assert not np.allclose(np.asarray(scaled_logits), np.asarray(native_logits), atol=1e-3)

    def expected(prompt: list[int], steps: int = STEPS) -> Any:
        fits = len(prompt) + steps <= NATIVE
        return reference(native if fits else scaled, prompt, steps)

    served = Served(
        loaded.model, loaded.context_length, context=loaded.context, max_prefill_chunk=CHUNK
    )
    try:
        for prompt in (short_prompt, long_prompt):
            tokens, usage = served.generate(prompt)
            assert usage["input_tokens"] == len(prompt)
            assert_same(tokens, expected(prompt), f"alone, {len(prompt)} tokens")
        # Past the native window only by what it may write: the scaled rope.
        near = prompts(1, NATIVE - 5, NATIVE - 4, seed=3)[0]
        assert_same(served.generate(near)[0], reference(scaled, near), "near the end")
        # Prompts on both sides of the native length, prefilled in chunks (short ones several to
        # a pass) and decoded together.
        many = prompts(8, 3, 2 * NATIVE, seed=2) + prompts(4, 3, 12, seed=4)
        assert {len(p) + STEPS <= NATIVE for p in many} == {True, False}
        readers = [served.submit(prompt) for prompt in many]
        for i, (reader, prompt) in enumerate(zip(readers, many, strict=True)):
            got = served.result(reader)[0]
            assert_same(got, expected(prompt), f"batched row {i}, {len(prompt)} tokens")
    finally:
        served.engine.stop()


def test_a_sequence_that_fits_the_native_context_is_capped_there(tmp_path: Path) -> None:
    """With no max_tokens, a short prompt is served in the model's own window (its own rope),
    so its output stops where that window ends; asked for more, it gets the scaled rope."""
    directory = model_dir(tmp_path, "llama")
    loaded = models.load(str(directory), context_length=SCALED)
    served = Served(loaded.model, loaded.context_length, context=loaded.context)
    try:
        prompt = prompts(1, NATIVE - 20, NATIVE - 19, seed=5)[0]
        usage = served.generate(prompt, steps=None)[1]  # type: ignore[arg-type]
        assert usage["output_tokens"] == NATIVE - len(prompt)
        longer = served.generate(prompt, steps=40)[0]
        assert len(longer) == 40
        assert_same(longer, reference(mlx_lm_model(directory, _yarn(4.0)), prompt, 40), "more")
    finally:
        served.engine.stop()


def _yarn(factor: float) -> dict[str, Any]:
    return {"type": "yarn", "factor": factor, "original_max_position_embeddings": NATIVE}


@pytest.mark.parametrize(
    ("arch", "config", "refusal"),
    [
        ("qwen3_moe", {}, "qwen3_moe builds its rotary position embedding without the config's"),
        ("gemma2", {}, "gemma2 builds its rotary position embedding without the config's"),
        ("phi3", {}, "phi3 does not take a yarn rope scaling"),
        ("nemotron_h", {}, "nemotron_h has no rotary position embedding"),
        (
            "llama",
            {"rope_scaling": {"type": "linear", "factor": 2.0}},
            "config already scales its rotary embedding (linear x2) to 256 tokens",
        ),
    ],
)
def test_a_model_that_cannot_take_the_scaling_is_refused(
    tmp_path: Path, arch: str, config: dict[str, Any], refusal: str
) -> None:
    directory = model_dir(tmp_path, arch, **config)
    with pytest.raises(ContextLengthError) as refused:
        models.load(str(directory), context_length=SCALED)
    assert refusal in str(refused.value)
    assert f"--context-length {SCALED}" in str(refused.value)
    # At its own context it is served as it is.
    assert models.load(str(directory)).context_length == NATIVE


def test_a_config_scaling_of_its_own_is_kept_up_to_what_it_covers(tmp_path: Path) -> None:
    # Qwen's way: max_position_embeddings stays the original length, YaRN on top.
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": NATIVE}
    directory = model_dir(tmp_path, "qwen3", rope_scaling=yarn)
    loaded = models.load(str(directory))
    assert (loaded.context_length, loaded.describe_context()) == (SCALED, str(SCALED))
    assert loaded.model.model.layers[0].self_attn.rope.mscale == pytest.approx(1.1386, abs=1e-4)
    with pytest.raises(ContextLengthError, match="already scales its rotary embedding"):
        models.load(str(directory), context_length=2 * SCALED)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_dir(tmp_path_factory.mktemp("models"), "llama")


@pytest.fixture
def scaled_server(tiny_dir: Path, tmp_path: Path) -> Iterator[RunningServer]:
    running = start_server(tmp_path, "--model", str(tiny_dir), "--context-length", str(SCALED))
    yield running
    stop_server(running)


@pytest.fixture
def capped_server(tiny_dir: Path, tmp_path: Path) -> Iterator[RunningServer]:
    running = start_server(tmp_path, "--model", str(tiny_dir), "--context-length", "128")
    yield running
    stop_server(running)


def ask(server: RunningServer, text: str, max_tokens: int = 8) -> httpx.Response:
    body = {"model": "m", "max_tokens": max_tokens, "messages": [{"role": "user", "content": text}]}
    return httpx.post(f"{server.url}/v1/messages", json=body, timeout=60)


def test_the_server_serves_prompts_past_the_native_context(scaled_server: RunningServer) -> None:
    assert f"context {SCALED} (YaRN x4 over {NATIVE}, its own rope within)" in scaled_server.log()
    reply = ask(scaled_server, "word " * (2 * NATIVE))
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]
    assert usage["input_tokens"] > 2 * NATIVE and usage["output_tokens"] > 0


def test_a_shorter_context_caps_prompts(capped_server: RunningServer) -> None:
    assert f"context 128 (model: {NATIVE})" in capped_server.log()
    assert ask(capped_server, "word " * 50).status_code == 200
    messages = [{"role": "user", "content": "word " * 200}]
    tokens = httpx.post(
        f"{capped_server.url}/v1/messages/count_tokens", json={"model": "m", "messages": messages}
    ).json()["input_tokens"]
    refused = ask(capped_server, "word " * 200)
    assert refused.status_code == 400
    message = refused.json()["error"]["message"]
    assert message == f"prompt is too long: {tokens} tokens > 128 maximum"


def test_an_unscalable_architecture_stops_the_server_at_start_up(tmp_path: Path) -> None:
    directory = model_dir(tmp_path, "qwen3_moe")
    command = [sys.executable, "-m", "mlxgate", "serve", "--port", str(free_port())]
    run = subprocess.run(
        [*command, "--model", str(directory), "--context-length", str(SCALED)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert run.returncode != 0
    assert (
        f"ContextLengthError: qwen3_moe builds its rotary position embedding without the config's "
        f"rope_scaling (4 of 4 unscaled), so mlxgate cannot give it --context-length {SCALED} past "
        f"its native {NATIVE} tokens; serve at most {NATIVE} tokens"
    ) in run.stdout + run.stderr
