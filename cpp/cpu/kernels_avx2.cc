// AVX2 + FMA (+ F16C) build of the CPU kernels. Only the functions in this file are compiled for
// AVX2 (a target pragma, not a global -mavx2), so the library still loads and runs on any x86-64
// CPU; attention_cpu.cc calls into here only after checking the CPU at run time.
#include "cpu/kernels_common.h"

#ifdef JAX_FLASH_CPU_HAS_X86_BUILDS

#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

namespace jax_flash::cpu::avx2 {

using VF = float __attribute__((vector_size(32)));
using VD = double __attribute__((vector_size(32)));

// Explicit FMA: the fusion must not depend on the -ffp-contract setting of the build.
inline VF Madd(const VF& a, const VF& b, const VF& c) { return _mm256_fmadd_ps(a, b, c); }
inline VD Madd(const VD& a, const VD& b, const VD& c) { return _mm256_fmadd_pd(a, b, c); }

// F16C converts eight halves per instruction, exactly (subnormals included).
inline void ConvertHalves(const Half* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) dst[i] = HalfToFloat(src[i].bits);
}

// 6 x 2 accumulators + 2 operand vectors + 1 broadcast = 15 of the 16 ymm registers.
inline constexpr int kMicroRows = 6;

#include "cpu/flash_impl.h"

}  // namespace jax_flash::cpu::avx2

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#endif  // JAX_FLASH_CPU_HAS_X86_BUILDS
