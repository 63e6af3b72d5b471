// Tensor-core forward kernel for fp16/bf16: FlashAttention-2's loop order (Dao, 2023, Algorithm 1)
// on mma.sync m16n8k16 with fp32 accumulation.
//
// One thread block owns one query tile (kBlockM rows of one sequence, SeqLayout::tile) of one
// query head. Which keys it visits, and which visited tiles need element masking, come from the
// shared policy (common/mask.h): SeqMask bounds the key loop and proves full tiles, TileMask
// masks the boundary tiles, segment-id chunk ranges skip key tiles of other documents. Q is
// loaded once; K and V tiles of kBlockN keys stream through a kStages-deep cp.async ring, so the
// copy of tile t+1 is in flight during all of tile t's work (QK^T, softmax and PV). Each warp
// owns 16 * kMTiles whole query rows: the row max/sum reductions stay inside the four lanes (a
// quad) that hold a row, and P goes from the S accumulators straight into PV's A operand in
// registers.
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
#include "cuda/kernel_attributes.h"
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
  // With segment ids the kernel also stages the ids of the tile's query rows and of every K/V
  // stage's keys (int32) behind the K/V ring, for the element mask of boundary tiles, and keeps
  // one SegWindow per warp.
  static constexpr int kIdBytes = (kBlockM + kStages * kBlockN) * 4 + kNWarps * 32;
  static constexpr int smem_bytes(bool segments) { return kSmemBytes + (segments ? kIdBytes : 0); }

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
  static_assert(kMinBlocks * smem_bytes(true) <= 228 * 1024, "resident blocks do not fit in smem");
  static_assert(smem_bytes(true) <= 227 * 1024, "exceeds sm_90 shared memory per block");
  static_assert(kBlockM <= kNThreads && kBlockN <= kNThreads, "one thread per segment id copy");
};

template <typename T, int kHeadDim>
using FwdTraitsFor = FwdTraits<T, kHeadDim, fwd_tile(kHeadDim).block_m, fwd_tile(kHeadDim).block_n,
                               fwd_tile(kHeadDim).n_warps, fwd_tile(kHeadDim).stages,
                               fwd_tile(kHeadDim).min_blocks, fwd_tile(kHeadDim).q_in_regs>;

// Everything the kernel reads besides shared memory, derived once on the host from FwdParams.
struct FwdArgs {
  const void* q;  // [rows_q, heads_q, head_dim] (dense: [batch, seqlen_q, heads_q, head_dim])
  const void* k;  // [rows_k, heads_kv, head_dim]
  const void* v;  // [rows_k, heads_kv, head_dim]
  void* o;        // [rows_q, heads_q, head_dim]
  float* lse;     // dense [batch, heads_q, seqlen_q], packed [heads_q, total_q]
  int64_t q_row_stride;   // heads_q * head_dim elements (also O's)
  int64_t kv_row_stride;  // heads_kv * head_dim
  SeqLayout layout;
  Band band;            // read only by the kBand kernels
  SegmentIds segments;  // read only by the kSegments kernels (dense only)
  const float* sinks;   // [batch, heads_q] natural-log sinks, or nullptr
  int64_t sinks_batch_stride;
  int heads_q;
  int q_per_kv;  // heads_q / heads_kv
  bool reverse;  // launch each head's last (heaviest, for a right-bounded band) tiles first
  // Units: (sequence, head) dense, head packed; levels: query tiles (of one sequence dense,
  // layout.tiles(kBlockM, false) packed).
  LaunchOrder order;
  float scale_log2;  // base-2 multiplier of the score: softmax_scale * log2(e), or with a
                     // softcap c, c * log2(e) (the kernel's score is then tanh(cap_scale * q.k))
  float cap_scale;   // softmax_scale / c
};

// Which key blocks a query tile with segment ids visits, for 32 consecutive candidate blocks at a
// time (bit i: block base - i), plus what every refill needs. Every warp keeps its own copy in
// shared memory (all its lanes hold the same values) and reads it with opaque 32-bit-address
// loads, so none of it occupies registers next to the accumulators.
struct SegWindow {
  int base;         // -1 until the first refill
  uint32_t seen;    // the block shares some id with the query tile
  uint32_t single;  // ... and both hold one and the same id: no segment element mask
  int32_t q_lo;     // id range of the query tile's rows
  int32_t q_hi;
  int batch;              // the dense batch row
  uint32_t stage_single;  // bit s: the single bit of the block whose copy went to K/V stage s
  int pad;
};
static_assert(sizeof(SegWindow) == 32, "FwdTraits::kIdBytes reserves 32 bytes per warp");

// The shared-window loads, stores and 4-byte copies of tc_primitives.cuh.
using tc::cp_async_4;
using tc::ld_shared_u32;
using tc::ld_shared_v2s32;
using tc::st_shared_u32;

// Copies rows [row0, row0 + kRows) of one head's [len, head_dim] slice into a padded shared
// tile. Rows at or past row_end (the end of the sequence's span) are zero-filled and never read
// from global memory: that is how tile tails read as zeros and why a packed neighbour's rows
// (and any NaN in them) never reach this sequence's MMAs.
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

// kBand: the call has a sliding window or causal band (without it only the sequence end masks).
// kSegments: segment ids (implies kBand). kSoftcap: s = c * tanh(scale * q.k / c).
template <typename Tr, bool kBand, bool kSegments, bool kSoftcap>
__global__ void __launch_bounds__(Tr::kNThreads, Tr::kMinBlocks) fwd_kernel(const FwdArgs args) {
  static_assert(kBand || !kSegments, "segment ids run on the band kernels");
  static_assert(Tr::kStages <= 32, "SegWindow holds 32 stage flags");
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
  constexpr float kLog2e = 1.4426950408889634f;

  extern __shared__ uint4 smem_raw[];  // uint4: 16-byte alignment for cp.async and ldmatrix
  char* smem_q = reinterpret_cast<char*>(smem_raw);
  char* smem_k = smem_q + Tr::kQTileBytes;
  char* smem_v = smem_k + kStages * Tr::kKVTileBytes;
  char* smem_raw_bytes = smem_q;
  // Segment ids (kSegments only), as shared-window addresses: kv ids per K/V stage, the query
  // tile's ids, then one SegWindow per warp.
  constexpr int kOffKvIds = Tr::kSmemBytes;
  constexpr int kOffQIds = kOffKvIds + kStages * kBlockN * 4;
  constexpr int kOffWindows = kOffQIds + kBlockM * 4;
  auto win_addr = [&](int field) {
    return tc::smem_addr(smem_raw) + kOffWindows + static_cast<uint32_t>(threadIdx.x / 32) * 32 +
           field;
  };

  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;

  // Query tiles of one head go in the launch order of LaunchOrder (common/schedule.h), so that
  // they share K/V through L2; a right-bounded band (causal) launches each head's heaviest (last)
  // tile first so that short tiles fill the tail. Dense units are (sequence, head).
  const CtaWork work = args.order.work(args.layout, blockIdx.x, args.reverse, kBlockM, false);
  const int head = static_cast<int>(work.head);
  const SeqTile& tile = work.tile;
  if (tile.empty(kBlockM, false)) return;
  const SeqSpan& span = tile.span;
  const int kv_head = head / args.q_per_kv;
  const int len_q = static_cast<int>(span.len_q);
  const int len_k = static_cast<int>(span.len_k);
  const int m0 = static_cast<int>(tile.block) * kBlockM;
  const int m1 = min(m0 + kBlockM, len_q);  // rows [m0, m1) of the span are this block's

  const T* q_head = static_cast<const T*>(args.q) + span.q_start * args.q_row_stride +
                    static_cast<int64_t>(head) * Tr::kHeadDim;
  const T* k_head = static_cast<const T*>(args.k) + span.k_start * args.kv_row_stride +
                    static_cast<int64_t>(kv_head) * Tr::kHeadDim;
  const T* v_head = static_cast<const T*>(args.v) + span.k_start * args.kv_row_stride +
                    static_cast<int64_t>(kv_head) * Tr::kHeadDim;
  T* o_head = static_cast<T*>(args.o) + span.q_start * args.q_row_stride +
              static_cast<int64_t>(head) * Tr::kHeadDim;
  float* lse_head = args.lse + span.stat_start + head * span.stat_head;

  // The row's sink (natural log; -inf stands for none): the softmax starts at m = sink, l = 1.
  const float sink =
      args.sinks != nullptr ? args.sinks[span.batch * args.sinks_batch_stride + head] : kNegInf;

  // Keys [key_begin, key_end) are seen by some row of this tile; key blocks outside
  // [nb_begin, nb_end) are never visited. Without kBand the band is unbounded at compile time.
  const SeqMask mask = (kBand ? args.band : Band{}).for_seq(span.len_q, span.len_k);
  const int key_begin = static_cast<int>(mask.key_begin(m0));
  const int key_end = static_cast<int>(mask.key_end(m1));
  const int nb_begin = key_begin / kBlockN;
  const int nb_end = (key_end + kBlockN - 1) / kBlockN;

  // Rows that see no key: O = 0 and lse = sink (-inf without sinks) by definition.
  auto write_empty = [&]() {
    const uint4 zero = make_uint4(0, 0, 0, 0);
    for (int i = tid; i < kBlockM * kChunksPerRow; i += Tr::kNThreads) {
      const int row = m0 + i / kChunksPerRow;
      if (row < m1) {
        *reinterpret_cast<uint4*>(o_head + row * args.q_row_stride + (i % kChunksPerRow) * 8) =
            zero;
      }
    }
    for (int i = tid; i < kBlockM; i += Tr::kNThreads) {
      if (m0 + i < m1) lse_head[m0 + i] = sink;
    }
  };
  if (key_begin >= key_end) {
    write_empty();
    return;
  }

  // Segment ids: key blocks whose id range is disjoint from the query tile's are skipped, and
  // blocks where both sides hold one and the same id need no segment element mask. The block
  // walks key blocks downwards; a warp classifies 32 candidate blocks per ballot (SegWindow), so
  // a long run of disjoint blocks costs one round trip, not one per block.
  if constexpr (kSegments) {
    const IdRange q_range = id_range_fixed<kBlockM / kSegmentChunk>(
        segment_row(args.segments.q_ranges, span.batch, args.layout.seqlen_q), m0, m1);
    st_shared_u32(win_addr(offsetof(SegWindow, base)), static_cast<uint32_t>(-1));
    st_shared_u32(win_addr(offsetof(SegWindow, q_lo)), static_cast<uint32_t>(q_range.lo));
    st_shared_u32(win_addr(offsetof(SegWindow, q_hi)), static_cast<uint32_t>(q_range.hi));
    st_shared_u32(win_addr(offsetof(SegWindow, batch)), static_cast<uint32_t>(span.batch));
    st_shared_u32(win_addr(offsetof(SegWindow, stage_single)), 0u);
    __syncwarp();  // every lane's stores before any lane's reads
  }
  // The largest key block in [nb_begin, n] that the tile visits, or a value below nb_begin.
  auto find_visit = [&](int n) -> int {
    if constexpr (!kSegments) {
      return n;
    } else {
      while (n >= nb_begin) {
        int base = static_cast<int>(ld_shared_u32(win_addr(offsetof(SegWindow, base))));
        if (n > base || n < base - 31) {
          base = n;
          const int cand = n - lane;
          bool seen = false;
          bool single = false;
          if (cand >= nb_begin) {
            const IdRange q_range{
                static_cast<int32_t>(ld_shared_u32(win_addr(offsetof(SegWindow, q_lo)))),
                static_cast<int32_t>(ld_shared_u32(win_addr(offsetof(SegWindow, q_hi))))};
            const int batch = static_cast<int>(ld_shared_u32(win_addr(offsetof(SegWindow, batch))));
            const IdRange r = id_range_fixed<kBlockN / kSegmentChunk>(
                segment_row(args.segments.kv_ranges, batch, args.layout.seqlen_k),
                static_cast<int64_t>(cand) * kBlockN, min((cand + 1) * kBlockN, len_k));
            seen = !r.disjoint(q_range);
            single = r.same_single(q_range);
          }
          const uint32_t seen_mask = __ballot_sync(0xffffffffu, seen);
          const uint32_t single_mask = __ballot_sync(0xffffffffu, single);
          // As in the backward's find_query_tile: warp barriers order the identical stores of
          // every lane against the other lanes' reads of the old and the new window.
          __syncwarp();
          st_shared_u32(win_addr(offsetof(SegWindow, base)), static_cast<uint32_t>(base));
          st_shared_u32(win_addr(offsetof(SegWindow, seen)), seen_mask);
          st_shared_u32(win_addr(offsetof(SegWindow, single)), single_mask);
          __syncwarp();
        }
        const uint32_t below =
            ld_shared_u32(win_addr(offsetof(SegWindow, seen))) & (0xffffffffu << (base - n));
        if (below != 0) return base - (__ffs(below) - 1);
        n = base - 32;
      }
      return nb_begin - 1;
    }
  };
  // Notes whether visited block n (just returned by find_visit), whose copy goes to `stage`,
  // needs no segment element mask.
  auto note_single = [&](int n, int stage) {
    if constexpr (kSegments) {
      const int base = static_cast<int>(ld_shared_u32(win_addr(offsetof(SegWindow, base))));
      const uint32_t bit =
          (ld_shared_u32(win_addr(offsetof(SegWindow, single))) >> (base - n)) & 1u;
      const uint32_t addr = win_addr(offsetof(SegWindow, stage_single));
      const uint32_t word = (ld_shared_u32(addr) & ~(1u << stage)) | (bit << stage);
      __syncwarp();  // every lane has read the old word before any lane writes the new one
      st_shared_u32(addr, word);
      __syncwarp();
    }
  };

  int next = find_visit(nb_end - 1);  // the next key block to copy
  if (next < nb_begin) {
    write_empty();
    return;
  }

  // Fragment coordinates: rows g and g + 8, columns c and c + 1 of every C tile.
  const int g = lane / 4;
  const int c = 2 * (lane % 4);

  // cp.async assignment: a thread copies chunk ld_chunk of rows ld_row + i * kRowsPerPass, so a
  // warp reads whole rows of contiguous global memory.
  const int ld_chunk = tid % kChunksPerRow;
  const int ld_row = tid / kChunksPerRow;
  const uint32_t ld_smem_off = ld_row * kPitch + ld_chunk * 16;

  auto load_kv = [&](int n_block, int stage) {
    const int row0 = n_block * kBlockN;
    load_tile<Tr, kBlockN>(smem_k + stage * Tr::kKVTileBytes, k_head, args.kv_row_stride, row0,
                           len_k, ld_row, ld_chunk, ld_smem_off);
    load_tile<Tr, kBlockN>(smem_v + stage * Tr::kKVTileBytes, v_head, args.kv_row_stride, row0,
                           len_k, ld_row, ld_chunk, ld_smem_off);
    if constexpr (kSegments) {
      if (tid < kBlockN) {
        const bool valid = row0 + tid < len_k;
        const int batch = static_cast<int>(ld_shared_u32(win_addr(offsetof(SegWindow, batch))));
        const int32_t* kv_ids = args.segments.kv_ids + batch * args.layout.seqlen_k;
        cp_async_4(smem_raw_bytes + kOffKvIds + (stage * kBlockN + tid) * 4,
                   kv_ids + (valid ? row0 + tid : 0), valid);
      }
    }
  };

  // Prologue: Q is its own commit group, then one group per K/V tile, kStages - 1 tiles ahead.
  // pending[] holds the key blocks whose copies are in flight, oldest first (below nb_begin:
  // none); next is the block the following copy fetches.
  load_tile<Tr, kBlockM>(smem_q, q_head, args.q_row_stride, m0, len_q, ld_row, ld_chunk,
                         ld_smem_off);
  if constexpr (kSegments) {
    if (tid < kBlockM) {
      const bool valid = m0 + tid < len_q;
      const int32_t* q_ids = args.segments.q_ids + span.batch * args.layout.seqlen_q;
      cp_async_4(smem_raw_bytes + kOffQIds + tid * 4, q_ids + (valid ? m0 + tid : 0), valid);
    }
  }
  tc::cp_async_commit();
  int pending[kStages - 1];
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    pending[s] = next;
    if (next >= nb_begin) {
      note_single(next, s);
      load_kv(next, s);
      next = find_visit(next - 1);
    }
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
  // every rescale factor is uniform across the quad. A sink starts the row at m = sink, l = 1:
  // the 1 sits in the quad's first lane, so the deferred reduction counts it once.
  float m_ref[kMTiles][2];
  float row_sum[kMTiles][2];
  const float sum_init = args.sinks != nullptr && lane % 4 == 0 ? 1.f : 0.f;
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi) {
    m_ref[mi][0] = m_ref[mi][1] = sink * kLog2e;
    row_sum[mi][0] = row_sum[mi][1] = sum_init;
  }

  const float scale_log2 = args.scale_log2;
  // Tile-local index of this thread's first query row (row g of m tile 0).
  const int row_base = warp * Tr::kRowsPerWarp + g;

  auto iteration = [&](int t, int n_block, auto mask_tag) {
    constexpr bool kMask = decltype(mask_tag)::value;
    const int stage = t % kStages;
    const char* k_tile = smem_k + stage * Tr::kKVTileBytes;
    const char* v_tile = smem_v + stage * Tr::kKVTileBytes;

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

    // Soft-capping: the kernel's score becomes tanh(scale * q.k / c); scale_log2 holds
    // c * log2(e), so everything below is unchanged.
    if constexpr (kSoftcap) {
#pragma unroll
      for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
        for (int j = 0; j < kSTiles; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mi][j][e] = tc::fast_tanh(s[mi][j][e] * args.cap_scale);
        }
      }
    }

    if constexpr (kMask) {
      // Only boundary tiles come here: the band's edges, the sequence end and (with segment
      // ids) tiles whose two sides do not hold one single id.
      const TileMask tm = mask.tile(m0, n_block * kBlockN);
#pragma unroll
      for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = row_base + mi * 16 + 8 * h;
          const int lo = kBand ? tm.lo(r) : 0;
          const int hi = kBand ? tm.hi(r) : tm.n_limit;
#pragma unroll
          for (int j = 0; j < kSTiles; ++j) {
            const int col = c + 8 * j;
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              if ((kBand && col + e < lo) || col + e >= hi) s[mi][j][2 * h + e] = kNegInf;
            }
          }
          if constexpr (kSegments) {
            const uint32_t ids = tc::smem_addr(smem_raw);
            const int32_t q_id = static_cast<int32_t>(ld_shared_u32(ids + kOffQIds + 4 * r));
#pragma unroll
            for (int j = 0; j < kSTiles; ++j) {
              const int2 kv_id =
                  ld_shared_v2s32(ids + kOffKvIds + 4 * (stage * kBlockN + c + 8 * j));
              if (kv_id.x != q_id) s[mi][j][2 * h] = kNegInf;
              if (kv_id.y != q_id) s[mi][j][2 * h + 1] = kNegInf;
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
    // has seen only masked keys (and no sink) keeps m = -inf; 0 then stands in as the
    // subtraction point, so p = 2^-inf = 0 instead of NaN. Max and sum use pairwise trees for
    // short dependency chains.
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

  // Key blocks are visited downwards from nb_end - 1, so the band's diagonal edge (causal) comes
  // first; tiles that SeqMask proves full (and, with segment ids, hold one single id on both
  // sides) take the unmasked path.
  for (int t = 0;; ++t) {
    const int n_block = pending[0];
    if (n_block < nb_begin) break;
#pragma unroll
    for (int s = 0; s + 1 < kStages - 1; ++s) pending[s] = pending[s + 1];
    // Tile t (and Q) has landed for this thread; the barrier publishes every thread's copies and
    // proves that all warps finished tile t - 1, whose stage the next copy overwrites.
    tc::cp_async_wait<kStages - 2>();
    __syncthreads();
    pending[kStages - 2] = next;
    if (next >= nb_begin) {
      note_single(next, (t + kStages - 1) % kStages);
      load_kv(next, (t + kStages - 1) % kStages);
      next = find_visit(next - 1);
    }
    tc::cp_async_commit();

    const int n0 = n_block * kBlockN;
    // With segment ids a tile also needs the element mask unless both sides hold one single id.
    const bool single =
        !kSegments ||
        ((ld_shared_u32(win_addr(offsetof(SegWindow, stage_single))) >> (t % kStages)) & 1u) != 0;
    if (mask.tile_full(m0, m1, n0, n0 + kBlockN) && single) {
      iteration(t, n_block, std::integral_constant<bool, false>{});
    } else {
      iteration(t, n_block, std::integral_constant<bool, true>{});
    }
  }

  // Epilogue: O = acc / rowsum. Each warp stages its rows in its own rows of the Q tile, which no
  // other warp reads and no copy targets any more, then writes whole 16-byte chunks, so a row
  // goes out as contiguous head_dim * 2 bytes. The __syncwarp orders this warp's last ldmatrix of
  // Q before the overwrite. Rows past the span's end are not written.
  constexpr float kLn2 = 0.6931471805599453f;
  __syncwarp();
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float sum = row_sum[mi][h];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      // sum > 0 iff the row saw a key (the max term contributes 2^0) or has a sink; otherwise
      // O = 0, lse = -inf. A row with a sink and no key gets O = 0 and lse = sink.
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
      const int row_local = warp * Tr::kRowsPerWarp + mi * 16 + g + 8 * h;
      if (lane % 4 == 0 && m0 + row_local < m1) {
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
    if (row < m1) {
      *reinterpret_cast<uint4*>(o_head + row * args.q_row_stride + chunk * 8) = val;
    }
  }
}

// Launches fwd_kernel; params are validated by the dispatcher (fwd_tc_dispatch.cu), which also
// chooses the flags: kBand iff the band is bounded on some side or segment ids are given,
// kSegments iff segment ids are given, kSoftcap iff softcap > 0.
template <typename Tr, bool kBand, bool kSegments, bool kSoftcap>
cudaError_t launch_fwd(const FwdParams& params, cudaStream_t stream) {
  const auto kernel = fwd_kernel<Tr, kBand, kSegments, kSoftcap>;
  constexpr int kSmemBytes = Tr::smem_bytes(kSegments);
  const SeqLayout& layout = params.layout;
  const int64_t tiles = layout.tiles(Tr::kBlockM, false);
  const int64_t grid = tiles * params.heads_q;
  if (grid > INT_MAX) return cudaErrorInvalidValue;
  if (grid == 0) return cudaSuccess;
  if (const cudaError_t err =
          configure_kernel_once<fwd_kernel<Tr, kBand, kSegments, kSoftcap>>(kSmemBytes);
      err != cudaSuccess) {
    return err;
  }
  FwdArgs args;
  args.q = params.q;
  args.k = params.k;
  args.v = params.v;
  args.o = params.o;
  args.lse = static_cast<float*>(params.lse);
  args.q_row_stride = params.heads_q * Tr::kHeadDim;
  args.kv_row_stride = params.heads_kv * Tr::kHeadDim;
  args.layout = layout;
  args.band = params.mask.band.clamped();
  args.segments = params.mask.segments;
  args.sinks = static_cast<const float*>(params.mask.sinks);
  args.sinks_batch_stride = params.mask.sinks_batch_stride;
  args.heads_q = static_cast<int>(params.heads_q);
  args.q_per_kv = static_cast<int>(params.heads_q / params.heads_kv);
  args.reverse = kBand && params.mask.band.right < kUnbounded;
  // The K and V of a unit's sequence are shared with the other query heads of its kv head.
  args.order = launch_order(
      layout, params.mask, layout.varlen() ? params.heads_q : layout.batch * params.heads_q,
      layout.varlen() ? tiles : (layout.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM, true,
      Tr::kHeadDim * 2 * 2, args.q_per_kv, params.heads_q);
  constexpr double kLog2e = 1.4426950408889634;
  const double softcap = params.mask.softcap;
  args.scale_log2 = static_cast<float>((kSoftcap ? softcap : params.softmax_scale) * kLog2e);
  args.cap_scale = kSoftcap ? static_cast<float>(params.softmax_scale / softcap) : 0.f;
  kernel<<<static_cast<unsigned>(grid), Tr::kNThreads, kSmemBytes, stream>>>(args);
  return cudaGetLastError();
}

// The forward for one (dtype, head_dim, mask flags) with the tile fwd_tile(head_dim).
template <typename T, int kHeadDim, bool kBand, bool kSegments, bool kSoftcap>
cudaError_t run_fwd(const FwdParams& params, cudaStream_t stream) {
  return launch_fwd<FwdTraitsFor<T, kHeadDim>, kBand, kSegments, kSoftcap>(params, stream);
}

// Every variant of JAX_FLASH_TC_FLAGS (tc_primitives.cuh) is declared here and defined once in
// fwd_tc_hdim{64,128,256}.cu, one file per head_dim.
#define JAX_FLASH_FWD_TC_EXTERN(T, D, B, S, C) \
  extern template cudaError_t run_fwd<T, D, B, S, C>(const FwdParams&, cudaStream_t);
JAX_FLASH_TC_FLAGS(JAX_FLASH_FWD_TC_EXTERN, __half, 64)
JAX_FLASH_TC_FLAGS(JAX_FLASH_FWD_TC_EXTERN, __half, 128)
JAX_FLASH_TC_FLAGS(JAX_FLASH_FWD_TC_EXTERN, __half, 256)
JAX_FLASH_TC_FLAGS(JAX_FLASH_FWD_TC_EXTERN, __nv_bfloat16, 64)
JAX_FLASH_TC_FLAGS(JAX_FLASH_FWD_TC_EXTERN, __nv_bfloat16, 128)
JAX_FLASH_TC_FLAGS(JAX_FLASH_FWD_TC_EXTERN, __nv_bfloat16, 256)
#undef JAX_FLASH_FWD_TC_EXTERN

}  // namespace jax_flash::cuda::fwd_tc
