"""How many tokens per verify pass prompt lookup keeps on the `edit` scenario, by policy: the
engine's adaptive draft length against fixed lengths, offline.

    .venv/bin/python benches/studies/lookup_policy.py [--tokens 256] [--width-cost 0.075]

The embedded model's greedy replies to the 5 `edit` prompts are generated once (mlx-lm); then
each policy is replayed over them without the model (a greedy row keeps a guess exactly while
it equals the reply). A pass of width W is costed `1 + width_cost * (W - 1)` decode steps, from
`verify_cost.py` at 1 row and 2,048 tokens of context (width 5: 1.40x, 9: 1.63x).
"""

from __future__ import annotations

import argparse

import numpy as np

import mlxgate.engine.speculation as spec
from mlxgate.bench.scenarios import EDITS, edit_prompt


def replies(tokens: int) -> list[tuple[list[int], list[int]]]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from mlxgate.models import load

    loaded = load(None)
    tokenizer = loaded.tokenizer
    out = []
    for edit in EDITS:
        text = tokenizer.render([{"role": "user", "content": edit_prompt(*edit).user}])
        prompt = tokenizer.encode(text)
        steps = generate_step(mx.array(prompt), loaded.model, max_tokens=tokens)
        out.append((prompt, [int(t) for t, _ in steps]))
    return out


def replay(
    data: list[tuple[list[int], list[int]]], width_cost: float, fixed: int | None
) -> tuple[float, float, float]:
    """(tokens per pass, tokens per decode step's cost, share of passes that kept nothing)."""
    passes = cost = tokens = empty = 0.0
    for prompt, reply in data:
        lookup = spec.Lookup.of(prompt, fixed or 8)
        step = done = 0
        while done < len(reply):
            step += 1
            k = fixed or lookup.wanted(step, 1 << 30)
            guess = spec.continuation(lookup.history, k, spec.MIN_MATCH, spec.MAX_MATCH)[:k]
            kept = 0
            while (
                kept < len(guess) and done + kept < len(reply) and guess[kept] == reply[done + kept]
            ):
                kept += 1
            emitted = reply[done : done + kept + 1]
            lookup.extend(np.array(emitted))
            if len(guess):
                lookup.verified(step, len(guess), kept, 8)
                empty += kept == 0
            done += len(emitted)
            passes += 1
            cost += 1 + width_cost * len(guess)
        tokens += len(reply)
    return tokens / passes, tokens / cost, empty / passes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--width-cost", type=float, default=0.075)
    args = parser.parse_args()
    data = replies(args.tokens)
    print("| policy | tokens / pass | tokens / step's cost | passes keeping nothing |")
    print("| --- | --- | --- | --- |")
    for fixed in (None, 4, 8, 16):
        per_pass, per_cost, empty = replay(data, args.width_cost, fixed)
        name = "adaptive (the engine's)" if fixed is None else f"always {fixed}"
        print(f"| {name} | {per_pass:.2f} | {per_cost:.2f} | {empty:.0%} |")


if __name__ == "__main__":
    main()
