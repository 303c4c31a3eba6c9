"""The engine serving the tiny VLMs (support/tiny_vlms.py) with images: greedy output equals
mlx-vlm's own generation on the same prompt and image, alone and continuously batched with
text-only requests and other images; the prefix cache knows an image by its content; a cancel
stops the vision tower between blocks."""

from __future__ import annotations

import hashlib
import io
import tempfile
import threading
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlxgate import models, prompts
from mlxgate._native import Reader, Reply, Router, StreamSpec, Vocab
from mlxgate.api.vision_prompts import VisionPrompts
from mlxgate.engine import Engine, EngineSettings, GenerationRequest
from mlxgate.models import LoadedModel
from support import tiny_vlms
from support.tiny_engine import Expected, Served, assert_same, wait_until

FAMILIES = sorted(tiny_vlms.FAMILIES)
STEPS = 8


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


class VisionServed:
    """The engine over one tiny VLM, loaded as `--model DIR` loads it; token i reads `i,`."""

    def __init__(self, loaded: LoadedModel, directory: Path, **settings: Any) -> None:
        self.loaded = loaded
        self.directory = directory
        rows = loaded.model.language_model.model.embed_tokens.weight.shape[0]
        vocab = Vocab.from_token_bytes([f"{i},".encode() for i in range(rows)], [])
        self.engine = Engine(loaded, Router(vocab), EngineSettings(**settings))
        self.engine.start()

    @property
    def vision(self) -> VisionPrompts:
        assert self.loaded.vision is not None
        return VisionPrompts(self.loaded.vision)

    def request(self, text: str, images: list[Any]) -> GenerationRequest:
        spec = StreamSpec.anthropic(
            model="tiny",
            message_id="msg_t",
            stream=False,
            stop_sequences=[],
            reply=Reply(eos_ids=[]),
        )
        if not images:
            return GenerationRequest(self.loaded.tokenizer.encode(text), spec, STEPS)
        prepared = self.vision.prepare(text, [loaded_image(i) for i in images])
        return GenerationRequest(prepared.ids, spec, STEPS, images=prepared.images)

    def submit(self, request: GenerationRequest) -> Reader:
        return self.engine.admit(request)


def loaded_image(image: Any) -> prompts.LoadedImage:
    data = io.BytesIO()
    image.save(data, format="PNG")
    return prompts.LoadedImage(image, hashlib.sha256(data.getvalue()).digest())


_served: dict[str, VisionServed] = {}


@pytest.fixture(scope="module")
def directories() -> Iterator[dict[str, Path]]:
    with tempfile.TemporaryDirectory() as tmp:
        yield {f: tiny_vlms.write(f, Path(tmp) / f) for f in FAMILIES}


def served(directories: dict[str, Path], family: str, **settings: Any) -> VisionServed:
    key = f"{family}{sorted(settings.items())}"
    if key not in _served:
        directory = directories[family]
        _served[key] = VisionServed(models.load(str(directory)), directory, **settings)
    return _served[key]


@pytest.fixture(scope="module", autouse=True)
def stop_engines() -> Iterator[None]:
    yield
    for server in _served.values():
        server.engine.stop()
    _served.clear()


def prompt(family: str, text: str, image: bool = True) -> str:
    """The family's one-image prompt for `text` (without its image if not `image`)."""
    template = tiny_vlms.PROMPTS[family]
    if not image:
        for mark in ("<|vision_start|><|image_pad|><|vision_end|>", "<start_of_image>", "[IMG]"):
            template = template.replace(mark, "")
    return template.format(text=text)


@cache
def plain_model(directory: Path) -> Any:
    """mlx-vlm's own model from `directory`, on MLX's ops (the served one has mlxgate's kernels
    on its language model)."""
    from mlx_vlm.utils import load

    return load(str(directory))[0]


def reference(server: VisionServed, text: str, images: list[Any]) -> Expected:
    """mlx-vlm's own greedy generation, on its own instance of the model."""
    from mlx_vlm import stream_generate

    out = Expected([], [])
    for step in stream_generate(
        plain_model(server.directory),
        server.vision.processor,
        text,
        image=images or None,
        max_tokens=STEPS,
        temperature=0.0,
    ):
        if len(out.tokens) == STEPS:
            break
        out.tokens.append(int(tiny_vlms.token(step)))
        out.logprobs.append(np.array(tiny_vlms.logprobs(step).astype(mx.float32)).reshape(-1))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_the_kernels_serve_the_language_model_not_the_tower(
    directories: dict[str, Path], family: str
) -> None:
    from mlxgate.models.cpu import attention, kernels, rebind

    loaded = models.load(str(directories[family]))  # (an engine's adapter wraps the layers)
    model = loaded.model
    assert attention.installed(model.language_model)
    assert not attention.installed(plain_model(directories[family]).language_model)
    if kernels.unavailable() is None:
        assert kernels.installed(model.language_model)
        rebound = [m for m in model.vision_tower.modules() if type(m).__module__ == rebind.__name__]
        assert not rebound, "the vision tower keeps MLX's ops"
        assert "on the language model" in loaded.kernels


@pytest.mark.parametrize("family", FAMILIES)
def test_an_image_prompt_gives_mlx_vlm_tokens(directories: dict[str, Path], family: str) -> None:
    server = served(directories, family)
    text = prompt(family, "Describe the image.")
    image = tiny_vlms.image(0)
    tokens, usage = Served.result(server.submit(server.request(text, [image])))
    assert_same(tokens, reference(server, text, [image]), family)
    assert usage["input_tokens"] > len(server.loaded.tokenizer.encode(text))  # image tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_with_text_and_other_images(directories: dict[str, Path], family: str) -> None:
    """Three at once: an image, text only, another image (another size): each is its own
    mlx-vlm output, continuously batched with the others."""
    server = served(directories, family)
    asks = [
        (prompt(family, "Describe the image."), [tiny_vlms.image(0)]),
        (prompt(family, "Say something about cats, at length.", image=False), []),
        (prompt(family, "What is in this picture?"), [tiny_vlms.image(1, 120, 100)]),
    ]
    before = server.engine.metrics.steps
    readers = [server.submit(server.request(text, images)) for text, images in asks]
    for reader, (text, images) in zip(readers, asks, strict=True):
        tokens, _ = Served.result(reader)
        assert_same(tokens, reference(server, text, images), f"{family} {text!r}")
    # Together: fewer steps than one after the other.
    assert server.engine.metrics.steps - before < 3 * (STEPS + 1)


def test_two_images_in_one_prompt(directories: dict[str, Path]) -> None:
    family = "qwen2_5_vl"
    server = served(directories, family)
    mark = "<|vision_start|><|image_pad|><|vision_end|>"
    text = prompt(family, f"Compare {mark} with the first.")
    images = [tiny_vlms.image(0), tiny_vlms.image(1, 120, 100)]
    request = server.request(text, images)
    assert request.images is not None and len(request.images.spans) == 2
    tokens, _ = Served.result(server.submit(request))
    assert_same(tokens, reference(server, text, images), "two images")


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "gemma3"])
def test_the_same_image_next_turn_is_a_cache_hit(directories: dict[str, Path], family: str) -> None:
    """Turn 2 (turn 1, its reply and a new question) reuses turn 1's keys/values through the
    image, without running the vision tower again; the answer is the one computed from
    scratch. The same turn with another image reuses nothing from the image on."""
    server = served(directories, family)
    fresh = served(directories, family, prefix_cache_mb=0)
    first = server.request(prompt(family, "Describe the image."), [tiny_vlms.image(0)])
    reply, _ = Served.result(server.submit(first))
    assert first.images is not None
    span = first.images.spans[0]
    more = server.loaded.tokenizer.encode("And now in French?")
    second = GenerationRequest(
        [*first.prompt_ids, *reply[:-1], *more], first.stream, STEPS, images=first.images
    )
    encoded = server.engine.metrics.vision_s.count
    tokens, usage = Served.result(server.submit(second))
    assert usage["cache_read_input_tokens"] >= span.start + span.length
    assert server.engine.metrics.vision_s.count == encoded  # the image came from the cache
    alone, fresh_usage = Served.result(fresh.submit(second))
    assert fresh_usage["cache_read_input_tokens"] == 0
    assert tokens == alone

    other = server.vision.prepare(
        prompt(family, "Describe the image."), [loaded_image(tiny_vlms.image(1))]
    )
    assert other.ids[: span.start] == first.prompt_ids[: span.start]
    third = GenerationRequest(
        [*other.ids, *reply[:-1], *more], first.stream, STEPS, images=other.images
    )
    tokens, usage = Served.result(server.submit(third))
    assert usage["cache_read_input_tokens"] <= span.start
    assert server.engine.metrics.vision_s.count == encoded + 1
    alone, _ = Served.result(fresh.submit(third))
    assert tokens == alone


class _Hook(nn.Module):
    """Runs `inner`, calling `before` first."""

    def __init__(self, inner: nn.Module, before: Any) -> None:
        super().__init__()
        self.inner = inner
        self.before = before

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.before()
        return self.inner(*args, **kwargs)


def test_cancel_during_the_vision_tower_stops_it(directories: dict[str, Path]) -> None:
    """The client leaves while the first vision block runs: once the engine has dropped the
    request, the tower stops after that block (the last block never runs), and the engine goes
    on serving."""
    family = "qwen2_5_vl"
    server = served(directories, family)
    blocks = server.loaded.model.vision_tower.blocks
    calls = {"first": 0, "last": 0}
    box: dict[str, Reader] = {}
    arrived = threading.Event()
    metrics = server.engine.metrics
    cancelled = metrics.requests_cancelled

    def first() -> None:  # (on the vision thread, while the engine steps on its own)
        calls["first"] += 1
        arrived.wait(10)
        box["reader"].cancel()
        wait_until(lambda: metrics.requests_cancelled > cancelled, server.engine)

    def last() -> None:
        calls["last"] += 1

    first_mlp, last_mlp = blocks[0].mlp, blocks[-1].mlp
    blocks[0].mlp = _Hook(first_mlp, first)
    blocks[-1].mlp = _Hook(last_mlp, last)
    try:
        text = prompt(family, "Describe the image.")
        box["reader"] = server.submit(server.request(text, [tiny_vlms.image(1, 90, 70)]))
        arrived.set()
        wait_until(lambda: server.engine.metrics.requests_cancelled > cancelled, server.engine)
        assert calls == {"first": 1, "last": 0}
    finally:
        blocks[0].mlp, blocks[-1].mlp = first_mlp, last_mlp
    image = tiny_vlms.image(1, 90, 70)
    tokens, _ = Served.result(server.submit(server.request(text, [image])))
    assert_same(tokens, reference(server, text, [image]), "after the cancel")


def test_streams_decode_while_the_vision_tower_runs(directories: dict[str, Path]) -> None:
    """The tower runs beside the engine's steps: a text stream started before the image request
    goes on decoding while the tower is held in its first block (it finishes meanwhile), and
    both answers are mlx-vlm's."""
    family = "gemma3"
    server = served(directories, family)
    blocks = server.loaded.model.vision_tower.vision_model.encoder.layers
    box: dict[str, Reader] = {}
    finished = threading.Event()

    def hold() -> None:  # (on the vision thread)
        finished.wait(60)

    original = blocks[0].mlp
    text = prompt(family, "Tell me a long story about the sea.", image=False)
    blocks[0].mlp = _Hook(original, hold)
    try:
        box["text"] = server.submit(server.request(text, []))
        image_text = prompt(family, "Describe the image.")
        box["image"] = server.submit(server.request(image_text, [tiny_vlms.image(0)]))
        tokens, _ = Served.result(box["text"])  # while the tower waits in its first block
        finished.set()
    finally:
        finished.set()
        blocks[0].mlp = original
    assert_same(tokens, reference(server, text, []), "the text stream")
    image_tokens, _ = Served.result(box["image"])
    assert_same(image_tokens, reference(server, image_text, [tiny_vlms.image(0)]), "the image")
