// FlashAttention forward for Hopper (sm_90a), after the FlashAttention-3 paper: warp-specialised
// CTAs in which one producer warpgroup streams K/V tiles with the tensor memory accelerator (TMA)
// into a two-stage shared-memory ring guarded by mbarriers, and two or three consumer warpgroups,
// each owning 64 query rows, run S = Q K^T and O += P V on warpgroup MMA (wgmma) with the online
// softmax kept in registers. setmaxnreg moves registers from the producer to the consumers; the
// consumers take turns issuing GEMMs (ping-pong), and each overlaps the softmax of one key block
// with the P V GEMM of the previous one. A CTA runs one query tile, or, in the persistent form
// (fwd_wgmma_persistent_kernel), one tile after another with the same per-tile code.
//
// Which keys a query tile visits and which scores exist come from the shared mask policy
// (common/mask.h) and tile scheduler (common/schedule.h): a query tile visits the key blocks of
// its band's key range, minus (segment ids) those whose ids it cannot share; only blocks that are
// not `tile_full` get element masking. Dense batches and packed (cu_seqlens) batches run the same
// kernel: dense TMA maps are [batch, seqlen, heads, head_dim], so rows past a sequence read as
// zeros and stores past it are clipped; packed maps are one [total rows, heads, head_dim] view, so
// a tile straddling a sequence end reads its neighbour's rows, and the kernel zeroes those V rows
// and stores those O rows by hand (see the producer and the epilogue). A segment-id call's rows
// whose ids are documents (SeqLayout::runs) run each document as such a sequence inside its row of
// the dense maps, with the band's body; the segment-id kernels hold both bodies (fwd_wgmma_tile).
//
// Shared-memory tiles are stored as the TMA writes them with 128-byte swizzling: a tile of R rows
// and D columns is D / 64 "panels" of R rows x 128 bytes, and inside each panel the 16-byte chunk
// c of row r sits at chunk c ^ (r % 8). Every tile starts on a 1024-byte boundary so that the
// swizzle phase equals the address bits the hardware uses (bits 7-9 of the byte address). The same
// bytes are then described to wgmma as K-major operands (Q and K for S = Q K^T) or as an MN-major
// operand (V for O += P V, where the key axis is the reduction axis).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math_constants.h>

#include <cstdint>
#include <type_traits>

#include "common/mask.h"
#include "common/schedule.h"
#include "cuda/grid_dependency.cuh"
#include "cuda/sm90_async.cuh"  // JAX_FLASH_SM90A, mbarrier and TMA wrappers
#include "cuda/sm90_wgmma.cuh"
#include "cuda/tc_primitives.cuh"

namespace jax_flash::cuda::sm90 {

// In banded kernels without segment ids, each consumer warpgroup computes only the key blocks its
// own 64 rows can see (the mask policy's key range of its rows); for the walk's other blocks it
// keeps the barrier protocol (waits, turns, releases) without GEMMs or softmax. A 192-row tile of
// the head_dim-64 causal forward at 1k computes a fifth of its scores for nothing, half of which
// are whole blocks of one warpgroup (tools/tile_coverage.py). Measured on an H100
// (docs/PERF_LOG.md): head_dim 64 causal 1k +6-9%, 2k +4-7%, the 1k window over 16k +7-10%;
// head_dim 128 (whose 128-row tiles align with the blocks) unchanged. 0 turns it off.
#ifndef JAX_FLASH_FWD_WG_SKIP
#define JAX_FLASH_FWD_WG_SKIP 1
#endif
inline constexpr bool kFwdWgSkip = JAX_FLASH_FWD_WG_SKIP != 0;

// The query tiles of the banded kernels (FwdWgmmaTraits::kAlignEnd) end at the sequence's last
// row instead of starting at its first, so that the tile left partly empty (at head_dim 64,
// 1024 = 5 x 192 + 64; at 128 and 256, lengths of 128k + 1 to 128k + 64) is the first one, whose
// rows see the fewest keys, rather than the last, whose working warpgroups walk every key block
// with fewer others to overlap their softmax with. A dense sequence's first tile then starts whole
// warpgroups (up to 128 rows) before row 0: Q's load reads zeros there, and those warpgroups only
// keep the barrier protocol, as a tile's warpgroups past the end do. Measured on an H100
// (docs/PERF_LOG.md): head_dim 64 causal 1k +2.4% over four rounds (each round at or above the
// unaligned build), every other cell within the card's noise. 0 turns it off.
#ifndef JAX_FLASH_FWD_ALIGN_END
#define JAX_FLASH_FWD_ALIGN_END 1
#endif

// Experiment switch: which head dims' consumer warpgroups take turns to issue their GEMMs
// (FwdWgmmaTraits::kPingPong), bit 1 for head_dim 64, 2 for 128, 4 for 256. FlashAttention-3's
// sm_90 forward (its UseSchedulerBarrier) keeps the turns for 16-bit inputs only up to head_dim
// 128 (at 256 a warpgroup's QK^T is 16 wgmma deep and its P V 256 columns wide), and its
// head_dim-256 main loop has no named barrier in its SASS. 3 (head_dim 256 without the turns):
// on an H100 its forward ran +1-2% at 4k and 16k in two rounds against 7, within 2% either way
// at 1k and 2k (docs/PERF_LOG.md).
#ifndef JAX_FLASH_FWD_PINGPONG
#define JAX_FLASH_FWD_PINGPONG 3
#endif

// Everything a launch needs besides the four tensor maps, computed on the host.
struct FwdWgmmaArgs {
  void* o;     // packed calls store the O rows of a tile that straddles a sequence end by hand
  float* lse;  // dense [batch, heads_q, seqlen_q], packed [heads_q, total_q]
  SeqLayout layout;
  Band band;
  SegmentIds segments;  // dense calls only
  const float* sinks;   // [batch, heads_q] (stride sinks_batch_stride), natural log; or nullptr
  int64_t sinks_batch_stride;
  // Units: (sequence, head) dense, head packed; levels: query tiles (layout.row_tiles(kBlockM,
  // false) dense, layout.tiles(kBlockM, false) packed).
  LaunchOrder order;
  int heads_q;
  int group;            // heads_q / heads_kv: query heads sharing one K/V head
  float scale_log2;     // softmax_scale * log2(e): the softmax runs in base 2
  float softcap_scale;  // softmax_scale / softcap (soft-capping kernels)
  float softcap_log2;   // softcap * log2(e): the base-2 scale of the capped score's tanh
  // Persistent kernels: the tile counter their CTAs claim tiles from, zeroed on the stream by the
  // launcher (fwd_wgmma_persistent_kernel).
  int* work_counter;
};

// What a kernel instantiation masks, beyond the end of the key sequence (which every kernel
// handles): nothing (the band is unbounded), a band with a finite bound (causal, sliding windows),
// or a band plus segment ids.
enum class FwdMask : int { kNone = 0, kBand = 1, kSegments = 2 };

// Every tile-size choice of the family (after FlashAttention-3's): the number of consumer
// warpgroups (64 query rows each) and the keys per K/V tile.
// - head_dim 64: the softmax costs as much as the two GEMMs, so a third consumer warpgroup
//   (192 query rows) gives the tensor cores more GEMMs to overlap with it and cuts the K/V traffic
//   per FLOP by a third.
// - head_dim 128: 176 keys per tile amortise the per-tile softmax bookkeeping; a band keeps 128
//   while a query row sees few keys (short causal calls, sliding windows), where the partly masked
//   tiles at the band's edges are a large share of the work.
// - head_dim 256: O alone takes 128 registers a thread, so S gets 80 keys (40 registers).
// - segment ids: document boundaries leave partly masked tiles at any length, and the producer's
//   key-block walk needs more registers (FwdWgmmaTraits::kProducerRegs), which the consumers give
//   up: two consumer warpgroups with 128 keys (64 at head_dim 256) fit what is left.
// - persistent (fwd_wgmma_persistent_kernel, rows of at most kPersistentMaxKeys keys): 128 keys at
//   head_dim 128 without a band too, since a second Q buffer does not fit beside two stages of 176.
struct FwdWgmmaTile {
  int consumer_warpgroups;
  int block_n;
};

constexpr FwdWgmmaTile fwd_wgmma_tile(int head_dim, FwdMask mask, bool long_keys,
                                      bool persistent = false) {
  if (mask == FwdMask::kSegments) return {2, head_dim <= 128 ? 128 : 64};
  if (head_dim <= 64) return {3, 128};
  if (head_dim <= 128) {
    return {2, (mask == FwdMask::kBand && !long_keys) || persistent ? 128 : 176};
  }
  return {2, 80};
}

// Query rows that can see at least this many keys count as long_keys (JAX_FLASH_FWD_LONG_KEYS
// moves the bound for A/B builds; it only changes which key block head_dim 128's band kernels use).
#ifndef JAX_FLASH_FWD_LONG_KEYS
#define JAX_FLASH_FWD_LONG_KEYS 4096
#endif
inline constexpr int64_t kLongKeys = JAX_FLASH_FWD_LONG_KEYS;

// Kernels that also have a persistent form (fwd_wgmma_persistent_kernel), which serves short rows
// only (never the long-keys variants): head_dim 64 and 128 without segment ids, with 128-key
// blocks, where two Q buffers fit beside the K/V ring (head_dim 64: 2 x 24 + 64 KB; 128: 2 x 32 +
// 128 KB). At head_dim 128 without a band the one-tile kernel's blocks are 176 keys and the
// persistent one's 128 (fwd_wgmma_tile; a form that kept 176 with one Q buffer and O staged over
// V measured no faster than the one-tile kernel, docs/PERF_LOG.md). Not head_dim 64 with softcap,
// whose 160-register consumers spill 150-320 bytes in the persistent form.
constexpr bool fwd_persistent_tile(int head_dim, FwdMask mask, bool long_keys, bool softcap) {
  return mask != FwdMask::kSegments && head_dim <= 128 && !long_keys &&
         !(softcap && head_dim == 64);
}
static_assert(fwd_wgmma_tile(64, FwdMask::kBand, false, true).block_n == 128 &&
                  fwd_wgmma_tile(128, FwdMask::kNone, false, true).block_n == 128 &&
                  fwd_wgmma_tile(128, FwdMask::kBand, false, true).block_n == 128,
              "two Q buffers fit beside the K/V ring with 128-key blocks only");

template <typename T, int kHeadDim, FwdMask kMaskKind, bool kSoftcapOn, bool kLongKeys,
          bool kPersistentOn = false>
struct FwdWgmmaTraits : Sw128Panels<kHeadDim> {
  using Panels = Sw128Panels<kHeadDim>;
  using Element = T;
  static constexpr int kD = kHeadDim;
  static constexpr FwdMask kMask = kMaskKind;
  // The band has a finite bound: key ranges and element masks depend on the row.
  static constexpr bool kBand = kMaskKind != FwdMask::kNone;
  static constexpr bool kSegments = kMaskKind == FwdMask::kSegments;
  // s = softcap * tanh(softmax_scale * q.k / softcap).
  static constexpr bool kSoftcap = kSoftcapOn;
  // A warp's row max stops following the scores once it is near the cap (online_softmax_freezing):
  // bf16 only (fp16 P has too little range); head_dim 128, and 64 without a band (the banded
  // head_dim-64 kernels, at 160 registers a consumer, then spill, and measured no gain); not in the
  // segment-id kernels, whose two bodies (document and element-masked) spill with it.
  static constexpr bool kFreezeMax =
      kSoftcapOn && std::is_same_v<T, __nv_bfloat16> &&
      (kHeadDim == 128 ? kMaskKind != FwdMask::kSegments
                       : kHeadDim == 64 && kMaskKind == FwdMask::kNone);
  static constexpr FwdWgmmaTile kTile =
      fwd_wgmma_tile(kHeadDim, kMaskKind, kLongKeys, kPersistentOn);
  static constexpr int kConsumerWarpgroups = kTile.consumer_warpgroups;
  static constexpr int kThreads = 128 * (kConsumerWarpgroups + 1);
  // One wgmma M extent (64 rows) per consumer warpgroup.
  static constexpr int kBlockM = 64 * kConsumerWarpgroups;
  static constexpr int kBlockN = kTile.block_n;
  // Consumer warpgroups take turns to issue their GEMMs (FlashAttention-3 ping-pong;
  // JAX_FLASH_FWD_PINGPONG).
  static constexpr int kHeadDimBit = kHeadDim == 64 ? 1 : kHeadDim == 128 ? 2 : 4;
  static constexpr bool kPingPong = (JAX_FLASH_FWD_PINGPONG & kHeadDimBit) != 0;
  // One CTA runs many tiles in turn (fwd_wgmma_persistent_kernel): two Q buffers, used by
  // alternate tiles, so that the next tile's Q loads while this one's key blocks are computed.
  static constexpr bool kPersistent = kPersistentOn;
  static constexpr int kQBuffers = kPersistent ? 2 : 1;
  // Query tiles aligned to the sequence's end (JAX_FLASH_FWD_ALIGN_END): banded kernels without
  // segment ids (whose documents have tiles of their own), dense calls only.
  static constexpr bool kAlignEnd = JAX_FLASH_FWD_ALIGN_END != 0 && kBand && !kSegments;

  // Registers: the producer needs only addresses and loop counters (and, with segment ids, its
  // key-block walk's ballots), the consumers the accumulators (O: kD / 2, S: kBlockN / 2,
  // P: kBlockN / 4 a thread). The split uses the registers the CTA is launched with (168 a thread
  // for 384 threads, 128 for 512): 24 * 128 + 240 * 256 = 40 * 128 + 232 * 256 = 168 * 384 and
  // 32 * 128 + 160 * 384 = 128 * 512.
  // A persistent producer also decodes each tile it claims: it gets the segment-id split too.
  static constexpr bool kBigProducer = kSegments || kPersistentOn;
  static constexpr int kProducerRegs = kConsumerWarpgroups == 2 ? (kBigProducer ? 40 : 24) : 32;
  static constexpr int kConsumerRegs = kConsumerWarpgroups == 2 ? (kBigProducer ? 232 : 240) : 160;

  // Tiles are Sw128Panels panels of their rows.
  static constexpr int kQPanelBytes = kBlockM * Panels::kRowBytes;
  static constexpr int kKVPanelBytes = kBlockN * Panels::kRowBytes;
  static constexpr int kQBytes = kQPanelBytes * Panels::kPanels;
  static constexpr int kKVStageBytes = kKVPanelBytes * Panels::kPanels;
  // K/V ring depth (a third stage measured no faster on the H200).
  static constexpr int kStages = 2;

  static constexpr int kQOffset = 0;
  static constexpr int kKOffset = kQOffset + kQBuffers * kQBytes;
  static constexpr int kVOffset = kKOffset + kStages * kKVStageBytes;
  static constexpr int kBarOffset = kVOffset + kStages * kKVStageBytes;
  // mbarriers: Q full, then K full, V full, K empty, V empty per stage, then the V tile that
  // straddles a packed sequence's end (it lands there and is released once its tail is zeroed);
  // persistent kernels then add the second Q buffer's full barrier and both buffers' empty ones.
  static constexpr int kNumBarriers = 2 + 4 * kStages + (kPersistent ? 3 : 0);
  // Persistent kernels: each Q buffer's tile index (fwd_wgmma_persistent_kernel's `slots`), after
  // the barriers.
  static constexpr int kSlotOffset = kBarOffset + 8 * kNumBarriers;
  // The extra 1024 bytes let the kernel round the dynamic shared-memory base up to the 1024-byte
  // swizzle period.
  static constexpr int kSmemBytes = kSlotOffset + (kPersistent ? 8 : 0) + 1024;

  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>);
  static_assert(kConsumerWarpgroups == 2 || kConsumerWarpgroups == 3);
  static_assert(kBlockN % 16 == 0 && kD % 16 == 0, "wgmma K extent is 16");
  static_assert(kBlockM % kSegmentChunk == 0 && kBlockN % kSegmentChunk == 0,
                "segment-id chunk summaries must tile both tile sizes");
  static_assert(kBlockM <= 256 && kBlockN <= 256, "TMA boxes hold at most 256 rows");
  static_assert(kQPanelBytes % 1024 == 0 && kKVPanelBytes % 1024 == 0,
                "every tile must stay on the 1024-byte swizzle period");
  static_assert(kSmemBytes <= 227 * 1024, "exceeds the 227 KB of shared memory a block may use");
  static_assert(!kPersistent || fwd_persistent_tile(kHeadDim, kMaskKind, kLongKeys, kSoftcapOn));
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumerWarpgroups <=
                    (65536 / kThreads / 8 * 8) * kThreads,
                "setmaxnreg can only move the registers the CTA was launched with");
};

#if JAX_FLASH_SM90A

// ---------------------------------------------------------------------------------------------
// Consumer pieces (the accumulator layout: cuda/sm90_wgmma.cuh).

// Named-barrier ids; 0 is __syncthreads.
inline constexpr int kBarSchedBase = 1;     // + consumer warpgroup: its turn to issue wgmma
inline constexpr int kBarEpilogueBase = 4;  // + consumer warpgroup: its own 128 threads

// The key blocks one query tile visits, last to first: the blocks of [first, last), the band's key
// range, less (with segment ids) those whose id range is disjoint from the query tile's. The
// producer warp and every consumer warp walk the same sequence from the same inputs, so they agree
// on stages, barrier phases and ping-pong turns without exchanging anything.
struct KeyWalk {
  // The lowest block left to consider: the band's first block; with segment ids raised to the
  // lowest block whose prefix reach (every id at or below it) still meets the tile's ids.
  int first;
  // Without segment ids: the block returned last. With them: the block of bit 0 of the window of
  // 32 candidate blocks top, top - 1, .., top - 31 evaluated last.
  int top;
  uint32_t visit;  // segment ids: bit k set = block top - k is still to visit
  uint32_t mixed;  // segment ids: bit k set = block top - k needs segment element masking
};

// The segment-id summaries a walk consults (segment ids only).
struct SegmentWalk {
  const int32_t* kv_ranges;  // the batch row's key chunk ranges
  IdRange q_tile;            // ids of the whole query tile: which blocks are visited
  IdRange q_rows;            // ids of the caller's own rows: which visited blocks need masking
  int64_t len_k;
};

template <bool kSegments>
__device__ __forceinline__ KeyWalk key_walk(int first, int last) {
  // With segment ids, the first call evaluates the window just below top = last - 1 + 32.
  return {first, kSegments ? last - 1 + 32 : last, 0u, 0u};
}

// The next block of the walk, or a value below the band's first block once it is done (-1 with
// segment ids, whose walk raises `first`). With segment ids every lane of the warp must call it
// together: one ballot decides 32 candidate blocks at once, so a tile that skips many blocks (one
// document among many) pays one round of chunk-range loads per 32 blocks, not per block, and the
// walk ends at the first block whose prefix reach shares no id with the tile (in a row of packed
// documents, the start of the tile's first document). kMixed also records, per visited block,
// whether the caller's rows and the block hold anything but one and the same id (then `mixed` is
// set and elements are masked).
template <int kBlockN, bool kSegments, bool kMixed>
__device__ __forceinline__ int next_key_block(KeyWalk& w, const SegmentWalk& seg, bool& mixed) {
  mixed = false;
  if constexpr (!kSegments) {
    return --w.top;
  } else {
    const int lane = static_cast<int>(threadIdx.x) % 32;
    while (w.visit == 0) {
      w.top -= 32;
      if (w.top < w.first) return -1;
      const int cand = w.top - lane;
      bool visit = false;
      bool cand_mixed = false;
      bool below_none = false;
      if (cand >= w.first) {
        const int64_t c0 = static_cast<int64_t>(cand) * kBlockN;
        const int64_t c1 = c0 + kBlockN < seg.len_k ? c0 + kBlockN : seg.len_k;
        const IdRange kv = id_range_fixed<kBlockN / kSegmentChunk>(seg.kv_ranges, c0, c1);
        below_none = seg.q_tile.disjoint(id_reach(seg.kv_ranges, (c1 - 1) / kSegmentChunk));
        visit = !seg.q_tile.disjoint(kv);
        cand_mixed = !seg.q_rows.same_single(kv);
      }
      // The reach only shrinks downwards, so the lanes that see no id ahead are the lanes from
      // the lowest such one up: blocks top - k and below are done with (their own ranges are
      // disjoint too, so none of them is in `visit`).
      const uint32_t done = __ballot_sync(0xffffffffu, below_none);
      if (done != 0) w.first = w.top - (__ffs(static_cast<int>(done)) - 1) + 1;
      w.visit = __ballot_sync(0xffffffffu, visit);
      if constexpr (kMixed) w.mixed = __ballot_sync(0xffffffffu, visit && cand_mixed);
    }
    const int k = __ffs(static_cast<int>(w.visit)) - 1;
    w.visit &= w.visit - 1;
    if constexpr (kMixed) mixed = ((w.mixed >> k) & 1u) != 0;
    return w.top - k;
  }
}

// Logit soft-capping, first half: S = tanh(softmax_scale / softcap * q.k). The factor
// softcap * log2(e) is applied by the online softmax in place of scale_log2, where it folds into
// the exp2's FMA; it is positive, so the row max commutes with it.
template <int kN>
__device__ __forceinline__ void apply_softcap(float (&s)[kN], float scale) {
#pragma unroll
  for (int i = 0; i < kN; ++i) s[i] = tc::fast_tanh(s[i] * scale);
}

// Sets the scores of invisible keys to -inf (by select, so a NaN or Inf computed from a row that
// is not this sequence's stays out). `tm` is the tile mask of this thread's row g and columns
// from 2t, so column c below is tile column 8i + 2t + e. What the caller knows at compile time
// or per warpgroup drops compares: without a finite band only the end of the key sequence can
// hide keys (hi = n_limit), and without kLower no row's lower bound falls inside the tile
// (lo = 0), so the unbounded kernel's tail tile and a causal diagonal tile cost one compare a
// score. With segment ids and `mixed`, key j must also hold row i's id.
template <int kBlockN, bool kBand, bool kLower, bool kSegments>
__device__ __forceinline__ void apply_mask(float (&s)[kBlockN / 2], const TileMask& tm, bool mixed,
                                           const int32_t* kv_ids, int kv_col0, int kv_last,
                                           const int (&q_id)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int lo = kLower ? tm.lo(8 * r) : 0;
    const int hi = kBand ? tm.hi(8 * r) : tm.n_limit;
#pragma unroll
    for (int i = 0; i < kBlockN / 8; ++i) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = 8 * i + e;
        if (c < lo || c >= hi) s[4 * i + 2 * r + e] = -CUDART_INF_F;
      }
    }
  }
  if constexpr (kSegments) {
    if (mixed) {
#pragma unroll
      for (int i = 0; i < kBlockN / 8; ++i) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          // Columns past the sequence end are already hidden; clamping keeps the load in bounds.
          const int j = min(kv_col0 + 8 * i + e, kv_last);
          const int kv = __ldg(kv_ids + j);
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            if (kv != q_id[r]) s[4 * i + 2 * r + e] = -CUDART_INF_F;
          }
        }
      }
    }
  }
}

// The largest score of row r of this thread's S tile (r = 0: row g, r = 1: row g + 8), unscaled,
// over the four threads that hold the row.
template <int kBlockN>
__device__ __forceinline__ float row_max(const float (&s)[kBlockN / 2], int r) {
  float mx = -CUDART_INF_F;
#pragma unroll
  for (int i = 0; i < kBlockN / 8; ++i) {
    mx = fmaxf(mx, fmaxf(s[4 * i + 2 * r], s[4 * i + 2 * r + 1]));
  }
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  return mx;
}

// Replaces the scores of row r by P = 2^(S * scale - m_use) and returns this thread's sum of them
// (two partial sums halve the dependent-add chain).
template <int kBlockN>
__device__ __forceinline__ float exp_row(float (&s)[kBlockN / 2], int r, float scale, float m_use) {
  float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
  for (int i = 0; i < kBlockN / 8; ++i) {
    const float p0 = tc::fast_exp2(fmaf(s[4 * i + 2 * r], scale, -m_use));
    const float p1 = tc::fast_exp2(fmaf(s[4 * i + 2 * r + 1], scale, -m_use));
    s[4 * i + 2 * r] = p0;
    s[4 * i + 2 * r + 1] = p1;
    sum0 += p0;
    sum1 += p1;
  }
  return sum0 + sum1;
}

// Moves row r's running max m to m_new: alpha = 2^(m - m_new), the row's scores become
// P = 2^(S * scale - m_new) and l takes their sum. A row that has seen no key keeps m = -inf; its
// subtraction point is clamped to 0 so that P = 0 and alpha = 0 come out instead of NaN.
template <int kBlockN>
__device__ __forceinline__ void advance_row(float (&s)[kBlockN / 2], int r, float m_new,
                                            float (&m)[2], float (&l)[2], float (&alpha)[2],
                                            float scale) {
  const float m_use = m_new == -CUDART_INF_F ? 0.f : m_new;
  alpha[r] = tc::fast_exp2(m[r] - m_use);
  m[r] = m_new;
  l[r] = l[r] * alpha[r] + exp_row<kBlockN>(s, r, scale, m_use);
}

// Online softmax of one S tile in base 2 (FlashAttention-2, Algorithm 1, lines 8-10): updates the
// running row max m and partial row sum l, replaces S by P = 2^(S * scale - m) and returns the
// factor alpha by which O must be rescaled. `scale` is scale_log2, or softcap * log2(e) on
// soft-capped (tanh) scores (advance_row says how a row that has seen no key stays NaN-free).
template <int kBlockN>
__device__ __forceinline__ void online_softmax(float (&s)[kBlockN / 2], float (&m)[2],
                                               float (&l)[2], float (&alpha)[2], float scale) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    advance_row<kBlockN>(s, r, fmaxf(m[r], row_max<kBlockN>(s, r) * scale), m, l, alpha, scale);
  }
}

// Soft-capped scores are tanh values times `scale` = softcap * log2(e), so no score of a row
// exceeds `scale` (log2 units), and once a row's max is near that bound it can stop following the
// row's scores. A warp whose 16 rows all have a running max within kFreezeGap of the bound raises
// each row's max by the least whole number k >= 0 that puts it at or above scale - kFreezeHeadroom
// (O and l follow through this tile's alpha), and from then on keeps it. No later P exceeds
// 2^kFreezeHeadroom, and the row's largest P so far stays at or above 2^-61 (kFreezeGap -
// kFreezeHeadroom + 1). A frozen warp skips the row max (an FMNMX a score, two shuffles a row),
// alpha's exp2 and O's rescale (an FMUL per O element a tile): the softmax instructions that
// soft-capping does not add, in a softmax bound by issue slots and the MUFU. Raising by whole log2
// units scales every P by exactly 2^-k, which bf16 rounds as it would the unfrozen P.
// Ranges: bf16 P has float32's exponent range, so P <= 2^16 keeps l and O far from overflow and
// scores up to ~2^-65 below the row's largest P stay normal; fp16 P would overflow past 2^15 and
// lose bits below 2^-14, too narrow a window (FwdWgmmaTraits::kFreezeMax).
// `freeze` is the warp's state: 0 online; 1 frozen at the last tile, whose alpha O still needs;
// 2 frozen before it (alpha = 1, and O's rescale is skipped).
inline constexpr float kFreezeHeadroom = 16.f;
inline constexpr float kFreezeGap = 76.f;

template <int kBlockN>
__device__ __forceinline__ void online_softmax_freezing(float (&s)[kBlockN / 2], float (&m)[2],
                                                        float (&l)[2], float (&alpha)[2],
                                                        float scale, int& freeze) {
  if (freeze > 0) {
    freeze = 2;
#pragma unroll
    for (int r = 0; r < 2; ++r) l[r] += exp_row<kBlockN>(s, r, scale, m[r]);
    return;
  }
  float m_new[2];
  bool near = true;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    m_new[r] = fmaxf(m[r], row_max<kBlockN>(s, r) * scale);
    // -inf (a row that has seen no key) is never near: such a warp keeps the online max.
    near = near && m_new[r] >= scale - kFreezeGap;
  }
  if (__all_sync(0xffffffffu, near)) {
    freeze = 1;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      m_new[r] += fmaxf(0.f, ceilf(scale - kFreezeHeadroom - m_new[r]));
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) advance_row<kBlockN>(s, r, m_new[r], m, l, alpha, scale);
}

// Zeroes rows [valid, kBlockN) of one K/V stage tile, every panel, with one warp. A whole
// 128-byte row is cleared, so the swizzle inside it does not matter.
template <class Tr>
__device__ __forceinline__ void zero_tile_rows(uint8_t* tile, int valid, int lane) {
#pragma unroll
  for (int p = 0; p < Tr::kPanels; ++p) {
    uint8_t* const panel = tile + p * Tr::kKVPanelBytes;
    for (int chunk = valid * (Tr::kRowBytes / 16) + lane;
         chunk < Tr::kBlockN * (Tr::kRowBytes / 16); chunk += 32) {
      *reinterpret_cast<uint4*>(panel + chunk * 16) = make_uint4(0u, 0u, 0u, 0u);
    }
  }
}

template <int kD>
__device__ __forceinline__ void rescale_o(float (&o)[kD / 2], const float (&alpha)[2]) {
#pragma unroll
  for (int i = 0; i < kD / 8; ++i) {
    o[4 * i + 0] *= alpha[0];
    o[4 * i + 1] *= alpha[0];
    o[4 * i + 2] *= alpha[1];
    o[4 * i + 3] *= alpha[1];
  }
}

// S = Q K^T for this warpgroup's 64 Q rows and the K tile; O += P V over the keys of the tile.
template <class Tr>
__device__ __forceinline__ void issue_qk(float (&s)[Tr::kBlockN / 2], uint64_t q_desc,
                                         uint64_t k_desc) {
  wgmma_ss_kmajor<Tr::kBlockN, Tr::kD, Tr::kQPanelBytes, Tr::kKVPanelBytes, typename Tr::Element>(
      s, q_desc, k_desc);
}
template <class Tr>
__device__ __forceinline__ void issue_pv(float (&o)[Tr::kD / 2],
                                         const uint32_t (&p)[Tr::kBlockN / 16][4],
                                         uint64_t v_desc) {
  wgmma_rs_mn<Tr::kD, Tr::kBlockN / 16, typename Tr::Element>(o, p, v_desc);
}

// The mbarriers after kBarOffset (FwdWgmmaTraits::kNumBarriers): index 0 is Q buffer 0's full
// barrier, so that a one-buffer kernel's layout is unchanged by the persistent kernels' three.
template <class Tr>
struct FwdBarriers {
  uint32_t first;  // shared address of barrier 0
  __device__ __forceinline__ uint32_t q_full(int buf) const {
    return buf == 0 ? first : first + 8u * (2 + 4 * Tr::kStages);
  }
  __device__ __forceinline__ uint32_t k_full(int stage) const { return first + 8u * (1 + stage); }
  __device__ __forceinline__ uint32_t v_full(int stage) const {
    return first + 8u * (1 + Tr::kStages + stage);
  }
  __device__ __forceinline__ uint32_t k_empty(int stage) const {
    return first + 8u * (1 + 2 * Tr::kStages + stage);
  }
  __device__ __forceinline__ uint32_t v_empty(int stage) const {
    return first + 8u * (1 + 3 * Tr::kStages + stage);
  }
  __device__ __forceinline__ uint32_t v_tail() const { return first + 8u * (1 + 4 * Tr::kStages); }
  // Persistent kernels: every consumer thread is done with Q buffer `buf`'s tile: it has read the
  // buffer's tile index, and its warpgroup's wgmmas and O stores have read the buffer. Each thread
  // arrives itself, after its own read of the index (one arrival per warp would order the other
  // lanes' reads only through the warp's convergence).
  __device__ __forceinline__ uint32_t q_empty(int buf) const {
    return first + 8u * (3 + 4 * Tr::kStages + buf);
  }

  // By one thread, before the CTA's first barrier.
  __device__ __forceinline__ void init() const {
    mbar_init(q_full(0), 1);
    for (int s = 0; s < Tr::kStages; ++s) {
      mbar_init(k_full(s), 1);
      mbar_init(v_full(s), 1);
      // Released by every consumer warp once its wgmmas have read the stage.
      mbar_init(k_empty(s), 4 * Tr::kConsumerWarpgroups);
      mbar_init(v_empty(s), 4 * Tr::kConsumerWarpgroups);
    }
    mbar_init(v_tail(), 1);
    if constexpr (Tr::kPersistent) {
      mbar_init(q_full(1), 1);
      mbar_init(q_empty(0), 128 * Tr::kConsumerWarpgroups);
      mbar_init(q_empty(1), 128 * Tr::kConsumerWarpgroups);
    }
    fence_barrier_init();
  }
};

// Where a tile stands in the sequences a persistent CTA carries from tile to tile; all zeros for a
// CTA of one tile.
struct FwdCursor {
  int ring = 0;  // key blocks the K/V ring has carried before this tile (each stage's use count)
  int tile = 0;  // tiles the CTA ran before: Q buffer tile % 2, used for the (tile / 2 + 1)-th time
};

// Which part of a tile's work fwd_wgmma_tile runs: all of it (a CTA of one tile: barrier set-up,
// the producer warpgroup and the consumer warpgroups), or, in a persistent CTA whose barriers are
// set up once, the producer warp's part or a consumer warpgroup's part.
enum class FwdPart : int { kWhole = 0, kProducer = 1, kConsumer = 2 };

// One CTA's work: query tile `work.tile` of head `work.head`. kSegOn: the tile's rows and keys
// are matched by segment id element by element (a dense row's tile in a segment-id call); off for
// every other tile, the documents of rows scheduled by their runs included. Returns the key blocks
// the tile's walk took through the K/V ring (persistent kernels, which have no segment ids).
template <class Tr, bool kSegOn, FwdPart kPart = FwdPart::kWhole>
__device__ __forceinline__ int fwd_wgmma_tile(const FwdWgmmaArgs& args, const CtaWork& work,
                                              const CUtensorMap& tm_q, const CUtensorMap& tm_k,
                                              const CUtensorMap& tm_v, const CUtensorMap& tm_o,
                                              const FwdCursor& cur = FwdCursor{}) {
  using T = typename Tr::Element;
  constexpr bool kBand = Tr::kBand;
  constexpr bool kSegments = kSegOn;
  // A segment-id kernel's tile that is one document of a row scheduled by its runs.
  constexpr bool kDocument = Tr::kSegments && !kSegOn;
  constexpr int kD = Tr::kD;
  constexpr int kBlockM = Tr::kBlockM;
  constexpr int kBlockN = Tr::kBlockN;
  constexpr int kStages = Tr::kStages;

  // ------------------------------------------------------------------ which tile
  const SeqLayout& layout = args.layout;
  // The tile's span, as the compiler sees warp-uniform values (packed spans are read from
  // cu_seqlens): branches on them then need no divergence guards around later shuffles, and the
  // values can live in uniform registers instead of the consumers' accumulator registers.
  const int head = warp_uniform(static_cast<int>(work.head));
  const SeqTile tile = warp_uniform(work.tile);
  const SeqSpan& span = tile.span;
  // Rows past the span's end are a neighbour's (packed calls, documents of a row).
  const bool varlen = kDocument || layout.varlen();
  // The spare slot of a packed span holds no query row: its CTA runs with len_q = 0, so it visits
  // nothing and stores nothing (an early exit would also make the compiler guard every shuffle).
  const bool no_rows = tile.empty(kBlockM, false);
  const int64_t len_q = no_rows ? 0 : span.len_q;
  const int64_t len_k = span.len_k;
  // kAlignEnd: a dense sequence's tiles start `shift` rows (whole warpgroups) before row 0, so
  // that its last tile ends at its last row or within the last warpgroup.
  int shift = 0;
  if constexpr (Tr::kAlignEnd) {
    if (!varlen) shift = static_cast<int>((kBlockM - len_q % kBlockM) % kBlockM) / 64 * 64;
  }
  const int m0 = no_rows ? 0 : static_cast<int>(tile.block * kBlockM) - shift;
  const int64_t m1 = m0 + kBlockM < len_q ? m0 + kBlockM : len_q;
  // An unbounded kernel uses the compile-time unbounded band: the same policy, with constants the
  // compiler can fold.
  const SeqMask mask = (kBand ? args.band : Band{}).for_seq(len_q, len_k);
  const int64_t key_lo = mask.key_begin(Tr::kAlignEnd && m0 < 0 ? 0 : m0);
  const int64_t key_hi = mask.key_end(m1);
  const int first_block = static_cast<int>(key_lo / kBlockN);
  const int last_block =
      key_hi > key_lo ? static_cast<int>((key_hi + kBlockN - 1) / kBlockN) : first_block;
  // TMA coordinates: a dense map has a batch axis (rows past a row's end read as zeros; a
  // document sits at its position in its row), a packed map one sequence of all rows, addressed
  // from the span's first row.
  const int q_row0 =
      static_cast<int>(kDocument ? layout.map_row_q(span) + m0 : (varlen ? span.q_start + m0 : m0));
  const int k_row0 =
      static_cast<int>(kDocument ? layout.map_row_k(span) : (varlen ? span.k_start : 0));
  const int map_batch = static_cast<int>(kDocument || !varlen ? span.seq : 0);
  // Segment ids (dense calls only): this batch row's ids and chunk summaries.
  const int32_t* q_ranges = nullptr;
  const int32_t* kv_ranges = nullptr;
  IdRange q_tile_ids{0, 0};
  if constexpr (kSegments) {
    q_ranges = segment_row(args.segments.q_ranges, span.batch, layout.seqlen_q);
    kv_ranges = segment_row(args.segments.kv_ranges, span.batch, layout.seqlen_k);
    // Read here, where every thread still has registers to spare: the producer's are few.
    q_tile_ids = id_range_fixed<kBlockM / kSegmentChunk>(q_ranges, m0, m1);
  }

  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw_addr = tc::smem_addr(smem_raw);
  const uint32_t base = (raw_addr + 1023u) & ~1023u;
  uint8_t* const smem = smem_raw + (base - raw_addr);
  // A persistent CTA's tile uses Q buffer cur.tile % 2 and continues the K/V ring's stage
  // sequence at cur.ring; a CTA of one tile starts both at 0.
  const int q_buf = Tr::kPersistent ? cur.tile & 1 : 0;
  const uint32_t q_phase = Tr::kPersistent ? (cur.tile >> 1) & 1 : 0;
  const int ring = Tr::kPersistent ? cur.ring : 0;
  const auto stage_of = [&](int i) { return (ring + i) % kStages; };
  const auto phase_of = [&](int i) { return static_cast<uint32_t>(((ring + i) / kStages) & 1); };
  const uint32_t q_smem = base + Tr::kQOffset + q_buf * Tr::kQBytes;
  const uint32_t k_smem = base + Tr::kKOffset;
  const uint32_t v_smem = base + Tr::kVOffset;
  const FwdBarriers<Tr> bars{base + Tr::kBarOffset};
  const uint32_t bar_q = bars.q_full(q_buf);
  const uint32_t bar_v_tail = bars.v_tail();

  // Q's load and the K tile of key row n0 into `stage`, issued by one thread.
  const auto load_q = [&]() {
    prefetch_tensormap(&tm_q);
    prefetch_tensormap(&tm_k);
    prefetch_tensormap(&tm_v);
    mbar_arrive_expect_tx(bar_q, Tr::kQBytes);
#pragma unroll
    for (int p = 0; p < Tr::kPanels; ++p) {
      tma_load_4d(q_smem + p * Tr::kQPanelBytes, &tm_q, bar_q, p * Tr::kPanelCols, head, q_row0,
                  map_batch);
    }
  };
  const auto load_k = [&](int stage, int n0, int kv_head) {
    mbar_arrive_expect_tx(bars.k_full(stage), Tr::kKVStageBytes);
#pragma unroll
    for (int p = 0; p < Tr::kPanels; ++p) {
      tma_load_4d(k_smem + stage * Tr::kKVStageBytes + p * Tr::kKVPanelBytes, &tm_k,
                  bars.k_full(stage), p * Tr::kPanelCols, kv_head, k_row0 + n0, map_batch);
    }
  };

  if (kPart == FwdPart::kWhole && threadIdx.x == 0) bars.init();
  if constexpr (kPart == FwdPart::kWhole) __syncthreads();

  const int warpgroup = static_cast<int>(threadIdx.x) / 128;
  if (kPart == FwdPart::kProducer || (kPart == FwdPart::kWhole && warpgroup == 0)) {
    // ------------------------------------------------------------------ producer
    if constexpr (kPart == FwdPart::kWhole) setmaxnreg_dec<Tr::kProducerRegs>();
    // One warp: lane 0 issues the loads; all lanes walk the key blocks (segment ballots) and zero
    // a straddling V tile.
    if (kPart == FwdPart::kProducer || threadIdx.x < 32) {
      const int lane = static_cast<int>(threadIdx.x);
      const bool leader = lane == 0;
      SegmentWalk seg{};
      if constexpr (kSegments) seg = {kv_ranges, q_tile_ids, {}, len_k};
      // Q is loaded whenever the band leaves the tile a key block, before the segment walk's
      // first round of loads decides which block that is: Q's latency then overlaps it.
      const bool band_keys = first_block < last_block;
      if (leader && band_keys) load_q();
      // A persistent CTA's consumers wait for every tile's Q-full phase, which also publishes the
      // tile's index: a tile without keys completes it with a plain arrival.
      if (Tr::kPersistent && leader && !band_keys) mbar_arrive(bar_q);
      KeyWalk walk = key_walk<kSegments>(first_block, last_block);
      bool unused;
      int nb = next_key_block<kBlockN, kSegments, false>(walk, seg, unused);
      // A tile whose rows see no key is all zeros / -inf (or the sink): nothing to load. (With
      // segment ids Q may be on its way all the same; the consumers wait for it, see there.)
      if (nb >= first_block) {
        const int kv_head = head / args.group;
        // In a packed call the rows of the block that straddles the sequence's end belong to the
        // next sequence. Its K columns are masked by select, but P = 0 times a NaN in V is still
        // NaN, so its V tile lands on bar_v_tail instead; once the next K load is under way the
        // warp zeroes the tail rows and releases the tile on its V-full barrier.
        int tail_stage = -1;
        int tail_valid = 0;
        const auto release_tail = [&]() {
          mbar_wait(bar_v_tail, 0);
          zero_tile_rows<Tr>(smem + Tr::kVOffset + tail_stage * Tr::kKVStageBytes, tail_valid,
                             lane);
          fence_proxy_async_smem();
          __syncwarp();
          if (leader) mbar_arrive(bars.v_full(tail_stage));
          tail_stage = -1;
        };
        // Key blocks are visited last to first so that the masked ones (diagonal, tail) come first.
        for (int it = 0; nb >= first_block;
             ++it, nb = next_key_block<kBlockN, kSegments, false>(walk, seg, unused)) {
          const int stage = stage_of(it);
          const int n0 = nb * kBlockN;
          // Use u = (ring + it) / kStages of a stage needs the consumers' release of use u - 1.
          const uint32_t empty_parity = phase_of(it) ^ 1u;
          if (leader) {
            if (ring + it >= kStages) mbar_wait(bars.k_empty(stage), empty_parity);
            load_k(stage, n0, kv_head);
          }
          if (tail_stage >= 0) release_tail();
          const bool straddles = varlen && n0 + int64_t{kBlockN} > len_k;
          const uint32_t v_bar = straddles ? bar_v_tail : bars.v_full(stage);
          if (leader) {
            if (ring + it >= kStages) mbar_wait(bars.v_empty(stage), empty_parity);
            mbar_arrive_expect_tx(v_bar, Tr::kKVStageBytes);
#pragma unroll
            for (int p = 0; p < Tr::kPanels; ++p) {
              tma_load_4d(v_smem + stage * Tr::kKVStageBytes + p * Tr::kKVPanelBytes, &tm_v, v_bar,
                          p * Tr::kPanelCols, kv_head, k_row0 + n0, map_batch);
            }
          }
          if (straddles) {
            tail_stage = stage;
            tail_valid = static_cast<int>(len_k - n0);
          }
        }
        if (tail_stage >= 0) release_tail();
      }
    }
  } else if constexpr (kPart != FwdPart::kProducer) {
    // ------------------------------------------------------------------ consumers
    if constexpr (kPart == FwdPart::kWhole) setmaxnreg_inc<Tr::kConsumerRegs>();
    // Per-warpgroup decisions (which rows, which blocks are fully visible) then steer branches
    // the compiler knows are warp-uniform.
    const int cw = warp_uniform(warpgroup - 1);
    const int tid = static_cast<int>(threadIdx.x) % 128;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int t = lane % 4;
    const int g = lane / 4;
    // This warpgroup's rows [r0, r1) of the sequence, and the row of acc rows r = 0 (and r = 1
    // at +8) of this thread.
    const int r0 = m0 + cw * 64;
    const int64_t r1 = r0 + 64 < len_q ? r0 + 64 : len_q;
    const int row = r0 + warp * 16 + g;
    // A warpgroup whose 64 rows all lie past the sequence (the tail of its last query tile), or
    // before it (kAlignEnd's first tile), keeps the barrier protocol (waits, releases, turns) so
    // the others are not blocked, but issues no GEMMs and computes nothing.
    const bool active = r0 < len_q && (!Tr::kAlignEnd || r0 >= 0);

    float o[kD / 2];
#pragma unroll
    for (int i = 0; i < kD / 2; ++i) o[i] = 0.f;
    float m[2] = {-CUDART_INF_F, -CUDART_INF_F};
    float l[2] = {0.f, 0.f};
    // Sinks: the row starts with the sink's logit in its max and exp(0) = 1 in its sum. l is a
    // per-thread partial sum, added over the row's four threads at the end: one of them holds it.
    if (args.sinks != nullptr && active) {
      const float sink =
          args.sinks[span.batch * args.sinks_batch_stride + head] * 1.4426950408889634f;
      m[0] = m[1] = sink;
      l[0] = l[1] = t == 0 ? 1.f : 0.f;
    }

    SegmentWalk seg{};
    const int32_t* kv_ids = nullptr;
    int q_id[2] = {0, 0};
    if constexpr (kSegments) {
      seg = {kv_ranges, q_tile_ids, id_range_fixed<64 / kSegmentChunk>(q_ranges, r0, r1), len_k};
      kv_ids = args.segments.kv_ids + span.batch * layout.seqlen_k;
      if (active) {
        const int32_t* q_ids = args.segments.q_ids + span.batch * layout.seqlen_q;
#pragma unroll
        for (int r = 0; r < 2; ++r)
          q_id[r] = q_ids[min(static_cast<int64_t>(row + 8 * r), len_q - 1)];
      }
    }
    KeyWalk walk = key_walk<kSegments>(first_block, last_block);
    bool mixed;
    int nb = next_key_block<kBlockN, kSegments, true>(walk, seg, mixed);
    // The producer loads Q before its walk has found a block, so with segment ids a tile that
    // visits none may still have Q in flight: it must land before the epilogue stages O in its
    // place and before the CTA's shared memory is released.
    if (kSegments && nb < first_block && first_block < last_block) mbar_wait(bar_q, 0);

    if (nb >= first_block) {
      float s[kBlockN / 2];
#pragma unroll
      for (int i = 0; i < kBlockN / 2; ++i) s[i] = 0.f;
      uint32_t p[kBlockN / 16][4];
      float alpha[2];
      // kFreezeMax: this warp's state (online_softmax_freezing).
      int freeze = 0;

      // Ping-pong (FlashAttention-3, section 3.1): the consumer warpgroups take turns, in a ring,
      // to issue their GEMMs, so that one's softmax runs while another's GEMMs occupy the tensor
      // cores. Turns are: QK^T of the first block; QK^T of each further block with P V of the one
      // before; P V of the last block (the final turn). Warpgroup 0 takes the first turn freely
      // and the end of each turn opens the next warpgroup's; the arrivals exactly match the
      // waits, so no barrier is left pending when the CTA exits. A persistent CTA's tiles continue
      // one ring: the last warpgroup's final turn opens warpgroup 0's first turn of the next tile
      // that has key blocks (ring > 0: an earlier tile had turns), or its wait at the CTA's end.
      constexpr int kGroups = Tr::kConsumerWarpgroups;
      const auto turn_begin = [&](bool first_turn) {
        if (Tr::kPingPong && (cw > 0 || !first_turn || ring > 0)) {
          named_barrier_sync(kBarSchedBase + cw, 256);
        }
      };
      const auto turn_end = [&](bool final_turn) {
        if (Tr::kPingPong && (cw < kGroups - 1 || !final_turn || Tr::kPersistent)) {
          named_barrier_arrive(kBarSchedBase + (cw + 1) % kGroups, 256);
        }
      };
      const auto release = [&](uint32_t bar) {
        if (lane == 0) mbar_arrive(bar);
      };

      const uint64_t q_desc = smem_desc_sw128(q_smem + cw * 64 * Tr::kRowBytes, 16);
      const auto k_desc = [&](int stage) {
        return smem_desc_sw128(k_smem + stage * Tr::kKVStageBytes, 16);
      };
      const auto v_desc = [&](int stage) {
        return smem_desc_sw128(v_smem + stage * Tr::kKVStageBytes, Tr::kKVPanelBytes);
      };

      if (!active) {
        // Same waits, releases and turns as below, without the math.
        mbar_wait(bars.k_full(stage_of(0)), phase_of(0));
        turn_begin(true);
        turn_end(false);
        release(bars.k_empty(stage_of(0)));
        int it = 1;
        for (nb = next_key_block<kBlockN, kSegments, true>(walk, seg, mixed); nb >= first_block;
             nb = next_key_block<kBlockN, kSegments, true>(walk, seg, mixed), ++it) {
          mbar_wait(bars.k_full(stage_of(it)), phase_of(it));
          turn_begin(false);
          mbar_wait(bars.v_full(stage_of(it - 1)), phase_of(it - 1));
          turn_end(false);
          release(bars.k_empty(stage_of(it)));
          release(bars.v_empty(stage_of(it - 1)));
        }
        mbar_wait(bars.v_full(stage_of(it - 1)), phase_of(it - 1));
        turn_begin(false);
        turn_end(true);
        release(bars.v_empty(stage_of(it - 1)));
      } else {
        // Scores of one block: soft-capping, element masks where the block is not entirely visible
        // to this warpgroup's rows (or its segment ids are mixed), then the online softmax.
        const float scale = Tr::kSoftcap ? args.softcap_log2 : args.scale_log2;
        const auto softmax = [&] {
          if constexpr (Tr::kFreezeMax) {
            online_softmax_freezing<kBlockN>(s, m, l, alpha, scale, freeze);
          } else {
            online_softmax<kBlockN>(s, m, l, alpha, scale);
          }
        };
        // O's rescale by the alpha of the block before; nothing once a frozen warp's alpha is 1.
        const auto rescale_acc = [&] {
          if (!Tr::kFreezeMax || freeze < 2) rescale_o<kD>(o, alpha);
        };
        const auto softmax_block = [&](int n0, bool seg_mixed) {
          if constexpr (Tr::kSoftcap) apply_softcap(s, args.softcap_scale);
          if (seg_mixed || !mask.tile_full(r0, r1, n0, n0 + int64_t{kBlockN})) {
            const TileMask tm = mask.tile(row, n0 + 2 * t);
            const int kv_last = static_cast<int>(len_k - 1);
            // Lower bounds rise with the row: the warpgroup's last row has the highest.
            if (kBand && mask.tile(r0, n0).lo(static_cast<int>(r1 - 1 - r0)) > 0) {
              apply_mask<kBlockN, kBand, true, kSegments>(s, tm, seg_mixed, kv_ids, n0 + 2 * t,
                                                          kv_last, q_id);
            } else {
              apply_mask<kBlockN, kBand, false, kSegments>(s, tm, seg_mixed, kv_ids, n0 + 2 * t,
                                                           kv_last, q_id);
            }
            softmax();
          } else {
            softmax();
          }
        };

        mbar_wait(bar_q, q_phase);

        // With kWgSkip, the walk's steps [lead, lead + count) are this warpgroup's blocks (step i
        // is block last_block - 1 - i); the others get idle turns. Without it, every step is.
        constexpr bool kWgSkip =
            kFwdWgSkip && kBand && !Tr::kSegments && !(Tr::kSoftcap && kD > 128);
        const int steps = last_block - first_block;
        int lead = 0;
        int count = steps;
        int wg_first = first_block;
        if constexpr (kWgSkip) {
          const int64_t lo = mask.key_begin(r0);
          const int64_t hi = mask.key_end(r1);
          if (hi > lo) {
            const int b_hi = min(last_block, static_cast<int>((hi + kBlockN - 1) / kBlockN));
            wg_first = max(first_block, static_cast<int>(lo / kBlockN));
            lead = last_block - b_hi;
            count = b_hi - wg_first;
          } else {
            count = 0;
          }
        }
        // Turn i of the walk (0 <= i <= steps) without math: it holds K of step i (i < steps)
        // and V of step i - 1 (i > 0), which the other warpgroups may be using.
        const auto idle_turn = [&](int i) {
          if (i < steps) mbar_wait(bars.k_full(stage_of(i)), phase_of(i));
          if (i > 0) mbar_wait(bars.v_full(stage_of(i - 1)), phase_of(i - 1));
          turn_begin(i == 0);
          turn_end(i == steps);
          if (i < steps) release(bars.k_empty(stage_of(i)));
          if (i > 0) release(bars.v_empty(stage_of(i - 1)));
        };
        if (kWgSkip && count <= 0) {
          // None of the walk's blocks is visible to these rows: O = 0, lse = -inf (or the sink).
          for (int i = 0; i <= steps; ++i) idle_turn(i);
        } else {
          if constexpr (kWgSkip) {
            for (int i = 0; i < lead; ++i) idle_turn(i);
            walk.top -= lead;
            nb -= lead;
          }

          // The first block's S is computed and softmaxed before the loop, so that inside the loop
          // the P V of block it-1 runs under the softmax of block it (FlashAttention-3, Algorithm
          // 2).
          bool next_mixed;
          int next;
          {
            const int s0 = stage_of(lead);
            mbar_wait(bars.k_full(s0), phase_of(lead));
            turn_begin(lead == 0);
            wgmma_fence();
            issue_qk<Tr>(s, q_desc, k_desc(s0));
            wgmma_commit();
            // A skipped step before this one: its V is released in this turn.
            if (kWgSkip && lead > 0) mbar_wait(bars.v_full(stage_of(lead - 1)), phase_of(lead - 1));
            turn_end(false);
            // The walk's chunk-range loads (segment ids) run under the GEMM.
            next = next_key_block<kBlockN, kSegments, true>(walk, seg, next_mixed);
            wgmma_wait<0>();
            fence_operand(s);
            release(bars.k_empty(s0));
            if (kWgSkip && lead > 0) release(bars.v_empty(stage_of(lead - 1)));
            softmax_block(nb * kBlockN, mixed);
            convert_p<kBlockN, T>(s, p);
          }

          int it = lead + 1;
#pragma unroll 1
          for (; next >= wg_first; ++it) {
            nb = next;
            mixed = next_mixed;
            const int stage = stage_of(it);
            const int prev = stage_of(it - 1);
            mbar_wait(bars.k_full(stage), phase_of(it));
            turn_begin(false);
            wgmma_fence();
            issue_qk<Tr>(s, q_desc, k_desc(stage));
            wgmma_commit();
            // O's rescale for block it-1 is done here, hidden under the QK^T just issued.
            rescale_acc();
            mbar_wait(bars.v_full(prev), phase_of(it - 1));
            wgmma_fence();
            issue_pv<Tr>(o, p, v_desc(prev));
            wgmma_commit();
            turn_end(false);
            next = next_key_block<kBlockN, kSegments, true>(walk, seg, next_mixed);

            wgmma_wait<1>();  // S of block it is complete; P V of block it-1 may still run
            fence_operand(s);
            release(bars.k_empty(stage));
            softmax_block(nb * kBlockN, mixed);
            wgmma_wait<0>();
            fence_operand(o);
            fence_operand(p);
            release(bars.v_empty(prev));
            convert_p<kBlockN, T>(s, p);
          }

          {
            const int last = stage_of(it - 1);
            // Skipped steps after this warpgroup's blocks: this turn holds the next step's K.
            const bool more = kWgSkip && it < steps;
            if (more) mbar_wait(bars.k_full(stage_of(it)), phase_of(it));
            rescale_acc();
            mbar_wait(bars.v_full(last), phase_of(it - 1));
            turn_begin(false);
            wgmma_fence();
            issue_pv<Tr>(o, p, v_desc(last));
            wgmma_commit();
            turn_end(!more);
            wgmma_wait<0>();
            fence_operand(o);
            fence_operand(p);
            release(bars.v_empty(last));
            if (more) release(bars.k_empty(stage_of(it)));
          }
          if constexpr (kWgSkip) {
            for (int i = it + 1; i <= steps; ++i) idle_turn(i);
          }
        }
      }
    }

    if (active) {
      // Epilogue: O = acc / l, lse = ln(2) * (m + log2(l)); a row that saw no key gets O = 0 and
      // lse = -inf (the sink with sinks: m = sink, l = 1).
      float inv_l[2];
      float lse[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float sum = l[r];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        inv_l[r] = sum > 0.f ? 1.f / sum : 0.f;
        lse[r] = sum > 0.f ? (m[r] + log2f(sum)) * 0.69314718055994531f : -CUDART_INF_F;
      }

      // O goes through this warpgroup's own 64 rows of the Q tile (no longer read by any wgmma)
      // in the same swizzled panel layout. Row index inside the warpgroup is 16 * warp + g (+8);
      // both have (row % 8) == g, so chunk c of either row sits at c ^ g.
      uint8_t* const o_stage = smem + Tr::kQOffset + q_buf * Tr::kQBytes + cw * 64 * Tr::kRowBytes;
#pragma unroll
      for (int i = 0; i < kD / 8; ++i) {
        const int panel = i / 8;
        const int chunk = (i % 8) ^ g;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row_in_wg = warp * 16 + g + 8 * r;
          const uint32_t packed =
              tc::pack2<T>(o[4 * i + 2 * r] * inv_l[r], o[4 * i + 2 * r + 1] * inv_l[r]);
          *reinterpret_cast<uint32_t*>(o_stage + panel * Tr::kQPanelBytes +
                                       row_in_wg * Tr::kRowBytes + chunk * 16 + t * 4) = packed;
        }
      }
      fence_proxy_async_smem();
      named_barrier_sync(kBarEpilogueBase + cw, 128);
      if (!varlen || r0 + 64 <= len_q) {
        // One TMA store per panel; a dense map clips rows past the sequence.
        if (tid == 0) {
#pragma unroll
          for (int pnl = 0; pnl < Tr::kPanels; ++pnl) {
            tma_store_4d(&tm_o, q_smem + pnl * Tr::kQPanelBytes + cw * 64 * Tr::kRowBytes,
                         pnl * Tr::kPanelCols, head, q_row0 + cw * 64, map_batch);
          }
          tma_store_commit_and_wait_read();
        }
      } else {
        // Packed, and the rows run past the sequence into the next one's: 16-byte stores of the
        // rows inside it only.
        constexpr int kChunks = kD / 8;
        const int64_t row_stride = static_cast<int64_t>(args.heads_q) * kD;
        T* const o_rows = static_cast<T*>(args.o) + (span.q_start + r0) * row_stride + head * kD;
        const int rows = static_cast<int>(r1 - r0);
        for (int idx = tid; idx < rows * kChunks; idx += 128) {
          const int rr = idx / kChunks;
          const int c = idx % kChunks;
          const uint4 v =
              *reinterpret_cast<const uint4*>(o_stage + (c / 8) * Tr::kQPanelBytes +
                                              rr * Tr::kRowBytes + (((c % 8) ^ (rr % 8)) * 16));
          *reinterpret_cast<uint4*>(o_rows + rr * row_stride + c * 8) = v;
        }
      }
      if (t == 0) {
        float* const lse_row = args.lse + span.stat_start + head * span.stat_head;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          if (row + 8 * r < len_q) lse_row[row + 8 * r] = lse[r];
        }
      }
    }
    // The O stores above have read the Q buffer (their issuer, thread 0, waited for that before
    // its arrival), no wgmma reads it any more, and this thread has read its tile index: the
    // producer may publish a later tile in the buffer and load that tile's Q into it.
    if constexpr (Tr::kPersistent) mbar_arrive(bars.q_empty(q_buf));
  }
  return first_block < last_block ? last_block - first_block : 0;
}

#endif  // JAX_FLASH_SM90A

// One CTA per (kBlockM-row query tile, query head). Dense calls enumerate the query tiles of one
// (batch element, head) fastest (with runs: the row's tile slots), packed calls the tile slots of
// all sequences of one head (the scheduler's order), so that the CTAs running together share K/V
// in L2. Warpgroup 0 is the TMA producer, the others the consumers (fwd_wgmma_tile).
template <class Tr>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    fwd_wgmma_kernel(const FwdWgmmaArgs args, const __grid_constant__ CUtensorMap tm_q,
                     const __grid_constant__ CUtensorMap tm_k,
                     const __grid_constant__ CUtensorMap tm_v,
                     const __grid_constant__ CUtensorMap tm_o) {
#if JAX_FLASH_SM90A
  // The segment-id kernels are launched as the programmatic dependents of the summary kernel that
  // writes their ids' records (fwd_wgmma.cu): nothing before this reads or writes global memory.
  if constexpr (Tr::kSegments) wait_for_primary();
  // Banded tiles near a sequence's end visit the most key blocks (causal): launch them first.
  // Only the segment-id kernels schedule rows by their documents.
  SeqLayout layout = args.layout;
  if constexpr (!Tr::kSegments) layout.runs = nullptr;
  const CtaWork work = args.order.work(layout, blockIdx.x, Tr::kBand, Tr::kBlockM, false);
  if constexpr (Tr::kSegments) {
    if (args.layout.has_runs()) {
      // A row's slots past its tiles hold nothing: they leave before any set-up. A document of a
      // row scheduled by its runs sees only its own keys, so its tile needs no segment ids.
      if (work.tile.empty(Tr::kBlockM, false)) return;
      if (work.tile.packed) {
        fwd_wgmma_tile<Tr, false>(args, work, tm_q, tm_k, tm_v, tm_o);
        return;
      }
    }
  }
  fwd_wgmma_tile<Tr, Tr::kSegments>(args, work, tm_q, tm_k, tm_v, tm_o);
#else
  // A device pass without the sm_90a instructions (the host never launches it there).
  __trap();
#endif  // JAX_FLASH_SM90A
}

// The persistent form: gridDim.x CTAs (at most one per SM) run all args.order.ctas() tiles. CTA c
// starts with tile c; its producer warp then claims one tile after another from
// args.work_counter (tile gridDim.x + the counter's old value, in launch order: the claim is as
// greedy as the hardware's CTA dispatch, and tiles heavier first), until the tiles run out. The
// producer publishes each tile's index in the slot of the Q buffer it loads the tile's Q into,
// before its arrival on that buffer's full barrier; the consumers read it after their wait, decode
// the same tile and run it, while the producer already loads the next tile's Q into the other
// buffer and its first K/V blocks into the ring. -1 ends the consumers' loop. What this saves
// against a CTA per tile: a CTA's launch, barrier set-up and register hand-off, and the wait for
// its Q, which otherwise start every tile (about a third of a head_dim-64 CTA's life at 1k keys,
// docs/PERF_LOG.md).
template <class Tr>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    fwd_wgmma_persistent_kernel(const FwdWgmmaArgs args, const __grid_constant__ CUtensorMap tm_q,
                                const __grid_constant__ CUtensorMap tm_k,
                                const __grid_constant__ CUtensorMap tm_v,
                                const __grid_constant__ CUtensorMap tm_o) {
#if JAX_FLASH_SM90A
  static_assert(Tr::kPersistent && !Tr::kSegments);
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw_addr = tc::smem_addr(smem_raw);
  const uint32_t base = (raw_addr + 1023u) & ~1023u;
  const FwdBarriers<Tr> bars{base + Tr::kBarOffset};
  volatile int* const slots =
      reinterpret_cast<volatile int*>(smem_raw + (base - raw_addr) + Tr::kSlotOffset);
  if (threadIdx.x == 0) bars.init();
  __syncthreads();

  SeqLayout layout = args.layout;
  layout.runs = nullptr;
  const int tiles = static_cast<int>(args.order.ctas());
  const auto work_of = [&](int tile) {
    return args.order.work(layout, tile, Tr::kBand, Tr::kBlockM, false);
  };
  FwdCursor cur{};
  if (threadIdx.x < 128) {
    setmaxnreg_dec<Tr::kProducerRegs>();
    if (threadIdx.x < 32) {
      const int lane = static_cast<int>(threadIdx.x);
      int tile = static_cast<int>(blockIdx.x);
      for (;; ++cur.tile) {
        const int buf = cur.tile & 1;
        // The next tile is claimed before this one's loads, so the atomic's latency hides there.
        int next = 0;
        if (lane == 0 && tile < tiles) {
          next = atomicAdd(args.work_counter, 1) + static_cast<int>(gridDim.x);
        }
        // The buffer's slot and Q are free once every consumer thread has finished the tile that
        // used them before (its (cur.tile / 2)-th use, phase parity (cur.tile / 2 - 1) % 2).
        if (cur.tile >= 2) mbar_wait(bars.q_empty(buf), ((cur.tile >> 1) + 1) & 1);
        const bool done = tile >= tiles;
        if (lane == 0) {
          slots[buf] = done ? -1 : tile;
          // The slot's store is released by the arrival on the buffer's full barrier: here, or in
          // the tile's producer part (Q's arrival with its byte count, or a plain one).
          if (done) mbar_arrive(bars.q_full(buf));
        }
        if (done) break;
        cur.ring += fwd_wgmma_tile<Tr, false, FwdPart::kProducer>(args, work_of(tile), tm_q, tm_k,
                                                                  tm_v, tm_o, cur);
        tile = __shfl_sync(0xffffffffu, next, 0);
      }
    }
  } else {
    setmaxnreg_inc<Tr::kConsumerRegs>();
    for (;; ++cur.tile) {
      const int buf = cur.tile & 1;
      mbar_wait(bars.q_full(buf), (cur.tile >> 1) & 1);
      const int tile = warp_uniform(slots[buf]);
      if (tile < 0) break;
      cur.ring += fwd_wgmma_tile<Tr, false, FwdPart::kConsumer>(args, work_of(tile), tm_q, tm_k,
                                                                tm_v, tm_o, cur);
    }
    // The last warpgroup's final turn of the last tile with key blocks opened warpgroup 0's next
    // turn (fwd_wgmma_tile's ping-pong): warpgroup 0 takes it, so no barrier is left pending.
    if (Tr::kPingPong && threadIdx.x < 256 && cur.ring > 0) named_barrier_sync(kBarSchedBase, 256);
  }
#else
  __trap();
#endif  // JAX_FLASH_SM90A
}

}  // namespace jax_flash::cuda::sm90
