// Tensor-core split pass of the decode call (common/decode_params.h) for fp16/bf16: split-KV
// "flash-decoding" on mma.sync m16n8k16 with fp32 accumulation.
//
// GQA packing. The G = heads_q / heads_kv query heads that share one KV head, times the seqlen_q
// query positions, form the M dimension of one problem: packed row r is query position r / G of
// query head kv_head * G + r % G. So one thread block reads each K/V byte of its key range once for
// all G * seqlen_q rows (the floor of a decode is reading the cache once), and the rows of one
// query position are adjacent, which keeps a row's query index a single division.
//
// Work split. One block owns (sequence, KV head, split, block of kBlockM packed rows). Its keys
// stream through a kStages-deep cp.async ring of kBlockN-key K/V tiles; the warps take 16
// keys of each tile apiece, each with its own online-softmax state over all the block's rows, so
// no warp waits on another inside the key loop. The warps' (m, l, O) are merged once, through
// shared memory, in the epilogue. Decode does ~1 FLOP per byte, so the design goal is bytes in
// flight, not tensor-core occupancy: kStages - 1 tiles (64-96 KB) are in flight per block and
// two blocks share an SM at head_dim 64/128.
//
// Paged caches. A key row's address is page * page_size + j % page_size (DecodeParams::key_row,
// done in 32-bit arithmetic here); each loading thread reads the block-table entries of its rows
// of tile t + 1 while it issues the copies of tile t, so the table lookup never stalls the copy
// issue. Rows of one key are head_dim * 2 contiguous bytes whatever the page size, so the 16-byte
// copies are the same for every layout.
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
#include "cuda/grid_dependency.cuh"
#include "cuda/kernel_attributes.h"
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
  static constexpr int kNWarps = kCompact && kHeadDim == 256 ? 2 : 4;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kKeysPerWarp = 16;
  static constexpr int kBlockN = kNWarps * kKeysPerWarp;
  static constexpr int kBlockM = 16 * kMTiles;
  static constexpr int kStages = kCompact ? 2 : (kHeadDim == 64 ? 5 : 3);
  static constexpr int kMinBlocks = kHeadDim == 256 || kCompact ? 1 : 2;

  static constexpr int kOTiles = kHeadDim / 8;    // n8 tiles of O per m16 tile
  static constexpr int kQKSteps = kHeadDim / 16;  // k16 steps of QK^T
  // Shared tiles are row-major with a 16-byte pad per row (see fwd_tc.cuh: the eight rows of an
  // ldmatrix phase then hit distinct banks).
  static constexpr int kRowBytes = kHeadDim * 2;
  static constexpr int kPitch = kRowBytes + 16;
  static constexpr int kChunksPerRow = kRowBytes / 16;
  static constexpr int kRowsPerPass = kNThreads / kChunksPerRow;
  static constexpr int kLoadRows = kBlockN / kRowsPerPass;  // K (and V) rows a thread copies
  static constexpr int kQBytes = kBlockM * kPitch;
  static constexpr int kStageBytes = 2 * kBlockN * kPitch;  // K tile, then V tile
  static constexpr int kRingBytes = kStages * kStageBytes;
  // Epilogue: each warp's scaled O rows in fp32, reusing the ring. A pitch of head_dim + 8
  // floats puts the 16 lanes of one float2-store phase (rows g, columns c) on distinct banks.
  static constexpr int kOPitch = kHeadDim + 8;
  static constexpr int kOBufBytes = kNWarps * kBlockM * kOPitch * 4;
  // Per-warp (m, l) of every row, then each row's merged reference point and 1 / l.
  static constexpr int kStatBytes = (2 * kNWarps + 2) * kBlockM * 4;
  static constexpr int kSmemBytes = kQBytes + kRingBytes + kStatBytes;

  static_assert(sizeof(T) == 2, "tensor-core path is fp16/bf16 only");
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "padded head_dim");
  static_assert(kNThreads % kChunksPerRow == 0 && kBlockN % kRowsPerPass == 0,
                "a cp.async sweep covers whole rows and a tile whole sweeps");
  static_assert(kStages >= 2, "the ring needs a tile in flight while one is computed");
  static_assert(kOBufBytes <= kRingBytes, "the epilogue's O buffer reuses the ring");
  static_assert(kMinBlocks * (kSmemBytes + 1024) <= 233472, "resident blocks exceed sm_90 smem");
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
};

// Block-table lookups of one thread's rows of the next tile to copy (paged caches only): the
// page, loaded early, and the row within it.
template <int kRows>
struct PageRows {
  int32_t page[kRows];
  int32_t offset[kRows];
};

template <typename Tr, bool kPaged>
__global__ void __launch_bounds__(Tr::kNThreads, Tr::kMinBlocks)
    decode_tc_kernel(const DecodeParams p, const TcArgs a) {
  using T = typename Tr::T;
  constexpr int kBlockN = Tr::kBlockN;
  constexpr int kBlockM = Tr::kBlockM;
  constexpr int kMTiles = Tr::kMTiles;
  constexpr int kStages = Tr::kStages;
  constexpr int kPitch = Tr::kPitch;
  constexpr int kChunksPerRow = Tr::kChunksPerRow;
  constexpr int kNWarps = Tr::kNWarps;
  constexpr float kNegInf = -INFINITY;
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr float kLn2 = 0.6931471805599453f;
  // The merge pass is launched as this grid's programmatic dependent: letting it launch as soon
  // as every block of this grid has started hides its launch latency (its blocks wait for this
  // grid's completion and memory before reading a partial). A no-op without a dependent.
  decode_allow_dependents();

  extern __shared__ uint4 smem_raw[];  // 16-byte alignment for cp.async and ldmatrix
  char* smem_q = reinterpret_cast<char*>(smem_raw);
  char* ring = smem_q + Tr::kQBytes;
  float* stat_m = reinterpret_cast<float*>(ring + Tr::kRingBytes);  // [kNWarps][kBlockM]
  float* stat_l = stat_m + kNWarps * kBlockM;                       // [kNWarps][kBlockM]
  float* row_ref = stat_l + kNWarps * kBlockM;                      // [kBlockM]
  float* row_inv = row_ref + kBlockM;                               // [kBlockM]
  float* obuf = reinterpret_cast<float*>(ring);  // [kNWarps][kBlockM][kOPitch], after the loop

  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int g = lane / 4;
  const int c = 2 * (lane % 4);

  // Row blocks of one (sequence, KV head, split) are adjacent in launch order so that they read
  // the same K/V through L2.
  int64_t bid = blockIdx.x;
  const int mb = static_cast<int>(bid % a.m_blocks);
  bid /= a.m_blocks;
  const int split = static_cast<int>(bid % p.num_splits);
  bid /= p.num_splits;
  const int kv_head = static_cast<int>(bid % p.heads_kv);
  const int64_t b = bid / p.heads_kv;

  const int seqlen_q = static_cast<int>(p.seqlen_q);
  const int seqlen_k = static_cast<int>(p.seqlen_k(b));
  const int head_dim = static_cast<int>(p.head_dim);
  const int group = a.group;
  const SeqMask mask = p.mask.band.for_seq(seqlen_q, seqlen_k);
  const int r0 = mb * kBlockM;
  const int r1 = min(r0 + kBlockM, a.rows);

  // This block's keys: its split's share of the keys any row of the sequence sees, narrowed to
  // what the block's own query positions [i0, i1) see. Split boundaries are multiples of kBlockN,
  // so tiles are aligned to kBlockN and none straddles two splits.
  int t_begin, t_end;
  {
    const int64_t lo = mask.key_begin(0);
    const int64_t hi = mask.key_end(seqlen_q);
    const int i0 = r0 / group;
    const int i1 = (r1 - 1) / group + 1;
    const int64_t sb = p.split_begin(split, lo, hi, kBlockN);
    const int64_t se = p.split_begin(split + 1, lo, hi, kBlockN);
    const int64_t kb = sb > mask.key_begin(i0) ? sb : mask.key_begin(i0);
    const int64_t ke = se < mask.key_end(i1) ? se : mask.key_end(i1);
    t_begin = static_cast<int>(kb / kBlockN);
    t_end = ke > kb ? static_cast<int>((ke + kBlockN - 1) / kBlockN) : t_begin;
  }
  const int n_tiles = t_end - t_begin;

  // Keys [key_lo, key_hi) are the ones row (mi, h) of this thread sees (SeqMask::key_begin /
  // key_end of its query position); padding rows past r1 see none.
  int key_lo[kMTiles][2];
  int key_hi[kMTiles][2];
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = r0 + mi * 16 + g + 8 * h;
      const int i = r / group;
      key_lo[mi][h] = r < r1 ? static_cast<int>(mask.key_begin(i)) : 0;
      key_hi[mi][h] = r < r1 ? static_cast<int>(mask.key_end(i + 1)) : 0;
    }
  }

  // cp.async assignment: chunk ld_chunk of rows ld_row + x * kRowsPerPass, so a warp reads whole
  // contiguous rows. Chunks at or past head_dim are zero-filled, never read.
  const int ld_chunk = tid % kChunksPerRow;
  const int ld_row = tid / kChunksPerRow;
  const bool chunk_valid = ld_chunk * 8 < head_dim;
  const uint32_t ld_smem_off = ld_row * kPitch + ld_chunk * 16;
  const int64_t kv_row_stride = p.heads_kv * p.head_dim;
  const T* k_base = static_cast<const T*>(p.k) + kv_head * p.head_dim + ld_chunk * 8;
  const T* v_base = static_cast<const T*>(p.v) + kv_head * p.head_dim + ld_chunk * 8;

  PageRows<kPaged ? Tr::kLoadRows : 1> pages;
  const int32_t* table = kPaged ? p.block_table + b * p.max_pages : nullptr;
  const uint32_t page_size = kPaged ? static_cast<uint32_t>(p.page_size) : 1u;
  const int32_t last_page =
      kPaged ? static_cast<int32_t>(p.num_pages <= INT_MAX ? p.num_pages - 1 : INT_MAX) : 0;
  // Starts the block-table loads of tile `tile`'s rows; their values are first used one tile
  // later, so the loads' latency hides behind a tile of work.
  auto fetch_pages = [&](int tile) {
    if constexpr (kPaged) {
#pragma unroll
      for (int x = 0; x < Tr::kLoadRows; ++x) {
        const uint32_t j = static_cast<uint32_t>(tile * kBlockN + ld_row + x * Tr::kRowsPerPass);
        const uint32_t blk = j / page_size;
        pages.offset[x] = static_cast<int32_t>(j - blk * page_size);
        pages.page[x] = static_cast<int>(j) < seqlen_k ? __ldg(table + blk) : 0;
      }
    }
  };
  auto load_kv = [&](int tile, int stage) {
    char* k_dst = ring + stage * Tr::kStageBytes + ld_smem_off;
    char* v_dst = k_dst + kBlockN * kPitch;
#pragma unroll
    for (int x = 0; x < Tr::kLoadRows; ++x) {
      const int j = tile * kBlockN + ld_row + x * Tr::kRowsPerPass;
      const bool valid = chunk_valid && j < seqlen_k;
      int64_t row;
      if constexpr (kPaged) {
        // DecodeParams::key_row: the page index is clamped into the pool.
        const int32_t page = min(max(pages.page[x], 0), last_page);
        row = static_cast<int64_t>(page) * page_size + pages.offset[x];
      } else {
        row = b * p.cache_len + j;
      }
      const int64_t off = valid ? row * kv_row_stride : 0;
      tc::cp_async_16_stream(k_dst + x * Tr::kRowsPerPass * kPitch, k_base + off, valid);
      tc::cp_async_16_stream(v_dst + x * Tr::kRowsPerPass * kPitch, v_base + off, valid);
    }
    if (tile + 1 < t_end) fetch_pages(tile + 1);
  };

  // Prologue: Q (its own commit group), then kStages - 1 tiles ahead.
  if (n_tiles > 0) {
    fetch_pages(t_begin);
    const T* q = static_cast<const T*>(p.q);
    constexpr int kQChunks = kBlockM * kChunksPerRow;
#pragma unroll
    for (int x = tid; x < kQChunks; x += Tr::kNThreads) {
      const int rl = x / kChunksPerRow;
      const int ch = x % kChunksPerRow;
      const int r = r0 + rl;
      const bool valid = r < r1 && ch * 8 < head_dim;
      const int i = r / group;
      const int64_t head = static_cast<int64_t>(kv_head) * group + r % group;
      const int64_t off =
          valid ? ((b * p.seqlen_q + i) * p.heads_q + head) * p.head_dim + ch * 8 : 0;
      tc::cp_async_16(smem_q + rl * kPitch + ch * 16, q + off, valid);
    }
  }
  tc::cp_async_commit();
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n_tiles) load_kv(t_begin + s, s);
    tc::cp_async_commit();
  }

  // ldmatrix lane addresses (fwd_tc.cuh): Q and V as (row l % 16, chunk l / 16), K as (row
  // l % 8 + 8 * (l / 16), chunk (l / 8) % 2), so every operand is a contiguous register run.
  const uint32_t qv_lane_off = (lane % 16) * kPitch + (lane / 16) * 16;
  const uint32_t k_lane_off = (lane % 8 + (lane / 16) * 8) * kPitch + ((lane / 8) % 2) * 16;
  const char* q_lane = smem_q + qv_lane_off;
  const uint32_t warp_keys = warp * Tr::kKeysPerWarp * kPitch;
  // Only the k16 steps that hold real head-dim columns (all of them unless head_dim is padded).
  const int qk_steps = (head_dim + 15) / 16;

  float acc_o[kMTiles][Tr::kOTiles][4];
  float m_run[kMTiles][2];    // running max of s * scale_log2 (base 2), -inf before any key
  float row_sum[kMTiles][2];  // this thread's share of the row sum; the quad reduces it once
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
    for (int j = 0; j < Tr::kOTiles; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[mi][j][e] = 0.f;
    }
    m_run[mi][0] = m_run[mi][1] = kNegInf;
    row_sum[mi][0] = row_sum[mi][1] = 0.f;
  }

  int stage = 0;
  for (int t = 0; t < n_tiles; ++t) {
    // Tile t has landed for this thread; the barrier publishes every thread's copies and proves
    // that all warps are done with tile t - 1, whose stage the next copy overwrites.
    tc::cp_async_wait<kStages - 2>();
    __syncthreads();
    if (t + kStages - 1 < n_tiles) {
      const int ahead = stage == 0 ? kStages - 1 : stage - 1;  // (t + kStages - 1) % kStages
      load_kv(t_begin + t + kStages - 1, ahead);
    }
    tc::cp_async_commit();

    const char* k_tile = ring + stage * Tr::kStageBytes + warp_keys;
    const char* v_tile = k_tile + kBlockN * kPitch;
    const int key0 = (t_begin + t) * kBlockN + warp * Tr::kKeysPerWarp;

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
        tc::ldmatrix_x4(bk, k_tile + k_lane_off + kk * 32);
        const uint32_t b_lo[2] = {bk[0], bk[1]};
        const uint32_t b_hi[2] = {bk[2], bk[3]};
#pragma unroll
        for (int mi = 0; mi < kMTiles; ++mi) {
          uint32_t qa[4];
          tc::ldmatrix_x4(qa, q_lane + mi * 16 * kPitch + kk * 32);
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
        tc::ldmatrix_x4_trans(bv, v_tile + qv_lane_off + dp * 32);
        const uint32_t b_lo[2] = {bv[0], bv[1]};
        const uint32_t b_hi[2] = {bv[2], bv[3]};
#pragma unroll
        for (int mi = 0; mi < kMTiles; ++mi) {
          tc::mma_16816<T>(acc_o[mi][2 * dp], pa[mi], b_lo);
          tc::mma_16816<T>(acc_o[mi][2 * dp + 1], pa[mi], b_hi);
        }
      }
    }
    stage = stage + 1 == kStages ? 0 : stage + 1;
  }

  // Epilogue 1: every warp publishes its rows' (m, l); the ring is free once no copy is pending
  // (trailing commit groups are empty, but a block with no tiles still copied nothing, so the
  // wait is cheap) and every warp has left the loop.
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
  tc::cp_async_wait<0>();
  __syncthreads();

  // Epilogue 2: merge the warps' states per row (and, with one split, the sink: one extra logit
  // in the denominator, counted once here), then write lse: natural log of the row's sum of
  // exp(scaled, capped score). A row with no visible key and no sink has l = 0: lse = -inf, O = 0.
  const bool single = p.num_splits == 1;
  if (tid < kBlockM) {
    const int rl = tid;
    const int r = r0 + rl;
    float m_tot = kNegInf;
#pragma unroll
    for (int w = 0; w < kNWarps; ++w) m_tot = fmaxf(m_tot, stat_m[w * kBlockM + rl]);
    const int i = r / group;
    const int64_t head = static_cast<int64_t>(kv_head) * group + r % group;
    float sink = kNegInf;
    if (single && p.mask.sinks != nullptr && r < r1) {
      sink = static_cast<const float*>(p.mask.sinks)[b * p.mask.sinks_batch_stride + head] * kLog2e;
      m_tot = fmaxf(m_tot, sink);
    }
    const float ref = m_tot == kNegInf ? 0.f : m_tot;
    float l_tot = exp2f(sink - ref);
#pragma unroll
    for (int w = 0; w < kNWarps; ++w) {
      l_tot += stat_l[w * kBlockM + rl] * exp2f(stat_m[w * kBlockM + rl] - ref);
    }
    row_ref[rl] = ref;
    row_inv[rl] = l_tot > 0.f ? 1.f / l_tot : 0.f;
    if (r < r1) {
      const float lse = l_tot > 0.f ? (m_tot + log2f(l_tot)) * kLn2 : kNegInf;
      if (single) {
        static_cast<float*>(p.lse)[(b * p.heads_q + head) * p.seqlen_q + i] = lse;
      } else {
        static_cast<float*>(
            p.partial_lse)[((b * p.num_splits + split) * p.heads_q + head) * p.seqlen_q + i] = lse;
      }
    }
  }
  __syncthreads();

  // Epilogue 3: each warp stores its O rows scaled to the merged reference and divided by l.
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
  __syncthreads();

  // Epilogue 4: sum the warps and write 8 columns (16 bytes of T, or 32 of fp32 partials) per
  // thread; columns at or past head_dim are never written.
  constexpr int kOutChunks = kBlockM * (Tr::kHeadDim / 8);
  for (int x = tid; x < kOutChunks; x += Tr::kNThreads) {
    const int rl = x / (Tr::kHeadDim / 8);
    const int ch = x % (Tr::kHeadDim / 8);
    const int r = r0 + rl;
    if (r >= r1 || ch * 8 >= head_dim) continue;
    float out[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) out[e] = 0.f;
#pragma unroll
    for (int w = 0; w < kNWarps; ++w) {
      const float* src = obuf + (w * kBlockM + rl) * Tr::kOPitch + ch * 8;
      const float4 u = *reinterpret_cast<const float4*>(src);
      const float4 v = *reinterpret_cast<const float4*>(src + 4);
      out[0] += u.x, out[1] += u.y, out[2] += u.z, out[3] += u.w;
      out[4] += v.x, out[5] += v.y, out[6] += v.z, out[7] += v.w;
    }
    const int i = r / group;
    const int64_t head = static_cast<int64_t>(kv_head) * group + r % group;
    if (single) {
      T* dst =
          static_cast<T*>(p.o) + ((b * p.seqlen_q + i) * p.heads_q + head) * p.head_dim + ch * 8;
      uint4 packed;
      packed.x = tc::pack2<T>(out[0], out[1]);
      packed.y = tc::pack2<T>(out[2], out[3]);
      packed.z = tc::pack2<T>(out[4], out[5]);
      packed.w = tc::pack2<T>(out[6], out[7]);
      *reinterpret_cast<uint4*>(dst) = packed;
    } else {
      float* dst = static_cast<float*>(p.partial_o) +
                   (((b * p.num_splits + split) * p.heads_q + head) * p.seqlen_q + i) * p.head_dim +
                   ch * 8;
      *reinterpret_cast<float4*>(dst) = make_float4(out[0], out[1], out[2], out[3]);
      *reinterpret_cast<float4*>(dst + 4) = make_float4(out[4], out[5], out[6], out[7]);
    }
  }
}

// Launches the split pass on `stream`; the caller (decode.cu) has validated p, clamped its band
// and checked that the grid and every position fit.
template <typename Tr, bool kPaged>
cudaError_t launch_tc(const DecodeParams& p, const TcArgs& args, int64_t blocks,
                      cudaStream_t stream) {
  const auto kernel = decode_tc_kernel<Tr, kPaged>;
  // The dynamic shared-memory limit is a per-device function attribute (set once per device); the
  // largest carveout lets kMinBlocks blocks share an SM (K/V pass through shared memory only, L1
  // has nothing to keep).
  const cudaError_t err =
      configure_kernel_once<decode_tc_kernel<Tr, kPaged>>(Tr::kSmemBytes, /*max_carveout=*/true);
  if (err != cudaSuccess) return err;
  kernel<<<static_cast<unsigned>(blocks), Tr::kNThreads, Tr::kSmemBytes, stream>>>(p, args);
  return cudaGetLastError();
}

}  // namespace jax_flash::cuda::decode
