// Tensor-core forward kernel for fp16/bf16: FlashAttention-2's loop order (Dao, 2023, Algorithm 1)
// on mma.sync m16n8k16 with fp32 accumulation.
//
// One thread block owns kBlockM query rows of one (batch, query head). Q is loaded once; K and V
// tiles of kBlockN keys stream through a kStages-deep cp.async ring, so the copy of tile t+1 is in
// flight during all of tile t's work (QK^T, softmax and PV). Each warp owns 16 * kMTiles whole
// query rows: the row max/sum reductions stay inside the four lanes (a quad) that hold a row, and
// P goes from the S accumulators straight into PV's A operand in registers.
//
// Fragment layouts (PTX ISA, mma.m16n8k16, g = lane / 4, c = 2 * (lane % 4)):
//   A 16x16 : a0 (g, c..c+1)  a1 (g+8, c..c+1)  a2 (g, c+8..c+9)  a3 (g+8, c+8..c+9)
//   B 16x8  : b0 (k = c..c+1, n = g)  b1 (k = c+8..c+9, n = g)
//   C 16x8  : c0,c1 (g, c..c+1)  c2,c3 (g+8, c..c+1)
// ldmatrix gives lane l of matrix i the pair (l / 4, c..c+1), or with .trans the pair
// (c..c+1, l / 4); lanes 8i..8i+7 supply the row addresses of matrix i.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "common/params.h"
#include "cuda/tc_primitives.cuh"

namespace jax_flash::cuda::fwd_tc {

// One kernel configuration; FwdTraits derives every other constant from it.
struct FwdTile {
  int block_m;     // query rows per thread block
  int block_n;     // keys per K/V pipeline stage
  int n_warps;     // each warp owns block_m / n_warps query rows
  int stages;      // K/V tiles resident in shared memory (the copy ring depth)
  int min_blocks;  // resident blocks per SM that the register budget is sized for
  bool q_in_regs;  // Q's A fragments live in registers for the whole key loop
};

// The single place where tile shapes are chosen (H200: 227 KB shared memory, 64K registers and
// 4 schedulers per SM). Two constraints set the shapes:
//  - Shared-memory bandwidth: one m16n8k16 reads a 256-byte B fragment through ldmatrix, so a
//    warp must reuse every K/V fragment for two m16 row tiles (32 query rows per warp) or the
//    ldmatrix traffic, not the tensor cores, becomes the limit (measured: 8 warps x 16 rows at
//    d128 is 17% slower than 4 warps x 32 rows).
//  - Registers: O (32 x head_dim fp32 per warp) and S live in registers. At d128 a thread holds
//    128 O + 64 S floats for a 64-key tile, which does not fit 255 registers together with the
//    fragments in flight (ptxas spills ~90 bytes); 32-key tiles (32 S floats) fit with no spill
//    and measured the same speed. Two 128-thread blocks per SM then give each scheduler two warps.
//    (A FlashAttention-3 style ping-pong, two 4-warp groups in one block passing a tensor token
//    through named barriers, measured 25% slower: one warp per scheduler cannot keep mma.sync
//    busy on its own.)
//  - d64 : 128 x 64, 4 warps (32 rows each), Q in registers (32 regs; re-reading it from smem
//          measured 2-4% slower); smem 18 KB Q + 2 x 18 KB K/V = 54 KB per block, 2 per SM.
//  - d128: 128 x 32, 4 warps (32 rows each), Q re-read from smem (in registers it would cost 64
//          registers on top of O's 128); smem 34 KB Q + 2 x 17 KB K/V = 68 KB, 2 blocks per SM.
//  - d256: 128 x 64, 8 warps (16 rows each): 32 rows per warp would need 256 O registers per
//          thread. smem 66 KB Q + 2 x 66 KB K/V = 198 KB, one block per SM.
constexpr FwdTile fwd_tile(int head_dim) {
  switch (head_dim) {
    case 64:
      return FwdTile{128, 64, 4, 2, 2, true};
    case 128:
      return FwdTile{128, 32, 4, 2, 2, false};
    default:
      return FwdTile{128, 64, 8, 2, 1, false};
  }
}

template <typename T_, int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kStages_,
          int kMinBlocks_, bool kQInRegs_>
struct FwdTraits {
  using T = T_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kStages = kStages_;
  static constexpr int kMinBlocks = kMinBlocks_;
  static constexpr bool kQInRegs = kQInRegs_;
  static constexpr int kNThreads = kNWarps * 32;

  static constexpr int kRowsPerWarp = kBlockM / kNWarps;
  static constexpr int kMTiles = kRowsPerWarp / 16;  // m16 tiles of query rows per warp
  static constexpr int kSTiles = kBlockN / 8;        // n8 tiles of S per m16 tile
  static constexpr int kOTiles = kHeadDim / 8;       // n8 tiles of O per m16 tile
  static constexpr int kQKSteps = kHeadDim / 16;     // k16 steps of QK^T
  static constexpr int kPVSteps = kBlockN / 16;      // k16 steps of PV

  // Shared tiles are row-major with a pitch of head_dim * 2 + 16 bytes. The 16-byte pad moves
  // each row four banks on, so the eight 16-byte rows of one ldmatrix phase (same column, eight
  // consecutive rows) and the epilogue's 4-byte fragment stores hit 32 distinct banks, while
  // every address stays affine in (row, chunk): one register per operand plus immediates.
  static constexpr int kRowBytes = kHeadDim * static_cast<int>(sizeof(T));
  static constexpr int kPitch = kRowBytes + 16;
  static constexpr int kChunksPerRow = kRowBytes / 16;
  static constexpr int kRowsPerPass = kNThreads / kChunksPerRow;  // rows one cp.async sweep fills
  static constexpr int kQTileBytes = kBlockM * kPitch;
  static constexpr int kKVTileBytes = kBlockN * kPitch;
  static constexpr int kSmemBytes = kQTileBytes + 2 * kStages * kKVTileBytes;

  static_assert(sizeof(T) == 2, "tensor-core path is fp16/bf16 only");
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "unsupported head_dim");
  static_assert(kBlockM % (16 * kNWarps) == 0, "each warp owns whole m16 tiles");
  static_assert(kBlockN % 16 == 0, "PV consumes keys in k16 steps");
  static_assert(kRowBytes % 128 == 0, "the pad shifts rows by 4 banks only if rows span 128 B");
  static_assert(kNThreads % kChunksPerRow == 0, "a cp.async sweep covers whole rows");
  static_assert(kBlockM % kRowsPerPass == 0 && kBlockN % kRowsPerPass == 0,
                "tiles are filled by whole sweeps");
  static_assert(kStages >= 2, "the copy ring needs a stage in flight while one is computed");
  static_assert(kSmemBytes <= 227 * 1024, "exceeds sm_90 shared memory per block");
  static_assert(kMinBlocks * kSmemBytes <= 228 * 1024, "resident blocks do not fit in smem");
};

template <typename T, int kHeadDim>
using FwdTraitsFor = FwdTraits<T, kHeadDim, fwd_tile(kHeadDim).block_m, fwd_tile(kHeadDim).block_n,
                               fwd_tile(kHeadDim).n_warps, fwd_tile(kHeadDim).stages,
                               fwd_tile(kHeadDim).min_blocks, fwd_tile(kHeadDim).q_in_regs>;

// Everything the kernel reads besides shared memory, derived once on the host from FwdParams.
struct FwdArgs {
  const void* q;           // [batch, seqlen_q, heads_q, head_dim]
  const void* k;           // [batch, seqlen_k, heads_kv, head_dim]
  const void* v;           // [batch, seqlen_k, heads_kv, head_dim]
  void* o;                 // [batch, seqlen_q, heads_q, head_dim]
  float* lse;              // [batch, heads_q, seqlen_q]
  int64_t q_row_stride;    // heads_q * head_dim elements (also O's)
  int64_t kv_row_stride;   // heads_kv * head_dim
  int64_t q_batch_stride;  // seqlen_q * heads_q * head_dim
  int64_t kv_batch_stride;
  int seqlen_q;
  int seqlen_k;
  int heads_q;
  int q_per_kv;      // heads_q / heads_kv
  int num_m_blocks;  // ceil(seqlen_q / kBlockM)
  float scale_log2;  // softmax_scale * log2(e): softmax runs in base 2
};

// Copies rows [row0, row0 + kRows) of one head's [seqlen, head_dim] slice into a padded shared
// tile. Rows at or past row_end are zero-filled and never read from global memory.
template <typename Tr, int kRows>
__device__ __forceinline__ void load_tile(char* tile, const typename Tr::T* head_base,
                                          int64_t row_stride, int row0, int row_end, int ld_row,
                                          int ld_chunk, uint32_t ld_smem_off) {
  const typename Tr::T* src = head_base + (row0 + ld_row) * row_stride + ld_chunk * 8;
  const int64_t pass_stride = Tr::kRowsPerPass * row_stride;
#pragma unroll
  for (int i = 0; i < kRows / Tr::kRowsPerPass; ++i) {
    const bool valid = row0 + ld_row + i * Tr::kRowsPerPass < row_end;
    tc::cp_async_16(tile + ld_smem_off + i * Tr::kRowsPerPass * Tr::kPitch, valid ? src : head_base,
                    valid);
    src += pass_stride;
  }
}

template <typename Tr, bool kCausal>
__global__ void __launch_bounds__(Tr::kNThreads, Tr::kMinBlocks) fwd_kernel(const FwdArgs args) {
  using T = typename Tr::T;
  constexpr int kBlockM = Tr::kBlockM;
  constexpr int kBlockN = Tr::kBlockN;
  constexpr int kStages = Tr::kStages;
  constexpr int kMTiles = Tr::kMTiles;
  constexpr int kSTiles = Tr::kSTiles;
  constexpr int kOTiles = Tr::kOTiles;
  constexpr int kQKSteps = Tr::kQKSteps;
  constexpr int kPVSteps = Tr::kPVSteps;
  constexpr int kPitch = Tr::kPitch;
  constexpr int kChunksPerRow = Tr::kChunksPerRow;
  constexpr float kNegInf = -INFINITY;
  constexpr float kRescaleSlack = 8.f;

  extern __shared__ uint4 smem_raw[];  // uint4: 16-byte alignment for cp.async and ldmatrix
  char* smem_q = reinterpret_cast<char*>(smem_raw);
  char* smem_k = smem_q + Tr::kQTileBytes;
  char* smem_v = smem_k + kStages * Tr::kKVTileBytes;

  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;

  // m blocks of one head are adjacent in launch order so that they share K/V through L2; causal
  // launches each head's heaviest (last) m block first so that short blocks fill the tail.
  const int m_idx = static_cast<int>(blockIdx.x % args.num_m_blocks);
  const int bh = static_cast<int>(blockIdx.x / args.num_m_blocks);
  const int head = bh % args.heads_q;
  const int batch = bh / args.heads_q;
  const int m_block = kCausal ? args.num_m_blocks - 1 - m_idx : m_idx;
  const int kv_head = head / args.q_per_kv;

  const int sq = args.seqlen_q;
  const int sk = args.seqlen_k;
  const int m0 = m_block * kBlockM;

  const T* q_head = static_cast<const T*>(args.q) + batch * args.q_batch_stride +
                    static_cast<int64_t>(head) * Tr::kHeadDim;
  const T* k_head = static_cast<const T*>(args.k) + batch * args.kv_batch_stride +
                    static_cast<int64_t>(kv_head) * Tr::kHeadDim;
  const T* v_head = static_cast<const T*>(args.v) + batch * args.kv_batch_stride +
                    static_cast<int64_t>(kv_head) * Tr::kHeadDim;
  T* o_head = static_cast<T*>(args.o) + batch * args.q_batch_stride +
              static_cast<int64_t>(head) * Tr::kHeadDim;
  float* lse_head = args.lse + (static_cast<int64_t>(batch) * args.heads_q + head) * sq;

  // Key blocks [0, n_blocks) hold keys some row of this block sees; blocks [0, n_full) are seen
  // whole by every row and need no mask. Query i sees key j iff j <= i + (sk - sq).
  int n_blocks = (sk + kBlockN - 1) / kBlockN;
  int n_full = sk / kBlockN;
  if constexpr (kCausal) {
    const int last_key = min(m0 + kBlockM, sq) - 1 + (sk - sq);
    n_blocks = last_key < 0 ? 0 : min(n_blocks, last_key / kBlockN + 1);
    const int first_row_keys = m0 + (sk - sq) + 1;
    n_full = first_row_keys <= 0 ? 0 : min(n_full, first_row_keys / kBlockN);
  }

  // Fragment coordinates: rows g and g + 8, columns c and c + 1 of every C tile.
  const int g = lane / 4;
  const int c = 2 * (lane % 4);

  if (n_blocks == 0) {
    // Every row of this block sees no key: O = 0 and lse = -inf by definition.
    const uint4 zero = make_uint4(0, 0, 0, 0);
    for (int i = tid; i < kBlockM * kChunksPerRow; i += Tr::kNThreads) {
      const int row = m0 + i / kChunksPerRow;
      if (row < sq) {
        *reinterpret_cast<uint4*>(o_head + row * args.q_row_stride + (i % kChunksPerRow) * 8) =
            zero;
      }
    }
    for (int i = tid; i < kBlockM; i += Tr::kNThreads) {
      if (m0 + i < sq) lse_head[m0 + i] = kNegInf;
    }
    return;
  }
  const int n_iters = n_blocks;
  const int n_masked = n_blocks - n_full;  // the first n_masked iterations (highest blocks) mask

  // cp.async assignment: a thread copies chunk ld_chunk of rows ld_row + i * kRowsPerPass, so a
  // warp reads whole rows of contiguous global memory.
  const int ld_chunk = tid % kChunksPerRow;
  const int ld_row = tid / kChunksPerRow;
  const uint32_t ld_smem_off = ld_row * kPitch + ld_chunk * 16;

  auto load_kv = [&](int t) {
    const int stage = t % kStages;
    const int row0 = (n_blocks - 1 - t) * kBlockN;
    load_tile<Tr, kBlockN>(smem_k + stage * Tr::kKVTileBytes, k_head, args.kv_row_stride, row0, sk,
                           ld_row, ld_chunk, ld_smem_off);
    load_tile<Tr, kBlockN>(smem_v + stage * Tr::kKVTileBytes, v_head, args.kv_row_stride, row0, sk,
                           ld_row, ld_chunk, ld_smem_off);
  };

  // Prologue: Q is its own commit group, then one group per K/V tile, kStages - 1 tiles ahead.
  load_tile<Tr, kBlockM>(smem_q, q_head, args.q_row_stride, m0, sq, ld_row, ld_chunk, ld_smem_off);
  tc::cp_async_commit();
#pragma unroll
  for (int t = 0; t < kStages - 1; ++t) {
    if (t < n_iters) load_kv(t);
    tc::cp_async_commit();
  }

  // ldmatrix row addresses (lanes 8i..8i+7 address matrix i; a k16 step adds 32 bytes, a
  // 16-row block 16 * kPitch). Matrix order is chosen so that every MMA operand is a register
  // run the ldmatrix wrote contiguously:
  //   Q (A operand): (rows 0-7, k 0-7) (rows 8-15, k 0-7) (rows 0-7, k 8-15) (rows 8-15, k 8-15)
  //     -> a0 a1 a2 a3; lane l: row l % 16, chunk l / 16.
  //   V (B operand of PV, .trans): (keys 0-7, d 0-7) (keys 8-15, d 0-7) (keys 0-7, d 8-15)
  //     (keys 8-15, d 8-15) -> b0 b1 of d tile 0, b0 b1 of d tile 1; same lane pattern as Q.
  //   K (B operand of QK^T): (keys 0-7, k 0-7) (keys 0-7, k 8-15) (keys 8-15, k 0-7)
  //     (keys 8-15, k 8-15) -> b0 b1 of key tile 0, b0 b1 of key tile 1; lane l: row
  //     l % 8 + 8 * (l / 16), chunk (l / 8) % 2.
  const uint32_t qv_lane_off = (lane % 16) * kPitch + (lane / 16) * 16;
  const uint32_t k_lane_off = (lane % 8 + (lane / 16) * 8) * kPitch + ((lane / 8) % 2) * 16;
  const char* q_warp = smem_q + warp * Tr::kRowsPerWarp * kPitch + qv_lane_off;

  uint32_t q_frag[Tr::kQInRegs ? kMTiles : 1][Tr::kQInRegs ? kQKSteps : 1][4];
  if constexpr (Tr::kQInRegs) {
    tc::cp_async_wait<kStages - 1>();
    __syncthreads();
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
      for (int kk = 0; kk < kQKSteps; ++kk) {
        tc::ldmatrix_x4(q_frag[mi][kk], q_warp + mi * 16 * kPitch + kk * 32);
      }
    }
  }

  float acc_o[kMTiles][kOTiles][4];
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
    for (int j = 0; j < kOTiles; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[mi][j][e] = 0.f;
    }
  }
  // Per row ([mi][h] is row g + 8h of m tile mi): the softmax reference point m in base-2 units
  // (a lower bound of the running max of s * scale_log2, see below) and this thread's partial
  // sum of 2^(s * scale_log2 - m). The quad reduction of the sum is deferred to the epilogue:
  // every rescale factor is uniform across the quad.
  float m_ref[kMTiles][2];
  float row_sum[kMTiles][2];
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi) {
    m_ref[mi][0] = m_ref[mi][1] = kNegInf;
    row_sum[mi][0] = row_sum[mi][1] = 0.f;
  }

  const float scale_log2 = args.scale_log2;
  // Global index of this thread's first query row (row g of m tile 0).
  const int row_base = m0 + warp * Tr::kRowsPerWarp + g;

  auto iteration = [&](int t, auto mask_tag) {
    constexpr bool kMask = decltype(mask_tag)::value;
    // Tile t (and Q) has landed for this thread; the barrier publishes every thread's copies and
    // proves that all warps finished tile t - 1, whose stage the next copy overwrites.
    tc::cp_async_wait<kStages - 2>();
    __syncthreads();
    if (t + kStages - 1 < n_iters) load_kv(t + kStages - 1);
    tc::cp_async_commit();

    const int stage = t % kStages;
    const char* k_tile = smem_k + stage * Tr::kKVTileBytes;
    const char* v_tile = smem_v + stage * Tr::kKVTileBytes;
    const int n_block = n_blocks - 1 - t;

    // S = Q K^T for this warp's rows, fp32.
    float s[kMTiles][kSTiles][4];
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
      for (int j = 0; j < kSTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mi][j][e] = 0.f;
      }
    }
#pragma unroll
    for (int kk = 0; kk < kQKSteps; ++kk) {
      uint32_t a[kMTiles][4];
#pragma unroll
      for (int mi = 0; mi < kMTiles; ++mi) {
        if constexpr (Tr::kQInRegs) {
#pragma unroll
          for (int e = 0; e < 4; ++e) a[mi][e] = q_frag[mi][kk][e];
        } else {
          tc::ldmatrix_x4(a[mi], q_warp + mi * 16 * kPitch + kk * 32);
        }
      }
#pragma unroll
      for (int np = 0; np < kBlockN / 16; ++np) {
        uint32_t b[4];
        tc::ldmatrix_x4(b, k_tile + k_lane_off + np * 16 * kPitch + kk * 32);
        const uint32_t b_lo[2] = {b[0], b[1]};
        const uint32_t b_hi[2] = {b[2], b[3]};
#pragma unroll
        for (int mi = 0; mi < kMTiles; ++mi) {
          tc::mma_16816<T>(s[mi][2 * np], a[mi], b_lo);
          tc::mma_16816<T>(s[mi][2 * np + 1], a[mi], b_hi);
        }
      }
    }

    if constexpr (kMask) {
      // Only the key block holding seqlen_k and the causal diagonal blocks come here.
      const int col0 = n_block * kBlockN + c;
#pragma unroll
      for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          int col_end = sk;
          if constexpr (kCausal) col_end = min(sk, row_base + mi * 16 + 8 * h + (sk - sq) + 1);
#pragma unroll
          for (int j = 0; j < kSTiles; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              if (col0 + 8 * j + e >= col_end) s[mi][j][2 * h + e] = kNegInf;
            }
          }
        }
      }
    }

    // Online softmax in base 2 (Algorithm 1, lines 9-10): p = 2^(s * scale_log2 - m) is one FMA
    // and one ex2. m is a per-row reference that only moves when the block max exceeds it by
    // more than kRescaleSlack (FlashAttention-4's conditional rescale): in between, p <= 2^slack,
    // harmless in fp32 sums and in fp16/bf16 P, and the O rescale (kOTiles * 4 multiplies per
    // thread) is skipped. The final O / rowsum and lse are exact for any reference. A row that
    // has seen only masked keys keeps m = -inf; 0 then stands in as the subtraction point, so
    // p = 2^-inf = 0 instead of NaN. Max and sum use pairwise trees for short dependency chains.
    float m_blk[kMTiles][2];
    bool grow = false;
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx[kSTiles];
#pragma unroll
        for (int j = 0; j < kSTiles; ++j) mx[j] = fmaxf(s[mi][j][2 * h], s[mi][j][2 * h + 1]);
#pragma unroll
        for (int w = 1; w < kSTiles; w *= 2) {
#pragma unroll
          for (int j = 0; j + w < kSTiles; j += 2 * w) mx[j] = fmaxf(mx[j], mx[j + w]);
        }
        float m = mx[0];
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
        m_blk[mi][h] = m * scale_log2;
        grow |= m_blk[mi][h] > m_ref[mi][h] + kRescaleSlack;
      }
    }
    if (__any_sync(0xffffffffu, grow)) {
#pragma unroll
      for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float m_new = fmaxf(m_ref[mi][h], m_blk[mi][h]);
          const float rescale = tc::fast_exp2(m_ref[mi][h] - (m_new == kNegInf ? 0.f : m_new));
          m_ref[mi][h] = m_new;
          row_sum[mi][h] *= rescale;
#pragma unroll
          for (int j = 0; j < kOTiles; ++j) {
            acc_o[mi][j][2 * h] *= rescale;
            acc_o[mi][j][2 * h + 1] *= rescale;
          }
        }
      }
    }
    uint32_t p[kMTiles][kPVSteps][4];
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float m_sub = m_ref[mi][h] == kNegInf ? 0.f : m_ref[mi][h];
        float sum[kSTiles];
#pragma unroll
        for (int j = 0; j < kSTiles; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            s[mi][j][2 * h + e] = tc::fast_exp2(fmaf(s[mi][j][2 * h + e], scale_log2, -m_sub));
          }
          sum[j] = s[mi][j][2 * h] + s[mi][j][2 * h + 1];
        }
#pragma unroll
        for (int w = 1; w < kSTiles; w *= 2) {
#pragma unroll
          for (int j = 0; j + w < kSTiles; j += 2 * w) sum[j] += sum[j + w];
        }
        row_sum[mi][h] += sum[0];
      }
      // S accumulator tiles 2kk and 2kk+1 (keys 16kk + c.., 16kk + 8 + c..) are exactly the
      // A fragment of PV's k step kk: a0 = (g, keys c..c+1) = tile 2kk's c0 c1, a1 = (g + 8, c..)
      // = tile 2kk's c2 c3, a2/a3 the same from tile 2kk + 1.
#pragma unroll
      for (int kk = 0; kk < kPVSteps; ++kk) {
        p[mi][kk][0] = tc::pack2<T>(s[mi][2 * kk][0], s[mi][2 * kk][1]);
        p[mi][kk][1] = tc::pack2<T>(s[mi][2 * kk][2], s[mi][2 * kk][3]);
        p[mi][kk][2] = tc::pack2<T>(s[mi][2 * kk + 1][0], s[mi][2 * kk + 1][1]);
        p[mi][kk][3] = tc::pack2<T>(s[mi][2 * kk + 1][2], s[mi][2 * kk + 1][3]);
      }
    }

    // O += P V.
#pragma unroll
    for (int kk = 0; kk < kPVSteps; ++kk) {
#pragma unroll
      for (int dp = 0; dp < Tr::kHeadDim / 16; ++dp) {
        uint32_t b[4];
        tc::ldmatrix_x4_trans(b, v_tile + qv_lane_off + kk * 16 * kPitch + dp * 32);
        const uint32_t b_lo[2] = {b[0], b[1]};
        const uint32_t b_hi[2] = {b[2], b[3]};
#pragma unroll
        for (int mi = 0; mi < kMTiles; ++mi) {
          tc::mma_16816<T>(acc_o[mi][2 * dp], p[mi][kk], b_lo);
          tc::mma_16816<T>(acc_o[mi][2 * dp + 1], p[mi][kk], b_hi);
        }
      }
    }
  };

  int t = 0;
  for (; t < n_masked; ++t) iteration(t, std::integral_constant<bool, true>{});
  for (; t < n_iters; ++t) iteration(t, std::integral_constant<bool, false>{});

  // Epilogue: O = acc / rowsum. Each warp stages its rows in its own rows of the Q tile, which no
  // other warp reads and no copy targets any more, then writes whole 16-byte chunks, so a row
  // goes out as contiguous head_dim * 2 bytes. The __syncwarp orders this warp's last ldmatrix of
  // Q before the overwrite.
  constexpr float kLn2 = 0.6931471805599453f;
  __syncwarp();
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float sum = row_sum[mi][h];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      // sum > 0 iff the row saw a key (the max term contributes 2^0); otherwise O = 0, lse = -inf.
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
      const int row_local = warp * Tr::kRowsPerWarp + mi * 16 + g + 8 * h;
      if (lane % 4 == 0 && m0 + row_local < sq) {
        lse_head[m0 + row_local] = sum > 0.f ? (m_ref[mi][h] + log2f(sum)) * kLn2 : kNegInf;
      }
      char* srow = smem_q + row_local * kPitch + c * 2;
#pragma unroll
      for (int j = 0; j < kOTiles; ++j) {
        *reinterpret_cast<uint32_t*>(srow + j * 16) =
            tc::pack2<T>(acc_o[mi][j][2 * h] * inv, acc_o[mi][j][2 * h + 1] * inv);
      }
    }
  }
  __syncwarp();
  constexpr int kWarpChunks = Tr::kRowsPerWarp * kChunksPerRow;
  static_assert(kWarpChunks % 32 == 0, "the O store sweeps whole warps");
#pragma unroll
  for (int it = 0; it < kWarpChunks / 32; ++it) {
    const int i = it * 32 + lane;
    const int row_local = warp * Tr::kRowsPerWarp + i / kChunksPerRow;
    const int chunk = i % kChunksPerRow;
    const uint4 val = *reinterpret_cast<const uint4*>(smem_q + row_local * kPitch + chunk * 16);
    const int row = m0 + row_local;
    if (row < sq) {
      *reinterpret_cast<uint4*>(o_head + row * args.q_row_stride + chunk * 8) = val;
    }
  }
}

// Launches fwd_kernel<Tr, kCausal>; params are validated by the dispatcher.
template <typename Tr, bool kCausal>
cudaError_t launch_fwd(const FwdParams& params, cudaStream_t stream) {
  const auto kernel = fwd_kernel<Tr, kCausal>;
  if constexpr (Tr::kSmemBytes > 48 * 1024) {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes);
    if (err != cudaSuccess) return err;
  }
  FwdArgs args;
  args.q = params.q;
  args.k = params.k;
  args.v = params.v;
  args.o = params.o;
  args.lse = static_cast<float*>(params.lse);
  args.q_row_stride = params.heads_q * Tr::kHeadDim;
  args.kv_row_stride = params.heads_kv * Tr::kHeadDim;
  args.q_batch_stride = params.seqlen_q * args.q_row_stride;
  args.kv_batch_stride = params.seqlen_k * args.kv_row_stride;
  args.seqlen_q = static_cast<int>(params.seqlen_q);
  args.seqlen_k = static_cast<int>(params.seqlen_k);
  args.heads_q = static_cast<int>(params.heads_q);
  args.q_per_kv = static_cast<int>(params.heads_q / params.heads_kv);
  const int64_t num_m_blocks = (params.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM;
  args.num_m_blocks = static_cast<int>(num_m_blocks);
  args.scale_log2 = static_cast<float>(params.softmax_scale * 1.4426950408889634);
  const int64_t grid = num_m_blocks * params.heads_q * params.batch;
  if (grid > INT_MAX) return cudaErrorInvalidValue;
  kernel<<<static_cast<unsigned>(grid), Tr::kNThreads, Tr::kSmemBytes, stream>>>(args);
  return cudaGetLastError();
}

// The forward for one (dtype, head_dim, causal) with the tile fwd_tile(head_dim).
template <typename T, int kHeadDim, bool kCausal>
cudaError_t run_fwd(const FwdParams& params, cudaStream_t stream) {
  return launch_fwd<FwdTraitsFor<T, kHeadDim>, kCausal>(params, stream);
}

// Declared here and defined once in fwd_tc_hdim{64,128,256}.cu, one file per head_dim.
#define JAX_FLASH_FWD_TC_EXTERN(T, D)                                               \
  extern template cudaError_t run_fwd<T, D, false>(const FwdParams&, cudaStream_t); \
  extern template cudaError_t run_fwd<T, D, true>(const FwdParams&, cudaStream_t);
JAX_FLASH_FWD_TC_EXTERN(__half, 64)
JAX_FLASH_FWD_TC_EXTERN(__half, 128)
JAX_FLASH_FWD_TC_EXTERN(__half, 256)
JAX_FLASH_FWD_TC_EXTERN(__nv_bfloat16, 64)
JAX_FLASH_FWD_TC_EXTERN(__nv_bfloat16, 128)
JAX_FLASH_FWD_TC_EXTERN(__nv_bfloat16, 256)
#undef JAX_FLASH_FWD_TC_EXTERN

}  // namespace jax_flash::cuda::fwd_tc
