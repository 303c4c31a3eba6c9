"""Server settings: one dataclass of declared settings (the engine's nested), filled by the CLI."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from functools import reduce

from mlxgate.engine.settings import EngineSettings
from mlxgate.formats import REASONING_FORMATS, TOOL_FORMATS
from mlxgate.setting import build, setting

CONFIG_ENV = "MLXGATE_CONFIG"


@dataclass(frozen=True)
class Config:
    host: str = setting("127.0.0.1", "address to bind")
    port: int = setting(8080, "port")
    model: tuple[str, ...] = setting(
        (),
        "a model to serve: a .gguf file, an mlx-lm model directory, a Hugging Face org/repo id "
        "(downloaded by mlx-lm) or `embedded`; NAME=SOURCE serves it as NAME (else its file or "
        "directory name, or the id). Repeatable: each is loaded when a request names it, the "
        "first at start-up (the default model, kept loaded)",
        metavar="[NAME=]SOURCE",
        default_text="the embedded SmolLM2-135M-Instruct",
    )
    models_config: str | None = setting(
        None,
        "a TOML file of models to serve besides --model's, a [models.NAME] table each: source, "
        "and any of aliases, context_length, rope_scaling, tool_format, reasoning_format, "
        "draft_model, pinned (loaded at start-up, never unloaded), ttl (seconds), default "
        "(this one answers requests naming no served model)",
        metavar="FILE",
        default_text="none",
    )
    max_model_memory: float = setting(
        0.0,
        "GB the loaded models may hold together (weights, KV caches and prefix caches, as MLX "
        "counts them): loading one that does not fit first unloads the least recently used "
        "idle ones (never a pinned one, never one with running streams); a model larger than "
        "this alone is refused with a clear error",
        metavar="GB",
        default_text="three quarters of the machine's memory",
    )
    model_ttl: float = setting(
        0.0,
        "seconds a loaded model may sit idle before it is unloaded (not the default model nor a "
        "pinned one); a request's keep_alive (seconds or a duration such as 5m; negative: "
        "forever) overrides it for its model",
        metavar="S",
        default_text="0: loaded models stay loaded",
    )
    draft_model: str | None = setting(
        None,
        "a smaller model with the served model's tokenizer (same forms as --model) that guesses "
        "tokens ahead for speculative decoding, in place of prompt lookup",
        metavar="MODEL",
        default_text="none: sequences guess from their own prompt and output",
    )
    context_length: int | None = setting(
        None,
        "tokens of context to serve. Fewer than the model's own caps prompts there; more "
        "scales the model's rotary position embedding by N / its own (--rope-scaling), or stops "
        "the server at start-up if its architecture or config cannot take that",
        metavar="N",
        default_text="the model's own; the embedded model: 32768, YaRN x4 over its 8192",
    )
    rope_scaling: str = setting(
        "yarn",
        "how --context-length stretches the rotary embedding past the model's own context: "
        "yarn (YaRN: interpolates the slow-turning dimensions only) or linear (every position "
        "divided by the factor)",
        choices=("yarn", "linear"),
    )
    weights: str = setting(
        "quantized",
        "how a quantized model's weights are served: quantized (as stored: a GGUF's Q4_1 or Q8_0 "
        "blocks as MLX's affine 4- or 8-bit, no precision lost) or float32 (dequantized once at "
        "load: ~5x the memory, for comparison)",
        choices=("quantized", "float32"),
    )
    no_cpu_kernels: bool = setting(
        False,
        "serve on MLX's own CPU ops, without mlxgate's kernels (quantized matmul, RMSNorm and "
        "RoPE with AVX2; used by default on x86-64 CPUs that have AVX2)",
    )
    int8_activations: bool = setting(
        False,
        "multiply the quantized weights by activations quantized to 8 bits, as integers "
        "(llama.cpp's way), in every matmul of two rows or more (several streams, prefill): "
        "faster there, not exact (greedy output can differ from the default's; "
        "benches/int8_agreement.py measures how often). Needs the CPU kernels; keeps a second "
        "copy of the quantized weights",
    )
    trust_remote_code: bool = setting(
        False,
        "let a model directory whose config.json names a `model_file` run that Python file to "
        "build its architecture (mlx-lm's custom models; only for directories you trust)",
    )
    # Client-facing name -> the served model (its name, or the `model` value as given).
    model_aliases: dict[str, str] = setting(  # noqa: RUF009 (a default_factory: see setting)
        {},
        "also answer to NAME: it is listed in /v1/models and found at /v1/models/NAME. MODEL "
        "must name a served model (its name as /v1/models lists it, or its --model value); "
        "anything else stops the server at start-up. Repeatable",
        name="--model-alias",
        metavar="NAME=MODEL",
    )
    strict_models: bool = setting(
        False,
        "answer only the served models' names and their aliases; a request naming any other "
        "model gets 404 (not_found_error; OpenAI: model_not_found)",
        default_text="with one model (or a default in --models-config), any model name is "
        "answered by it",
    )
    tool_format: str = setting(
        "auto",
        "how the model writes tool calls and how earlier calls are rendered back into its prompt: "
        f"{', '.join(sorted(TOOL_FORMATS))}",
        metavar="NAME",
        choices=("auto", *TOOL_FORMATS),
        default_text="auto: detected from the chat template",
    )
    reasoning_format: str = setting(
        "auto",
        "how the model delimits its reasoning and where its template reads earlier reasoning: "
        f"{', '.join(REASONING_FORMATS)}",
        metavar="NAME",
        choices=("auto", *REASONING_FORMATS),
        default_text="auto: detected from the chat template",
    )
    # For a request that sets none; above the model's own defaults (sampling_defaults).
    temperature: float | None = setting(
        None,
        "sampling temperature for requests that set none; 0 is greedy",
        default_text="the model's own (--sampling-defaults), else 0",
    )
    top_p: float | None = setting(
        None, "top-p for requests that set none", default_text="the model's own, else 1 (off)"
    )
    top_k: int | None = setting(
        None, "top-k for requests that set none", default_text="the model's own, else 0 (off)"
    )
    repetition_penalty: float | None = setting(
        None,
        "mlx-lm's repetition penalty for requests that set none: a recent token's logit divided "
        "by it (multiplied, if negative); 0 or 1 is off",
        default_text="the model's own, else off; the embedded model: 1.1",
    )
    repetition_context_size: int | None = setting(
        None,
        "how many of the last tokens (prompt, then reply) the repetition penalty counts",
        metavar="N",
        default_text="the model's own, else 20",
    )
    sampling_defaults: str = setting(
        "model",
        "what a request that leaves a sampling parameter unset gets: model: the model's own "
        "(its generation_config.json, a GGUF's general.sampling keys, the embedded model's "
        "table), under the flags above and --models-config; server: the flags alone",
        choices=("model", "server"),
    )
    engine: EngineSettings = field(default_factory=EngineSettings)
    api_key: str | None = setting(
        None,
        "require this key as x-api-key or Authorization: Bearer; anything else gets 401",
        default_text="none, no key is checked",
    )
    insecure_public: bool = setting(
        False,
        "allow a --host other than loopback without --api-key (anyone who reaches it can use "
        "the server)",
    )
    allowed_hosts: tuple[str, ...] = setting(
        (),
        "without --api-key, Host header names answered besides loopback ones (the defence "
        "against DNS rebinding: a web page naming its own domain for 127.0.0.1); comma-"
        "separated, repeatable; * answers any",
        metavar="HOST",
    )
    cors_origins: tuple[str, ...] = setting(
        (),
        "web page origins (e.g. https://app.example) whose browser requests are allowed and "
        "answered with CORS headers; others get 403. Comma-separated, repeatable; * allows any",
        metavar="ORIGIN",
        default_text="none: requests from web pages are refused",
    )
    rate_limit: float = setting(
        0,
        "requests a minute per client (API key, else address), in bursts of up to as many; "
        "beyond them: 429 with retry-after",
        metavar="N",
        default_text="no limit",
    )
    max_per_client: int = setting(
        0,
        "concurrent generation requests per client (API key, else address); beyond them: 429 "
        "with retry-after",
        default_text="no limit",
    )
    max_output_tokens: int | None = setting(
        None,
        "the most tokens one reply may have: a request asking for more, or for no limit, gets M",
        default_text="the context's room after the prompt",
    )
    max_body_bytes: int = setting(32 << 20, "the largest request body; larger ones get 413")
    max_images: int = setting(20, "the most images one request may hold; more get 400")
    max_image_bytes: int = setting(
        20 << 20, "the largest image file (sent, or fetched from a URL); larger ones get 400"
    )
    allow_image_urls: bool = setting(
        False,
        "fetch images that requests give by http(s) URL (off: such requests get 400, and the "
        "server reaches no other host for them)",
    )
    image_url_timeout: float = setting(
        10.0, "seconds an image URL's fetch may take (--allow-image-urls)", metavar="S"
    )
    responses_store_mb: int = setting(
        256,
        "memory for Responses API responses kept with `store: true` (for previous_response_id "
        "and GET /v1/responses/ID); the least recently used go first; 0 keeps none",
    )
    drain_timeout: float = setting(
        30.0,
        "on SIGTERM or SIGINT: seconds running generations get to finish (new requests get 503 "
        "with retry-after, /health says draining); the rest then end with an error event",
        metavar="S",
    )
    resume_window: float = setting(
        0.0,
        "keep a dropped stream generating for S seconds: GET /v1/streams/{request-id} with "
        "Last-Event-ID replays what the client missed and follows the rest",
        metavar="S",
        default_text="off",
    )
    record_trace: str | None = setting(
        None,
        "append every generation request to FILE, a JSONL agent trace (session, turn, timing, "
        "body) that `mlxgate bench --trace FILE` replays",
        metavar="FILE",
        default_text="off",
    )
    ranks: int = setting(
        1,
        "serve the model across N processes on this machine, started as `mlx.launch --backend "
        "ring -n N` starts them (over loopback): each holds its shard; rank 0 serves. Under "
        "mlx.launch (several hosts), the group it started is used instead",
        metavar="N",
        default_text="1; under mlx.launch, its group",
    )
    pipeline: bool = setting(
        False,
        "across ranks, pipeline parallel: each rank holds a run of layers (mlx-lm's "
        "pipeline()); else tensor parallel: each holds part of every layer (shard())",
    )
    rank_timeout: float = setting(
        5.0,
        "across ranks: seconds without word from the other ranks before the server fails "
        "(/health 503, every stream ends with an error event, exit non-zero)",
        metavar="S",
    )
    log_level: str = setting("info", "log verbosity", choices=("debug", "info", "warning", "error"))
    log_format: str = setting(
        "text",
        "text: human one-liners; json: one JSON object per line, and per request its id, "
        "route, dialect, model, status, prompt / cached / output tokens, TTFT, duration and how "
        "it ended (finished, cancelled, drained, stalled, error)",
        choices=("text", "json"),
    )

    def to_env(self) -> None:
        """Pass the settings to the app factory, which granian calls in its worker process."""
        os.environ[CONFIG_ENV] = json.dumps(asdict(self))

    @classmethod
    def from_env(cls) -> Config:
        raw = os.environ.get(CONFIG_ENV)
        if not raw:
            return cls()
        data = json.loads(raw)
        return build(cls, lambda path: reduce(dict.__getitem__, path.split("."), data))
