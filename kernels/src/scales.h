// A quantized weight's scale or bias as a float, whatever MLX stores it as. Included only by
// the files compiled with F16C; internal linkage, so each keeps its own copy built for its own
// instructions (the linker must not hand the AVX2 file the AVX-512 file's).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "kernels.h"

namespace mlxgate {
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

// The scales (or biases) [at, at + count) as floats: `p` itself where MLX stores float32, else
// converted into `buffer` (eight at a time from float16), so that a kernel broadcasts each from
// memory in one instruction instead of converting it where it is used.
inline const float* scales_as_floats(
    const void* p, ScaleType type, long at, int count, float* buffer) {
  switch (type) {
    case ScaleType::float32:
      return static_cast<const float*>(p) + at;
    case ScaleType::float16: {
      const uint16_t* halves = static_cast<const uint16_t*>(p) + at;
      int i = 0;
      for (; i + 8 <= count; i += 8) {
        const __m128i eight = _mm_loadu_si128(reinterpret_cast<const __m128i*>(halves + i));
        _mm256_storeu_ps(buffer + i, _mm256_cvtph_ps(eight));
      }
      for (; i < count; ++i) buffer[i] = _cvtsh_ss(halves[i]);
      return buffer;
    }
    case ScaleType::bfloat16:
      for (int i = 0; i < count; ++i) buffer[i] = scale_at(p, type, at + i);
      return buffer;
  }
  return buffer;
}

// One output column's scales and biases as floats (at most MAX_ROW_GROUPS groups).
struct ColumnScales {
  ColumnScales(const QuantizedWeight& w, int c) {
    const int groups = w.k / w.group;
    const long first = static_cast<long>(c) * groups;
    scales = scales_as_floats(w.scales, w.scale_type, first, groups, buffers[0]);
    biases = scales_as_floats(w.biases, w.scale_type, first, groups, buffers[1]);
  }
  float buffers[2][MAX_ROW_GROUPS];
  const float* scales;
  const float* biases;
};

}  // namespace
}  // namespace mlxgate
