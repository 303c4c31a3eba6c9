// The int8-activation matmul (int8_matmul.h) with AVX-512 VNNI, for the CPUs that have it:
// vpdpbusd multiplies 32 unsigned weight bytes by 32 signed bytes of x and adds each four
// products to a 32-bit sum in one instruction, where AVX2 takes maddubs, madd and an add, and
// it takes an 8-bit weight's bytes as they are (no sign trick). Compiled with -mavx512vnni and
// -mavx512vl besides AVX2's options; run after vnni_supported().
#include "kernels.h"

#if defined(MLXGATE_X86)
#include <immintrin.h>

#include "int8_matmul.h"

namespace mlxgate {

bool vnni_supported() {
  __builtin_cpu_init();
  return avx512_supported() && __builtin_cpu_supports("avx512vnni");
}

namespace {

struct DotProducts {
  static constexpr bool signed_bytes = false;
  static constexpr int chunk_vectors(int) { return 1; }

  template <int BITS>
  static const __m256i* unpack(const uint8_t* packed, long chunks, __m256i* scratch) {
    if constexpr (BITS == 4) {
      return unpack_nibbles(packed, chunks, scratch);
    } else {
      return reinterpret_cast<const __m256i*>(packed);  // read where they are
    }
  }

  template <int BITS>
  static __m256i step(__m256i sums, const __m256i* weights, long t, __m256i x) {
    return _mm256_dpbusd_epi32(sums, _mm256_loadu_si256(weights + t), x);
  }

  template <int BITS>
  static __m256i finish(__m256i sums) {
    return sums;
  }
};

}  // namespace

void int8_matmul_columns_vnni(
    const Int8Rows& x, int rows, const Int8Weight& w, float* out, int c0, int c1) {
  int8_matmul<DotProducts>(x, rows, w, out, c0, c1);
}

}  // namespace mlxgate

#else

namespace mlxgate {
bool vnni_supported() { return false; }
void int8_matmul_columns_vnni(const Int8Rows&, int, const Int8Weight&, float*, int, int) {}
}  // namespace mlxgate

#endif
