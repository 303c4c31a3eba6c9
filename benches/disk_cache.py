"""The prefix cache's disk tier (engine/disk_cache.py) on the embedded model: how fast a long
prompt's keys/values go to disk and come back, and what writing costs the decode steps beside it.

    .venv/bin/python benches/disk_cache.py [--tokens 4096] [--rounds 6] [--steps 24]

Writes: the writer thread's bytes/s (serializing, checksumming, writing, renaming). Reads: the
reader thread's bytes/s (reading, checking, joining the blocks into numpy buffers; the files are
in the page cache, as they are right after writing), and the engine thread's part (numpy to MLX
arrays). Decode: one sequence's decode step time with the writer idle (A) and while it writes
the same entry again under other names (B: only the steps that ended before it finished), A and
B interleaved round by round; the ratio is median B / median A.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import mlxgate  # noqa: F401  (preloads OpenBLAS before mlx.core)

import mlx.core as mx  # isort: skip
import numpy as np  # isort: skip

from mlxgate.engine import cache_kinds
from mlxgate.engine.cache_kinds import CacheLayout
from mlxgate.engine.disk_cache import MAX_QUEUED_WRITES, DiskCache, identity
from mlxgate.engine.prefix_cache import CacheEntry
from mlxgate.models import load
from mlxgate.models.adapter import ModelAdapter


def prefill(model: Any, caches: list[Any], tokens: list[int], chunk: int = 512) -> mx.array:
    for start in range(0, len(tokens), chunk):
        logits = model(mx.array(tokens[start : start + chunk])[None], cache=caches)
        mx.eval(logits, [cache_kinds.arrays(c) for c in caches])
    return logits[:, -1, :]  # type: ignore[no-any-return]


def wait_for(condition: Any, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the disk tier did not finish")
        time.sleep(0.001)


def decode_steps(model: Any, caches: list[Any], token: mx.array, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        logits = model(token.reshape(1, 1), cache=caches)
        token = mx.argmax(logits[:, -1, :], axis=-1)
        mx.eval(token)
        times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="the prompt's length")
    parser.add_argument("--rounds", type=int, default=6, help="A/B rounds of decode steps")
    parser.add_argument("--steps", type=int, default=24, help="decode steps per A or B")
    args = parser.parse_args()

    loaded = load(None, context_length=8192)
    model = loaded.model
    adapter = ModelAdapter(model)
    layout = CacheLayout.of(adapter.make_cache())
    tokens = np.random.default_rng(0).integers(100, 40000, size=args.tokens).tolist()
    caches = adapter.make_cache()
    last = prefill(model, caches, tokens)
    layers = [cache_kinds.snapshot(c, owned=True) for c in caches]
    mx.eval([cache_kinds.arrays(layer) for layer in layers])
    nbytes = sum(cache_kinds.nbytes(layer) for layer in layers)
    entry = CacheEntry(np.asarray(tokens, dtype=np.int32), layers, nbytes)
    print(
        f"{loaded.name}: {layout.describe()}; a {args.tokens}-token prompt's cache: "
        f"{nbytes / 2**20:.1f} MiB"
    )

    with tempfile.TemporaryDirectory() as directory:
        disk = DiskCache(
            directory, identity(loaded), 2**40, adapter.make_cache, cuttable=layout.cuttable
        )
        blocks = len(disk._block_names(entry.tokens, 0)) if layout.cuttable else 1
        write_s, walls = [], []
        for variant in range(3):  # the first also touches fresh memory
            before, started = disk.stats.write_s, time.perf_counter()
            disk.write(CacheEntry(entry.tokens, layers, nbytes, variant + 100))
            wait_for(lambda v=variant: disk.stats.written_files >= (v + 1) * blocks)
            walls.append(time.perf_counter() - started)
            write_s.append(disk.stats.write_s - before)
        stats = disk.stats
        size = stats.written_bytes / 3
        print(
            f"write: {blocks} files, {size / 2**20:.1f} MiB in "
            + ", ".join(f"{s:.3f}" for s in write_s)
            + f" s on the writer: {size / min(write_s) / 2**20:.0f} MiB/s at best "
            f"({min(walls):.3f} s wall)"
        )
        disk.write(entry)
        wait_for(lambda: disk.stats.written_files >= 4 * blocks)

        read_s, make_s = [], []
        for _ in range(3):
            before = disk.stats.read_s
            match = disk.lookup(entry.tokens, 0, len(tokens), None)
            assert match is not None
            read = match._read.result()
            read_s.append(disk.stats.read_s - before)
            started = time.perf_counter()
            mx.eval([cache_kinds.arrays(layer) for layer in disk.layers(read)])
            make_s.append(time.perf_counter() - started)
        read_bytes = stats.read_bytes / 3
        print(
            f"read: {read_bytes / 2**20:.1f} MiB in {min(read_s):.3f} s on the reader: "
            f"{read_bytes / min(read_s) / 2**20:.0f} MiB/s; to MLX arrays on the engine "
            f"thread {min(make_s) * 1e3:.1f} ms"
        )

        token = mx.argmax(last, axis=-1)
        decode_steps(model, caches, token, 4)  # warm
        idle, writing = [], []
        variants = iter(range(1, 10_000))
        for _ in range(args.rounds):
            idle += decode_steps(model, caches, token, args.steps)
            target = disk.stats.written_files
            # Enough writes (each under other names, so written in full) to outlast the round.
            writes = min(2 + int(sum(idle[-args.steps :]) / min(walls)), MAX_QUEUED_WRITES)
            for _ in range(writes):
                disk.write(CacheEntry(entry.tokens, layers, nbytes, next(variants)))
                target += blocks
            # Only the steps that ended while the writer still wrote.
            for step_s in decode_steps(model, caches, token, args.steps):
                if disk.stats.written_files < target:
                    writing.append(step_s)
            wait_for(lambda t=target: disk.stats.written_files >= t)
        disk.close()
    a, b = statistics.median(idle), statistics.median(writing)
    print(
        f"decode step: writer idle {a * 1e3:.2f} ms (median of {len(idle)}), writing "
        f"{b * 1e3:.2f} ms (median of {len(writing)}): ratio {b / a:.3f}"
    )


if __name__ == "__main__":
    main()
