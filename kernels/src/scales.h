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

}  // namespace
}  // namespace mlxgate
