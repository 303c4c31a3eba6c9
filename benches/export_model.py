"""Writes the embedded SmolLM2 model as an mlx-lm model directory, so mlx_lm.server can serve it.

    .venv/bin/python benches/export_model.py [--out benches/.cache/smollm2-mlx] [--check]

mlx_lm.server cannot read the GGUF that mlxgate ships; `mlxgate.models.export` writes the same
float32 weights (dequantized by mlxgate's loader) with mlx-lm's parameter names. `--check` loads
the result with mlx_lm and compares its greedy output with mlxgate's model.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import mlxgate  # noqa: F401  (preloads OpenBLAS before mlx.core)
from mlxgate.models.export import export

DEFAULT_DIR = Path(__file__).parent / ".cache" / "smollm2-mlx"
CHECK_PROMPT = "What is the capital of France?"
CHECK_TOKENS = 24


def check(out: Path) -> bool:
    """Greedy text from mlx_lm on the export equals mlxgate's on the GGUF."""
    import mlx.core as mx
    from mlx_lm import generate
    from mlx_lm import load as mlx_lm_load
    from mlx_lm.models.cache import make_prompt_cache

    from mlxgate.models import load

    messages = [{"role": "user", "content": CHECK_PROMPT}]
    ours = load(None, weights="float32", cpu_kernels=False)  # what the export holds
    ids = ours.tokenizer.encode(ours.tokenizer.render(messages))
    tokens: list[int] = []
    cache = make_prompt_cache(ours.model)
    logits = ours.model(mx.array(ids)[None], cache=cache)[:, -1, :]
    for _ in range(CHECK_TOKENS):
        token = int(mx.argmax(logits, axis=-1).item())  # type: ignore[arg-type]  # argmax gives an int
        if token in ours.tokenizer.eos_ids:
            break
        tokens.append(token)
        logits = ours.model(mx.array([[token]]), cache=cache)[:, -1, :]
    expected = ours.tokenizer.decode(tokens)

    model, tokenizer = mlx_lm_load(str(out))[:2]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    got = generate(model, tokenizer, prompt, max_tokens=len(tokens))
    same_prompt = list(prompt) == ids
    print(f"prompt tokens equal: {same_prompt}")
    print(f"mlxgate: {expected!r}")
    print(f"mlx_lm:  {got!r}")
    return same_prompt and got == expected


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--check", action="store_true", help="compare greedy output with mlx_lm")
    args = parser.parse_args()
    out = export(args.out)
    print(out)
    if args.check and not check(out):
        sys.exit("mlx_lm's output on the export differs from mlxgate's")


if __name__ == "__main__":
    main()
