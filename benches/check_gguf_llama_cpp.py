"""Checks that tests/test_gguf_convert.py writes its tiny GGUF files as llama.cpp reads them:
each architecture's random-weight tiny model is written as that test writes it and run by
llama-server, whose greedy tokens must be the original mlx-lm model's (and mlxgate's, loading
the same file).

    LLAMA_SERVER=benches/.cache/bin/llama-server PYTHONPATH=tests \
        .venv/bin/python benches/check_gguf_llama_cpp.py

The tiny models here have a 512-token vocabulary (llama.cpp wants as many embedding rows as
tokens) and larger embeddings than the test's (peaked logits: fewer near-ties). Greedy, 16
tokens after a 24-token prompt that crosses the sliding window. llama-server runs with 8,192
tokens of context, past LongRoPE's original 4,096: below it llama.cpp takes Phi-3's short
factors, where mlx-lm's `SuScaledRoPE` always takes the long ones.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx


def greedy_llama_cpp(path: Path, prompt: list[int], logs: Path) -> list[int] | str:
    from mlxgate.bench import spawn

    binary = os.environ.get("LLAMA_SERVER") or "llama-server"
    port = spawn.free_port()
    command = [
        binary, "--model", str(path), "--host", "127.0.0.1", "--ctx-size", "8192",
        "--threads", str(os.cpu_count() or 1), "--port", str(port),
    ]  # fmt: skip
    server = spawn.Server(f"llama-server-{path.stem}", command, port, logs / f"{path.stem}.log")
    try:
        server.start()
        body = {
            "prompt": prompt,
            "n_predict": 16,
            "temperature": 0,
            "top_k": 1,
            "cache_prompt": False,
            "return_tokens": True,
            "ignore_eos": True,
        }
        reply = httpx.post(f"{server.url}/completion", json=body, timeout=120)
        reply.raise_for_status()
        return [int(t) for t in reply.json()["tokens"]]
    except Exception as exc:  # reported: the next architecture still runs
        return f"llama-server failed: {exc}"
    finally:
        server.stop()


def main() -> int:
    import mlx.core as mx
    import numpy as np
    import test_gguf_convert as written
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.generate import generate_step

    from mlxgate import models

    os.environ["MLXGATE_CACHE"] = tempfile.mkdtemp(prefix="gguf-check-cache-")
    work = Path(tempfile.mkdtemp(prefix="gguf-check-"))
    prompt = np.random.default_rng(0).integers(300, 512, 24).tolist()

    def greedy(model: Any) -> list[int]:
        steps = zip(generate_step(mx.array(prompt), model, max_tokens=16), range(16), strict=False)
        return [int(token) for (token, _), _ in steps]

    failed = 0
    for arch in written.FAMILIES:
        original, cfg = written.tiny_original(arch, vocab_size=512)
        parameters: list[tuple[str, mx.array]] = tree_flatten(original.parameters())  # type: ignore[assignment]
        changed = [
            (name, mx.random.uniform(0.5, 1.5, p.shape) if "norm." in name else p * 3)
            for name, p in parameters
            if "norm." in name or "embed" in name or "lm_head" in name
        ]
        original.update(tree_unflatten(changed))
        mx.eval(original.parameters())
        path = work / f"{arch}.gguf"
        written.write_as_llama_cpp(original, cfg, arch, path)
        want = greedy(original)
        ours = greedy(models.load(str(path), cpu_kernels=False).model)
        theirs = greedy_llama_cpp(path, prompt, work)
        print(f"{arch:20} mlxgate: {ours == want!s:5}  llama.cpp: {theirs == want!s:5}")
        if theirs != want:
            print(f"    mlx-lm    {want}\n    llama.cpp {theirs}")
        failed += ours != want or theirs != want
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
