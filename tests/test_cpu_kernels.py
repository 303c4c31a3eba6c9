"""mlxgate's CPU kernels (kernels/, models/cpu/kernels.py) against the MLX ops they replace.

Each kernel is compared with MLX's own op on random shapes: odd sizes, group edges, a
power-of-two reduction (rows 8 KB apart), 1..65 rows (both the dot-product and the sgemm path
of the quantized matmul), every scale dtype, transposed views. Where a kernel does not apply
it must be MLX's op itself, bit for bit. The served models' token-for-token agreement with
mlx-lm runs with the kernels on in test_architectures.py (4-bit variants of every family) and
on the embedded model everywhere.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlxgate.models.cpu import kernels  # (conftest imports mlxgate first: OpenBLAS)

pytestmark = pytest.mark.skipif(
    kernels.unavailable() is not None, reason=f"{kernels.unavailable()}"
)


@pytest.fixture(scope="module")
def ext() -> Any:
    import mlxgate_kernels

    return mlxgate_kernels


def widths() -> list[str]:
    """The instruction sets the kernels can run here: AVX2, and AVX-512 where the CPU has it
    (the extension refuses it elsewhere), so no case is collected that cannot run."""
    if kernels.unavailable() is not None:
        return ["avx2"]
    import mlxgate_kernels

    before = mlxgate_kernels.using_avx512()
    mlxgate_kernels.use_avx512(True)
    has = mlxgate_kernels.using_avx512()
    mlxgate_kernels.use_avx512(before)
    return ["avx2", "avx512"] if has else ["avx2"]


@pytest.fixture(params=widths())
def width(ext: Any, request: pytest.FixtureRequest) -> Iterator[str]:
    """The instruction set of the quantized matmul and attention."""
    before = ext.using_avx512()
    ext.use_avx512(request.param == "avx512")
    yield request.param
    ext.use_avx512(before)


def quantized(n: int, k: int, bits: int, group: int, dtype: mx.Dtype, seed: int) -> tuple:
    key = mx.random.key(seed)
    if group == 16:  # as a GGUF file's Q6_K is served (mx.quantize takes no groups of 16)
        packed = mx.random.randint(0, 64, (n, k), key=key).astype(mx.uint8).view(mx.uint32)
        scales = mx.random.normal((n, k // group), key=mx.random.key(seed + 1)) / 64
        return packed, scales.astype(dtype), (-32 * scales).astype(dtype)
    w = mx.random.normal((n, k), key=key)
    packed, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    return packed, scales.astype(dtype), biases.astype(dtype)


def close(got: mx.array, want: mx.array, tolerance: float = 2e-5) -> None:
    """Equal up to float32 rounding of a different summation order, relative to the size."""
    got_np, want_np = np.asarray(got), np.asarray(want)
    assert got_np.shape == want_np.shape
    scale = max(1.0, float(np.abs(want_np).max()))
    np.testing.assert_allclose(got_np, want_np, rtol=0, atol=tolerance * scale)


@pytest.mark.parametrize(("bits", "group"), [(4, 32), (4, 64), (8, 16), (8, 32), (8, 64)])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32], ids=str)
def test_quantized_matmul_equals_mlx(
    ext: Any, width: str, bits: int, group: int, dtype: mx.Dtype
) -> None:
    for seed, (n, groups) in enumerate([(37, 3), (130, 9), (1, 1), (65, 18), (7, 32)]):
        k = group * groups
        packed, scales, biases = quantized(n, k, bits, group, dtype, seed)
        for rows in (1, 2, 3, 7, 8, 9, 31, 47, 48, 64, 65):
            x = mx.random.normal((rows, k), key=mx.random.key(100 + rows))
            if group == 16:  # MLX's own quantized_matmul gets groups of 16 wrong on the CPU
                wide = (scales.astype(mx.float32), biases.astype(mx.float32))
                want = x @ mx.dequantize(packed, *wide, group, bits).T
            else:
                want = mx.quantized_matmul(x, packed, scales, biases, True, group, bits)
            got = ext.quantized_matmul(x, packed, scales, biases, True, group, bits)
            close(got, want)


@pytest.mark.parametrize("bits", [4, 8])
def test_one_row_with_more_groups_than_its_kernel_holds_takes_the_general_path(
    ext: Any, width: str, bits: int
) -> None:
    k = 32 * 520  # MAX_ROW_GROUPS is 512
    packed, scales, biases = quantized(5, k, bits, 32, mx.float16, seed=15)
    x = mx.random.normal((1, k), key=mx.random.key(16))
    want = mx.quantized_matmul(x, packed, scales, biases, True, 32, bits)
    close(ext.quantized_matmul(x, packed, scales, biases, True, 32, bits), want)


def test_quantized_matmul_takes_batches_and_views(ext: Any, width: str) -> None:
    packed, scales, biases = quantized(96, 128, 4, 32, mx.float16, seed=7)
    x = mx.random.normal((3, 128, 5), key=mx.random.key(8)).transpose(0, 2, 1)  # not contiguous
    want = mx.quantized_matmul(x, packed, scales, biases, True, 32, 4)
    got = ext.quantized_matmul(x, packed, scales, biases, transpose=True, group_size=32, bits=4)
    assert got.shape == (3, 5, 96)
    close(got, want)


def test_the_sgemm_path_and_the_dot_products_agree(ext: Any) -> None:
    packed, scales, biases = quantized(300, 256, 4, 64, mx.float16, seed=9)
    x = mx.random.normal((80, 256), key=mx.random.key(10))
    before = ext.sgemm_rows()
    try:
        ext.set_sgemm_rows(0)
        dots = ext.quantized_matmul(x, packed, scales, biases, True, 64, 4)
        mx.eval(dots)
        ext.set_sgemm_rows(1)
        tiles = ext.quantized_matmul(x, packed, scales, biases, True, 64, 4)
        mx.eval(tiles)
    finally:
        ext.set_sgemm_rows(before)
    close(tiles, dots)


def test_where_the_kernel_does_not_apply_the_answer_is_mlx_own(ext: Any) -> None:
    w = mx.random.normal((64, 128), key=mx.random.key(11))
    x32 = mx.random.normal((4, 128), key=mx.random.key(12))
    cases: list[tuple[mx.array, tuple, dict[str, Any]]] = []
    packed3, s3, b3 = mx.quantize(w, group_size=32, bits=3)
    cases.append((x32, (packed3, s3, b3), {"group_size": 32, "bits": 3}))
    packed, scales, biases = mx.quantize(w, group_size=128, bits=4)  # group 128
    cases.append((x32, (packed, scales, biases), {"group_size": 128, "bits": 4}))
    packed, scales, biases = mx.quantize(w, group_size=32, bits=4)
    cases.append((x32.astype(mx.float16), (packed, scales, biases), {"group_size": 32}))
    for x, (p, s, b), options in cases:
        want = mx.quantized_matmul(x, p, s, b, **options)
        got = ext.quantized_matmul(x, p, s, b, **options)
        np.testing.assert_array_equal(np.asarray(got.astype(mx.float32)), np.asarray(want))


def experts(count: int, n: int, k: int, bits: int, group: int, dtype: mx.Dtype) -> tuple:
    w = mx.random.normal((count, n, k), key=mx.random.key(n + k))
    packed, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    return packed, scales.astype(dtype), biases.astype(dtype)


@pytest.mark.parametrize(("bits", "group"), [(4, 32), (4, 64), (8, 32), (8, 64)])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=str)
def test_gather_qmm_equals_mlx(
    ext: Any, width: str, bits: int, group: int, dtype: mx.Dtype
) -> None:
    """mlx-lm's SwitchGLU calls: a decode step's or a prompt's tokens, each sent to `top` of the
    experts (an expert chosen twice, experts chosen by none, many rows to one: the sgemm tiles),
    and the sorted form it takes from 64 positions on."""
    for count, n, groups in [(8, 37, 2), (16, 130, 3), (4, 64, 5)]:
        k = group * groups
        packed, scales, biases = experts(count, n, k, bits, group, dtype)
        for batch, tokens, top in [(1, 1, 2), (2, 1, 3), (3, 1, 8), (1, 17, 4), (3, 40, 2)]:
            x = mx.random.normal((batch, tokens, 1, 1, k), key=mx.random.key(tokens))
            chosen = mx.random.randint(0, count, (batch, tokens, top), key=mx.random.key(top))
            chosen = chosen.astype(mx.uint32)
            order = mx.argsort(chosen.flatten())
            calls: list[tuple[mx.array, mx.array, dict[str, Any]]] = [
                (x, chosen, {}),
                (x.flatten(0, -3)[order // top], chosen.flatten()[order], {"sorted_indices": True}),
            ]
            for rows, indices, sort in calls:
                want = mx.gather_qmm(
                    rows, packed, scales, biases, None, indices, True, group, bits, **sort
                )
                got = ext.gather_qmm(
                    rows, packed, scales, biases, None, indices, True, group, bits, **sort
                )
                close(got, want)


def test_gather_qmm_takes_both_indices_and_many_rows_a_matrix(ext: Any) -> None:
    packed, scales, biases = experts(3, 40, 96, 4, 32, mx.float16)
    x = mx.random.normal((5, 3, 96), key=mx.random.key(1))  # three rows a matrix
    lhs = mx.array([[4, 0], [2, 2], [1, 3]])
    rhs = mx.array([[2], [0], [2]])  # broadcast against lhs
    want = mx.gather_qmm(x, packed, scales, biases, lhs, rhs, True, 32, 4)
    got = ext.gather_qmm(x, packed, scales, biases, lhs, rhs, True, 32, 4)
    assert got.shape == (3, 2, 3, 40)
    close(got, want)
    matched = x[:3]  # no indices: the i-th matrix of x by the i-th expert
    close(
        ext.gather_qmm(matched, packed, scales, biases, None, None, True, 32, 4),
        mx.gather_qmm(matched, packed, scales, biases, None, None, True, 32, 4),
    )


def test_gather_qmm_where_the_kernel_does_not_apply_is_mlx_own(ext: Any) -> None:
    w = mx.random.normal((4, 64, 128), key=mx.random.key(2))
    x = mx.random.normal((2, 1, 1, 128), key=mx.random.key(3))
    chosen = mx.array([[1, 3], [0, 0]], dtype=mx.uint32)
    p3, s3, b3 = mx.quantize(w, group_size=32, bits=3)
    packed, scales, biases = mx.quantize(w, group_size=32, bits=4)
    cases: list[tuple[tuple[mx.array, mx.array, mx.array, mx.array], dict[str, Any]]] = [
        ((x, p3, s3, b3), {"group_size": 32, "bits": 3}),
        ((x.astype(mx.float16), packed, scales, biases), {"group_size": 32, "bits": 4}),
        ((x[..., :64], packed, scales, biases), {"group_size": 32, "bits": 4, "transpose": False}),
    ]
    for (a, w, s, b), options in cases:
        want = mx.gather_qmm(a, w, s, b, rhs_indices=chosen, **options)
        got = ext.gather_qmm(a, w, s, b, rhs_indices=chosen, **options)
        np.testing.assert_array_equal(
            np.asarray(got.astype(mx.float32)), np.asarray(want.astype(mx.float32))
        )


def test_gated_activations_equal_mlx(ext: Any) -> None:
    from mlx_lm.models.activations import swiglu

    for shape in [(1, 1, 2048), (1, 1, 7), (3, 5, 1536), (65, 1, 40), (1, 300, 96)]:
        gate = mx.random.normal(shape, key=mx.random.key(shape[-1])) * 4
        up = mx.random.normal(shape, key=mx.random.key(shape[0]))
        close(ext.activation(gate, up, kind="silu"), swiglu(gate, up), 1e-6)
        close(ext.activation(gate, kind="gelu_tanh"), nn.gelu_approx(gate), 1e-6)
        close(ext.activation(gate, up, kind="gelu_tanh"), nn.gelu_approx(gate) * up, 1e-6)
    far = mx.array([-1e4, -100.0, -30.0, 0.0, 30.0, 100.0, 1e4])
    close(ext.activation(far, kind="silu"), nn.silu(far), 1e-6)
    close(ext.activation(far, kind="gelu_tanh"), nn.gelu_approx(far), 1e-6)
    view = mx.random.normal((64, 24)).T  # not contiguous
    close(ext.activation(view, view, kind="silu"), swiglu(view, view), 1e-6)


def test_gated_activations_it_cannot_take_are_left_to_mlx(ext: Any) -> None:
    x = mx.random.normal((2, 64))
    assert ext.activation(x.astype(mx.float16), kind="silu") is None
    assert ext.activation(x, x[:1], kind="silu") is None  # broadcast: not the kernel's
    assert ext.activation(x, kind="relu") is None
    assert ext.activation(x, kind="gelu_tanh") is not None


def test_rms_norm_equals_mlx(ext: Any) -> None:
    for d in (7, 64, 77, 576):
        weight = mx.random.normal((d,), key=mx.random.key(d))
        x = mx.random.normal((2, 5, d), key=mx.random.key(d + 1)) * 3
        close(ext.rms_norm(x, weight, 1e-5), mx.fast.rms_norm(x, weight, 1e-5))
        view = x.transpose(1, 0, 2)
        close(ext.rms_norm(view, weight, 1e-6), mx.fast.rms_norm(view, weight, 1e-6))
    half = mx.random.normal((3, 8), key=mx.random.key(1)).astype(mx.float16)
    np.testing.assert_array_equal(
        np.asarray(ext.rms_norm(half, None, 1e-5)), np.asarray(mx.fast.rms_norm(half, None, 1e-5))
    )


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("dims", [64, 32])
def test_rope_equals_mlx(ext: Any, traditional: bool, dims: int) -> None:
    # [batch, heads, tokens, features] as attention passes it: a transposed view.
    x = mx.random.normal((2, 7, 3, 64), key=mx.random.key(dims)).transpose(0, 2, 1, 3)
    freqs = mx.random.uniform(1, 1000, (dims // 2,), key=mx.random.key(3))
    for offset in (0, 19, mx.array([4, 300])):
        for base, scale, f in ((10000.0, 1.0, None), (500000.0, 0.25, None), (None, 1.0, freqs)):
            options: dict[str, Any] = dict(
                traditional=traditional, base=base, scale=scale, offset=offset, freqs=f
            )
            close(ext.rope(x, dims, **options), mx.fast.rope(x, dims, **options), 1e-5)


@pytest.mark.parametrize(
    ("batch", "heads", "kv_heads", "n", "t", "dim"),
    [
        (1, 9, 3, 1, 1, 64),  # a first decode step
        (2, 9, 3, 1, 70, 64),  # decode, grouped query heads
        (3, 4, 4, 5, 71, 128),  # a verify pass, every head its own keys
        (1, 2, 1, 40, 300, 48),  # a prefill chunk, an unspecialised head size
        (2, 8, 2, 130, 130, 64),  # a whole prompt: key blocks, partly masked rows
        (2, 4, 1, 1, 200, 256),  # Gemma's decode: four heads of 256 features over one key head
        (1, 2, 2, 3, 100, 192),  # values 64 features at a time, keys by the general dot
    ],
)
def test_attention_equals_mlx(
    ext: Any, width: str, batch: int, heads: int, kv_heads: int, n: int, t: int, dim: int
) -> None:
    key = mx.random.key(n * t)
    q = mx.random.normal((batch, n, heads, dim), key=key).transpose(0, 2, 1, 3)  # a view
    cache = mx.random.normal((2, batch, kv_heads, t + 9, dim), key=mx.random.key(t))
    k, v = cache[0, :, :, :t], cache[1, :, :, :t]  # views of a longer cache, as mlx-lm's
    # Boolean masks that leave every row a key (an all-masked row is a padded slot: zeros).
    keep = mx.random.uniform(shape=(batch, 1, n, t), key=mx.random.key(5)) > 0.3
    keep = keep | (mx.arange(t) == 0)
    additive = mx.random.normal((batch, heads, n, t), key=mx.random.key(6))
    for mask in (None, "causal", keep, additive):
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=dim**-0.5, mask=mask)
        got = ext.scaled_dot_product_attention(q, k, v, scale=dim**-0.5, mask=mask)
        close(got, want, 1e-5)


def test_attention_gives_zeros_for_a_row_with_every_key_masked(ext: Any, width: str) -> None:
    q, k, v = (mx.random.normal((1, 2, 3, 64), key=mx.random.key(i)) for i in range(3))
    mask = mx.array([True, True, False])[:, None] & mx.array([True, True, True])
    got = np.asarray(ext.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask))
    assert not got[:, :, 2].any() and got[:, :, :2].any()


@pytest.mark.parametrize(("bits", "group"), [(8, 64), (8, 32), (4, 64), (4, 32)])
@pytest.mark.parametrize(
    ("batch", "heads", "kv_heads", "n", "t", "dim"),
    [
        (1, 9, 3, 1, 1, 64),  # a first decode step
        (2, 9, 3, 1, 70, 64),  # decode, grouped query heads
        (3, 4, 4, 5, 71, 128),  # a verify pass
        (2, 8, 2, 130, 130, 64),  # a whole prompt: key blocks, partly masked rows
        (1, 4, 1, 17, 40, 256),  # Gemma's head size
    ],
)
def test_attention_over_a_quantized_cache_equals_mlx_lm(
    ext: Any,
    width: str,
    bits: int,
    group: int,
    batch: int,
    heads: int,
    kv_heads: int,
    n: int,
    t: int,
    dim: int,
) -> None:
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    q = mx.random.normal((batch, heads, n, dim), key=mx.random.key(n * t))
    full = mx.random.normal((2, batch, kv_heads, t + 9, dim), key=mx.random.key(t))
    # Triples of views of a longer cache, as mlx-lm's QuantizedKVCache returns them.
    k, v = (
        [part[:, :, :t] for part in mx.quantize(full[i], group_size=group, bits=bits)]
        for i in (0, 1)
    )
    reference: Any = quantized_scaled_dot_product_attention  # (typed for masks as arrays)
    keep = mx.random.uniform(shape=(batch, 1, n, t), key=mx.random.key(5)) > 0.3
    keep = keep | (mx.arange(t) == 0)
    additive = mx.random.normal((batch, 1, n, t), key=mx.random.key(6))  # mlx-lm's shape
    for mask in (None, "causal", keep, additive):
        want = reference(  # (it scales its queries in place)
            mx.array(q), tuple(k), tuple(v), scale=dim**-0.5, mask=mask, group_size=group, bits=bits
        )
        got = ext.quantized_scaled_dot_product_attention(
            q, k, v, scale=dim**-0.5, mask=mask, group_size=group, bits=bits
        )
        assert got is not None
        close(got, want, 1e-5)


def test_attention_over_a_quantized_cache_it_cannot_read_is_left_to_mlx_lm(ext: Any) -> None:
    q = mx.random.normal((1, 2, 1, 64))
    k = list(mx.quantize(mx.random.normal((1, 2, 8, 64)), group_size=64, bits=8))
    kv3 = list(mx.quantize(mx.random.normal((1, 2, 8, 64)), group_size=64, bits=3))
    call = ext.quantized_scaled_dot_product_attention
    assert call(q, kv3, kv3, scale=0.125, group_size=64, bits=3) is None  # 3 bits
    assert call(q.astype(mx.float16), k, k, scale=0.125, group_size=64, bits=8) is None
    assert call(q, k, k, scale=0.125, mask="sliding", group_size=64, bits=8) is None
    assert call(q, k, k, scale=0.125, group_size=64, bits=8) is not None


def int8_reference(
    x: mx.array, packed: mx.array, scales: mx.array, biases: mx.array, group: int, bits: int
) -> np.ndarray:
    """The int8 path's arithmetic in numpy (float64 but for x's quantization, which is float32
    as the kernel's): x quantized per group (max |x| / 127, ties to even), the integer dot
    products of each group scaled by both scales, the biases times x's group sums."""
    n, k = packed.shape[0], x.shape[-1]
    raw = np.asarray(packed).view(np.uint8).reshape(n, -1).astype(np.int64)
    q = raw if bits == 8 else np.stack([raw & 15, raw >> 4], -1).reshape(n, k)
    xs = np.asarray(x).reshape(-1, k // group, group)
    amax = np.abs(xs).max(-1)
    inverse = np.where(amax > 0, np.float32(127) / np.maximum(amax, 1e-30), 0).astype(np.float32)
    xq = np.rint(xs * inverse[..., None]).astype(np.int64)
    dots = np.einsum("rgj,cgj->rcg", xq, q.reshape(n, k // group, group)).astype(np.float64)
    x_scales = (amax / np.float32(127)).astype(np.float64)
    s = np.asarray(scales.astype(mx.float32)).astype(np.float64)
    b = np.asarray(biases.astype(mx.float32)).astype(np.float64)
    out = (dots * x_scales[:, None, :] * s).sum(-1) + xs.sum(-1).astype(np.float64) @ b.T
    return out.reshape(*x.shape[:-1], n)


@pytest.mark.parametrize(("bits", "group"), [(4, 32), (4, 64), (8, 16), (8, 32), (8, 64)])
def test_int8_matmul_does_the_int8_arithmetic(ext: Any, width: str, bits: int, group: int) -> None:
    """AVX2's maddubs (8-bit weights by the sign trick) and AVX-512 VNNI's vpdpbusd, where this
    CPU has it: the same numbers as the int8 arithmetic written out, for 1..33 rows, groups that
    fill one lane set, several, and a last one padded."""
    from mlxgate.models.cpu.int8 import layout

    for seed, (n, groups) in enumerate([(37, 3), (130, 9), (1, 1), (65, 20), (9, 32)]):
        k = group * groups
        packed, scales, biases = quantized(n, k, bits, group, mx.float16, seed)
        int8_weight = layout(packed, scales, biases, group, bits)
        for rows in (1, 2, 5, 8, 33):
            x = mx.random.normal((rows, k), key=mx.random.key(200 + rows)) * 3
            if rows == 5:
                x = x * (mx.arange(k) >= group)  # a group of zeros: scale 0
            got = ext.int8_matmul(x, *int8_weight, group_size=group, bits=bits)
            want = int8_reference(x, packed, scales, biases, group, bits)
            close(got, mx.array(want.astype(np.float32)), 1e-5)


def test_int8_matmul_is_close_to_the_exact_one_and_takes_batches(ext: Any) -> None:
    from mlxgate.models.cpu.int8 import layout

    packed, scales, biases = quantized(200, 640, 8, 32, mx.bfloat16, seed=21)
    x = mx.random.normal((2, 3, 640), key=mx.random.key(22))
    got = ext.int8_matmul(x, *layout(packed, scales, biases, 32, 8), group_size=32, bits=8)
    want = ext.quantized_matmul(x, packed, scales, biases, True, 32, 8)
    assert got.shape == (2, 3, 200)
    error = np.abs(np.asarray(got) - np.asarray(want))
    assert 0 < error.max() < 0.02 * np.abs(np.asarray(want)).max()  # not exact, but near


def test_int8_matmul_refuses_what_it_cannot_take(ext: Any) -> None:
    from mlxgate.models.cpu.int8 import layout

    packed, scales, biases = quantized(16, 256, 4, 32, mx.float16, seed=23)
    weight = layout(packed, scales, biases, 32, 4)
    x = mx.random.normal((2, 256))
    for call in (
        lambda: ext.int8_matmul(mx.zeros((2, 288)), *weight, group_size=32, bits=4),  # 9 groups
        lambda: ext.int8_matmul(x, *weight, group_size=64, bits=4),  # another group
        lambda: ext.int8_matmul(x, *weight, group_size=32, bits=8),  # another width
        lambda: ext.int8_matmul(x.astype(mx.float16), *weight, group_size=32, bits=4),
        lambda: ext.int8_matmul(x, weight[0][:, 1:], *weight[1:], group_size=32, bits=4),
    ):
        with pytest.raises(ValueError, match="int8_matmul"):
            call()


def tiny_quantized_llama() -> nn.Module:
    from mlx_lm.models import llama
    from mlx_lm.utils import quantize_model

    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=128,
        num_hidden_layers=2,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=256,
        tie_word_embeddings=True,
    )
    mx.random.seed(0)
    model = llama.Model(args)
    quantize_model(model, {}, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model


def test_kernels_go_to_one_instance_not_to_mlx_or_its_siblings() -> None:
    from mlx_lm.models import llama

    ours, sibling = tiny_quantized_llama(), tiny_quantized_llama()
    tokens = mx.array([list(range(40))])
    before = sibling(tokens)

    assert kernels.install(ours)
    assert kernels.installed(ours)
    assert not kernels.installed(sibling)
    assert type(sibling.model.layers[0].self_attn) is llama.Attention
    assert mx.quantized_matmul is not None and not hasattr(mx, "__mlxgate__")
    assert "Mlxgate" not in str(type(sibling.model.norm))
    # The tied embedding's LM head (`as_linear`, not `__call__`) goes through the kernel too.
    assert "as_linear" in vars(type(ours.model.embed_tokens))
    close(ours(tokens), before, 1e-4)
    np.testing.assert_array_equal(np.asarray(sibling(tokens)), np.asarray(before))


def test_int8_activations_take_several_rows_and_leave_one_row_exact() -> None:
    from mlxgate.models.cpu import int8

    ours, exact = tiny_quantized_llama(), tiny_quantized_llama()
    kernels.install(ours)
    kernels.install(exact)
    linears = [m for m in ours.modules() if isinstance(m, nn.QuantizedLinear)]
    count, size = int8.install(ours)
    assert count == len(linears) + 1  # and the tied head
    assert size == int8.nbytes(ours) > 0
    assert int8.install(ours) == (0, 0)  # once
    assert "_int8" not in ours.parameters()["model"]["layers"][0]["mlp"]["up_proj"]

    one = mx.array([[7]])
    np.testing.assert_array_equal(np.asarray(ours(one)), np.asarray(exact(one)))
    # 40 rows: under the sgemm threshold, so AVX2 without VNNI takes the int8 path too.
    tokens = mx.array([list(range(20)), list(range(20, 40))])
    got, want = np.asarray(ours(tokens)), np.asarray(exact(tokens))
    error = np.abs(got - want).max()
    assert 0 < error < 0.05 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.9


def test_a_model_with_int8_activations_is_still_served_in_batches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine's start-up check (is a batch computed as each sequence alone?) compares one
    row with several, which the int8 path computes differently by design (the embedded model's
    rows by 2%, and the engine then served it one sequence at a time): the check runs with the
    int8 path suspended, so the model is still prefilled and decoded in batches."""
    from mlxgate.engine import batch_check
    from mlxgate.models.cpu import int8
    from support.tiny_engine import Served

    monkeypatch.setattr(batch_check, "TOLERANCE", 1e-5)
    model, exact = tiny_quantized_llama(), tiny_quantized_llama()
    kernels.install(model)
    kernels.install(exact)
    int8.install(model)
    tokens = mx.array([[5, 17, 3, 99], [1, 2, 3, 4]])
    assert not np.array_equal(np.asarray(model(tokens)), np.asarray(exact(tokens)))
    with int8.suspended(model):  # as the check runs it
        np.testing.assert_array_equal(np.asarray(model(tokens)), np.asarray(exact(tokens)))
    assert not np.array_equal(np.asarray(model(tokens)), np.asarray(exact(tokens)))
    served = Served(model)
    try:
        assert served.engine.batch_problems.prefill is None
        assert served.engine.batch_problems.decode is None
        readers = [served.submit([5, 17, 3 + i, 99]) for i in range(4)]
        assert all(len(served.result(reader)[0]) == 12 for reader in readers)
    finally:
        served.engine.stop()


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_the_experts_of_a_mixture_go_through_the_kernel(ext: Any, arch: str) -> None:
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    from support.tiny_models import twins

    ours, plain = twins(arch, "affine")
    switches = [m for m in ours.modules() if isinstance(m, QuantizedSwitchLinear)]
    assert switches
    assert kernels.install(ours)
    for switch in switches:
        assert type(switch).__call__.__globals__["mx"].gather_qmm is ext.gather_qmm
    tokens = mx.array([[5, 17, 3, 99, 42, 7], [1, 2, 3, 4, 5, 6]])
    close(ours(tokens), plain(tokens), 1e-4)


def test_gemma_norms_make_their_offset_once_and_give_the_same_numbers() -> None:
    from mlx_lm.models import gemma3_text

    from mlxgate.models.cpu import offset_norms
    from support.tiny_models import twins

    ours, plain = twins("gemma3_text", "affine")
    tokens = mx.array([[5, 17, 3, 99, 42, 7]])
    assert offset_norms.install(ours)
    norms = [m for m in ours.modules() if isinstance(m, gemma3_text.RMSNorm)]
    assert norms and all(type(m).__call__ is not gemma3_text.RMSNorm.__call__ for m in norms)
    np.testing.assert_array_equal(np.asarray(ours(tokens)), np.asarray(plain(tokens)))
    # A replaced weight is followed, not the sum made from the old one.
    changed = mx.random.normal(ours.model.norm.weight.shape)
    ours.model.norm.weight = changed
    plain.model.norm.weight = changed
    np.testing.assert_array_equal(np.asarray(ours(tokens)), np.asarray(plain(tokens)))


def test_without_the_extension_the_model_keeps_mlx_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "_extension", lambda: "this CPU lacks AVX2, FMA or F16C")
    model = tiny_quantized_llama()
    assert not kernels.install(model)
    assert not kernels.installed(model)
    assert kernels.describe() == "MLX's own (this CPU lacks AVX2, FMA or F16C)"
