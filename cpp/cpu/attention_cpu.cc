// Public CPU entry points: pick the build of the kernels this process runs, once.
#include "cpu/attention_cpu.h"

#include <cstdlib>
#include <string>

#include "cpu/kernels.h"

#ifdef JAX_FLASH_CPU_HAS_X86_BUILDS
#include <cpuid.h>
#endif

namespace jax_flash::cpu {
namespace {

#ifdef JAX_FLASH_CPU_HAS_X86_BUILDS
bool CpuHasAvx2Build() {
  // __builtin_cpu_supports also checks that the OS saves the ymm registers. Every AVX2 CPU has
  // F16C, but it is a separate feature bit, so it is checked too, through CPUID leaf 1 (not every
  // compiler's __builtin_cpu_supports knows "f16c").
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C) != 0;
  return f16c && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

bool CpuHasAvx512Build() {
  // The AVX-512 build targets F, VL, BW and DQ (every AVX-512 Xeon since Skylake-SP, and AMD
  // since Zen 4). __builtin_cpu_supports reports them only when the OS also saves the zmm and
  // mask registers (XCR0), so a kernel that disables AVX-512 state is respected.
  return CpuHasAvx2Build() && __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq");
}
#endif

constexpr Isa kAllIsas[] = {Isa::kGeneric, Isa::kAvx2, Isa::kAvx512};

bool Supported(Isa isa) {
  switch (isa) {
    case Isa::kGeneric:
      return true;
#ifdef JAX_FLASH_CPU_HAS_X86_BUILDS
    case Isa::kAvx2:
      return CpuHasAvx2Build();
    case Isa::kAvx512:
      return CpuHasAvx512Build();
#endif
    default:
      return false;
  }
}

IsaChoice Choose() {
  IsaChoice choice;
  const std::vector<Isa> supported = supported_isas();
  choice.isa = supported.back();
  const char* requested = std::getenv("JAX_FLASH_CPU_ISA");
  if (requested == nullptr || *requested == '\0') return choice;
  std::string names;
  for (Isa isa : kAllIsas) {
    if (requested == std::string(isa_name(isa))) {
      if (Supported(isa)) {
        choice.isa = isa;
      } else {
        choice.error = std::string("JAX_FLASH_CPU_ISA=") + requested +
                       ": this CPU (or its OS) does not support that instruction set";
      }
      return choice;
    }
    names += names.empty() ? "" : ", ";
    names += isa_name(isa);
  }
  choice.error = std::string("JAX_FLASH_CPU_ISA=") + requested + ": unknown level (one of " +
                 names + ", or unset for the best this CPU supports)";
  return choice;
}

}  // namespace

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kGeneric:
      return "generic";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
  }
  return "unknown";
}

std::vector<Isa> supported_isas() {
  std::vector<Isa> out;
  for (Isa isa : kAllIsas) {
    if (Supported(isa)) out.push_back(isa);
  }
  return out;
}

const IsaChoice& isa_choice() {
  // Read once: a process never mixes builds, so forward and backward always agree.
  static const IsaChoice choice = Choose();
  return choice;
}

std::string simd_level() {
  const IsaChoice& choice = isa_choice();
  if (!choice.error.empty()) return "none (" + choice.error + ")";
  return isa_name(choice.isa);
}

void attention_fwd(const FwdParams& params, DType dtype, const ParallelFor& parallel_for) {
  switch (isa_choice().isa) {
#ifdef JAX_FLASH_CPU_HAS_X86_BUILDS
    case Isa::kAvx512:
      return avx512::AttentionForward(params, dtype, parallel_for);
    case Isa::kAvx2:
      return avx2::AttentionForward(params, dtype, parallel_for);
#endif
    default:
      return generic::AttentionForward(params, dtype, parallel_for);
  }
}

void attention_bwd(const BwdParams& params, DType dtype, const ParallelFor& parallel_for) {
  switch (isa_choice().isa) {
#ifdef JAX_FLASH_CPU_HAS_X86_BUILDS
    case Isa::kAvx512:
      return avx512::AttentionBackward(params, dtype, parallel_for);
    case Isa::kAvx2:
      return avx2::AttentionBackward(params, dtype, parallel_for);
#endif
    default:
      return generic::AttentionBackward(params, dtype, parallel_for);
  }
}

}  // namespace jax_flash::cpu
