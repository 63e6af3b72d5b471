// Merge pass of the decode call (common/decode_params.h), when num_splits > 1: each split s left
// a normalised partial O_s and its lse_s over its keys; the row's result is
//   lse = log(sum_s exp(lse_s) + exp(sink)),  O = sum_s exp(lse_s - lse) * O_s,
// in the stats precision with full-precision exp/log. The sink enters here, once. A row whose
// splits and sink are all -inf (it sees no key) gets lse = -inf and O = 0, never NaN.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/decode_params.h"
#include "cuda/decode_simt.cuh"
#include "cuda/grid_dependency.cuh"

namespace jax_flash::cuda::decode {

template <typename T, typename S>
__device__ __forceinline__ T to_output(S x) {
  if constexpr (std::is_same_v<T, __half>) {
    return __float2half_rn(x);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16_rn(x);
  } else {
    return static_cast<T>(x);
  }
}

// One block of kMergeWarps warps per row of lse's [batch, heads_q, seqlen_q]. A decode call has
// few rows (batch x heads_q x seqlen_q, e.g. 32) and up to ~100 splits, so the splits are what is
// spread: every warp computes the row's max and sum over all splits (lanes stride the splits),
// then warp w sums the partial rows of splits w, w + kMergeWarps, ... (lanes over the head-dim
// columns, coalesced, kMergeUnroll splits' loads in flight), and the warps' sums meet in shared
// memory. T: output dtype, S: stats.
inline constexpr int kMergeWarps = 8;
inline constexpr int kMergeUnroll = 4;

template <typename T, typename S>
__global__ void __launch_bounds__(kMergeWarps * 32) decode_merge_kernel(const DecodeParams p) {
  // Launched as the split pass's programmatic dependent: wait for that grid to finish and its
  // partials to be visible.
  wait_for_primary();
  constexpr int kPerLane = kSimtMaxHeadDim / 32;
  __shared__ S partial[kMergeWarps][kSimtMaxHeadDim];
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int64_t row = blockIdx.x;  // the lse index
  const int64_t i = row % p.seqlen_q;
  const int64_t h = row / p.seqlen_q % p.heads_q;
  const int64_t b = row / p.seqlen_q / p.heads_q;
  const int d = static_cast<int>(p.head_dim);
  const int64_t n_splits = p.num_splits;
  const int64_t split_stride = p.heads_q * p.seqlen_q;  // between splits in partial_lse
  const S* part_lse =
      static_cast<const S*>(p.partial_lse) + (b * n_splits * p.heads_q + h) * p.seqlen_q + i;
  const S* part_o = static_cast<const S*>(p.partial_o) +
                    ((b * n_splits * p.heads_q + h) * p.seqlen_q + i) * p.head_dim;
  const S neg_inf = simt::neg_inf<S>();

  S m = neg_inf;
  for (int64_t s = lane; s < n_splits; s += 32) m = fmax(m, part_lse[s * split_stride]);
  m = warp_max(m);
  S sink = neg_inf;
  if (p.mask.sinks != nullptr) {
    sink = static_cast<const S*>(p.mask.sinks)[b * p.mask.sinks_batch_stride + h];
    m = fmax(m, sink);
  }
  T* o_row = static_cast<T*>(p.o) + ((b * p.seqlen_q + i) * p.heads_q + h) * p.head_dim;
  S* lse_out = static_cast<S*>(p.lse);
  if (m == neg_inf) {  // uniform across the block: every warp saw the same lse values
    if (warp == 0) {
#pragma unroll
      for (int t = 0; t < kPerLane; ++t) {
        if (lane + 32 * t < d) o_row[lane + 32 * t] = to_output<T>(S(0));
      }
      if (lane == 0) lse_out[row] = neg_inf;
    }
    return;
  }
  S sum = S(0);
  for (int64_t s = lane; s < n_splits; s += 32) {
    sum += simt::exp_full(part_lse[s * split_stride] - m);
  }
  sum = warp_sum(sum) + simt::exp_full(sink - m);
  const S lse = m + simt::log_full(sum);

  S o[kPerLane];
#pragma unroll
  for (int t = 0; t < kPerLane; ++t) o[t] = S(0);
  // Empty splits have weight exp(-inf) = 0 and an O_s of zeros: they add nothing, so no branch.
  for (int64_t s0 = warp; s0 < n_splits; s0 += kMergeWarps * kMergeUnroll) {
#pragma unroll
    for (int u = 0; u < kMergeUnroll; ++u) {
      const int64_t s = s0 + u * kMergeWarps;
      if (s < n_splits) {
        const S weight = simt::exp_full(part_lse[s * split_stride] - lse);
        const S* src = part_o + s * split_stride * p.head_dim;
#pragma unroll
        for (int t = 0; t < kPerLane; ++t) {
          if (lane + 32 * t < d) o[t] = fma(weight, src[lane + 32 * t], o[t]);
        }
      }
    }
  }
#pragma unroll
  for (int t = 0; t < kPerLane; ++t) partial[warp][lane + 32 * t] = o[t];
  __syncthreads();
  // Warp 0 adds the warps' sums in a fixed order (the result does not depend on timing).
  if (warp == 0) {
#pragma unroll
    for (int t = 0; t < kPerLane; ++t) {
      if (lane + 32 * t < d) {
        S total = S(0);
#pragma unroll
        for (int w = 0; w < kMergeWarps; ++w) total += partial[w][lane + 32 * t];
        o_row[lane + 32 * t] = to_output<T>(total);
      }
    }
    if (lane == 0) lse_out[row] = lse;
  }
}

}  // namespace jax_flash::cuda::decode
