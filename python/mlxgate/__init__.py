"""mlxgate: a local LLM server for MLX models (the Anthropic Messages, OpenAI Chat Completions and
Responses APIs)."""

import os as _os

from mlxgate.blas import preload_openblas as _preload_openblas

# Must happen before anything imports mlx.core; MLXGATE_NO_OPENBLAS=1 measures the baseline.
if not _os.environ.get("MLXGATE_NO_OPENBLAS"):
    _preload_openblas()

__version__ = "0.1.0"
