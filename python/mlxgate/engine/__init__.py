"""Generation: admission, scheduling and the model-owning engine thread."""

from mlxgate.engine.contract import (
    AdmissionError,
    EngineStopped,
    GenerationRequest,
    Generator,
    PromptTooLong,
    QueueFull,
    SamplingParams,
)
from mlxgate.engine.engine import Engine, EngineSettings

__all__ = [
    "AdmissionError",
    "Engine",
    "EngineSettings",
    "EngineStopped",
    "GenerationRequest",
    "Generator",
    "PromptTooLong",
    "QueueFull",
    "SamplingParams",
]
