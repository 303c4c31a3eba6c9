"""Single-stream decode speed of the embedded model, with and without OpenBLAS, in one run.

    .venv/bin/python benches/decode_speed.py [--tokens 64]

Each BLAS runs in its own subprocess (OpenBLAS must be preloaded before mlx.core is imported);
the report gives both figures and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def measure(tokens: int) -> dict[str, float | str]:
    # mlxgate first: importing it preloads OpenBLAS (unless MLXGATE_NO_OPENBLAS is set), which
    # only works before mlx.core is imported.
    from mlxgate import blas

    import mlx.core as mx  # isort: skip
    from mlx_lm.models.cache import make_prompt_cache  # isort: skip

    from mlxgate.models import load

    loaded = load(None)
    tok = loaded.tokenizer
    text = "Tell me about the history of Paris. " * 24
    prompt = tok.encode(tok.render([{"role": "user", "content": text}]))

    # Warm-up: MLX's CPU backend compiles its kernels on first use.
    cache = make_prompt_cache(loaded.model)
    logits = loaded.model(mx.array(prompt)[None], cache=cache)[:, -1, :]
    for _ in range(8):
        logits = loaded.model(mx.argmax(logits, axis=-1)[None], cache=cache)[:, -1, :]
        mx.eval(logits)

    cache = make_prompt_cache(loaded.model)
    started = time.perf_counter()
    logits = loaded.model(mx.array(prompt)[None], cache=cache)[:, -1, :]
    mx.eval(logits)
    prefill_s = time.perf_counter() - started
    token = mx.argmax(logits, axis=-1)
    started = time.perf_counter()
    for _ in range(tokens):
        logits = loaded.model(token[None], cache=cache)[:, -1, :]
        token = mx.argmax(logits, axis=-1)
        mx.eval(token)
    decode_s = time.perf_counter() - started
    return {
        "blas": blas.blas_in_use(),
        "prompt_tokens": len(prompt),
        "prefill_tok_s": len(prompt) / prefill_s,
        "decode_tok_s": tokens / decode_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.tokens)))
        return
    results = {}
    for label, extra_env in (("openblas", {}), ("reference", {"MLXGATE_NO_OPENBLAS": "1"})):
        out = subprocess.run(
            [sys.executable, __file__, "--child", "--tokens", str(args.tokens)],
            env={**os.environ, **extra_env},
            capture_output=True,
            text=True,
            check=True,
        )
        results[label] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"{'BLAS':<12} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for label, r in results.items():
        print(f"{label:<12} {r['prefill_tok_s']:>14.1f} {r['decode_tok_s']:>13.2f}")
    ratio = results["openblas"]["decode_tok_s"] / results["reference"]["decode_tok_s"]
    print(f"decode speed-up with OpenBLAS: {ratio:.1f}x")


if __name__ == "__main__":
    main()
