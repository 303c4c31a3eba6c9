"""Generation: admission, scheduling and the model-owning engine thread."""

from typing import TYPE_CHECKING, Any

from mlxgate.engine.constraints import Grammar, GrammarError
from mlxgate.engine.contract import (
    AdmissionError,
    EngineStopped,
    GenerationEngine,
    GenerationRequest,
    PromptTooLong,
    QueueFull,
    SamplingParams,
)
from mlxgate.engine.settings import EngineSettings

if TYPE_CHECKING:
    from mlxgate.engine.engine import Engine


def __getattr__(name: str) -> Any:
    # The engine imports MLX (seconds); the CLI and the server process need only the settings.
    if name == "Engine":
        from mlxgate.engine.engine import Engine

        return Engine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AdmissionError",
    "Engine",
    "EngineSettings",
    "EngineStopped",
    "GenerationEngine",
    "GenerationRequest",
    "Grammar",
    "GrammarError",
    "PromptTooLong",
    "QueueFull",
    "SamplingParams",
]
