// Exact scalar split pass of the decode call (common/decode_params.h) for float32 and float64:
// every product is a plain FMA in the input precision (no tensor cores, no TF32) and exp/log are
// the full-precision library functions, as in the SIMT attention kernels (simt_common.cuh, whose
// score function this reuses so that decode and attention see the same logits). Correctness over
// speed: one warp owns one (sequence, split, query head, query position) row; lane l scores key
// j0 + l of each 32-key chunk, the warp updates the online softmax once per chunk, and each lane
// accumulates O over its head-dim columns lane, lane + 32, ... (coalesced V reads).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/decode_params.h"
#include "cuda/simt_common.cuh"

namespace jax_flash::cuda::decode {

inline constexpr int kSimtWarps = 4;
inline constexpr int kSimtChunk = 32;  // keys per online-softmax step, also the split granule
inline constexpr int kSimtMaxHeadDim = 256;

template <typename T>
__device__ __forceinline__ T warp_max(T x) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) x = fmax(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
template <typename T>
__device__ __forceinline__ T warp_sum(T x) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// One warp per row of the [batch, num_splits, heads_q, seqlen_q] partial layout (with one split,
// the same rows written straight to o and lse).
template <typename T, bool kSoftcap>
__global__ void __launch_bounds__(kSimtWarps * 32) decode_simt_kernel(const DecodeParams p) {
  constexpr int kPerLane = kSimtMaxHeadDim / 32;
  __shared__ T q_smem[kSimtWarps][kSimtMaxHeadDim];
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  int64_t w = static_cast<int64_t>(blockIdx.x) * kSimtWarps + warp;
  if (w >= p.batch * p.num_splits * p.heads_q * p.seqlen_q) return;  // whole warps only
  const int64_t i = w % p.seqlen_q;
  w /= p.seqlen_q;
  const int64_t h = w % p.heads_q;
  w /= p.heads_q;
  const int64_t split = w % p.num_splits;
  const int64_t b = w / p.num_splits;
  const int64_t kv_head = h / (p.heads_q / p.heads_kv);
  const int d = static_cast<int>(p.head_dim);

  const int64_t seqlen_k = p.seqlen_k(b);
  const SeqMask mask = p.mask.band.for_seq(p.seqlen_q, seqlen_k);
  const int64_t lo = mask.key_begin(0);
  const int64_t hi = mask.key_end(p.seqlen_q);
  const int64_t sb = p.split_begin(split, lo, hi, kSimtChunk);
  const int64_t se = p.split_begin(split + 1, lo, hi, kSimtChunk);
  // This row's keys within the split: SeqMask's range of query i, so no element test remains.
  const int64_t kb = sb > mask.key_begin(i) ? sb : mask.key_begin(i);
  const int64_t ke = se < mask.key_end(i + 1) ? se : mask.key_end(i + 1);

  const T* q_row = static_cast<const T*>(p.q) + ((b * p.seqlen_q + i) * p.heads_q + h) * d;
  for (int x = lane; x < kSimtMaxHeadDim; x += 32) q_smem[warp][x] = x < d ? q_row[x] : T(0);
  __syncwarp();

  const int64_t kv_row_stride = p.heads_kv * p.head_dim;
  const T* k_head = static_cast<const T*>(p.k) + kv_head * d;
  const T* v_head = static_cast<const T*>(p.v) + kv_head * d;
  const auto score = simt::Score<T, kSoftcap>::of(p.softmax_scale, p.mask.softcap);

  T m = simt::neg_inf<T>();
  T l = T(0);
  T o[kPerLane];
#pragma unroll
  for (int t = 0; t < kPerLane; ++t) o[t] = T(0);

  for (int64_t j0 = kb; j0 < ke; j0 += kSimtChunk) {
    const int64_t j = j0 + lane;
    const bool valid = j < ke;
    const long long row = valid ? p.key_row(b, j) : 0;
    T s = simt::neg_inf<T>();
    if (valid) {
      const T* k_row = k_head + row * kv_row_stride;
      T dot = T(0);
      for (int x = 0; x < d; ++x) dot = fma(q_smem[warp][x], k_row[x], dot);
      T unused;
      s = score(dot, unused);
    }
    const T m_new = fmax(m, warp_max(s));
    // Every key so far is -inf (only possible when the row's scores overflow to -inf): skip, so
    // that no exp(-inf - -inf) appears.
    if (m_new == simt::neg_inf<T>()) continue;
    const T alpha = simt::exp_full(m - m_new);
    const T pj = valid ? simt::exp_full(s - m_new) : T(0);
    l = l * alpha + warp_sum(pj);
#pragma unroll
    for (int t = 0; t < kPerLane; ++t) o[t] *= alpha;
    const int n = ke - j0 < kSimtChunk ? static_cast<int>(ke - j0) : kSimtChunk;
    for (int src = 0; src < n; ++src) {
      const T ps = __shfl_sync(0xffffffffu, pj, src);
      const long long rs = __shfl_sync(0xffffffffu, row, src);
      const T* v_row = v_head + rs * kv_row_stride;
#pragma unroll
      for (int t = 0; t < kPerLane; ++t) {
        if (lane + 32 * t < d) o[t] = fma(ps, v_row[lane + 32 * t], o[t]);
      }
    }
    m = m_new;
  }

  // With one split the sink joins the denominator here (the merge adds it otherwise).
  const bool single = p.num_splits == 1;
  if (single && p.mask.sinks != nullptr) {
    const T sink = static_cast<const T*>(p.mask.sinks)[b * p.mask.sinks_batch_stride + h];
    const T m_tot = fmax(m, sink);
    if (m_tot != simt::neg_inf<T>()) {
      const T alpha = simt::exp_full(m - m_tot);
      l = l * alpha + simt::exp_full(sink - m_tot);
#pragma unroll
      for (int t = 0; t < kPerLane; ++t) o[t] *= alpha;
      m = m_tot;
    }
  }
  const T lse = l > T(0) ? m + simt::log_full(l) : simt::neg_inf<T>();
  const int64_t stat = single ? (b * p.heads_q + h) * p.seqlen_q + i
                              : ((b * p.num_splits + split) * p.heads_q + h) * p.seqlen_q + i;
  T* o_row = single ? static_cast<T*>(p.o) + ((b * p.seqlen_q + i) * p.heads_q + h) * d
                    : static_cast<T*>(p.partial_o) + stat * d;
#pragma unroll
  for (int t = 0; t < kPerLane; ++t) {
    if (lane + 32 * t < d) o_row[lane + 32 * t] = l > T(0) ? o[t] / l : T(0);
  }
  if (lane == 0) static_cast<T*>(single ? p.lse : p.partial_lse)[stat] = lse;
}

}  // namespace jax_flash::cuda::decode
