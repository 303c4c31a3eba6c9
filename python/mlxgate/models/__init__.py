"""Resolves `--model` (default, GGUF file, mlx-lm directory, Hugging Face id) to a loaded model:
every one through mlx-lm's own loader and tokenizer (a GGUF file converted once, models/gguf.py)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

from mlxgate.models import context, sampling_defaults, vision, yarn
from mlxgate.models.context import ServedContext
from mlxgate.models.cpu import install_kernels, int8, kernels
from mlxgate.models.gguf import loading
from mlxgate.models.tokenizer import ChatTokenizer

if TYPE_CHECKING:
    from mlxgate.models.vision import ImageTokens

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
# Its own 8,192 tokens hold neither Claude Code's first request (~12.8k tokens) nor Codex's
# (~10k): YaRN x4.
DEFAULT_MODEL_CONTEXT = 32768


@dataclass
class LoadedModel:
    name: str
    model: nn.Module
    tokenizer: ChatTokenizer
    context_length: int
    source: str
    context: ServedContext | None = None  # how context_length relates to the model's own
    kernels: str = "MLX's own"  # what runs its matmuls, norms and ropes on the CPU
    vision: ImageTokens | None = None  # how its prompts take images (a vision model)
    # What its files recommend for sampling (models/sampling_defaults.py), and which files.
    sampling: dict[str, float | int] = field(default_factory=dict)
    sampling_source: str = "generation_config.json"
    blocks: str | None = None  # a GGUF's block types and how each is served (gguf.py)

    def describe_context(self) -> str:
        return self.context.describe() if self.context else str(self.context_length)


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
    """The embedded model's Q4_1 GGUF (models/embedded.py: installed, cached or fetched)."""
    from mlxgate.models import embedded

    return embedded.path()


def _load_directory(
    path: Path,
    context_length: int | None,
    rope_scaling: str,
    trust_remote_code: bool,
    dequantize_to: mx.Dtype | None = None,
    shard: Callable[[nn.Module], None] | None = None,
    prepare: Callable[[nn.Module], None] | None = None,
) -> tuple[nn.Module, ChatTokenizer, ServedContext]:
    """`dequantize_to`: serve quantized weights dequantized, in that dtype. `shard`: cuts the
    model to this rank's part (ranks.py) before its weights are read. `prepare`: what the model
    needs as soon as mlx-lm built it (a GGUF conversion's: models/gguf/loading.py)."""
    from mlx_lm.utils import dequantize_model, load_config, load_model

    config = load_config(path)
    served, overrides = context.for_config(config, context_length, rope_scaling)
    # Lazy: the rope is checked before the weights are read.
    model, _ = load_model(
        path, lazy=True, model_config=overrides, trust_remote_code=trust_remote_code
    )
    if prepare is not None:
        prepare(model)
    if dequantize_to is not None and "quantization" in config:
        model = dequantize_model(model)
        model.update(tree_map(lambda w: w.astype(dequantize_to), model.parameters()))
        model.eval()
    context.check_scaled(model, config, served)
    yarn.follow_config(model, config)
    if served.scaling is not None and "model_file" not in config:
        # The same architecture as its config builds it (weights never read): its own rope,
        # for what fits its own context. (A custom architecture keeps the scaled one.)
        from mlx_lm.utils import _get_classes

        model_class, args_class = _get_classes(config)
        native = model_class(args_class.from_dict(config))
        served = context.switch_rope(model, native, served)
    if shard is not None:
        shard(model)
    mx.eval(model.parameters())
    return model, ChatTokenizer.from_pretrained_dir(path), served


def stored_bytes(spec: str | None) -> int:
    """What the weights of the model `--model` names take where they are stored (a directory's
    safetensors, a downloaded repository's, a GGUF file's once converted: converting it if it
    was not), before it is loaded: about what loading it will hold. 0 where that is not known
    without downloading."""
    path = default_model_path() if spec is None else Path(spec).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        from mlxgate.models.gguf import converted

        path = converted(path)  # (its K-quants may take more once converted than in the file)
    if spec is not None and not path.exists() and spec.count("/") == 1:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            path = Path(snapshot_download(spec, local_files_only=True))
        except LocalEntryNotFoundError:
            return 0
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.glob("*.safetensors")) if path.is_dir() else 0


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.tiktoken", "*.txt"]
    return Path(snapshot_download(repo_id, allow_patterns=patterns))


def load(
    spec: str | None,
    trust_remote_code: bool = False,
    context_length: int | None = None,
    rope_scaling: str = "yarn",
    weights: str = "quantized",
    cpu_kernels: bool = True,
    int8_activations: bool = False,
    shard: Callable[[nn.Module], None] | None = None,
) -> LoadedModel:
    """Load the model named by `--model`; None means the embedded default. `trust_remote_code`
    lets a model directory's own `model_file` build its architecture (mlx-lm's custom models).
    `context_length` (None: the model's own; the embedded default's is DEFAULT_MODEL_CONTEXT)
    past the model's own context is reached by `rope_scaling` ("yarn" or "linear").
    `weights`: "quantized" serves quantized weights as stored, "float32" dequantizes them.
    `cpu_kernels`: mlxgate's CPU kernels where this machine runs them (models/cpu/);
    `int8_activations` their int8 path for matmuls of several rows (models/cpu/int8.py).
    `shard`: loads just this rank's part of the model (ranks.py; an mlx-lm model).
    """
    if spec is None and context_length is None:
        context_length = DEFAULT_MODEL_CONTEXT
    dequantize_to = mx.float32 if weights == "float32" else None
    loaded = _load(spec, dequantize_to, trust_remote_code, context_length, rope_scaling, shard)
    language = loaded.model if loaded.vision is None else loaded.model.language_model
    loaded.kernels = install_kernels(language, native=cpu_kernels)
    if int8_activations:
        loaded.kernels += "; " + _install_int8(language)
    if loaded.vision is not None:  # the vision tower keeps MLX's ops
        loaded.kernels += " on the language model, MLX's own on the vision tower"
    if not kernels.installed(loaded.model):
        loading.widen_groups_of_16(loaded.model)  # (a GGUF file's Q6_K tensors)
    return loaded


def _install_int8(model: nn.Module) -> str:
    """The int8-activation path on `model`'s quantized matrices, and what the start-up line says
    of it."""
    if not kernels.installed(model):
        return "no int8 activations (they need the CPU kernels)"
    count, size = int8.install(model)
    if count == 0:
        return "no int8 activations (no quantized matrix they take)"
    return (
        f"int8 activations (not exact) on {count} matrices from {int8.MIN_ROWS} rows, "
        f"{size / 2**20:.0f} MiB more"
    )


def _load(
    spec: str | None,
    dequantize_to: mx.Dtype | None,
    trust_remote_code: bool,
    context_length: int | None,
    rope_scaling: str,
    shard: Callable[[nn.Module], None] | None,
) -> LoadedModel:
    if spec is None:
        path = default_model_path()
        loaded = _load_gguf(DEFAULT_MODEL, path, dequantize_to, context_length, rope_scaling, shard)
        loaded.sampling = {**loaded.sampling, **sampling_defaults.EMBEDDED}
        loaded.sampling_source = "the embedded model's table, docs/models.md"
        return loaded

    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"no such GGUF file: {path}")
        return _load_gguf(path.stem, path, dequantize_to, context_length, rope_scaling, shard)
    if spec.count("/") == 1 and not path.exists():
        path = _download(spec)
        source = f"huggingface:{spec}"
    else:
        source = str(path)
    if path.is_dir() and vision.vision_config(path) is not None:
        if shard is not None:
            raise ValueError("a vision-language model is served by one process (no ranks)")
        model, tokenizer, images, length = vision.load(path, context_length)
        name = spec if source.startswith("huggingface:") else path.name
        sampling = sampling_defaults.of_directory(path)
        return LoadedModel(name, model, tokenizer, length, source, vision=images, sampling=sampling)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} is not an mlx-lm model directory (no config.json)")
        model, tokenizer, served = _load_directory(
            path, context_length, rope_scaling, trust_remote_code, dequantize_to, shard
        )
        name = spec if source.startswith("huggingface:") else path.name
        return _loaded(name, model, tokenizer, served, source, path)
    raise FileNotFoundError(
        f"--model {spec!r}: not a .gguf file, a model directory or an org/repo id"
    )


def _load_gguf(
    name: str,
    path: Path,
    dequantize_to: mx.Dtype | None,
    context_length: int | None,
    rope_scaling: str,
    shard: Callable[[nn.Module], None] | None = None,
) -> LoadedModel:
    from mlxgate.models.gguf import blocks_described, converted

    directory = converted(path)
    prepare = functools.partial(loading.prepare, dequantized=dequantize_to is not None)
    with loading.groups_of_16():
        model, tokenizer, served = _load_directory(
            directory, context_length, rope_scaling, False, dequantize_to, shard, prepare
        )
    loaded = _loaded(name, model, tokenizer, served, str(path), directory)
    loaded.sampling_source = "the GGUF's general.sampling keys"
    if dequantize_to is None:
        loaded.blocks = blocks_described(directory)
    return loaded


def _loaded(
    name: str,
    model: nn.Module,
    tokenizer: ChatTokenizer,
    served: ServedContext,
    source: str,
    directory: Path,
) -> LoadedModel:
    sampling = sampling_defaults.of_directory(directory)
    return LoadedModel(name, model, tokenizer, served.length, source, served, sampling=sampling)
