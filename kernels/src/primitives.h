// MLX operations backed by mlxgate's CPU kernels. Each takes what the MLX op it stands in for
// takes; where the kernel does not apply (another device, dtype, mode or shape) it returns
// that MLX op itself, so a caller never has to ask first.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "mlx/array.h"
#include "mlx/stream.h"
#include "mlx/utils.h"

namespace mlxgate {

namespace mx = mlx::core;

// mx.quantized_matmul for the affine mode, 4 or 8 bits, group 32 or 64 (or 16 at 8 bits), float32
// activations, transposed weights (what QuantizedLinear computes).
mx::array quantized_matmul(
    const mx::array& x, const mx::array& w, const mx::array& scales,
    const std::optional<mx::array>& biases, bool transpose, std::optional<int> group_size,
    std::optional<int> bits, const std::string& mode, mx::StreamOrDevice s);

// The int8-activation matmul (opt-in, not exact; kernels.h's Int8Weight): x [..., k] float32
// quantized to 8 bits a group, against a weight in the int8 layout (models/cpu/int8.py makes
// it): packed uint8, scales and biases float32 [n, padded groups]. Throws std::invalid_argument
// for anything else.
mx::array int8_matmul(
    const mx::array& x, const mx::array& packed, const mx::array& scales,
    const mx::array& biases, int group_size, int bits, mx::StreamOrDevice s);

// mx.gather_qmm on the same weights (a stack of experts' matrices), for mlx-lm's
// QuantizedSwitchLinear: each expert's matrix read once for every row routed to it.
mx::array gather_qmm(
    const mx::array& x, const mx::array& w, const mx::array& scales,
    const std::optional<mx::array>& biases, const std::optional<mx::array>& lhs_indices,
    const std::optional<mx::array>& rhs_indices, bool transpose, std::optional<int> group_size,
    std::optional<int> bits, const std::string& mode, const std::optional<mx::array>& global_scale,
    bool sorted_indices, mx::StreamOrDevice s);

// A gated MLP's activation of float32 x, times `up` (of x's shape) where given: "silu"
// (mlx-lm's swiglu(x, up)) or "gelu_tanh" (nn.gelu_approx); nullopt where the kernel does not
// apply (the caller keeps MLX's way).
std::optional<mx::array> activation(
    const mx::array& x, const std::optional<mx::array>& up, const std::string& kind,
    mx::StreamOrDevice s);

// mx.fast.rms_norm for float32 rows.
mx::array rms_norm(
    const mx::array& x, const std::optional<mx::array>& weight, float eps, mx::StreamOrDevice s);

// mx.fast.rope for float32 [batch, heads, tokens, features] (the offset an int or one per row).
mx::array rope(
    const mx::array& x, int dims, bool traditional, std::optional<float> base, float scale,
    const mx::array& offset, const std::optional<mx::array>& freqs, mx::StreamOrDevice s);

// mx.fast.scaled_dot_product_attention for float32 [batch, heads, tokens, features] (grouped
// query heads; mask none, "causal", a boolean or an additive array; no sinks).
mx::array scaled_dot_product_attention(
    const mx::array& queries, const mx::array& keys, const mx::array& values, float scale,
    const std::string& mask_mode, const std::optional<mx::array>& mask, mx::StreamOrDevice s);

// Attention over mlx-lm's quantized KV cache (what its quantized_scaled_dot_product_attention
// computes): keys and values as mx.quantize triples [batch, kv_heads, t, ...], 4 or 8 bits;
// nullopt where the kernel does not apply (the caller keeps mlx-lm's way).
std::optional<mx::array> quantized_scaled_dot_product_attention(
    const mx::array& queries, const std::vector<mx::array>& keys,
    const std::vector<mx::array>& values, float scale, const std::string& mask_mode,
    const std::optional<mx::array>& mask, int group_size, int bits, mx::StreamOrDevice s);

// Rows from which quantized_matmul dequantizes a tile of the weight and calls the BLAS sgemm
// instead of its own dot products (prefill chunks); 0 turns the sgemm path off.
void set_sgemm_rows(int rows);
int sgemm_rows();

}  // namespace mlxgate
