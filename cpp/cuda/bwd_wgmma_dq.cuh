// The wgmma backward's dQ (bwd_wgmma.cuh): a pair's dQ_i added into the fp32 dq_accum, from
// registers with vector atomics or staged in shared memory for TMA reductions, by the consumers
// or by writer warps, in any order or in the deterministic order of dq_convert.cuh.
#pragma once

#include "cuda/bwd_wgmma_traits.cuh"
#include "cuda/dq_convert.cuh"

namespace jax_flash::cuda::sm90 {

#if JAX_FLASH_SM90A

// dQ_i of one warpgroup added into dq_accum from registers with vector atomics: the path of a
// packed sequence's last tile, whose rows past the sequence are the neighbour's and must get
// nothing, in the deterministic order (semaphores) or not. Accumulator element 4i + 2r + e is
// (query row row0 + 16 warp + g + 8r of the tile, column col0 + 8i + 2t + e of the head). A
// warpgroup whose dQ_i takes several GEMMs (kDqGemms) waits for its deterministic turn before the
// first (`first`) and passes it on after the last (`last`).
template <class Tr>
__device__ __forceinline__ void bwd_dq_atomics(const float (&dq)[Tr::kDqAcc], int64_t dq_offset,
                                               int rows, int m0, int cw, int ctid,
                                               const BwdCtaTile* cta_tile, const BwdWgmmaArgs& args,
                                               int row0, int col0, bool first, bool last) {
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
  // Rows past the sequence get nothing. With kDqStsm columns 8i + 2t and 8i + 2t + 1 sit at
  // 8i + t and 8i + 4 + t (dq_accum_position).
  static_assert(dq_accum_position(0) == 0 && dq_accum_position(1) == 4 &&
                dq_accum_position(6) == 3 && dq_accum_position(7) == 7);
  if constexpr (Tr::kDqT) {
    // dQ^T: element 4i + 2r + e is (head column col0 + 16 warp + g + 8r, query row 8i + 2t + e).
    static_assert(!Tr::kDqStsm);
    float* const dq_col = args.dq_accum + dq_offset + col0 + (ctid % 128) / 32 * 16 + dq_lane / 4;
#pragma unroll
    for (int i = 0; i < Tr::kBlockM / 8; ++i) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int q = 8 * i + 2 * (dq_lane % 4) + e;
        if (q < rows) {
          float* const at = dq_col + static_cast<int64_t>(q) * args.heads_q * kD;
          tc::red_add_f32(at, dq[4 * i + e]);
          tc::red_add_f32(at + 8, dq[4 * i + 2 + e]);
        }
      }
    }
  } else {
    float* const dq_head = args.dq_accum + dq_offset + col0 + (Tr::kDqStsm ? 1 : 2) * (dq_lane % 4);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int q = row0 + (ctid % 128) / 32 * 16 + dq_lane / 4 + 8 * r;
      if (q < rows) {
        float* const dq_row = dq_head + static_cast<int64_t>(q) * args.heads_q * kD;
#pragma unroll
        for (int i = 0; i < Tr::kDqCols / 8; ++i) {
          if constexpr (Tr::kDqStsm) {
            tc::red_add_f32(dq_row + 8 * i, dq[4 * i + 2 * r]);
            tc::red_add_f32(dq_row + 8 * i + 4, dq[4 * i + 2 * r + 1]);
          } else {
            tc::red_add_f32x2(dq_row + 8 * i, dq[4 * i + 2 * r], dq[4 * i + 2 * r + 1]);
          }
        }
      }
    }
  }
  if (sem != nullptr && last) {
    named_barrier_sync(kBwdBarDsOwnBase + cw, 128);
    if (ctid % 128 == 0) dq_pass_turn(sem);
  }
}

// dQ_i accumulators of kCols columns staged for TMA reductions: 32-column float32 boxes of 64
// 128-byte rows (8 KB apart from `boxes` on) with the 128-byte swizzle (chunk c of row q at
// c ^ (q % 8)); element 4i + 2r + e is query row q = 16 warp + g + 8r, column 8i + 2t + e.
// - Natural order (kStsm clear): the thread's column pair is one 8-byte store, 8 bytes into chunk
//   2 (i % 4) + t / 2 of box i / 4. The swizzle puts rows g and g ^ 1 of a half-warp on the same
//   banks, twice the wavefronts of the ideal (tools/dq_stage_banks.py).
// - dq_accum_position's order (kStsm): column 8i + 2t + e sits in slot t of chunk 2 (i % 4) + e,
//   the layout of one stmatrix.x4 a group of 8 columns: matrix 2r + e is the warp's rows 8r.. at
//   chunk 2 (i % 4) + e, register 2r + e of lane 4g + t is that matrix's row g at slot t, and the
//   8 rows of a matrix fall on 8 different chunks, one wavefront each.
template <int kCols, bool kStsm>
__device__ __forceinline__ void stage_dq_boxes(uint8_t* boxes, const float (&dq)[kCols / 2],
                                               int ctid) {
  if constexpr (kStsm) {
    const int lane = ctid % 32;
    // This lane addresses row lane % 8 of matrix m = lane / 8 (accumulator row r = m / 2, chunk
    // parity e = m % 2).
    const int m = lane / 8;
    const int q = (ctid % 128) / 32 * 16 + 8 * (m / 2) + lane % 8;
    const uint32_t row = tc::smem_addr(boxes) + q * 128;
#pragma unroll
    for (int i = 0; i < kCols / 8; ++i) {
      const int chunk = (2 * (i % 4) + m % 2) ^ (lane % 8);
      tc::stmatrix_x4(row + (i / 4) * 8192 + chunk * 16, __float_as_uint(dq[4 * i]),
                      __float_as_uint(dq[4 * i + 1]), __float_as_uint(dq[4 * i + 2]),
                      __float_as_uint(dq[4 * i + 3]));
    }
  } else {
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
}

// dQ^T accumulators of one warp (kDqT: 16 head-dim columns, rows 16 warp + g + 8r, x kRows queries,
// columns 8i + 2t + e; element 4i + 2r + e) staged as the warp's [kRows x 16] float32 box with the
// 64-byte swizzle the TMA map applies: byte 64 q + 16 ((c / 4) ^ ((q / 2) % 4)) + 4 (c % 4) for
// query q, column c. For a fixed (i, r, e) the warp's 32 stores fall on 16 banks, two lanes each.
// (q / 2) % 4 is t for every q = 8i + 2t + e, so a lane's chunk depends on r alone, and its
// stores are two base addresses plus immediates (512 bytes an i, 64 an e).
template <int kRows>
__device__ __forceinline__ void stage_dq_box_t(uint8_t* box, const float (&dq)[kRows / 2],
                                               int lane) {
  const int g = lane / 4;
  const int t = lane % 4;
  uint8_t* const row = box + 128 * t + (g % 4) * 4;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    uint8_t* const at = row + ((g / 4 + 2 * r) ^ t) * 16;
#pragma unroll
    for (int i = 0; i < kRows / 8; ++i) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        *reinterpret_cast<float*>(at + 512 * i + 64 * e) = dq[4 * i + 2 * r + e];
      }
    }
  }
}

// The same warp's dQ^T in dq_pair_position's order (BwdWgmmaArgs::dq_pairs): its box is
// [kRows / 2 pair rows x 32] float32 with the 128-byte swizzle, the thread's values of query pair
// 4i + t, columns g and g + 8, one 16-byte chunk at dq_pair_chunk(g) ^ ((4i + t) % 8). A quarter
// warp's 8 lanes (g in {2k, 2k + 1}, four pair rows) write 8 different chunk positions, so each
// store takes the 4 wavefronts its 512 bytes need. The swizzle term is t ^ 4 (i % 2), so the
// stores are two base addresses plus immediates (1024 bytes an i / 2).
template <int kRows>
__device__ __forceinline__ void stage_dq_box_pairs(uint8_t* box, const float (&dq)[kRows / 2],
                                                   int lane) {
  const int g = lane / 4;
  const int t = lane % 4;
  const int chunk = dq_pair_chunk(g) ^ t;
  uint8_t* const even = box + 128 * t + 16 * chunk;
  uint8_t* const odd = box + 128 * t + 16 * (chunk ^ 4);
#pragma unroll
  for (int i = 0; i < kRows / 8; ++i) {
    *reinterpret_cast<float4*>((i % 2 == 0 ? even : odd) + 512 * i) =
        make_float4(dq[4 * i], dq[4 * i + 1], dq[4 * i + 2], dq[4 * i + 3]);
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

// TMA reductions of kBoxes staged kBoxCols-column float32 boxes (kBoxBytes apart from `src` on;
// 32 columns, 8 KB, or kDqT's 16 columns of all the tile's rows) into dQ columns col0, col0 +
// kBoxCols, .. of (at, head); the caller commits the bulk group. The map's boxes have kBoxRows
// rows: kPieces of them from row piece0 * kBoxRows of the staged tile on (each piece 1 KB-aligned
// in the staged tile, so the swizzle is the same).
template <int kBoxes, int kBoxRows, int kPieces, int kBoxBytes = 8192, int kBoxCols = 32>
__device__ __forceinline__ void dq_reduce_boxes(const CUtensorMap* tm_dq, uint32_t src, int col0,
                                                int head, BwdDqRow at, int piece0 = 0) {
  static_assert(kPieces == 1 || kBoxRows * kBoxCols * 4 % 1024 == 0);
#pragma unroll
  for (int k = 0; k < kPieces; ++k) {
    const int row = (piece0 + k) * kBoxRows;
#pragma unroll
    for (int b = 0; b < kBoxes; ++b) {
      tma_reduce_add_4d(tm_dq, src + b * kBoxBytes + row * kBoxCols * 4, col0 + kBoxCols * b, head,
                        at.row + row, at.batch);
    }
  }
}

// kDqT: TMA reductions of kBoxes consecutive warp boxes (kDqBoxBytes apart from `src` on, 16
// head-dim columns each from col0) into dq_accum, in the natural order or, with `pairs`
// (BwdWgmmaArgs::dq_pairs), in dq_pair_position's view: pair rows, 32 floats a 16-column group.
template <class Tr, int kBoxes>
__device__ __forceinline__ void dq_reduce_boxes_t(const CUtensorMap* tm_dq, uint32_t src, int col0,
                                                  int head, BwdDqRow at, bool pairs) {
  static_assert(Tr::kDqT);
  if (Tr::kDqPairs && pairs) {
    dq_reduce_boxes<kBoxes, Tr::kDqPairBoxRows, 1, Tr::kDqBoxBytes, Tr::kDqPairBoxCols>(
        tm_dq, src, 2 * col0, head, {at.row / 2, at.batch});
  } else {
    dq_reduce_boxes<kBoxes, Tr::kDqBoxRows, 1, Tr::kDqBoxBytes, Tr::kDqBoxCols>(tm_dq, src, col0,
                                                                                head, at);
  }
}

// kDqRecordMbar: consumer thread 0's side of a hand-off record. Before writing record k (the
// record's own count, `seq`) it waits until the writer has read record k - 1 ...
__device__ __forceinline__ void dq_record_claim(BwdDqHandoff* h) {
#if JAX_FLASH_BWD_DQ_RECORD_MBAR
  const int k = h->seq;
  if (k > 0) mbar_wait(tc::smem_addr(&h->empty), (k - 1) & 1);
  h->seq = k + 1;
#endif
}
// ... and announces it once written.
__device__ __forceinline__ void dq_record_publish(BwdDqHandoff* h) {
#if JAX_FLASH_BWD_DQ_RECORD_MBAR
  mbar_arrive(tc::smem_addr(&h->full));
#endif
}

// The writer warp's side (every lane calls take): whether the record just staged is the end
// flag. With kDqRecordMbar lane 0 first waits for the record's mbarrier (its count of records
// read kept in the record, not in a register: the producer warpgroup's 24 spill otherwise) and
// tells the other lanes; release arrives on the record's `empty` once the reductions that take
// its coordinates are issued.
__device__ __forceinline__ bool dq_record_take(const BwdDqHandoff* handoff, int lane) {
#if JAX_FLASH_BWD_DQ_RECORD_MBAR
  int end = 0;
  if (lane == 0) {
    BwdDqHandoff* const rec = const_cast<BwdDqHandoff*>(handoff);
    const int k = rec->taken;
    mbar_wait(tc::smem_addr(&rec->full), k & 1);
    rec->taken = k + 1;
    end = rec->end;
  }
  return __shfl_sync(0xffffffffu, end, 0) != 0;
#else
  (void)lane;
  return handoff->end != 0;
#endif
}
__device__ __forceinline__ void dq_record_release(const BwdDqHandoff* handoff) {
#if JAX_FLASH_BWD_DQ_RECORD_MBAR
  mbar_arrive(tc::smem_addr(&handoff->empty));
#else
  (void)handoff;
#endif
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
                                              int lane, bool pairs) {
  // Without counters (Tr::kDqWriter outside the deterministic order) there are no turns.
  const bool ordered = sems != nullptr;
  named_barrier_arrive(kBwdBarDqFreeBase + cw, kBwdDqHandoffThreads);
  for (;;) {
    named_barrier_sync(kBwdBarDqStagedBase + cw, kBwdDqHandoffThreads);
    if (dq_record_take(handoff, lane)) {
      // Nothing waited for the unordered reductions' writes: none stays in flight when the CTA
      // retires.
      if (!ordered && lane == 0) tma_wait_all();
      return;
    }
    int32_t* const sem = ordered ? sems + handoff->sem : nullptr;
    if (lane == 0) {
      if (ordered) dq_turn_wait(sem, handoff->ticket);
      if constexpr (Tr::kDqT) {
        dq_reduce_boxes_t<Tr, Tr::kDqBoxes>(tm_dq, stage_dq, Tr::dq_col0(cw), handoff->head,
                                            {handoff->row, handoff->batch}, pairs);
      } else {
        dq_reduce_boxes<Tr::kDqBoxes, Tr::kDqBoxRows, Tr::kDqRows / Tr::kDqBoxRows, Tr::kDqBoxBytes,
                        Tr::kDqBoxCols>(tm_dq, stage_dq, Tr::dq_col0(cw), handoff->head,
                                        {handoff->row, handoff->batch});
      }
      dq_record_release(handoff);
      tma_commit();
      tma_wait_read();
    }
    __syncwarp();
    named_barrier_arrive(kBwdBarDqFreeBase + cw, kBwdDqHandoffThreads);
    if (lane == 0 && ordered) dq_turn_pass(sem);
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
        stats + stage * Tr::kRowStatBytes + Tr::kHeaderOffset);
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
    // The second half is staged in the other panels (dO, with kDqFirst Q), which the first
    // half's reductions do not read: the consumers may hand it over at once, so that they never
    // wait for the deterministic turn.
    named_barrier_arrive(kBwdBarDqFreeBase + cw, kBwdDqHandoffThreads);
    int32_t* sem = nullptr;
    for (int half = 0; half < 2; ++half) {
      if (half == 1) {
        __syncwarp();
        named_barrier_sync(kBwdBarDqStagedBase + cw, kBwdDqHandoffThreads);
        // The next pair's first half is staged in the next stage's panels: it may come at once
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
        dq_reduce_boxes<2, Tr::kDqBoxRows, 1>(tm_dq,
                                              (Tr::dq_half_in_q(half) ? q_smem : do_smem) + panels,
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

}  // namespace jax_flash::cuda::sm90
