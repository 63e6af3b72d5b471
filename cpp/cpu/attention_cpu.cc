// Public CPU entry points: pick the fastest build of the kernels this CPU can run.
#include "cpu/attention_cpu.h"

#include "cpu/kernels.h"

#ifdef JAX_FLASH_CPU_HAS_AVX2_BUILD
#include <cpuid.h>
#endif

namespace jax_flash::cpu {
namespace {

#ifdef JAX_FLASH_CPU_HAS_AVX2_BUILD
bool CpuHasAvx2Build() {
  // __builtin_cpu_supports also checks that the OS saves the ymm registers. Every AVX2 CPU has
  // F16C, but it is a separate feature bit, so it is checked too, through CPUID leaf 1 (not every
  // compiler's __builtin_cpu_supports knows "f16c").
  static const bool supported = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C) != 0;
    return f16c && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return supported;
}
#endif

}  // namespace

const char* simd_level() {
#ifdef JAX_FLASH_CPU_HAS_AVX2_BUILD
  if (CpuHasAvx2Build()) return "avx2";
#endif
  return "generic";
}

void attention_fwd(const FwdParams& params, DType dtype, const ParallelFor& parallel_for) {
#ifdef JAX_FLASH_CPU_HAS_AVX2_BUILD
  if (CpuHasAvx2Build()) return avx2::AttentionForward(params, dtype, parallel_for);
#endif
  generic::AttentionForward(params, dtype, parallel_for);
}

void attention_bwd(const BwdParams& params, DType dtype, const ParallelFor& parallel_for) {
#ifdef JAX_FLASH_CPU_HAS_AVX2_BUILD
  if (CpuHasAvx2Build()) return avx2::AttentionBackward(params, dtype, parallel_for);
#endif
  generic::AttentionBackward(params, dtype, parallel_for);
}

}  // namespace jax_flash::cpu
