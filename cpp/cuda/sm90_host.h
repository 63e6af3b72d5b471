// Host-side helpers shared by the Hopper (sm_90a) kernel families: the device check and TMA tensor
// maps over the [batch, seqlen, heads, head_dim] layout.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "common/params.h"

namespace jax_flash::cuda::sm90 {

// True when this build holds the kernels' sm_90a code (JAX_FLASH_BUILT_SM90A, set by CMake from
// the -gencode list) and the current device has compute capability 9.0 (read once per device).
// Without sm_90a code the kernels compile to a trap, so they must not be dispatched.
bool sm90a_kernels_usable();

// The current device's SM count (read once per device); 0 if it cannot be read.
int sm_count();

// Checks both Hopper families share: f16/bf16, non-negative batch and lengths, positive head counts
// with heads_q a multiple of heads_kv, and a finite positive softmax scale.
template <typename Params>
bool common_params_supported(const Params& p, DType dtype) {
  return (dtype == DType::kF16 || dtype == DType::kBF16) && params_well_formed(p);
}

inline bool aligned(const void* ptr, uintptr_t bytes) {
  return (reinterpret_cast<uintptr_t>(ptr) & (bytes - 1)) == 0;
}

// A [batch, seqlen, heads, head_dim] tensor of 2-byte (or, with elem_bytes 4, float32) elements as
// a 4-D TMA map (innermost first), read or written in boxes of one 128-byte swizzle span of
// head-dim columns (64 of 2 bytes, 32 of 4; `box_bytes` 64: half of that with the 64-byte swizzle)
// x `box_rows` sequence positions of one head. Rows past
// seqlen read as zeros and are not written. A zero seqlen is encoded as 1 (TMA dims must be
// nonzero): callers never load such a map. `promotion`: how much around each miss L2 fetches (the
// attention kernels reuse K/V rows across CTAs and ask for 256 bytes; the decode stream reads each
// byte once and asks for none). False on failure.
bool encode_bshd(CUtensorMap* map, CUtensorMapDataType type, const void* ptr, int64_t batch,
                 int64_t seqlen, int64_t heads, int64_t head_dim, int box_rows, int elem_bytes = 2,
                 CUtensorMapL2promotion promotion = CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                 int box_bytes = 128);

}  // namespace jax_flash::cuda::sm90
