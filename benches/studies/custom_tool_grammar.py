"""What holding a custom tool's input to its grammar costs: llguidance's mask computation per
token while a reply writes Codex's `apply_patch` call (tool_choice auto), in Qwen3-Coder's XML
format (the tool's Lark grammar nested as is) and in Qwen3's Hermes JSON (the grammar rewritten
for the JSON string, formats/escaped_grammar.py), against the same XML reply held only as a
`strict` function tool's call, and the decode step it is spent beside.

    PYTHONPATH=benches:tests .venv/bin/python benches/studies/custom_tool_grammar.py [--repeats 50]

The Qwen3 vocabulary (151,936 tokens) from the tests' tokenizer fixtures; masks as the engine
computes them (one row; the engine computes a step's rows together on llguidance's threads).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import llguidance
import numpy as np
from report import publish

from mlxgate.api import custom_tools
from mlxgate.prompts import Conversation, Renderer, ToolChoice
from support.forced import tokenizer

ROOT = Path(__file__).resolve().parents[2]

PATCH = (
    "*** Begin Patch\n*** Update File: src/app.py\n@@ def main():\n-    print('hi')\n"
    "+    print('hello, world')\n+    return 0\n*** Add File: NOTES.md\n+Said hello.\n*** End Patch"
)
REPLIES = {
    "qwen3-coder": "I will edit the file now.\n<tool_call>\n<function=apply_patch>\n"
    f"<parameter=input>\n{PATCH}\n</parameter>\n</function>\n</tool_call>",
    "qwen3": "I will edit the file now.\n<tool_call>\n"
    + json.dumps({"name": "apply_patch", "arguments": {"input": PATCH}}, ensure_ascii=False)
    + "\n</tool_call>",
}


def grammar(renderer: Renderer, custom: bool) -> str:
    lark = (ROOT / "tests" / "fixtures" / "apply_patch.lark").read_text()
    fmt = {"type": "grammar", "syntax": "lark", "definition": lark}
    function, tool = custom_tools.custom_tool("apply_patch", "Edit files.", fmt, "tools.0")
    conversation = Conversation(
        [{"role": "user", "content": "Say hello in app.py."}],
        [function],
        ToolChoice(),
        strict_tools=not custom,
        input_grammars=custom_tools.grammars([tool]) if custom else {},
        custom_tools=[tool.name] if custom else [],
    )
    rendered = renderer.render(conversation).call_grammar
    assert rendered is not None
    return rendered


def mask_times(lark: str, vocab: llguidance.LLTokenizer, ids: list[int]) -> list[float]:
    matcher = llguidance.LLMatcher(vocab, llguidance.LLMatcher.grammar_from_lark(lark))
    times = []
    for token in ids:
        started = time.perf_counter()
        matcher.compute_bitmask()
        times.append(time.perf_counter() - started)
        assert matcher.consume_token(token), matcher.get_error()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", type=Path, default=ROOT / "benches" / "results")
    args = parser.parse_args()
    rows = []
    cases = (
        ("custom apply_patch, Qwen3-Coder XML (Lark nested)", "qwen3-coder", True),
        ("custom apply_patch, Hermes JSON (Lark escaped)", "qwen3", True),
        ("strict function, Qwen3-Coder XML", "qwen3-coder", False),
    )
    for name, family, custom in cases:
        chat = tokenizer(family)
        vocab = llguidance.LLTokenizer(chat.tokenizer.to_str(), n_vocab=151936, eos_token=[0])
        ids = chat.tokenizer.encode(REPLIES[family], add_special_tokens=False).ids
        held = grammar(Renderer(chat), custom)
        times = [t for _ in range(args.repeats) for t in mask_times(held, vocab, ids)]
        ms = np.array(times) * 1e3
        rows.append(
            f"| {name} | {statistics.median(ms):.3f} | {np.percentile(ms, 90):.3f} "
            f"| {np.percentile(ms, 99):.3f} | {ms.max():.3f} |"
        )
    lines = [
        f"# A custom tool's grammar: mask cost per token ({time.strftime('%Y-%m-%d %H:%M')})",
        "",
        f"`benches/studies/custom_tool_grammar.py --repeats {args.repeats}`: the tokens of a "
        "reply that writes Codex's apply_patch call, the mask computed before each (one row, "
        "Qwen3's 151,936-token vocabulary), over all repeats. For scale: a decode step of the "
        "embedded 135M model is ~16 ms on this machine (docs/performance.md).",
        "",
        "| grammar | median ms | p90 ms | p99 ms | max ms |",
        "| --- | --- | --- | --- | --- |",
        *rows,
    ]
    publish(lines, args.out, "custom-tool-grammar")


if __name__ == "__main__":
    main()
