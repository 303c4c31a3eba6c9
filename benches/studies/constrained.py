"""What constrained decoding costs: aggregate decode tok/s with every row held to a JSON schema,
against the same rows unconstrained, at C=1 and C=32; and the mask computation per step, for
that schema and for a `strict` tool's grammar over free text (tool_choice auto).

    PYTHONPATH=benches .venv/bin/python benches/studies/constrained.py [--tokens 64] [--rounds 3]

In-process, through the real engine and router, on the embedded model. Each round runs the
unconstrained batch and the constrained batch back to back (interleaved, so that the machine's
drift touches both alike; which goes first alternates); the report gives the median ratio
constrained / unconstrained, prefill included, without the prefix cache. The
schema asks for a long array, so no constrained row ends before `--tokens` (the unconstrained
rows run to `--tokens` too: the end-of-turn token is not an end for them here).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from report import publish

LONG_JSON = {
    "type": "object",
    "properties": {
        "cities": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 24},
                    "population": {"type": "integer", "minimum": 0},
                    "country": {"enum": ["France", "Spain", "Italy", "Germany"]},
                },
                "required": ["name", "population", "country"],
                "additionalProperties": False,
            },
            "minItems": 500,
        }
    },
    "required": ["cities"],
    "additionalProperties": False,
}
QUESTIONS = [
    "List the largest cities of Europe as JSON.",
    "Give me European cities with their populations, as JSON.",
    "Which cities in France, Spain, Italy and Germany are the biggest? Answer in JSON.",
    "Write JSON about cities.",
]


def drain(reader: Any) -> None:
    ready = threading.Event()
    while (data := reader.take()) is not None:
        if data:
            continue
        ready.clear()
        if reader.park(ready, lambda _: ready.set()):
            ready.wait(5.0)


def decode_tok_s(engine: Any, prompts: list[list[int]], tokens: int, grammar: Any) -> float:
    """Aggregate generated tokens per second for `prompts` at once, `tokens` each."""
    from mlxgate._native import Reply, StreamSpec
    from mlxgate.engine import GenerationRequest

    spec = StreamSpec.anthropic(
        model="m", message_id="msg_b", stream=True, stop_sequences=[], reply=Reply(eos_ids=[])
    )
    started = time.perf_counter()
    readers = [engine.admit(GenerationRequest(p, spec, tokens, grammar=grammar)) for p in prompts]
    threads = [threading.Thread(target=drain, args=(r,)) for r in readers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return len(prompts) * tokens / (time.perf_counter() - started)


def mask_ms(vocabulary: Any, grammar: Any, width: int, rows: int, steps: int = 32) -> float:
    """Milliseconds per step to compute the masks of `rows` constrained rows (each advanced by
    an allowed token between steps, as the engine does)."""
    import numpy as np

    matchers = [vocabulary.matcher(grammar, width) for _ in range(rows)]
    spent = 0.0
    for step in range(steps):
        started = time.perf_counter()
        allowed = vocabulary.allowed(matchers)
        spent += time.perf_counter() - started
        for row, matcher in enumerate(matchers):
            choices = np.flatnonzero(allowed[row])
            matcher.consume_token(int(choices[(row + step) % len(choices)]))
    return spent / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    args = parser.parse_args()

    import mlxgate  # noqa: F401  (preloads OpenBLAS before mlx.core)
    from mlxgate import prompts
    from mlxgate._native import Router
    from mlxgate.engine import Engine, EngineSettings, Grammar
    from mlxgate.models import load

    loaded = load(None, context_length=8192)
    tok = loaded.tokenizer
    vocab = tok.native_vocab()
    # No prefix cache: the second of a pair would find the first's prompts cached.
    settings = EngineSettings(prefix_cache_mb=0)
    engine = Engine(loaded, Router(vocab), settings, end_ids=sorted(tok.eos_ids))
    engine.start()
    grammar = Grammar.json_schema(LONG_JSON)
    questions = [tok.encode(tok.render([{"role": "user", "content": q}])) for q in QUESTIONS]
    decode_tok_s(engine, questions[:1], 4, grammar)  # warm-up: the grammar vocabulary is built

    ratios: dict[int, list[tuple[float, float]]] = {1: [], 32: []}
    for round_ in range(args.rounds):
        for rows in ratios:
            batch = [questions[i % len(questions)] for i in range(rows)]
            measured = {}
            for constrained in (False, True) if round_ % 2 == 0 else (True, False):
                measured[constrained] = decode_tok_s(
                    engine, batch, args.tokens, grammar if constrained else None
                )
            ratios[rows].append((measured[False], measured[True]))
    vocabulary = engine.vocabulary
    assert vocabulary is not None
    width = loaded.model.model.embed_tokens.weight.shape[0]
    masks = {rows: mask_ms(vocabulary, grammar, width, rows) for rows in (1, 32)}
    # A `strict` tool with tool_choice auto: free text, calls held to the schema.
    renderer = prompts.Renderer(tok)
    tool = {"type": "function", "function": {"name": "cities", "parameters": LONG_JSON}}
    conversation = prompts.Conversation(
        [{"role": "user", "content": QUESTIONS[0]}], [tool], strict_tools=True
    )
    strict_text = renderer.render(conversation).call_grammar
    assert strict_text is not None
    strict = Grammar.lark(strict_text)
    strict_masks = {rows: mask_ms(vocabulary, strict, width, rows) for rows in (1, 32)}
    engine.stop()

    lines = [
        f"# Constrained decoding cost ({time.strftime('%Y-%m-%d %H:%M')})",
        "",
        f"`benches/studies/constrained.py --tokens {args.tokens} --rounds {args.rounds}`: "
        "the embedded "
        f"model, in-process; C rows at once, {args.tokens} tokens each, unconstrained then held "
        "to a JSON schema (an array of objects with a bounded string, an integer and an enum), "
        "interleaved per round. Median over rounds.",
        "",
        "| C | unconstrained tok/s | constrained tok/s | constrained / unconstrained |"
        " mask per step | mask per step, strict tool (free text) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for rows, runs in ratios.items():
        free = statistics.median(r[0] for r in runs)
        held = statistics.median(r[1] for r in runs)
        ratio = statistics.median(r[1] / r[0] for r in runs)
        lines.append(
            f"| {rows} | {free:.1f} | {held:.1f} | {ratio:.3f}x | {masks[rows]:.2f} ms "
            f"| {strict_masks[rows]:.2f} ms |"
        )
    publish(lines, args.out, "constrained")


if __name__ == "__main__":
    main()
