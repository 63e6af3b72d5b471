// Portable build of the CPU kernels: GCC/Clang vector extensions on 16-byte vectors, which lower to
// SSE2 on x86-64, NEON on AArch64, and scalar code elsewhere. Used when the CPU lacks AVX2/FMA.
#include "cpu/kernels_common.h"

namespace jax_flash::cpu::generic {

using VF = float __attribute__((vector_size(16)));
using VD = double __attribute__((vector_size(16)));

inline VF Madd(const VF& a, const VF& b, const VF& c) { return a * b + c; }
inline VD Madd(const VD& a, const VD& b, const VD& c) { return a * b + c; }

inline void ConvertHalves(const Half* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = HalfToFloat(src[i].bits);
}

// 6 x 2 accumulators + 2 operand vectors + 1 broadcast = 15 of SSE2's 16 registers.
inline constexpr int kMicroRows = 6;

#include "cpu/flash_impl.h"

}  // namespace jax_flash::cpu::generic
