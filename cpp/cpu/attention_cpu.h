// CPU FlashAttention: tiled over query and key/value blocks with an online softmax, O(N) extra
// memory. Framework-free: the FFI layer supplies a parallel-for built on XLA's thread pool.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/params.h"

namespace jax_flash::cpu {

// Runs task(i) for every i in [0, n_tasks), possibly concurrently, and returns once all finished.
using ParallelFor = std::function<void(int64_t n_tasks, const std::function<void(int64_t)>& task)>;

// The instruction-set builds of the kernels, in increasing order of preference.
enum class Isa { kGeneric, kAvx2, kAvx512 };

// "generic", "avx2" or "avx512": the names JAX_FLASH_CPU_ISA accepts.
const char* isa_name(Isa isa);

// The builds this CPU (and its OS) can run, in increasing order; "generic" is always one.
std::vector<Isa> supported_isas();

// The build every call of this process uses, decided once at the first query: the level that
// JAX_FLASH_CPU_ISA names, or the best supported one when it is unset or empty. `error` is
// non-empty when the variable names an unknown level or one this CPU lacks; the kernels then
// refuse to run (the FFI handlers return it as an error) rather than fall back silently.
struct IsaChoice {
  Isa isa = Isa::kGeneric;
  std::string error;
};
const IsaChoice& isa_choice();

// Any head_dim in [1, 256]; f16/bf16 are computed in float32, f32 in float32, f64 in float64.
// Both run the build of isa_choice() and must not be called while its error is set.
void attention_fwd(const FwdParams& params, DType dtype, const ParallelFor& parallel_for);
// dq_accum is ignored (nullptr). Deterministic: no atomics.
void attention_bwd(const BwdParams& params, DType dtype, const ParallelFor& parallel_for);

// The build of the kernels this process runs, by isa_name() ("avx512", "avx2" or "generic"), or
// "none (<reason>)" when JAX_FLASH_CPU_ISA is refused; for reports, never an exception.
std::string simd_level();

}  // namespace jax_flash::cpu
