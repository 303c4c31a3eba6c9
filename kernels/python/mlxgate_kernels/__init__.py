"""mlxgate's CPU kernels as MLX operations; see mlxgate.models.cpu for how they serve."""

from mlxgate_kernels._ext import (
    activation,
    cpu_supported,
    gather_qmm,
    int8_matmul,
    quantized_matmul,
    quantized_scaled_dot_product_attention,
    rms_norm,
    rope,
    scaled_dot_product_attention,
    set_sgemm_rows,
    sgemm_rows,
    threads,
    use_avx512,
    using_avx512,
    vnni_supported,
)

__all__ = [
    "activation",
    "cpu_supported",
    "gather_qmm",
    "int8_matmul",
    "quantized_matmul",
    "quantized_scaled_dot_product_attention",
    "rms_norm",
    "rope",
    "scaled_dot_product_attention",
    "set_sgemm_rows",
    "sgemm_rows",
    "threads",
    "use_avx512",
    "using_avx512",
    "vnni_supported",
]
