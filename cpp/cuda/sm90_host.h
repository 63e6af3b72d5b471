// Host-side helpers shared by the Hopper (sm_90a) kernel families: the device check and TMA tensor
// maps over the [batch, seqlen, heads, head_dim] layout.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace jax_flash::cuda::sm90 {

// True when the current device has compute capability 9.0 (read once per device).
bool current_device_is_sm90();

// A [batch, seqlen, heads, head_dim] 16-bit tensor as a 4-D TMA map (innermost first), read or
// written in boxes of 64 head-dim columns (one 128-byte swizzle span) x `box_rows` sequence
// positions of one head. Rows past seqlen read as zeros and are not written. False on failure.
bool encode_bshd(CUtensorMap* map, CUtensorMapDataType type, const void* ptr, int64_t batch,
                 int64_t seqlen, int64_t heads, int64_t head_dim, int box_rows);

}  // namespace jax_flash::cuda::sm90
