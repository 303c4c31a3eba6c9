from collections.abc import Sequence

import mlx.core as mx

def cpu_supported() -> bool: ...
def threads() -> int: ...
def set_sgemm_rows(rows: int) -> None: ...
def sgemm_rows() -> int: ...
def use_avx512(use: bool) -> None: ...
def using_avx512() -> bool: ...
def quantized_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None = None,
    transpose: bool = True,
    group_size: int | None = None,
    bits: int | None = None,
    mode: str = "affine",
    *,
    stream: mx.Stream | mx.Device | None = None,
) -> mx.array: ...
def int8_matmul(
    x: mx.array,
    packed: mx.array,
    scales: mx.array,
    biases: mx.array,
    *,
    group_size: int,
    bits: int,
    stream: mx.Stream | mx.Device | None = None,
) -> mx.array: ...
def vnni_supported() -> bool: ...
def gather_qmm(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None = None,
    lhs_indices: mx.array | None = None,
    rhs_indices: mx.array | None = None,
    transpose: bool = True,
    group_size: int | None = None,
    bits: int | None = None,
    mode: str = "affine",
    global_scale: mx.array | None = None,
    *,
    sorted_indices: bool = False,
    stream: mx.Stream | mx.Device | None = None,
) -> mx.array: ...
def activation(
    x: mx.array,
    up: mx.array | None = None,
    *,
    kind: str,
    stream: mx.Stream | mx.Device | None = None,
) -> mx.array | None: ...
def rms_norm(
    x: mx.array,
    weight: mx.array | None,
    eps: float,
    *,
    stream: mx.Stream | mx.Device | None = None,
) -> mx.array: ...
def rope(
    a: mx.array,
    dims: int,
    *,
    traditional: bool,
    base: float | None,
    scale: float,
    offset: int | mx.array,
    freqs: mx.array | None = None,
    stream: mx.Stream | mx.Device | None = None,
) -> mx.array: ...
def scaled_dot_product_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    mask: str | mx.array | None = None,
    stream: mx.Stream | mx.Device | None = None,
) -> mx.array: ...
def quantized_scaled_dot_product_attention(
    q: mx.array,
    k: Sequence[mx.array],
    v: Sequence[mx.array],
    *,
    scale: float,
    mask: str | mx.array | None = None,
    group_size: int,
    bits: int,
    stream: mx.Stream | mx.Device | None = None,
) -> mx.array | None: ...
