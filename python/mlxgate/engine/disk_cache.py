"""The prefix cache's disk tier: entries written behind the engine, read back ahead of prefill.

Format: one safetensors file per block or snapshot, written and read through the `safetensors`
package's numpy API by two threads of the tier's own, so neither starts MLX work (MLX streams are
per thread; the engine thread is the only one that evaluates). The writer takes the buffers of
arrays the engine evaluated before storing the entry and no one writes to: the buffer protocol on
an evaluated array hands over its pointer and computes nothing, so a write costs the engine
thread nothing. bfloat16, which numpy lacks, is written as its 16 bits (uint16) and its dtype
recorded in the metadata. The engine thread turns what the reader read into MLX arrays when the
prompt starts prefilling (`DiskMatch.caches`), waiting for the read if it is not done (reading a
prefix takes a fraction of computing it). The writer runs at a lower priority: on a busy CPU the
engine's steps come first.

Under DIR/<identity>/ (identity: a hash of everything that changes the numbers, `identity`):
- a model whose caches are all attention keys/values (cuttable) keeps blocks of BLOCK_TOKENS
  tokens, every layer's keys and values for them, named by a hash chain (key_i = H(key_i-1,
  block i's tokens), key_-1 = H(identity, variant)): prompts that share a prefix share blocks;
- a model with windows or recurrent state keeps whole snapshots, `<tokens>-<H(identity,
  variant, tokens)>`: the token count tells a lookup which prefix lengths to hash.

Each file carries its token ids and a CRC-32 of its tensors; a file that fails either check (or
cannot be parsed: truncated) is deleted, logged, and never used: the prompt computes what it
lacked. Writes go to a temporary file renamed into place. The directory is bounded by bytes,
least recently used first (a read touches a file's mtime), other identities' files counted and
evicted alike.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib.metadata
import json
import logging
import os
import queue
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from hashlib import blake2b
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import safetensors.numpy
from mlx.utils import tree_flatten
from mlx_lm.models.cache import CacheList

from mlxgate.engine import cache_kinds
from mlxgate.engine.prefix_cache import CacheEntry, PrefixMatch
from mlxgate.models import LoadedModel, architecture
from mlxgate.models.cpu import kernels

log = logging.getLogger("mlxgate.engine")

BLOCK_TOKENS = 256
SUFFIX = ".safetensors"
WRITER_NICE = 10  # the writer thread's nice value (Linux): it yields the CPU to the engine
FORMAT = 1  # of the files: part of the identity
MAX_QUEUED_WRITES = 16  # entries waiting for the writer; past them an entry is not written

# numpy's dtype for each MLX dtype a cache holds; bfloat16 goes as its bits.
_NUMPY: dict[mx.Dtype, type] = {
    mx.float32: np.float32,
    mx.float16: np.float16,
    mx.bfloat16: np.uint16,
    mx.int32: np.int32,
    mx.uint32: np.uint32,
    mx.int64: np.int64,
    mx.uint8: np.uint8,
    mx.bool_: np.bool_,
}
_MLX = {str(dtype).rpartition(".")[2]: dtype for dtype in _NUMPY}

Make = Callable[[], list[Any]]


def identity(loaded: LoadedModel) -> str:
    """A hash of what the cached numbers depend on: every parameter's name, shape, dtype and a
    sample of its values, the context and rope settings, the kernels and MLX's version. Cheap
    (a few values per parameter), so a cache written by other weights or another quantization
    lands in another directory."""
    model = loaded.model
    flat: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    parameters = sorted(flat, key=lambda item: item[0])
    samples = []
    for _, p in parameters:
        # Contiguous: numpy reads a strided MLX view's buffer wrongly.
        sample = mx.contiguous(p.reshape(-1)[:: max(1, p.size // 64)])
        samples.append(sample.view(mx.uint16) if sample.dtype == mx.bfloat16 else sample)
    mx.eval(samples)
    digest = blake2b(digest_size=12)
    context = dataclasses.asdict(loaded.context) if loaded.context else None
    settings = [
        FORMAT,
        importlib.metadata.version("mlx"),
        architecture(model),
        loaded.context_length,
        context,
        # What load installed (a ModelAdapter's wrapped layers hide it from
        # `kernels.installed`), and whether this machine runs the compiled kernels.
        loaded.kernels,
        kernels.unavailable() is None,
    ]
    digest.update(json.dumps(settings, sort_keys=True, default=str).encode())
    for (name, p), sample in zip(parameters, samples, strict=True):
        digest.update(f"{name} {p.shape} {p.dtype}".encode())
        digest.update(np.array(sample).tobytes())
    return digest.hexdigest()


@dataclass
class DiskStats:
    """What the tier did since start; its threads count, /metrics reads."""

    files: int = 0  # in the directory, every identity's
    bytes: int = 0
    hit_tokens: int = 0  # prompt tokens served from disk
    written_files: int = 0
    written_bytes: int = 0
    write_s: float = 0.0
    read_files: int = 0
    read_bytes: int = 0
    read_s: float = 0.0
    damaged_files: int = 0


@dataclass
class _Read:
    """What the reader thread read: the first `length` tokens' tensors (numpy), by name."""

    length: int
    tensors: dict[str, _Tagged]
    fields: dict[str, Any]  # a snapshot's scalars and lists, by name


class DiskMatch:
    """A prefix found on disk, read since lookup. `caches()` (engine thread) waits for the read and
    builds the caches; a file that fails its checks shrinks `length` to the blocks before it, or
    to the memory match it falls back to, or to nothing."""

    def __init__(
        self, disk: DiskCache, read: Future[_Read], length: int, fallback: PrefixMatch | None
    ) -> None:
        self.length = length
        self._disk = disk
        self._read = read
        self._fallback = fallback
        self._layers: list[Any] | None = None
        self._settled = False

    @property
    def tier(self) -> str:
        """ "disk", or the memory match it fell back to (a file that failed its checks)."""
        if self._settled and self._layers is None and self._fallback is not None:
            return self._fallback.tier
        return "disk"

    def caches(self) -> list[Any]:
        if not self._settled:
            self._settle()
        if self._layers is not None:
            with self._disk.lock:  # each start counts, as the engine's own count does
                self._disk.stats.hit_tokens += self.length
            return [cache_kinds.snapshot(layer) for layer in self._layers]
        if self._fallback is not None:
            return self._fallback.caches()
        return self._disk.make_cache()

    def _settle(self) -> None:
        self._settled = True
        fallback = self._fallback.length if self._fallback is not None else 0
        self.length = fallback
        try:
            read = self._read.result()
            if read.length > fallback:
                self._layers = self._disk.layers(read)
                self.length = read.length
        except Exception:  # whatever went wrong, the prompt computes what it lacks
            log.exception("prefix cache: reading a prefix from disk failed")
            self._layers = None
            self.length = fallback
        self._read = Future()  # the numpy buffers go


class DiskCache:
    """The files of one model identity in `root/identity`, and the threads that write and read
    them. `lookup` (event loop) reads only the index; `write` (engine thread) only queues."""

    def __init__(
        self,
        root: str | Path,
        model: str,
        max_bytes: int,
        make_cache: Make,
        *,
        cuttable: bool,
        block_tokens: int = BLOCK_TOKENS,
    ) -> None:
        self.root = Path(root)
        self.dir = self.root / model
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.make_cache = make_cache
        self.cuttable = cuttable
        self.block_tokens = block_tokens
        self.model = bytes.fromhex(model)
        self.stats = DiskStats()
        self.lock = threading.Lock()  # the index, the sizes and the stats
        # Start-up lists names only: sizes and ages are read by the writer thread.
        self._names = {p.name.removesuffix(SUFFIX) for p in self._listed(self.dir)}
        self._lengths = Counter(int(n.partition("-")[0]) for n in self._names if "-" in n)
        others = [p for p in self.root.iterdir() if p.is_dir() and p != self.dir]
        if others:
            log.info(
                "prefix cache dir %s: %d other models' caches there (not used; counted in "
                "--prefix-cache-disk-gb)",
                self.root,
                len(others),
            )
        self._ages: dict[Path, tuple[float, int]] = {}  # every file under root: (mtime, bytes)
        self._writes: queue.Queue[CacheEntry | None] = queue.Queue(MAX_QUEUED_WRITES)
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="mlxgate-disk-read")
        self._writer = threading.Thread(
            target=self._write_loop, name="mlxgate-disk-write", daemon=True
        )
        self._writer.start()

    @staticmethod
    def _listed(folder: Path) -> Iterator[Path]:
        return (p for p in folder.iterdir() if p.name.endswith(SUFFIX))

    # --- lookup (event loop) ---------------------------------------------------------------

    def _seed(self, variant: int) -> bytes:
        return blake2b(self.model + bytes([variant]), digest_size=16).digest()

    def lookup(
        self,
        tokens: np.ndarray,
        variant: int,
        limit: int,
        fallback: PrefixMatch | None,
        longer_than: int = 0,
    ) -> DiskMatch | None:
        """The longest prefix of `tokens` (at most `limit` of them) on disk, if longer than
        `fallback` (the memory tier's match) and `longer_than`: its reading starts now."""
        floor = max(longer_than, fallback.length if fallback is not None else 0)
        with self.lock:
            if self.cuttable:
                names = self._blocks(tokens, variant, limit)
                length = len(names) * self.block_tokens
            else:
                length, name = self._snapshot(tokens, variant, limit, floor)
                names = [name] if name else []
        if length <= floor:
            return None
        read = self._reader.submit(self._read_files, names, tokens[:length])
        return DiskMatch(self, read, length, fallback)

    def _blocks(self, tokens: np.ndarray, variant: int, limit: int) -> list[str]:
        key, names, size = self._seed(variant), [], self.block_tokens
        for start in range(0, limit - size + 1, size):
            key = blake2b(key + tokens[start : start + size].tobytes(), digest_size=16).digest()
            if key.hex() not in self._names:
                break
            names.append(key.hex())
        return names

    def _snapshot(
        self, tokens: np.ndarray, variant: int, limit: int, floor: int
    ) -> tuple[int, str]:
        best: tuple[int, str] = (0, "")
        digest = blake2b(self._seed(variant), digest_size=16)
        done = 0
        for length in sorted(n for n in self._lengths if floor < n <= limit):
            digest.update(tokens[done:length].tobytes())
            done = length
            name = f"{length}-{digest.copy().hexdigest()}"
            if name in self._names:
                best = (length, name)
        return best

    def _block_names(self, tokens: np.ndarray, variant: int) -> list[str]:
        key, names, size = self._seed(variant), [], self.block_tokens
        for start in range(0, len(tokens) - size + 1, size):
            key = blake2b(key + tokens[start : start + size].tobytes(), digest_size=16).digest()
            names.append(key.hex())
        return names

    def _snapshot_name(self, tokens: np.ndarray, variant: int) -> str:
        digest = blake2b(self._seed(variant), digest_size=16)
        digest.update(tokens.tobytes())
        return f"{len(tokens)}-{digest.hexdigest()}"

    # --- reading (reader thread, then the engine thread) -------------------------------------

    def _read_files(self, names: list[str], tokens: np.ndarray) -> _Read:
        """The files' tensors, blocks joined in order; stops at the first file that fails."""
        started = time.perf_counter()
        parts: list[dict[str, np.ndarray]] = []
        dtypes: dict[str, str] = {}
        fields: dict[str, Any] = {}
        read_bytes = 0
        for i, name in enumerate(names):
            want = tokens[i * self.block_tokens : (i + 1) * self.block_tokens]
            loaded = self._read_file(name, want if self.cuttable else tokens)
            if loaded is None:
                break
            tensors, dtypes, fields, size = loaded
            parts.append(tensors)
            read_bytes += size
        if not parts:
            return _Read(0, {}, {})
        if self.cuttable:
            length = len(parts) * self.block_tokens
            joined = {key: np.concatenate([p[key] for p in parts], axis=2) for key in parts[0]}
        else:
            length, joined = len(tokens), parts[0]
        with self.lock:
            self.stats.read_files += len(parts)
            self.stats.read_bytes += read_bytes
            self.stats.read_s += time.perf_counter() - started
        return _Read(length, {key: _Tagged(a, dtypes[key]) for key, a in joined.items()}, fields)

    def _read_file(
        self, name: str, tokens: np.ndarray
    ) -> tuple[dict[str, np.ndarray], dict[str, str], dict[str, Any], int] | None:
        """A file's tensors, their dtypes, its fields and its size; None if it is gone or
        damaged (then deleted)."""
        path = self.dir / (name + SUFFIX)
        try:
            data = path.read_bytes()
        except FileNotFoundError:  # evicted since the lookup
            self._forget(path)
            return None
        try:
            tensors, metadata = _decode(data)
            if not np.array_equal(tensors.pop("tokens"), tokens):
                raise ValueError("written for other tokens")
            dtypes = json.loads(metadata["dtypes"])
            fields = json.loads(metadata["fields"])
        except Exception as exc:  # any damage: the file is not used
            log.warning("prefix cache file %s is damaged (%s): deleted, not used", path, exc)
            path.unlink(missing_ok=True)
            self._forget(path)
            with self.lock:
                self.stats.damaged_files += 1
            return None
        now = time.time()
        with contextlib.suppress(FileNotFoundError):  # evicted meanwhile: what was read is good
            os.utime(path, (now, now))
        with self.lock:
            self._ages[path] = (now, len(data))
        return tensors, dtypes, fields, len(data)

    def layers(self, read: _Read) -> list[Any]:
        """Per-layer caches of what was read (engine thread: MLX arrays made here)."""
        arrays = {key: _to_mlx(value) for key, value in read.tensors.items()}
        template = self.make_cache()
        if self.cuttable:

            def leaf(cache: Any, prefix: str) -> Any:
                out = type(cache)()
                out.keys, out.values = arrays[prefix + "keys"], arrays[prefix + "values"]
                out.offset = read.length
                return out

        else:

            def leaf(cache: Any, prefix: str) -> Any:
                out = copy.copy(cache)
                for key, value in read.fields.items():
                    if not key.startswith(prefix):
                        continue
                    name = key.removeprefix(prefix)
                    if isinstance(value, dict):  # a list: its items' tensors or values
                        items = value["list"]
                        value = [
                            arrays[f"{key}.{i}"] if item == _TENSOR else item
                            for i, item in enumerate(items)
                        ]
                    elif value == _TENSOR:
                        value = arrays[key]
                    setattr(out, name, value)
                return out

        return [_rebuild(cache, f"{layer}.", leaf) for layer, cache in enumerate(template)]

    # --- writing (engine thread queues, writer thread writes) --------------------------------

    def write(self, entry: CacheEntry) -> None:
        """Queue an entry (evaluated, never written to) for the writer; never waits."""
        try:
            self._writes.put_nowait(entry)
        except queue.Full:
            log.debug("prefix cache: the disk writer is behind; an entry is not written")

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish the queued writes (up to `timeout_s`) and stop the threads."""
        try:
            self._writes.put(None, timeout=timeout_s)
        except queue.Full:
            return
        self._writer.join(timeout_s)
        self._reader.shutdown(wait=False, cancel_futures=True)

    def _write_loop(self) -> None:
        if hasattr(os, "setpriority"):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        try:
            self._scan()
        except OSError:
            log.exception("prefix cache: listing %s failed; its size is not bounded", self.root)
        while (entry := self._writes.get()) is not None:
            try:
                self._write_entry(entry)
            except Exception:
                log.exception("prefix cache: writing an entry to disk failed")

    def _scan(self) -> None:
        """Every file's size and age, other identities' too; temporary files a crash left go."""
        ages: dict[Path, tuple[float, int]] = {}
        for folder in [p for p in self.root.iterdir() if p.is_dir()]:
            for entry in os.scandir(folder):
                if entry.name.endswith(".tmp"):
                    Path(entry.path).unlink(missing_ok=True)
                elif entry.name.endswith(SUFFIX):
                    stat = entry.stat()
                    ages[Path(entry.path)] = (stat.st_mtime, stat.st_size)
        with self.lock:
            self._ages = ages | self._ages  # reads since start are newer
            self._evict()

    def _write_entry(self, entry: CacheEntry) -> None:
        if self.cuttable:
            self._write_blocks(entry)
        else:
            self._write_snapshot(entry)

    def _write_blocks(self, entry: CacheEntry) -> None:
        """The entry's whole blocks not on disk yet."""
        size = self.block_tokens
        for i, name in enumerate(self._block_names(entry.tokens, entry.variant)):
            if name in self._names:
                continue
            start, end = i * size, (i + 1) * size
            tensors = {
                f"{prefix}{kind}": _to_numpy(getattr(leaf, kind)).block(start, end)
                for prefix, leaf in _leaves_named(entry.layers)
                for kind in ("keys", "values")
            }
            self._write_file(name, tensors, {}, entry.tokens[start:end])

    def _write_snapshot(self, entry: CacheEntry) -> None:
        """Every attribute of each layer cache: arrays as tensors, the rest as fields."""
        name = self._snapshot_name(entry.tokens, entry.variant)
        if name in self._names:
            return
        tensors: dict[str, _Tagged] = {}
        fields: dict[str, Any] = {}
        for prefix, leaf in _leaves_named(entry.layers):
            for attr, value in vars(leaf).items():
                key = prefix + attr
                if isinstance(value, mx.array):
                    tensors[key], fields[key] = _to_numpy(value), _TENSOR
                elif isinstance(value, list):
                    items: list[Any] = []
                    for i, item in enumerate(value):
                        if isinstance(item, mx.array):
                            tensors[f"{key}.{i}"] = _to_numpy(item)
                            item = _TENSOR
                        items.append(item)
                    fields[key] = {"list": items}
                else:
                    fields[key] = value
        self._write_file(name, tensors, fields, entry.tokens)

    def _write_file(
        self,
        name: str,
        tensors: dict[str, _Tagged],
        fields: dict[str, Any],
        tokens: np.ndarray,
    ) -> None:
        started = time.perf_counter()
        arrays = {key: np.ascontiguousarray(value.array) for key, value in tensors.items()}
        arrays["tokens"] = np.ascontiguousarray(tokens, dtype=np.int32)
        dtypes = {key: value.dtype for key, value in tensors.items()}
        metadata = {
            "crc32": str(_checksum(arrays)),
            "dtypes": json.dumps(dtypes),
            "fields": json.dumps(fields),
        }
        path = self.dir / (name + SUFFIX)
        temporary = path.with_name(f".{name}.{os.getpid()}.tmp")
        # Straight to the file: a third fewer copies than serializing to bytes first.
        safetensors.numpy.save_file(arrays, temporary, metadata=metadata)
        size = temporary.stat().st_size
        os.replace(temporary, path)
        with self.lock:
            self._names.add(name)
            if not self.cuttable:
                self._lengths[len(tokens)] += 1
            self._ages[path] = (time.time(), size)
            self.stats.written_files += 1
            self.stats.written_bytes += size
            self.stats.write_s += time.perf_counter() - started
            self._evict()

    def _evict(self) -> None:
        """Oldest files first until the directory fits (under the lock)."""
        total = sum(size for _, size in self._ages.values())
        if total > self.max_bytes:
            for path in sorted(self._ages, key=lambda p: self._ages[p][0]):
                if total <= self.max_bytes:
                    break
                path.unlink(missing_ok=True)
                total -= self._ages[path][1]
                self._forget_locked(path)
        self.stats.files, self.stats.bytes = len(self._ages), total

    def _forget(self, path: Path) -> None:
        with self.lock:
            self._forget_locked(path)
            self.stats.files = len(self._ages)
            self.stats.bytes = sum(size for _, size in self._ages.values())

    def _forget_locked(self, path: Path) -> None:
        self._ages.pop(path, None)
        if path.parent == self.dir:
            name = path.name.removesuffix(SUFFIX)
            if name in self._names:
                self._names.discard(name)
                if "-" in name:
                    self._lengths[int(name.partition("-")[0])] -= 1
                    self._lengths += Counter()  # drops lengths no file has now


_TENSOR = "tensor"  # a field that is a tensor of the same name


@dataclass(frozen=True)
class _Tagged:
    """A numpy array and the MLX dtype it holds (bfloat16's bits as uint16)."""

    array: np.ndarray
    dtype: str

    def block(self, start: int, end: int) -> _Tagged:
        """Keys or values of tokens start:end."""
        return _Tagged(self.array[:, :, start:end, :], self.dtype)


def _to_numpy(array: mx.array) -> _Tagged:
    """The array's own buffer, no copy (it is evaluated and contiguous: an owned snapshot)."""
    dtype = str(array.dtype).rpartition(".")[2]
    buffer = memoryview(array).cast("B")  # type: ignore[arg-type]
    return _Tagged(np.frombuffer(buffer, dtype=_NUMPY[array.dtype]).reshape(array.shape), dtype)


def _to_mlx(tagged: _Tagged) -> mx.array:
    out = mx.array(tagged.array)
    dtype = _MLX[tagged.dtype]
    return out.view(dtype) if out.dtype != dtype else out


def _checksum(arrays: dict[str, np.ndarray]) -> int:
    crc = 0
    for key in sorted(arrays):
        crc = zlib.crc32(arrays[key].data, crc)
    return crc


def _decode(data: bytes) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """A file's tensors and metadata, its checksum verified (raises on any damage)."""
    header = int.from_bytes(data[:8], "little")
    metadata = json.loads(data[8 : 8 + header])["__metadata__"]
    tensors = safetensors.numpy.load(data)
    if str(_checksum(tensors)) != metadata["crc32"]:
        raise ValueError("checksum mismatch")
    return tensors, metadata


def _leaves_named(layers: list[Any]) -> Iterator[tuple[str, Any]]:
    """Each layer's single caches (a CacheList's parts) with their tensor name prefix."""
    for layer, cache in enumerate(layers):
        parts = cache.caches if type(cache) is CacheList else [cache]
        for part, leaf in enumerate(parts):
            yield f"{layer}.{part}.", leaf


def _rebuild(template: Any, prefix: str, leaf: Callable[[Any, str], Any]) -> Any:
    if type(template) is CacheList:
        return CacheList(*(leaf(c, f"{prefix}{i}.") for i, c in enumerate(template.caches)))
    return leaf(template, f"{prefix}0.")


def configured(
    directory: str | None, gigabytes: float, loaded: LoadedModel, make_cache: Make, cuttable: bool
) -> DiskCache | None:
    """The disk tier the settings ask for, or None."""
    if not directory:
        return None
    return DiskCache(
        directory, identity(loaded), int(gigabytes * 2**30), make_cache, cuttable=cuttable
    )
