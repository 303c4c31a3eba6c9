"""An agent's second turn on a hybrid model: how much of its prompt the prefix cache skips.

    PYTHONPATH=benches .venv/bin/python benches/studies/hybrid_turns.py \
        [--arch qwen3_5] [--prefix 2000] [--sessions 3]

A hybrid model (Gated DeltaNet layers beside attention, as Qwen3.5 / Qwen3-Next) keeps a
recurrent state that cannot be cut at an arbitrary token, so its prefix cache keeps snapshots.
Each session sends turn 1 (a `prefix`-token system prompt and a question), then turn 2: the same
prompt, the reply it got, and a new question, as an agent client does. The report gives each
turn's time to first token (in-process, through the real engine and router) and the ratio
turn 2 / turn 1, with the prefix cache on and, as the control, off.

The model is random-weight, built from mlx-lm's own classes at a small but not tiny size (the
ratio depends on how much of the prompt is recomputed, not on what the weights say).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from report import publish

VOCAB = 4096


def hybrid_model(arch: str) -> Any:
    import mlx.core as mx
    from mlx_lm.utils import _get_classes

    text = {
        "model_type": f"{arch}_text" if arch.startswith("qwen3_5") else arch,
        "hidden_size": 512,
        "num_hidden_layers": 8,
        "intermediate_size": 1024,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "rope_theta": 1e6,
        "linear_num_value_heads": 8,
        "linear_num_key_heads": 4,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 4,
        "partial_rotary_factor": 0.25,
        "num_experts": 0,
        "num_experts_per_tok": 0,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": 0,
        "shared_expert_intermediate_size": 0,
        "norm_topk_prob": True,
    }
    config = {"model_type": arch, "text_config": text} if arch.startswith("qwen3_5") else text
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    mx.eval(model.parameters())
    return model


def first_token_s(engine: Any, prompt: list[int], steps: int) -> tuple[float, list[int]]:
    """Seconds to the first streamed token, and the generated ids (token i reads `i,`)."""
    import orjson

    from mlxgate._native import Reply, StreamSpec
    from mlxgate.engine import GenerationRequest

    spec = StreamSpec.anthropic(
        model="m", message_id="msg_b", stream=True, stop_sequences=[], reply=Reply(eos_ids=[])
    )
    started = time.perf_counter()
    reader = engine.admit(GenerationRequest(prompt, spec, steps))
    first: float | None = None
    text = ""
    ready = threading.Event()
    while True:
        data = reader.take()
        if data is None:
            break
        if data:
            for line in data.splitlines():
                if not line.startswith(b"data: "):
                    continue
                delta = orjson.loads(line[len(b"data: ") :]).get("delta", {})
                if delta.get("type") == "text_delta":
                    first = first if first is not None else time.perf_counter() - started
                    text += delta["text"]
            continue
        ready.clear()
        if reader.park(ready, lambda _: ready.set()):
            ready.wait(5.0)
    assert first is not None
    return first, [int(t) for t in text.split(",") if t]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="qwen3_5")
    parser.add_argument("--prefix", type=int, default=2000)
    parser.add_argument("--sessions", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    args = parser.parse_args()

    import numpy as np

    import mlxgate  # noqa: F401  (preloads OpenBLAS before mlx.core)
    from mlxgate._native import Router, Vocab
    from mlxgate.engine import Engine, EngineSettings
    from mlxgate.models import LoadedModel
    from mlxgate.models.cpu import install_kernels

    model = hybrid_model(args.arch)
    install_kernels(model)
    vocab = Vocab.from_token_bytes([f"{i},".encode() for i in range(VOCAB)], [])
    rng = np.random.default_rng(0)
    results: dict[str, list[tuple[float, float]]] = {"on": [], "off": []}
    for cache in ("on", "off"):
        settings = EngineSettings(prefix_cache_mb=1024 if cache == "on" else 0)
        loaded = LoadedModel(args.arch, model, None, 32768, "random")  # type: ignore[arg-type]
        engine = Engine(loaded, Router(vocab), settings)
        engine.start()
        first_token_s(engine, rng.integers(1, VOCAB, 64).tolist(), 2)  # warm-up
        for _ in range(args.sessions):
            system = rng.integers(1, VOCAB, args.prefix).tolist()
            turn1 = system + rng.integers(1, VOCAB, 30).tolist()
            ttft1, reply = first_token_s(engine, turn1, 16)
            turn2 = turn1 + reply + rng.integers(1, VOCAB, 30).tolist()
            ttft2, _ = first_token_s(engine, turn2, 16)
            results[cache].append((ttft1, ttft2))
        engine.stop()

    layout = engine.layout
    lines = [
        f"# Agent turn 2 on a hybrid model ({time.strftime('%Y-%m-%d %H:%M')})",
        "",
        f"`benches/studies/hybrid_turns.py --arch {args.arch} --prefix {args.prefix} "
        f"--sessions {args.sessions}`: random-weight {args.arch} ({layout.describe()}), "
        f"{args.prefix}-token system prompt + 30-token question; turn 2 adds the 16-token reply "
        "and a new 30-token question. Time to first token, median over sessions.",
        "",
        "| prefix cache | turn 1 TTFT | turn 2 TTFT | turn 2 / turn 1 |",
        "| --- | --- | --- | --- |",
    ]
    for cache, runs in results.items():
        t1 = statistics.median(r[0] for r in runs)
        t2 = statistics.median(r[1] for r in runs)
        lines.append(f"| {cache} | {t1 * 1e3:.0f} ms | {t2 * 1e3:.0f} ms | {t2 / t1:.3f}x |")
    publish(lines, args.out, "hybrid-turns")


if __name__ == "__main__":
    main()
