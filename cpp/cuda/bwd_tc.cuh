// FlashAttention-2 backward on the tensor cores (mma.sync m16n8k16, ldmatrix, fp32 accumulation)
// for f16/bf16.
//
// One block owns one key/value tile K_j, V_j of kBlockN keys of one sequence (SeqLayout::tile) of
// one kv head. It keeps dK_j and dV_j in registers while it walks the query tiles Q_i (kBlockM
// rows) that may see it (SeqMask::row_begin/row_end; with segment ids, those whose id range meets
// the key tile's) for every query head of its GQA group, so dK/dV need no cross-block reduction
// and GQA needs no per-query-head copies. dQ_i, which every key tile contributes to, is
// accumulated with fp32 reductions into dq_accum and converted to T by a second small kernel.
// Per query tile (paper, Algorithm 2):
//   S = Q_i K_j^T, P = exp(scale * S - lse_i)   recomputed, never stored in global memory
//   dP = dO_i V_j^T, dS = P * (dP - delta_i)    delta_i = rowsum(dO_i * O_i) - dlse, from the
//   caller
//   dV_j += P^T dO_i, dK_j += dS^T Q_i, dQ_i += dS K_j
// P and dS make one round trip through shared memory in T because dV/dK consume them transposed.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>

#include "common/params.h"
#include "cuda/dq_convert.cuh"
#include "cuda/kernel_attributes.h"
#include "cuda/tc_primitives.cuh"

namespace jax_flash::cuda::bwd_tc {

// ---------------------------------------------------------------------------------------------
// Configuration

// Derives every tile, warp and shared-memory constant of one kernel configuration. Each of the
// five GEMMs spreads its output over the kNWarps warps as a (WarpsM x WarpsN) grid:
//   S, dP : [kBlockM x kBlockN], reduction over kHeadDim   (kSdPWarpsM warps along the queries)
//   dV, dK: [kBlockN x kHeadDim], reduction over kBlockM  (kdKVWarpsN warps along the keys)
//   dQ    : [kBlockM x kHeadDim], reduction over kBlockN  (kdQWarpsM warps along the queries),
//           computed kdQSplits column slices at a time to bound its accumulator registers.
template <int kRows, int kCols, int kWarpsRows, int kNWarps>
struct WarpGrid {
  static constexpr int kWarpsM = kWarpsRows;
  static constexpr int kWarpsN = kNWarps / kWarpsRows;
  static constexpr int kTileM = kRows / kWarpsM;
  static constexpr int kTileN = kCols / kWarpsN;
  static constexpr int kMi = kTileM / 16;  // m16 fragments per warp
  static constexpr int kNi = kTileN / 8;   // n8 fragments per warp
  static_assert(kNWarps % kWarpsRows == 0, "warps must tile the output");
  static_assert(kRows % (16 * kWarpsM) == 0 && kCols % (16 * kWarpsN) == 0,
                "warp tiles must be whole m16 x n16 fragments (B is loaded two n8 tiles at once)");
  __device__ static __forceinline__ int row0(int warp) { return (warp % kWarpsM) * kTileM; }
  __device__ static __forceinline__ int col0(int warp) { return (warp / kWarpsM) * kTileN; }
};

template <typename T_, int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kSdPWarpsM,
          int kdKVWarpsN, int kdQWarpsM, int kdQSplits_, bool kSdPDoubleBuffer_>
struct BwdTraits {
  using T = T_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kThreads = kNWarps * 32;
  static constexpr int kdQSplits = kdQSplits_;
  static constexpr bool kSdPDoubleBuffer = kSdPDoubleBuffer_;

  using SdP = WarpGrid<kBlockM, kBlockN, kSdPWarpsM, kNWarps>;
  using dKV = WarpGrid<kBlockN, kHeadDim, kdKVWarpsN, kNWarps>;
  using dQ = WarpGrid<kBlockM, kHeadDim / kdQSplits, kdQWarpsM, kNWarps>;

  // Shared memory, in bytes. Q, dO, lse and delta are double-buffered so the next query tile
  // streams in while the current one is computed; K and V are loaded once per block.
  static constexpr int kKVTileBytes = kBlockN * kHeadDim * 2;
  static constexpr int kQTileBytes = kBlockM * kHeadDim * 2;
  static constexpr int kPTileBytes = kBlockM * kBlockN * 2;
  static constexpr int kRowStatBytes = kBlockM * 4;
  static constexpr int kOffK = 0;
  static constexpr int kOffV = kOffK + kKVTileBytes;
  static constexpr int kOffQ = kOffV + kKVTileBytes;      // 2 stages
  static constexpr int kOffdO = kOffQ + 2 * kQTileBytes;  // 2 stages
  static constexpr int kOffP = kOffdO + 2 * kQTileBytes;
  static constexpr int kOffdS = kOffP + kPTileBytes;
  static constexpr int kOffLse = kOffdS + kPTileBytes;            // 2 stages
  static constexpr int kOffDelta = kOffLse + 2 * kRowStatBytes;   // 2 stages
  static constexpr int kOffInfo = kOffDelta + 2 * kRowStatBytes;  // BlockInfo
  static constexpr int kInfoBytes = 256;
  static constexpr int kOffKvIds = kOffInfo + kInfoBytes;  // kSegments: the key tile's ids
  static constexpr int kSmemBytes = kOffKvIds;
  static constexpr int smem_bytes(bool segments) {
    return kOffKvIds + (segments ? kBlockN * 4 : 0);
  }

  static_assert(kHeadDim % 64 == 0 && kBlockN % 64 == 0,
                "swizzled rows need at least eight 16-byte chunks");
  static_assert(kBlockM % 16 == 0 && kBlockM <= kThreads, "one thread per lse/delta row");
  static_assert((kBlockM * kHeadDim / 8) % kThreads == 0, "Q/dO tile copies must divide evenly");
  static_assert((kBlockN * kHeadDim / 8) % kThreads == 0, "K/V tile copies must divide evenly");
  static_assert(kHeadDim % kdQSplits == 0, "");
  static_assert(smem_bytes(true) <= 227 * 1024,
                "exceeds the largest shared-memory carve-out (Hopper)");
  static_assert(kHeadDim == 256 || smem_bytes(true) <= 163 * 1024,
                "d64 and d128 must fit A100's 163 KB");
};

// The configurations. All use 8 warps and one block per SM: the dK/dV accumulators alone take 64
// (d64) or 128 (d128, d256) registers per thread. Tiles are as large as registers and shared
// memory allow, so each operand byte read from shared memory feeds as many MMAs as possible, and
// the warp grids minimise the shared-memory bytes each GEMM reads.
//   d64 : 128 x 128. S/dP warp tiles 32 x 64, dK/dV 32 x 32, dQ 32 x 32. 162 KB smem.
//   d128:  64 x 128. S/dP 32 x 32, dK/dV 32 x 64, dQ 32 x 32 as two 32 x 16 column halves.
//          161 KB.
//   d256:  64 x  64. S/dP 32 x 16, dK/dV 32 x 64, dQ 32 x 64 as two 32 x 32 halves. 209 KB,
//          which needs Hopper's 227 KB (A100's 163 KB is too small: cudaFuncSetAttribute fails).
// Only the S/dP GEMMs of d256 double-buffer their fragments; elsewhere those registers are
// needed to keep ptxas from spilling (d128's dQ halves serve the same purpose).
template <typename T, int kHeadDim>
struct BwdConfig;
template <typename T>
struct BwdConfig<T, 64> {
  using Traits = BwdTraits<T, 64, 128, 128, 8, 4, 4, 4, 1, false>;
};
template <typename T>
struct BwdConfig<T, 128> {
  using Traits = BwdTraits<T, 128, 64, 128, 8, 2, 4, 2, 2, false>;
};
template <typename T>
struct BwdConfig<T, 256> {
  using Traits = BwdTraits<T, 256, 64, 64, 8, 2, 2, 2, 2, true>;
};

// What the kernels read; every derived scalar is computed on the host.
struct BwdArgs {
  const void* q;       // [rows_q, heads_q, D] (dense: [batch, seqlen_q, heads_q, D])
  const void* k;       // [rows_k, heads_kv, D]
  const void* v;       // [rows_k, heads_kv, D]
  const void* dout;    // [rows_q, heads_q, D]
  const float* lse;    // dense [batch, heads_q, seqlen_q], packed [heads_q, total_q]
  const float* delta;  // as lse
  void* dk;            // [rows_k, heads_kv, D]
  void* dv;            // [rows_k, heads_kv, D]
  float* dq_accum;     // [rows_q, heads_q, D]
  // [rows_q, heads_q, kDqCounters] counters that put each dQ tile's additions in key-tile order
  // (dq_convert.cuh); nullptr: atomics in any order. With segment ids every query tile of the
  // band is then visited, since the order counts key tiles by position, not by shared ids.
  int32_t* dq_semaphores;
  SeqLayout layout;
  Band band;            // read only by the kBand kernels
  SegmentIds segments;  // read only by the kSegments kernels (dense only)
  // Sequence positions and head indices fit in int (checked on the host); element offsets into
  // the tensors are formed in int64.
  int heads_q;
  int heads_kv;
  int group;  // heads_q / heads_kv
  // Units: (sequence, kv head) dense, kv head packed; levels: key tiles (of one sequence dense,
  // layout.tiles(kBlockN, true) packed).
  LaunchOrder order;
  float scale;       // softmax_scale, folded into dK at the end
  float scale_log2;  // base-2 multiplier of the score: softmax_scale * log2(e), or with a
                     // softcap c, c * log2(e) (the score is then tanh(cap_scale * q.k))
  float cap_scale;   // softmax_scale / c
};

// ---------------------------------------------------------------------------------------------
// Primitives

// The kernels address shared memory with 32-bit shared-window addresses rather than 64-bit generic
// pointers: inside the main loop every register counts, and this keeps one per address. The
// wrappers taking them are tc_primitives.cuh's.
using tc::cp_async_16;
using tc::cp_async_4;
using tc::ld_shared_b128;
using tc::ld_shared_f32;
using tc::ld_shared_s32;
using tc::ld_shared_s64;
using tc::ld_shared_u32;
using tc::ld_shared_v2s32;
using tc::st_shared_s64;
using tc::st_shared_u32;

// ---------------------------------------------------------------------------------------------
// Shared-memory tiles

// A row-major tile of 16-bit elements, kCols per row. The 16-byte chunk c of row r is stored at
// chunk position c ^ (r % 8). Every ldmatrix phase reads the same logical chunk of 8 consecutive
// rows (and every fragment store writes one chunk of 8 consecutive rows), which the XOR spreads
// over all 32 banks; cp.async writes whole rows, which the XOR only permutes.
template <int kCols>
__device__ __forceinline__ int swz(int row, int col) {
  return row * kCols + ((((col >> 3) ^ row) & 7) | ((col >> 3) & ~7)) * 8 + (col & 7);
}

// Copies a [kRows x kHeadDim] tile whose row r starts at gmem + r * row_stride into the swizzled
// tile at shared address `tile`; rows at or past `rows_valid` become zeros.
template <int kRows, int kHeadDim, int kThreads, typename T>
__device__ __forceinline__ void load_tile(uint32_t tile, const T* gmem, int64_t row_stride,
                                          int rows_valid, int tid) {
  constexpr int kChunksPerRow = kHeadDim / 8;
  static_assert((kRows * kChunksPerRow) % kThreads == 0, "");
#pragma unroll
  for (int i = 0; i < kRows * kChunksPerRow / kThreads; ++i) {
    const int c = tid + i * kThreads;
    const int row = c / kChunksPerRow;
    const int col = (c % kChunksPerRow) * 8;
    const bool valid = row < rows_valid;
    const T* src = gmem + (valid ? row * row_stride + col : 0);
    cp_async_16(tile + 2 * swz<kHeadDim>(row, col), src, valid);
  }
}

// ---------------------------------------------------------------------------------------------
// Warp-level GEMM

// Moves a lane's ldmatrix address in a swizzled tile by d_rows rows (a multiple of 8, so the
// swizzle pattern is unchanged) and d_chunks 16-byte chunks, both compile-time after unrolling.
// Writing the chunk step as an XOR is exact because the lane's own chunk bits never overlap the
// low bits of d_chunks (warp tiles are powers of two and aligned to their size). It keeps one
// address register per operand: each step is one LOP3 plus the instruction's immediate offset.
template <int kCols>
__device__ __forceinline__ uint32_t swz_step(uint32_t lane_addr, int d_rows, int d_chunks) {
  return (lane_addr ^ ((d_chunks & 7) << 4)) + (d_chunks >> 3) * 128 + d_rows * kCols * 2;
}

// acc[i][j] (the 16 x 8 tile at rows m0 + 16 i, columns n0 + 8 j) += A * B over k in [0, kK).
// A is [M x kK]: stored row-major as [m][k] (kATrans = false) or as its transpose [k][m]
// (kATrans = true, e.g. P^T from the row-major P). B is [kK x N]: stored as [n][k] (kBTrans =
// false, e.g. K for Q K^T) or as [k][n] (kBTrans = true, e.g. dO for P^T dO). sA and sB are
// shared-memory byte addresses of swizzled tiles. With kDoubleBuffer the fragments of step k+1 are
// loaded while the MMAs of step k run; without it they cost no extra registers (for GEMMs issued
// while the most accumulators are live, where the other warps hide the ldmatrix latency).
//
// ldmatrix x4: lane l supplies the row address of matrix l / 8. For A the four matrices are
// (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15), i.e. the a0..a3
// registers of the m16n8k16 A fragment. For B they are (n 0-7, k 0-7), (n 0-7, k 8-15),
// (n 8-15, k 0-7), (n 8-15, k 8-15): the b0, b1 registers of two adjacent n8 tiles. The .trans
// forms serve operands stored with k along the rows.
template <typename T, int kMi, int kNi, int kK, int kACols, bool kATrans, int kBCols, bool kBTrans,
          bool kDoubleBuffer>
struct WarpGemm {
  static_assert(kNi % 2 == 0 && kK % 16 == 0, "");
  static_assert((kMi & (kMi - 1)) == 0 && (kNi & (kNi - 1)) == 0,
                "swz_step needs power-of-two warp tiles");
  static constexpr int kSteps = kK / 16;

  __device__ static __forceinline__ uint32_t lane_addr_a(uint32_t sA, int m0, int lane) {
    if constexpr (kATrans) {
      return sA + 2 * swz<kACols>((lane & 7) + ((lane >> 4) << 3), m0 + (((lane >> 3) & 1) << 3));
    } else {
      return sA + 2 * swz<kACols>(m0 + (lane & 15), (lane >> 4) << 3);
    }
  }
  __device__ static __forceinline__ uint32_t lane_addr_b(uint32_t sB, int n0, int lane) {
    if constexpr (kBTrans) {
      return sB + 2 * swz<kBCols>(lane & 15, n0 + ((lane >> 4) << 3));
    } else {
      return sB + 2 * swz<kBCols>(n0 + (lane & 7) + ((lane >> 4) << 3), ((lane >> 3) & 1) << 3);
    }
  }

  __device__ static __forceinline__ void load_a(uint32_t (&a)[kMi][4], uint32_t addr, int ks) {
#pragma unroll
    for (int i = 0; i < kMi; ++i) {
      if constexpr (kATrans) {
        tc::ldmatrix_x4_trans(a[i], swz_step<kACols>(addr, ks * 16, i * 2));
      } else {
        tc::ldmatrix_x4(a[i], swz_step<kACols>(addr, i * 16, ks * 2));
      }
    }
  }

  __device__ static __forceinline__ void load_b(uint32_t (&b)[kNi][2], uint32_t addr, int ks) {
#pragma unroll
    for (int j = 0; j < kNi; j += 2) {
      uint32_t r[4];
      if constexpr (kBTrans) {
        tc::ldmatrix_x4_trans(r, swz_step<kBCols>(addr, ks * 16, j));
      } else {
        tc::ldmatrix_x4(r, swz_step<kBCols>(addr, j * 8, ks * 2));
      }
      b[j][0] = r[0];
      b[j][1] = r[1];
      b[j + 1][0] = r[2];
      b[j + 1][1] = r[3];
    }
  }

  __device__ static __forceinline__ void run(float (&acc)[kMi][kNi][4], uint32_t sA, int m0,
                                             uint32_t sB, int n0, int lane) {
    const uint32_t addr_a = lane_addr_a(sA, m0, lane);
    const uint32_t addr_b = lane_addr_b(sB, n0, lane);
    constexpr int kBufs = kDoubleBuffer ? 2 : 1;
    uint32_t a[kBufs][kMi][4];
    uint32_t b[kBufs][kNi][2];
    if constexpr (kDoubleBuffer) {
      load_a(a[0], addr_a, 0);
      load_b(b[0], addr_b, 0);
    }
#pragma unroll
    for (int ks = 0; ks < kSteps; ++ks) {
      const int buf = kDoubleBuffer ? ks & 1 : 0;
      if constexpr (kDoubleBuffer) {
        if (ks + 1 < kSteps) {
          load_a(a[buf ^ 1], addr_a, ks + 1);
          load_b(b[buf ^ 1], addr_b, ks + 1);
        }
      } else {
        load_a(a[0], addr_a, ks);
        load_b(b[0], addr_b, ks);
      }
#pragma unroll
      for (int i = 0; i < kMi; ++i) {
#pragma unroll
        for (int j = 0; j < kNi; ++j) tc::mma_16816<T>(acc[i][j], a[buf][i], b[buf][j]);
      }
    }
  }
};

template <int kMi, int kNi>
__device__ __forceinline__ void zero(float (&acc)[kMi][kNi][4]) {
#pragma unroll
  for (int i = 0; i < kMi; ++i) {
#pragma unroll
    for (int j = 0; j < kNi; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;
    }
  }
}

// Writes an accumulator tile (m16n8 C layout: lane holds rows lane/4 and lane/4 + 8, columns
// 2 (lane % 4) + {0, 1}) into the swizzled smem tile at byte address `tile` as T, times `mul`.
template <typename T, int kCols, int kMi, int kNi>
__device__ __forceinline__ void store_acc(uint32_t tile, const float (&acc)[kMi][kNi][4], int m0,
                                          int n0, float mul, int lane) {
  static_assert((kNi & (kNi - 1)) == 0, "swz_step needs power-of-two warp tiles");
  const uint32_t addr = tile + 2 * swz<kCols>(m0 + (lane >> 2), n0 + (lane & 3) * 2);
#pragma unroll
  for (int i = 0; i < kMi; ++i) {
#pragma unroll
    for (int j = 0; j < kNi; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        st_shared_u32(swz_step<kCols>(addr, i * 16 + h * 8, j),
                      tc::pack2<T>(acc[i][j][2 * h] * mul, acc[i][j][2 * h + 1] * mul));
      }
    }
  }
}

// Returns x unchanged but opaque to the compiler. Lane-dependent offsets derived from it inside
// the main loop are then recomputed each iteration (a few integer ops) instead of being hoisted
// out of the loop, where dozens of them would stay live next to the dK/dV accumulators and spill.
__device__ __forceinline__ uint32_t opaque(uint32_t x) {
  asm volatile("mov.b32 %0, %1;\n" : "=r"(x) : "r"(x));
  return x;
}

// ---------------------------------------------------------------------------------------------
// Schedule

// Where the block's key tile lives and which query tiles it visits: computed once in the
// prologue (the packed lookup is a binary search over cu_seqlens) and read back in every phase
// with opaque shared loads, so that none of it stays in registers next to the dK/dV accumulators.
struct BlockInfo {
  int64_t q_start;     // first row of the sequence in the [rows_q, heads_q, D] views
  int64_t k_start;     // first row in the [rows_k, heads_kv, D] views
  int64_t stat_start;  // lse/delta of (query head h, row i) at stat_start + h * stat_head + i
  int64_t stat_head;
  int len_q;
  int len_k;
  int n0;  // first key of the block's tile, sequence-local
  int head_kv;
  int m_begin;  // query tiles [m_begin, m_end) hold every row that may see the key tile
  int m_end;
  int batch;  // dense batch row (segment ids)
  int kv_lo;  // id range of the key tile (segment ids)
  int kv_hi;
  // Segment ids, per Q/dO stage: the iteration index (see IterCoord) of the tile in that stage,
  // and whether the pair needs no segment element mask.
  int pos[2];
  int single[2];
  // Segment ids, one per warp: which of 32 consecutive query tiles from `base` share an id with
  // the key tile (bit i: tile base + i), and which of those hold one and the same single id.
  struct Window {
    int base;
    uint32_t seen;
    uint32_t single;
    int pad;
  } window[8];
};

// Opaque reads of the BlockInfo at shared address `addr`.
struct Info {
  uint32_t addr;
  __device__ int64_t q_start() const { return ld_shared_s64(addr + offsetof(BlockInfo, q_start)); }
  __device__ int64_t k_start() const { return ld_shared_s64(addr + offsetof(BlockInfo, k_start)); }
  __device__ int64_t stat_start() const {
    return ld_shared_s64(addr + offsetof(BlockInfo, stat_start));
  }
  __device__ int64_t stat_head() const {
    return ld_shared_s64(addr + offsetof(BlockInfo, stat_head));
  }
  __device__ int len_q() const { return ld_shared_s32(addr + offsetof(BlockInfo, len_q)); }
  __device__ int len_k() const { return ld_shared_s32(addr + offsetof(BlockInfo, len_k)); }
  __device__ int n0() const { return ld_shared_s32(addr + offsetof(BlockInfo, n0)); }
  __device__ int head_kv() const { return ld_shared_s32(addr + offsetof(BlockInfo, head_kv)); }
  __device__ int m_begin() const { return ld_shared_s32(addr + offsetof(BlockInfo, m_begin)); }
  __device__ int m_end() const { return ld_shared_s32(addr + offsetof(BlockInfo, m_end)); }
  __device__ int batch() const { return ld_shared_s32(addr + offsetof(BlockInfo, batch)); }
  __device__ IdRange kv_range() const {
    return {ld_shared_s32(addr + offsetof(BlockInfo, kv_lo)),
            ld_shared_s32(addr + offsetof(BlockInfo, kv_hi))};
  }
  __device__ uint32_t pos_addr(int stage) const {
    return addr + offsetof(BlockInfo, pos) + 4 * stage;
  }
  __device__ uint32_t single_addr(int stage) const {
    return addr + offsetof(BlockInfo, single) + 4 * stage;
  }
  __device__ uint32_t window_addr(int warp) const {
    return addr + offsetof(BlockInfo, window) + sizeof(BlockInfo::Window) * warp;
  }
};

// The smallest query tile in [m, m_end) whose segment ids meet the key tile's (kv_range), or
// m_end. Every lane of the calling warp takes part; the warp's Window caches the answer for 32
// candidate tiles per ballot, so a run of disjoint tiles costs one round trip, not one per tile.
// Returns the tile's "one single id on both sides" bit through `single`.
template <int kBlockM>
__device__ __forceinline__ int find_query_tile(const BwdArgs& args, uint32_t window, int m,
                                               int m_end, int len_q, int batch, IdRange kv_range,
                                               bool& single) {
  const int lane = threadIdx.x % 32;
  const uint32_t base_addr = window + offsetof(BlockInfo::Window, base);
  const uint32_t seen_addr = window + offsetof(BlockInfo::Window, seen);
  const uint32_t single_addr = window + offsetof(BlockInfo::Window, single);
  if (args.dq_semaphores != nullptr) {
    // The deterministic order visits every tile (a disjoint one adds zeros).
    single = false;
    return m < m_end ? m : m_end;
  }
  while (m < m_end) {
    int base = ld_shared_s32(base_addr);
    if (m < base || m > base + 31) {
      base = m;
      const int cand = m + lane;
      bool cand_seen = false;
      bool cand_single = false;
      if (cand < m_end) {
        const IdRange r = id_range_fixed<kBlockM / kSegmentChunk>(
            segment_row(args.segments.q_ranges, batch, args.layout.seqlen_q),
            static_cast<int64_t>(cand) * kBlockM, min((cand + 1) * kBlockM, len_q));
        cand_seen = !r.disjoint(kv_range);
        cand_single = r.same_single(kv_range);
      }
      const uint32_t seen_mask = __ballot_sync(0xffffffffu, cand_seen);
      const uint32_t single_mask = __ballot_sync(0xffffffffu, cand_single);
      // Every lane stores the same words; the warp barriers order them after every lane's reads
      // of the old window and before every lane's reads of the new one (a ballot converges the
      // lanes but does not order their shared-memory accesses).
      __syncwarp();
      st_shared_u32(base_addr, static_cast<uint32_t>(base));
      st_shared_u32(seen_addr, seen_mask);
      st_shared_u32(single_addr, single_mask);
      __syncwarp();
    }
    const uint32_t above = ld_shared_u32(seen_addr) & (0xffffffffu << (m - base));
    if (above != 0) {
      const int found = base + __ffs(above) - 1;
      single = ((ld_shared_u32(single_addr) >> (found - base)) & 1u) != 0;
      return found;
    }
    m = base + 32;
  }
  single = false;
  return m_end;
}

// Where the query rows of one sequence live (what a query-tile copy needs).
struct QuerySpan {
  int64_t q_start;
  int64_t stat_start;
  int64_t stat_head;
  int len_q;
};

// ---------------------------------------------------------------------------------------------
// Kernels

// Issues the cp.async copies of Q_i, dO_i, lse_i and delta_i of query tile m_block of `head`.
// Rows past the sequence's end are zero-filled and never read: that is what keeps a packed
// neighbour's rows (and any NaN in them) out of this sequence's gradients.
template <typename Tr>
__device__ __forceinline__ void load_query_tile(const BwdArgs& args, const QuerySpan& qs, int head,
                                                int m_block, int stage, uint32_t smem, int tid) {
  using T = typename Tr::T;
  const int row0 = m_block * Tr::kBlockM;
  const int rows_valid = qs.len_q - row0;
  const int64_t row_stride = static_cast<int64_t>(args.heads_q) * Tr::kHeadDim;
  const int64_t offset =
      (qs.q_start + row0) * row_stride + static_cast<int64_t>(head) * Tr::kHeadDim;
  load_tile<Tr::kBlockM, Tr::kHeadDim, Tr::kThreads>(smem + Tr::kOffQ + stage * Tr::kQTileBytes,
                                                     static_cast<const T*>(args.q) + offset,
                                                     row_stride, rows_valid, tid);
  load_tile<Tr::kBlockM, Tr::kHeadDim, Tr::kThreads>(smem + Tr::kOffdO + stage * Tr::kQTileBytes,
                                                     static_cast<const T*>(args.dout) + offset,
                                                     row_stride, rows_valid, tid);
  if (tid < Tr::kBlockM) {
    const bool valid = tid < rows_valid;
    const int64_t stat = qs.stat_start + head * qs.stat_head + row0 + (valid ? tid : 0);
    cp_async_4(smem + Tr::kOffLse + stage * Tr::kRowStatBytes + tid * 4, args.lse + stat, valid);
    cp_async_4(smem + Tr::kOffDelta + stage * Tr::kRowStatBytes + tid * 4, args.delta + stat,
               valid);
  }
}

// Coordinates of iteration index `it` of this block: the indices walk the query tiles
// [m_begin, m_end) of each query head of the GQA group in turn. Without segment ids the k-th
// iteration of the main loop has index k; with them, indices of tiles that share no id with the
// key tile are skipped, and BlockInfo::pos holds the index of each stage's tile.
struct IterCoord {
  bool valid;  // it names an iteration of this block
  int head;    // query head
  int m_block;
  __device__ IterCoord(const BwdArgs& args, const Info& info, int it) {
    const int m_begin = info.m_begin();
    const int num_m = info.m_end() - m_begin;
    valid = it < max(num_m, 0) * args.group;
    const int head_step = valid ? it / num_m : 0;
    m_block = m_begin + (it - head_step * num_m);
    head = info.head_kv() * args.group + head_step;
  }
};

// kBand: a sliding window or causal band (without it only the sequence end masks). kSegments:
// segment ids (implies kBand). kSoftcap: s = c * tanh(scale * q.k / c).
template <typename Tr, bool kBand, bool kSegments, bool kSoftcap>
__global__ void __launch_bounds__(Tr::kThreads, 1) bwd_main_kernel(const BwdArgs args) {
  static_assert(kBand || !kSegments, "segment ids run on the band kernels");
  static_assert(Tr::kNWarps <= 8, "BlockInfo holds 8 segment windows");
  using T = typename Tr::T;
  using SdP = typename Tr::SdP;
  using dKV = typename Tr::dKV;
  using dQ = typename Tr::dQ;
  constexpr int kBlockM = Tr::kBlockM;
  constexpr int kBlockN = Tr::kBlockN;
  constexpr int kD = Tr::kHeadDim;
  static_assert(sizeof(BlockInfo) <= Tr::kInfoBytes, "");

  extern __shared__ __align__(128) unsigned char smem[];

  // Only the dK/dV accumulators and the iteration counter live across the main loop: everything
  // else is derived again inside it (and in the epilogue) from the BlockInfo in shared memory and
  // opaque() copies of threadIdx, which costs a few integer ops per iteration and keeps ptxas from
  // parking block scalars in registers (or spilling them) next to 128+ accumulator registers.
  int k = 0;  // main-loop iterations done; iteration k uses Q/dO stage k & 1
  {
    const uint32_t smem_base = tc::smem_addr(smem);
    const int tid = threadIdx.x;
    // Key tiles of one kv head go in the launch order of LaunchOrder (common/schedule.h), so
    // that co-resident blocks share the same Q, dO and dq_accum rows in L2; dense units are
    // (sequence, kv head).
    const CtaWork work = args.order.work(
        args.layout, blockIdx.x, dq_launch_reversed(args.dq_semaphores != nullptr), kBlockN, true);
    const int head_kv = static_cast<int>(work.head);
    const SeqTile& tile = work.tile;
    if (tile.empty(kBlockN, true)) return;
    const SeqSpan& span = tile.span;
    const int len_q = static_cast<int>(span.len_q);
    const int len_k = static_cast<int>(span.len_k);
    const int n0 = static_cast<int>(tile.block) * kBlockN;
    const int n1 = min(n0 + kBlockN, len_k);
    // Query rows [row_begin, row_end) may see some key of the tile; without kBand the band is
    // unbounded at compile time.
    const SeqMask mask = (kBand ? args.band : Band{}).for_seq(span.len_q, span.len_k);
    const int row_begin = static_cast<int>(mask.row_begin(n0));
    const int row_end = static_cast<int>(mask.row_end(n1));
    const int m_begin = row_begin / kBlockM;
    const int m_end = row_begin < row_end ? (row_end + kBlockM - 1) / kBlockM : m_begin;
    const int batch = static_cast<int>(span.batch);
    const Info info{smem_base + Tr::kOffInfo};

    // With segment ids the first query tile is the first one that shares an id with the key tile.
    int m_first = m_begin;
    bool single = false;
    IdRange kv_range{0, 0};
    if constexpr (kSegments) {
      kv_range = id_range_fixed<kBlockN / kSegmentChunk>(
          segment_row(args.segments.kv_ranges, batch, args.layout.seqlen_k), n0, n1);
      const uint32_t window = info.window_addr(tid / 32);
      st_shared_u32(window + offsetof(BlockInfo::Window, base), static_cast<uint32_t>(-64));
      __syncwarp();  // every lane's store before any lane's read
      m_first =
          find_query_tile<kBlockM>(args, window, m_begin, m_end, len_q, batch, kv_range, single);
    }
    const int it_first = m_first < m_end ? m_first - m_begin : (m_end - m_begin) * args.group;

    if (tid == 0) {
      st_shared_s64(info.addr + offsetof(BlockInfo, q_start), span.q_start);
      st_shared_s64(info.addr + offsetof(BlockInfo, k_start), span.k_start);
      st_shared_s64(info.addr + offsetof(BlockInfo, stat_start), span.stat_start);
      st_shared_s64(info.addr + offsetof(BlockInfo, stat_head), span.stat_head);
      st_shared_u32(info.addr + offsetof(BlockInfo, len_q), len_q);
      st_shared_u32(info.addr + offsetof(BlockInfo, len_k), len_k);
      st_shared_u32(info.addr + offsetof(BlockInfo, n0), n0);
      st_shared_u32(info.addr + offsetof(BlockInfo, head_kv), head_kv);
      st_shared_u32(info.addr + offsetof(BlockInfo, m_begin), m_begin);
      st_shared_u32(info.addr + offsetof(BlockInfo, m_end), m_end);
      st_shared_u32(info.addr + offsetof(BlockInfo, batch), batch);
      st_shared_u32(info.addr + offsetof(BlockInfo, kv_lo), kv_range.lo);
      st_shared_u32(info.addr + offsetof(BlockInfo, kv_hi), kv_range.hi);
      st_shared_u32(info.pos_addr(0), static_cast<uint32_t>(it_first));
      st_shared_u32(info.single_addr(0), single ? 1u : 0u);
    }
    if (m_first < m_end) {
      const int64_t kv_row_stride = static_cast<int64_t>(args.heads_kv) * kD;
      const int64_t kv_offset =
          (span.k_start + n0) * kv_row_stride + static_cast<int64_t>(head_kv) * kD;
      load_tile<kBlockN, kD, Tr::kThreads>(smem_base + Tr::kOffK,
                                           static_cast<const T*>(args.k) + kv_offset, kv_row_stride,
                                           len_k - n0, tid);
      load_tile<kBlockN, kD, Tr::kThreads>(smem_base + Tr::kOffV,
                                           static_cast<const T*>(args.v) + kv_offset, kv_row_stride,
                                           len_k - n0, tid);
      if constexpr (kSegments) {
        if (tid < kBlockN) {
          const bool valid = n0 + tid < len_k;
          const int32_t* kv_ids = args.segments.kv_ids + batch * args.layout.seqlen_k;
          cp_async_4(smem_base + Tr::kOffKvIds + 4 * tid, kv_ids + (valid ? n0 + tid : 0), valid);
        }
      }
      const QuerySpan qs{span.q_start, span.stat_start, span.stat_head, len_q};
      load_query_tile<Tr>(args, qs, head_kv * args.group, m_first, 0, smem_base, tid);
    }
    tc::cp_async_commit();
    // Publishes the BlockInfo, which the first iteration reads before its barrier.
    __syncthreads();
  }

  float acc_dv[dKV::kMi][dKV::kNi][4];
  float acc_dk[dKV::kMi][dKV::kNi][4];
  zero(acc_dv);
  zero(acc_dk);

  // Each phase of an iteration re-derives the coordinates it needs (IterCoord, lane/warp, shared
  // addresses) rather than keeping them live from the top of the iteration.
  for (;; ++k) {
    {
      const int stage = k & 1;
      const Info info{opaque(tc::smem_addr(smem)) + Tr::kOffInfo};
      const int it = kSegments ? ld_shared_s32(info.pos_addr(stage)) : k;
      const IterCoord ic(args, info, it);
      if (!ic.valid) break;
      const int tid = static_cast<int>(opaque(threadIdx.x));
      // The iteration after this one; with segment ids the next query tile that shares an id
      // with the key tile (its warp-uniform search reads and writes only this warp's Window).
      int it_next = it + 1;
      bool next_single = false;
      if constexpr (kSegments) {
        const int m_begin = info.m_begin();
        const int m_end = info.m_end();
        const int num_m = m_end - m_begin;
        const int len_q = info.len_q();
        const int batch = info.batch();
        const IdRange kv_range = info.kv_range();
        const uint32_t window = info.window_addr(tid / 32);
        const int head_step = it / num_m;
        int m = find_query_tile<kBlockM>(args, window, ic.m_block + 1, m_end, len_q, batch,
                                         kv_range, next_single);
        it_next = head_step * num_m + (m - m_begin);
        if (m >= m_end) {
          it_next = num_m * args.group;
          if (head_step + 1 < args.group) {
            m = find_query_tile<kBlockM>(args, window, m_begin, m_end, len_q, batch, kv_range,
                                         next_single);
            it_next = (head_step + 1) * num_m + (m - m_begin);
          }
        }
      }
      // Barrier A: this stage's copies have landed for every thread, and every warp is done with
      // the previous iteration, i.e. with sP, sdS, the other Q/dO stage and the other stage's
      // BlockInfo flags, which are now free.
      tc::cp_async_wait<0>();
      __syncthreads();
      if constexpr (kSegments) {
        if (tid == 0) {
          st_shared_u32(info.pos_addr(stage ^ 1), static_cast<uint32_t>(it_next));
          st_shared_u32(info.single_addr(stage ^ 1), next_single ? 1u : 0u);
        }
      }
      const IterCoord next(args, info, it_next);
      if (next.valid) {
        const QuerySpan qs{info.q_start(), info.stat_start(), info.stat_head(), info.len_q()};
        load_query_tile<Tr>(args, qs, next.head, next.m_block, stage ^ 1,
                            opaque(tc::smem_addr(smem)), tid);
      }
      tc::cp_async_commit();
    }

    // S = Q K^T, then P. A row past the sequence's end, or one that saw no key (lse = -inf),
    // gets an exponent bias of -inf so its P is exactly 0 rather than inf or NaN. Masked entries
    // (the band's edges, keys past the sequence's end, other segments) are zeroed, by select, on
    // the tiles that SeqMask does not prove full. P goes to shared memory as T for the dV GEMM and
    // stays in registers as f16 pairs for dS: half the registers of fp32 at the point where the
    // dP accumulators join dK/dV, and for P in [0, 1] f16 is 4x more precise than the bf16
    // rounding dS gets anyway. With soft-capping the score is t = tanh(scale * q.k / c); the dP
    // phase needs 1 - t^2, which waits in the (still unused) dS tile, as f16, at the very
    // positions where this thread later writes dS.
    using GemmSdP = WarpGemm<T, SdP::kMi, SdP::kNi, kD, kD, false, kD, false, Tr::kSdPDoubleBuffer>;
    __half2 p_f16[SdP::kMi][SdP::kNi][2];
    {
      const int stage = k & 1;
      const uint32_t base = opaque(tc::smem_addr(smem));
      const Info info{base + Tr::kOffInfo};
      const IterCoord ic(args, info, kSegments ? ld_shared_s32(info.pos_addr(stage)) : k);
      const int tid = static_cast<int>(opaque(threadIdx.x));
      const int warp = tid / 32;
      const int lane = tid % 32;
      const int sdp_m0 = SdP::row0(warp);
      const int sdp_n0 = SdP::col0(warp);
      float acc_s[SdP::kMi][SdP::kNi][4];
      zero(acc_s);
      GemmSdP::run(acc_s, base + Tr::kOffQ + stage * Tr::kQTileBytes, sdp_m0, base + Tr::kOffK,
                   sdp_n0, lane);

      if constexpr (kSoftcap) {
        const uint32_t lane_ds =
            base + Tr::kOffdS + 2 * swz<kBlockN>(sdp_m0 + (lane >> 2), sdp_n0 + (lane & 3) * 2);
#pragma unroll
        for (int i = 0; i < SdP::kMi; ++i) {
#pragma unroll
          for (int j = 0; j < SdP::kNi; ++j) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const float t0 = tc::fast_tanh(acc_s[i][j][2 * h] * args.cap_scale);
              const float t1 = tc::fast_tanh(acc_s[i][j][2 * h + 1] * args.cap_scale);
              acc_s[i][j][2 * h] = t0;
              acc_s[i][j][2 * h + 1] = t1;
              const __half2 dt = __floats2half2_rn(1.f - t0 * t0, 1.f - t1 * t1);
              st_shared_u32(swz_step<kBlockN>(lane_ds, i * 16 + h * 8, j),
                            *reinterpret_cast<const uint32_t*>(&dt));
            }
          }
        }
      }

      const int row0 = ic.m_block * kBlockM;
      const int len_q = info.len_q();
      const int n0 = info.n0();
      const SeqMask mask = (kBand ? args.band : Band{}).for_seq(len_q, info.len_k());
      const bool need_mask = !mask.tile_full(row0, min(row0 + kBlockM, len_q), n0, n0 + kBlockN);
      const TileMask tm = mask.tile(row0, n0);
      bool seg_mask = false;
      const int32_t* q_ids = nullptr;
      if constexpr (kSegments) {
        seg_mask = ld_shared_s32(info.single_addr(stage)) == 0;
        q_ids = args.segments.q_ids + info.batch() * args.layout.seqlen_q + row0;
      }
      const uint32_t lse_addr = base + Tr::kOffLse + stage * Tr::kRowStatBytes;
      const uint32_t lane_p =
          base + Tr::kOffP + 2 * swz<kBlockN>(sdp_m0 + (lane >> 2), sdp_n0 + (lane & 3) * 2);
#pragma unroll
      for (int i = 0; i < SdP::kMi; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = sdp_m0 + i * 16 + (lane >> 2) + h * 8;
          const float lse = ld_shared_f32(lse_addr + 4 * r);
          const bool live = row0 + r < len_q && lse != -INFINITY;
          const float bias = live ? -lse * static_cast<float>(M_LOG2E) : -INFINITY;
          // Columns of this tile outside [lo, hi) are masked for this row.
          int lo = 0;
          int hi = kBlockN;
          if (need_mask) {
            lo = kBand ? tm.lo(r) : 0;
            hi = kBand ? tm.hi(r) : tm.n_limit;
          }
          int32_t q_id = 0;
          if constexpr (kSegments) {
            if (seg_mask && live) q_id = q_ids[r];
          }
#pragma unroll
          for (int j = 0; j < SdP::kNi; ++j) {
            const int c = sdp_n0 + j * 8 + (lane & 3) * 2;
            int2 kv_id = make_int2(0, 0);
            if constexpr (kSegments) {
              if (seg_mask) kv_id = ld_shared_v2s32(base + Tr::kOffKvIds + 4 * c);
            }
            float p[2];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              p[e] = tc::fast_exp2(fmaf(acc_s[i][j][2 * h + e], args.scale_log2, bias));
              if ((kBand && c + e < lo) || c + e >= hi) p[e] = 0.f;
              if constexpr (kSegments) {
                if ((e == 0 ? kv_id.x : kv_id.y) != q_id) p[e] = 0.f;
              }
            }
            p_f16[i][j][h] = __floats2half2_rn(p[0], p[1]);
            st_shared_u32(swz_step<kBlockN>(lane_p, i * 16 + h * 8, j), tc::pack2<T>(p[0], p[1]));
          }
        }
      }
    }

    // dP = dO V^T, dS = P * (dP - delta) (times 1 - t^2 with soft-capping).
    {
      const int stage = k & 1;
      const int tid = static_cast<int>(opaque(threadIdx.x));
      const int warp = tid / 32;
      const int lane = tid % 32;
      const uint32_t base = opaque(tc::smem_addr(smem));
      const int sdp_m0 = SdP::row0(warp);
      const int sdp_n0 = SdP::col0(warp);
      float acc_dp[SdP::kMi][SdP::kNi][4];
      zero(acc_dp);
      GemmSdP::run(acc_dp, base + Tr::kOffdO + stage * Tr::kQTileBytes, sdp_m0, base + Tr::kOffV,
                   sdp_n0, lane);
      const uint32_t delta_addr = base + Tr::kOffDelta + stage * Tr::kRowStatBytes;
      const uint32_t lane_ds =
          base + Tr::kOffdS + 2 * swz<kBlockN>(sdp_m0 + (lane >> 2), sdp_n0 + (lane & 3) * 2);
#pragma unroll
      for (int i = 0; i < SdP::kMi; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float delta =
              ld_shared_f32(delta_addr + 4 * (sdp_m0 + i * 16 + (lane >> 2) + h * 8));
#pragma unroll
          for (int j = 0; j < SdP::kNi; ++j) {
            const float2 p = __half22float2(p_f16[i][j][h]);
            acc_dp[i][j][2 * h] = p.x * (acc_dp[i][j][2 * h] - delta);
            acc_dp[i][j][2 * h + 1] = p.y * (acc_dp[i][j][2 * h + 1] - delta);
            if constexpr (kSoftcap) {
              const uint32_t bits = ld_shared_u32(swz_step<kBlockN>(lane_ds, i * 16 + h * 8, j));
              const float2 dt = __half22float2(*reinterpret_cast<const __half2*>(&bits));
              acc_dp[i][j][2 * h] *= dt.x;
              acc_dp[i][j][2 * h + 1] *= dt.y;
            }
          }
        }
      }
      store_acc<T, kBlockN>(base + Tr::kOffdS, acc_dp, sdp_m0, sdp_n0, 1.f, lane);
    }
    // Barrier B: P and dS are complete.
    __syncthreads();

    // dV += P^T dO, dK += dS^T Q.
    {
      const int stage = k & 1;
      const int tid = static_cast<int>(opaque(threadIdx.x));
      const int warp = tid / 32;
      const int lane = tid % 32;
      const uint32_t base = opaque(tc::smem_addr(smem));
      using GemmdKV = WarpGemm<T, dKV::kMi, dKV::kNi, kBlockM, kBlockN, true, kD, true, true>;
      GemmdKV::run(acc_dv, base + Tr::kOffP, dKV::row0(warp),
                   base + Tr::kOffdO + stage * Tr::kQTileBytes, dKV::col0(warp), lane);
      GemmdKV::run(acc_dk, base + Tr::kOffdS, dKV::row0(warp),
                   base + Tr::kOffQ + stage * Tr::kQTileBytes, dKV::col0(warp), lane);
    }

    // dQ_i += dS K_j, reduced into dq_accum. Rows past the sequence's end are not written.
    {
      const int tid = static_cast<int>(opaque(threadIdx.x));
      const int warp = tid / 32;
      const int lane = tid % 32;
      const uint32_t base = opaque(tc::smem_addr(smem));
      const Info info{base + Tr::kOffInfo};
      const IterCoord ic(args, info, kSegments ? ld_shared_s32(info.pos_addr(k & 1)) : k);
      const int row0 = ic.m_block * kBlockM;
      const int len_q = info.len_q();
      using GemmdQ = WarpGemm<T, dQ::kMi, dQ::kNi, kBlockN, kBlockN, false, kD, true, true>;
      const int64_t q_row_stride = static_cast<int64_t>(args.heads_q) * kD;
      // Deterministic: this CTA adds to the tile after every lower key tile that visits it.
      int32_t* const sem =
          args.dq_semaphores != nullptr
              ? args.dq_semaphores +
                    ((info.q_start() + row0) * args.heads_q + ic.head) * kDqCounters
              : nullptr;
      if (sem != nullptr) {
        if (tid == 0) {
          const SeqMask mask = (kBand ? args.band : Band{}).for_seq(len_q, info.len_k());
          const int rows = min(kBlockM, len_q - row0);
          dq_wait_turn(sem, dq_ticket(mask, row0, rows, info.n0(), kBlockN));
        }
        __syncthreads();
      }
      float* dq_tile = args.dq_accum + (info.q_start() + row0) * q_row_stride +
                       static_cast<int64_t>(ic.head) * kD;
#pragma unroll
      for (int split = 0; split < Tr::kdQSplits; ++split) {
        const int dq_m0 = dQ::row0(warp);
        const int dq_n0 = split * (kD / Tr::kdQSplits) + dQ::col0(warp);
        float acc_dq[dQ::kMi][dQ::kNi][4];
        zero(acc_dq);
        GemmdQ::run(acc_dq, base + Tr::kOffdS, dq_m0, base + Tr::kOffK, dq_n0, lane);
#pragma unroll
        for (int i = 0; i < dQ::kMi; ++i) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int r = dq_m0 + i * 16 + (lane >> 2) + h * 8;
            if (row0 + r < len_q) {
              float* dst = dq_tile + r * q_row_stride + dq_n0 + (lane & 3) * 2;
#pragma unroll
              for (int j = 0; j < dQ::kNi; ++j) {
                tc::red_add_f32x2(dst + j * 8, acc_dq[i][j][2 * h], acc_dq[i][j][2 * h + 1]);
              }
            }
          }
        }
      }
      if (sem != nullptr) {
        __syncthreads();
        if (tid == 0) dq_pass_turn(sem);
      }
    }
  }

  // Epilogue: stage dV and scale * dK through the now idle K/V tiles so the global stores are
  // 16-byte and coalesced. Keys past the sequence's end are not written; every key of it is,
  // zeros included (a tile no query row sees, e.g. the padding span's, writes dK = dV = 0).
  const int tid = static_cast<int>(opaque(threadIdx.x));
  const int warp = tid / 32;
  const int lane = tid % 32;
  tc::cp_async_wait<0>();
  __syncthreads();
  const uint32_t base = opaque(tc::smem_addr(smem));
  store_acc<T, kD>(base + Tr::kOffV, acc_dv, dKV::row0(warp), dKV::col0(warp), 1.f, lane);
  store_acc<T, kD>(base + Tr::kOffK, acc_dk, dKV::row0(warp), dKV::col0(warp), args.scale, lane);
  __syncthreads();
  const Info info{base + Tr::kOffInfo};
  const int n0 = info.n0();
  const int64_t kv_row_stride = static_cast<int64_t>(args.heads_kv) * kD;
  const int64_t kv_offset =
      (info.k_start() + n0) * kv_row_stride + static_cast<int64_t>(info.head_kv()) * kD;
  const int rows_valid = info.len_k() - n0;
  constexpr int kChunksPerRow = kD / 8;
#pragma unroll
  for (int i = 0; i < kBlockN * kChunksPerRow / Tr::kThreads; ++i) {
    const int c = tid + i * Tr::kThreads;
    const int row = c / kChunksPerRow;
    const int col = (c % kChunksPerRow) * 8;
    if (row < rows_valid) {
      const int64_t dst = kv_offset + row * kv_row_stride + col;
      *reinterpret_cast<uint4*>(static_cast<T*>(args.dv) + dst) =
          ld_shared_b128(base + Tr::kOffV + 2 * swz<kD>(row, col));
      *reinterpret_cast<uint4*>(static_cast<T*>(args.dk) + dst) =
          ld_shared_b128(base + Tr::kOffK + 2 * swz<kD>(row, col));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Launcher

// Zeroes dq_accum, runs the main kernel and converts dQ, all on `stream`. Shapes are checked by
// bwd_tensor_core before it gets here; it also chooses the flags: kBand iff the band is bounded
// on some side or segment ids are given, kSegments iff segment ids are given, kSoftcap iff
// softcap > 0. Every dQ row is written (rows no key tile reaches come out as 0).
template <typename T, int kHeadDim, bool kBand, bool kSegments, bool kSoftcap>
cudaError_t run_bwd(const BwdParams& params, cudaStream_t stream) {
  using Tr = typename BwdConfig<T, kHeadDim>::Traits;
  const SeqLayout& layout = params.layout;
  const int64_t dq_elems = layout.rows_q() * params.heads_q * kHeadDim;
  const int64_t tiles = layout.tiles(Tr::kBlockN, true);
  const int64_t num_blocks = tiles * params.heads_kv;
  const int64_t group = params.heads_q / params.heads_kv;
  const int64_t max_len_q = layout.varlen() ? layout.total_q : layout.seqlen_q;
  const int64_t max_len_k = layout.varlen() ? layout.total_k : layout.seqlen_k;
  const int64_t max_m_blocks = (max_len_q + Tr::kBlockM - 1) / Tr::kBlockM;
  // Positions and head indices are int inside the kernel; element offsets are int64.
  if (num_blocks > INT_MAX || max_m_blocks * group > INT_MAX || max_len_q > INT_MAX - 1024 ||
      max_len_k > INT_MAX - 1024 || params.heads_q > INT_MAX / kHeadDim) {
    return cudaErrorInvalidValue;
  }

  if (const cudaError_t err = zero_dq_accum(params.dq_accum, dq_elems, stream);
      err != cudaSuccess) {
    return err;
  }
  if (const cudaError_t err =
          zero_dq_semaphores(params.dq_semaphores, layout.rows_q() * params.heads_q, stream);
      err != cudaSuccess) {
    return err;
  }

  if (num_blocks > 0) {
    BwdArgs args;
    args.q = params.q;
    args.k = params.k;
    args.v = params.v;
    args.dout = params.dout;
    args.lse = static_cast<const float*>(params.lse);
    args.delta = static_cast<const float*>(params.delta);
    args.dk = params.dk;
    args.dv = params.dv;
    args.dq_accum = params.dq_accum;
    args.dq_semaphores = params.dq_semaphores;
    args.layout = layout;
    args.band = params.mask.band.clamped();
    args.segments = params.mask.segments;
    args.heads_q = static_cast<int>(params.heads_q);
    args.heads_kv = static_cast<int>(params.heads_kv);
    args.group = static_cast<int>(group);
    // The Q and dO a unit's key tiles share: one sequence's rows of its group of query heads.
    args.order = launch_order(
        layout, params.mask, layout.varlen() ? params.heads_kv : layout.batch * params.heads_kv,
        layout.varlen() ? tiles : (layout.seqlen_k + Tr::kBlockN - 1) / Tr::kBlockN, false,
        kHeadDim * 2 * 2 * group, 1, params.heads_kv, params.dq_semaphores != nullptr);
    const double softcap = params.mask.softcap;
    args.scale = static_cast<float>(params.softmax_scale);
    args.scale_log2 = static_cast<float>((kSoftcap ? softcap : params.softmax_scale) * M_LOG2E);
    args.cap_scale = kSoftcap ? static_cast<float>(params.softmax_scale / softcap) : 0.f;

    auto kernel = bwd_main_kernel<Tr, kBand, kSegments, kSoftcap>;
    constexpr int kSmemBytes = Tr::smem_bytes(kSegments);
    if (const cudaError_t err =
            configure_kernel_once<bwd_main_kernel<Tr, kBand, kSegments, kSoftcap>>(kSmemBytes);
        err != cudaSuccess) {
      return err;
    }
    kernel<<<static_cast<unsigned>(num_blocks), Tr::kThreads, kSmemBytes, stream>>>(args);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }

  return convert_dq<T>(params.dq_accum, params.dq, dq_elems, params.softmax_scale, stream);
}

// The variants of JAX_FLASH_TC_FLAGS (tc_primitives.cuh): one explicit instantiation of each per
// (dtype, head_dim) lives in
// bwd_tc_hdim{64,128,256}.cu; these declarations keep every other includer from instantiating
// the kernels again.
#define JAX_FLASH_BWD_TC_EXTERN(T, D, B, S, C) \
  extern template cudaError_t run_bwd<T, D, B, S, C>(const BwdParams&, cudaStream_t);
JAX_FLASH_TC_FLAGS(JAX_FLASH_BWD_TC_EXTERN, __half, 64)
JAX_FLASH_TC_FLAGS(JAX_FLASH_BWD_TC_EXTERN, __half, 128)
JAX_FLASH_TC_FLAGS(JAX_FLASH_BWD_TC_EXTERN, __half, 256)
JAX_FLASH_TC_FLAGS(JAX_FLASH_BWD_TC_EXTERN, __nv_bfloat16, 64)
JAX_FLASH_TC_FLAGS(JAX_FLASH_BWD_TC_EXTERN, __nv_bfloat16, 128)
JAX_FLASH_TC_FLAGS(JAX_FLASH_BWD_TC_EXTERN, __nv_bfloat16, 256)
#undef JAX_FLASH_BWD_TC_EXTERN

}  // namespace jax_flash::cuda::bwd_tc
