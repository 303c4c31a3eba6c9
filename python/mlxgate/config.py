"""Server settings: one dataclass, filled by the CLI and handed to the app factory."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

CONFIG_ENV = "MLXGATE_CONFIG"


@dataclass(frozen=True)
class Config:
    host: str = "127.0.0.1"
    port: int = 8080
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    # Client-facing name -> the served model (its name, or the `model` value as given).
    model_aliases: dict[str, str] = field(default_factory=dict)
    strict_models: bool = False  # answer only the served name and the aliases (else 404)
    # Sampling for requests that do not say (the Anthropic API no longer has these fields).
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_queued: int = 64
    max_running: int = 64
    step_token_budget: int = 0  # 0: adaptive (see EngineSettings)
    prefix_cache_mb: int = 1024
    max_body_bytes: int = 32 * 1024 * 1024
    api_key: str | None = None  # None: no key is checked (loopback use)
    max_per_client: int = 0  # concurrent generation requests per client; 0 = unlimited
    max_output_tokens: int | None = None  # None: max_tokens is clamped to the context
    log_level: str = "info"

    def to_env(self) -> None:
        """Pass the settings to the app factory, which granian calls in its worker process."""
        os.environ[CONFIG_ENV] = json.dumps(asdict(self))

    @classmethod
    def from_env(cls) -> Config:
        raw = os.environ.get(CONFIG_ENV)
        return cls(**json.loads(raw)) if raw else cls()
