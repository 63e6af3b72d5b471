// CPU FlashAttention: tiled over query and key/value blocks with an online softmax, O(N) extra
// memory. Framework-free: the FFI layer supplies a parallel-for built on XLA's thread pool.
#pragma once

#include <cstdint>
#include <functional>

#include "common/params.h"

namespace jax_flash::cpu {

// Runs task(i) for every i in [0, n_tasks), possibly concurrently, and returns once all finished.
using ParallelFor = std::function<void(int64_t n_tasks, const std::function<void(int64_t)>& task)>;

// Any head_dim in [1, 256]; f16/bf16 are computed in float32, f32 in float32, f64 in float64.
void attention_fwd(const FwdParams& params, DType dtype, const ParallelFor& parallel_for);
// dq_accum is ignored (nullptr). Deterministic: no atomics.
void attention_bwd(const BwdParams& params, DType dtype, const ParallelFor& parallel_for);

// The build of the kernels this CPU runs: "avx2" (AVX2 + FMA + F16C) or "generic" (SSE2 on
// x86-64, NEON on AArch64, scalar code elsewhere).
const char* simd_level();

}  // namespace jax_flash::cpu
