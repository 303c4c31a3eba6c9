// The int8-activation matmul's loop (kernels.h's Int8Weight and Int8Rows), written once for the
// instruction sets that multiply bytes: kernels_avx2.cpp gives it AVX2's maddubs, kernels_vnni.cpp
// AVX-512 VNNI's vpdpbusd. Internal linkage: each file keeps its own copy, built for its own
// instructions.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "horizontal.h"
#include "kernels.h"

namespace mlxgate {
namespace {

constexpr int INT8_COLUMNS = 4;  // columns a block: each load of x serves four
// Chunks a Products accumulator takes before `finish` (AVX2's 16-bit sums of 4-bit products,
// at most 2 * 15 * 127 each a chunk, hold eight).
constexpr long INT8_RUN = 8;

// COLS columns from c against every row. Products (the instruction set's) says how a column's
// packed bytes are laid out for its multiply (`unpack`, into a scratch buffer of this thread's)
// and how one 32-byte chunk of them meets 32 bytes of x (`step`, into an accumulator that
// `finish` turns into eight 32-bit sums of four products each, every INT8_RUN chunks). A lane
// set's integer sums (an 8-bit weight's taken as q - 128 where Products says so, 128 times x's
// sum added back) are converted once and scaled by each lane's group scale times its x scale;
// the biases meet x's group sums.
template <class Products, int BITS, int COLS>
void int8_columns(const Int8Rows& x, int rows, const Int8Weight& w, int c, float* out) {
  const int chunks_per_set = w.group / 4;  // 32 bytes a chunk: four of each of the 8 groups
  const int sets = w.padded_groups / INT8_LANES;
  const long chunks = static_cast<long>(sets) * chunks_per_set;
  const long row_bytes = chunks * 32 * BITS / 8;
  thread_local std::vector<__m256i> scratch;
  const long column_vectors = chunks * Products::chunk_vectors(BITS);
  scratch.resize(COLS * column_vectors);
  const __m256i* weights[COLS];
  const float* scales[COLS];
  const float* biases[COLS];
  for (int cc = 0; cc < COLS; ++cc) {
    const long column = c + cc;
    weights[cc] = Products::template unpack<BITS>(
        w.packed + column * row_bytes, chunks, scratch.data() + cc * column_vectors);
    scales[cc] = w.scales + column * w.padded_groups;
    biases[cc] = w.biases + column * w.padded_groups;
  }
  constexpr bool shifted = BITS == 8 && Products::signed_bytes;
  const long x_bytes = chunks * 32;
  for (int r = 0; r < rows; ++r) {
    const __m256i* xr = reinterpret_cast<const __m256i*>(x.q + r * x_bytes);
    const float* row_scales = x.scales + static_cast<long>(r) * w.padded_groups;
    const float* row_sums = x.sums + static_cast<long>(r) * w.padded_groups;
    const int32_t* row_shifts = x.shifts + static_cast<long>(r) * w.padded_groups;
    __m256 acc[COLS];
    for (int cc = 0; cc < COLS; ++cc) acc[cc] = _mm256_setzero_ps();
    for (int s = 0; s < sets; ++s) {
      __m256i sums[COLS];
      for (int cc = 0; cc < COLS; ++cc) sums[cc] = _mm256_setzero_si256();
      const long first = static_cast<long>(s) * chunks_per_set;
      for (long run = first; run < first + chunks_per_set; run += INT8_RUN) {
        __m256i partial[COLS];
        for (int cc = 0; cc < COLS; ++cc) partial[cc] = _mm256_setzero_si256();
        for (long t = run; t < std::min(run + INT8_RUN, first + chunks_per_set); ++t) {
          const __m256i xv = _mm256_loadu_si256(xr + t);
          for (int cc = 0; cc < COLS; ++cc) {
            partial[cc] = Products::template step<BITS>(partial[cc], weights[cc], t, xv);
          }
        }
        for (int cc = 0; cc < COLS; ++cc) {
          sums[cc] = _mm256_add_epi32(sums[cc], Products::template finish<BITS>(partial[cc]));
        }
      }
      const int g = s * INT8_LANES;
      if constexpr (shifted) {
        const __m256i shift =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row_shifts + g));
        for (int cc = 0; cc < COLS; ++cc) sums[cc] = _mm256_add_epi32(sums[cc], shift);
      }
      const __m256 x_scale = _mm256_loadu_ps(row_scales + g);
      const __m256 x_sum = _mm256_loadu_ps(row_sums + g);
      for (int cc = 0; cc < COLS; ++cc) {
        const __m256 scale = _mm256_mul_ps(_mm256_loadu_ps(scales[cc] + g), x_scale);
        acc[cc] = _mm256_fmadd_ps(_mm256_loadu_ps(biases[cc] + g), x_sum, acc[cc]);
        acc[cc] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[cc]), scale, acc[cc]);
      }
    }
    for (int cc = 0; cc < COLS; ++cc) {
      out[static_cast<long>(r) * w.n + c + cc] = horizontal_sum(acc[cc]);
    }
  }
}

template <class Products, int BITS>
void int8_matmul(const Int8Rows& x, int rows, const Int8Weight& w, float* out, int c0, int c1) {
  int c = c0;
  for (; c + INT8_COLUMNS <= c1; c += INT8_COLUMNS) {
    int8_columns<Products, BITS, INT8_COLUMNS>(x, rows, w, c, out);
  }
  for (; c < c1; ++c) int8_columns<Products, BITS, 1>(x, rows, w, c, out);
}

template <class Products>
void int8_matmul(const Int8Rows& x, int rows, const Int8Weight& w, float* out, int c0, int c1) {
  if (w.bits == 4) {
    int8_matmul<Products, 4>(x, rows, w, out, c0, c1);
  } else {
    int8_matmul<Products, 8>(x, rows, w, out, c0, c1);
  }
}

// A 4-bit column's packed chunks to bytes: each 32 packed bytes hold chunk 2u in their low
// nibbles and chunk 2u + 1 in their high ones.
inline const __m256i* unpack_nibbles(const uint8_t* packed, long chunks, __m256i* scratch) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (long u = 0; u < chunks / 2; ++u) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed) + u);
    scratch[2 * u] = _mm256_and_si256(v, low);
    scratch[2 * u + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
  }
  return scratch;
}

}  // namespace
}  // namespace mlxgate
