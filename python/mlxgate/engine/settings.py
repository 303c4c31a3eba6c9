"""The engine's settings, each declared once with the help its `mlxgate serve` flag shows."""

from __future__ import annotations

from dataclasses import dataclass

from mlxgate.setting import setting


@dataclass(frozen=True)
class EngineSettings:
    """Admission, batching and prefill scheduling."""

    max_queued: int = setting(
        64,
        "requests that may wait for the engine; beyond them: 529 (Anthropic) or 503 (OpenAI) "
        "with retry-after",
    )
    max_running: int = setting(64, "sequences decoded together in one batch")
    step_token_budget: int = setting(
        0,
        "tokens one engine step may process, one per decoding sequence and the rest on "
        "prefilling waiting prompts; bounds how long a long prompt can delay running streams",
        default_text="adapt, measuring decode steps and prefill passes as they run, so that a "
        "step that prefills takes at most --max-step-ratio times a decode-only step",
    )
    max_step_ratio: float = setting(
        3.0,
        "with the adaptive step budget: how many times a decode-only step's time a step that "
        "also prefills may take while few prompts wait (when more wait, each may take its own "
        "prefill's time, up to a decode step's, all of them at most the geometric mean of a "
        "step's own time and their whole prefill's)",
    )
    # Several short prompts go in one batched pass: ~2x the tokens/s of one prompt alone.
    max_prefill_tokens: int = setting(
        2048,
        "the most prompt tokens one step prefills; with nothing decoding a step takes this many",
    )
    # On CPU longer passes cost more per token (256 tokens: ~245 tok/s, 512: ~195 tok/s with
    # SmolLM2-135M).
    max_prefill_chunk: int = setting(
        256, "the most tokens of one prompt that one forward pass takes"
    )
    min_prefill_chunk: int = setting(
        16, "the fewest prompt tokens a step prefills while prompts wait, however many rows decode"
    )
    prefix_cache_mb: int = setting(
        1024,
        "memory for reusing the KV cache of shared prompt prefixes across requests; 0 turns it off",
    )
    prefix_cache_dir: str | None = setting(
        None,
        "a directory where the prefix cache also keeps its entries, so that a restarted server "
        "reuses them (a subdirectory per model and its settings)",
        metavar="DIR",
        default_text="none: memory only",
    )
    prefix_cache_disk_gb: float = setting(
        20.0,
        "the most disk space the prefix cache's directory may take (every model's files in it); "
        "the least recently used files go first",
        metavar="GB",
    )
    kv_memory_gb: float = setting(
        0.0,
        "memory the running and prefilling sequences' KV caches may hold: a prompt starts only "
        "when its cache fits, a decoding sequence is preempted (its cache kept in the prefix "
        "cache, resumed later exactly) when the batch's would outgrow it, and a prompt that "
        "cannot fit even alone is refused",
        default_text="half the machine's memory after the weights, less the prefix cache's",
    )
    loop_guard_tokens: int = setting(
        384,
        "end a reply once its last N tokens or more repeat one cycle of at most 256 tokens at "
        "least 4 times (Chat Completions: length; Anthropic and Responses: the turn ended); not "
        "for a request that asks for temperature 0 (or loop_guard: false); 0 turns it off",
        metavar="N",
    )
    kv_bits: int = setting(
        0,
        "keep attention keys/values quantized to 8 or 4 bits: 0.28x or 0.16x the bytes of float32 "
        "ones (0.53x or 0.28x of 16-bit ones), so more sequences and prefix cache fit; with "
        "mlxgate's CPU kernels a decode step takes 1.1-1.2x the float cache's (elsewhere 1.5-5x); "
        "outputs are close to the float cache's, not the same. Sliding windows and recurrent "
        "layers keep floats; 0: floats",
    )
    kv_group_size: int = setting(
        64, "with --kv-bits: features sharing one scale and bias (32, 64 or 128)"
    )
    max_draft_tokens: int = setting(
        8,
        "speculative decoding: the most tokens a sequence guesses ahead (from its own prompt "
        "and output, or with --draft-model) for one forward pass to check; 0 turns it off",
    )
    speculation_max_rows: int = setting(
        4,
        "sequences decoding at most, for speculation to run: with more, a step is bound by "
        "compute rather than by reading the weights, and guesses cost throughput",
    )
    ping_interval_s: float = setting(
        10.0,
        "seconds between keep-alive events on a stream whose prompt waits or prefills (clients "
        "and proxies time out on a silent connection)",
    )
    # A reader may fall behind (its frames coalesce); one that stays over the bound this long
    # has stopped reading.
    stall_timeout_s: float = setting(
        30.0,
        "seconds a stream may stay over the router's unread bound before its generation is "
        "cancelled with an error event",
    )
