"""Speculation's speed-up on tiny random-weight models by layer kind: one greedy sequence decoded
with guesses an oracle makes (mlx-lm's own continuation, every `spoil`-th guess wrong) against
the same engine without guesses.

    PYTHONPATH=benches:tests .venv/bin/python benches/studies/tiny_guesses.py \
        [--archs llama,gemma3_text,qwen3_5] [--spoils 1000,4] [--tokens 200]

Random weights copy nothing, so prompt lookup would rarely guess: the oracle stands in for a
sequence that copies (spoil 1000: every guess right, as an edit's reply mostly is; spoil 4: a
run of three right guesses, then a wrong one). The tiny models' steps are mostly MLX's per-op
cost, not weights, so the ratios say what a kind's taking back costs against a pass, not what a
real model gains. Each configuration runs twice, interleaved; the report gives the faster.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from report import publish


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default="llama,gemma3_text,qwen3_5")
    parser.add_argument("--spoils", default="1000,4")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    args = parser.parse_args()

    import mlxgate  # noqa: F401  (preloads OpenBLAS before mlx.core)
    from support.tiny_engine import Oracle, Served, prompts, reference
    from support.tiny_models import twins

    spoils = [int(s) for s in args.spoils.split(",")]
    prompt = prompts(1, 40, 41, seed=5)[0]
    lines = [
        "# Speculation on tiny models, by layer kind",
        "",
        f"Command: `PYTHONPATH=benches:tests .venv/bin/python benches/studies/tiny_guesses.py "
        f"--archs {args.archs} --spoils {args.spoils} --tokens {args.tokens}`  ",
        f"One greedy sequence of {args.tokens} tokens after a 40-token prompt; decode tok/s.",
        "",
        "| model | no guesses | " + " | ".join(f"every {s}th guess wrong" for s in spoils) + " |",
        "|---|---|" + "---|" * len(spoils),
    ]
    for arch in args.archs.split(","):
        served_model, reference_model = twins(arch)
        want = reference(reference_model, prompt, args.tokens).tokens
        best: dict[int | None, float] = {}
        for _ in range(2):
            for spoil in [None, *spoils]:
                served = Served(served_model, max_draft_tokens=0 if spoil is None else 8)
                try:
                    if spoil is not None:
                        assert served.engine.speculation is not None
                        oracle = Oracle(spoil)
                        oracle.expect(prompt, want)
                        served.engine.speculation.propose = oracle
                    served.generate(prompt, 2)  # warm-up
                    started = time.perf_counter()
                    tokens, _ = served.generate(prompt, args.tokens)
                    rate = len(tokens) / (time.perf_counter() - started)
                finally:
                    served.engine.stop()
                best[spoil] = max(best.get(spoil, 0.0), rate)
        plain = best[None]
        cells = [f"{best[s]:.0f} ({best[s] / plain:.2f}x)" for s in spoils]
        lines.append(f"| {arch} | {plain:.0f} | " + " | ".join(cells) + " |")
    publish(lines, args.out, "tiny-guesses")


if __name__ == "__main__":
    main()
