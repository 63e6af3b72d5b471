// The wgmma backward's configuration (bwd_wgmma.cuh): the parameters that cross from the host,
// the traits that derive every tile and shared-memory constant from (dtype, head_dim, mask,
// softcap), the named barriers and the records the roles exchange through shared memory, and what
// a CTA's key tile and each of its (query tile, key tile) pairs must do.
#pragma once

#include "common/mask.h"
#include "common/schedule.h"
#include "cuda/dq_convert.cuh"
#include "cuda/sm90_wgmma.cuh"

namespace jax_flash::cuda::sm90 {

struct BwdWgmmaArgs {
  const float* lse;    // dense [batch, heads_q, seqlen_q], packed [heads_q, total_q]; natural log
  const float* delta;  // same layout as lse
  // [rows_q, heads_q, D], unscaled dS K sums; with kDqStsm the columns of each aligned group of
  // 8 in dq_accum_position's order (dq_convert.cuh)
  float* dq_accum;
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
  // kDqT kernels (JAX_FLASH_BWD_DQ_PAIRS) on a dense call with an even seqlen_q: dq_accum in the
  // query-pair order of dq_convert.cuh (dq_pair_position), staged with one 16-byte store per
  // query pair (stage_dq_box_pairs). Otherwise the natural order.
  bool dq_pairs;
};

// Head_dim 64 with 128 queries per (query tile, key tile) pair (1) or 64 (0, the tile of head_dim
// 128 and 256), to compare the two.
#ifndef JAX_FLASH_BWD_M128
#define JAX_FLASH_BWD_M128 1
#endif

// Head_dim 128 without a mask or softcap with 80 queries per pair (1, default) or 64 (0)
// (BwdWgmmaTraits::kDqT), FlashAttention-3's tile for those calls: S^T and dP^T are m64n80, dS is
// stored K-major ([80 queries][128 keys], stmatrix.trans) and dQ_i is computed transposed, dQ^T =
// K^T dS^T per warpgroup (its 64 head-dim columns x 80 queries), staged per warp in
// 64-byte-swizzled [80 x 16] float32 boxes for the TMA reductions (or, JAX_FLASH_BWD_DQ_PAIRS,
// [40 x 32] boxes of query pairs). Measured on an H100
// (docs/PERF_LOG.md): the B=4 S=4096 unmasked backward +3.7% / +3.5% in two rounds.
#ifndef JAX_FLASH_BWD_M80
#define JAX_FLASH_BWD_M80 1
#endif

// kDqT's dq_accum on dense calls with an even seqlen_q (BwdWgmmaArgs::dq_pairs): 1 (default), in
// the query-pair order (dq_convert.cuh, dq_pair_position), where a thread's four dQ^T values of
// one query pair and head-dim column pair are one 16-byte store and each warp's box is [40 pair
// rows x 32] float32 with the 128-byte swizzle: 10 conflict-free stores a thread a pair instead of
// 40 4-byte stores with two-way bank conflicts; 0, the natural order everywhere. Measured on an
// H100 (docs/PERF_LOG.md): the B=4 S=4096 unmasked backward +1.6% to +3.9% in six rounds, the
// unchanged causal kernels -3.0% to +2.9%.
#ifndef JAX_FLASH_BWD_DQ_PAIRS
#define JAX_FLASH_BWD_DQ_PAIRS 1
#endif

// The pair's order (BwdWgmmaTraits::kLateP), bit 1 for head_dim 64, bit 2 for head_dim 128:
// clear, dV issued early (with 128-query pairs the packed f16 factor); set, P kept float32 and dV
// issued after dS^T. Measured on the H200 (docs/PERF_LOG.md): head_dim 64 +5-6% unmasked and
// +3-4% causal over the early order, head_dim 128 +2% unmasked but -1 to +1% causal, so bit 2
// is off. Bit 4: head_dim 128's kernels without kMasked only (unbounded bands, no segment ids:
// the cells that gained; +1.9% / +2.2% on the H200, +2.4% / +1.2% on an H100), on by default.
#ifndef JAX_FLASH_BWD_LATE_P
#define JAX_FLASH_BWD_LATE_P 5
#endif

// Head_dim 256's dQ order (BwdWgmmaTraits::kDqFirst): 0, dV and dK then both dQ halves, each
// waited for in full; 1 (default, +8% unmasked and +3-5% causal on the H200), the first dQ half
// before dV and dK.
#ifndef JAX_FLASH_BWD_DQ_FIRST
#define JAX_FLASH_BWD_DQ_FIRST 1
#endif

// dQ_i's staging order (BwdWgmmaTraits::kDqStsm), bit 1 for head_dim 64, bit 2 for 128, bit 4
// for 256: set, dq_accum keeps each group of 8 columns in dq_accum_position's order and the
// consumers stage dQ_i with stmatrix (bwd_wgmma_dq.cuh, stage_dq_boxes); clear, the natural order
// and one 8-byte store per column pair, which takes twice the shared-memory wavefronts. At 128,
// bit 2 reaches the 64-query (masked) kernels that have the writer warps only: the 80-query ones
// stage dQ^T in their own boxes. Measured on an H100 (docs/PERF_LOG.md): +1.5-2.5% of the backward
// at 256; at 128 and 64 -2 to +0.5% alone, but a gain together with the writer warps (kDqWriter):
// +2-3.6% at 128, and at 64 (with kDsStsm too) +2-3% unmasked and +1-6% causal. So bits 1 and 2
// are on; at 128 the bit follows kDqWriter, at 64 it does not (the soft-capped masked kernel,
// which has no writer warps, stages with stmatrix too; its speed was not measured either way).
#ifndef JAX_FLASH_BWD_DQ_STSM
#define JAX_FLASH_BWD_DQ_STSM 7
#endif

// How the consumers write the 16-bit tiles they exchange through shared memory (dS^T, and P^T
// where the warpgroups split the queries), bit 1 for head_dim 64, bit 2 for 128, bit 4 for 256
// (BwdWgmmaTraits::kDsStsm): set, one stmatrix.x4 per k16 step of a warp's fragments
// (store_operand_tile_stsm); clear, one 4-byte store per register (store_operand_tile). The bytes
// stored are the same; stmatrix takes a quarter of the instructions. An experiment's -D switch:
// the 80-query kernels (kDqT) store dS with stmatrix.trans either way. Measured on an H100
// (docs/PERF_LOG.md): alone (7 against 0) head_dim 64 and 128 within the rounds' spread, 256 -1%;
// at head_dim 64 on top of the writer warps and stmatrix dQ staging -1 to +3.6% (unmasked +1.1 to
// +2.6% in three rounds), and of the builds tried the only one ahead of the default on every
// head_dim-64 cell of every round, so bit 1 is on.
#ifndef JAX_FLASH_BWD_DS_STSM
#define JAX_FLASH_BWD_DS_STSM 1
#endif

// Which head_dims hand every call's staged dQ_i to the writer warps (bwd_dq_writer), which issue
// the TMA reductions, as the deterministic order does but without its turns (BwdWgmmaTraits::
// kDqWriter; bit 1 for 64, bit 2 for 128; head_dim 256's split-query kernels always have their
// writer; bit 8 lets the soft-capped kernels in, bit 16 only those without kMasked: on an H100
// bit 8 gained 2-3.5% on the soft-capped unmasked cell in four rounds, -1.6 to +2.2% causal).
// Clear, outside that order each consumer warp's lane 0 issues its own box's reductions and waits
// for their reads before the next staging. Measured on an H100 (docs/PERF_LOG.md): at 128 with
// stmatrix staging +2-3.6% of the masked kernels' backward, -0.6 to +2.1% unmasked, so bits 2 and
// 16 are on (18: with STATS_EARLY 25, +1-5% on the head_dim-128 cells against 2 with 0, two rounds
// on an H100). At 64 the writer alone lost 1% at causal 1k; with stmatrix staging of dQ and dS^T
// (DQ_STSM bit 1, DS_STSM bit 1) it gained on every head_dim-64 cell (unmasked 4k +2.1-3.2% and
// causal 4k +2.4-6.3% in three to five rounds, causal 1k +1.1 / +1.4%), so bit 1 is on too (19).
#ifndef JAX_FLASH_BWD_DQ_WRITER
#define JAX_FLASH_BWD_DQ_WRITER 19
#endif

// Where a pair's lse and delta reach the consumers' registers (docs/PERF_LOG.md). Measured on an
// H100: before the writer warps, 13 lost 1.3-3.3% on most masked head_dim-128 cells; with them, 9
// gained 1-4% on the masked and unmasked head_dim-128 cells in four rounds but lost 1-4% on the
// soft-capped causal one, hence bit 16 in the default 25 (bit 32, head_dim 64 too: 57, within
// +-1% of 25 at head_dim 64 in two rounds, off). 0,
// each read from the stage where the P^T / dS^T math uses it; bit 1, lse loaded before the wait
// for S^T; bit 2, delta loaded right after the P^T math, before the dV GEMM's issue and the wait
// for dP^T; bit 4, delta loaded with lse; bit 8, with bit 1, the first two lse pairs of the
// 80-query kernels (docs/PERF_LOG.md: the first use of each carried a short-scoreboard stall).
// Otherwise only kernels with 64-query pairs and neither split queries nor the packed factor,
// i.e. head_dim 128's masked and soft-capped ones: 8 values of each a thread.
#ifndef JAX_FLASH_BWD_STATS_EARLY
#define JAX_FLASH_BWD_STATS_EARLY 25
#endif

// How the deterministic order's hand-off record (BwdDqHandoff) is ordered between a consumer
// warpgroup and its writer warp: 0 (default), by the staged / free named barriers alone, which
// order the staging buffer too; 1, by a pair of mbarriers per record besides them (written:
// consumer thread 0 arrives; read: writer lane 0 arrives). compute-sanitizer's racecheck follows
// mbarriers but not bar.arrive / bar.sync pairs, and reports the record's fields under 0 (README,
// Determinism). Measured on an H100: racecheck then reports nothing, but head_dim 128 loses 1-5%
// and head_dim 64 causal 1k 10% (docs/PERF_LOG.md), so 0.
#ifndef JAX_FLASH_BWD_DQ_RECORD_MBAR
#define JAX_FLASH_BWD_DQ_RECORD_MBAR 0
#endif
inline constexpr bool kDqRecordMbar = JAX_FLASH_BWD_DQ_RECORD_MBAR != 0;
// sizeof(BwdDqHandoff), defined below.
inline constexpr int kDqHandoffBytes = kDqRecordMbar ? 56 : 32;

// kMasked: the band has a finite bound or segment ids are given, so tile pairs inside a sequence
// may be skipped or need element masking (without it only the end of a sequence is masked).
// kSoftcap: logit soft-capping.
template <typename T, int kHeadDim, bool kMasked, bool kSoftcap>
struct BwdWgmmaTraits : Sw128Panels<kHeadDim> {
  using Panels = Sw128Panels<kHeadDim>;
  using Element = T;
  static constexpr int kD = kHeadDim;
  // This head_dim's bit in the per-head_dim switches (JAX_FLASH_BWD_DQ_WRITER, _DQ_STSM, _DS_STSM).
  static constexpr int kHeadDimBit = kD == 64 ? 1 : kD == 128 ? 2 : 4;
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
  // kPair128 below says how the registers fit. Head_dim 256 and head_dim 128's masked or
  // soft-capped kernels keep 64 (their dK / dV registers leave no room for 128 queries).
  // kDqT (JAX_FLASH_BWD_M80): head_dim 128 without a mask or softcap, 80 queries a pair and
  // dQ_i computed transposed (see the switch); its kernels keep no segment ids, which is what
  // lets their 80-row stages fit in shared memory.
  static constexpr bool kDqT = kD == 128 && !kMasked && !kSoftcap && JAX_FLASH_BWD_M80 != 0;
  static constexpr int kBlockM = kDqT ? 80 : kD == 64 && JAX_FLASH_BWD_M128 != 0 ? 128 : 64;
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
  // dQ_i accumulator registers a thread: m64n(kDqCols) per GEMM, or with kDqT m64n80 (its 64
  // head-dim columns on the accumulator rows, the 80 queries on its columns).
  static constexpr int kDqAcc = kDqT ? kBlockM / 2 : kDqCols / 2;
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
  // kDqT: a warp holds 16 head-dim columns of all the tile's queries, so its box is [kBlockM rows x
  // 16 columns] (64-byte rows, the 64-byte swizzle), and the warpgroup's 4 boxes lie side by side.
  static constexpr int kDqBoxRows = kDqT ? kBlockM : kWarpDq ? 16 : kDqRows;
  static constexpr int kDqBoxCols = kDqT ? 16 : 32;
  // kDqT with BwdWgmmaArgs::dq_pairs: the same warp's box as [kBlockM / 2 pair rows x 32]
  // (128-byte rows, the 128-byte swizzle; its bytes kDqBoxBytes as before).
  static constexpr bool kDqPairs = kDqT && JAX_FLASH_BWD_DQ_PAIRS != 0;
  static constexpr int kDqPairBoxRows = kBlockM / 2;
  static constexpr int kDqPairBoxCols = 32;

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
  // kLateP (JAX_FLASH_BWD_LATE_P; not with soft-capping, whose dS factor is not P, nor at head_dim
  // 256): the pair in FlashAttention-3's order. dP^T is one GEMM issued with S^T; P stays float32
  // in s, dS^T replaces dP^T, and only then are both converted to 16 bits and dV += P^T dO issued,
  // after the dS^T stores, where otherwise dV is issued as soon as P^T is 16-bit and runs under the
  // dS math. For the 128-query pair the peak is again S^T, dP^T, dK and dV (192 registers), without
  // the f16 factor, its conversions and the split dP^T; for the 64-query pair of head_dim 128, 192
  // instead of 208 with P^T.
  // kPackedFactor: the 128-query scheme above.
  // The JAX_FLASH_BWD_LATE_P bits that turn it on for this kernel.
  static constexpr int kLatePBits = kD == 64 ? 1 : kMasked ? 2 : 2 | 4;
  static constexpr bool kLateP = !kSplitQ && !kSoftcap && (JAX_FLASH_BWD_LATE_P & kLatePBits) != 0;
  static constexpr bool kPackedFactor = kPair128 && !kLateP;
  // JAX_FLASH_BWD_STATS_EARLY: lse / delta loaded into registers ahead of their use. kLseAhead
  // is how many of the thread's kSCols / 8 lse pairs: all of them with 64-query pairs; with the
  // 80-query pairs, whose registers do not hold all ten (ptxas spills and serialises the wgmma),
  // the first two with bit 8, so that the P^T math starts while the rest arrive; bit 32 the same
  // for head_dim 64's 128-query pairs (sixteen pairs a thread).
  // Bit 16 keeps the soft-capped kernels out (their causal cell lost 1-4% with bits 1 and 8 on
  // an H100, docs/PERF_LOG.md).
  static constexpr int lse_ahead() {
    constexpr int kBits = JAX_FLASH_BWD_STATS_EARLY;
    if ((kBits & 1) == 0 || kPackedFactor || kSplitQ || ((kBits & 16) != 0 && kSoftcap)) return 0;
    if (kSCols <= 64) return kSCols / 8;
    if (kSCols == 80 && (kBits & 8) != 0) return 2;
    if (kSCols == 128 && (kBits & 32) != 0) return 2;
    return 0;
  }
  static constexpr int kLseAhead = lse_ahead();
  // Delta pairs loaded ahead (all of them, 64-query pairs only): kDeltaWithLse with lse, before
  // the wait for S^T (bit 4; not soft-capped, where ptxas then spills 116 bytes, and there as with
  // bit 2), otherwise after the P^T math (bit 2).
  static constexpr int kDeltaAhead =
      (JAX_FLASH_BWD_STATS_EARLY & 6) != 0 && kSCols <= 64 && !kPackedFactor && !kSplitQ
          ? kSCols / 8
          : 0;
  static constexpr bool kDeltaWithLse =
      kDeltaAhead > 0 && (JAX_FLASH_BWD_STATS_EARLY & 4) != 0 && !kIsSoftcap;
  // kDqFirst (head_dim 256, JAX_FLASH_BWD_DQ_FIRST): the first dQ half is issued before dV and
  // dK, so that it is done, and staged, while dK still runs, and the second half queues behind
  // dK instead of after the staging. The halves then trade places: the first is staged in the
  // dO panels (free once dV is done), the second in the Q panels (once dK is); the writer warp
  // reads them accordingly.
  static constexpr bool kDqFirst = kSplitQ && JAX_FLASH_BWD_DQ_FIRST != 0;
  // Whether dQ half h is staged in the Q panels (else the dO panels): the consumers stage it
  // there and the writer warp reduces it from there.
  __host__ __device__ static constexpr bool dq_half_in_q(int h) { return (h == 0) != kDqFirst; }
  // Every call's staged dQ_i reduced by the writer warps (JAX_FLASH_BWD_DQ_WRITER, same bits).
  // Soft-capped kernels only with bit 8 (an experiment): there the unmasked head_dim-128 kernel
  // spills 32 bytes with it (ptxas), and no soft-capped cell was in the measurement that turned
  // it on.
  static constexpr bool kDqWriter = kDqStaged &&
                                    (!kSoftcap || (JAX_FLASH_BWD_DQ_WRITER & 8) != 0 ||
                                     ((JAX_FLASH_BWD_DQ_WRITER & 16) != 0 && !kMasked)) &&
                                    (JAX_FLASH_BWD_DQ_WRITER & kHeadDimBit) != 0;
  // Whether a call's staged dQ_i goes to the writer warps: with kDqWriter always, otherwise only
  // in the deterministic order (dQ semaphores given).
  __device__ static constexpr bool dq_to_writer(bool in_order) {
    return kDqStaged && (kDqWriter || in_order);
  }
  // dq_accum in dq_accum_position's order, dQ_i staged with stmatrix (JAX_FLASH_BWD_DQ_STSM);
  // not the dQ^T kernels, which keep their own box order. At head_dim 128 the staging paid only
  // together with the writer warps, so there it follows kDqWriter.
  static constexpr bool kDqStsm =
      (JAX_FLASH_BWD_DQ_STSM & kHeadDimBit) != 0 && !kDqT && (kD != 128 || kDqWriter);
  // The exchanged dS^T / P^T tiles stored with stmatrix (JAX_FLASH_BWD_DS_STSM).
  static constexpr bool kDsStsm = (JAX_FLASH_BWD_DS_STSM & kHeadDimBit) != 0;
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;

  // Tiles are Sw128Panels panels of their rows.
  static constexpr int kKVPanelBytes = kBlockN * Panels::kRowBytes;
  static constexpr int kKVBytes = kKVPanelBytes * Panels::kPanels;
  static constexpr int kQPanelBytes = kBlockM * Panels::kRowBytes;
  static constexpr int kQStageBytes = kQPanelBytes * Panels::kPanels;
  // dS^T of one query tile: kBlockN key rows of kBlockM queries, in kDsPanels panels of 64
  // queries (128-byte rows, as the TMA lays out Q); P^T alike where the warpgroups exchange it.
  // kDqT: dS instead, kBlockM query rows of the kBlockN keys, in kBlockN / 64 panels (K-major for
  // the dQ^T GEMM's B).
  static constexpr int kDsPanels =
      kDqT ? kBlockN * 2 / Panels::kRowBytes : kBlockM * 2 / Panels::kRowBytes;
  static constexpr int kDsPanelBytes = (kDqT ? kBlockM : kBlockN) * Panels::kRowBytes;
  static constexpr int kDsBytes = kDsPanelBytes * kDsPanels;
  static constexpr int kPBytes = kSplitQ ? kDsBytes : 0;
  // dQ_i of one warpgroup (kDqRows queries x kDqCols head-dim columns, float32) on its way to
  // dq_accum: TMA boxes of 32 columns, each kDqRows 128-byte rows with the 128-byte swizzle.
  static constexpr int kDqBoxBytes = kDqRows * kDqBoxCols * 4;
  static constexpr int kDqBoxes = kDqCols / kDqBoxCols;
  static constexpr int kDqWgBytes = kDqStaged ? kDqBoxBytes * kDqBoxes : 0;
  // Per stage: lse * log2(e), delta and the query segment ids (kBlockM 4-byte values each), then
  // the pair's header (BwdPairHeader).
  // kDqT kernels (no segment ids) keep no query ids: their shared memory is full.
  static constexpr int kHeaderBytes = 48;
  static constexpr int kStatArrays = kDqT ? 2 : 3;
  static constexpr int kHeaderOffset = kStatArrays * kBlockM * 4;
  static constexpr int kRowStatBytes = kHeaderOffset + kHeaderBytes;

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
  static constexpr int kHandoffBytes = kDqStaged ? kDqHandoffBytes : 0;
  static constexpr int kHandoffOffset = kKvIdOffset + (kDqT ? 0 : kBlockN * 4);
  // The kernel aligns its base to 1024 bytes (the swizzle's period); dynamic shared memory starts
  // 16-byte aligned, so that costs at most 1008 bytes (head_dim 256 needs all but a few of them).
  static constexpr int kSmemBytes = kHandoffOffset + kConsumerWarpgroups * kHandoffBytes + 1008;

  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>);
  static_assert(kD == 64 || kD == 128 || kD == 256, "head_dim 64, 128 and 256 only");
  static_assert(kBlockM * 2 == kDsPanels * Panels::kRowBytes || kDqT,
                "dS^T rows are whole swizzle spans");
  static_assert(!kDqT || (kBlockM % 16 == 0 && kDsPanels == 2 && !kPair128 && !kSplitQ),
                "the kDqT pair: k16 steps of queries, dS in two 64-key panels");
  static_assert(kDsPanels == 1 || !kSplitQ, "the P^T / dS^T exchange reads one panel");
  static_assert(kKVPanelBytes % 1024 == 0 && kQPanelBytes % 1024 == 0 &&
                kDsPanelBytes % 1024 == 0 && kDqBoxBytes % 1024 == 0);
  static_assert(kDqCols == 64 || kDqCols == 32, "dQ GEMMs are m64n64 or m64n32");
  static_assert(kDqRows == 64 || kDqT, "dQ GEMMs have 64 query rows (one wgmma M extent)");
  static_assert((kDqBoxBytes == 8192 || kDqT) && (kQPanelBytes == 8192 || !kSplitQ),
                "dq_reduce_boxes and stage_dq_boxes space the 32-column boxes 8 KB apart");
  static_assert(!kDqPairs || kDqPairBoxRows * kDqPairBoxCols * 4 == kDqBoxBytes,
                "a pair box holds the warp's natural box's bytes");
  static_assert(kDkCols == 128 || kDkCols == 64, "dV / dK GEMMs are m64n128 or m64n64");
  static_assert(kSCols == 128 || kSCols == 80 || kSCols == 64 || kSCols == 32,
                "S^T GEMMs are m64n128, m64n80, m64n64 or m64n32");
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
  int seq;     // kDqRecordMbar: records written so far (consumer thread 0's own count)
#if JAX_FLASH_BWD_DQ_RECORD_MBAR
  uint64_t full;   // mbarrier, one arrival: the record is written
  uint64_t empty;  // mbarrier, one arrival: the writer has read it
  int taken;       // records read so far (writer lane 0's own count)
  int pad;
#endif
};
static_assert(sizeof(BwdDqHandoff) == kDqHandoffBytes, "BwdWgmmaTraits::kHandoffBytes");

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

}  // namespace jax_flash::cuda::sm90
