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
// Shared-memory tiles use the forward's 128-byte-swizzled panel layout (cuda/fwd_wgmma.cuh), with
// the wgmma wrappers and descriptors of cuda/sm90_wgmma.cuh and the barrier and TMA wrappers of
// cuda/sm90_async.cuh.
//
// This file holds the kernel, its roles and their pair loops; the parameters, traits and shared
// records are in bwd_wgmma_traits.cuh, the P^T / dS^T element math in bwd_wgmma_scores.cuh and
// every dQ path (atomics, TMA reductions, writer warps, the deterministic order) in
// bwd_wgmma_dq.cuh.
#pragma once

#include <math_constants.h>

#include "common/mask.h"
#include "common/schedule.h"
#include "cuda/bwd_wgmma_dq.cuh"
#include "cuda/bwd_wgmma_scores.cuh"
#include "cuda/bwd_wgmma_traits.cuh"
#include "cuda/dq_convert.cuh"
#include "cuda/sm90_wgmma.cuh"

namespace jax_flash::cuda::sm90 {

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
    return reinterpret_cast<BwdPairHeader*>(stats + stage * Tr::kRowStatBytes + Tr::kHeaderOffset);
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
#if JAX_FLASH_BWD_DQ_RECORD_MBAR
    if constexpr (Tr::kDqStaged) {
      BwdDqHandoff* const rec = reinterpret_cast<BwdDqHandoff*>(smem + Tr::kHandoffOffset);
      for (int w = 0; w < Tr::kConsumerWarpgroups; ++w) {
        mbar_init(tc::smem_addr(&rec[w].full), 1);
        mbar_init(tc::smem_addr(&rec[w].empty), 1);
        rec[w].seq = 0;
        rec[w].taken = 0;
      }
    }
#endif
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
      if (Tr::dq_to_writer(args.dq_semaphores != nullptr) && n_iters > 0) {
        bwd_dq_writer<Tr>(
            &tm_dq, base + Tr::kDqOffset + (warp - 1) * Tr::kDqWgBytes,
            reinterpret_cast<const BwdDqHandoff*>(smem + Tr::kHandoffOffset) + warp - 1,
            args.dq_semaphores, warp - 1, lane, args.dq_pairs);
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
        constexpr int kStatPerLane = (kBlockM + 31) / 32;
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
          // (80-row tiles: the last round's upper lanes hold no row.)
          if (kBlockM % 32 != 0 && r >= kBlockM) break;
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
  // Warp-uniform in the compiler's view too, so that the shared-memory offsets and wgmma
  // descriptors derived from it stay on the uniform datapath instead of being computed per
  // thread and moved to uniform registers before every wgmma.
  const int cw = warp_uniform(warpgroup - 1);
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
    float dq[Tr::kDqAcc];
#pragma unroll
    for (int i = 0; i < kSCols / 2; ++i) {
      s[i] = 0.f;
      dp[i] = 0.f;
    }
#pragma unroll
    for (int i = 0; i < Tr::kDqAcc; ++i) dq[i] = 0.f;
    uint32_t p[kSCols / 16][4];
    uint32_t ds[kSCols / 16][4];
    // The factor of dS as f16 pairs (kPackedFactor only; otherwise it stays in s and this goes
    // unused).
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
      // kPackedFactor only dP^T's first half (queries 0-63) here; the second follows the P^T math.
      wgmma_fence();
      wgmma_ss_kmajor<kSCols, kD, Tr::kKVPanelBytes, Tr::kQPanelBytes, T>(s, k_desc, q_desc);
      wgmma_commit();
      if constexpr (Tr::kDoBarrier) {
        // dO may land after Q: S^T runs meanwhile.
        mbar_wait(bar_full_do(stage), (slot / kStages) & 1);
        wgmma_fence();
      }
      if constexpr (Tr::kPackedFactor) {
        wgmma_ss_kmajor<kSCols / 2, kD, Tr::kKVPanelBytes, Tr::kQPanelBytes, T>(acc_half<0>(dp),
                                                                                v_desc, do_desc);
      } else {
        wgmma_ss_kmajor<kSCols, kD, Tr::kKVPanelBytes, Tr::kQPanelBytes, T>(dp, v_desc, do_desc);
      }
      wgmma_commit();

      // kLseAhead: the pair's lse at this thread's query columns loaded now, under the wait.
      float2 lse_pre[Tr::kLseAhead > 0 ? Tr::kLseAhead : 1];
      if constexpr (Tr::kLseAhead > 0) load_pair_stats(lse_pre, stage_lse(stage) + q0, t);
      float2 delta_pre[Tr::kDeltaAhead > 0 ? Tr::kDeltaAhead : 1];
      if constexpr (Tr::kDeltaWithLse) load_pair_stats(delta_pre, stage_delta(stage), t);
      // Groups retire in order: with dP^T pending, S^T is done.
      wgmma_wait<1>();
      fence_operand(s);
      // P^T and dS^T on the unmasked path or, for a masked pair, with element masking (the two
      // are separate copies so that unmasked pairs pay nothing for the mask; kPackedFactor runs
      // one P^T pass for both and masks its packed results).
      if constexpr (Tr::kPackedFactor) {
        bwd_probs<Tr, false>(s, p, wh, stage_lse(stage) + q0, stage_qid(stage) + q0, hdr->mask,
                             false, kvid_s, key, q0, t, args);
        if (flags & kPairMasked) {
          bwd_mask_packed<Tr>(p, wh, stage_qid(stage) + q0, hdr->mask,
                              kMasked && (flags & kPairSegments) != 0, kvid_s, key, q0, t);
        }
      } else if (flags & kPairMasked) {
        bwd_probs<Tr, true, Tr::kLseAhead>(s, p, wh, stage_lse(stage) + q0, stage_qid(stage) + q0,
                                           hdr->mask, kMasked && (flags & kPairSegments) != 0,
                                           kvid_s, key, q0, t, args, lse_pre);
      } else {
        bwd_probs<Tr, false, Tr::kLseAhead>(s, p, wh, stage_lse(stage) + q0, stage_qid(stage) + q0,
                                            hdr->mask, false, kvid_s, key, q0, t, args, lse_pre);
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
        store_exchanged_tile<Tr>(p_tile, p, warp * 16, q0 / 8, lane, g, t);
        wgmma_wait<0>();
        fence_operand(dp);
        if (flags & kPairMasked) {
          bwd_dscores<Tr, true>(dp, s, wh, stage_delta(stage) + q0, t);
        } else {
          bwd_dscores<Tr, false>(dp, s, wh, stage_delta(stage) + q0, t);
        }
        convert_p<kSCols, T>(dp, ds);
        store_exchanged_tile<Tr>(ds_tile, ds, warp * 16, q0 / 8, lane, g, t);
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
        // dQ_i's half h (K panel h).
        const auto dq_gemm = [&](int h) {
#pragma unroll
          for (int k = 0; k < kBlockN / 16; ++k) {
            wgmma_ss_mn<Tr::kDqCols, true, T>(
                dq, desc_advance(ds_desc, k * 16 * Tr::kRowBytes),
                desc_advance(k_mn_desc, h * Tr::kKVPanelBytes + k * 16 * Tr::kRowBytes),
                k > 0 ? 1u : 0u);
          }
          wgmma_commit();
        };
        wgmma_fence();
        // kDqFirst: groups dQ_0, dV, dK (then dQ_1); otherwise one group dV + dK + dQ_0.
        if constexpr (Tr::kDqFirst) dq_gemm(0);
        wgmma_rs_mn<kDkCols, kSCols / 16, T>(dv, p, desc_advance(do_mn_desc, q0 * Tr::kRowBytes));
        wgmma_rs_mn<kDkCols, kSCols / 16, T>(dv, p_other,
                                             desc_advance(do_mn_desc, q_other * Tr::kRowBytes));
        if constexpr (Tr::kDqFirst) wgmma_commit();
        wgmma_rs_mn<kDkCols, kSCols / 16, T>(dk, ds, desc_advance(q_mn_desc, q0 * Tr::kRowBytes));
        wgmma_rs_mn<kDkCols, kSCols / 16, T>(dk, ds_other,
                                             desc_advance(q_mn_desc, q_other * Tr::kRowBytes));
        if constexpr (Tr::kDqFirst) wgmma_commit();
        // The header is read before the release lets the producer rewrite it.
        const int64_t dq_offset = hdr->dq_offset;
        const int rows = hdr->rows;
        const int m0 = hdr->m0;
        const int ctid = fresh_thread_index() - 128;
        // There is no shared memory left for a dQ staging buffer, but once this warpgroup's dV
        // (dK) is done, the panels of dO (Q) holding its columns are dead: the other warpgroup
        // reads only its own columns after the exchange barrier. dQ_i's first kDqCols columns
        // are staged in the Q panels, the next in the dO panels (kDqFirst: the other way round,
        // each as soon as the GEMM that read the panels is done), and the stage goes back to the
        // producer only once the writer warp's TMA reductions have read them. Packed tails add
        // from registers instead.
        const bool staged = (flags & kPairZeroRows) == 0;
        static_assert(Tr::kDqGemms == 2 && Tr::kDqCols == 2 * 32 && Tr::kQPanelBytes == 8192,
                      "each dQ GEMM fills the two panels of Q or dO that hold its columns");
#pragma unroll
        for (int h = 0; h < Tr::kDqGemms; ++h) {
          if constexpr (Tr::kDqFirst) {
            // h = 0: dQ_0 and dV are done, dK may run on. h = 1: everything.
            if (h == 1) {
              wgmma_fence();
              dq_gemm(1);
              wgmma_wait<0>();
            } else {
              wgmma_wait<1>();
            }
          } else {
            wgmma_fence();
            dq_gemm(h);
            wgmma_wait<0>();
          }
          fence_operand(dq);
          if (staged) {
            uint8_t* const panels = smem + (Tr::dq_half_in_q(h) ? Tr::kQOffset : Tr::kDoOffset) +
                                    stage * Tr::kQStageBytes + col_panel;
            stage_dq_boxes<Tr::kDqCols, Tr::kDqStsm>(panels, dq, ctid);
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
        // dS^T stores and the barrier below. With kPackedFactor dP^T's second half goes first;
        // kLateP issues dV after the dS^T stores (below), its P^T not yet converted here.
        // kDeltaAhead: the pair's delta loaded first, to arrive under the issue and the wait.
        if constexpr (Tr::kDeltaAhead > 0 && !Tr::kDeltaWithLse) {
          load_pair_stats(delta_pre, stage_delta(stage), t);
        }
        if constexpr (!Tr::kLateP) {
          wgmma_fence();
          if constexpr (Tr::kPackedFactor) {
            wgmma_ss_kmajor<kSCols / 2, kD, Tr::kKVPanelBytes, Tr::kQPanelBytes, T>(
                acc_half<1>(dp), v_desc, desc_advance(do_desc, kSCols / 2 * Tr::kRowBytes));
            wgmma_commit();
          }
          wgmma_rs_mn<kDkCols, kBlockM / 16, T>(dv, p, do_mn_desc);
          wgmma_commit();
        }

        if constexpr (Tr::kPackedFactor) {
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
          // Leaving one group pending means dP^T is done while dV may still run (kLateP: dP^T is
          // the only group in flight).
          wgmma_wait<Tr::kLateP ? 0 : 1>();
          fence_operand(dp);
          constexpr int kI = kSCols / 8;
          if (flags & kPairMasked) {
            bwd_dscores<Tr, true, 0, kI, Tr::kDeltaAhead>(dp, s, wh, stage_delta(stage), t,
                                                          delta_pre);
          } else {
            bwd_dscores<Tr, false, 0, kI, Tr::kDeltaAhead>(dp, s, wh, stage_delta(stage), t,
                                                           delta_pre);
          }
        }
        if constexpr (Tr::kLateP) convert_p<kBlockM, T>(s, p);
        convert_p<kBlockM, T>(dp, ds);

        // dS^T to shared memory: key row kr of the 128-key tile, query pair (8i + 2t, +1) in
        // chunk i % 8 of the row in panel i / 8, swizzled to chunk (i % 8) ^ (kr % 8) =
        // (i % 8) ^ g. With 128-query tiles the thread's position is re-read (volatile) so that
        // the eight swizzled chunk offsets are computed here, not kept live across the loop.
        if constexpr (Tr::kDqT) {
          // kDqT: dS, K-major, for the dQ^T GEMM (store_ds_kmajor).
          store_ds_kmajor<Tr>(ds_tile, ds, key_row0 + warp * 16, lane);
        } else {
          const int sid = Tr::kPair128 ? fresh_thread_index() - 128 : 0;
          const int srow = Tr::kPair128 ? sid / 32 * 16 : key_row0 + warp * 16;
          const int sg = Tr::kPair128 ? sid % 32 / 4 : g;
          const int st = Tr::kPair128 ? sid % 4 : t;
          store_exchanged_tile<Tr>(ds_tile, ds, srow, 0, Tr::kPair128 ? sid % 32 : lane, sg, st);
        }
        if constexpr (Tr::kLateP) {
          // dV += P^T dO now that P^T is 16-bit: it runs under the barrier and the dQ GEMM's
          // issue, and is the first of the three groups the waits below count.
          wgmma_fence();
          wgmma_rs_mn<kDkCols, kBlockM / 16, T>(dv, p, do_mn_desc);
          wgmma_commit();
        }
        fence_proxy_async_smem();
        named_barrier_sync(kBwdBarConsumers, 128 * Tr::kConsumerWarpgroups);

        // dQ_i (the warpgroup's 64 queries x kDqCols head-dim columns) = dS K over the 128 keys:
        // A = dS^T read as MN-major dS (with kDqSplitRows the panel of its queries), B = K
        // MN-major; both advance 16 key rows per wgmma. Then dK += dS^T Q (Q as the MN-major B
        // operand, over all the tile's queries), which runs while dQ_i leaves.
        wgmma_fence();
        if constexpr (Tr::kDqT) {
          // dQ^T = K^T dS^T: A = this warpgroup's panel of K read MN-major (16 key rows a step),
          // B = dS K-major (32 bytes into a 128-byte row a step, then the next 64-key panel).
          const uint64_t dsk_desc = smem_desc_sw128(ds_smem + buf * Tr::kDsBytes, 16);
#pragma unroll
          for (int k = 0; k < kBlockN / 16; ++k) {
            wgmma_ss_mn<kBlockM, false, T>(
                dq, desc_advance(k_mn_desc, k * 16 * Tr::kRowBytes),
                desc_advance(dsk_desc, (k / 4) * Tr::kDsPanelBytes + (k % 4) * 32),
                k > 0 ? 1u : 0u);
          }
        } else {
#pragma unroll
          for (int k = 0; k < kBlockN / 16; ++k) {
            wgmma_ss_mn<Tr::kDqCols, true, T>(dq, desc_advance(ds_desc, k * 16 * Tr::kRowBytes),
                                              desc_advance(k_mn_desc, k * 16 * Tr::kRowBytes),
                                              k > 0 ? 1u : 0u);
          }
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
        const bool to_writer = Tr::dq_to_writer(in_order);
        if ((flags & kPairZeroRows) == 0) {
          // Staged for a TMA reduction. Rows past a dense sequence are clipped by the map; a
          // packed tile's rows past its sequence take the path below.
          uint8_t* const stage_dq = smem + Tr::kDqOffset + (ctid / 128) * Tr::kDqWgBytes;
          // In order, the writer warp reduces the buffer; it must have read the previous tile.
          // Otherwise each warp's lane 0 issued the reductions and waits for them here.
          static_assert(Tr::kWarpDq);
          if (to_writer) {
            named_barrier_sync(kBwdBarDqFreeBase + ctid / 128, kBwdDqHandoffThreads);
          } else {
            // The warp's rows of the buffer were read by its previous reduction.
            if (ctid % 32 == 0) tma_wait_read();
            __syncwarp();
          }
          if constexpr (Tr::kDqT) {
            uint8_t* const box = stage_dq + (ctid % 128) / 32 * Tr::kDqBoxBytes;
            if (Tr::kDqPairs && args.dq_pairs) {
              stage_dq_box_pairs<kBlockM>(box, dq, ctid % 32);
            } else {
              stage_dq_box_t<kBlockM>(box, dq, ctid % 32);
            }
          } else {
            stage_dq_boxes<Tr::kDqCols, Tr::kDqStsm>(stage_dq, dq, ctid);
          }
          fence_proxy_async_smem();
          if (to_writer) {
            // The arrival orders the staging (and thread 0's record) before the writer's reads.
            if (ctid % 128 == 0) {
              BwdDqHandoff* const h =
                  reinterpret_cast<BwdDqHandoff*>(smem + Tr::kHandoffOffset) + ctid / 128;
              const BwdDqRow at = bwd_dq_row(*cta_tile, packed_layout, runs_tile,
                                             args.layout.seqlen_q, m0 + Tr::dq_row0(ctid / 128));
              dq_record_claim(h);
              // (The turn's counter and ticket only in the deterministic order.)
              if (in_order) h->sem = dq_offset / kD * kDqCounters + ctid / 128;
              h->row = at.row;
              h->batch = at.batch;
              h->head = head;
              if (in_order) h->ticket = dq_ticket(cta_tile->mask, m0, rows, cta_tile->n0, kBlockN);
              h->end = 0;
              dq_record_publish(h);
            }
            named_barrier_arrive(kBwdBarDqStagedBase + ctid / 128, kBwdDqHandoffThreads);
          } else {
            // The warp's 16 rows, staged by its own lanes: a warp barrier orders them (and their
            // proxy fences) before lane 0's reductions.
            __syncwarp();
            if (ctid % 32 == 0) {
              const BwdDqRow at = bwd_dq_row(*cta_tile, packed_layout, runs_tile,
                                             args.layout.seqlen_q, m0 + Tr::dq_row0(ctid / 128));
              if constexpr (Tr::kDqT) {
                // The warp's own box: its 16 head-dim columns of every query row.
                const int w = ctid % 128 / 32;
                dq_reduce_boxes_t<Tr, 1>(&tm_dq, tc::smem_addr(stage_dq) + w * Tr::kDqBoxBytes,
                                         Tr::dq_col0(ctid / 128) + Tr::kDqBoxCols * w, head, at,
                                         args.dq_pairs);
              } else {
                dq_reduce_boxes<Tr::kDqBoxes, Tr::kDqBoxRows, 1>(&tm_dq, tc::smem_addr(stage_dq),
                                                                 Tr::dq_col0(ctid / 128), head, at,
                                                                 ctid % 128 / 32);
              }
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
    if (Tr::dq_to_writer(args.dq_semaphores != nullptr)) {
      const int etid = fresh_thread_index() - 128;
      named_barrier_sync(kBwdBarDqFreeBase + etid / 128, kBwdDqHandoffThreads);
      if (etid % 128 == 0) {
        BwdDqHandoff* const h =
            reinterpret_cast<BwdDqHandoff*>(smem + Tr::kHandoffOffset) + etid / 128;
        dq_record_claim(h);
        h->end = 1;
        dq_record_publish(h);
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
