// AVX-512 build of the CPU kernels: zmm-wide vectors (16 floats, 8 doubles) and the 32-register
// file. Like the AVX2 build it is compiled under a target pragma, so the library still loads on
// any x86-64 CPU; attention_cpu.cc calls into here only after checking the CPU at run time.
#include "cpu/kernels_common.h"

#ifdef JAX_FLASH_CPU_HAS_X86_BUILDS

#include <immintrin.h>

// F, VL, BW and DQ: the common subset of every AVX-512 CPU since Skylake-SP (DQ gives the float
// bitwise operations on zmm that the compiler uses for selects and signs).
#if defined(__clang__)
#pragma clang attribute push(                                                    \
    __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c"))), \
    apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c")
#endif

namespace jax_flash::cpu::avx512 {

using VF = float __attribute__((vector_size(64)));
using VD = double __attribute__((vector_size(64)));

// Explicit FMA: the fusion must not depend on the -ffp-contract setting of the build.
inline VF Madd(const VF& a, const VF& b, const VF& c) { return _mm512_fmadd_ps(a, b, c); }
inline VD Madd(const VD& a, const VD& b, const VD& c) { return _mm512_fmadd_pd(a, b, c); }

// Sixteen halves per instruction, exactly (subnormals included).
inline void ConvertHalves(const Half* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(h));
  }
  for (; i < n; ++i) dst[i] = HalfToFloat(src[i].bits);
}

// 8 x 2 accumulators + 2 operand vectors + 1 broadcast = 19 of the 32 zmm registers; 8 rows
// divide the 64-row tiles and head_dim 64 / 128, so no edge kernel runs on the common shapes.
inline constexpr int kMicroRows = 8;

#include "cpu/flash_impl.h"

}  // namespace jax_flash::cpu::avx512

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#endif  // JAX_FLASH_CPU_HAS_X86_BUILDS
