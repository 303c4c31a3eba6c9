// The kernels with AVX2, FMA and F16C (this file alone is compiled with -mavx2 -mfma -mf16c;
// nothing here runs before cpu_supported() says yes). Elsewhere, a portable stub says no.
#include "kernels.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(MLXGATE_X86)
#include <immintrin.h>

#include "horizontal.h"
#include "int8_matmul.h"
#include "scales.h"

namespace mlxgate {

bool cpu_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c");
}

namespace {

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

// ROWS rows of x against COLS columns from c, over the whole reduction: each load of x serves
// COLS columns, so that the multiply-adds rather than the loads bound a step of many rows. A
// column's sums run in the same order whatever the block, so its values do not depend on which
// columns share it.
template <int BITS, int ROWS, int COLS>
inline void dot_block(
    const float* x, long x_stride, const QuantizedWeight& w, int c, float* out, long out_stride) {
  constexpr int words_per_8 = BITS / 4;
  const int groups = w.k / w.group;
  const long row_words = static_cast<long>(w.k) * BITS / 32;
  const uint32_t* packed = w.packed + c * row_words;
  __m256 acc[COLS][ROWS];
  for (int cc = 0; cc < COLS; ++cc)
    for (int r = 0; r < ROWS; ++r) acc[cc][r] = _mm256_setzero_ps();
  for (int g = 0; g < groups; ++g) {
    float scale[COLS], bias[COLS];
    for (int cc = 0; cc < COLS; ++cc) {
      const long at = static_cast<long>(c + cc) * groups + g;
      scale[cc] = scale_at(w.scales, w.scale_type, at);
      bias[cc] = scale_at(w.biases, w.scale_type, at);
    }
    for (int j = g * w.group; j < (g + 1) * w.group; j += 8) {
      __m256 weight[COLS];
      for (int cc = 0; cc < COLS; ++cc) {
        weight[cc] = _mm256_fmadd_ps(unpack8<BITS>(packed + cc * row_words + j / 8 * words_per_8),
            _mm256_set1_ps(scale[cc]), _mm256_set1_ps(bias[cc]));
      }
      for (int r = 0; r < ROWS; ++r) {
        const __m256 xv = _mm256_loadu_ps(x + r * x_stride + j);
        for (int cc = 0; cc < COLS; ++cc) acc[cc][r] = _mm256_fmadd_ps(weight[cc], xv, acc[cc][r]);
      }
    }
  }
  for (int cc = 0; cc < COLS; ++cc)
    for (int r = 0; r < ROWS; ++r) out[r * out_stride + c + cc] = horizontal_sum(acc[cc][r]);
}

// One row against output column c (a decode step of one stream), which is bound by the
// instructions per weight rather than by the row's loads. As dot_block<BITS, 1, 1>, but with fewer
// of them: the column's scales and biases converted to floats up front; 4-bit weights unpacked
// 32 at a time (the low nibbles of 16 bytes, then the high ones: x comes in pairs order, see
// kernels.h); four chains of multiply-adds instead of one, so that no FMA
// waits for the one before it. Needs groups <= MAX_ROW_GROUPS. (A one-row step of the embedded
// model: 1.17x faster; issue 50's note.)
template <int BITS>
inline float dot_row(const float* x, const QuantizedWeight& w, int c) {
  constexpr int words_per_8 = BITS / 4;
  const int groups = w.k / w.group;
  const long row_words = static_cast<long>(w.k) * BITS / 32;
  const uint32_t* packed = w.packed + c * row_words;
  const ColumnScales column(w, c);
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  if (BITS == 8 && w.group == 16) {  // GGUF's Q6_K: two groups to the 32 weights
    for (int g = 0; g < groups; g += 2) {
      const int j = g * 16;
      for (int v = 0; v < 4; ++v) {
        const __m256 scale = _mm256_broadcast_ss(column.scales + g + v / 2);
        const __m256 bias = _mm256_broadcast_ss(column.biases + g + v / 2);
        const __m256 weight =
            _mm256_fmadd_ps(unpack8<BITS>(packed + (j + 8 * v) / 8 * words_per_8), scale, bias);
        acc[v] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(x + j + 8 * v), acc[v]);
      }
    }
    return horizontal_sum(
        _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
  }
  for (int g = 0; g < groups; ++g) {
    const __m256 scale = _mm256_broadcast_ss(column.scales + g);
    const __m256 bias = _mm256_broadcast_ss(column.biases + g);
    for (int j = g * w.group; j < (g + 1) * w.group; j += 32) {  // here groups are 32 or 64
      __m256 q[4];
      if constexpr (BITS == 4) {  // the 32 weights' 16 bytes: low nibbles even, high odd
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed + j / 8));
        const __m128i nibble = _mm_set1_epi8(0x0F);
        const __m128i low = _mm_and_si128(bytes, nibble);
        const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
        q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(low));
        q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(low, low)));
        q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(high));
        q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(high, high)));
      } else {
        for (int v = 0; v < 4; ++v) q[v] = unpack8<BITS>(packed + (j + 8 * v) / 8 * words_per_8);
      }
      for (int v = 0; v < 4; ++v) {
        const __m256 weight = _mm256_fmadd_ps(q[v], scale, bias);
        acc[v] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(x + j + 8 * v), acc[v]);
      }
    }
  }
  return horizontal_sum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
}

// Every row of x against column c, eight rows a block.
template <int BITS>
void column_rows(const float* x, long x_stride, int rows, const QuantizedWeight& w, int c, float* out) {
  int r = 0;
  for (; r + 8 <= rows; r += 8) {
    dot_block<BITS, 8, 1>(x + r * x_stride, x_stride, w, c, out + r * w.n, w.n);
  }
  const float* xr = x + r * x_stride;
  float* outr = out + static_cast<long>(r) * w.n;
  switch (rows - r) {
    case 7: dot_block<BITS, 7, 1>(xr, x_stride, w, c, outr, w.n); break;
    case 6: dot_block<BITS, 6, 1>(xr, x_stride, w, c, outr, w.n); break;
    case 5: dot_block<BITS, 5, 1>(xr, x_stride, w, c, outr, w.n); break;
    case 4: dot_block<BITS, 4, 1>(xr, x_stride, w, c, outr, w.n); break;
    case 3: dot_block<BITS, 3, 1>(xr, x_stride, w, c, outr, w.n); break;
    case 2: dot_block<BITS, 2, 1>(xr, x_stride, w, c, outr, w.n); break;
    case 1: dot_block<BITS, 1, 1>(xr, x_stride, w, c, outr, w.n); break;
    default: break;
  }
}

template <int BITS>
void matmul_columns(
    const float* x, long x_stride, int rows, const QuantizedWeight& w, float* out, int c0, int c1) {
  if (one_row(rows, w)) {
    for (int c = c0; c < c1; ++c) out[c] = dot_row<BITS>(x, w, c);
    return;
  }
  // Column outer, row blocks inner: a weight row is read from memory once, whatever the rows.
  // From eight rows, two columns a block of four rows (1.01-1.13x a step at 8-32 rows:
  // benches/results/column-pairs-20261128.md), the rows past a multiple of four a column at a time.
  int c = c0;
  if (rows >= 8) {
    const int blocked = rows / 4 * 4;
    for (; c + 2 <= c1; c += 2) {
      for (int r = 0; r < blocked; r += 4) {
        dot_block<BITS, 4, 2>(
            x + r * x_stride, x_stride, w, c, out + static_cast<long>(r) * w.n, w.n);
      }
      for (int cc = 0; cc < 2 && blocked < rows; ++cc) {
        column_rows<BITS>(x + blocked * x_stride, x_stride, rows - blocked, w, c + cc,
            out + static_cast<long>(blocked) * w.n);
      }
    }
  }
  for (; c < c1; ++c) column_rows<BITS>(x, x_stride, rows, w, c, out);
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

namespace {
std::atomic<bool> wide{avx512_supported() && std::getenv("MLXGATE_NO_AVX512") == nullptr};
}  // namespace

void use_avx512(bool use) { wide = use && avx512_supported(); }
bool using_avx512() { return wide; }

void quantized_matmul_columns(
    const float* x, long x_stride, int rows, const QuantizedWeight& w, float* out, int c0, int c1) {
  if (wide.load(std::memory_order_relaxed)) {
    quantized_matmul_columns_avx512(x, x_stride, rows, w, out, c0, c1);
  } else if (w.bits == 4) {
    matmul_columns<4>(x, x_stride, rows, w, out, c0, c1);
  } else {
    matmul_columns<8>(x, x_stride, rows, w, out, c0, c1);
  }
}

namespace {

// The int8 path's multiply with AVX2: maddubs (unsigned weight bytes by signed x bytes, pairs
// summed to 16 bits) and madd (to 32). An 8-bit weight (0..255 would saturate the pairs) is
// taken as q - 128: its magnitude against x with its sign (llama.cpp's sign trick); its column
// unpacked as the two, a chunk apart.
struct MaddubsProducts {
  static constexpr bool signed_bytes = true;
  static constexpr int chunk_vectors(int bits) { return bits == 8 ? 2 : 1; }

  template <int BITS>
  static const __m256i* unpack(const uint8_t* packed, long chunks, __m256i* scratch) {
    if constexpr (BITS == 4) {
      return unpack_nibbles(packed, chunks, scratch);
    } else {
      const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
      for (long t = 0; t < chunks; ++t) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed) + t);
        const __m256i centred = _mm256_xor_si256(v, flip);
        scratch[2 * t] = _mm256_abs_epi8(centred);
        scratch[2 * t + 1] = centred;
      }
      return scratch;
    }
  }

  // 4 bits: the pairs' 16-bit sums accumulated as they are, widened by `finish`.
  template <int BITS>
  static __m256i step(__m256i partial, const __m256i* weights, long t, __m256i x) {
    if constexpr (BITS == 4) {
      return _mm256_add_epi16(partial, _mm256_maddubs_epi16(weights[t], x));
    } else {
      const __m256i pairs =
          _mm256_maddubs_epi16(weights[2 * t], _mm256_sign_epi8(x, weights[2 * t + 1]));
      return _mm256_add_epi32(partial, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
    }
  }

  template <int BITS>
  static __m256i finish(__m256i partial) {
    if constexpr (BITS == 4) return _mm256_madd_epi16(partial, _mm256_set1_epi16(1));
    return partial;
  }
};

// Eight floats times `inverse`, rounded to the nearest integer (ties to even): their eight
// bytes in order (the values are within +-127), and the values added to `total`.
inline uint64_t quantize8(const float* x, __m256 inverse, __m256i& total) {
  const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x), inverse));
  total = _mm256_add_epi32(total, v);
  const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  return static_cast<uint64_t>(_mm_cvtsi128_si64(_mm_packs_epi16(words, words)));
}

}  // namespace

void quantize_rows_int8(
    const float* x, long x_stride, int k, int group, int padded_groups, const Int8Rows& into,
    int r0, int r1) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const long row_bytes = static_cast<long>(padded_groups) * group;
  const int groups = k / group;
  for (int r = r0; r < r1; ++r) {
    const float* xr = x + r * x_stride;
    int8_t* qr = into.q + r * row_bytes;
    const long at = static_cast<long>(r) * padded_groups;
    for (int g = 0; g < padded_groups; ++g) {
      // Group g is lane g % 8 of lane set g / 8: its bytes 4t..4t+3 sit in chunk t of the set.
      const long set = g / INT8_LANES;
      int8_t* lane = qr + set * INT8_LANES * group + (g % INT8_LANES) * 4;
      if (g >= groups) {
        for (int t = 0; t < group / 4; ++t) std::memset(lane + t * 32, 0, 4);
        into.scales[at + g] = into.sums[at + g] = 0.0f;
        into.shifts[at + g] = 0;
        continue;
      }
      const float* xg = xr + static_cast<long>(g) * group;
      __m256 largest = _mm256_setzero_ps(), total = _mm256_setzero_ps();
      for (int j = 0; j < group; j += 8) {
        const __m256 v = _mm256_loadu_ps(xg + j);
        largest = _mm256_max_ps(largest, _mm256_and_ps(v, magnitude));
        total = _mm256_add_ps(total, v);
      }
      __m128 half = _mm_max_ps(_mm256_castps256_ps128(largest), _mm256_extractf128_ps(largest, 1));
      half = _mm_max_ps(half, _mm_movehl_ps(half, half));
      const float amax = _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
      into.scales[at + g] = amax / 127.0f;
      into.sums[at + g] = horizontal_sum(total);
      const __m256 inverse = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
      __m256i quantized = _mm256_setzero_si256();
      for (int j = 0; j < group; j += 8) {
        const uint64_t eight = quantize8(xg + j, inverse, quantized);
        std::memcpy(lane + (j / 4) * 32, &eight, 4);
        std::memcpy(lane + (j / 4 + 1) * 32, reinterpret_cast<const char*>(&eight) + 4, 4);
      }
      into.shifts[at + g] = 128 * horizontal_sum(quantized);
    }
  }
}

void int8_matmul_columns(
    const Int8Rows& x, int rows, const Int8Weight& w, float* out, int c0, int c1) {
  static const bool vnni = vnni_supported();
  if (vnni && wide.load(std::memory_order_relaxed)) {
    int8_matmul_columns_vnni(x, rows, w, out, c0, c1);
  } else {
    int8_matmul<MaddubsProducts>(x, rows, w, out, c0, c1);
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

namespace {

// e^x for eight floats (Cephes' expf: range reduction by ln 2, a degree-5 polynomial; relative
// error ~1e-7). -inf gives 0.
inline __m256 exp8(__m256 x) {
  const __m256 minus_inf = _mm256_set1_ps(-INFINITY);
  const __m256 is_minus_inf = _mm256_cmp_ps(x, minus_inf, _CMP_EQ_OQ);
  x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
  x = _mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f));
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i n = _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127));
  __m256 pow2n = _mm256_castsi256_ps(_mm256_slli_epi32(n, 23));
  return _mm256_andnot_ps(is_minus_inf, _mm256_mul_ps(y, pow2n));
}

}  // namespace

void activation_range(
    const float* x, const float* up, Activation act, float* out, long i0, long i1) {
  const auto z_of = [act](__m256 v) {
    if (act == Activation::silu) return v;
    const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(v, v), v);
    const __m256 inner = _mm256_fmadd_ps(cube, _mm256_set1_ps(0.044715f), v);
    return _mm256_mul_ps(inner, _mm256_set1_ps(1.5957691216057308f));  // 2 sqrt(2 / pi)
  };
  const __m256 one = _mm256_set1_ps(1.0f);
  long i = i0;
  for (; i + 8 <= i1; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 minus_z = _mm256_sub_ps(_mm256_setzero_ps(), z_of(v));
    __m256 y = _mm256_div_ps(v, _mm256_add_ps(one, exp8(minus_z)));
    if (up != nullptr) y = _mm256_mul_ps(y, _mm256_loadu_ps(up + i));
    _mm256_storeu_ps(out + i, y);
  }
  for (; i < i1; ++i) {
    const float v = x[i];
    const float z = act == Activation::silu ? v : (v + 0.044715f * v * v * v) * 1.5957691216057308f;
    const float y = v / (1.0f + std::exp(-z));
    out[i] = up != nullptr ? y * up[i] : y;
  }
}

namespace {

inline float dot(const float* a, const float* b, int d) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int j = 0;
  for (; j + 16 <= d; j += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j + 8), _mm256_loadu_ps(b + j + 8), acc1);
  }
  for (; j + 8 <= d; j += 8) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), acc0);
  }
  float sum = horizontal_sum(_mm256_add_ps(acc0, acc1));
  for (; j < d; ++j) sum += a[j] * b[j];
  return sum;
}

// Lane i of the result is the sum of the lanes of v[i].
inline __m256 transpose_sum(const __m256 (&v)[8]) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

// scores[j] = q . keys[j] for j in [0, count), eight keys at a time (count rounded up to 8;
// the keys past `count` are read from key 0 and their scores are garbage for the caller).
template <int DK8>
inline void block_scores(const float* q, const float* keys, int64_t stride, int count, float* scores) {
  for (int j = 0; j < count; j += 8) {
    const float* key[8];
    for (int i = 0; i < 8; ++i) key[i] = keys + (j + i < count ? (j + i) : 0) * stride;
    __m256 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
    for (int d = 0; d < DK8; ++d) {
      const __m256 qv = _mm256_loadu_ps(q + 8 * d);
      for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(key[i] + 8 * d), acc[i]);
    }
    _mm256_storeu_ps(scores + j, transpose_sum(acc));
  }
}

// o += sum_j p[j] * values[j], the output held in registers for the block.
template <int DV8>
inline void block_values(const float* p, const float* values, int64_t stride, int count, float* o) {
  __m256 acc[DV8];
  for (int d = 0; d < DV8; ++d) acc[d] = _mm256_loadu_ps(o + 8 * d);
  for (int j = 0; j < count; ++j) {
    const __m256 weight = _mm256_set1_ps(p[j]);
    const float* v = values + j * stride;
    for (int d = 0; d < DV8; ++d) acc[d] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(v + 8 * d), acc[d]);
  }
  for (int d = 0; d < DV8; ++d) _mm256_storeu_ps(o + 8 * d, acc[d]);
}

// Keys per block: the block's keys and values stay in L1/L2 while the rows go over them.
constexpr int KEY_BLOCK = 64;
constexpr int MAX_ROWS = 64;  // rows one call takes at most (the caller splits)

}  // namespace

void attention_rows(const Attention& a, int b, int head, int r0, int r1, float* out) {
  // AVX-512 shares each key among four query rows; a decode step's single row does better here.
  if (r1 - r0 >= 4 && wide.load(std::memory_order_relaxed) &&
      attention_rows_avx512(a, b, head, r0, r1, out)) {
    return;
  }
  const int rows = r1 - r0;
  const int kv_head = head / (a.heads / a.kv_heads);
  const int dk = a.key_dim, dv = a.value_dim;
  const float* keys = a.keys.data + b * a.keys.batch + kv_head * a.keys.head;
  const float* values = a.values.data + b * a.values.batch + kv_head * a.values.head;
  // Each row's query times the scale (as MLX scales the queries before the product), its
  // running maximum and sum, and its running output.
  thread_local std::vector<float> scratch;
  scratch.resize(static_cast<size_t>(MAX_ROWS) * (dk + dv + 2) + KEY_BLOCK);
  float* queries = scratch.data();
  float* acc = queries + MAX_ROWS * dk;
  float* peak = acc + MAX_ROWS * dv;
  float* total = peak + MAX_ROWS;
  float* scores = total + MAX_ROWS;
  for (int r = 0; r < rows; ++r) {
    const float* q = a.queries.data + b * a.queries.batch + head * a.queries.head +
        static_cast<int64_t>(r0 + r) * a.queries.row;
    for (int j = 0; j < dk; ++j) queries[r * dk + j] = q[j] * a.scale;
    std::memset(acc + r * dv, 0, sizeof(float) * dv);
    peak[r] = -INFINITY;
    total[r] = 0.0f;
  }
  for (int k0 = 0; k0 < a.t; k0 += KEY_BLOCK) {
    for (int r = 0; r < rows; ++r) {
      const int row = r0 + r;
      int k1 = std::min(a.t, k0 + KEY_BLOCK);
      if (a.mask_kind == MaskKind::causal) k1 = std::min(k1, a.t - a.n + row + 1);
      if (k1 <= k0) continue;
      const int count = k1 - k0;
      const float* q = queries + r * dk;
      const float* block_keys = keys + static_cast<int64_t>(k0) * a.keys.row;
      if (dk == 64) {
        block_scores<8>(q, block_keys, a.keys.row, count, scores);
      } else if (dk == 128) {
        block_scores<16>(q, block_keys, a.keys.row, count, scores);
      } else if (dk == 256) {  // Gemma's heads
        block_scores<32>(q, block_keys, a.keys.row, count, scores);
      } else {
        for (int j = 0; j < count; ++j) scores[j] = dot(q, block_keys + j * a.keys.row, dk);
      }
      if (a.mask_kind == MaskKind::boolean || a.mask_kind == MaskKind::additive) {
        const int64_t at = b * a.mask_strides[0] + head * a.mask_strides[1] +
            row * a.mask_strides[2] + k0 * a.mask_strides[3];
        for (int j = 0; j < count; ++j) {
          const int64_t m = at + j * a.mask_strides[3];
          if (a.mask_kind == MaskKind::boolean) {
            if (!static_cast<const bool*>(a.mask)[m]) scores[j] = -INFINITY;
          } else {
            scores[j] += static_cast<const float*>(a.mask)[m];
          }
        }
      }
      float block_peak = -INFINITY;
      for (int j = 0; j < count; ++j) block_peak = std::max(block_peak, scores[j]);
      if (block_peak == -INFINITY) continue;
      float* o = acc + r * dv;
      if (block_peak > peak[r]) {
        const float rescale = peak[r] == -INFINITY ? 0.0f : std::exp(peak[r] - block_peak);
        const __m256 factor = _mm256_set1_ps(rescale);
        int j = 0;
        for (; j + 8 <= dv; j += 8) _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_loadu_ps(o + j), factor));
        for (; j < dv; ++j) o[j] *= rescale;
        total[r] *= rescale;
        peak[r] = block_peak;
      }
      const int padded = (count + 7) & ~7;
      for (int j = count; j < padded; ++j) scores[j] = -INFINITY;
      const __m256 shift = _mm256_set1_ps(peak[r]);
      __m256 sum = _mm256_setzero_ps();
      for (int j = 0; j < padded; j += 8) {
        const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + j), shift));
        _mm256_storeu_ps(scores + j, p);
        sum = _mm256_add_ps(sum, p);
      }
      total[r] += horizontal_sum(sum);
      const float* block_values_at = values + static_cast<int64_t>(k0) * a.values.row;
      if (dv == 64) {
        block_values<8>(scores, block_values_at, a.values.row, count, o);
      } else if (dv == 128) {
        block_values<16>(scores, block_values_at, a.values.row, count, o);
      } else if (dv % 64 == 0) {  // 64 features at a time, their sums in registers
        for (int d = 0; d < dv; d += 64) {
          block_values<8>(scores, block_values_at + d, a.values.row, count, o + d);
        }
      } else {
        for (int j = 0; j < count; ++j) {
          const float* v = block_values_at + j * a.values.row;
          for (int d = 0; d < dv; ++d) o[d] += scores[j] * v[d];
        }
      }
    }
  }
  for (int r = 0; r < rows; ++r) {
    float* dst = out + ((static_cast<int64_t>(b) * a.heads + head) * a.n + r0 + r) * dv;
    const float inverse = total[r] > 0.0f ? 1.0f / total[r] : 0.0f;
    for (int d = 0; d < dv; ++d) dst[d] = acc[r * dv + d] * inverse;
  }
}

}  // namespace mlxgate

#else  // not x86-64: MLX's own ops serve (Metal on a Mac)

namespace mlxgate {
bool cpu_supported() { return false; }
void quantized_matmul_columns(const float*, long, int, const QuantizedWeight&, float*, int, int) {}
void dequantize_columns(const QuantizedWeight&, float*, int, int) {}
void quantize_rows_int8(const float*, long, int, int, int, const Int8Rows&, int, int) {}
void int8_matmul_columns(const Int8Rows&, int, const Int8Weight&, float*, int, int) {}
void rms_norm_rows(const float*, const float*, float, int, float*, int, int) {}
void rope_rows(const float*, const float*, const float*, int, bool, int, float*, int, int) {}
void activation_range(const float*, const float*, Activation, float*, long, long) {}
void attention_rows(const Attention&, int, int, int, int, float*) {}
void use_avx512(bool) {}
bool using_avx512() { return false; }
}  // namespace mlxgate

#endif
