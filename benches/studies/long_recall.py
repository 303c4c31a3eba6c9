"""Long prompts under the 32k default: a fact placed at several depths of a long document, asked
for at its end, answered by mlxgate and by llama-server on the same GGUF and settings.

    PYTHONPATH=benches flock /tmp/bench.lock .venv/bin/python benches/studies/long_recall.py \
        [--lengths 12000,24000] [--depths 0.1,0.5,0.9] [--servers mlxgate,llama-server]

Each server is started as `mlxgate bench --spawn` starts it (llama-server: YaRN x4 over the
model's 8,192 tokens, `--jinja`, so both render the GGUF's own chat template), one at a time,
and asked greedily over Chat Completions, one prompt after another. The document is stdlib
docstrings (context_cost.py's filler) with the fact inserted at a depth (0: its start, 1: its
end); the prompt lengths are those mlxgate's tokenizer counts. The report quotes every reply and
whether it holds the code.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from context_cost import filler_text
from report import log, publish

FACT = "Note for the reader: the door code of the archive room is 4817."
QUESTION = "What is the door code of the archive room? Answer with the number."
CODE = "4817"
REPLY_TOKENS = 24


def document(filler: str, chars: int, depth: float) -> str:
    """`chars` of the filler with FACT inserted between paragraphs at `depth` of it."""
    text = filler[:chars]
    at = text.rfind("\n\n", 0, int(len(text) * depth) + 1)
    at = 0 if at < 0 else at
    return f"{text[:at]}\n\n{FACT}\n\n{text[at:]}".strip()


def content(doc: str) -> str:
    return f"{doc}\n\n{QUESTION}"


def sized(tokenizer: Any, filler: str, tokens: int) -> int:
    """How many filler characters make a prompt of about `tokens` tokens (mlxgate's count)."""

    def count(text: str) -> int:
        return len(tokenizer.encode(tokenizer.render([{"role": "user", "content": text}])))

    low, high = 0, len(filler)
    while high - low > 200:
        middle = (low + high) // 2
        if count(content(filler[:middle])) <= tokens:
            low = middle
        else:
            high = middle
    if low == 0 or count(content(filler[:low])) < tokens * 0.95:
        raise SystemExit(f"the filler text is too short for {tokens} tokens")
    return low


def ask(url: str, model: str, text: str) -> tuple[str, int, float]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": REPLY_TOKENS,
        "temperature": 0,
    }
    started = time.monotonic()
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=3600)
    reply.raise_for_status()
    data = reply.json()
    answer = data["choices"][0]["message"]["content"] or ""
    return answer, int(data["usage"]["prompt_tokens"]), time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--lengths", default="12000,24000", help="prompt lengths, tokens")
    parser.add_argument("--depths", default="0.1,0.5,0.9", help="where the fact goes, 0-1")
    parser.add_argument("--servers", default="mlxgate,llama-server")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    depths = [float(d) for d in args.depths.split(",")]
    names = args.servers.split(",")

    import mlxgate  # noqa: F401  (preloads OpenBLAS before mlx.core)
    from mlxgate.bench.spawn import MODEL, spawn
    from mlxgate.models import load

    filler = filler_text()
    tokenizer = load(None, context_length=8192).tokenizer
    prompts: list[tuple[int, float, str]] = []
    for length in lengths:
        chars = sized(tokenizer, filler, length)
        prompts += [(length, d, content(document(filler, chars, d))) for d in depths]
    logs = Path(tempfile.mkdtemp(prefix="long-recall-"))
    rows: list[tuple[str, int, float, int, str, float]] = []
    for name in names:
        server = spawn(name, 1, logs)
        try:
            for length, depth, text in prompts:
                log(f"{name}: {length} tokens, fact at {depth:.0%}")
                answer, prompt_tokens, seconds = ask(server.url, MODEL[name], text)
                rows.append((name, prompt_tokens, depth, length, answer, seconds))
                log(f"  {prompt_tokens} prompt tokens, {seconds:.0f} s: {answer!r}")
        finally:
            server.stop()

    command = " ".join(["benches/studies/long_recall.py", *sys.argv[1:]])
    lines = [
        f"# Long prompts: recall of a fact by depth ({time.strftime('%Y-%m-%d %H:%M')})",
        "",
        f"`{command}`: the embedded model (SmolLM2-135M-Instruct, Q4_1 GGUF) served at 32,768 "
        f"tokens, YaRN x4 over its 8,192, by each server; greedy, {REPLY_TOKENS} tokens. The "
        f"fact: {FACT!r}; the question, at the end: {QUESTION!r}.",
        "",
        "| server | prompt tokens | fact at | holds the code | reply | time |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, prompt_tokens, depth, _, answer, seconds in rows:
        found = "yes" if CODE in answer else "no"
        quoted = answer.replace("\n", " ").replace("|", "\\|")
        lines.append(
            f"| {name} | {prompt_tokens:,} | {depth:.0%} | {found} | {quoted} | {seconds:.0f} s |"
        )
    publish(lines, args.out, "long-recall")


if __name__ == "__main__":
    main()
