// The per-instruction-set builds of the CPU kernels (flash_impl.h compiled once per set). The
// public entry points in attention_cpu.cc pick one at run time.
#pragma once

#include "common/params.h"
#include "cpu/attention_cpu.h"

namespace jax_flash::cpu {

// Portable build: plain C++ with GCC/Clang vector extensions, any CPU.
namespace generic {
void AttentionForward(const FwdParams& params, DType dtype, const ParallelFor& parallel_for);
void AttentionBackward(const BwdParams& params, DType dtype, const ParallelFor& parallel_for);
}  // namespace generic

#if defined(__x86_64__) || defined(_M_X64)
#define JAX_FLASH_CPU_HAS_X86_BUILDS 1
// AVX2 + FMA + F16C build; call only when the CPU supports all three. Both x86 builds are
// compiled under target pragmas, so the library itself still runs on any x86-64 CPU.
namespace avx2 {
void AttentionForward(const FwdParams& params, DType dtype, const ParallelFor& parallel_for);
void AttentionBackward(const BwdParams& params, DType dtype, const ParallelFor& parallel_for);
}  // namespace avx2
// AVX-512 (F, VL, BW, DQ) + FMA + F16C build; call only when the CPU supports all of them.
namespace avx512 {
void AttentionForward(const FwdParams& params, DType dtype, const ParallelFor& parallel_for);
void AttentionBackward(const BwdParams& params, DType dtype, const ParallelFor& parallel_for);
}  // namespace avx512
#endif

}  // namespace jax_flash::cpu
