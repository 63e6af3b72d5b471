// What the two tensor-core split passes of the decode call (decode_tc.cuh: a cp.async ring filled
// by every thread; decode_tma.cuh: a TMA ring filled by a copy warp) have in common: the tile
// shapes, the block's share of the work, and one warp's math on a landed K/V tile, from the scores
// to its part of the epilogue. The two passes differ only in how a tile reaches shared memory and
// where its bytes sit there (a `Tiles` layout below).
//
// GQA packing. The G = heads_q / heads_kv query heads that share one KV head, times the seqlen_q
// query positions, form the M dimension of one problem: packed row r is query position r / G of
// query head kv_head * G + r % G. So one thread block reads each K/V byte of its key range once for
// all G * seqlen_q rows (the floor of a decode is reading the cache once), and the rows of one
// query position are adjacent, which keeps a row's query index a single division.
//
// Work split. One block owns (sequence, KV head, split, block of kBlockM packed rows). Its keys
// stream through a kStages-deep ring of kBlockN-key K/V tiles; the math warps take 16 keys of each
// tile apiece, each with its own online-softmax state over all the block's rows, so no warp waits
// on another inside the key loop. The warps' (m, l, O) are merged once, through shared memory, in
// the epilogue. Decode does ~1 FLOP per byte, so the design goal is bytes in flight, not
// tensor-core occupancy: kStages - 1 tiles (64-96 KB) are in flight per block and two blocks share
// an SM at head_dim 64/128.
//
// Fragment layouts are fwd_tc.cuh's (PTX ISA, mma.m16n8k16, g = lane / 4, c = 2 * (lane % 4)).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>

#include "common/decode_params.h"
#include "cuda/tc_primitives.cuh"

namespace jax_flash::cuda::decode {

// The tile shapes of one (dtype, padded head_dim, m16 tiles per block, compact) configuration.
//  - kBlockN = 64 keys: four warps x 16 keys, the k16 step of PV. It is also the split granule.
//  - kStages: as deep as two blocks per SM allow at head_dim 64 / 128 (233472 B per SM, 1 KB
//    reserved per block): d64 5 x 18 KB, d128 3 x 34 KB; d256 3 x 66 KB with one block per SM.
//  - kCompact: the fallback for GPUs with less shared memory per block than these need (sm_80:
//    163 KB, sm_86 / sm_89: 99 KB): two stages, and at d256 two warps (32-key tiles), so that
//    every configuration fits 99 KB.
template <typename T_, int kHeadDim_, int kMTiles_, bool kCompact_ = false>
struct TcTraits {
  using T = T_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kMTiles = kMTiles_;
  static constexpr bool kCompact = kCompact_;
  static constexpr int kNWarps = kCompact && kHeadDim == 256 ? 2 : 4;  // math warps
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kKeysPerWarp = 16;
  static constexpr int kBlockN = kNWarps * kKeysPerWarp;
  static constexpr int kBlockM = 16 * kMTiles;
  static constexpr int kStages = kCompact ? 2 : (kHeadDim == 64 ? 5 : 3);
  static constexpr int kMinBlocks = kHeadDim == 256 || kCompact ? 1 : 2;

  static constexpr int kOTiles = kHeadDim / 8;    // n8 tiles of O per m16 tile
  static constexpr int kQKSteps = kHeadDim / 16;  // k16 steps of QK^T
  // Padded tiles (Q always; K/V in the cp.async ring) are row-major with a 16-byte pad per row
  // (see fwd_tc.cuh: the eight rows of an ldmatrix phase then hit distinct banks).
  static constexpr int kRowBytes = kHeadDim * 2;
  static constexpr int kPitch = kRowBytes + 16;
  static constexpr int kChunksPerRow = kRowBytes / 16;
  static constexpr int kQBytes = kBlockM * kPitch;
  // Epilogue: each warp's scaled O rows in fp32, reusing the ring. A pitch of head_dim + 8
  // floats puts the 16 lanes of one float2-store phase (rows g, columns c) on distinct banks.
  static constexpr int kOPitch = kHeadDim + 8;
  static constexpr int kOBufBytes = kNWarps * kBlockM * kOPitch * 4;
  // Per-warp (m, l) of every row, then each row's merged reference point and 1 / l.
  static constexpr int kStatBytes = (2 * kNWarps + 2) * kBlockM * 4;

  // The cp.async ring (decode_tc.cuh): padded K and V tiles.
  static constexpr int kRowsPerPass = kNThreads / kChunksPerRow;
  static constexpr int kLoadRows = kBlockN / kRowsPerPass;  // K (and V) rows a thread copies
  static constexpr int kStageBytes = 2 * kBlockN * kPitch;  // K tile, then V tile
  static constexpr int kRingBytes = kStages * kStageBytes;
  static constexpr int kSmemBytes = kQBytes + kRingBytes + kStatBytes;

  // Whether the TMA pass (decode_tma.cuh) serves this configuration: full-depth tiles only, and
  // not two m16 tiles at head_dim 128, whose ~210 registers a thread do not fit two blocks of
  // kTmaThreads (three of their warps share an SM sub-partition: ptxas caps them at 168 and
  // spills).
  static constexpr bool kTma = !kCompact && !(kHeadDim == 128 && kMTiles == 2);
  // The TMA ring: swizzled K and V tiles (SwizzledTiles), then Q, the stats and
  // one full and one empty mbarrier per stage; 1 KB of slack to round the base up to the swizzle
  // period.
  static constexpr int kTmaTileBytes = kBlockN * kRowBytes;
  static constexpr int kTmaStageBytes = 2 * kTmaTileBytes;
  static constexpr int kTmaRingBytes = kStages * kTmaStageBytes;
  static constexpr int kTmaThreads = kNThreads + 32;  // the math warps and one copy warp
  static constexpr int kTmaSmemBytes = kTmaRingBytes + kQBytes + kStatBytes + 16 * kStages + 1024;

  static_assert(sizeof(T) == 2, "tensor-core path is fp16/bf16 only");
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "padded head_dim");
  static_assert(kNThreads % kChunksPerRow == 0 && kBlockN % kRowsPerPass == 0,
                "a cp.async sweep covers whole rows and a tile whole sweeps");
  static_assert(kStages >= 2, "the ring needs a tile in flight while one is computed");
  static_assert(kOBufBytes <= kRingBytes && (!kTma || kOBufBytes <= kTmaRingBytes),
                "the epilogue's O buffer reuses the ring");
  static_assert(kMinBlocks * (kSmemBytes + 1024) <= 233472, "resident blocks exceed sm_90 smem");
  static_assert(!kTma || kMinBlocks * (kTmaSmemBytes + 1024) <= 233472,
                "resident TMA blocks exceed sm_90 smem");
  static_assert(!kTma || kTmaTileBytes % 1024 == 0,
                "TMA tiles must stay on the 1024-byte swizzle period");
  static_assert(!kCompact || kSmemBytes <= 101376, "compact tiles must fit sm_86's 99 KB");
  static_assert(kBlockM <= kNThreads, "one thread merges each row's warp states");
};

// Scalars derived once on the host.
struct TcArgs {
  float scale_log2;  // softmax_scale * log2(e), or with a softcap c, c * log2(e)
  float cap_scale;   // softmax_scale / c (softcap only)
  bool softcap;
  int group;     // G = heads_q / heads_kv
  int rows;      // G * seqlen_q packed rows per (sequence, KV head)
  int m_blocks;  // ceil(rows / kBlockM)
  int box_rows;  // TMA ring only: key rows per tensor-map box (kBlockN, or a page's share of it)
};

// Byte offset of 16-byte chunk `chunk` of key row `row` in a K or V tile of the cp.async ring.
template <typename Tr>
struct PaddedTiles {
  __device__ __forceinline__ static uint32_t offset(int row, int chunk) {
    return static_cast<uint32_t>(row * Tr::kPitch + chunk * 16);
  }
};

// The same for the TMA ring, which stores a tile as the tensor maps' 128-byte swizzle writes it
// (sm90_host.h): kHeadDim / 64 panels of kBlockN rows x 128 bytes, and inside a panel chunk c of
// row r at c ^ (r % 8). The eight rows of an ldmatrix phase then hit distinct banks without a pad.
template <typename Tr>
struct SwizzledTiles {
  __device__ __forceinline__ static uint32_t offset(int row, int chunk) {
    return static_cast<uint32_t>((chunk / 8) * (Tr::kBlockN * 128) + row * 128 +
                                 (((chunk % 8) ^ (row % 8)) * 16));
  }
};

// The block's place in the grid and its share of the keys.
struct BlockWork {
  int64_t b;    // sequence
  int kv_head;  // KV head
  int split;
  int r0, r1;          // packed rows [r0, r1)
  int seqlen_k;        // keys the sequence holds
  int t_begin, t_end;  // key tiles [t_begin, t_end) of kBlockN keys
  SeqMask mask;
};

template <typename Tr>
__device__ __forceinline__ BlockWork block_work(const DecodeParams& p, const TcArgs& a) {
  constexpr int kBlockN = Tr::kBlockN;
  BlockWork w;
  // Row blocks of one (sequence, KV head, split) are adjacent in launch order so that they read
  // the same K/V through L2.
  int64_t bid = blockIdx.x;
  const int mb = static_cast<int>(bid % a.m_blocks);
  bid /= a.m_blocks;
  w.split = static_cast<int>(bid % p.num_splits);
  bid /= p.num_splits;
  w.kv_head = static_cast<int>(bid % p.heads_kv);
  w.b = bid / p.heads_kv;
  const int seqlen_q = static_cast<int>(p.seqlen_q);
  w.seqlen_k = static_cast<int>(p.seqlen_k(w.b));
  w.mask = p.mask.band.for_seq(seqlen_q, w.seqlen_k);
  w.r0 = mb * Tr::kBlockM;
  w.r1 = min(w.r0 + Tr::kBlockM, a.rows);
  // The block's keys: its split's share of the keys any row of the sequence sees, narrowed to
  // what the block's own query positions [i0, i1) see. Split boundaries are multiples of kBlockN,
  // so tiles are aligned to kBlockN and none straddles two splits.
  const int64_t lo = w.mask.key_begin(0);
  const int64_t hi = w.mask.key_end(seqlen_q);
  const int i0 = w.r0 / a.group;
  const int i1 = (w.r1 - 1) / a.group + 1;
  const int64_t sb = p.split_begin(w.split, lo, hi, kBlockN);
  const int64_t se = p.split_begin(w.split + 1, lo, hi, kBlockN);
  const int64_t kb = sb > w.mask.key_begin(i0) ? sb : w.mask.key_begin(i0);
  const int64_t ke = se < w.mask.key_end(i1) ? se : w.mask.key_end(i1);
  w.t_begin = static_cast<int>(kb / kBlockN);
  w.t_end = ke > kb ? static_cast<int>((ke + kBlockN - 1) / kBlockN) : w.t_begin;
  return w;
}

// The block's query rows into the padded Q tile, as cp.async copies of the math threads (`tid` <
// kNThreads); rows past r1 and columns past head_dim are zero-filled.
template <typename Tr>
__device__ __forceinline__ void load_q(const DecodeParams& p, const TcArgs& a, const BlockWork& w,
                                       char* smem_q, int tid) {
  using T = typename Tr::T;
  constexpr int kChunksPerRow = Tr::kChunksPerRow;
  const T* q = static_cast<const T*>(p.q);
  constexpr int kQChunks = Tr::kBlockM * kChunksPerRow;
  for (int x = tid; x < kQChunks; x += Tr::kNThreads) {
    const int rl = x / kChunksPerRow;
    const int ch = x % kChunksPerRow;
    const int r = w.r0 + rl;
    const bool valid = r < w.r1 && ch * 8 < p.head_dim;
    const int i = r / a.group;
    const int64_t head = static_cast<int64_t>(w.kv_head) * a.group + r % a.group;
    const int64_t off =
        valid ? ((w.b * p.seqlen_q + i) * p.heads_q + head) * p.head_dim + ch * 8 : 0;
    tc::cp_async_16(smem_q + rl * Tr::kPitch + ch * 16, q + off, valid);
  }
}

// One math warp's online-softmax state over all the block's rows, and its steps.
template <typename Tr>
struct WarpState {
  using T = typename Tr::T;
  static constexpr int kMTiles = Tr::kMTiles;
  static constexpr float kNegInf = -INFINITY;

  float acc_o[kMTiles][Tr::kOTiles][4];
  float m_run[kMTiles][2];    // running max of s * scale_log2 (base 2), -inf before any key
  float row_sum[kMTiles][2];  // this thread's share of the row sum; the quad reduces it once
  // Keys [key_lo, key_hi) are the ones row (mi, h) of this thread sees (SeqMask::key_begin /
  // key_end of its query position); padding rows past r1 see none.
  int key_lo[kMTiles][2];
  int key_hi[kMTiles][2];
  // This lane's ldmatrix address in the padded Q tile (fwd_tc.cuh: row l % 16, chunk l / 16), and
  // the k16 steps that hold real head-dim columns (all of them unless head_dim is padded).
  const char* q_lane;
  int qk_steps;

  __device__ __forceinline__ void init(const DecodeParams& p, const TcArgs& a, const BlockWork& w,
                                       const char* smem_q, int lane) {
    const int g = lane / 4;
    q_lane = smem_q + (lane % 16) * Tr::kPitch + (lane / 16) * 16;
    qk_steps = (static_cast<int>(p.head_dim) + 15) / 16;
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
      for (int j = 0; j < Tr::kOTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_o[mi][j][e] = 0.f;
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        m_run[mi][h] = kNegInf;
        row_sum[mi][h] = 0.f;
        const int r = w.r0 + mi * 16 + g + 8 * h;
        const int i = r / a.group;
        key_lo[mi][h] = r < w.r1 ? static_cast<int>(w.mask.key_begin(i)) : 0;
        key_hi[mi][h] = r < w.r1 ? static_cast<int>(w.mask.key_end(i + 1)) : 0;
      }
    }
  }

  // Warp `warp`'s 16 keys of key tile `tile`, landed in `k_tile` and `v_tile` as `Tiles` lays
  // them out: rows [warp_row, warp_row + 16) of the tile, keys key0 .. key0 + 15.
  template <typename Tiles>
  __device__ __forceinline__ void attend(const TcArgs& a, const char* k_tile, const char* v_tile,
                                         int tile, int warp, int lane) {
    const int warp_row = warp * Tr::kKeysPerWarp;
    const int key0 = tile * Tr::kBlockN + warp_row;
    const int c = 2 * (lane % 4);
    // ldmatrix lane addresses (fwd_tc.cuh): V as Q (row l % 16, chunk l / 16), K as (row
    // l % 8 + 8 * (l / 16), chunk (l / 8) % 2), so every operand is a contiguous register run.
    const int k_row = warp_row + lane % 8 + (lane / 16) * 8;
    const int k_chunk = (lane / 8) % 2;
    const int v_row = warp_row + lane % 16;
    const int v_chunk = lane / 16;

    // S = Q K^T for this warp's 16 keys, fp32.
    float s[kMTiles][2][4];
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mi][0][e] = s[mi][1][e] = 0.f;
    }
#pragma unroll
    for (int kk = 0; kk < Tr::kQKSteps; ++kk) {
      if (kk < qk_steps) {
        uint32_t bk[4];
        tc::ldmatrix_x4(bk, k_tile + Tiles::offset(k_row, 2 * kk + k_chunk));
        const uint32_t b_lo[2] = {bk[0], bk[1]};
        const uint32_t b_hi[2] = {bk[2], bk[3]};
#pragma unroll
        for (int mi = 0; mi < kMTiles; ++mi) {
          uint32_t qa[4];
          tc::ldmatrix_x4(qa, q_lane + mi * 16 * Tr::kPitch + kk * 32);
          tc::mma_16816<T>(s[mi][0], qa, b_lo);
          tc::mma_16816<T>(s[mi][1], qa, b_hi);
        }
      }
    }

    // Soft-capping, the element mask and the online softmax in base 2. Every tile is masked: the
    // test is two compares per score, nothing next to the tile's copy time, and it covers the
    // band's edges, the sequence end and the padding rows alike. A row that has seen no visible
    // key keeps m = -inf; 0 then stands in as the subtraction point so that p = 2^-inf = 0.
    uint32_t pa[kMTiles][4];
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = kNegInf;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float x = s[mi][j][2 * h + e];
            if (a.softcap) x = tc::fast_tanh(x * a.cap_scale);
            const int key = key0 + 8 * j + c + e;
            x = key >= key_lo[mi][h] && key < key_hi[mi][h] ? x * a.scale_log2 : kNegInf;
            s[mi][j][2 * h + e] = x;
            mx = fmaxf(mx, x);
          }
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m_run[mi][h], mx);
        const float m_sub = m_new == kNegInf ? 0.f : m_new;
        const float rescale = tc::fast_exp2(m_run[mi][h] - m_sub);
        m_run[mi][h] = m_new;
        float sum = row_sum[mi][h] * rescale;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float pe = tc::fast_exp2(s[mi][j][2 * h + e] - m_sub);
            s[mi][j][2 * h + e] = pe;
            sum += pe;
          }
        }
        row_sum[mi][h] = sum;
#pragma unroll
        for (int j = 0; j < Tr::kOTiles; ++j) {
          acc_o[mi][j][2 * h] *= rescale;
          acc_o[mi][j][2 * h + 1] *= rescale;
        }
      }
      // The two S tiles (keys c.., 8 + c..) are exactly PV's A fragment for these 16 keys.
      pa[mi][0] = tc::pack2<T>(s[mi][0][0], s[mi][0][1]);
      pa[mi][1] = tc::pack2<T>(s[mi][0][2], s[mi][0][3]);
      pa[mi][2] = tc::pack2<T>(s[mi][1][0], s[mi][1][1]);
      pa[mi][3] = tc::pack2<T>(s[mi][1][2], s[mi][1][3]);
    }

    // O += P V over this warp's 16 keys.
#pragma unroll
    for (int dp = 0; dp < Tr::kHeadDim / 16; ++dp) {
      if (dp < qk_steps) {
        uint32_t bv[4];
        tc::ldmatrix_x4_trans(bv, v_tile + Tiles::offset(v_row, 2 * dp + v_chunk));
        const uint32_t b_lo[2] = {bv[0], bv[1]};
        const uint32_t b_hi[2] = {bv[2], bv[3]};
#pragma unroll
        for (int mi = 0; mi < kMTiles; ++mi) {
          tc::mma_16816<T>(acc_o[mi][2 * dp], pa[mi], b_lo);
          tc::mma_16816<T>(acc_o[mi][2 * dp + 1], pa[mi], b_hi);
        }
      }
    }
  }

  // The epilogue, for the kNThreads math threads (`tid` < kNThreads): merges the warps' states
  // per row (and, with one split, the sink: one extra logit in the denominator, counted once
  // here), writes lse (natural log of the row's sum of exp(scaled, capped score)) and O, or the
  // split's partials. A row with no visible key and no sink has l = 0: lse = -inf, O = 0.
  // `smem_stats` holds Tr::kStatBytes; `obuf` (Tr::kOBufBytes) is the ring, which must hold no
  // pending copy once `sync_math()` has passed. sync_math() is a barrier of the math threads.
  template <typename SyncMath>
  __device__ __forceinline__ void finish(const DecodeParams& p, const TcArgs& a, const BlockWork& w,
                                         char* smem_stats, float* obuf, int tid,
                                         SyncMath sync_math) {
    constexpr int kBlockM = Tr::kBlockM;
    constexpr int kNWarps = Tr::kNWarps;
    constexpr float kLog2e = 1.4426950408889634f;
    constexpr float kLn2 = 0.6931471805599453f;
    const int lane = tid % 32;
    const int warp = tid / 32;
    const int g = lane / 4;
    const int c = 2 * (lane % 4);
    float* stat_m = reinterpret_cast<float*>(smem_stats);  // [kNWarps][kBlockM]
    float* stat_l = stat_m + kNWarps * kBlockM;            // [kNWarps][kBlockM]
    float* row_ref = stat_l + kNWarps * kBlockM;           // [kBlockM]
    float* row_inv = row_ref + kBlockM;                    // [kBlockM]

    // 1: every warp publishes its rows' (m, l).
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float sum = row_sum[mi][h];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        if (lane % 4 == 0) {
          const int rl = mi * 16 + g + 8 * h;
          stat_m[warp * kBlockM + rl] = m_run[mi][h];
          stat_l[warp * kBlockM + rl] = sum;
        }
      }
    }
    sync_math();

    // 2: one thread per row merges the warps' states and writes lse.
    const bool single = p.num_splits == 1;
    if (tid < kBlockM) {
      const int rl = tid;
      const int r = w.r0 + rl;
      float m_tot = kNegInf;
#pragma unroll
      for (int x = 0; x < kNWarps; ++x) m_tot = fmaxf(m_tot, stat_m[x * kBlockM + rl]);
      const int i = r / a.group;
      const int64_t head = static_cast<int64_t>(w.kv_head) * a.group + r % a.group;
      float sink = kNegInf;
      if (single && p.mask.sinks != nullptr && r < w.r1) {
        sink = static_cast<const float*>(p.mask.sinks)[w.b * p.mask.sinks_batch_stride + head] *
               kLog2e;
        m_tot = fmaxf(m_tot, sink);
      }
      const float ref = m_tot == kNegInf ? 0.f : m_tot;
      float l_tot = exp2f(sink - ref);
#pragma unroll
      for (int x = 0; x < kNWarps; ++x) {
        l_tot += stat_l[x * kBlockM + rl] * exp2f(stat_m[x * kBlockM + rl] - ref);
      }
      row_ref[rl] = ref;
      row_inv[rl] = l_tot > 0.f ? 1.f / l_tot : 0.f;
      if (r < w.r1) {
        const float lse = l_tot > 0.f ? (m_tot + log2f(l_tot)) * kLn2 : kNegInf;
        if (single) {
          static_cast<float*>(p.lse)[(w.b * p.heads_q + head) * p.seqlen_q + i] = lse;
        } else {
          static_cast<float*>(
              p.partial_lse)[((w.b * p.num_splits + w.split) * p.heads_q + head) * p.seqlen_q + i] =
              lse;
        }
      }
    }
    sync_math();

    // 3: each warp stores its O rows scaled to the merged reference and divided by l.
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int rl = mi * 16 + g + 8 * h;
        const float f = tc::fast_exp2(m_run[mi][h] - row_ref[rl]) * row_inv[rl];
        float* dst = obuf + (warp * kBlockM + rl) * Tr::kOPitch + c;
#pragma unroll
        for (int j = 0; j < Tr::kOTiles; ++j) {
          *reinterpret_cast<float2*>(dst + 8 * j) =
              make_float2(acc_o[mi][j][2 * h] * f, acc_o[mi][j][2 * h + 1] * f);
        }
      }
    }
    sync_math();

    // 4: sum the warps and write 8 columns (16 bytes of T, or 32 of fp32 partials) per thread;
    // columns at or past head_dim are never written.
    constexpr int kOutChunks = kBlockM * (Tr::kHeadDim / 8);
    for (int x = tid; x < kOutChunks; x += Tr::kNThreads) {
      const int rl = x / (Tr::kHeadDim / 8);
      const int ch = x % (Tr::kHeadDim / 8);
      const int r = w.r0 + rl;
      if (r >= w.r1 || ch * 8 >= p.head_dim) continue;
      float out[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) out[e] = 0.f;
#pragma unroll
      for (int y = 0; y < kNWarps; ++y) {
        const float* src = obuf + (y * kBlockM + rl) * Tr::kOPitch + ch * 8;
        const float4 u = *reinterpret_cast<const float4*>(src);
        const float4 v = *reinterpret_cast<const float4*>(src + 4);
        out[0] += u.x, out[1] += u.y, out[2] += u.z, out[3] += u.w;
        out[4] += v.x, out[5] += v.y, out[6] += v.z, out[7] += v.w;
      }
      const int i = r / a.group;
      const int64_t head = static_cast<int64_t>(w.kv_head) * a.group + r % a.group;
      if (single) {
        T* dst = static_cast<T*>(p.o) + ((w.b * p.seqlen_q + i) * p.heads_q + head) * p.head_dim +
                 ch * 8;
        uint4 packed;
        packed.x = tc::pack2<T>(out[0], out[1]);
        packed.y = tc::pack2<T>(out[2], out[3]);
        packed.z = tc::pack2<T>(out[4], out[5]);
        packed.w = tc::pack2<T>(out[6], out[7]);
        *reinterpret_cast<uint4*>(dst) = packed;
      } else {
        float* dst =
            static_cast<float*>(p.partial_o) +
            (((w.b * p.num_splits + w.split) * p.heads_q + head) * p.seqlen_q + i) * p.head_dim +
            ch * 8;
        *reinterpret_cast<float4*>(dst) = make_float4(out[0], out[1], out[2], out[3]);
        *reinterpret_cast<float4*>(dst + 4) = make_float4(out[4], out[5], out[6], out[7]);
      }
    }
  }
};

}  // namespace jax_flash::cuda::decode
