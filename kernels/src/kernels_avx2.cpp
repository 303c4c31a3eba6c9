// The kernels with AVX2, FMA and F16C (this file alone is compiled with -mavx2 -mfma -mf16c;
// nothing here runs before cpu_supported() says yes). Elsewhere, a portable stub says no.
#include "kernels.h"

#include <cmath>
#include <cstring>

#if defined(MLXGATE_X86)
#include <immintrin.h>

namespace mlxgate {

bool cpu_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c");
}

namespace {

inline float scale_at(const void* p, ScaleType type, long i) {
  switch (type) {
    case ScaleType::float32:
      return static_cast<const float*>(p)[i];
    case ScaleType::float16:
      return _cvtsh_ss(static_cast<const uint16_t*>(p)[i]);
    case ScaleType::bfloat16: {
      uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(p)[i]) << 16;
      float value;
      std::memcpy(&value, &bits, sizeof value);
      return value;
    }
  }
  return 0.0f;
}

inline float horizontal_sum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

// Eight consecutive weights of a row as floats, before scale and bias. For 4 bits they are
// the eight nibbles of one word; for 8 bits the eight bytes of two.
template <int BITS>
inline __m256 unpack8(const uint32_t* words) {
  if constexpr (BITS == 4) {
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    __m256i word = _mm256_set1_epi32(static_cast<int>(*words));
    __m256i q = _mm256_and_si256(_mm256_srlv_epi32(word, shifts), _mm256_set1_epi32(0xF));
    return _mm256_cvtepi32_ps(q);
  } else {
    __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(words));
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
  }
}

// ROWS rows of x against output column c, over the whole reduction.
template <int BITS, int ROWS>
inline void dot_rows(
    const float* x, long x_stride, const QuantizedWeight& w, int c, float* out, long out_stride) {
  constexpr int words_per_8 = BITS / 4;  // words holding 8 weights
  const int groups = w.k / w.group;
  const long row_words = static_cast<long>(w.k) * BITS / 32;
  const uint32_t* packed = w.packed + c * row_words;
  __m256 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
  for (int g = 0; g < groups; ++g) {
    const long at = static_cast<long>(c) * groups + g;
    const __m256 scale = _mm256_set1_ps(scale_at(w.scales, w.scale_type, at));
    const __m256 bias = _mm256_set1_ps(scale_at(w.biases, w.scale_type, at));
    for (int j = g * w.group; j < (g + 1) * w.group; j += 8) {
      const __m256 weight =
          _mm256_fmadd_ps(unpack8<BITS>(packed + j / 8 * words_per_8), scale, bias);
      for (int r = 0; r < ROWS; ++r) {
        acc[r] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(x + r * x_stride + j), acc[r]);
      }
    }
  }
  for (int r = 0; r < ROWS; ++r) out[r * out_stride + c] = horizontal_sum(acc[r]);
}

template <int BITS>
void matmul_columns(const float* x, int rows, const QuantizedWeight& w, float* out, int c0, int c1) {
  // Column outer, row blocks inner: a weight row is read from memory once, whatever the rows.
  for (int c = c0; c < c1; ++c) {
    int r = 0;
    for (; r + 8 <= rows; r += 8) dot_rows<BITS, 8>(x + r * w.k, w.k, w, c, out + r * w.n, w.n);
    const float* xr = x + static_cast<long>(r) * w.k;
    float* outr = out + static_cast<long>(r) * w.n;
    switch (rows - r) {
      case 7: dot_rows<BITS, 7>(xr, w.k, w, c, outr, w.n); break;
      case 6: dot_rows<BITS, 6>(xr, w.k, w, c, outr, w.n); break;
      case 5: dot_rows<BITS, 5>(xr, w.k, w, c, outr, w.n); break;
      case 4: dot_rows<BITS, 4>(xr, w.k, w, c, outr, w.n); break;
      case 3: dot_rows<BITS, 3>(xr, w.k, w, c, outr, w.n); break;
      case 2: dot_rows<BITS, 2>(xr, w.k, w, c, outr, w.n); break;
      case 1: dot_rows<BITS, 1>(xr, w.k, w, c, outr, w.n); break;
      default: break;
    }
  }
}

template <int BITS>
void dequantize(const QuantizedWeight& w, float* dst, int c0, int c1) {
  constexpr int words_per_8 = BITS / 4;
  const int groups = w.k / w.group;
  const long row_words = static_cast<long>(w.k) * BITS / 32;
  for (int c = c0; c < c1; ++c) {
    const uint32_t* packed = w.packed + c * row_words;
    float* row = dst + static_cast<long>(c - c0) * w.k;
    for (int g = 0; g < groups; ++g) {
      const long at = static_cast<long>(c) * groups + g;
      const __m256 scale = _mm256_set1_ps(scale_at(w.scales, w.scale_type, at));
      const __m256 bias = _mm256_set1_ps(scale_at(w.biases, w.scale_type, at));
      for (int j = g * w.group; j < (g + 1) * w.group; j += 8) {
        _mm256_storeu_ps(
            row + j, _mm256_fmadd_ps(unpack8<BITS>(packed + j / 8 * words_per_8), scale, bias));
      }
    }
  }
}

}  // namespace

void quantized_matmul_columns(
    const float* x, int rows, const QuantizedWeight& w, float* out, int c0, int c1) {
  if (w.bits == 4) {
    matmul_columns<4>(x, rows, w, out, c0, c1);
  } else {
    matmul_columns<8>(x, rows, w, out, c0, c1);
  }
}

void dequantize_columns(const QuantizedWeight& w, float* dst, int c0, int c1) {
  if (w.bits == 4) {
    dequantize<4>(w, dst, c0, c1);
  } else {
    dequantize<8>(w, dst, c0, c1);
  }
}

void rms_norm_rows(
    const float* x, const float* weight, float eps, int d, float* out, int r0, int r1) {
  for (int r = r0; r < r1; ++r) {
    const float* xr = x + static_cast<long>(r) * d;
    float* outr = out + static_cast<long>(r) * d;
    __m256 squares = _mm256_setzero_ps();
    int j = 0;
    for (; j + 8 <= d; j += 8) {
      __m256 v = _mm256_loadu_ps(xr + j);
      squares = _mm256_fmadd_ps(v, v, squares);
    }
    float sum = horizontal_sum(squares);
    for (; j < d; ++j) sum += xr[j] * xr[j];
    // As MLX's: x * rsqrt(mean(x^2) + eps), then times the weight.
    const float norm = 1.0f / std::sqrt(sum / static_cast<float>(d) + eps);
    const __m256 scale = _mm256_set1_ps(norm);
    for (j = 0; j + 8 <= d; j += 8) {
      __m256 v = _mm256_mul_ps(_mm256_loadu_ps(xr + j), scale);
      _mm256_storeu_ps(outr + j, _mm256_mul_ps(v, _mm256_loadu_ps(weight + j)));
    }
    for (; j < d; ++j) outr[j] = (xr[j] * norm) * weight[j];
  }
}

void rope_rows(
    const float* x, const float* positions, const float* inv_freqs, int dims, bool traditional,
    int d, float* out, int r0, int r1) {
  const int half = dims / 2;
  for (int r = r0; r < r1; ++r) {
    const float* xr = x + static_cast<long>(r) * d;
    float* outr = out + static_cast<long>(r) * d;
    const float position = positions[r];
    for (int i = 0; i < half; ++i) {
      const float theta = position * inv_freqs[i];
      const float cos_t = std::cos(theta);
      const float sin_t = std::sin(theta);
      const int a = traditional ? 2 * i : i;
      const int b = traditional ? 2 * i + 1 : i + half;
      const float x1 = xr[a];
      const float x2 = xr[b];
      outr[a] = x1 * cos_t - x2 * sin_t;
      outr[b] = x1 * sin_t + x2 * cos_t;
    }
    if (dims < d) std::memcpy(outr + dims, xr + dims, sizeof(float) * (d - dims));
  }
}

}  // namespace mlxgate

#else  // not x86-64: MLX's own ops serve (Metal on a Mac)

namespace mlxgate {
bool cpu_supported() { return false; }
void quantized_matmul_columns(const float*, int, const QuantizedWeight&, float*, int, int) {}
void dequantize_columns(const QuantizedWeight&, float*, int, int) {}
void rms_norm_rows(const float*, const float*, float, int, float*, int, int) {}
void rope_rows(const float*, const float*, const float*, int, bool, int, float*, int, int) {}
}  // namespace mlxgate

#endif
