"""Converts a GGUF file, once, into an mlx-lm model directory in the cache.

The directory is what mlx-lm loads: `config.json` from the file's metadata (architectures.py),
the tensors under mlx-lm's names (tensors.py: blocks as MLX's affine quantization where that is
exact, else float32), and the tokenizer transformers builds from the file's metadata
(`tokenizer.json`, its config and chat template), `generation_config.json` from its
`general.sampling.*` keys if it has them, and `gguf_blocks.json`: how each block type of the
file is served and what that costs in bytes (`blocks_described`). It is keyed by the file's
path, size and modification time (and the transformers version), so a changed file is converted
again.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger("mlxgate")

# Part of the cache key: a change to what convert() writes converts every file again.
CONVERSION_VERSION = 6

# What convert() writes about each block type (blocks_described).
BLOCKS_FILE = "gguf_blocks.json"

# llama.cpp's sampling keys (`general.sampling.*`) as generation_config.json names them
# (models/sampling_defaults.py).
SAMPLING_KEYS = {
    "temp": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "penalty_repeat": "repetition_penalty",
    "penalty_last_n": "repetition_context_size",
}


def cache_dir() -> Path:
    """Where mlxgate keeps what it makes once: `$MLXGATE_CACHE`, else `$XDG_CACHE_HOME/mlxgate`,
    else `~/.cache/mlxgate`."""
    if own := os.environ.get("MLXGATE_CACHE"):
        return Path(own).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "mlxgate"


def converted(path: Path) -> Path:
    """The mlx-lm directory of the GGUF file `path`, converted on first use."""
    stat = path.stat()
    # The tokenizer is transformers' conversion: a new transformers converts again too.
    made_by = f"{CONVERSION_VERSION}\0{importlib.metadata.version('transformers')}"
    key = f"{made_by}\0{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}"
    out = cache_dir() / "gguf" / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if (out / "config.json").exists():
        return out
    log.info("converting %s into an mlx-lm model directory (once): %s", path, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Written aside and renamed whole: a directory that exists is complete.
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        staging.chmod(0o755)  # (mkdtemp's is private)
        convert(path, staging)
        try:
            staging.rename(out)
        except OSError:  # another process finished first
            if not (out / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def read_metadata(path: Path) -> dict[str, Any]:
    """The file's metadata as plain Python values (llama.cpp's `gguf` reader)."""
    from gguf import GGUFReader

    return {name: field.contents() for name, field in GGUFReader(path).fields.items()}


def convert(path: Path, out: Path) -> None:
    """Write the mlx-lm model directory of the GGUF file `path` into `out`."""
    import mlx.core as mx
    from gguf import GGUFReader

    from mlxgate.models.gguf import tensors
    from mlxgate.models.gguf.architectures import (
        ARCHITECTURES,
        ROPE_TENSORS,
        config,
        unpermute,
        unshift,
    )

    reader = GGUFReader(path)
    meta = {name: field.contents() for name, field in reader.fields.items()}
    name = meta.get("general.architecture")
    arch = ARCHITECTURES.get(name)  # type: ignore[arg-type]
    if arch is None:
        known = ", ".join(ARCHITECTURES)
        raise ValueError(f"{path.name}: GGUF architecture {name!r} is not supported ({known})")
    weights: dict[str, mx.array] = {}
    blocks: dict[str, dict[str, Any]] = {}  # block type -> how it is served, what it costs
    ropes = {}  # llama.cpp's per-frequency rope factors: a scaling in mlx-lm's config
    for tensor in reader.tensors:
        if tensor.name.startswith(ROPE_TENSORS):
            ropes[tensor.name] = tensors.values(tensor.tensor_type, tensor.data).reshape(-1)
            continue
        parameter = arch.parameter(tensor.name)
        arrays = tensors.read(tensor.tensor_type, tensor.data)
        served_as = tensors.served_as(tensor.tensor_type, arrays)
        kind = blocks.setdefault(
            tensor.tensor_type.name,
            {"served_as": served_as, "tensors": 0, "file_bytes": 0, "bytes": 0},
        )
        kind["tensors"] += 1
        kind["file_bytes"] += int(tensor.n_bytes)
        kind["bytes"] += sum(int(array.nbytes) for array in arrays.values())
        if "scales" not in arrays:
            arrays["weight"] = unshift(arch, parameter, arrays["weight"])
        stem = parameter.rsplit(".", 1)[0]
        for key, array in arrays.items():
            # (a bias is read as a "weight": only a weight has scales and biases)
            name = parameter if key == "weight" else f"{stem}.{key}"
            weights[name] = mx.array(unpermute(arch, stem, array, meta))
    settings = config(path, meta, arch, weights, ropes)
    write_tokenizer(meta, out)
    if sampling := generation_config(meta):
        (out / "generation_config.json").write_text(json.dumps(sampling, indent=2))
    (out / BLOCKS_FILE).write_text(json.dumps(blocks, indent=2))
    (out / "config.json").write_text(json.dumps(settings, indent=2))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})


def blocks_described(directory: Path) -> str | None:
    """How a converted file's block types are served, largest first, for the start-up line:
    e.g. "Q8_0 as 8-bit affine (float16 scales) (10 tensors, 179.8 MB in the file, 190.4 MB
    served, 1.06x), ...; 246.2 MB in the file, 345.1 MB served (1.40x)"; None for a directory
    that is not a conversion."""
    try:
        blocks = json.loads((directory / BLOCKS_FILE).read_text())
    except FileNotFoundError:
        return None
    parts = []
    for kind, block in sorted(blocks.items(), key=lambda item: -item[1]["bytes"]):
        part = f"{kind} as {block['served_as']}"
        if block["bytes"] > block["file_bytes"]:
            part += f" ({block['tensors']} tensors, {_costs(block['file_bytes'], block['bytes'])})"
        parts.append(part)
    in_file = sum(block["file_bytes"] for block in blocks.values())
    served = sum(block["bytes"] for block in blocks.values())
    return f"{', '.join(parts)}; {_costs(in_file, served)}"


def _costs(in_file: int, served: int) -> str:
    growth = served / max(1, in_file)
    return f"{in_file / 1e6:.1f} MB in the file, {served / 1e6:.1f} MB served, {growth:.2f}x"


def generation_config(meta: dict[str, Any]) -> dict[str, float | int]:
    """The file's recommended sampling (`general.sampling.*`), as generation_config.json says it.
    llama.cpp's `penalty_last_n` of 0 turns the penalty off, -1 counts the whole context."""
    found = {
        ours: meta[f"general.sampling.{theirs}"]
        for theirs, ours in SAMPLING_KEYS.items()
        if f"general.sampling.{theirs}" in meta
    }
    last_n = found.get("repetition_context_size")
    if last_n == 0:
        found.pop("repetition_penalty", None)
        found.pop("repetition_context_size")
    elif last_n is not None and last_n < 0:
        arch = meta.get("general.architecture")
        found["repetition_context_size"] = int(meta.get(f"{arch}.context_length", 4096))
    return found


def write_tokenizer(meta: dict[str, Any], out: Path) -> None:
    """The tokenizer files of a Hugging Face model directory, built by transformers from a GGUF
    file's metadata (as `AutoTokenizer.from_pretrained(..., gguf_file=...)` builds it, whose
    own reader needs torch), plus `generation_config.json` with the file's end tokens."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    found = {
        group: {
            name: meta[f"tokenizer.{key}"]
            for key, name in keys.items()
            if f"tokenizer.{key}" in meta
        }
        for group, keys in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer, settings = found["tokenizer"], found["tokenizer_config"]
    tokens = tokenizer["tokens"]
    # As transformers' get_gguf_tokenizer: llama.cpp adds BOS to a sentencepiece vocabulary
    # that does not say otherwise.
    if tokenizer.get("tokenizer_type") == "llama":
        settings.setdefault("add_bos_token", True)
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        settings[f"{name}_token"] = tokens[token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(meta["general.architecture"], tokenizer)
    PreTrainedTokenizerFast(tokenizer_object=backend, **settings, **extra).save_pretrained(out)
    ends = {meta.get(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot")} - {None}
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": sorted(ends)}))
