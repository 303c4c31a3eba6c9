// The quantized matmul with AVX-512 (F, BW, VL, DQ), for the CPUs that have it: sixteen weights
// a register and eight rows by two columns a block (16 sums in registers, where AVX2 holds eight),
// twice the multiply-adds of the AVX2 kernel per load, which is what a step of many rows (32
// streams, a verify pass) is bound by. Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq; run after avx512_supported().
#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <vector>

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

// ROWS rows of x against COLS columns from c: each load of x serves COLS columns, so that the
// multiply-adds rather than the loads bound a step of many rows. A column's sums run in the same
// order whatever the block, so its values do not depend on which columns share it.
template <int BITS, int ROWS, int COLS>
inline void dot_block(
    const float* x, long x_stride, const QuantizedWeight& w, int c, float* out, long out_stride) {
  const int groups = w.k / w.group;
  const long row_words = static_cast<long>(w.k) * BITS / 32;
  const uint32_t* packed = w.packed + c * row_words;
  __m512 acc[COLS][ROWS];
  for (int cc = 0; cc < COLS; ++cc)
    for (int r = 0; r < ROWS; ++r) acc[cc][r] = _mm512_setzero_ps();
  for (int g = 0; g < groups; ++g) {
    float scale[COLS], bias[COLS];
    for (int cc = 0; cc < COLS; ++cc) {
      const long at = static_cast<long>(c + cc) * groups + g;
      scale[cc] = scale_at(w.scales, w.scale_type, at);
      bias[cc] = scale_at(w.biases, w.scale_type, at);
    }
    for (int j = g * w.group; j < (g + 1) * w.group; j += 16) {
      __m512 weight[COLS];
      for (int cc = 0; cc < COLS; ++cc) {
        weight[cc] = _mm512_fmadd_ps(unpack16<BITS>(packed + cc * row_words + j * BITS / 32),
            _mm512_set1_ps(scale[cc]), _mm512_set1_ps(bias[cc]));
      }
      for (int r = 0; r < ROWS; ++r) {
        const __m512 xv = _mm512_loadu_ps(x + r * x_stride + j);
        for (int cc = 0; cc < COLS; ++cc) acc[cc][r] = _mm512_fmadd_ps(weight[cc], xv, acc[cc][r]);
      }
    }
  }
  for (int cc = 0; cc < COLS; ++cc)
    for (int r = 0; r < ROWS; ++r) out[r * out_stride + c + cc] = _mm512_reduce_add_ps(acc[cc][r]);
}

template <int BITS, int ROWS, int COLS>
inline void block_remainder(
    int rows, const float* x, long x_stride, const QuantizedWeight& w, int c, float* out,
    long out_stride) {
  if constexpr (ROWS > 0) {
    if (rows == ROWS) {
      dot_block<BITS, ROWS, COLS>(x, x_stride, w, c, out, out_stride);
    } else {
      block_remainder<BITS, ROWS - 1, COLS>(rows, x, x_stride, w, c, out, out_stride);
    }
  }
}

// Every row of x against COLS columns from c, ROWS rows a block.
template <int BITS, int ROWS, int COLS>
inline void all_rows(
    const float* x, long x_stride, int rows, const QuantizedWeight& w, int c, float* out) {
  int r = 0;
  for (; r + ROWS <= rows; r += ROWS) {
    dot_block<BITS, ROWS, COLS>(
        x + r * x_stride, x_stride, w, c, out + static_cast<long>(r) * w.n, w.n);
  }
  if (r < rows) {
    block_remainder<BITS, ROWS - 1, COLS>(
        rows - r, x + r * x_stride, x_stride, w, c, out + static_cast<long>(r) * w.n, w.n);
  }
}

// One row against output column c, as the AVX2 file's dot_row (scales converted up front, 4-bit
// weights taken by nibble against x in pairs order, two chains of multiply-adds), but a 4-bit
// weight looked up in its group's values rather than converted and scaled (1.05-1.3x a matmul,
// bit for bit the same: benches/results/one-row-lookup-20261129.md). Needs
// groups <= MAX_ROW_GROUPS.
template <int BITS>
inline float dot_row(const float* x, const QuantizedWeight& w, int c) {
  const int groups = w.k / w.group;
  const long row_words = static_cast<long>(w.k) * BITS / 32;
  const uint32_t* packed = w.packed + c * row_words;
  const ColumnScales column(w, c);
  __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  if (BITS == 8 && w.group == 16) {  // GGUF's Q6_K: a group to each 16 weights
    for (int g = 0; g < groups; g += 2) {
      for (int v = 0; v < 2; ++v) {
        const int j = (g + v) * 16;
        const __m512 weight = _mm512_fmadd_ps(unpack16<BITS>(packed + j * BITS / 32),
            _mm512_set1_ps(column.scales[g + v]), _mm512_set1_ps(column.biases[g + v]));
        acc[v] = _mm512_fmadd_ps(weight, _mm512_loadu_ps(x + j), acc[v]);
      }
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
  }
  const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int g = 0; g < groups; ++g) {
    const __m512 scale = _mm512_set1_ps(column.scales[g]);
    const __m512 bias = _mm512_set1_ps(column.biases[g]);
    if constexpr (BITS == 4) {
      // The 32 weights' 16 bytes, low nibbles against x's even elements and high against its
      // odd, each weight looked up among its group's sixteen values (level * scale + bias, as
      // the other kernels compute a weight; vpermps reads an index's low four bits): one
      // instruction a sixteen weights where converting and scaling them takes two.
      const __m512 values = _mm512_fmadd_ps(levels, scale, bias);
      for (int j = g * w.group; j < (g + 1) * w.group; j += 32) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed + j / 8));
        const __m512 low = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(bytes), values);
        const __m512 high =
            _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_srli_epi16(bytes, 4)), values);
        acc[0] = _mm512_fmadd_ps(low, _mm512_loadu_ps(x + j), acc[0]);
        acc[1] = _mm512_fmadd_ps(high, _mm512_loadu_ps(x + j + 16), acc[1]);
      }
      continue;
    }
    for (int j = g * w.group; j < (g + 1) * w.group; j += 32) {  // here groups are 32 or 64
      __m512 q[2];
      for (int v = 0; v < 2; ++v) q[v] = unpack16<BITS>(packed + (j + 16 * v) * BITS / 32);
      for (int v = 0; v < 2; ++v) {
        const __m512 weight = _mm512_fmadd_ps(q[v], scale, bias);
        acc[v] = _mm512_fmadd_ps(weight, _mm512_loadu_ps(x + j + 16 * v), acc[v]);
      }
    }
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
}

template <int BITS>
void matmul_columns(
    const float* x, long x_stride, int rows, const QuantizedWeight& w, float* out, int c0, int c1) {
  if (one_row(rows, w)) {
    for (int c = c0; c < c1; ++c) out[c] = dot_row<BITS>(x, w, c);
    return;
  }
  // Eight rows by two columns: 16 sums in registers, each row's load used twice.
  int c = c0;
  for (; c + 2 <= c1; c += 2) all_rows<BITS, 8, 2>(x, x_stride, rows, w, c, out);
  if (c < c1) all_rows<BITS, 8, 1>(x, x_stride, rows, w, c, out);
}

// e^x for sixteen floats, as exp8 in kernels_avx2.cpp (Cephes' expf); -inf gives 0.
inline __m512 exp16(__m512 x) {
  const __mmask16 minus_inf = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ);
  x = _mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f));
  x = _mm512_max_ps(x, _mm512_set1_ps(-88.3762626647949f));
  __m512 fx = _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f));
  fx = _mm512_roundscale_ps(fx, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500E-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507E-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073E-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894E-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459E-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201E-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  const __m512i n = _mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127));
  const __m512 result = _mm512_mul_ps(y, _mm512_castsi512_ps(_mm512_slli_epi32(n, 23)));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~minus_inf), result);
}

constexpr int KEYS = 64;  // keys per block: four registers of scores per row
constexpr int DIM = 64;   // the head size this kernel takes (keys and values)
constexpr int TILE = 4;   // query rows that share each key and value load

// Scores of T rows (queries scaled, [T][DIM]) against a block of keys transposed ([DIM][KEYS]).
template <int T>
inline void tile_scores(const float* queries, const float* transposed, float* scores) {
  __m512 acc[T][4];
  for (int i = 0; i < T; ++i)
    for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_setzero_ps();
  for (int d = 0; d < DIM; ++d) {
    __m512 k[4];
    for (int c = 0; c < 4; ++c) k[c] = _mm512_loadu_ps(transposed + d * KEYS + 16 * c);
    for (int i = 0; i < T; ++i) {
      const __m512 q = _mm512_set1_ps(queries[i * DIM + d]);
      for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_fmadd_ps(q, k[c], acc[i][c]);
    }
  }
  for (int i = 0; i < T; ++i)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(scores + i * KEYS + 16 * c, acc[i][c]);
}

// out[i] += sum_j p[i][j] * values[j] for T rows, each value row loaded once for all of them.
template <int T>
inline void tile_values(
    const float* p, const float* values, int64_t stride, int count, float* out) {
  __m512 acc[T][4];
  for (int i = 0; i < T; ++i)
    for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_loadu_ps(out + i * DIM + 16 * c);
  for (int j = 0; j < count; ++j) {
    __m512 v[4];
    for (int c = 0; c < 4; ++c) v[c] = _mm512_loadu_ps(values + j * stride + 16 * c);
    for (int i = 0; i < T; ++i) {
      const __m512 weight = _mm512_set1_ps(p[i * KEYS + j]);
      for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_fmadd_ps(weight, v[c], acc[i][c]);
    }
  }
  for (int i = 0; i < T; ++i)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(out + i * DIM + 16 * c, acc[i][c]);
}

}  // namespace

bool attention_rows_avx512(const Attention& a, int b, int head, int r0, int r1, float* out) {
  if (a.key_dim != DIM || a.value_dim != DIM) return false;
  const int rows = r1 - r0;
  const int kv_head = head / (a.heads / a.kv_heads);
  const float* keys = a.keys.data + b * a.keys.batch + kv_head * a.keys.head;
  const float* values = a.values.data + b * a.values.batch + kv_head * a.values.head;
  thread_local std::vector<float> scratch;
  scratch.resize(static_cast<size_t>(rows) * (2 * DIM + 2) + DIM * KEYS + TILE * KEYS);
  float* queries = scratch.data();
  float* acc = queries + rows * DIM;
  float* peak = acc + rows * DIM;
  float* total = peak + rows;
  float* transposed = total + rows;
  float* scores = transposed + DIM * KEYS;
  for (int r = 0; r < rows; ++r) {
    const float* q = a.queries.data + b * a.queries.batch + head * a.queries.head +
        static_cast<int64_t>(r0 + r) * a.queries.row;
    for (int d = 0; d < DIM; ++d) queries[r * DIM + d] = q[d] * a.scale;
    std::fill(acc + r * DIM, acc + (r + 1) * DIM, 0.0f);
    peak[r] = -INFINITY;
    total[r] = 0.0f;
  }
  // The last key any of these rows sees (causal: the last row's own position).
  const int seen = a.mask_kind == MaskKind::causal ? a.t - a.n + r1 : a.t;
  for (int k0 = 0; k0 < seen; k0 += KEYS) {
    const int count = std::min(KEYS, seen - k0);
    for (int j = 0; j < KEYS; ++j) {
      const float* key = keys + static_cast<int64_t>(k0 + std::min(j, count - 1)) * a.keys.row;
      for (int d = 0; d < DIM; ++d) transposed[d * KEYS + j] = key[d];
    }
    for (int rt = 0; rt < rows; rt += TILE) {
      const int tile = std::min(TILE, rows - rt);
      if (tile == TILE) {
        tile_scores<TILE>(queries + rt * DIM, transposed, scores);
      } else {
        for (int i = 0; i < tile; ++i) {
          tile_scores<1>(queries + (rt + i) * DIM, transposed, scores + i * KEYS);
        }
      }
      for (int i = 0; i < tile; ++i) {
        const int r = rt + i;
        const int row = r0 + r;
        float* s = scores + i * KEYS;
        int limit = count;
        if (a.mask_kind == MaskKind::causal) limit = std::min(count, a.t - a.n + row + 1 - k0);
        for (int j = std::max(limit, 0); j < KEYS; ++j) s[j] = -INFINITY;
        if (a.mask_kind == MaskKind::boolean || a.mask_kind == MaskKind::additive) {
          const int64_t at = b * a.mask_strides[0] + head * a.mask_strides[1] +
              row * a.mask_strides[2] + k0 * a.mask_strides[3];
          for (int j = 0; j < limit; ++j) {
            const int64_t m = at + j * a.mask_strides[3];
            if (a.mask_kind == MaskKind::boolean) {
              if (!static_cast<const bool*>(a.mask)[m]) s[j] = -INFINITY;
            } else {
              s[j] += static_cast<const float*>(a.mask)[m];
            }
          }
        }
        __m512 top = _mm512_loadu_ps(s);
        for (int c = 1; c < 4; ++c) top = _mm512_max_ps(top, _mm512_loadu_ps(s + 16 * c));
        const float block_peak = _mm512_reduce_max_ps(top);
        if (block_peak == -INFINITY) {  // nothing seen here: weights 0
          std::fill(s, s + KEYS, 0.0f);
          continue;
        }
        if (block_peak > peak[r]) {
          const float rescale = peak[r] == -INFINITY ? 0.0f : std::exp(peak[r] - block_peak);
          for (int d = 0; d < DIM; ++d) acc[r * DIM + d] *= rescale;
          total[r] *= rescale;
          peak[r] = block_peak;
        }
        const __m512 shift = _mm512_set1_ps(peak[r]);
        __m512 sum = _mm512_setzero_ps();
        for (int c = 0; c < 4; ++c) {
          const __m512 p = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + 16 * c), shift));
          _mm512_storeu_ps(s + 16 * c, p);
          sum = _mm512_add_ps(sum, p);
        }
        total[r] += _mm512_reduce_add_ps(sum);
      }
      const float* block_values = values + static_cast<int64_t>(k0) * a.values.row;
      if (tile == TILE) {
        tile_values<TILE>(scores, block_values, a.values.row, count, acc + rt * DIM);
      } else {
        for (int i = 0; i < tile; ++i) {
          tile_values<1>(scores + i * KEYS, block_values, a.values.row, count, acc + (rt + i) * DIM);
        }
      }
    }
  }
  for (int r = 0; r < rows; ++r) {
    float* dst = out + ((static_cast<int64_t>(b) * a.heads + head) * a.n + r0 + r) * DIM;
    const float inverse = total[r] > 0.0f ? 1.0f / total[r] : 0.0f;
    for (int d = 0; d < DIM; ++d) dst[d] = acc[r * DIM + d] * inverse;
  }
  return true;
}

void quantized_matmul_columns_avx512(
    const float* x, long x_stride, int rows, const QuantizedWeight& w, float* out, int c0, int c1) {
  if (w.bits == 4) {
    matmul_columns<4>(x, x_stride, rows, w, out, c0, c1);
  } else {
    matmul_columns<8>(x, x_stride, rows, w, out, c0, c1);
  }
}

}  // namespace mlxgate

#else

namespace mlxgate {
bool avx512_supported() { return false; }
bool attention_rows_avx512(const Attention&, int, int, int, int, float*) { return false; }
void quantized_matmul_columns_avx512(const float*, long, int, const QuantizedWeight&, float*, int, int) {}
}  // namespace mlxgate

#endif
