// The fp32 dQ accumulator shared by the tensor-core backward passes: the key tiles of one query
// row run in different CTAs and add into it with atomics, so it is zeroed before the main kernel
// and scaled and rounded to T once after it.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/mask.h"
#include "cuda/tc_primitives.cuh"

namespace jax_flash::cuda {

// Where head-dim column `col` of dQ sits in a row of dq_accum when the wgmma backward stages dQ
// with stmatrix (BwdWgmmaTraits::kDqStsm; bwd_wgmma_dq.cuh, stage_dq_boxes): each aligned group of
// 8 columns holds its even columns first (8i + 2t + e at 8i + 4e + t). Otherwise, and in the
// mma.sync backward, dq_accum is in the natural order.
JF_HOST_DEVICE constexpr int dq_accum_position(int col) {
  return (col & ~7) | ((col & 1) << 2) | ((col & 7) >> 1);
}

// The query-pair order of the wgmma backward's 80-query dQ^T staging (BwdWgmmaArgs::dq_pairs;
// dense calls with an even seqlen_q): dq_accum is [batch, seqlen_q / 2, heads, 2 head_dim], a row
// holding queries 2p and 2p + 1, and inside a row each aligned group of 16 head-dim columns of the
// two queries is 32 floats. A thread of the dQ^T GEMM holds columns c and c + 8 (c < 8) of both
// queries of a pair; they are one 16-byte chunk, at chunk dq_pair_chunk(c) of the group: columns
// 2k and 2k + 1 sit four chunks apart, so that the 8 lanes of a quarter warp (two values of c,
// four pair rows under the 128-byte swizzle) store to 8 different chunk positions. Inside the
// chunk: (query 2p, c), (2p + 1, c), (2p, c + 8), (2p + 1, c + 8), the order of the thread's
// accumulator registers.
JF_HOST_DEVICE constexpr int dq_pair_chunk(int c) { return (c >> 1) | ((c & 1) << 2); }
JF_HOST_DEVICE constexpr int dq_pair_position(int query_parity, int col) {
  return 32 * (col >> 4) + 4 * dq_pair_chunk(col & 7) + 2 * ((col >> 3) & 1) + query_parity;
}
constexpr bool dq_pair_order_is_a_permutation() {
  bool seen[32] = {};
  for (int e = 0; e < 2; ++e) {
    for (int col = 0; col < 16; ++col) {
      const int at = dq_pair_position(e, col);
      if (at < 0 || at >= 32 || seen[at]) return false;
      seen[at] = true;
    }
  }
  return true;
}
static_assert(dq_pair_order_is_a_permutation() && dq_pair_position(1, 31) == 63);

// dQ = T(scale * dq_accum), kWidth elements per thread and step (n = elements / kWidth; head_dim
// is a multiple of 64, so the element count is a multiple of 8): 4 in the natural order, one
// float4 read a lane; 8 in dq_accum_position's order (kPermuted), one aligned group of 8 columns,
// two float4 reads 32 bytes apart a lane, which the step interleaves back.
template <typename T, bool kPermuted, int kWidth>
__global__ void dq_convert_kernel(const float4* __restrict__ dq_accum, T* __restrict__ dq,
                                  int64_t n, float scale) {
  static_assert(kWidth == (kPermuted ? 8 : 4));
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if constexpr (kWidth == 4) {
      const float4 a = dq_accum[i];
      uint2 out;
      out.x = tc::pack2<T>(a.x * scale, a.y * scale);
      out.y = tc::pack2<T>(a.z * scale, a.w * scale);
      reinterpret_cast<uint2*>(dq)[i] = out;
    } else {
      const float4 a = dq_accum[2 * i];
      const float4 b = dq_accum[2 * i + 1];
      // Two 8-byte stores: the callers guarantee dQ 8-byte alignment, not 16.
      reinterpret_cast<uint2*>(dq)[2 * i] = make_uint2(tc::pack2<T>(a.x * scale, b.x * scale),
                                                       tc::pack2<T>(a.y * scale, b.y * scale));
      reinterpret_cast<uint2*>(dq)[2 * i + 1] = make_uint2(tc::pack2<T>(a.z * scale, b.z * scale),
                                                           tc::pack2<T>(a.w * scale, b.w * scale));
    }
  }
}

// dQ = T(scale * dq_accum) from dq_pair_position's order: a thread and step per (pair row, head,
// group of 16 columns), its 32 floats read as 8 float4 (128 contiguous bytes a lane) and written
// as 16 columns of each of the two query rows (8-byte stores).
template <typename T>
__global__ void dq_convert_pairs_kernel(const float4* __restrict__ dq_accum, T* __restrict__ dq,
                                        int64_t groups, int heads, int head_dim, float scale) {
  const int col_groups = head_dim / 16;
  for (int64_t n = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; n < groups;
       n += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float4 chunk[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) chunk[j] = dq_accum[8 * n + j];
    const int64_t row_head = n / col_groups;
    const int col0 = static_cast<int>(n - row_head * col_groups) * 16;
    const int64_t pair_row = row_head / heads;
    const int64_t head = row_head - pair_row * heads;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float v[16];
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        const float4 a = chunk[dq_pair_chunk(c)];
        v[c] = (e == 0 ? a.x : a.y) * scale;
        v[c + 8] = (e == 0 ? a.z : a.w) * scale;
      }
      uint2* const out =
          reinterpret_cast<uint2*>(dq + ((2 * pair_row + e) * heads + head) * head_dim + col0);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        out[k] = make_uint2(tc::pack2<T>(v[4 * k], v[4 * k + 1]),
                            tc::pack2<T>(v[4 * k + 2], v[4 * k + 3]));
      }
    }
  }
}

// Zeroes the `elems` floats of dq_accum on `stream`.
inline cudaError_t zero_dq_accum(float* dq_accum, int64_t elems, cudaStream_t stream) {
  if (elems == 0) return cudaSuccess;
  return cudaMemsetAsync(dq_accum, 0, elems * sizeof(float), stream);
}

// The deterministic backward keeps kDqCounters counters per dQ row and head
// (BwdParams::dq_semaphores; only a query tile's first row is used): one per group of threads
// that add to disjoint columns of the tile.
inline constexpr int kDqCounters = 2;

// Zeroes the deterministic backward's counters for `rows` dQ rows x heads on `stream`.
inline cudaError_t zero_dq_semaphores(int32_t* sems, int64_t rows, cudaStream_t stream) {
  if (sems == nullptr || rows == 0) return cudaSuccess;
  return cudaMemsetAsync(sems, 0, rows * kDqCounters * sizeof(int32_t), stream);
}

// The deterministic backward adds the contributions to one dQ tile (query tile of a sequence, one
// query head) in the order of the key tiles, descending: the key-tile CTA waits until the tile's
// counter says that every higher key tile that visits the tile has added its part, adds its own,
// and bumps the counter. For the band of common/mask.h the key tiles that visit a query tile are
// one run, up to the one holding the last key the tile's last row may see (hi), so key tile j comes
// `dq_ticket` = hi - j places into the order. Descending is the order in which a causal backward
// reaches a query tile anyway (the CTA of a later key tile starts at a later query tile), so there
// it costs little waiting. The grid is launched with the key tiles of a head in descending order
// too (dq_launch_tile), so a CTA only waits for CTAs of lower grid index, which the hardware starts
// no later than itself: the wait always ends.
JF_HOST_DEVICE int dq_ticket(const SeqMask& mask, int64_t m0, int64_t rows, int64_t n0,
                             int64_t block_n) {
  const int64_t hi = (mask.key_end(m0 + rows) - 1) / block_n;
  return static_cast<int>(hi - n0 / block_n);
}

// Whether a head's key tiles launch last to first: the deterministic order does.
JF_HOST_DEVICE bool dq_launch_reversed(bool deterministic) { return deterministic; }

// The key tile (of `tiles`, in schedule order) that grid position `t` of a head works on.
JF_HOST_DEVICE int64_t dq_launch_tile(int64_t t, int64_t tiles, bool deterministic) {
  return dq_launch_reversed(deterministic) ? tiles - 1 - t : t;
}

#if defined(__CUDACC__)
// Spins (one thread) until *sem == target; the acquire orders the earlier CTAs' dQ additions,
// which they released, before the caller's own.
__device__ __forceinline__ void dq_wait_turn(const int32_t* sem, int target) {
  int value;
  do {
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(value) : "l"(sem) : "memory");
  } while (value != target);
}

// Passes the turn on (one thread, after a barrier that follows every thread's additions): the
// fence makes the additions the barrier ordered before it visible before the counter moves.
__device__ __forceinline__ void dq_pass_turn(int32_t* sem) {
  asm volatile("fence.acq_rel.gpu;\n" ::: "memory");
  asm volatile("red.relaxed.gpu.global.add.s32 [%0], 1;\n" ::"l"(sem) : "memory");
}
#endif

// dq = T(scale * dq_accum) over `elems` elements on `stream`; kPermuted as dq_convert_kernel.
template <typename T, bool kPermuted = false>
cudaError_t convert_dq(const float* dq_accum, void* dq, int64_t elems, double scale,
                       cudaStream_t stream) {
  if (elems == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  constexpr int kWidth = kPermuted ? 8 : 4;
  const int64_t n = elems / kWidth;
  const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, 65536);
  dq_convert_kernel<T, kPermuted, kWidth><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      reinterpret_cast<const float4*>(dq_accum), static_cast<T*>(dq), n, static_cast<float>(scale));
  return cudaGetLastError();
}

// dq = T(scale * dq_accum) over `elems` elements (rows_q x heads x head_dim, rows_q even) in
// dq_pair_position's order, on `stream`.
template <typename T>
cudaError_t convert_dq_pairs(const float* dq_accum, void* dq, int64_t elems, int heads,
                             int head_dim, double scale, cudaStream_t stream) {
  if (elems == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const int64_t groups = elems / 32;
  const int64_t blocks = std::min<int64_t>((groups + kThreads - 1) / kThreads, 65536);
  dq_convert_pairs_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      reinterpret_cast<const float4*>(dq_accum), static_cast<T*>(dq), groups, heads, head_dim,
      static_cast<float>(scale));
  return cudaGetLastError();
}

}  // namespace jax_flash::cuda
