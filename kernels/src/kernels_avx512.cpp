// The quantized matmul with AVX-512 (F, BW, VL, DQ), for the CPUs that have it: sixteen weights
// a register and up to sixteen rows a pass, twice the multiply-adds of the AVX2 kernel per
// dequantized weight, which is what a step of many rows (32 streams, a verify pass) is bound
// by. Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq; run after avx512_supported().
#include "kernels.h"

#if defined(MLXGATE_X86)
#include <immintrin.h>

#include "scales.h"

namespace mlxgate {

bool avx512_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

namespace {

// Sixteen consecutive weights of a row as floats, before scale and bias: the nibbles of two
// words (4 bits) or the bytes of four (8 bits).
template <int BITS>
inline __m512 unpack16(const uint32_t* words) {
  if constexpr (BITS == 4) {
    const __m512i shifts =
        _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
    const __m512i pick = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i two =
        _mm512_castsi128_si512(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(words)));
    const __m512i spread = _mm512_permutexvar_epi32(pick, two);
    return _mm512_cvtepi32_ps(
        _mm512_and_si512(_mm512_srlv_epi32(spread, shifts), _mm512_set1_epi32(0xF)));
  } else {
    return _mm512_cvtepi32_ps(
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(words))));
  }
}

template <int BITS, int ROWS>
inline void dot_rows(
    const float* x, long x_stride, const QuantizedWeight& w, int c, float* out, long out_stride) {
  const int groups = w.k / w.group;
  const long row_words = static_cast<long>(w.k) * BITS / 32;
  const uint32_t* packed = w.packed + c * row_words;
  __m512 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  for (int g = 0; g < groups; ++g) {
    const long at = static_cast<long>(c) * groups + g;
    const __m512 scale = _mm512_set1_ps(scale_at(w.scales, w.scale_type, at));
    const __m512 bias = _mm512_set1_ps(scale_at(w.biases, w.scale_type, at));
    for (int j = g * w.group; j < (g + 1) * w.group; j += 16) {
      const __m512 weight = _mm512_fmadd_ps(unpack16<BITS>(packed + j * BITS / 32), scale, bias);
      for (int r = 0; r < ROWS; ++r) {
        acc[r] = _mm512_fmadd_ps(weight, _mm512_loadu_ps(x + r * x_stride + j), acc[r]);
      }
    }
  }
  for (int r = 0; r < ROWS; ++r) out[r * out_stride + c] = _mm512_reduce_add_ps(acc[r]);
}

template <int BITS, int ROWS>
inline void dot_remainder(
    int rows, const float* x, long x_stride, const QuantizedWeight& w, int c, float* out,
    long out_stride) {
  if constexpr (ROWS > 0) {
    if (rows == ROWS) {
      dot_rows<BITS, ROWS>(x, x_stride, w, c, out, out_stride);
    } else {
      dot_remainder<BITS, ROWS - 1>(rows, x, x_stride, w, c, out, out_stride);
    }
  }
}

template <int BITS>
void matmul_columns(const float* x, int rows, const QuantizedWeight& w, float* out, int c0, int c1) {
  for (int c = c0; c < c1; ++c) {
    int r = 0;
    for (; r + 16 <= rows; r += 16) {
      dot_rows<BITS, 16>(x + static_cast<long>(r) * w.k, w.k, w, c, out + static_cast<long>(r) * w.n, w.n);
    }
    if (r < rows) {
      dot_remainder<BITS, 15>(
          rows - r, x + static_cast<long>(r) * w.k, w.k, w, c, out + static_cast<long>(r) * w.n, w.n);
    }
  }
}

}  // namespace

void quantized_matmul_columns_avx512(
    const float* x, int rows, const QuantizedWeight& w, float* out, int c0, int c1) {
  if (w.bits == 4) {
    matmul_columns<4>(x, rows, w, out, c0, c1);
  } else {
    matmul_columns<8>(x, rows, w, out, c0, c1);
  }
}

}  // namespace mlxgate

#else

namespace mlxgate {
bool avx512_supported() { return false; }
void quantized_matmul_columns_avx512(const float*, int, const QuantizedWeight&, float*, int, int) {}
}  // namespace mlxgate

#endif
