"""Generation: admission, scheduling and the model-owning engine thread."""

from mlxgate.engine.engine import Engine, EngineSettings
from mlxgate.engine.errors import AdmissionError, EngineStopped, PromptTooLong, QueueFull
from mlxgate.engine.request import GenerationRequest, SamplingParams

__all__ = [
    "AdmissionError",
    "Engine",
    "EngineSettings",
    "EngineStopped",
    "GenerationRequest",
    "PromptTooLong",
    "QueueFull",
    "SamplingParams",
]
