"""The prefix cache's disk tier (engine/disk_cache.py): what a restarted engine reuses, exactly.

Each engine here is a fresh start on the same directory (a new PrefixCache, memory empty), so
whatever it reuses came from disk; its greedy output is compared with the first engine's and with
mlx-lm's.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import numpy as np
import openai
import pytest
from test_architectures import Served, assert_same, prompts, reference

from mlxgate.engine.disk_cache import BLOCK_TOKENS, SUFFIX
from support.servers import start_server, stop_server
from support.tiny_models import build, twins

# Every test runs models through the engine.
pytestmark = pytest.mark.slow

# Past two blocks, and not a whole number of them.
PROMPT = prompts(1, 2 * BLOCK_TOKENS + 100, 2 * BLOCK_TOKENS + 101, seed=11)[0]


def served(model: Any, directory: Path) -> Served:
    return Served(model, prefix_cache_dir=str(directory))


def first_run(model: Any, directory: Path, prompt: list[int] = PROMPT) -> list[int]:
    """Generate once on a fresh engine (its entries go to disk), then stop it."""
    first = served(model, directory)
    tokens, usage = first.generate(prompt)
    assert usage["cache_read_input_tokens"] == 0
    first.engine.stop()  # waits for the writer
    return tokens


def block_files(directory: Path, model: Any, prompt: list[int]) -> list[Path]:
    """The files of `prompt`'s blocks, in order."""
    engine = served(model, directory).engine
    disk = engine.disk_cache
    assert disk is not None
    names = disk._block_names(np.asarray(prompt, dtype=np.int32), 0)
    engine.stop()
    return [disk.dir / (name + SUFFIX) for name in names]


@pytest.mark.parametrize(
    ("arch", "dtype"),
    [
        pytest.param("llama", None, id="attention-blocks"),
        pytest.param("llama", mx.bfloat16, id="attention-blocks-bfloat16"),
        pytest.param("qwen3_5", None, id="recurrent-snapshot"),
        pytest.param("gemma3_text", None, id="windowed-snapshot"),
    ],
)
def test_a_restarted_engine_reuses_what_the_last_one_wrote_exactly(
    arch: str, dtype: mx.Dtype | None, tmp_path: Path
) -> None:
    model, reference_model = twins(arch)
    if dtype is not None:  # keys/values in a dtype numpy lacks
        model.set_dtype(dtype)
        reference_model.set_dtype(dtype)
    cold = first_run(model, tmp_path)
    again = served(model, tmp_path)
    engine = again.engine
    computed = engine.metrics.prefill_tokens
    reader = again.submit(PROMPT)
    tokens, usage = again.result(reader)
    assert reader.cached_from == "disk"
    prefix = len(PROMPT) - 1  # a snapshot of all but the last token
    if engine.layout.cuttable:
        prefix = prefix // BLOCK_TOKENS * BLOCK_TOKENS  # whole blocks
    assert usage["cache_read_input_tokens"] == prefix
    assert engine.metrics.prefill_tokens - computed == len(PROMPT) - 1 - prefix
    assert tokens == cold
    if dtype is None:  # (bfloat16 rounds mlx-lm's one pass and our chunks apart)
        assert_same(tokens, reference(reference_model, PROMPT), "from disk")
    disk = engine.disk_cache
    assert disk is not None and disk.stats.hit_tokens == prefix
    if engine.layout.cuttable:
        # Another prompt that shares the first block only: block 0 is shared.
        branch = PROMPT[:BLOCK_TOKENS] + prompts(1, 300, 301, seed=12)[0]
        engine.stop()
        again = served(model, tmp_path)
        tokens, usage = again.generate(branch)
        assert usage["cache_read_input_tokens"] == BLOCK_TOKENS
        if dtype is None:
            assert_same(tokens, reference(reference_model, branch), "branch")
    again.engine.stop()


def test_another_models_files_are_not_used(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first_run(build("llama", seed=0), tmp_path)
    other = build("llama", seed=2)  # the same shapes, other weights
    with caplog.at_level(logging.INFO, logger="mlxgate.engine"):
        again = served(other, tmp_path)
    assert "1 other models' caches there (not used" in caplog.text
    tokens, usage = again.generate(PROMPT)
    assert usage["cache_read_input_tokens"] == 0
    again.engine.stop()
    assert len(list(tmp_path.iterdir())) == 2  # a directory per identity
    alone = Served(other)
    assert tokens == alone.generate(PROMPT)[0]
    alone.engine.stop()


@pytest.mark.parametrize("damage", ["flipped", "truncated"])
def test_a_damaged_block_is_not_used_and_the_output_is_exact(
    damage: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = build("llama")
    cold = first_run(model, tmp_path)
    files = block_files(tmp_path, model, PROMPT)
    assert all(path.exists() for path in files)
    damaged = files[1]  # the first block stays good: the prefix shrinks to it
    data = bytearray(damaged.read_bytes())
    if damage == "flipped":
        data[len(data) // 2] ^= 0xFF
    else:
        del data[len(data) // 2 :]
    damaged.write_bytes(bytes(data))

    beside = prompts(1, 81, 82, seed=14)[0]  # near the rest promised: a group with it
    again = served(model, tmp_path)
    engine = again.engine
    computed, passes = engine.metrics.prefill_tokens, engine.metrics.prefill_passes
    with caplog.at_level(logging.WARNING, logger="mlxgate.engine"):
        # Queued together, so one pass prefills both: the group's widths are what is left to
        # compute once the read fell short, not what the lookup promised.
        with engine.admission._wakeup:
            readers = [again.submit(PROMPT), again.submit(beside)]
        tokens, beside_tokens = (again.result(reader)[0] for reader in readers)
    assert "is damaged" in caplog.text
    assert tokens == cold
    assert engine.metrics.prefill_passes - passes == 1
    computed = engine.metrics.prefill_tokens - computed
    assert computed == len(PROMPT) - 1 - BLOCK_TOKENS + len(beside) - 1
    alone = Served(model)
    assert beside_tokens == alone.generate(beside)[0]
    alone.engine.stop()
    disk = engine.disk_cache
    assert disk is not None
    assert (disk.stats.damaged_files, disk.stats.hit_tokens) == (1, BLOCK_TOKENS)
    engine.stop()  # the prompt's blocks written again
    assert damaged.exists() and damaged.read_bytes() != bytes(data)


def test_a_restarted_server_reports_the_prefix_it_read_from_disk(tmp_path: Path) -> None:
    system = " ".join(f"Rule {i}: answer in plain words, briefly." for i in range(80))
    messages: list[Any] = [
        {"role": "system", "content": system},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    directory = str(tmp_path / "prefixes")

    def ask() -> tuple[int, int, str, str]:
        running = start_server(tmp_path, "--prefix-cache-dir", directory)
        try:
            client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="x", max_retries=0)
            reply = client.chat.completions.create(
                model="m", messages=messages, max_tokens=8, temperature=0
            )
            metrics = httpx.get(f"{running.url}/metrics").text
        finally:
            stop_server(running)  # SIGTERM: the engine stops and the writer finishes
        usage = reply.usage
        assert usage is not None and usage.prompt_tokens_details is not None
        cached = usage.prompt_tokens_details.cached_tokens or 0
        return usage.prompt_tokens, cached, metrics, running.log()

    prompt_tokens, cached, _, _ = ask()
    assert prompt_tokens > 2 * BLOCK_TOKENS and cached == 0
    _, cached, metrics, log = ask()
    assert cached == (prompt_tokens - 1) // BLOCK_TOKENS * BLOCK_TOKENS
    model = 'model="SmolLM2-135M-Instruct"'
    assert f'mlxgate_prefix_cache_hit_tokens_total{{{model},tier="disk"}} {cached}.0' in metrics
    assert f"{prompt_tokens} prompt tokens ({cached} cached from disk)" in log  # request log


def test_the_directory_keeps_to_its_size_least_recently_used_first(tmp_path: Path) -> None:
    model = build("llama")
    first_run(model, tmp_path)
    files = block_files(tmp_path, model, PROMPT)
    block = files[0].stat().st_size
    stranger = tmp_path / "another-model" / ("0" * 32 + SUFFIX)
    stranger.parent.mkdir()
    stranger.write_bytes(b"\0" * block)  # another identity's, older than ours: counted
    old = files[0].stat().st_mtime - 60
    os.utime(stranger, (old, old))
    # Room for three and a half blocks. A prompt that reads block 0 back (a read touches it);
    # then another prompt's two new blocks push out the stranger, then the least recently used
    # of ours: block 1.
    other = prompts(1, 2 * BLOCK_TOKENS + 10, 2 * BLOCK_TOKENS + 11, seed=13)[0]
    again = Served(model, prefix_cache_dir=str(tmp_path), prefix_cache_disk_gb=3.5 * block / 2**30)
    assert again.generate(PROMPT[: BLOCK_TOKENS + 5])[1]["cache_read_input_tokens"] == BLOCK_TOKENS
    again.generate(other)
    again.engine.stop()
    disk = again.engine.disk_cache
    assert disk is not None
    assert not stranger.exists() and files[0].exists() and not files[1].exists()
    assert (disk.stats.files, disk.stats.bytes) == (3, 3 * block)
