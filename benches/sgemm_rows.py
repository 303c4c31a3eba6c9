"""From how many rows a quantized matmul should multiply dequantized tiles by OpenBLAS rather
than by the dot-product kernels (`mlxgate_kernels.set_sgemm_rows`): a whole decode step of B
streams, the thresholds A/B interleaved step by step in one process.

    .venv/bin/python benches/sgemm_rows.py [--model FILE.gguf] [--batches 24,32,40]
        [--thresholds 64,32] [--rounds 12]

Run it with and without MLXGATE_NO_AVX512=1 (the kernels' two instruction sets). Each row is
the median step time of each threshold over the rounds (each round: per threshold an untimed
step, then two timed), and the ratio of the first threshold's to each other's (above 1: the
other is faster).
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: the embedded model)")
    parser.add_argument("--batches", default="24,32,40")
    parser.add_argument("--thresholds", default="64,32")
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()

    import mlxgate  # noqa: F401, I001  (first: it preloads OpenBLAS before mlx.core)
    import mlx.core as mx
    import mlxgate_kernels
    from mlx_lm.generate import _merge_caches

    from mlxgate.models import load

    loaded = load(args.model)
    model = loaded.model
    thresholds = [int(t) for t in args.thresholds.split(",")]
    before = mlxgate_kernels.sgemm_rows()
    print(f"{loaded.name}, {loaded.kernels}, AVX-512: {mlxgate_kernels.using_avx512()}")
    for batch in (int(b) for b in args.batches.split(",")):
        caches = []
        for _ in range(batch):  # each stream's prompt prefilled alone, then batched as served
            cache = model.make_cache()
            prompt = mx.random.randint(100, 20000, (1, 74)).astype(mx.uint32)
            mx.eval(model(prompt, cache=cache))
            caches.append(cache)
        cache = _merge_caches(caches)
        tokens = mx.random.randint(100, 20000, (batch, 1)).astype(mx.uint32)
        times: dict[int, list[float]] = {t: [] for t in thresholds}
        for _ in range(args.rounds):
            for threshold in thresholds:
                mlxgate_kernels.set_sgemm_rows(threshold)
                # A step first, untimed: a step just after the other path pays for it (OpenBLAS's
                # threads spin for a while after a call), which a server's steady steps do not.
                mx.eval(model(tokens, cache=cache))
                for _ in range(2):
                    started = time.perf_counter()
                    mx.eval(model(tokens, cache=cache))
                    times[threshold].append(time.perf_counter() - started)
        median = {t: statistics.median(v) * 1e3 for t, v in times.items()}
        base = thresholds[0]
        cells = ", ".join(f"{t}: {ms:.1f} ms" for t, ms in median.items())
        ratios = ", ".join(
            f"{t} vs {base}: {median[base] / median[t]:.2f}x" for t in thresholds[1:]
        )
        print(f"B={batch}: step by threshold {cells}; {ratios}")
    mlxgate_kernels.set_sgemm_rows(before)


if __name__ == "__main__":
    main()
