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
// spread. The pass is the last link of a decode step's dependent chain, so it is built for latency:
// - warp w takes splits w, w + kMergeWarps, ... in rounds of kMergeUnroll and issues every load of
//   a round (the splits' lse, and their partial rows with lanes over the head-dim columns,
//   coalesced) before using any, folding them into its own (m_w, l_w, o_w) against its own running
//   max; the warps' states then meet once in shared memory. Up to kMergeWarps * kMergeUnroll
//   splits that is one round of global loads, where merging against the row's max first takes two.
// - The blocks launch early, as the split pass's programmatic dependents, and where the SMs have
//   room they sit at the wait while it runs. After the wait, a pass over cold code costs more than
//   its work: instruction fetches on SMs that have not run this kernel lately (a per-block
//   timeline, tools/decode_cta_trace.py: 2.8 us from the wait to the end, 1.0 us once warm). So
//   on sm_90 the body runs twice: first before the wait, on stand-in values (every split's lse 0,
//   partial rows and sink 0), reading and writing no global memory, which brings its instructions
//   into the SM's instruction cache; then after the wait, on the split pass's results. (A block
//   that only finds room once the split pass is over pays for the first pass; at batch 8 and 32,
//   where that happens, the call measured no slower.)
// The order of every sum is fixed: the result does not depend on timing. T: output dtype, S:
// stats precision.
inline constexpr int kMergeWarps = 8;
inline constexpr int kMergeUnroll = 4;
static_assert(kMergeWarps * 32 >= kSimtMaxHeadDim, "one thread per head-dim column of O");

template <typename T, typename S>
__global__ void __launch_bounds__(kMergeWarps * 32) decode_merge_kernel(const DecodeParams p) {
  constexpr int kPerLane = kSimtMaxHeadDim / 32;
  __shared__ S warp_o[kMergeWarps][kSimtMaxHeadDim];
  __shared__ S warp_m[kMergeWarps];
  __shared__ S warp_l[kMergeWarps];
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int col = static_cast<int>(threadIdx.x);  // the column of O this thread writes
  const int64_t row = blockIdx.x;                 // the lse index
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
  T* o_row = static_cast<T*>(p.o) + ((b * p.seqlen_q + i) * p.heads_q + h) * p.head_dim;
  const S neg_inf = simt::neg_inf<S>();

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int kFirstRound = 0;
#else
  // Without a programmatic launch the blocks start once the split pass is done: nothing would
  // hide the first pass.
  constexpr int kFirstRound = 1;
#endif
#pragma unroll 1
  for (int round = kFirstRound; round < 2; ++round) {
    // The compiler must not tell the two passes apart, or it would compile the body twice.
    int pass;
    asm volatile("mov.b32 %0, %1;" : "=r"(pass) : "r"(round));
    const bool live = pass == 1;
    // Launched as the split pass's programmatic dependent: wait for that grid to finish and its
    // partials to be visible.
    if (live) wait_for_primary();

    // This warp's splits, folded in rounds. A split that saw no key has lse -inf and an O_s of
    // zeros: its weight is 0. A warp that has met only such splits keeps m_w = -inf, l_w = 0 and
    // o_w = 0.
    S m_w = neg_inf;
    S l_w = S(0);
    S o_w[kPerLane];
#pragma unroll
    for (int t = 0; t < kPerLane; ++t) o_w[t] = S(0);
    for (int64_t s0 = warp; s0 < n_splits; s0 += kMergeWarps * kMergeUnroll) {
      S lse_s[kMergeUnroll];
      S o_s[kMergeUnroll][kPerLane];
#pragma unroll
      for (int u = 0; u < kMergeUnroll; ++u) {
        const int64_t s = s0 + u * kMergeWarps;
        const bool valid = s < n_splits;
        lse_s[u] = valid ? (live ? part_lse[s * split_stride] : S(0)) : neg_inf;
        const S* src = part_o + s * split_stride * p.head_dim;
#pragma unroll
        for (int t = 0; t < kPerLane; ++t) {
          o_s[u][t] = live && valid && lane + 32 * t < d ? src[lane + 32 * t] : S(0);
        }
      }
      S m_new = m_w;
#pragma unroll
      for (int u = 0; u < kMergeUnroll; ++u) m_new = fmax(m_new, lse_s[u]);
      if (m_new == neg_inf) continue;  // warp-uniform: every lane read the same lse values
      const S alpha = simt::exp_full(m_w - m_new);  // 0 while m_w is -inf
      l_w *= alpha;
#pragma unroll
      for (int t = 0; t < kPerLane; ++t) o_w[t] *= alpha;
#pragma unroll
      for (int u = 0; u < kMergeUnroll; ++u) {
        const S weight = simt::exp_full(lse_s[u] - m_new);
        l_w += weight;
#pragma unroll
        for (int t = 0; t < kPerLane; ++t) o_w[t] = fma(weight, o_s[u][t], o_w[t]);
      }
      m_w = m_new;
    }
#pragma unroll
    for (int t = 0; t < kPerLane; ++t) warp_o[warp][lane + 32 * t] = o_w[t];
    if (lane == 0) {
      warp_m[warp] = m_w;
      warp_l[warp] = l_w;
    }
    __syncthreads();

    // Every thread combines the warps' states (the same few exps in each: cheaper than another
    // barrier) for its column of O; thread 0 also writes lse. The sink enters here, once. A row
    // that sees no key and has no sink (m = -inf) gets O = 0 and lse = -inf, never NaN.
    S m = neg_inf;
#pragma unroll
    for (int x = 0; x < kMergeWarps; ++x) m = fmax(m, warp_m[x]);
    S sink = neg_inf;
    if (p.mask.sinks != nullptr) {
      sink = live ? static_cast<const S*>(p.mask.sinks)[b * p.mask.sinks_batch_stride + h] : S(0);
      m = fmax(m, sink);
    }
    const bool none = m == neg_inf;
    const S ref = none ? S(0) : m;
    // With m finite, the warp (or sink) that holds it adds at least 1 to sum.
    S sum = simt::exp_full(sink - ref);
    S o = S(0);
#pragma unroll
    for (int x = 0; x < kMergeWarps; ++x) {
      // A warp with m_w = -inf has l_w = 0 and o_w = 0, and its factor exp(-inf) is 0.
      const S f = simt::exp_full(warp_m[x] - ref);
      sum = fma(warp_l[x], f, sum);
      if (col < d) o = fma(warp_o[x][col], f, o);
    }
    if (live) {
      if (col < d) o_row[col] = to_output<T>(none ? S(0) : o / sum);
      if (col == 0) static_cast<S*>(p.lse)[row] = none ? neg_inf : m + simt::log_full(sum);
    }
    // The first pass's shared-memory reads come before the second's writes.
    __syncthreads();
  }
}

}  // namespace jax_flash::cuda::decode
