// FlashAttention-2 backward on the tensor cores (mma.sync m16n8k16, ldmatrix, fp32 accumulation)
// for f16/bf16.
//
// One block owns one key/value tile K_j, V_j of kBlockN keys of one kv head. It keeps dK_j and dV_j
// in registers while it walks every query tile Q_i (kBlockM rows) of every query head of its GQA
// group, so dK/dV need no cross-block reduction and GQA needs no per-query-head copies. dQ_i, which
// every key tile contributes to, is accumulated with fp32 reductions into dq_accum and converted
// to T by a second small kernel. Per query tile (paper, Algorithm 2):
//   S = Q_i K_j^T, P = exp(scale * S - lse_i)   recomputed, never stored in global memory
//   dP = dO_i V_j^T, dS = P * (dP - delta_i)    delta_i = rowsum(dO_i * O_i) - dlse, from the
//   caller dV_j += P^T dO_i, dK_j += dS^T Q_i, dQ_i += dS K_j
// P and dS make one round trip through shared memory in T because dV/dK consume them transposed.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>

#include "common/params.h"
#include "cuda/dq_convert.cuh"
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
  static constexpr int kOffLse = kOffdS + kPTileBytes;           // 2 stages
  static constexpr int kOffDelta = kOffLse + 2 * kRowStatBytes;  // 2 stages
  static constexpr int kSmemBytes = kOffDelta + 2 * kRowStatBytes;

  static_assert(kHeadDim % 64 == 0 && kBlockN % 64 == 0,
                "swizzled rows need at least eight 16-byte chunks");
  static_assert(kBlockM % 16 == 0 && kBlockM <= kThreads, "one thread per lse/delta row");
  static_assert((kBlockM * kHeadDim / 8) % kThreads == 0, "Q/dO tile copies must divide evenly");
  static_assert((kBlockN * kHeadDim / 8) % kThreads == 0, "K/V tile copies must divide evenly");
  static_assert(kHeadDim % kdQSplits == 0, "");
  static_assert(kSmemBytes <= 227 * 1024, "exceeds the largest shared-memory carve-out (Hopper)");
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
  const void* q;       // [batch, seqlen_q, heads_q, D]
  const void* k;       // [batch, seqlen_k, heads_kv, D]
  const void* v;       // [batch, seqlen_k, heads_kv, D]
  const void* dout;    // [batch, seqlen_q, heads_q, D]
  const float* lse;    // [batch, heads_q, seqlen_q]
  const float* delta;  // [batch, heads_q, seqlen_q]
  void* dk;            // [batch, seqlen_k, heads_kv, D]
  void* dv;            // [batch, seqlen_k, heads_kv, D]
  float* dq_accum;     // [batch, seqlen_q, heads_q, D]
  // Sequence positions and head indices fit in int (checked on the host); element offsets into
  // the tensors are formed in int64.
  int seqlen_q;
  int seqlen_k;
  int heads_q;
  int heads_kv;
  int causal_offset;  // seqlen_k - seqlen_q: query i sees key j iff j <= i + causal_offset
  int group;          // heads_q / heads_kv
  int num_n_blocks;   // key tiles per (batch, kv head)
  int num_m_blocks;   // query tiles per (batch, query head)
  float scale;        // softmax_scale, folded into dK at the end
  float scale_log2;   // softmax_scale * log2(e)
};

// ---------------------------------------------------------------------------------------------
// Primitives beyond tc_primitives.cuh

// The kernels address shared memory with 32-bit shared-window addresses rather than 64-bit generic
// pointers: inside the main loop every register counts, and this keeps one per address.
//
// 16-byte global->shared copy, zero-filling (and reading nothing) when `valid` is false; the same
// instruction as tc::cp_async_16, taking a shared-window address.
__device__ __forceinline__ void cp_async_16(uint32_t smem_dst, const void* gmem_src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_dst), "l"(gmem_src),
               "r"(src_bytes));
}
// 4-byte variant for the lse/delta rows, whose base is only 4-byte aligned.
__device__ __forceinline__ void cp_async_4(uint32_t smem_dst, const void* gmem_src, bool valid) {
  const int src_bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_dst), "l"(gmem_src),
               "r"(src_bytes));
}
__device__ __forceinline__ float ld_shared_f32(uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ void st_shared_b32(uint32_t addr, uint32_t value) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(value));
}
__device__ __forceinline__ uint4 ld_shared_b128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr));
  return v;
}

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
        st_shared_b32(swz_step<kCols>(addr, i * 16 + h * 8, j),
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
// Kernels

// Issues the cp.async copies of Q_i, dO_i, lse_i and delta_i of query tile m_block of `head`.
template <typename Tr>
__device__ __forceinline__ void load_query_tile(const BwdArgs& args, int batch, int head,
                                                int m_block, int stage, uint32_t smem, int tid) {
  using T = typename Tr::T;
  const int row0 = m_block * Tr::kBlockM;
  const int rows_valid = args.seqlen_q - row0;
  const int64_t row_stride = static_cast<int64_t>(args.heads_q) * Tr::kHeadDim;
  const int64_t offset = (static_cast<int64_t>(batch) * args.seqlen_q + row0) * row_stride +
                         static_cast<int64_t>(head) * Tr::kHeadDim;
  load_tile<Tr::kBlockM, Tr::kHeadDim, Tr::kThreads>(smem + Tr::kOffQ + stage * Tr::kQTileBytes,
                                                     static_cast<const T*>(args.q) + offset,
                                                     row_stride, rows_valid, tid);
  load_tile<Tr::kBlockM, Tr::kHeadDim, Tr::kThreads>(smem + Tr::kOffdO + stage * Tr::kQTileBytes,
                                                     static_cast<const T*>(args.dout) + offset,
                                                     row_stride, rows_valid, tid);
  if (tid < Tr::kBlockM) {
    const bool valid = tid < rows_valid;
    const int64_t stat = (static_cast<int64_t>(batch) * args.heads_q + head) * args.seqlen_q +
                         row0 + (valid ? tid : 0);
    cp_async_4(smem + Tr::kOffLse + stage * Tr::kRowStatBytes + tid * 4, args.lse + stat, valid);
    cp_async_4(smem + Tr::kOffDelta + stage * Tr::kRowStatBytes + tid * 4, args.delta + stat,
               valid);
  }
}

// Which (batch, kv head, key tile) a block owns: blockIdx.x with the key tile fastest, so that
// co-resident blocks share the same Q, dO and dq_accum rows in L2.
struct BlockCoord {
  int batch;
  int head_kv;
  int n_block;
  __device__ BlockCoord(const BwdArgs& args, int block) {
    const int bh = block / args.num_n_blocks;
    n_block = block - bh * args.num_n_blocks;
    batch = bh / args.heads_kv;
    head_kv = bh - batch * args.heads_kv;
  }
  __device__ int64_t kv_offset(const BwdArgs& args, int kD, int kBlockN) const {
    return (static_cast<int64_t>(batch) * args.seqlen_k + n_block * kBlockN) *
               (static_cast<int64_t>(args.heads_kv) * kD) +
           static_cast<int64_t>(head_kv) * kD;
  }
};

// Causal: the first query row that sees key n0 is n0 - causal_offset; earlier query tiles are
// entirely masked for this key tile and are skipped.
template <bool kCausal, int kBlockM>
__device__ __forceinline__ int first_m_block(const BwdArgs& args, int n0) {
  if constexpr (kCausal) {
    const int first_row = n0 - args.causal_offset;
    if (first_row >= args.seqlen_q) return args.num_m_blocks;
    if (first_row > 0) return first_row / kBlockM;
  }
  return 0;
}

// Coordinates of main-loop iteration `it` of this block: the query head and query tile it
// processes and those of the next iteration (for the prefetch). Built from an opaque() copy of
// blockIdx, so each use recomputes it instead of keeping it live across the iteration.
template <bool kCausal, int kBlockM, int kBlockN>
struct IterCoord {
  bool valid;     // it < number of iterations of this block
  bool has_next;  // it + 1 < number of iterations
  int batch;
  int n0;    // first key of the block's tile
  int head;  // query head
  int row0;  // first query row of the tile
  int next_head;
  int next_m_block;
  __device__ IterCoord(const BwdArgs& args, int it) {
    const BlockCoord bc(args, static_cast<int>(opaque(blockIdx.x)));
    batch = bc.batch;
    n0 = bc.n_block * kBlockN;
    const int m_begin = first_m_block<kCausal, kBlockM>(args, n0);
    const int num_m = args.num_m_blocks - m_begin;
    const int num_iters = max(num_m, 0) * args.group;
    valid = it < num_iters;
    has_next = it + 1 < num_iters;
    const int head_step = valid ? it / num_m : 0;
    const int m_block = m_begin + (it - head_step * num_m);
    head = bc.head_kv * args.group + head_step;
    row0 = m_block * kBlockM;
    const bool head_done = m_block + 1 == args.num_m_blocks;
    next_m_block = head_done ? m_begin : m_block + 1;
    next_head = head_done ? head + 1 : head;
  }
};

template <typename Tr, bool kCausal>
__global__ void __launch_bounds__(Tr::kThreads, 1) bwd_main_kernel(const BwdArgs args) {
  using T = typename Tr::T;
  using SdP = typename Tr::SdP;
  using dKV = typename Tr::dKV;
  using dQ = typename Tr::dQ;
  constexpr int kBlockM = Tr::kBlockM;
  constexpr int kBlockN = Tr::kBlockN;
  constexpr int kD = Tr::kHeadDim;

  extern __shared__ __align__(128) unsigned char smem[];

  // Only the dK/dV accumulators and the iteration counter live across the main loop: everything
  // else is derived again inside it (and in the epilogue) from opaque() copies of blockIdx and
  // threadIdx, which costs a few integer ops per iteration and keeps ptxas from parking block
  // scalars in registers (or spilling them) next to 128+ accumulator registers.
  {
    const uint32_t smem_base = tc::smem_addr(smem);
    const BlockCoord coord(args, blockIdx.x);
    const int n0 = coord.n_block * kBlockN;
    const int m_begin = first_m_block<kCausal, kBlockM>(args, n0);
    if (m_begin < args.num_m_blocks) {
      const int tid = threadIdx.x;
      const int64_t kv_row_stride = static_cast<int64_t>(args.heads_kv) * kD;
      const int64_t kv_offset = coord.kv_offset(args, kD, kBlockN);
      load_tile<kBlockN, kD, Tr::kThreads>(smem_base + Tr::kOffK,
                                           static_cast<const T*>(args.k) + kv_offset, kv_row_stride,
                                           args.seqlen_k - n0, tid);
      load_tile<kBlockN, kD, Tr::kThreads>(smem_base + Tr::kOffV,
                                           static_cast<const T*>(args.v) + kv_offset, kv_row_stride,
                                           args.seqlen_k - n0, tid);
      load_query_tile<Tr>(args, coord.batch, coord.head_kv * args.group, m_begin, 0, smem_base,
                          tid);
    }
    tc::cp_async_commit();
  }

  float acc_dv[dKV::kMi][dKV::kNi][4];
  float acc_dk[dKV::kMi][dKV::kNi][4];
  zero(acc_dv);
  zero(acc_dk);

  // The iterations walk the query tiles of each query head of the group in turn. Each phase of
  // an iteration re-derives the coordinates it needs (IterCoord, lane/warp, shared addresses)
  // rather than keeping them live from the top of the iteration.
  for (int it = 0;; ++it) {
    {
      const IterCoord<kCausal, kBlockM, kBlockN> ic(args, it);
      if (!ic.valid) break;
      const int stage = it & 1;
      const int tid = static_cast<int>(opaque(threadIdx.x));
      // Barrier A: this stage's copies have landed for every thread, and every warp is done with
      // the previous iteration, i.e. with sP, sdS and the other Q/dO stage, which are now free.
      tc::cp_async_wait<0>();
      __syncthreads();
      if (ic.has_next) {
        load_query_tile<Tr>(args, ic.batch, ic.next_head, ic.next_m_block, stage ^ 1,
                            opaque(tc::smem_addr(smem)), tid);
      }
      tc::cp_async_commit();
    }

    // S = Q K^T, then P. A row past seqlen_q, or one that saw no key (lse = -inf), gets an
    // exponent bias of -inf so its P is exactly 0 rather than inf or NaN. Masked entries (keys
    // past seqlen_k, causal) are zeroed on the tiles that need it. P goes to shared memory as T
    // for the dV GEMM and stays in registers as f16 pairs for dS: half the registers of fp32 at
    // the point where the dP accumulators join dK/dV, and for P in [0, 1] f16 is 4x more precise
    // than the bf16 rounding dS gets anyway.
    using GemmSdP = WarpGemm<T, SdP::kMi, SdP::kNi, kD, kD, false, kD, false, Tr::kSdPDoubleBuffer>;
    __half2 p_f16[SdP::kMi][SdP::kNi][2];
    {
      const int stage = it & 1;
      const IterCoord<kCausal, kBlockM, kBlockN> ic(args, it);
      const int tid = static_cast<int>(opaque(threadIdx.x));
      const int warp = tid / 32;
      const int lane = tid % 32;
      const uint32_t base = opaque(tc::smem_addr(smem));
      const int sdp_m0 = SdP::row0(warp);
      const int sdp_n0 = SdP::col0(warp);
      float acc_s[SdP::kMi][SdP::kNi][4];
      zero(acc_s);
      GemmSdP::run(acc_s, base + Tr::kOffQ + stage * Tr::kQTileBytes, sdp_m0, base + Tr::kOffK,
                   sdp_n0, lane);

      const uint32_t lse_addr = base + Tr::kOffLse + stage * Tr::kRowStatBytes;
      const uint32_t lane_p =
          base + Tr::kOffP + 2 * swz<kBlockN>(sdp_m0 + (lane >> 2), sdp_n0 + (lane & 3) * 2);
      const bool need_mask = ic.n0 + kBlockN > args.seqlen_k ||
                             (kCausal && ic.n0 + kBlockN - 1 > ic.row0 + args.causal_offset);
#pragma unroll
      for (int i = 0; i < SdP::kMi; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = sdp_m0 + i * 16 + (lane >> 2) + h * 8;
          const float lse = ld_shared_f32(lse_addr + 4 * r);
          const bool live = ic.row0 + r < args.seqlen_q && lse != -INFINITY;
          const float bias = live ? -lse * static_cast<float>(M_LOG2E) : -INFINITY;
          // Columns of this tile at or past col_limit are masked for this row.
          int col_limit = kBlockN;
          if (need_mask) {
            int limit = args.seqlen_k;
            if constexpr (kCausal) limit = min(limit, ic.row0 + r + args.causal_offset + 1);
            col_limit = limit - ic.n0;
          }
#pragma unroll
          for (int j = 0; j < SdP::kNi; ++j) {
            const int c = sdp_n0 + j * 8 + (lane & 3) * 2;
            float p[2];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              p[e] = tc::fast_exp2(fmaf(acc_s[i][j][2 * h + e], args.scale_log2, bias));
              if (c + e >= col_limit) p[e] = 0.f;
            }
            p_f16[i][j][h] = __floats2half2_rn(p[0], p[1]);
            st_shared_b32(swz_step<kBlockN>(lane_p, i * 16 + h * 8, j), tc::pack2<T>(p[0], p[1]));
          }
        }
      }
    }

    // dP = dO V^T, dS = P * (dP - delta).
    {
      const int stage = it & 1;
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
          }
        }
      }
      store_acc<T, kBlockN>(base + Tr::kOffdS, acc_dp, sdp_m0, sdp_n0, 1.f, lane);
    }
    // Barrier B: P and dS are complete.
    __syncthreads();

    // dV += P^T dO, dK += dS^T Q.
    {
      const int stage = it & 1;
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

    // dQ_i += dS K_j, reduced into dq_accum.
    {
      const IterCoord<kCausal, kBlockM, kBlockN> ic(args, it);
      const int tid = static_cast<int>(opaque(threadIdx.x));
      const int warp = tid / 32;
      const int lane = tid % 32;
      const uint32_t base = opaque(tc::smem_addr(smem));
      using GemmdQ = WarpGemm<T, dQ::kMi, dQ::kNi, kBlockN, kBlockN, false, kD, true, true>;
      const int64_t q_row_stride = static_cast<int64_t>(args.heads_q) * kD;
      float* dq_tile = args.dq_accum +
                       (static_cast<int64_t>(ic.batch) * args.seqlen_q + ic.row0) * q_row_stride +
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
            if (ic.row0 + r < args.seqlen_q) {
              float* dst = dq_tile + r * q_row_stride + dq_n0 + (lane & 3) * 2;
#pragma unroll
              for (int j = 0; j < dQ::kNi; ++j) {
                tc::red_add_f32x2(dst + j * 8, acc_dq[i][j][2 * h], acc_dq[i][j][2 * h + 1]);
              }
            }
          }
        }
      }
    }
  }

  // Epilogue: stage dV and scale * dK through the now idle K/V tiles so the global stores are
  // 16-byte and coalesced. Keys past seqlen_k are not written.
  const int tid = static_cast<int>(opaque(threadIdx.x));
  const int warp = tid / 32;
  const int lane = tid % 32;
  tc::cp_async_wait<0>();
  __syncthreads();
  const uint32_t base = opaque(tc::smem_addr(smem));
  store_acc<T, kD>(base + Tr::kOffV, acc_dv, dKV::row0(warp), dKV::col0(warp), 1.f, lane);
  store_acc<T, kD>(base + Tr::kOffK, acc_dk, dKV::row0(warp), dKV::col0(warp), args.scale, lane);
  __syncthreads();
  const BlockCoord out(args, static_cast<int>(opaque(blockIdx.x)));
  const int64_t kv_offset = out.kv_offset(args, kD, kBlockN);
  const int64_t kv_row_stride = static_cast<int64_t>(opaque(args.heads_kv)) * kD;
  const int rows_valid = args.seqlen_k - out.n_block * kBlockN;
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
// bwd_tensor_core before it gets here.
template <typename T, int kHeadDim, bool kCausal>
cudaError_t run_bwd(const BwdParams& params, cudaStream_t stream) {
  using Tr = typename BwdConfig<T, kHeadDim>::Traits;
  const int64_t dq_elems = params.batch * params.seqlen_q * params.heads_q * kHeadDim;
  const int64_t num_n_blocks = (params.seqlen_k + Tr::kBlockN - 1) / Tr::kBlockN;
  const int64_t num_m_blocks = (params.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM;
  const int64_t num_blocks = num_n_blocks * params.heads_kv * params.batch;
  const int64_t group = params.heads_q / params.heads_kv;
  // Positions and head indices are int inside the kernel; element offsets are int64.
  if (num_blocks > INT_MAX || num_m_blocks * group > INT_MAX || params.seqlen_q > INT_MAX - 1024 ||
      params.seqlen_k > INT_MAX - 1024 || params.heads_q > INT_MAX / kHeadDim) {
    return cudaErrorInvalidValue;
  }

  if (const cudaError_t err = zero_dq_accum(params.dq_accum, dq_elems, stream);
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
    args.seqlen_q = static_cast<int>(params.seqlen_q);
    args.seqlen_k = static_cast<int>(params.seqlen_k);
    args.heads_q = static_cast<int>(params.heads_q);
    args.heads_kv = static_cast<int>(params.heads_kv);
    args.causal_offset = static_cast<int>(params.seqlen_k - params.seqlen_q);
    args.group = static_cast<int>(group);
    args.num_n_blocks = static_cast<int>(num_n_blocks);
    args.num_m_blocks = static_cast<int>(num_m_blocks);
    args.scale = static_cast<float>(params.softmax_scale);
    args.scale_log2 = static_cast<float>(params.softmax_scale * M_LOG2E);

    auto kernel = bwd_main_kernel<Tr, kCausal>;
    if (Tr::kSmemBytes > 48 * 1024) {
      const cudaError_t err =
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes);
      if (err != cudaSuccess) return err;
    }
    kernel<<<static_cast<unsigned>(num_blocks), Tr::kThreads, Tr::kSmemBytes, stream>>>(args);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }

  return convert_dq<T>(params.dq_accum, params.dq, dq_elems, params.softmax_scale, stream);
}

// One explicit instantiation per (dtype, head_dim, causal) lives in bwd_tc_hdim{64,128,256}.cu;
// these declarations keep every other includer from instantiating the kernels again.
#define JAX_FLASH_BWD_TC_EXTERN(T, D)                                               \
  extern template cudaError_t run_bwd<T, D, false>(const BwdParams&, cudaStream_t); \
  extern template cudaError_t run_bwd<T, D, true>(const BwdParams&, cudaStream_t);
JAX_FLASH_BWD_TC_EXTERN(__half, 64)
JAX_FLASH_BWD_TC_EXTERN(__half, 128)
JAX_FLASH_BWD_TC_EXTERN(__half, 256)
JAX_FLASH_BWD_TC_EXTERN(__nv_bfloat16, 64)
JAX_FLASH_BWD_TC_EXTERN(__nv_bfloat16, 128)
JAX_FLASH_BWD_TC_EXTERN(__nv_bfloat16, 256)
#undef JAX_FLASH_BWD_TC_EXTERN

}  // namespace jax_flash::cuda::bwd_tc
