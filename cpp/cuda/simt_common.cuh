// Building blocks of the exact scalar (SIMT) attention kernels for float32 and float64: tile
// shapes per (dtype, head-dim capacity), vector shared-memory reads, zero-filling tile loads, the
// causal visibility bounds and the launch helper. Every product is a plain FMA in the input
// precision (no tensor cores, no TF32) and exp/log are the full-precision library functions, so
// these files must be compiled without --use_fast_math (which would turn expf into __expf).
#pragma once

#include <cuda_runtime.h>
#include <math_constants.h>

#include <cstdint>
#include <type_traits>
#include <utility>

#include "common/params.h"

namespace jax_flash::cuda::simt {

// Elements per 16-byte shared-memory access: float4 or double2. Rows of every shared tile are
// padded by one such vector so that lanes walking down a column hit distinct banks.
template <typename T>
inline constexpr int kVec = 16 / static_cast<int>(sizeof(T));

template <typename T>
struct alignas(16) Vec {
  T v[kVec<T>];
};

template <typename T>
__device__ __forceinline__ Vec<T> load_vec(const T* smem) {
  return *reinterpret_cast<const Vec<T>*>(smem);
}

template <typename T>
__device__ __forceinline__ T neg_inf();
template <>
__device__ __forceinline__ float neg_inf<float>() {
  return -CUDART_INF_F;
}
template <>
__device__ __forceinline__ double neg_inf<double>() {
  return -CUDART_INF;
}

// The scaled logit scale * q.k, rounded on its own (never contracted into a later subtraction).
// The forward's running max, its P and the backward's recomputed P all start from this one
// rounded value, so both passes see the same logits: a key that dominates its row has
// logit == max == lse exactly and recomputes P = exp(0) = 1. With an fma, P would carry the
// product's rounding residue (up to half an ulp of a logit, ~5e-4 at |logit| ~ 1e4) that the
// f32 lse cannot represent, and every gradient of such a row would be off by that much.
__device__ __forceinline__ float scaled_logit(float x, float scale) { return __fmul_rn(x, scale); }
__device__ __forceinline__ double scaled_logit(double x, double scale) {
  return __dmul_rn(x, scale);
}

__device__ __forceinline__ float exp_full(float x) { return expf(x); }
__device__ __forceinline__ double exp_full(double x) { return exp(x); }
__device__ __forceinline__ float log_full(float x) { return logf(x); }
__device__ __forceinline__ double log_full(double x) { return log(x); }

// acc[i][ch * kVecN + f] += sum over n < n_lim of a[(row0 + i) * kAStride + n] *
// b[n * kBStride + ch * kChunkSpan + lane * kVecN + f]: a thread's rows of a score tile (P or dS
// in shared memory) times its head-dim columns of a row-major operand (V or K). n_lim is the key
// count rounded up to the vector width: past the real count `a` holds 0 and `b` zero-filled rows,
// so the padding adds exact zeros. Chunks at or past head_dim d are skipped.
template <typename T, int kRowsPerThread, int kDimChunks, int kChunkSpan, int kAStride,
          int kBStride>
__device__ __forceinline__ void accumulate_rows(T (&acc)[kRowsPerThread][kDimChunks * kVec<T>],
                                                const T* a, const T* b, int row0, int lane,
                                                int n_lim, int d) {
  constexpr int kV = kVec<T>;
#pragma unroll 1
  for (int n = 0; n < n_lim; n += kV) {
    Vec<T> va[kRowsPerThread];
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) va[i] = load_vec(a + (row0 + i) * kAStride + n);
#pragma unroll
    for (int e = 0; e < kV; ++e) {
      const T* b_row = b + (n + e) * kBStride + lane * kV;
#pragma unroll
      for (int ch = 0; ch < kDimChunks; ++ch) {
        if (ch * kChunkSpan < d) {
          const Vec<T> vb = load_vec(b_row + ch * kChunkSpan);
#pragma unroll
          for (int i = 0; i < kRowsPerThread; ++i) {
#pragma unroll
            for (int f = 0; f < kV; ++f) {
              acc[i][ch * kV + f] = fma(va[i].v[e], vb.v[f], acc[i][ch * kV + f]);
            }
          }
        }
      }
    }
  }
}

// Head-dim capacity buckets: one instantiation per bucket sizes the shared tiles and register
// accumulators; the actual head_dim is a runtime value inside the bucket.
inline constexpr int kMaxHeadDim = 256;

// Block tile of the backward kernels. Both kernels keep `kRows` rows of two operands resident in
// shared memory (K, V for dK/dV; Q, dO for dQ) and stream `kCols` rows of the other two. In the
// score phase a thread computes kRows / (kThreads / kScoreLanes) resident rows against
// kCols / kScoreLanes streamed rows; in the accumulation phase it owns
// kRows / (kThreads / kAccLanes) output rows and head-dim columns strided by kAccLanes vectors.
// Sizes keep every configuration under the 99 KB of shared memory that sm_86 / sm_89 allow.
template <typename T, int kCap>
struct BwdTile;
template <>
struct BwdTile<float, 64> {
  static constexpr int kRows = 64, kCols = 32, kThreads = 128, kScoreLanes = 16, kAccLanes = 16;
};
template <>
struct BwdTile<float, 128> {
  static constexpr int kRows = 32, kCols = 32, kThreads = 256, kScoreLanes = 16, kAccLanes = 16;
};
template <>
struct BwdTile<float, 256> {
  static constexpr int kRows = 16, kCols = 16, kThreads = 128, kScoreLanes = 16, kAccLanes = 16;
};
template <>
struct BwdTile<double, 64> {
  static constexpr int kRows = 32, kCols = 16, kThreads = 128, kScoreLanes = 16, kAccLanes = 16;
};
template <>
struct BwdTile<double, 128> {
  static constexpr int kRows = 16, kCols = 16, kThreads = 128, kScoreLanes = 16, kAccLanes = 16;
};
template <>
struct BwdTile<double, 256> {
  static constexpr int kRows = 8, kCols = 8, kThreads = 64, kScoreLanes = 8, kAccLanes = 16;
};

// Asynchronous global->shared copy of one 4- or 8-byte element (sm_80+). When `valid` is false
// the source is not read and the destination is zero-filled.
template <int kBytes>
__device__ __forceinline__ void cp_async_element(void* smem_dst, const void* gmem_src, bool valid) {
  static_assert(kBytes == 4 || kBytes == 8, "cp.async.ca copies 4, 8 or 16 bytes");
  const unsigned int dst = static_cast<unsigned int>(__cvta_generic_to_shared(smem_dst));
  const int src_bytes = valid ? kBytes : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(dst), "l"(gmem_src),
               "n"(kBytes), "r"(src_bytes)
               : "memory");
}

// Waits for this thread's outstanding copies; a __syncthreads() must follow before other threads
// read the tile.
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

// Starts copying rows [0, rows_valid) x columns [0, head_dim) of a row-major slab whose
// consecutive rows are `row_stride` elements apart into a [kRows][kStride] shared tile. The rest
// of the first kCap columns is zero-filled: padded rows and head-dim columns then add exact zeros
// to every dot product, and no global address past the slab is ever read. Copies go straight to
// shared memory, so a whole tile is in flight at once without staging registers; the loop stays
// rolled because unrolled, the compiler hoists every element's 64-bit row offset out of the
// callers' loops and keeps them all live.
template <typename T, int kThreads, int kRows, int kCap, int kStride>
__device__ __forceinline__ void load_tile_async(T* tile, const T* src, int64_t row_stride,
                                                int rows_valid, int head_dim) {
  static_assert(kRows * kCap % kThreads == 0, "tile must split evenly over the block");
#pragma unroll 1
  for (int idx = static_cast<int>(threadIdx.x); idx < kRows * kCap; idx += kThreads) {
    const int r = idx / kCap;
    const int c = idx % kCap;
    const bool valid = r < rows_valid && c < head_dim;
    cp_async_element<sizeof(T)>(tile + r * kStride + c, valid ? src + r * row_stride + c : src,
                                valid);
  }
}

// Copies a per-row statistic (lse or delta) of rows [0, rows_valid); padded rows get `fill`.
template <typename T, int kThreads, int kRows>
__device__ __forceinline__ void load_row_stat(T* dst, const T* src, int rows_valid, T fill) {
  for (int r = static_cast<int>(threadIdx.x); r < kRows; r += kThreads) {
    dst[r] = r < rows_valid ? src[r] : fill;
  }
}

// Causal masking is bottom-right aligned: query i sees key j iff j <= i + (seqlen_k - seqlen_q).
// Exclusive end of the keys that any query row below q_end can see.
__host__ __device__ inline int64_t visible_key_end(int64_t q_end, int64_t seqlen_q,
                                                   int64_t seqlen_k, bool causal) {
  if (!causal) return seqlen_k;
  const int64_t end = q_end + (seqlen_k - seqlen_q);
  return end < 0 ? 0 : (end > seqlen_k ? seqlen_k : end);
}

// First query row that sees key k_begin; earlier rows see no key at or after it.
__host__ __device__ inline int64_t first_visible_query(int64_t k_begin, int64_t seqlen_q,
                                                       int64_t seqlen_k, bool causal) {
  if (!causal) return 0;
  const int64_t first = k_begin - (seqlen_k - seqlen_q);
  return first < 0 ? 0 : first;
}

// Within one (query tile at m0, key tile at n0) pair, local query row r sees local key column c
// iff c <= r + diag. The bound is clamped to the int range: beyond a tile's extent it only has to
// keep its sign and magnitude relative to the tile sizes.
__device__ __forceinline__ int causal_diag(int64_t m0, int64_t n0, int64_t seqlen_q,
                                           int64_t seqlen_k, bool causal) {
  constexpr int64_t kFar = int64_t{1} << 30;
  if (!causal) return static_cast<int>(kFar);
  const int64_t diag = m0 + (seqlen_k - seqlen_q) - n0;
  return static_cast<int>(diag < -kFar ? -kFar : (diag > kFar ? kFar : diag));
}

inline bool valid_shape(int64_t batch, int64_t seqlen_q, int64_t seqlen_k, int64_t heads_q,
                        int64_t heads_kv, int64_t head_dim) {
  return batch >= 0 && seqlen_q >= 0 && seqlen_k >= 0 && heads_kv >= 1 && heads_q >= heads_kv &&
         heads_q % heads_kv == 0 && head_dim >= 1 && head_dim <= kMaxHeadDim;
}

// Calls fn(std::integral_constant<int, kCap>) for the smallest capacity bucket holding head_dim.
template <typename Fn>
cudaError_t dispatch_head_dim(int64_t head_dim, Fn&& fn) {
  if (head_dim >= 1 && head_dim <= 64) return fn(std::integral_constant<int, 64>{});
  if (head_dim > 64 && head_dim <= 128) return fn(std::integral_constant<int, 128>{});
  if (head_dim > 128 && head_dim <= 256) return fn(std::integral_constant<int, 256>{});
  return cudaErrorInvalidValue;
}

// Entry-point dispatch of the forward and the backward (Params is FwdParams or BwdParams): checks
// the shape, then calls fn(T{}, std::integral_constant<int, kCap>{}) for the element type T
// (float or double) and the capacity bucket of head_dim.
template <typename Params, typename Fn>
cudaError_t dispatch(const Params& p, DType dtype, Fn&& fn) {
  if (!valid_shape(p.batch, p.seqlen_q, p.seqlen_k, p.heads_q, p.heads_kv, p.head_dim)) {
    return cudaErrorInvalidValue;
  }
  const auto by_head_dim = [&](auto zero) {
    return dispatch_head_dim(p.head_dim, [&](auto cap) { return fn(zero, cap); });
  };
  switch (dtype) {
    case DType::kF32:
      return by_head_dim(0.0f);
    case DType::kF64:
      return by_head_dim(0.0);
    default:
      return cudaErrorInvalidValue;
  }
}

// One block per tile on a 1-D grid (gridDim.x allows 2^31 - 1, unlike y and z); an empty grid
// launches nothing. Every launch raises the kernel's dynamic shared-memory limit, which is a
// per-function attribute of the current device and so is not cached across calls, and asks for
// the largest shared-memory carveout: the kernels stage all reuse in shared memory, not in L1.
template <typename... KernelArgs, typename... Args>
cudaError_t launch(void (*kernel)(KernelArgs...), int64_t blocks, int threads, size_t smem_bytes,
                   cudaStream_t stream, Args&&... args) {
  if (blocks == 0) return cudaSuccess;
  if (blocks < 0 || blocks > INT32_MAX) return cudaErrorInvalidValue;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem_bytes));
  if (err != cudaSuccess) return err;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                             cudaSharedmemCarveoutMaxShared);
  if (err != cudaSuccess) return err;
  kernel<<<static_cast<unsigned int>(blocks), threads, smem_bytes, stream>>>(
      std::forward<Args>(args)...);
  return cudaGetLastError();
}

}  // namespace jax_flash::cuda::simt
