// The raw CPU kernels, free of MLX: plain pointers in, plain pointers out. Each runs on one
// thread over a range of rows or columns; primitives.cpp splits the work over the pool.
#pragma once

#include <cstdint>

namespace mlxgate {

// How a quantized weight's scales and biases are stored (MLX keeps them in the model's dtype).
enum class ScaleType { float32, float16, bfloat16 };

// The most groups a row of one weight has for the one-row kernels (k = 16,384 at group 32); a
// weight with more takes the general path.
constexpr int MAX_ROW_GROUPS = 512;

struct QuantizedWeight {
  const uint32_t* packed;  // [n, k * bits / 32], MLX's affine layout (element j at bit j * bits)
  const void* scales;      // [n, k / group]
  const void* biases;      // [n, k / group]
  ScaleType scale_type;
  int bits;   // 4 or 8
  int group;  // 16 (8 bits: GGUF's Q6_K), 32 or 64
  int n;
  int k;
};

// Whether this CPU runs the kernels below (x86-64 with AVX2, FMA and F16C).
bool cpu_supported();

// Whether quantized_matmul_columns takes its one row by a kernel of its own (a decode step of
// one stream), which reads the weights 32 at a time. For a 4-bit weight it unpacks them low
// nibbles then high, so it takes x in pairs order: each block of 32 as its 16 even elements,
// then its 16 odd ones.
// (Internal linkage: each file keeps its own copy, built for its own instructions.)
namespace {
inline bool one_row(int rows, const QuantizedWeight& w) {
  return rows == 1 && w.k % 32 == 0 && w.k / w.group <= MAX_ROW_GROUPS;
}
inline bool takes_pairs(int rows, const QuantizedWeight& w) {
  return one_row(rows, w) && w.bits == 4;
}
}  // namespace

// out[r, c] = sum_j x[r * x_stride + j] * w[c, j] for rows [0, rows) and columns [c0, c1), the
// weight dequantized in registers; each weight row is read once for all rows. x in pairs order
// where takes_pairs(rows, w).
void quantized_matmul_columns(
    const float* x, long x_stride, int rows, const QuantizedWeight& w, float* out, int c0, int c1);

// The same with AVX-512 (kernels_avx512.cpp), which quantized_matmul_columns takes where
// avx512_supported() says the CPU has it, unless use_avx512(false) (or MLXGATE_NO_AVX512=1 in
// the environment) keeps it on AVX2.
bool avx512_supported();
void use_avx512(bool use);
bool using_avx512();
void quantized_matmul_columns_avx512(
    const float* x, long x_stride, int rows, const QuantizedWeight& w, float* out, int c0, int c1);

// The int8-activation path (opt-in, not exact: llama.cpp's way of multiplying quantized weights
// by activations quantized to 8 bits). A weight in the int8 layout has its groups taken eight
// at a time (a lane set; zero groups pad the last), each 32-byte chunk holding four bytes of
// each of its eight groups (lane i: bytes 4t..4t+3 of group i), so that a group's integer
// products sum in one 32-bit lane and are converted and scaled once a group, not once a
// multiply (models/cpu/int8.py makes the layout).
constexpr int INT8_LANES = 8;

struct Int8Weight {
  const uint8_t* packed;  // [n, padded_groups * group * bits / 8]; 4 bits: each 32 bytes hold a
                          // chunk in their low nibbles and the next in their high ones
  const float* scales;    // [n, padded_groups]
  const float* biases;    // [n, padded_groups]
  int bits;               // 4 or 8
  int group;              // 16 (8 bits only), 32 or 64
  int n;
  int padded_groups;      // a multiple of INT8_LANES
};

// Rows of x in the same chunk order, each group quantized to 8 bits by its own scale (max |x|
// / 127), with x's float sum over each group (which the biases multiply) and 128 times the sum
// of its quantized values (what an 8-bit weight taken as q - 128 leaves out of a dot product).
struct Int8Rows {
  int8_t* q;        // [rows, padded_groups * group]
  float* scales;    // [rows, padded_groups]
  float* sums;      // [rows, padded_groups]
  int32_t* shifts;  // [rows, padded_groups]
};

// Rows [r0, r1) of x ([rows, k], `x_stride` floats apart) into `into` as Int8Rows lays them out
// for a weight of this group and padded_groups (padding groups are zeros).
void quantize_rows_int8(
    const float* x, long x_stride, int k, int group, int padded_groups, const Int8Rows& into,
    int r0, int r1);

// out[r, c] ([rows, w.n]) for every row and columns [c0, c1): AVX2's maddubs (an 8-bit weight
// taken as q - 128 by the sign trick), or AVX-512 VNNI's vpdpbusd where the CPU has it and
// using_avx512().
void int8_matmul_columns(
    const Int8Rows& x, int rows, const Int8Weight& w, float* out, int c0, int c1);
bool vnni_supported();
void int8_matmul_columns_vnni(
    const Int8Rows& x, int rows, const Int8Weight& w, float* out, int c0, int c1);

// The dequantized weight's rows [c0, c1) into dst ([c1 - c0, k], row-major).
void dequantize_columns(const QuantizedWeight& w, float* dst, int c0, int c1);

// out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * weight, for rows [r0, r1) of width d.
void rms_norm_rows(
    const float* x, const float* weight, float eps, int d, float* out, int r0, int r1);

// The activations of gated MLPs: SiLU (SwiGLU's) and GELU's tanh form (Gemma's GeGLU).
enum class Activation { silu, gelu_tanh };

// out[i] = act(x[i]) * up[i] (or act(x[i]) where up is null) for i in [i0, i1), both written as
// x / (1 + e^-z): z = x for SiLU, z = 2 sqrt(2/pi) (x + 0.044715 x^3) for GELU, whose
// 0.5 (1 + tanh(z / 2)) is the sigmoid of z.
void activation_range(
    const float* x, const float* up, Activation act, float* out, long i0, long i1);

// One rotary embedding: rows [r0, r1) of x [rows, d] where row r sits at position
// positions[r]; the first `dims` features rotate by position * inv_freqs[i] (non-traditional
// halves, or traditional pairs), the rest are copied.
void rope_rows(
    const float* x, const float* positions, const float* inv_freqs, int dims, bool traditional,
    int d, float* out, int r0, int r1);

// One [batch, heads, rows, features] operand of attention: where it starts and its strides in
// elements (the features contiguous). Keys and values are usually views of a larger cache.
struct Strided4 {
  const float* data;
  int64_t batch, head, row;
};

enum class MaskKind { none, causal, boolean, additive };

struct Attention {
  Strided4 queries;  // [batch, heads, n, key_dim]
  Strided4 keys;     // [batch, kv_heads, t, key_dim]
  Strided4 values;   // [batch, kv_heads, t, value_dim]
  int heads, kv_heads, n, t, key_dim, value_dim;
  float scale;
  MaskKind mask_kind;
  const void* mask;         // bool or float32, broadcast to [batch, heads, n, t]
  int64_t mask_strides[4];  // in elements (0 where broadcast)
};

// softmax(q k^T * scale + mask) v for query rows [r0, r1) of head `head` of batch row `b`,
// into out ([batch, heads, n, value_dim], contiguous). One pass over the keys in blocks with a
// running maximum and sum (as flash attention does); a row whose keys are all masked gives 0.
void attention_rows(const Attention& a, int b, int head, int r0, int r1, float* out);

// The same with AVX-512 for 64-feature heads, four query rows sharing each key and value load;
// false (nothing done) for other head sizes. attention_rows takes it where it can.
bool attention_rows_avx512(const Attention& a, int b, int head, int r0, int r1, float* out);

}  // namespace mlxgate
