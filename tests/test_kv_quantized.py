"""Quantized KV cache (`--kv-bits`): served exactly as mlx-lm computes with its QuantizedKVCache.

Quantized keys are not the float cache's, so the reference is mlx-lm's `generate_step` on a
second instance of the model whose prompt cache is mlx-lm's own `QuantizedKVCache` (one
sequence, alone): batching, slots, bands, chunks, prefix reuse and guesses must change no
token of it (up to a tie, as in test_architectures). How far quantized outputs drift from the
float cache's is measured, not asserted: benches/kv_quantized.py.

The embedded model is checked at 8 bits only. A batch rounds the float keys differently from a
sequence alone (~1e-5 in SmolLM2's), and where a key lies that close to a step between two
quantized levels it lands on the other one: at 4 bits a step is 1/15 of a group's range, enough
to tip a near tie (one of six answers in a run of this test), so batched and alone agree there
only as closely as the float model's own near ties allow.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import openai
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache
from mlx_lm.utils import _get_classes
from test_engine import QUESTIONS, body, make_engine, prompt_ids, submit, text
from test_speculation import Oracle

import mlxgate  # noqa: F401  (preloads OpenBLAS before mlx.core)
from mlxgate.engine import Engine
from mlxgate.engine.prefix_cache import MemoryMatch
from mlxgate.models import LoadedModel, load
from support.servers import start_server, stop_server
from support.tiny_engine import Expected, Served, assert_same, prompts, wait_until
from support.tiny_models import config

STEPS = 12
CHUNK = 16
GROUP = 64


def wide(arch: str, seed: int = 0) -> Any:
    """A tiny random-weight `arch` model with heads of GROUP features (mx.quantize needs whole
    groups along a head: tiny_models' heads of 16 are too small)."""
    cfg = {**config(arch), "head_dim": GROUP}
    model_class, args_class = _get_classes(cfg)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(cfg))
    mx.eval(model.parameters())
    return model


def reference(model: Any, prompt: list[int], bits: int, steps: int = STEPS) -> Expected:
    """mlx-lm's greedy tokens and log-probabilities for `prompt` alone, its plain attention
    layers' keys/values in mlx-lm's QuantizedKVCache from the first token on."""
    from mlx_lm.generate import generate_step

    cache = [
        QuantizedKVCache(group_size=GROUP, bits=bits) if type(c) is KVCache else c
        for c in make_prompt_cache(model)
    ]
    out = Expected([], [])
    for token, logprobs in generate_step(
        mx.array(prompt), model, max_tokens=steps, prompt_cache=cache
    ):
        out.tokens.append(int(token))
        out.logprobs.append(np.array(logprobs.astype(mx.float32)))
    return out


@pytest.fixture(scope="module", params=[8, 4], ids=lambda bits: f"{bits}bit")
def tiny(request: pytest.FixtureRequest) -> Iterator[tuple[Served, Any, int]]:
    bits = request.param
    model = wide("llama")
    served = Served(
        model,
        kv_bits=bits,
        max_prefill_chunk=CHUNK,
        min_prefill_chunk=8,
        prefix_cache_mb=64,
        max_draft_tokens=0,  # guessed tokens: test_guesses_change_no_token
    )
    yield served, wide("llama"), bits
    served.engine.stop()


def test_batched_rows_equal_each_prompt_alone(tiny: tuple[Served, Any, int]) -> None:
    served, model, bits = tiny
    engine = served.engine
    assert engine.layout.describe() == "4 attention layers"
    assert all(type(c) is QuantizedKVCache for c in engine._adapter.make_cache())

    prompt = [5, 17, 3, 99, 42, 7]
    assert_same(served.generate(prompt)[0], reference(model, prompt, bits), "alone")

    # Short prompts of similar lengths at once (prefilled several to a pass) beside two long
    # ones that end first (the columns only those used are then dropped); the short ones end at
    # different steps (free slots, then the band compacted).
    many = prompts(10, 8, 12, seed=2)
    jobs = [(p, 4) for p in prompts(2, 50, 56, seed=9)]
    jobs += [(p, STEPS + 3 * (i % 4)) for i, p in enumerate(many)]
    readers = [served.submit(p, n) for p, n in jobs]
    for i, (reader, (p, n)) in enumerate(zip(readers, jobs, strict=True)):
        assert_same(served.result(reader)[0], reference(model, p, bits, n), f"batched row {i}")

    # A prompt of several chunks joining a running row; then short ones written one after
    # another into the slot the last one left.
    long_prompt = prompts(1, 5 * CHUNK, 5 * CHUNK + 1, seed=3)[0]
    keeper = served.submit(many[0], steps=400)
    wait_until(lambda: engine.metrics.running == 1, engine)
    assert_same(served.generate(long_prompt)[0], reference(model, long_prompt, bits), "chunked")
    for i, p in enumerate(many[1:4]):
        assert_same(served.generate(p)[0], reference(model, p, bits), f"into a slot {i}")
        assert len(engine.decoder.batch.stream_ids) == 2, "a slot was added instead of reused"

    # A prompt hundreds of tokens longer than the running row: a band of its own.
    far = prompts(1, 700, 701, seed=4)[0]
    beside = served.submit(far, steps=40)
    wait_until(lambda: engine.metrics.running == 2, engine)
    assert len(engine.decoder.batch.bands) == 2
    assert_same(served.result(beside)[0], reference(model, far, bits, 40), "own band")
    assert_same(served.result(keeper)[0], reference(model, many[0], bits, 400), "keeper")


def test_cached_prefixes_hold_quantized_keys_and_are_reused_exactly(
    tiny: tuple[Served, Any, int],
) -> None:
    served, model, bits = tiny
    cache = served.engine.prefix_cache
    first = prompts(1, 40, 41, seed=5)[0]
    served.generate(first)
    # An agent's next turn (the whole entry reused) and a branch (the entry cut at 24 tokens).
    turn = first + prompts(1, 20, 21, seed=6)[0]
    tokens, usage = served.generate(turn)
    # All of the first prompt: the first reply's entry holds its last token too (fed by the
    # reply's first step), and the turn looks it up again if it came in before it was stored.
    assert usage["cache_read_input_tokens"] == len(first)
    assert_same(tokens, reference(model, turn, bits), "next turn")
    branch = first[:24] + prompts(1, 20, 21, seed=7)[0]
    tokens, usage = served.generate(branch)
    assert usage["cache_read_input_tokens"] == 24
    assert_same(tokens, reference(model, branch, bits), "branch")
    # Entries are what the cache held: quantized, and counted at their quantized size.
    match = cache.lookup([*turn, 1])
    assert match is not None
    assert isinstance(match, MemoryMatch), match  # the in-memory tier's
    layers = match.entry.layers
    assert all(type(layer) is QuantizedKVCache for layer in layers)
    # Keys and values of float32 (the tiny model's), GROUP features a head.
    floats = len(match.entry.tokens) * sum(
        2 * layer.keys[1].shape[1] * GROUP * 4 for layer in layers
    )
    assert match.entry.nbytes < floats * (0.3 if bits == 8 else 0.2)


def test_guesses_change_no_token(tiny: tuple[Served, Any, int]) -> None:
    """Speculation stays on with quantized keys/values: a verify pass quantizes its guesses'
    keys as decode steps would, and a rejected guess's columns are taken back."""
    _, model, bits = tiny
    served = Served(
        wide("llama"), kv_bits=bits, max_prefill_chunk=CHUNK, speculation_max_rows=64,
        prefix_cache_mb=0,
    )  # fmt: skip
    try:
        oracle = Oracle()
        speculation = served.engine.speculation
        assert speculation is not None
        speculation.propose = oracle
        many = prompts(8, 3, 40, seed=8)
        expected = [reference(model, p, bits, 24) for p in many]
        for p, want in zip(many, expected, strict=True):
            oracle.expect(p, want.tokens)
        readers = [served.submit(p, 24) for p in many]
        for i, reader in enumerate(readers):
            assert_same(served.result(reader)[0], expected[i], f"row {i}")
        metrics = served.engine.metrics
        assert 0 < metrics.accepted_tokens < metrics.drafted_tokens
    finally:
        served.engine.stop()


@pytest.mark.parametrize(
    ("arch", "described"),
    [
        ("gemma3_text", "4 layers: 2 sliding-window attention, 2 attention"),
        ("qwen3_next", "4 layers: 2 recurrent, 2 attention"),
    ],
)
def test_windows_and_recurrent_layers_keep_floats_beside_quantized_ones(
    arch: str, described: str
) -> None:
    served = Served(wide(arch), kv_bits=8, max_prefill_chunk=CHUNK, prefix_cache_mb=64)
    try:
        engine, model = served.engine, wide(arch)
        assert engine.layout.describe() == described
        caches = engine._adapter.make_cache()
        assert sum(type(c) is QuantizedKVCache for c in caches) == 2
        assert not any(type(c) is KVCache for c in caches)
        many = prompts(8, 3, 30, seed=10)
        readers = [served.submit(p) for p in many]
        for i, (reader, p) in enumerate(zip(readers, many, strict=True)):
            assert_same(served.result(reader)[0], reference(model, p, 8), f"row {i}")
        # Reused only whole (a snapshot): a window or a recurrent state cannot be cut.
        first = prompts(1, 40, 41, seed=11)[0]
        served.generate(first)
        turn = first + prompts(1, 20, 21, seed=12)[0]
        tokens, usage = served.generate(turn)
        assert usage["cache_read_input_tokens"] == len(first) - 1
        assert_same(tokens, reference(model, turn, 8), "next turn")
    finally:
        served.engine.stop()


def test_a_model_that_cannot_attend_over_quantized_keys_is_refused_at_start_up() -> None:
    with pytest.raises(ValueError, match="attention sinks"):
        Served(wide("gpt_oss"), kv_bits=8)


def test_a_head_the_group_size_does_not_divide_is_refused_at_start_up() -> None:
    with pytest.raises(ValueError, match="cannot attend over quantized keys/values"):
        Served(wide("llama"), kv_bits=8, kv_group_size=128)
    with pytest.raises(ValueError, match="--kv-bits must be"):
        Served(wide("llama"), kv_bits=3)


# --- the embedded model -------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm() -> LoadedModel:
    return load(None, context_length=8192)


def test_the_embedded_model_batches_and_reuses_exactly(
    smollm: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlxgate.models.cpu import kernels

    kernel_calls = []
    if kernels.unavailable() is None:  # its attention over the quantized keys is the kernel's
        extension = kernels.extension()
        attend = extension.quantized_scaled_dot_product_attention

        def counted(*args: Any, **kwargs: Any) -> Any:
            out = attend(*args, **kwargs)
            kernel_calls.append(out is not None)
            return out

        monkeypatch.setattr(extension, "quantized_scaled_dot_product_attention", counted)
    engine: Engine = make_engine(smollm, kv_bits=8)
    try:
        assert all(type(c) is not KVCache for c in engine._adapter.make_cache())
        shared = "Answer briefly and precisely. " * 10
        prompts_ = [prompt_ids(engine, shared + q) for q in QUESTIONS[:6]]
        engine.prefix_cache.max_bytes, saved = 0, engine.prefix_cache.max_bytes  # all computed
        try:
            alone = [text(body(submit(engine, ids, 16))) for ids in prompts_]
        finally:
            engine.prefix_cache.max_bytes = saved
        # Together, then again from the prefix cache the first run filled.
        together = [text(body(r)) for r in [submit(engine, ids, 16) for ids in prompts_]]
        again = [body(submit(engine, ids, 16)) for ids in prompts_]
        assert together == alone
        assert [m["usage"]["cache_read_input_tokens"] for m in again] == [
            len(p) - 1 for p in prompts_
        ]
        assert [text(m) for m in again] == alone
        assert "Paris" in alone[0]
        assert kernels.unavailable() is not None or (kernel_calls and all(kernel_calls))
    finally:
        engine.stop()


def test_a_server_with_quantized_kv_answers(tmp_path: Path) -> None:
    server = start_server(tmp_path, "--kv-bits", "8", "--context-length", "8192")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-local", max_retries=0)
        started = time.monotonic()
        answer = client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": QUESTIONS[0]}],
            max_tokens=16,
            temperature=0,
        )
        assert time.monotonic() - started < 60
        assert "Paris" in (answer.choices[0].message.content or "")
        assert "quantized KV cache: 30 attention layers at 8 bits" in server.log()
    finally:
        stop_server(server)
