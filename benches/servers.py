"""The servers the developer scripts start (mlxgate with and without speculation, mlx_lm.server),
with `mlxgate bench`'s `Server` (mlxgate/bench/spawn.py)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from mlxgate.bench.machine import CpuSampler, blas
from mlxgate.bench.spawn import Server, free_port, mlx_lm_command, mlxgate_command, stop_all

__all__ = ["PYTHON", "CpuSampler", "Server", "blas", "free_port", "server_command", "stop_all"]

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable

# Which API dialects each server speaks, and the model name its requests carry.
# `mlxgate_plain` is mlxgate without speculative decoding, the baseline speculation is held to.
DIALECTS = {
    "mlxgate": ("anthropic", "openai"),
    "mlxgate_plain": ("anthropic", "openai"),
    "mlx_lm": ("openai",),
}
MODEL_NAMES = {
    "mlxgate": "SmolLM2-135M-Instruct",
    "mlxgate_plain": "SmolLM2-135M-Instruct",
    "mlx_lm": "default_model",
}
LABELS = {
    "mlxgate": "mlxgate",
    "mlxgate_plain": "mlxgate without speculation",
    "mlx_lm": "mlx_lm.server",
}


def display(command: list[str]) -> str:
    """A shell line for the report; the `-c` code is double-quoted (it holds no " or $)."""
    if len(command) == 3 and command[1] == "-c":
        return f'{command[0]} -c "{command[2]}"'
    return shlex.join(command)


def server_command(name: str, port: int | str, model_dir: Path, extra: list[str]) -> list[str]:
    if name == "mlxgate_plain":
        return mlxgate_command(port, ["--max-draft-tokens", "0", *extra])
    if name == "mlxgate":
        return mlxgate_command(port, extra)
    if name == "mlx_lm":
        return mlx_lm_command(model_dir, port, extra)
    raise ValueError(f"unknown server {name!r} (one of {', '.join(DIALECTS)})")
