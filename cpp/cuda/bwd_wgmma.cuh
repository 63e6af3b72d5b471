// FlashAttention backward for Hopper (sm_90a) on warpgroup MMA, after the FlashAttention-3
// paper's backward. One CTA per (128-key tile, kv head) of the tile scheduler (common/schedule.h):
// K_j and V_j are loaded once by TMA; a producer warp streams Q_i, dO_i (TMA) and lse_i, delta_i
// (plain loads) of every query tile that the mask lets see the key tile, for every query head of
// the GQA group, through a ring of stages guarded by mbarriers; two consumer warpgroups, each
// owning 64 of the 128 keys, compute
//   S^T = K Q^T, dP^T = V dO^T                      (wgmma, both operands from shared memory)
//   P^T = 2^(S^T scale log2e - lse log2e), dS^T = P^T (dP^T - delta)       (registers)
//     (soft-capped: t = tanh(S^T scale / c), P^T = 2^(c log2e t - lse log2e), and dS^T gets the
//     factor 1 - t^2 of the tanh's derivative)
//   dV += P^T dO, dK += dS^T Q                      (wgmma, P^T / dS^T as the register operand)
//   dQ_i += dS K                                    (wgmma, dS^T staged in shared memory)
// and add dQ_i into the fp32 dq_accum: staged in shared memory and added by TMA reductions (one
// bulk operation per 32 columns instead of a vector atomic per thread and row), or, for a packed
// sequence's last tile, with vector atomics from registers. In the deterministic order the staged
// tile is handed to a writer warp of the producer warpgroup (bwd_dq_writer), which waits for the
// tile's turn, so that the consumers never spin; at head_dim 256, which stages dQ_i in the
// warpgroup's dead Q / dO panels, writer warps issue every reduction (bwd_dq_writer_split).
// Head_dim 64, 128 and 256; at 256 (BwdWgmmaTraits::kSplitQ) a CTA owns 64 keys, the warpgroups
// split dK / dV's columns and S^T's queries, and exchange their halves of P^T and dS^T through
// shared memory. At 64 (JAX_FLASH_BWD_M128) a query tile has 128 rows instead of 64, and the
// warpgroups split dQ_i's rows rather than its columns. Inside a warpgroup the GEMMs of one query
// tile are ordered so that each runs under elementwise work: dV under dS = P (dP - delta) and the
// dS^T stores, dK under the dQ_i staging (dQ_i is computed before dK for that reason). Working on
// the transposed products keeps the key axis on the accumulator rows, so dK and dV stay in
// registers across the whole loop and P^T, dS^T are already in the register-operand layout of the
// dV/dK GEMMs.
//
// Masks (common/mask.h) are decided once per (query tile, key tile) pair by the producer, which
// skips the pairs no query of which sees a key (outside the band's row range, disjoint segment
// ids) and hands each visited pair to the consumers in a small header beside its lse / delta:
// whether it needs element masking and the TileMask to apply. The consumers follow the headers,
// so both roles walk the same sequence of pairs by construction; an end header closes it.
//
// Shared-memory tiles use the forward's 128-byte-swizzled panel layout (cuda/fwd_wgmma.cuh,
// whose PTX wrappers, descriptors and barrier helpers this file reuses).
#pragma once

#include "common/mask.h"
#include "common/schedule.h"
#include "cuda/dq_convert.cuh"
#include "cuda/fwd_wgmma.cuh"

namespace jax_flash::cuda::sm90 {

struct BwdWgmmaArgs {
  const float* lse;    // dense [batch, heads_q, seqlen_q], packed [heads_q, total_q]; natural log
  const float* delta;  // same layout as lse
  float* dq_accum;     // [rows_q, heads_q, D], unscaled dS K sums
  // [rows_q, heads_q, kDqCounters] counters that put each dQ tile's additions in key-tile order
  // (dq_convert.cuh); nullptr: atomics in any order. With segment ids every pair of the band is
  // then visited, since the order counts the key tiles by position, not by shared ids.
  int32_t* dq_semaphores;
  void* dk;  // [rows_k, heads_kv, D]
  void* dv;
  SeqLayout layout;
  Band band;             // unbounded in the kernels without kMasked
  SegmentIds segments;   // dense only; enabled only in the kernels with kMasked
  int64_t seg_stride_q;  // layout.seqlen_q: per-batch stride of q_ids
  int64_t seg_stride_k;  // layout.seqlen_k
  int heads_q;
  int heads_kv;
  int group;  // heads_q / heads_kv
  // Units: kv heads; levels: their key tiles, every sequence's (layout.tiles(kBlockN, true)).
  LaunchOrder order;
  float scale;
  float scale_log2;
  // Soft-capping, as the forward computes it: t = tanh(x * softcap_scale) for the raw product
  // x = q.k, score in log2 units softcap_log2 * t (kSoftcap kernels only).
  float softcap_scale;  // softmax_scale / softcap
  float softcap_log2;   // softcap * log2(e)
};

// Head_dim 64 with 128 queries per (query tile, key tile) pair (1) or 64 (0, the tile of head_dim
// 128 and 256), to compare the two.
#ifndef JAX_FLASH_BWD_M128
#define JAX_FLASH_BWD_M128 1
#endif

// kMasked: the band has a finite bound or segment ids are given, so tile pairs inside a sequence
// may be skipped or need element masking (without it only the end of a sequence is masked).
// kSoftcap: logit soft-capping.
template <typename T, int kHeadDim, bool kMasked, bool kSoftcap>
struct BwdWgmmaTraits {
  using Element = T;
  static constexpr int kD = kHeadDim;
  static constexpr bool kIsMasked = kMasked;
  static constexpr bool kIsSoftcap = kSoftcap;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kThreads = 128 * (kConsumerWarpgroups + 1);
  // Head_dim 64 / 128: each consumer warpgroup owns 64 of the CTA's 128 keys (the M extent of one
  // wgmma) with all of dK and dV's columns. Head_dim 256 (kSplitQ): dK and dV of 64 keys are
  // already 256 registers a thread, so the CTA has 64 keys, each warpgroup owns half of dK and
  // dV's columns, and the two split the queries of S^T and dP^T instead (kSCols each): the
  // halves of P^T and dS^T are exchanged through shared memory before the dV / dK GEMMs, which
  // reduce over all the tile's queries.
  static constexpr bool kSplitQ = kD == 256;
  static constexpr int kBlockN = kSplitQ ? 64 : 64 * kConsumerWarpgroups;
  // Queries per pair. Head_dim 64 (JAX_FLASH_BWD_M128): 128, so that the per-pair fixed costs
  // (stage and GEMM waits, the dS^T barrier, proxy fences, the dQ_i hand-off, the header and
  // lse / delta handling), which dominate a pair of the short head_dim-64 GEMMs, are paid once
  // per 128 queries, and S^T is one m64n128 GEMM (each K fragment read once per 128 queries);
  // kPair128 below says how the registers fit. Head_dim 128 and 256 keep 64 (their dK / dV
  // registers leave no room).
  static constexpr int kBlockM = kD == 64 && JAX_FLASH_BWD_M128 != 0 ? 128 : 64;
  static constexpr int kSCols = kSplitQ ? kBlockM / kConsumerWarpgroups : kBlockM;
  static constexpr int kDkCols = kSplitQ ? kD / kConsumerWarpgroups : kD;
  // Q / dO stages: with 64-query tiles a third fits beside the head_dim-64 tiles, and gives the
  // producer a whole extra pair's time to refill a stage; 128-query tiles (Q and dO 32 KB a
  // stage, a third would pass the 227 KB) and head_dim 128 and 256 have room for two.
  static constexpr int kStages = kD == 64 && kBlockM == 64 ? 3 : 2;
  // dO completes on a barrier of its own (BwdPairHeader::dout_full), so that S^T starts once Q
  // has landed: head_dim 256, whose stage returns to the producer late (it holds dQ_i's staging),
  // waits on the stage for much of a pair, and gained 1-3% from it; head_dim 64 lost 2%
  // (docs/PERF_LOG.md).
  static constexpr bool kDoBarrier = kSplitQ;
  // dQ_i = dS K reduces over all the tile's keys, so each warpgroup needs the other's dS^T rows,
  // and each dQ element is added to dq_accum once per key tile; kDqGemms GEMMs of kDqCols columns
  // each, added through TMA reductions. With 64-query tiles the two warpgroups split the head
  // dimension; with 128 (kDqSplitRows) they split the queries instead, 64 each with all the
  // columns (one m64n64 GEMM over the 128 keys, staged as two of the same 64-row TMA boxes).
  // Head_dim 256 has no shared memory left for a staging buffer
  // (kDqStaged is false there): it stages dQ_i in the warpgroup's own panels of Q and dO once
  // they are dead (bwd_dq_writer_split).
  static constexpr bool kDqSplitRows = kBlockM == 64 * kConsumerWarpgroups && !kSplitQ;
  static constexpr int kDqRows = kDqSplitRows ? kBlockM / kConsumerWarpgroups : kBlockM;
  static constexpr int kDqCols = kSplitQ ? 64 : kDqSplitRows ? kD : kD / kConsumerWarpgroups;
  static constexpr int kDqGemms = kDqSplitRows ? 1 : kD / (kConsumerWarpgroups * kDqCols);
  // Consumer warpgroup cw's part of dQ_i: tile rows from dq_row0(cw), head columns from
  // dq_col0(cw).
  __host__ __device__ static constexpr int dq_row0(int cw) {
    return kDqSplitRows ? cw * kDqRows : 0;
  }
  __host__ __device__ static constexpr int dq_col0(int cw) {
    return kDqSplitRows ? 0 : cw * kDqCols;
  }
  static constexpr bool kDqStaged = !kSplitQ;
  // Rows of one dq_accum TMA box. kWarpDq (head_dim 64 / 128, order of arrival): each consumer
  // warp adds its own 16 query rows of dQ_i as soon as it has staged them, with no warpgroup
  // barrier between the staging and the reduction. The deterministic writer then adds a tile as
  // kDqRows / kDqBoxRows pieces; head_dim 256 keeps 64-row boxes.
  static constexpr bool kWarpDq = kDqStaged;
  static constexpr int kDqBoxRows = kWarpDq ? 16 : kDqRows;

  // Consumers hold dK and dV (kDkCols / 2 registers each), S^T and dP^T (kSCols / 2 each), dQ
  // (kDqCols / 2) and the 16-bit P^T, dS^T (kSCols / 4 each). With 128-query tiles (kPair128)
  // S^T, dP^T, dK and dV alone take 192 of the 240 registers, and the pair loop is arranged so
  // that hardly more is live at once:
  // - the float32 factor of dS that bwd_probs leaves in S^T's registers (P, or P (1 - t^2) with
  //   soft-capping) is kept as f16 pairs instead (wh, 32 registers; S^T is then dead), as the
  //   mma.sync backward keeps P for dS: for a factor in [0, 1] f16 is 4x more precise than the
  //   bf16 rounding dS^T gets anyway;
  // - dP^T is issued in two halves of 64 queries, the first with S^T, the second once the P^T
  //   math is done and S^T is dead, so that its 32 registers are not taken during that math; the
  //   first half's dS^T math then runs under the second half;
  // - masked pairs run the unmasked P^T math, then clear the hidden elements of the packed P^T and
  //   wh (bwd_mask_packed), with the mask as two bit masks (bwd_visible_bits) rather than a
  //   predicate per element.
  static constexpr bool kPair128 = kBlockM == 128;
  static_assert(!kPair128 || !kSplitQ);
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;

  static constexpr int kPanelCols = 64;
  static constexpr int kPanels = kD / kPanelCols;
  static constexpr int kRowBytes = 128;
  static constexpr int kKVPanelBytes = kBlockN * kRowBytes;
  static constexpr int kKVBytes = kKVPanelBytes * kPanels;
  static constexpr int kQPanelBytes = kBlockM * kRowBytes;
  static constexpr int kQStageBytes = kQPanelBytes * kPanels;
  // dS^T of one query tile: kBlockN key rows of kBlockM queries, in kDsPanels panels of 64
  // queries (128-byte rows, as the TMA lays out Q); P^T alike where the warpgroups exchange it.
  static constexpr int kDsPanels = kBlockM * 2 / kRowBytes;
  static constexpr int kDsPanelBytes = kBlockN * kRowBytes;
  static constexpr int kDsBytes = kDsPanelBytes * kDsPanels;
  static constexpr int kPBytes = kSplitQ ? kDsBytes : 0;
  // dQ_i of one warpgroup (kDqRows queries x kDqCols head-dim columns, float32) on its way to
  // dq_accum: TMA boxes of 32 columns, each kDqRows 128-byte rows with the 128-byte swizzle.
  static constexpr int kDqBoxBytes = kDqRows * kRowBytes;
  static constexpr int kDqBoxes = kDqCols / 32;
  static constexpr int kDqWgBytes = kDqStaged ? kDqBoxBytes * kDqBoxes : 0;
  // Per stage: lse * log2(e), delta and the query segment ids (kBlockM 4-byte values each), then
  // the pair's header (BwdPairHeader).
  static constexpr int kHeaderBytes = 48;
  static constexpr int kRowStatBytes = 3 * kBlockM * 4 + kHeaderBytes;

  static constexpr int kKOffset = 0;
  static constexpr int kVOffset = kKOffset + kKVBytes;
  static constexpr int kQOffset = kVOffset + kKVBytes;
  static constexpr int kDoOffset = kQOffset + kStages * kQStageBytes;
  static constexpr int kDsOffset = kDoOffset + kStages * kQStageBytes;
  static constexpr int kPOffset = kDsOffset + 2 * kDsBytes;
  static constexpr int kDqOffset = kPOffset + 2 * kPBytes;
  static constexpr int kStatOffset = kDqOffset + kConsumerWarpgroups * kDqWgBytes;
  static constexpr int kBarOffset = kStatOffset + kStages * kRowStatBytes;
  // mbarriers: K/V full, then full and empty per stage.
  static constexpr int kNumBarriers = 1 + 2 * kStages;
  // The CTA's tile (BwdCtaTile), written once by thread 0.
  static constexpr int kTileOffset = kBarOffset + 8 * kNumBarriers;
  static constexpr int kTileBytes = 128;
  // Segment ids of the tile's keys (kBlockN ints), written by the producer warp.
  static constexpr int kKvIdOffset = kTileOffset + kTileBytes;
  // The deterministic order's hand-off of a staged dQ_i to its writer warp (BwdDqHandoff), one per
  // consumer warpgroup (head_dim 64 / 128).
  static constexpr int kHandoffBytes = kDqStaged ? 32 : 0;
  static constexpr int kHandoffOffset = kKvIdOffset + kBlockN * 4;
  // The kernel aligns its base to 1024 bytes (the swizzle's period); dynamic shared memory starts
  // 16-byte aligned, so that costs at most 1008 bytes (head_dim 256 needs all but a few of them).
  static constexpr int kSmemBytes = kHandoffOffset + kConsumerWarpgroups * kHandoffBytes + 1008;

  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>);
  static_assert(kD == 64 || kD == 128 || kD == 256, "head_dim 64, 128 and 256 only");
  static_assert(kBlockM * 2 == kDsPanels * kRowBytes, "dS^T rows are whole swizzle spans");
  static_assert(kDsPanels == 1 || !kSplitQ, "the P^T / dS^T exchange reads one panel");
  static_assert(kKVPanelBytes % 1024 == 0 && kQPanelBytes % 1024 == 0 &&
                kDsPanelBytes % 1024 == 0 && kDqBoxBytes % 1024 == 0);
  static_assert(kDqCols == 64 || kDqCols == 32, "dQ GEMMs are m64n64 or m64n32");
  static_assert(kDqRows == 64, "dQ GEMMs have 64 query rows (one wgmma M extent)");
  static_assert(kDqBoxBytes == 8192 && (kQPanelBytes == 8192 || !kSplitQ),
                "dq_reduce_boxes and stage_dq_boxes space the 32-column boxes 8 KB apart");
  static_assert(kDkCols == 128 || kDkCols == 64, "dV / dK GEMMs are m64n128 or m64n64");
  static_assert(kSCols == 128 || kSCols == 64 || kSCols == 32,
                "S^T GEMMs are m64n128, m64n64 or m64n32");
  static_assert(kRowStatBytes % 16 == 0, "headers are read as 16-byte vectors");
  static_assert(kHandoffOffset % 8 == 0, "the hand-off holds an int64_t");
  static_assert(kConsumerWarpgroups + 1 <= 4, "one writer warp per consumer warpgroup");
  static_assert(kBlockM % kSegmentChunk == 0 && kBlockN % kSegmentChunk == 0);
  static_assert(kSmemBytes <= 227 * 1024);
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumerWarpgroups <= 65536);
};

// Named barriers (id 0 is __syncthreads): both consumer warpgroups together (dS^T written; zeroed
// rows of a packed sequence's boundary tile), and each consumer warpgroup alone (dQ_i staged for
// its TMA reduction, its deterministic turn; ids 2 and 3). In the deterministic order, per
// consumer warpgroup and shared with its writer warp (128 + 32 threads): dQ_i staged (the
// consumers arrive, the writer waits; ids 4 and 5) and the staging buffer free again (the writer
// arrives, the consumers wait; ids 6 and 7).
inline constexpr int kBwdBarConsumers = 1;
inline constexpr int kBwdBarDsOwnBase = 2;
inline constexpr int kBwdBarDqStagedBase = 4;
inline constexpr int kBwdBarDqFreeBase = 6;
inline constexpr int kBwdDqHandoffThreads = 128 + 32;

// What the producer tells the consumers about one visited (query tile, key tile) pair.
struct BwdPairHeader {
  int64_t dq_offset;  // element offset of (first query row, head) in dq_accum
  int rows;           // query rows of the tile inside the sequence (1..kBlockM)
  int flags;          // kPair* bits
  TileMask mask;      // query row r sees key column c iff mask.visible(r, c) (kPairMasked)
  int m0;             // the tile's first query row, sequence-local (the deterministic order)
  int head;           // the query head
  int pad;
  // The stage's dO mbarrier (BwdWgmmaTraits::kDoBarrier), which lives here for want of other room
  // at head_dim 256. Initialised once per CTA; the producer writes the fields above one by one and
  // never this one.
  uint64_t dout_full;
};
static_assert(sizeof(BwdPairHeader) == 48);

// A staged dQ_i as a consumer warpgroup hands it to its writer warp (deterministic order only):
// where the tile goes and when its turn comes.
struct BwdDqHandoff {
  int64_t sem;  // the tile's counter: index into dq_semaphores
  int row;      // TMA coordinates of the staged first query row (packed: row of the [rows] view)
  int batch;
  int head;
  int ticket;  // dq_ticket: the counter value at which the tile's turn comes
  int end;     // no more tiles: the writer leaves
  int pad;
};
static_assert(sizeof(BwdDqHandoff) == 32, "BwdWgmmaTraits::kHandoffBytes");

inline constexpr int kPairEnd = 1;       // no more pairs: the consumers leave the loop
inline constexpr int kPairMasked = 2;    // apply mask (band, end of the sequence's keys)
inline constexpr int kPairSegments = 4;  // ... and q_id == kv_id (ids in the stage)
inline constexpr int kPairZeroRows = 8;  // rows >= `rows` of Q and dO are a neighbour's: zero them

// The key tile of one CTA, the query tiles it visits (before segment skipping) and what the
// producer asks of the mask for each, computed once by thread 0 and read by all from shared
// memory: re-reading it where it is needed keeps the 24-register producer from spilling.
struct BwdCtaTile {
  SeqSpan span;
  SeqMask mask;      // the band of the span's sequence
  IdRange kv_range;  // segment ids of the tile's keys (segments only)
  int head_kv;
  int n0;       // first key of the tile, sequence-local
  int m_first;  // first query tile (block index) whose rows may see a key of the tile
  int num_m;    // query tiles from m_first on that may
  int empty;    // the tile holds no key of its span: the CTA has nothing to do
  int packed;   // SeqTile::packed
};
static_assert(sizeof(BwdCtaTile) <= 128, "BwdWgmmaTraits::kTileBytes");

// The CTA's work for block index `cta` of the grid (key tiles of one kv head fastest). kRuns: the
// kernel may schedule rows by their documents (only the kernels that take segment ids do).
template <int kBlockM, int kBlockN, bool kRuns>
JF_HOST_DEVICE BwdCtaTile bwd_cta_tile(const BwdWgmmaArgs& args, const Band& band, bool segments,
                                       int cta) {
  int64_t unit, level;
  args.order.locate(cta, unit, level);
  const int64_t tile = dq_launch_tile(level, args.order.per_unit, args.dq_semaphores != nullptr);
  SeqLayout layout = args.layout;
  if constexpr (!kRuns) layout.runs = nullptr;
  const SeqTile st = layout.tile(tile, kBlockN, true);
  BwdCtaTile ct;
  ct.span = st.span;
  ct.mask = band.for_seq(st.span.len_q, st.span.len_k);
  ct.kv_range = IdRange{0, 0};
  ct.head_kv = static_cast<int>(unit);
  ct.empty = st.empty(kBlockN, true) ? 1 : 0;
  ct.packed = st.packed ? 1 : 0;
  ct.n0 = 0;
  ct.m_first = 0;
  ct.num_m = 0;
  if (ct.empty) return ct;
  const int64_t n0 = st.block * kBlockN;
  const int64_t n1 = n0 + kBlockN < st.span.len_k ? n0 + kBlockN : st.span.len_k;
  const int64_t r0 = ct.mask.row_begin(n0);
  const int64_t r1 = ct.mask.row_end(n1);
  ct.n0 = static_cast<int>(n0);
  if (r1 > r0) {
    ct.m_first = static_cast<int>(r0 / kBlockM);
    ct.num_m = static_cast<int>((r1 + kBlockM - 1) / kBlockM - r0 / kBlockM);
  }
  // A document of a row scheduled by its runs sees only its own keys: no segment ids.
  if (segments && !st.packed) {
    ct.kv_range = id_range_fixed<kBlockN / kSegmentChunk>(
        segment_row(args.segments.kv_ranges, st.span.batch, args.seg_stride_k), n0, n1);
  }
  return ct;
}

// The producer's decision for the pair of query tile m0 (a block of the CTA's row range) and
// the CTA's key tile: its header's `rows` and `flags`, or flags = -1 when no query of the tile
// sees a key of the key tile (segment ids disjoint). Masking is needed where the band does not
// cover the whole pair or the key tile runs past the sequence (tile_full), or where the segment
// ids are not one and the same on both sides. `q_ranges` points at the batch row's chunk ranges
// (segments only).
struct BwdPair {
  int rows;
  int flags;
};

template <int kBlockM, int kBlockN>
JF_HOST_DEVICE BwdPair bwd_pair(const BwdCtaTile& ct, int m0, bool segments,
                                const int32_t* q_ranges, bool varlen) {
  BwdPair pr;
  pr.rows = ct.span.len_q - m0 < kBlockM ? static_cast<int>(ct.span.len_q - m0) : kBlockM;
  pr.flags = ct.mask.tile_full(m0, m0 + pr.rows, ct.n0, ct.n0 + kBlockN) ? 0 : kPairMasked;
  if (segments) {
    const IdRange q_range = id_range_fixed<kBlockM / kSegmentChunk>(q_ranges, m0, m0 + pr.rows);
    if (q_range.disjoint(ct.kv_range)) {
      pr.flags = -1;
      return pr;
    }
    if (!q_range.same_single(ct.kv_range)) pr.flags |= kPairMasked | kPairSegments;
  }
  // Only a packed sequence's neighbour rows are real data; dense tails read as zeros.
  if (varlen && pr.rows < kBlockM) pr.flags |= kPairZeroRows;
  return pr;
}

#if JAX_FLASH_SM90A

// Half kH of an accumulator array: the m64nN accumulator's registers of columns
// [kH N / 2, (kH + 1) N / 2) are exactly those of an m64n(N/2) accumulator of those columns.
template <int kH, int kN>
__device__ __forceinline__ auto& acc_half(float (&acc)[kN]) {
  return *reinterpret_cast<float (*)[kN / 2]>(acc + kH * (kN / 2));
}

// threadIdx.x through a volatile read, which the compiler can neither hoist nor merge with
// others: values derived from it are computed where they are used, not kept live in registers.
__device__ __forceinline__ int fresh_thread_index() {
  int tid;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(tid));
  return tid;
}

// Zeroes rows [row0, kRows) of kTensors swizzled tiles (kPanels panels of kRows 128-byte rows,
// kTensorStride bytes apart), one 16-byte chunk per store, over the 256 consumer threads. The
// swizzle only permutes the chunks inside a row, so whole rows are zeroed regardless of it. The
// thread index is read afresh so that this rare path's addresses are not kept live.
template <int kRows, int kPanels, int kTensors, int kTensorStride>
__device__ __forceinline__ void zero_tile_rows(uint8_t* tile, int row0) {
  constexpr int kThreads = 256;
  constexpr int kRowsPerPass = kThreads / (8 * kPanels);
  const int thread = fresh_thread_index() - 128;
  uint8_t* const at = tile + (thread / 8 % kPanels) * kRows * 128 + (thread % 8) * 16;
  for (int row = row0 + thread / (8 * kPanels); row < kRows; row += kRowsPerPass) {
#pragma unroll
    for (int x = 0; x < kTensors; ++x) {
      *reinterpret_cast<uint4*>(at + x * kTensorStride + row * 128) = make_uint4(0u, 0u, 0u, 0u);
    }
  }
}

// kPair128's element masking as two bit masks, one per accumulator row r of the thread (key
// kc = `key` + 8r): bit 2i + e of vis[r] says whether query q0 + 8i + 2t + e sees that key (the
// TileMask, TileMask::pair_row_bits, and with `seg` the segment ids). Two registers instead of a
// predicate per element.
template <class Tr>
__device__ __forceinline__ void bwd_visible_bits(uint32_t (&vis)[2], const int* qid_s,
                                                 const TileMask& tm, bool seg, const int* kvid_s,
                                                 int key, int q0, int t) {
  constexpr int kSteps = Tr::kSCols / 8;  // i
  static_assert(2 * kSteps <= 32, "one bit per query of the thread");
#pragma unroll
  for (int r = 0; r < 2; ++r) vis[r] = tm.pair_row_bits(key + 8 * r, q0 + 2 * t, kSteps);
  if (seg) {
    const int kv0 = kvid_s[key];
    const int kv1 = kvid_s[key + 8];
    uint32_t same0 = 0u;
    uint32_t same1 = 0u;
#pragma unroll
    for (int i = 0; i < kSteps; ++i) {
      const int2 qid = *reinterpret_cast<const int2*>(qid_s + 8 * i + 2 * t);
      same0 |= ((qid.x == kv0 ? 1u : 0u) | (qid.y == kv0 ? 2u : 0u)) << (2 * i);
      same1 |= ((qid.x == kv1 ? 1u : 0u) | (qid.y == kv1 ? 2u : 0u)) << (2 * i);
    }
    vis[0] &= same0;
    vis[1] &= same1;
  }
}

// kPair128's element masking, applied to the 16-bit P^T (p) and the f16 factor of dS (wh) once
// bwd_probs has computed them unmasked: the 16-bit half of each element that bwd_visible_bits
// hides is cleared, bitwise, so whatever the unmasked math gave there (inf, NaN) is gone, as with
// the selects of the float path. Masked and unmasked pairs thus share one P^T pass, and the mask
// costs two registers there. Element (query q0 + 8i + 2t + e, key `key` + 8r) is half e of
// register 2 (i % 2) + r of k16 step i / 2.
template <class Tr>
__device__ __forceinline__ void bwd_mask_packed(uint32_t (&p)[Tr::kSCols / 16][4],
                                                uint32_t (&wh)[Tr::kSCols / 16][4],
                                                const int* qid_s, const TileMask& tm, bool seg,
                                                const int* kvid_s, int key, int q0, int t) {
  uint32_t vis[2];
  bwd_visible_bits<Tr>(vis, qid_s, tm, seg, kvid_s, key, q0, t);
#pragma unroll
  for (int i = 0; i < Tr::kSCols / 8; ++i) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const uint32_t two = vis[r] >> (2 * i);
      const uint32_t keep =
          ((two & 1u) != 0u ? 0x0000ffffu : 0u) | ((two & 2u) != 0u ? 0xffff0000u : 0u);
      p[i / 2][2 * (i % 2) + r] &= keep;
      wh[i / 2][2 * (i % 2) + r] &= keep;
    }
  }
}

// P^T of one pair from S^T (both in s on entry): accumulator element 4i + 2r + e is (key row
// g + 8r, query column 8i + 2t + e), i.e. tile-local key `key` + 8r and query q0 + 8i + 2t + e
// (lse_s and qid_s point at query q0's entries). On exit s holds the factor of dS, P or
// P (1 - t^2) with soft-capping (kPair128: wh holds it as f16 pairs in p's layout, and s is dead),
// and p the 16-bit P packed as it is computed into the register fragments of the dV GEMM (k16 step
// i / 2, register 2 (i % 2) + r: the layout convert_p produces). With kMask, elements the TileMask
// (or, with `seg`, the segment ids) hides are selected to 0, never multiplied, so a NaN there
// cannot leak.
template <class Tr, bool kMask>
__device__ __forceinline__ void bwd_probs(float (&s)[Tr::kSCols / 2],
                                          uint32_t (&p)[Tr::kSCols / 16][4],
                                          uint32_t (&wh)[Tr::kSCols / 16][4], const float* lse_s,
                                          const int* qid_s, const TileMask tm, bool seg,
                                          const int* kvid_s, int key, int q0, int t,
                                          const BwdWgmmaArgs& args) {
  using T = typename Tr::Element;
  static_assert(!(kMask && Tr::kPair128), "kPair128 masks afterwards (bwd_mask_packed)");
  // The band as a window of query offsets per accumulator row r: query q0 + 2t + o sees key
  // `key` + 8r iff first[r] <= o <= last[r] (none past the sequence's keys). Each element then
  // costs two compares with a constant offset o = 8i + e, where TileMask::visible, evaluated per
  // element, compiled to branches around reloads of the pair's mask from shared memory and
  // doubled the time of a masked pair.
  int first[2] = {0, 0};
  int last[2] = {-1, -1};
  if constexpr (kMask) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int kc = key + 8 * r;
      const int base = q0 + 2 * t;
      first[r] = kc - tm.hi_diag - base;
      last[r] = kc < tm.n_limit ? kc - tm.lo_diag - base : -1;
    }
  }
#pragma unroll
  for (int i = 0; i < Tr::kSCols / 8; ++i) {
    const float2 l2 = *reinterpret_cast<const float2*>(lse_s + 8 * i + 2 * t);
    int2 qid = make_int2(0, 0);
    if (kMask && seg) qid = *reinterpret_cast<const int2*>(qid_s + 8 * i + 2 * t);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float p0, p1, w0, w1;
      const float x0 = s[4 * i + 2 * r];
      const float x1 = s[4 * i + 2 * r + 1];
      if constexpr (Tr::kIsSoftcap) {
        const float t0 = tc::fast_tanh(x0 * args.softcap_scale);
        const float t1 = tc::fast_tanh(x1 * args.softcap_scale);
        p0 = tc::fast_exp2(fmaf(args.softcap_log2, t0, -l2.x));
        p1 = tc::fast_exp2(fmaf(args.softcap_log2, t1, -l2.y));
        w0 = p0 * fmaf(-t0, t0, 1.f);
        w1 = p1 * fmaf(-t1, t1, 1.f);
      } else {
        p0 = tc::fast_exp2(fmaf(x0, args.scale_log2, -l2.x));
        p1 = tc::fast_exp2(fmaf(x1, args.scale_log2, -l2.y));
        w0 = p0;
        w1 = p1;
      }
      if constexpr (kMask) {
        bool v0 = (first[r] <= 8 * i) & (8 * i <= last[r]);
        bool v1 = (first[r] <= 8 * i + 1) & (8 * i + 1 <= last[r]);
        if (seg) {
          const int kv_id = kvid_s[key + 8 * r];
          v0 = v0 & (qid.x == kv_id);
          v1 = v1 & (qid.y == kv_id);
        }
        p0 = v0 ? p0 : 0.f;
        p1 = v1 ? p1 : 0.f;
        w0 = v0 ? w0 : 0.f;
        w1 = v1 ? w1 : 0.f;
      }
      if constexpr (Tr::kPair128) {
        wh[i / 2][2 * (i % 2) + r] = tc::pack2<__half>(w0, w1);
      } else {
        s[4 * i + 2 * r] = w0;
        s[4 * i + 2 * r + 1] = w1;
      }
      p[i / 2][2 * (i % 2) + r] = tc::pack2<T>(p0, p1);
    }
  }
}

// dS^T = P^T (dP^T - delta) in place of dP^T, delta broadcast along the key rows, with w (the
// factor bwd_probs left in s, or with kPair128 in wh) for P^T. With kMask every masked element has
// w = 0 and is selected to 0, since dP^T there may come from a neighbour's V rows; a visible
// element whose P underflowed to 0 gets 0 either way.
template <class Tr, bool kMask, int kI0 = 0, int kI1 = Tr::kSCols / 8>
__device__ __forceinline__ void bwd_dscores(float (&dp)[Tr::kSCols / 2],
                                            const float (&w)[Tr::kSCols / 2],
                                            const uint32_t (&wh)[Tr::kSCols / 16][4],
                                            const float* delta_s, int t) {
#pragma unroll
  for (int i = kI0; i < kI1; ++i) {
    const float2 dl = *reinterpret_cast<const float2*>(delta_s + 8 * i + 2 * t);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float w0, w1;
      if constexpr (Tr::kPair128) {
        const uint32_t bits = wh[i / 2][2 * (i % 2) + r];
        const float2 wf = __half22float2(*reinterpret_cast<const __half2*>(&bits));
        w0 = wf.x;
        w1 = wf.y;
      } else {
        w0 = w[4 * i + 2 * r];
        w1 = w[4 * i + 2 * r + 1];
      }
      float d0 = w0 * (dp[4 * i + 2 * r] - dl.x);
      float d1 = w1 * (dp[4 * i + 2 * r + 1] - dl.y);
      if constexpr (kMask) {
        d0 = w0 != 0.f ? d0 : 0.f;
        d1 = w1 != 0.f ? d1 : 0.f;
      }
      dp[4 * i + 2 * r] = d0;
      dp[4 * i + 2 * r + 1] = d1;
    }
  }
}

// dQ_i of one warpgroup added into dq_accum from registers with vector atomics: the path of a
// packed sequence's last tile, whose rows past the sequence are the neighbour's and must get
// nothing, in the deterministic order (semaphores) or not. Accumulator element 4i + 2r + e is
// (query row row0 + 16 warp + g + 8r of the tile, column col0 + 8i + 2t + e of the head). A
// warpgroup whose dQ_i takes several GEMMs (kDqGemms) waits for its deterministic turn before the
// first (`first`) and passes it on after the last (`last`).
template <class Tr>
__device__ __forceinline__ void bwd_dq_atomics(const float (&dq)[Tr::kDqCols / 2],
                                               int64_t dq_offset, int rows, int m0, int cw,
                                               int ctid, const BwdCtaTile* cta_tile,
                                               const BwdWgmmaArgs& args, int row0, int col0,
                                               bool first, bool last) {
  constexpr int kD = Tr::kD;
  const int dq_lane = ctid % 32;
  // Deterministic: this warpgroup's turn at the tile comes after every higher key tile that
  // visits it. The warpgroups add to disjoint columns (or, kDqSplitRows, rows), each half with its
  // own counter.
  int32_t* const sem = args.dq_semaphores != nullptr
                           ? args.dq_semaphores + dq_offset / kD * kDqCounters + cw
                           : nullptr;
  if (sem != nullptr && first) {
    if (ctid % 128 == 0) {
      dq_wait_turn(sem, dq_ticket(cta_tile->mask, m0, rows, cta_tile->n0, Tr::kBlockN));
    }
    named_barrier_sync(kBwdBarDsOwnBase + cw, 128);
  }
  // Rows past the sequence get nothing.
  float* const dq_head = args.dq_accum + dq_offset + col0 + 2 * (dq_lane % 4);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int q = row0 + (ctid % 128) / 32 * 16 + dq_lane / 4 + 8 * r;
    if (q < rows) {
      float* const dq_row = dq_head + static_cast<int64_t>(q) * args.heads_q * kD;
#pragma unroll
      for (int i = 0; i < Tr::kDqCols / 8; ++i) {
        tc::red_add_f32x2(dq_row + 8 * i, dq[4 * i + 2 * r], dq[4 * i + 2 * r + 1]);
      }
    }
  }
  if (sem != nullptr && last) {
    named_barrier_sync(kBwdBarDsOwnBase + cw, 128);
    if (ctid % 128 == 0) dq_pass_turn(sem);
  }
}

// A 16-bit operand tile of kBlockN key rows x kBlockM queries (dS^T, or P^T where the
// warpgroups exchange it), in kPanels panels of 64 queries (kPanelBytes apart) with 128-byte
// swizzled rows: a warp's fragments f (accumulator layout, k16 step i / 2, register
// 2 (i % 2) + r: key row row0 + g + 8r, queries 8 c + 2t, +1 with c = chunk0 + i) go to 16-byte
// chunk c % 8 of the row in panel c / 8, swizzled by the row's position in its 8-row group,
// which is g.
template <int kPanels, int kPanelBytes, int kSteps>
__device__ __forceinline__ void store_operand_tile(uint8_t* tile, const uint32_t (&f)[kSteps][4],
                                                   int row0, int chunk0, int g, int t) {
#pragma unroll
  for (int i = 0; i < 2 * kSteps; ++i) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int c = chunk0 + i;
      const int panel = kPanels > 1 ? c / 8 : 0;
      const int chunk = kPanels > 1 ? c % 8 : c;
      *reinterpret_cast<uint32_t*>(tile + panel * kPanelBytes + (row0 + g + 8 * r) * 128 +
                                   ((chunk ^ g) * 16) + t * 4) = f[i / 2][2 * (i % 2) + r];
    }
  }
}

// The register fragments of k16 steps step0 .. step0 + kSteps - 1 (queries) of a warp's 16 key
// rows row0.. of such a tile, the A operand of a register-sourced wgmma: one ldmatrix.x4 per step,
// lanes 0-15 addressing the rows at the step's first 8 queries, lanes 16-31 at its last 8.
template <int kSteps>
__device__ __forceinline__ void load_operand_tile(uint32_t (&f)[kSteps][4], const uint8_t* tile,
                                                  int row0, int step0, int lane) {
  const int row = row0 + (lane & 15);
#pragma unroll
  for (int k = 0; k < kSteps; ++k) {
    const int chunk = 2 * (step0 + k) + (lane >> 4);
    tc::ldmatrix_x4(f[k], tile + row * 128 + ((chunk ^ (row & 7)) * 16));
  }
}

// dQ_i accumulators of kCols columns staged for TMA reductions: 32-column float32 boxes of 64
// 128-byte rows (8 KB apart from `boxes` on), element 4i + 2r + e of query row q = 16 warp + g +
// 8r in box i / 4, 16-byte chunk 2 (i % 4) + t / 2 swizzled by q % 8 = g, 8 bytes in.
template <int kCols>
__device__ __forceinline__ void stage_dq_boxes(uint8_t* boxes, const float (&dq)[kCols / 2],
                                               int ctid) {
  const int qg = ctid % 32 / 4;
  const int qt = ctid % 4;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int q = (ctid % 128) / 32 * 16 + qg + 8 * r;
#pragma unroll
    for (int i = 0; i < kCols / 8; ++i) {
      const int chunk = (2 * (i % 4) + qt / 2) ^ qg;
      *reinterpret_cast<float2*>(boxes + (i / 4) * 8192 + q * 128 + chunk * 16 + (qt % 2) * 8) =
          make_float2(dq[4 * i + 2 * r], dq[4 * i + 2 * r + 1]);
    }
  }
}

// Where a query tile's dQ rows start in the TMA map over dq_accum: dense maps index
// [batch, seqlen], packed ones the [rows] view from the span's start.
struct BwdDqRow {
  int row;
  int batch;
};
// `packed`: the call's layout is packed (SeqLayout::varlen); `runs`: the tile is a document of a
// dense row (SeqTile::packed in a segment-id call), whose map row is its position in the row.
__device__ __forceinline__ BwdDqRow bwd_dq_row(const BwdCtaTile& ct, bool packed, bool runs,
                                               int64_t seqlen_q, int m0) {
  if (runs) {
    return {static_cast<int>(ct.span.q_start - ct.span.batch * seqlen_q + m0),
            static_cast<int>(ct.span.batch)};
  }
  return {static_cast<int>((packed ? ct.span.q_start : 0) + m0),
          packed ? 0 : static_cast<int>(ct.span.seq)};
}

// TMA reductions of kBoxes staged 32-column float32 boxes (8 KB apart from `src` on) into dQ
// columns col0, col0 + 32, .. of (at, head); the caller commits the bulk group. The map's boxes
// have kBoxRows rows: kPieces of them from row piece0 * kBoxRows of the staged tile on (each
// piece 1 KB-aligned in the staged tile, so the 128-byte swizzle is the same).
template <int kBoxes, int kBoxRows, int kPieces>
__device__ __forceinline__ void dq_reduce_boxes(const CUtensorMap* tm_dq, uint32_t src, int col0,
                                                int head, BwdDqRow at, int piece0 = 0) {
  static_assert(kBoxRows * 128 % 1024 == 0);
#pragma unroll
  for (int k = 0; k < kPieces; ++k) {
    const int row = (piece0 + k) * kBoxRows;
#pragma unroll
    for (int b = 0; b < kBoxes; ++b) {
      tma_reduce_add_4d(tm_dq, src + b * 8192 + row * 128, col0 + 32 * b, head, at.row + row,
                        at.batch);
    }
  }
}

// A writer warp's turn at a tile (one lane): wait for it, then order the TMA reductions after the
// earlier CTAs' (async-proxy writes, released through the counter) ...
__device__ __forceinline__ void dq_turn_wait(const int32_t* sem, int ticket) {
  dq_wait_turn(sem, ticket);
  fence_proxy_async_global();
}
// ... and pass it on once this CTA's reductions have completed in global memory.
__device__ __forceinline__ void dq_turn_pass(int32_t* sem) {
  tma_wait_all();
  fence_proxy_async_global();
  dq_pass_turn(sem);
}

// The deterministic order's dQ writer of consumer warpgroup cw: warp 1 + cw of the producer
// warpgroup, otherwise idle. For each tile the consumers stage (in their own buffer,
// `stage_dq`) it waits for the tile's turn, adds it with TMA reductions, frees the buffer once
// the TMA has read it and passes the turn once the reductions have completed in global memory.
// The spin on the counter thus happens beside the consumers' GEMMs, which only wait if the
// writer still holds the buffer when they stage the next tile (a pair's time later).
//
// Order: the turn is passed after cp.async.bulk.wait_group 0 (the reductions' writes performed,
// not only their reads of shared memory), then a proxy fence (async-proxy writes before the
// generic release) and the release of dq_pass_turn; the next CTA's writer acquires the counter
// and fences the proxies again before it issues its own reductions, so every element of
// dq_accum receives the key tiles' additions in the fixed order of dq_ticket, whatever the
// timing. The wait ends for the reason dq_convert.cuh gives (a tile's earlier turns belong to
// CTAs of lower grid index, already resident or done); inside the CTA the writer depends only
// on its consumers' hand-offs, and they only on it, never on the reverse of a wait.
//
// Hand-off: the staged and free barriers are used in strict alternation. The writer arrives on
// "free" once up front and once after each tile's TMA reads; the consumers wait on "free"
// before each staging and once more before the end hand-off, and arrive on "staged" after each
// staging and at the end: both sides use each barrier equally often, and neither can run a
// phase ahead (a second arrival needs the other side's intervening one). The handoff record is
// read before "free" is arrived on, so it too may be rewritten then.
template <class Tr>
__device__ __forceinline__ void bwd_dq_writer(const CUtensorMap* tm_dq, uint32_t stage_dq,
                                              const BwdDqHandoff* handoff, int32_t* sems, int cw,
                                              int lane) {
  named_barrier_arrive(kBwdBarDqFreeBase + cw, kBwdDqHandoffThreads);
  for (;;) {
    named_barrier_sync(kBwdBarDqStagedBase + cw, kBwdDqHandoffThreads);
    if (handoff->end) return;
    int32_t* const sem = sems + handoff->sem;
    if (lane == 0) {
      dq_turn_wait(sem, handoff->ticket);
      dq_reduce_boxes<Tr::kDqBoxes, Tr::kDqBoxRows, Tr::kDqRows / Tr::kDqBoxRows>(
          tm_dq, stage_dq, Tr::dq_col0(cw), handoff->head, {handoff->row, handoff->batch});
      tma_commit();
      tma_wait_read();
    }
    __syncwarp();
    named_barrier_arrive(kBwdBarDqFreeBase + cw, kBwdDqHandoffThreads);
    if (lane == 0) dq_turn_pass(sem);
    // The barriers are warp-collective: the warp meets again before the next one.
    __syncwarp();
  }
}

// Head_dim 256's dQ writer of consumer warpgroup cw (warp 1 + cw of the producer warpgroup), in
// either order. The consumers stage each pair's dQ_i in the Q / dO panels of the pair's own stage
// (its columns' panels, which are dead once the warpgroup's dV and dK are done): the first half of
// its columns in the Q panels, the second in the dO panels. Each half is handed over on its own
// round of the staged / free barriers of bwd_dq_writer (two rounds a pair, one for the end), so
// that the first half's TMA reductions run while the second half is computed and staged: the
// stage goes back to the producer only once the reductions have read it, and that turnaround is
// on the pairs' critical path (docs/PERF_LOG.md). The writer reads the pair's header from the
// stage, adds the panels (after the tile's turn in the deterministic order, then passing it on as
// bwd_dq_writer does), and arrives on the stage's empty barrier once both halves are read. A
// packed sequence's last tile, which the consumers add from registers, is only released. Unlike
// bwd_dq_writer's one buffer, each round's panels are the next round's only in the stage after
// next, whose reuse the empty barrier orders: the writer arrives on "free" as soon as it has
// taken a round over, so that in the deterministic order the consumers never wait for the
// tile's turn (only the stage's release does).
template <class Tr>
__device__ __forceinline__ void bwd_dq_writer_split(const CUtensorMap* tm_dq, uint32_t q_smem,
                                                    uint32_t do_smem, uint32_t bar_empty0,
                                                    const uint8_t* stats,
                                                    const BwdCtaTile* cta_tile,
                                                    const BwdWgmmaArgs& args, int cw, int lane) {
  static_assert(!Tr::kSplitQ || Tr::kDqBoxRows == Tr::kBlockM);
  named_barrier_arrive(kBwdBarDqFreeBase + cw, kBwdDqHandoffThreads);
  for (int slot = 0;; ++slot) {
    const int stage = slot % Tr::kStages;
    named_barrier_sync(kBwdBarDqStagedBase + cw, kBwdDqHandoffThreads);
    const BwdPairHeader* const hdr = reinterpret_cast<const BwdPairHeader*>(
        stats + stage * Tr::kRowStatBytes + 3 * Tr::kBlockM * 4);
    // Only lane 0 reads the header: its arrival on the empty barrier below orders its own reads
    // before the producer's next writes of the stage, and would not order the other lanes'.
    int flags = 0;
    if (lane == 0) flags = hdr->flags;
    flags = __shfl_sync(0xffffffffu, flags, 0);
    if (flags & kPairEnd) break;
    const bool staged = (flags & kPairZeroRows) == 0;
    // The warpgroup's columns' panels of the stage.
    const uint32_t panels =
        stage * Tr::kQStageBytes + cw * Tr::kDkCols / Tr::kPanelCols * Tr::kQPanelBytes;
    // The second half is staged in the dO panels, which the first half's reductions do not read:
    // the consumers may hand it over at once, so that they never wait for the deterministic turn.
    named_barrier_arrive(kBwdBarDqFreeBase + cw, kBwdDqHandoffThreads);
    int32_t* sem = nullptr;
    for (int half = 0; half < 2; ++half) {
      if (half == 1) {
        __syncwarp();
        named_barrier_sync(kBwdBarDqStagedBase + cw, kBwdDqHandoffThreads);
        // The next pair's first half is staged in the next stage's Q panels: it may come at once
        // too.
        named_barrier_arrive(kBwdBarDqFreeBase + cw, kBwdDqHandoffThreads);
      }
      if (lane == 0 && staged) {
        // The header stays valid until this warp's arrival on the stage's empty barrier.
        const int m0 = hdr->m0;
        const BwdDqRow at =
            bwd_dq_row(*cta_tile, args.layout.varlen(),
                       args.segments.enabled() && cta_tile->packed != 0, args.layout.seqlen_q, m0);
        if (half == 0 && args.dq_semaphores != nullptr) {
          sem = args.dq_semaphores + hdr->dq_offset / Tr::kD * kDqCounters + cw;
          dq_turn_wait(sem, dq_ticket(cta_tile->mask, m0, hdr->rows, cta_tile->n0, Tr::kBlockN));
        }
        dq_reduce_boxes<2, Tr::kDqBoxRows, 1>(tm_dq, (half == 0 ? q_smem : do_smem) + panels,
                                              cw * Tr::kDkCols + 64 * half, hdr->head, at);
        tma_commit();
      }
    }
    if (lane == 0) {
      if (staged) tma_wait_read();
      mbar_arrive(bar_empty0 + 8u * stage);
    }
    __syncwarp();
    if (lane == 0 && sem != nullptr) dq_turn_pass(sem);
    __syncwarp();
  }
  // The CTA's shared memory outlives the reductions' reads (waited for above); their writes are
  // waited for too, so that nothing is in flight when the CTA retires.
  if (lane == 0) tma_wait_all();
}

#endif  // JAX_FLASH_SM90A

// Warpgroup 0 is the producer (only its warp 0 works), warpgroups 1 and 2 the consumers.
// blockIdx.x enumerates the key tiles of one kv head fastest (sequence by sequence), so that
// CTAs running together read the same Q, dO and dq_accum rows from L2.
template <class Tr>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    bwd_wgmma_kernel(const BwdWgmmaArgs args, const __grid_constant__ CUtensorMap tm_q,
                     const __grid_constant__ CUtensorMap tm_k,
                     const __grid_constant__ CUtensorMap tm_v,
                     const __grid_constant__ CUtensorMap tm_do,
                     const __grid_constant__ CUtensorMap tm_dq,
                     const __grid_constant__ CUtensorMap tm_dk,
                     const __grid_constant__ CUtensorMap tm_dv) {
#if JAX_FLASH_SM90A
  using T = typename Tr::Element;
  constexpr bool kMasked = Tr::kIsMasked;
  constexpr int kD = Tr::kD;
  constexpr int kBlockM = Tr::kBlockM;
  constexpr int kBlockN = Tr::kBlockN;
  constexpr int kStages = Tr::kStages;
  constexpr float kLog2e = 1.4426950408889634f;

  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw_addr = tc::smem_addr(smem_raw);
  const uint32_t base = (raw_addr + 1023u) & ~1023u;
  uint8_t* const smem = smem_raw + (base - raw_addr);
  const uint32_t k_smem = base + Tr::kKOffset;
  const uint32_t v_smem = base + Tr::kVOffset;
  const uint32_t q_smem = base + Tr::kQOffset;
  const uint32_t do_smem = base + Tr::kDoOffset;
  const uint32_t ds_smem = base + Tr::kDsOffset;
  uint8_t* const stats = smem + Tr::kStatOffset;
  const uint32_t bar_kv = base + Tr::kBarOffset;
  const auto bar_full = [&](int stage) { return bar_kv + 8u * (1 + stage); };
  const auto bar_empty = [&](int stage) { return bar_kv + 8u * (1 + kStages + stage); };
  BwdCtaTile* const cta_tile = reinterpret_cast<BwdCtaTile*>(smem + Tr::kTileOffset);
  int* const kvid_s = reinterpret_cast<int*>(smem + Tr::kKvIdOffset);
  // lse * log2(e), delta, query segment ids and the header of stage `stage`.
  const auto stage_lse = [&](int stage) {
    return reinterpret_cast<float*>(stats + stage * Tr::kRowStatBytes);
  };
  const auto stage_delta = [&](int stage) { return stage_lse(stage) + kBlockM; };
  const auto stage_qid = [&](int stage) {
    return reinterpret_cast<int*>(stage_lse(stage) + 2 * kBlockM);
  };
  const auto stage_header = [&](int stage) {
    return reinterpret_cast<BwdPairHeader*>(stats + stage * Tr::kRowStatBytes + 3 * kBlockM * 4);
  };
  // The stage's dO barrier (BwdPairHeader::dout_full); bar_full(stage) covers Q, the stats and
  // the header.
  const auto bar_full_do = [&](int stage) {
    return tc::smem_addr(&stage_header(stage)->dout_full);
  };
  // The kernels without kMasked serve only unbounded bands: a constant one lets the compiler
  // fold the band's arithmetic.
  const Band band = kMasked ? args.band : Band{};

  // Segment ids of the call; a CTA whose key tile is one document of a row scheduled by its runs
  // does without them (`segments` below).
  const bool segment_call = kMasked && args.segments.enabled();

  if (threadIdx.x == 0) {
    // K / V: lane 0 of the producer warp with the TMA byte count, lanes 1..31 after writing the
    // keys' segment ids.
    mbar_init(bar_kv, 32);
    for (int s = 0; s < kStages; ++s) {
      // The 32 lanes of the producer warp arrive after writing lse / delta (lane 0 has
      // announced the TMA byte count before).
      mbar_init(bar_full(s), 32);
      // Lane 0 of the producer warp with dO's byte count.
      if (Tr::kDoBarrier) mbar_init(bar_full_do(s), 1);
      // Released by every consumer thread once its GEMMs and its own lse / delta reads are done
      // with the stage: each thread's arrival orders its own shared-memory reads before the
      // producer's next writes of that stage (one arrival per warp would not cover the reads of
      // the other 31 lanes).
      // Head_dim 256: each dQ writer warp arrives too (bwd_dq_writer_split).
      mbar_init(bar_empty(s),
                128 * Tr::kConsumerWarpgroups + (Tr::kSplitQ ? Tr::kConsumerWarpgroups : 0));
    }
    fence_barrier_init();
    *cta_tile = bwd_cta_tile<kBlockM, kBlockN, kMasked>(args, band, segment_call,
                                                        static_cast<int>(blockIdx.x));
  }
  __syncthreads();
  if (cta_tile->empty) return;

  const int warpgroup = static_cast<int>(threadIdx.x) / 128;
  const int tid = static_cast<int>(threadIdx.x) % 128;
  const int warp = tid / 32;
  const int lane = tid % 32;
  // Rows past the span's end are a neighbour's (packed calls, documents of a row).
  // A tile that is one document of a row scheduled by its runs (segment-id calls only: without
  // segment ids the kernel's code is that of the dense and packed layouts alone).
  const bool runs_tile = segment_call && warp_uniform(cta_tile->packed) != 0;
  const bool packed_layout = args.layout.varlen();
  const bool varlen = packed_layout || runs_tile;
  const bool segments = segment_call && !runs_tile;
  // The first row of the tile's span in the TMA maps (dense maps: inside its batch row).
  const auto map_row = [&](int64_t start, int64_t seqlen) {
    if (runs_tile) return static_cast<int>(start - cta_tile->span.batch * seqlen);
    return packed_layout ? static_cast<int>(start) : 0;
  };
  const int n_iters = cta_tile->num_m * args.group;

  if (warpgroup == 0) {
    // ------------------------------------------------------------------ producer
    setmaxnreg_dec<Tr::kProducerRegs>();
    // Warps 1 and 2: the deterministic order's dQ writers. The vote makes the branch visibly
    // warp-uniform, which keeps the producer's code below on uniform registers: with a plain
    // branch on `warp` its values move to the 24 vector registers and spill.
    if (__all_sync(0xffffffffu, warp >= 1 && warp <= Tr::kConsumerWarpgroups)) {
      if (Tr::kDqStaged && args.dq_semaphores != nullptr && n_iters > 0) {
        bwd_dq_writer<Tr>(
            &tm_dq, base + Tr::kDqOffset + (warp - 1) * Tr::kDqWgBytes,
            reinterpret_cast<const BwdDqHandoff*>(smem + Tr::kHandoffOffset) + warp - 1,
            args.dq_semaphores, warp - 1, lane);
      }
      if (Tr::kSplitQ && n_iters > 0) {
        bwd_dq_writer_split<Tr>(&tm_dq, q_smem, do_smem, bar_empty(0), stats, cta_tile, args,
                                warp - 1, lane);
      }
      return;
    }
    if (warp != 0 || n_iters <= 0) return;
    const BwdCtaTile& ct = *cta_tile;
    // Dense: 4-D maps [batch, seqlen, heads, D], whose rows past a sequence read as zeros.
    // Packed: [rows, heads, D] maps addressed by the span's rows.
    const auto q_row0 = [&] { return map_row(ct.span.q_start, args.layout.seqlen_q); };
    const auto tma_batch = [&] { return packed_layout ? 0 : static_cast<int>(ct.span.seq); };
    if (lane == 0) {
      prefetch_tensormap(&tm_q);
      prefetch_tensormap(&tm_k);
      prefetch_tensormap(&tm_v);
      prefetch_tensormap(&tm_do);
      mbar_arrive_expect_tx(bar_kv, 2 * Tr::kKVBytes);
      const int k_row = map_row(ct.span.k_start, args.layout.seqlen_k) + ct.n0;
#pragma unroll
      for (int p = 0; p < Tr::kPanels; ++p) {
        tma_load_4d(k_smem + p * Tr::kKVPanelBytes, &tm_k, bar_kv, p * Tr::kPanelCols, ct.head_kv,
                    k_row, tma_batch());
        tma_load_4d(v_smem + p * Tr::kKVPanelBytes, &tm_v, bar_kv, p * Tr::kPanelCols, ct.head_kv,
                    k_row, tma_batch());
      }
    } else {
      // Lanes 1..31 write the keys' segment ids before their arrivals on bar_kv, which order
      // the writes before the consumers' reads (lane 0 issues the TMA without waiting for
      // them).
      if (segments) {
        const int32_t* const ids = args.segments.kv_ids + ct.span.batch * args.seg_stride_k + ct.n0;
        for (int c = lane - 1; c < kBlockN; c += 31) {
          kvid_s[c] = ct.n0 + c < ct.span.len_k ? ids[c] : 0;
        }
      }
      mbar_arrive(bar_kv);
    }
    int slot = 0;
    // The pairs of each query head, in query-tile order. Each lane decides one of 32
    // consecutive query tiles and a ballot gathers the visited ones, so a key tile that shares
    // its segment with few query tiles (one document of a packed row) pays one round of
    // chunk-range loads per 32 tiles it skips, not one per tile; and a head's walk ends at the
    // first tile whose suffix reach (every query id from it to the row's end) shares no id with
    // the key tile, not at the row's end.
    const int32_t* const q_ranges =
        segments ? segment_row(args.segments.q_ranges, ct.span.batch, args.seg_stride_q) : nullptr;
    for (int it = 0; it < n_iters;) {
      const int head = ct.head_kv * args.group + it / ct.num_m;
      // This round: query tiles [window, window + count) of the head (never the next head's).
      const int window = it % ct.num_m;
      const int count = min(32, ct.num_m - window);
      it += count;
      int lane_flags = -1;
      bool none_ahead = false;
      if (lane < count) {
        const int m0 = (ct.m_first + window + lane) * kBlockM;
        lane_flags = bwd_pair<kBlockM, kBlockN>(ct, m0, segments, q_ranges, varlen).flags;
        // The deterministic order needs every pair of the band: one whose ids are disjoint is
        // computed fully masked (it adds zeros) instead of skipped.
        if (lane_flags < 0 && args.dq_semaphores != nullptr) {
          lane_flags = kPairMasked | kPairSegments;
        }
        // No query from this tile to the row's end holds an id of the key tile (the suffix
        // reach): the head's remaining tiles are all skipped, so its walk ends here.
        none_ahead = segments && args.dq_semaphores == nullptr &&
                     ct.kv_range.disjoint(id_reach(q_ranges, m0 / kSegmentChunk));
      }
      // (it - 1 is still in this head: the next head starts at the next multiple of num_m.)
      if (__ballot_sync(0xffffffffu, none_ahead) != 0) it = ((it - 1) / ct.num_m + 1) * ct.num_m;
      uint32_t visit = __ballot_sync(0xffffffffu, lane_flags >= 0);
      while (visit != 0) {
        const int k = __ffs(static_cast<int>(visit)) - 1;
        visit &= visit - 1;
        const int m0 = (ct.m_first + window + k) * kBlockM;
        const int rows =
            ct.span.len_q - m0 < kBlockM ? static_cast<int>(ct.span.len_q - m0) : kBlockM;
        const int flags = __shfl_sync(0xffffffffu, lane_flags, k);

        const int stage = slot % kStages;
        // The pair's lse and delta are loaded before the wait for its stage: their L2 round trip
        // then runs while the consumers (and, at head_dim 256, the dQ writers) still hold the
        // stage, whose turnaround is on the pairs' critical path (docs/PERF_LOG.md).
        const int64_t stat_row = ct.span.stat_start + head * ct.span.stat_head + m0;
        constexpr int kStatPerLane = kBlockM / 32;
        float lse_ahead[kStatPerLane];
        float dlt_ahead[kStatPerLane];
#pragma unroll
        for (int i = 0; i < kStatPerLane; ++i) {
          const int r = lane + 32 * i;
          // Both loads are issued before either is used: one L2 round trip a pair, not two.
          lse_ahead[i] = r < rows ? args.lse[stat_row + r] : -CUDART_INF_F;
          dlt_ahead[i] = r < rows ? args.delta[stat_row + r] : 0.f;
        }
        if (slot >= kStages) mbar_wait(bar_empty(stage), ((slot / kStages) + 1) & 1);
        // Lane 0 announces Q and dO's bytes without arriving, so the stage completes only after
        // its own stat and header writes too.
        if (lane == 0) {
          BwdPairHeader* const h = stage_header(stage);
          h->dq_offset = ((ct.span.q_start + m0) * args.heads_q + head) * int64_t{kD};
          h->rows = rows;
          h->flags = flags;
          h->mask = ct.mask.tile(m0, ct.n0);
          h->m0 = m0;
          h->head = head;
          // Panel p of the pair's Q or dO rows into the stage, completing on `bar`.
          const auto load_panel = [&](uint32_t dst, const CUtensorMap* map, uint32_t bar, int p) {
            tma_load_4d(dst + stage * Tr::kQStageBytes + p * Tr::kQPanelBytes, map, bar,
                        p * Tr::kPanelCols, head, q_row0() + m0, tma_batch());
          };
          if constexpr (Tr::kDoBarrier) {
            // All of Q first: S^T waits for it alone.
            mbar_expect_tx(bar_full(stage), Tr::kQStageBytes);
            mbar_arrive_expect_tx(bar_full_do(stage), Tr::kQStageBytes);
#pragma unroll
            for (int p = 0; p < Tr::kPanels; ++p) load_panel(q_smem, &tm_q, bar_full(stage), p);
#pragma unroll
            for (int p = 0; p < Tr::kPanels; ++p) {
              load_panel(do_smem, &tm_do, bar_full_do(stage), p);
            }
          } else {
            mbar_expect_tx(bar_full(stage), 2 * Tr::kQStageBytes);
#pragma unroll
            for (int p = 0; p < Tr::kPanels; ++p) {
              load_panel(q_smem, &tm_q, bar_full(stage), p);
              load_panel(do_smem, &tm_do, bar_full(stage), p);
            }
          }
        }
        // Rows past the sequence and rows that saw no key (lse = -inf) get +inf, which makes
        // P = 2^(s - inf) = 0 exactly; their delta is 0.
        float* const lse_s = stage_lse(stage);
#pragma unroll
        for (int i = 0; i < kStatPerLane; ++i) {
          const int r = lane + 32 * i;
          const bool seen = lse_ahead[i] != -CUDART_INF_F;
          lse_s[r] = seen ? lse_ahead[i] * kLog2e : CUDART_INF_F;
          lse_s[kBlockM + r] = seen ? dlt_ahead[i] : 0.f;
          if (kMasked && (flags & kPairSegments)) {
            stage_qid(stage)[r] =
                r < rows ? args.segments.q_ids[ct.span.batch * args.seg_stride_q + m0 + r] : 0;
          }
        }
        mbar_arrive(bar_full(stage));
        ++slot;
      }
    }
    // The end header, in the next stage once the consumers released it.
    const int stage = slot % kStages;
    if (slot >= kStages) mbar_wait(bar_empty(stage), ((slot / kStages) + 1) & 1);
    if (lane == 0) stage_header(stage)->flags = kPairEnd;
    mbar_arrive(bar_full(stage));
    return;
  }

  // -------------------------------------------------------------------- consumers
  setmaxnreg_inc<Tr::kConsumerRegs>();
  constexpr bool kSplitQ = Tr::kSplitQ;
  constexpr int kSCols = Tr::kSCols;
  constexpr int kDkCols = Tr::kDkCols;
  const int cw = warpgroup - 1;
  const int g = lane / 4;
  const int t = lane % 4;
  // The warpgroup's key rows (of the tile), its S^T query columns (of the pair's query tile)
  // and its dK / dV head-dim columns.
  const int key_row0 = kSplitQ ? 0 : cw * 64;
  const int q0 = kSplitQ ? cw * kSCols : 0;
  const int col0 = kSplitQ ? cw * kDkCols : 0;
  // Tile-local key of accumulator rows r = 0 (and r = 1 at +8) of this thread.
  const int key = key_row0 + warp * 16 + g;

  float dk[kDkCols / 2];
  float dv[kDkCols / 2];
#pragma unroll
  for (int i = 0; i < kDkCols / 2; ++i) {
    dk[i] = 0.f;
    dv[i] = 0.f;
  }

  if (n_iters > 0) {
    float s[kSCols / 2];
    float dp[kSCols / 2];
    float dq[Tr::kDqCols / 2];
#pragma unroll
    for (int i = 0; i < kSCols / 2; ++i) {
      s[i] = 0.f;
      dp[i] = 0.f;
    }
#pragma unroll
    for (int i = 0; i < Tr::kDqCols / 2; ++i) dq[i] = 0.f;
    uint32_t p[kSCols / 16][4];
    uint32_t ds[kSCols / 16][4];
    // The factor of dS as f16 pairs (kPair128 only; otherwise it stays in s and this goes unused).
    uint32_t wh[kSCols / 16][4];

    // A operands of S^T and dP^T: this warpgroup's 64 rows of K and V, K-major.
    const uint64_t k_desc = smem_desc_sw128(k_smem + key_row0 * Tr::kRowBytes, 16);
    const uint64_t v_desc = smem_desc_sw128(v_smem + key_row0 * Tr::kRowBytes, 16);
    // B operand of dQ, MN-major: this warpgroup's first kDqCols head-dim columns of K, i.e.
    // panel cw with head_dim 128, half cw of the single panel with head_dim 64 (all of it with
    // 128-query tiles, whose warpgroups split dQ_i's rows), panel 2 cw with head_dim 256 (whose
    // second dQ GEMM takes the next panel).
    constexpr int kDqColBytes = Tr::kDqCols * Tr::kDqGemms * 2;
    const int dq_cw = Tr::kDqSplitRows ? 0 : cw;
    const uint64_t k_mn_desc =
        smem_desc_sw128(k_smem + dq_cw * kDqColBytes / Tr::kRowBytes * Tr::kKVPanelBytes +
                            dq_cw * kDqColBytes % 128,
                        Tr::kKVPanelBytes);

    mbar_wait(bar_kv, 0);
    // K rows past a packed sequence are its neighbour's and would enter dQ = dS K (0 * NaN is
    // NaN), so they are zeroed. V rows past it only reach dP^T rows of keys that the mask
    // selects away, and dense tails arrive as zeros.
    if (varlen) {
      const int keys = static_cast<int>(cta_tile->span.len_k - cta_tile->n0);
      if (keys < kBlockN) {
        zero_tile_rows<kBlockN, Tr::kPanels, 1, 0>(smem + Tr::kKOffset, keys);
        fence_proxy_async_smem();
        named_barrier_sync(kBwdBarConsumers, 128 * Tr::kConsumerWarpgroups);
      }
    }

    for (int slot = 0;; ++slot) {
      const int stage = slot % kStages;
      const uint32_t q_stage = q_smem + stage * Tr::kQStageBytes;
      const uint32_t do_stage = do_smem + stage * Tr::kQStageBytes;
      const uint64_t q_desc = smem_desc_sw128(q_stage + q0 * Tr::kRowBytes, 16);
      const uint64_t do_desc = smem_desc_sw128(do_stage + q0 * Tr::kRowBytes, 16);
      // B operands of dK and dV, MN-major: the warpgroup's kDkCols columns of Q and dO.
      const uint32_t col_panel = col0 / Tr::kPanelCols * Tr::kQPanelBytes;
      const uint64_t q_mn_desc = smem_desc_sw128(q_stage + col_panel, Tr::kQPanelBytes);
      const uint64_t do_mn_desc = smem_desc_sw128(do_stage + col_panel, Tr::kQPanelBytes);
      const BwdPairHeader* const hdr = stage_header(stage);

      mbar_wait(bar_full(stage), (slot / kStages) & 1);
      const int flags = hdr->flags;
      if (flags & kPairEnd) break;
      // Q and dO rows past a packed sequence belong to its neighbour: they would enter S^T,
      // dP^T (column-wise, selected away by lse = +inf only if finite) and dK += dS^T Q, dV +=
      // P^T dO (0 * NaN is NaN), so they are zeroed before any GEMM reads the stage.
      if (flags & kPairZeroRows) {
        if (Tr::kDoBarrier) mbar_wait(bar_full_do(stage), (slot / kStages) & 1);
        zero_tile_rows<kBlockM, Tr::kPanels, 2, Tr::kDoOffset - Tr::kQOffset>(
            smem + Tr::kQOffset + stage * Tr::kQStageBytes, hdr->rows);
        fence_proxy_async_smem();
        named_barrier_sync(kBwdBarConsumers, 128 * Tr::kConsumerWarpgroups);
      }

      // S^T = K Q^T and dP^T = V dO^T over the head dimension, 16 columns per wgmma. With
      // kPair128 only dP^T's first half (queries 0-63) here; the second follows the P^T math.
      wgmma_fence();
      wgmma_ss_kmajor<kSCols, kD, Tr::kKVPanelBytes, Tr::kQPanelBytes, T>(s, k_desc, q_desc);
      wgmma_commit();
      if constexpr (Tr::kDoBarrier) {
        // dO may land after Q: S^T runs meanwhile.
        mbar_wait(bar_full_do(stage), (slot / kStages) & 1);
        wgmma_fence();
      }
      if constexpr (Tr::kPair128) {
        wgmma_ss_kmajor<kSCols / 2, kD, Tr::kKVPanelBytes, Tr::kQPanelBytes, T>(acc_half<0>(dp),
                                                                                v_desc, do_desc);
      } else {
        wgmma_ss_kmajor<kSCols, kD, Tr::kKVPanelBytes, Tr::kQPanelBytes, T>(dp, v_desc, do_desc);
      }
      wgmma_commit();

      // Groups retire in order: with dP^T pending, S^T is done.
      wgmma_wait<1>();
      fence_operand(s);
      // P^T and dS^T on the unmasked path or, for a masked pair, with element masking (the two
      // are separate copies so that unmasked pairs pay nothing for the mask; kPair128 runs one
      // P^T pass for both and masks its packed results).
      if constexpr (Tr::kPair128) {
        bwd_probs<Tr, false>(s, p, wh, stage_lse(stage) + q0, stage_qid(stage) + q0, hdr->mask,
                             false, kvid_s, key, q0, t, args);
        if (flags & kPairMasked) {
          bwd_mask_packed<Tr>(p, wh, stage_qid(stage) + q0, hdr->mask,
                              kMasked && (flags & kPairSegments) != 0, kvid_s, key, q0, t);
        }
      } else if (flags & kPairMasked) {
        bwd_probs<Tr, true>(s, p, wh, stage_lse(stage) + q0, stage_qid(stage) + q0, hdr->mask,
                            kMasked && (flags & kPairSegments) != 0, kvid_s, key, q0, t, args);
      } else {
        bwd_probs<Tr, false>(s, p, wh, stage_lse(stage) + q0, stage_qid(stage) + q0, hdr->mask,
                             false, kvid_s, key, q0, t, args);
      }

      // Two buffers of each exchanged tile alternate: a warpgroup can only reach pair slot + 2
      // (which rewrites buffer slot % 2) after both passed the barrier of slot + 1, i.e. after
      // both waited for their GEMMs of slot, which read the tiles.
      const int buf = slot & 1;
      uint8_t* const ds_tile = smem + Tr::kDsOffset + buf * Tr::kDsBytes;
      // The dQ GEMMs' A operand: with kDqSplitRows the panel of the warpgroup's 64 queries.
      const uint64_t ds_desc = smem_desc_sw128(
          ds_smem + buf * Tr::kDsBytes + (Tr::kDqSplitRows ? cw * Tr::kDsPanelBytes : 0),
          static_cast<uint32_t>(Tr::kDsPanelBytes));
      if constexpr (kSplitQ) {
        // This warpgroup's P^T columns go to the exchange tile while dP^T finishes.
        uint8_t* const p_tile = smem + Tr::kPOffset + buf * Tr::kPBytes;
        store_operand_tile<Tr::kDsPanels, Tr::kDsPanelBytes>(p_tile, p, warp * 16, q0 / 8, g, t);
        wgmma_wait<0>();
        fence_operand(dp);
        if (flags & kPairMasked) {
          bwd_dscores<Tr, true>(dp, s, wh, stage_delta(stage) + q0, t);
        } else {
          bwd_dscores<Tr, false>(dp, s, wh, stage_delta(stage) + q0, t);
        }
        convert_p<kSCols, T>(dp, ds);
        store_operand_tile<Tr::kDsPanels, Tr::kDsPanelBytes>(ds_tile, ds, warp * 16, q0 / 8, g, t);
        // dS^T is also read by the dQ GEMMs, through the async proxy.
        fence_proxy_async_smem();
        named_barrier_sync(kBwdBarConsumers, 128 * Tr::kConsumerWarpgroups);
        // The other warpgroup's query columns of P^T and dS^T.
        const int q_other = kSCols - q0;
        uint32_t p_other[kSCols / 16][4];
        uint32_t ds_other[kSCols / 16][4];
        load_operand_tile(p_other, p_tile, warp * 16, q_other / 16, lane);
        load_operand_tile(ds_other, ds_tile, warp * 16, q_other / 16, lane);

        // dV += P^T dO and dK += dS^T Q over the tile's queries (this warpgroup's columns
        // first, from registers, then the other's), then dQ_i = dS K over the tile's 64 keys,
        // kDqCols columns per GEMM (A = dS^T read as MN-major dS, B = K MN-major).
        wgmma_fence();
        wgmma_rs_mn<kDkCols, kSCols / 16, T>(dv, p, desc_advance(do_mn_desc, q0 * Tr::kRowBytes));
        wgmma_rs_mn<kDkCols, kSCols / 16, T>(dv, p_other,
                                             desc_advance(do_mn_desc, q_other * Tr::kRowBytes));
        wgmma_rs_mn<kDkCols, kSCols / 16, T>(dk, ds, desc_advance(q_mn_desc, q0 * Tr::kRowBytes));
        wgmma_rs_mn<kDkCols, kSCols / 16, T>(dk, ds_other,
                                             desc_advance(q_mn_desc, q_other * Tr::kRowBytes));
        // The header is read before the release lets the producer rewrite it.
        const int64_t dq_offset = hdr->dq_offset;
        const int rows = hdr->rows;
        const int m0 = hdr->m0;
        const int ctid = fresh_thread_index() - 128;
        // There is no shared memory left for a dQ staging buffer, but once this warpgroup's dV
        // and dK are done, the panels of Q and dO holding its columns are dead: the other
        // warpgroup reads only its own columns after the exchange barrier. dQ_i's first kDqCols
        // columns are staged in the Q panels, the next in the dO panels, and the stage goes back
        // to the producer only once the writer warp's TMA reductions have read them. Packed
        // tails add from registers instead.
        const bool staged = (flags & kPairZeroRows) == 0;
        static_assert(Tr::kDqGemms == 2 && Tr::kDqCols == 2 * 32 && Tr::kQPanelBytes == 8192,
                      "each dQ GEMM fills the two panels of Q or dO that hold its columns");
#pragma unroll
        for (int h = 0; h < Tr::kDqGemms; ++h) {
          wgmma_fence();
#pragma unroll
          for (int k = 0; k < kBlockN / 16; ++k) {
            wgmma_ss_trans<Tr::kDqCols, T>(
                dq, desc_advance(ds_desc, k * 16 * Tr::kRowBytes),
                desc_advance(k_mn_desc, h * Tr::kKVPanelBytes + k * 16 * Tr::kRowBytes),
                k > 0 ? 1u : 0u);
          }
          wgmma_commit();
          wgmma_wait<0>();
          fence_operand(dq);
          if (staged) {
            uint8_t* const panels = smem + (h == 0 ? Tr::kQOffset : Tr::kDoOffset) +
                                    stage * Tr::kQStageBytes + col_panel;
            stage_dq_boxes<Tr::kDqCols>(panels, dq, ctid);
          } else {
            bwd_dq_atomics<Tr>(dq, dq_offset, rows, m0, cw, ctid, cta_tile, args, 0,
                               col0 + h * Tr::kDqCols, h == 0, h == Tr::kDqGemms - 1);
          }
          if (h == 0) {
            // The first half goes to the writer (bwd_dq_writer_split) while the second is
            // computed; the arrival orders the staging before its reductions.
            if (staged) fence_proxy_async_smem();
            named_barrier_sync(kBwdBarDqFreeBase + cw, kBwdDqHandoffThreads);
            named_barrier_arrive(kBwdBarDqStagedBase + cw, kBwdDqHandoffThreads);
          }
        }
        fence_operand(p_other);
        fence_operand(ds_other);
        // The second half to the writer warp, staged or not: the arrival orders the staging
        // before its reductions.
        if (staged) fence_proxy_async_smem();
        named_barrier_sync(kBwdBarDqFreeBase + cw, kBwdDqHandoffThreads);
        named_barrier_arrive(kBwdBarDqStagedBase + cw, kBwdDqHandoffThreads);
      } else {
        // dV += P^T dO over the tile's queries, 16 per wgmma, with dO as the MN-major B operand
        // (head_dim contiguous, as V in the forward's O += P V); it runs under the dS math, the
        // dS^T stores and the barrier below. With kPair128 dP^T's second half goes first.
        wgmma_fence();
        if constexpr (Tr::kPair128) {
          wgmma_ss_kmajor<kSCols / 2, kD, Tr::kKVPanelBytes, Tr::kQPanelBytes, T>(
              acc_half<1>(dp), v_desc, desc_advance(do_desc, kSCols / 2 * Tr::kRowBytes));
          wgmma_commit();
        }
        wgmma_rs_mn<kDkCols, kBlockM / 16, T>(dv, p, do_mn_desc);
        wgmma_commit();

        if constexpr (Tr::kPair128) {
          // dS^T of the first 64 queries while the second half of dP^T may still run, then of
          // the rest (groups retire in order).
          wgmma_wait<2>();
          fence_operand(acc_half<0>(dp));
          if (flags & kPairMasked) {
            bwd_dscores<Tr, true, 0, kSCols / 16>(dp, s, wh, stage_delta(stage), t);
          } else {
            bwd_dscores<Tr, false, 0, kSCols / 16>(dp, s, wh, stage_delta(stage), t);
          }
          wgmma_wait<1>();
          fence_operand(acc_half<1>(dp));
          if (flags & kPairMasked) {
            bwd_dscores<Tr, true, kSCols / 16, kSCols / 8>(dp, s, wh, stage_delta(stage), t);
          } else {
            bwd_dscores<Tr, false, kSCols / 16, kSCols / 8>(dp, s, wh, stage_delta(stage), t);
          }
        } else {
          // Leaving one group pending means dP^T is done while dV may still run.
          wgmma_wait<1>();
          fence_operand(dp);
          if (flags & kPairMasked) {
            bwd_dscores<Tr, true>(dp, s, wh, stage_delta(stage), t);
          } else {
            bwd_dscores<Tr, false>(dp, s, wh, stage_delta(stage), t);
          }
        }
        convert_p<kBlockM, T>(dp, ds);

        // dS^T to shared memory: key row kr of the 128-key tile, query pair (8i + 2t, +1) in
        // chunk i % 8 of the row in panel i / 8, swizzled to chunk (i % 8) ^ (kr % 8) =
        // (i % 8) ^ g. With 128-query tiles the thread's position is re-read (volatile) so that
        // the eight swizzled chunk offsets are computed here, not kept live across the loop.
        {
          const int sid = Tr::kPair128 ? fresh_thread_index() - 128 : 0;
          const int srow = Tr::kPair128 ? sid / 32 * 16 : key_row0 + warp * 16;
          const int sg = Tr::kPair128 ? sid % 32 / 4 : g;
          const int st = Tr::kPair128 ? sid % 4 : t;
          store_operand_tile<Tr::kDsPanels, Tr::kDsPanelBytes>(ds_tile, ds, srow, 0, sg, st);
        }
        fence_proxy_async_smem();
        named_barrier_sync(kBwdBarConsumers, 128 * Tr::kConsumerWarpgroups);

        // dQ_i (the warpgroup's 64 queries x kDqCols head-dim columns) = dS K over the 128 keys:
        // A = dS^T read as MN-major dS (with kDqSplitRows the panel of its queries), B = K
        // MN-major; both advance 16 key rows per wgmma. Then dK += dS^T Q (Q as the MN-major B
        // operand, over all the tile's queries), which runs while dQ_i leaves.
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < kBlockN / 16; ++k) {
          wgmma_ss_trans<Tr::kDqCols, T>(dq, desc_advance(ds_desc, k * 16 * Tr::kRowBytes),
                                         desc_advance(k_mn_desc, k * 16 * Tr::kRowBytes),
                                         k > 0 ? 1u : 0u);
        }
        wgmma_commit();
        wgmma_rs_mn<kDkCols, kBlockM / 16, T>(dk, ds, q_mn_desc);
        wgmma_commit();
        wgmma_wait<1>();
        fence_operand(dq);
        // The header is read before the release lets the producer rewrite it.
        const int64_t dq_offset = hdr->dq_offset;
        const int rows = hdr->rows;
        const int m0 = hdr->m0;
        const int head = hdr->head;

        // The thread's position is re-read here (volatile) so that the compiler computes these
        // addresses now, when s and dP^T are dead, instead of keeping them live across the
        // loop.
        const int ctid = fresh_thread_index() - 128;
        // dq accumulator element 4i + 2r + e is (query row 16 warp + g + 8r of the warpgroup's
        // kDqRows, column 8i + 2t + e of its kDqCols). The warpgroups split the columns (column
        // kDqCols cw + 8i + 2t + e of the head) or, kDqSplitRows, the rows (tile row
        // kDqRows cw + 16 warp + g + 8r).
        const bool in_order = args.dq_semaphores != nullptr;
        if ((flags & kPairZeroRows) == 0) {
          // Staged for a TMA reduction. Rows past a dense sequence are clipped by the map; a
          // packed tile's rows past its sequence take the path below.
          uint8_t* const stage_dq = smem + Tr::kDqOffset + (ctid / 128) * Tr::kDqWgBytes;
          // In order, the writer warp reduces the buffer; it must have read the previous tile.
          // Otherwise each warp's lane 0 issued the reductions and waits for them here.
          static_assert(Tr::kWarpDq);
          if (in_order) {
            named_barrier_sync(kBwdBarDqFreeBase + ctid / 128, kBwdDqHandoffThreads);
          } else {
            // The warp's rows of the buffer were read by its previous reduction.
            if (ctid % 32 == 0) tma_wait_read();
            __syncwarp();
          }
          stage_dq_boxes<Tr::kDqCols>(stage_dq, dq, ctid);
          fence_proxy_async_smem();
          if (in_order) {
            // The arrival orders the staging (and thread 0's record) before the writer's reads.
            if (ctid % 128 == 0) {
              BwdDqHandoff* const h =
                  reinterpret_cast<BwdDqHandoff*>(smem + Tr::kHandoffOffset) + ctid / 128;
              const BwdDqRow at = bwd_dq_row(*cta_tile, packed_layout, runs_tile,
                                             args.layout.seqlen_q, m0 + Tr::dq_row0(ctid / 128));
              h->sem = dq_offset / kD * kDqCounters + ctid / 128;
              h->row = at.row;
              h->batch = at.batch;
              h->head = head;
              h->ticket = dq_ticket(cta_tile->mask, m0, rows, cta_tile->n0, kBlockN);
              h->end = 0;
            }
            named_barrier_arrive(kBwdBarDqStagedBase + ctid / 128, kBwdDqHandoffThreads);
          } else {
            // The warp's 16 rows, staged by its own lanes: a warp barrier orders them (and their
            // proxy fences) before lane 0's reductions.
            __syncwarp();
            if (ctid % 32 == 0) {
              dq_reduce_boxes<Tr::kDqBoxes, Tr::kDqBoxRows, 1>(
                  &tm_dq, tc::smem_addr(stage_dq), Tr::dq_col0(ctid / 128), head,
                  bwd_dq_row(*cta_tile, packed_layout, runs_tile, args.layout.seqlen_q,
                             m0 + Tr::dq_row0(ctid / 128)),
                  ctid % 128 / 32);
              tma_commit();
            }
          }
        } else {
          // A packed sequence's last tile: its rows past the sequence are a neighbour's, which
          // a TMA box would add to, so it adds from registers (in order: after its own wait for
          // the turn, in this warpgroup, while the writer warp may still be busy with an
          // earlier tile of another counter).
          bwd_dq_atomics<Tr>(dq, dq_offset, rows, m0, cw, ctid, cta_tile, args, Tr::dq_row0(cw),
                             Tr::dq_col0(cw), true, true);
        }
        // dK += dS^T Q is done with Q and dS^T: the stage goes back to the producer.
        wgmma_wait<0>();
      }
      fence_operand(dk);
      fence_operand(dv);
      fence_operand(p);
      fence_operand(ds);
      mbar_arrive(bar_empty(stage));
    }
    // Shared memory must outlive the TMA reductions' reads of it; waiting for their writes too
    // leaves nothing in flight when the CTA retires.
    if (Tr::kWarpDq ? lane == 0 : tid == 0) tma_wait_all();
    // In order: the end hand-off, once the writer has read the last tile (bwd_dq_writer); the
    // writer's own waits keep the CTA's shared memory alive until its reductions are done.
    // (The position is re-read, as in the loop, so that the loop does not keep it live.)
    if (Tr::kSplitQ) {
      // The end round of bwd_dq_writer_split: the writer reads the end header from the stage.
      named_barrier_sync(kBwdBarDqFreeBase + cw, kBwdDqHandoffThreads);
      named_barrier_arrive(kBwdBarDqStagedBase + cw, kBwdDqHandoffThreads);
    }
    if (Tr::kDqStaged && args.dq_semaphores != nullptr) {
      const int etid = fresh_thread_index() - 128;
      named_barrier_sync(kBwdBarDqFreeBase + etid / 128, kBwdDqHandoffThreads);
      if (etid % 128 == 0) {
        reinterpret_cast<BwdDqHandoff*>(smem + Tr::kHandoffOffset)[etid / 128].end = 1;
      }
      named_barrier_arrive(kBwdBarDqStagedBase + etid / 128, kBwdDqHandoffThreads);
    }
  }

  // Epilogue: dK = scale * dS^T Q, dV, element 4i + 2r + e at (key row g + 8r, column
  // col0 + 8i + 2t + e). A CTA with no visible query still writes its zeros; keys past the
  // sequence are a neighbour's.
  const int keys = static_cast<int>(cta_tile->span.len_k - cta_tile->n0);
  if (!varlen || keys >= kBlockN) {
    // Through shared memory and TMA stores (whole 128-byte rows, where the stores below write
    // 16-byte pieces of rows 2 KB apart), into the K and V tiles' place: both warpgroups have
    // finished their last GEMM, which read them, once both pass this barrier. The dense maps
    // clip the keys past the sequence; a packed sequence's last tile takes the path below.
    named_barrier_sync(kBwdBarConsumers, 128 * Tr::kConsumerWarpgroups);
    // The position is re-read (volatile) so that these addresses are not hoisted into the loop.
    const int etid = fresh_thread_index() - 128;
    const int eg = etid % 32 / 4;
    const int et = etid % 4;
    const int e_row0 = kSplitQ ? 0 : etid / 128 * 64;
    const int e_panel0 = kSplitQ ? etid / 128 * (kDkCols / Tr::kPanelCols) : 0;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int kr = e_row0 + etid % 128 / 32 * 16 + eg + 8 * r;
#pragma unroll
      for (int i = 0; i < kDkCols / 8; ++i) {
        const int at = (e_panel0 + i / 8) * Tr::kKVPanelBytes + kr * Tr::kRowBytes +
                       ((i % 8) ^ eg) * 16 + et * 4;
        *reinterpret_cast<uint32_t*>(smem + Tr::kKOffset + at) =
            tc::pack2<T>(dk[4 * i + 2 * r] * args.scale, dk[4 * i + 2 * r + 1] * args.scale);
        *reinterpret_cast<uint32_t*>(smem + Tr::kVOffset + at) =
            tc::pack2<T>(dv[4 * i + 2 * r], dv[4 * i + 2 * r + 1]);
      }
    }
    fence_proxy_async_smem();
    named_barrier_sync(kBwdBarDsOwnBase + cw, 128);
    if (tid == 0) {
      const int row =
          map_row(cta_tile->span.k_start, args.layout.seqlen_k) + cta_tile->n0 + key_row0;
      const int batch = packed_layout ? 0 : static_cast<int>(cta_tile->span.seq);
#pragma unroll
      for (int p = 0; p < kDkCols / Tr::kPanelCols; ++p) {
        const int panel = col0 / Tr::kPanelCols + p;
        const uint32_t at = panel * Tr::kKVPanelBytes + key_row0 * Tr::kRowBytes;
        tma_store_4d(&tm_dk, k_smem + at, panel * Tr::kPanelCols, cta_tile->head_kv, row, batch);
        tma_store_4d(&tm_dv, v_smem + at, panel * Tr::kPanelCols, cta_tile->head_kv, row, batch);
      }
      tma_store_commit_and_wait_read();
    }
    return;
  }
  T* const dk_out = static_cast<T*>(args.dk);
  T* const dv_out = static_cast<T*>(args.dv);
  const int64_t k_row0 = cta_tile->span.k_start + cta_tile->n0;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int kr = key + 8 * r;
    if (kr >= keys) continue;
    const int64_t off = ((k_row0 + kr) * args.heads_kv + cta_tile->head_kv) * kD + col0 + 2 * t;
#pragma unroll
    for (int i = 0; i < kDkCols / 8; ++i) {
      *reinterpret_cast<uint32_t*>(dk_out + off + 8 * i) =
          tc::pack2<T>(dk[4 * i + 2 * r] * args.scale, dk[4 * i + 2 * r + 1] * args.scale);
      *reinterpret_cast<uint32_t*>(dv_out + off + 8 * i) =
          tc::pack2<T>(dv[4 * i + 2 * r], dv[4 * i + 2 * r + 1]);
    }
  }
#else
  // A device pass without the sm_90a instructions (the host never launches it there).
  __trap();
#endif  // JAX_FLASH_SM90A
}

}  // namespace jax_flash::cuda::sm90
