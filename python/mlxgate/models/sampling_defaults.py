"""A model's own sampling defaults: what its files recommend for a request that sets nothing.

Read as vLLM reads them, from the model directory's `generation_config.json` (`temperature`,
`top_p`, `top_k`, `repetition_penalty`); a GGUF file's `general.sampling.*` keys are written
there when it is converted (models/gguf). The embedded model's come from its card (below). A
served model's defaults are these under `--models-config`'s and the flags' (app.py).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("mlxgate")

# What generation_config.json may say, as SamplingParams names it (and its type). The context
# size is not Hugging Face's (it penalizes the whole context): a converted GGUF's
# `penalty_last_n`.
KEYS: dict[str, type] = {
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "repetition_penalty": float,
    "repetition_context_size": int,
}

# SmolLM2-135M-Instruct: greedy, with mlx-lm's repetition penalty over its default 20 tokens.
# Measured (docs/models.md): its card's temperature 0.2 and top-p 0.9 answer "What is the capital
# of France?" in broken French for two of three seeds; without a penalty it repeats a stanza
# until the loop guard stops it; over Ollama's 64 tokens, Claude Code's first turn rambled on
# for 2,030 tokens, over 20 it answers in 17.
EMBEDDED: dict[str, float | int] = {
    "temperature": 0.0,
    "repetition_penalty": 1.1,
    "repetition_context_size": 20,
}


def of_directory(path: Path) -> dict[str, float | int]:
    """What `path`'s generation_config.json recommends, of what mlxgate samples with; nothing
    if it has none (or one that cannot be read: said once in the log)."""
    file = path / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        document: Any = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        log.warning("%s is not read (%s): no sampling defaults from it", file, exc)
        return {}
    if not isinstance(document, dict):
        return {}
    found: dict[str, float | int] = {}
    for key, kind in KEYS.items():
        value = document.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            found[key] = kind(value)
    return found
