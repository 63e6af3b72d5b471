// Building blocks of the exact scalar (SIMT) attention kernels for float32 and float64: tile
// shapes per (dtype, head-dim capacity), vector shared-memory reads, zero-filling tile loads, the
// per-tile-pair use of the shared mask policy (common/mask.h), the score function, the checks and
// dispatch of the entry points and the launch helper. Every product is a plain FMA in the input
// precision (no tensor cores, no TF32) and exp/log are the full-precision library functions, so
// these files must be compiled without --use_fast_math (which would turn expf into __expf).
#pragma once

#include <cuda_runtime.h>
#include <math_constants.h>

#include <cmath>
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

// Blocks of `smem_bytes` of dynamic shared memory that fit one SM of the architecture being
// compiled (sm_90: 228 KB, sm_80: 164 KB; the system reserves 1 KB per block). Used as the
// minimum blocks per SM of a kernel's launch bounds where shared memory, not registers, should
// set the occupancy: ptxas's own register budget otherwise either spills under a budget tighter
// than needed or takes registers that cost a block per SM.
constexpr int blocks_per_sm(size_t smem_bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr size_t kSmemPerSm = 233472;
#else
  constexpr size_t kSmemPerSm = 167936;
#endif
  return static_cast<int>(kSmemPerSm / (smem_bytes + 1024));
}

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

// Rows of a tile of at most `size` rows that start `remaining` rows before the end of their span.
__host__ __device__ inline int tile_rows(int64_t remaining, int size) {
  return static_cast<int>(remaining < size ? remaining : size);
}

// The segment ids of one sequence of a dense batch, as the kernels read them: ids of its
// positions and their per-kSegmentChunk (min, max) ranges, all indexed by sequence-local
// position. All null without segment ids.
struct SeqSegments {
  const int32_t* q_ids = nullptr;
  const int32_t* kv_ids = nullptr;
  const int32_t* q_ranges = nullptr;
  const int32_t* kv_ranges = nullptr;

  __device__ __forceinline__ bool enabled() const { return q_ids != nullptr; }
};

__device__ __forceinline__ SeqSegments seq_segments(const SegmentIds& ids, const SeqSpan& span) {
  SeqSegments s;
  if (!ids.enabled()) return s;
  s.q_ids = ids.q_ids + span.batch * span.len_q;
  s.kv_ids = ids.kv_ids + span.batch * span.len_k;
  s.q_ranges = segment_row(ids.q_ranges, span.batch, span.len_q);
  s.kv_ranges = segment_row(ids.kv_ranges, span.batch, span.len_k);
  return s;
}

// What one (queries [r0, r1), keys [c0, c1)) tile pair of a sequence needs, for real rows and
// keys only (the caller accounts for its tiles' padding): `skip` when the pair shares no segment,
// `full` when every row sees every key (no element test), else an element test of the band and,
// when `ids`, of equal segment ids. The loops already stay inside the band, so only segment ids
// can make a pair skippable.
struct PairMask {
  bool skip;
  bool full;
  bool ids;
};

__device__ __forceinline__ PairMask pair_mask(const SeqMask& band, const SeqSegments& seg,
                                              int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  PairMask pm{false, band.tile_full(r0, r1, c0, c1), false};
  if (seg.enabled()) {
    const IdRange q = id_range(seg.q_ranges, r0, r1);
    const IdRange k = id_range(seg.kv_ranges, c0, c1);
    pm.skip = q.disjoint(k);
    pm.ids = !q.same_single(k);
    pm.full = pm.full && !pm.ids;
  }
  return pm;
}

// The band's element mask of the tile pair at (m0, n0), restricted to the n_rows keys actually
// loaded: zero-filled keys past them are never visible, whatever the band says.
__device__ __forceinline__ TileMask loaded_tile_mask(const SeqMask& band, int64_t m0, int64_t n0,
                                                     int n_rows) {
  TileMask tm = band.tile(m0, n0);
  tm.n_limit = tm.n_limit < n_rows ? tm.n_limit : n_rows;
  return tm;
}

// Copies the segment ids of tile-local positions [0, valid) to shared memory, 0 past them (those
// positions are masked anyway). Shared rather than register copies: the boundary tiles' element
// test then reads them after the tile's barrier, so the compiler cannot hoist their global loads
// above the dot products and keep them live there (that cost the forward a third of its
// occupancy).
template <int kThreads, int kSize>
__device__ __forceinline__ void load_ids(int32_t* dst, const int32_t* src, int valid) {
  for (int x = static_cast<int>(threadIdx.x); x < kSize; x += kThreads) {
    dst[x] = x < valid ? src[x] : 0;
  }
}

__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float tanh_full(float x) { return tanhf(x); }
__device__ __forceinline__ double tanh_full(double x) { return tanh(x); }

// The score of a raw dot product x = q.k: scale * x, or with soft-capping
// cap * tanh(x * (scale / cap)). The forward and both backward kernels evaluate this one function
// on the same x, so every pass sees bit-identical logits (see scaled_logit); `t` receives the
// tanh, whose 1 - t^2 is the backward's chain factor.
template <typename T, bool kSoftcap>
struct Score {
  T mul;  // scale, or scale / cap
  T cap;

  __device__ __forceinline__ static Score of(double softmax_scale, double softcap) {
    if constexpr (kSoftcap) {
      return {static_cast<T>(softmax_scale / softcap), static_cast<T>(softcap)};
    } else {
      return {static_cast<T>(softmax_scale), T(0)};
    }
  }
  __device__ __forceinline__ T operator()(T x, T& t) const {
    if constexpr (kSoftcap) {
      t = tanh_full(scaled_logit(x, mul));
      return mul_rn(cap, t);
    } else {
      t = T(0);
      return scaled_logit(x, mul);
    }
  }
};

// Checks what the kernels rely on and returns the params they run with; anything else is an
// error, never a silent fallback. Band bounds beyond kUnbounded mean the same as kUnbounded
// (positions are below 2^31) and are clamped to it so that no band arithmetic can overflow.
template <typename Params>
cudaError_t checked_params(const Params& p, Params& out) {
  const SeqLayout& l = p.layout;
  const MaskParams& m = p.mask;
  constexpr int64_t kMaxPos = INT32_MAX;
  if (!params_well_formed(p) || p.head_dim > kMaxHeadDim) return cudaErrorInvalidValue;
  const bool fits = l.varlen() ? l.total_q <= kMaxPos && l.total_k <= kMaxPos
                               : l.seqlen_q <= kMaxPos && l.seqlen_k <= kMaxPos;
  if (!fits) return cudaErrorInvalidValue;
  out = p;
  out.mask.band = m.band.clamped();
  return cudaSuccess;
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
// the params, then calls fn(checked params, T{}, std::integral_constant<int, kCap>{},
// std::bool_constant<kSoftcap>{}) for the element type T (float or double), the capacity bucket
// of head_dim and whether scores are soft-capped. Soft-capping is the one variant that is a
// template flag: it changes every score. The band, packed layouts, sinks and segment ids change
// only per-tile (uniform) decisions and the boundary tiles' element test, so the plain path pays
// nothing measurable for them at run time.
template <typename Params, typename Fn>
cudaError_t dispatch(const Params& params, DType dtype, Fn&& fn) {
  Params p;
  if (cudaError_t err = checked_params(params, p); err != cudaSuccess) return err;
  const auto by_softcap = [&](auto zero, auto cap) {
    if (p.mask.softcap == 0.0) return fn(p, zero, cap, std::false_type{});
    // Score multiplies by scale / cap and by cap in the element type: both must be normal there
    // (an overflowed factor would turn a zero dot product into NaN, an underflowed one every
    // score into 0).
    using T = decltype(zero);
    if (!std::isnormal(static_cast<T>(p.softmax_scale / p.mask.softcap)) ||
        !std::isnormal(static_cast<T>(p.mask.softcap))) {
      return cudaErrorInvalidValue;
    }
    return fn(p, zero, cap, std::true_type{});
  };
  const auto by_head_dim = [&](auto zero) {
    return dispatch_head_dim(p.head_dim, [&](auto cap) { return by_softcap(zero, cap); });
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
