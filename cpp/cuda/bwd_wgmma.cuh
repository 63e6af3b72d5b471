// FlashAttention backward for Hopper (sm_90a) on warpgroup MMA, after the FlashAttention-3
// paper's backward. One CTA per (128-key tile, kv head, batch):
// K_j and V_j are loaded once by TMA; a producer warp streams Q_i, dO_i (TMA) and lse_i, delta_i
// (plain loads) of every query tile of every query head of the GQA group through a two-stage
// ring guarded by mbarriers; two consumer warpgroups, each owning 64 of the 128 keys, compute
//   S^T = K Q^T, dP^T = V dO^T                      (wgmma, both operands from shared memory)
//   P^T = 2^(S^T scale log2e - lse log2e), dS^T = P^T (dP^T - delta)       (registers)
//   dV += P^T dO, dK += dS^T Q                      (wgmma, P^T / dS^T as the register operand)
//   dQ_i += dS K                                    (wgmma, dS^T staged in shared memory)
// and reduce dQ_i into the fp32 dq_accum with vector atomics. Head_dim 128 and 64; every step of
// one query tile runs in order inside a warpgroup (no intra-warpgroup overlap of the elementwise
// work with the GEMMs yet), so the two warpgroups overlap each other only loosely. Working on the
// transposed products keeps the key axis on the accumulator rows, so dK and dV stay in registers
// across the whole loop and P^T, dS^T are already in the register-operand layout of the dV/dK
// GEMMs.
//
// Shared-memory tiles use the forward's 128-byte-swizzled panel layout (cuda/fwd_wgmma.cuh,
// whose PTX wrappers, descriptors and barrier helpers this file reuses).
#pragma once

#include "cuda/fwd_wgmma.cuh"

namespace jax_flash::cuda::sm90 {

struct BwdWgmmaArgs {
  const float* lse;    // [batch, heads_q, seqlen_q], natural log
  const float* delta;  // [batch, heads_q, seqlen_q]
  float* dq_accum;     // [batch, seqlen_q, heads_q, D], unscaled dS K sums
  void* dk;            // [batch, seqlen_k, heads_kv, D]
  void* dv;
  int seqlen_q;
  int seqlen_k;
  int heads_q;
  int heads_kv;
  int group;          // heads_q / heads_kv
  int n_blocks;       // ceil(seqlen_k / kBlockN)
  int m_blocks;       // ceil(seqlen_q / kBlockM)
  int causal_offset;  // seqlen_k - seqlen_q: query i sees key j iff j <= i + causal_offset
  float scale;
  float scale_log2;
};

template <typename T, int kHeadDim, bool kCausal>
struct BwdWgmmaTraits {
  using Element = T;
  static constexpr int kD = kHeadDim;
  static constexpr bool kIsCausal = kCausal;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kThreads = 128 * (kConsumerWarpgroups + 1);
  // Keys per CTA (64 per consumer warpgroup: the M extent of one wgmma) and queries per tile.
  static constexpr int kBlockN = 64 * kConsumerWarpgroups;
  static constexpr int kBlockM = 64;
  static constexpr int kStages = 2;
  // dQ_i = dS K. With head_dim 128 the two warpgroups split the head dimension (64 columns each)
  // and reduce over all 128 keys, so each needs the other's dS^T rows. With head_dim 64 a
  // 32-column split would need sub-panel descriptors, so each warpgroup instead reduces over its
  // own 64 keys into all 64 columns and both add their partial sums to dq_accum.
  static constexpr bool kDqSplitD = kD == 64 * kConsumerWarpgroups;
  static constexpr int kDqKeys = kDqSplitD ? kBlockN : 64;
  static constexpr int kDqColBase = 64;  // columns of dQ per warpgroup when split

  // Consumers hold dK and dV (kD / 2 registers each), S^T and dP^T (kBlockM / 2 each), dQ
  // (kBlockM / 2) and the 16-bit P^T, dS^T (kBlockM / 4 each).
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;

  static constexpr int kPanelCols = 64;
  static constexpr int kPanels = kD / kPanelCols;
  static constexpr int kRowBytes = 128;
  static constexpr int kKVPanelBytes = kBlockN * kRowBytes;
  static constexpr int kKVBytes = kKVPanelBytes * kPanels;
  static constexpr int kQPanelBytes = kBlockM * kRowBytes;
  static constexpr int kQStageBytes = kQPanelBytes * kPanels;
  // dS^T of one query tile: kBlockN key rows of kBlockM queries (one 128-byte panel).
  static constexpr int kDsBytes = kBlockN * kRowBytes;
  // lse * log2(e) then delta, kBlockM floats each, per stage.
  static constexpr int kRowStatBytes = 2 * kBlockM * 4;

  static constexpr int kKOffset = 0;
  static constexpr int kVOffset = kKOffset + kKVBytes;
  static constexpr int kQOffset = kVOffset + kKVBytes;
  static constexpr int kDoOffset = kQOffset + kStages * kQStageBytes;
  static constexpr int kDsOffset = kDoOffset + kStages * kQStageBytes;
  static constexpr int kStatOffset = kDsOffset + 2 * kDsBytes;
  static constexpr int kBarOffset = kStatOffset + kStages * kRowStatBytes;
  // mbarriers: K/V full, then full and empty per stage.
  static constexpr int kNumBarriers = 1 + 2 * kStages;
  static constexpr int kSmemBytes = kBarOffset + 8 * kNumBarriers + 1024;

  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>);
  static_assert(kD == 64 || kD == 128, "head_dim 64 and 128 only");
  static_assert(kBlockM * 2 == kRowBytes, "dS^T rows must be exactly one swizzle span");
  static_assert(kKVPanelBytes % 1024 == 0 && kQPanelBytes % 1024 == 0 && kDsBytes % 1024 == 0);
  static_assert(kSmemBytes <= 227 * 1024);
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumerWarpgroups <= 65536);
};

// Named barriers (id 0 is __syncthreads): dS^T written, for both consumer warpgroups together
// (head_dim 128) or for each alone (head_dim 64, ids 2 and 3).
inline constexpr int kBwdBarDs = 1;
inline constexpr int kBwdBarDsOwnBase = 2;

// Causal: the first query row that sees key n0 is n0 - causal_offset; query tiles before it are
// skipped. Returns m_blocks when no query row sees the tile.
template <bool kCausal, int kBlockM>
__device__ __forceinline__ int bwd_first_m_block(const BwdWgmmaArgs& args, int n0) {
  if constexpr (kCausal) {
    const int first_row = n0 - args.causal_offset;
    if (first_row >= args.seqlen_q) return args.m_blocks;
    if (first_row > 0) return first_row / kBlockM;
  }
  return 0;
}

#if JAX_FLASH_SM90A

// dQ = dS K: A = dS (M = queries) and B = K (N = head_dim) are both MN-major in shared memory
// (imm-trans-a = imm-trans-b = 1), m64n64k16.
#define BW_F8(i)                                                                            \
  "+f"(d[(i) + 0]), "+f"(d[(i) + 1]), "+f"(d[(i) + 2]), "+f"(d[(i) + 3]), "+f"(d[(i) + 4]), \
      "+f"(d[(i) + 5]), "+f"(d[(i) + 6]), "+f"(d[(i) + 7])
#define BW_WGMMA_TT64(TY)                                                                        \
  asm volatile(                                                                                  \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                               \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY                                    \
      " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "  \
      "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 1, " \
      "1;\n}\n"                                                                                  \
      : BW_F8(0), BW_F8(8), BW_F8(16), BW_F8(24)                                                 \
      : "l"(desc_a), "l"(desc_b), "r"(scale_d))

template <typename T>
__device__ __forceinline__ void wgmma_ss_n64_trans(float (&d)[32], uint64_t desc_a, uint64_t desc_b,
                                                   uint32_t scale_d) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    BW_WGMMA_TT64("bf16");
  } else {
    BW_WGMMA_TT64("f16");
  }
}

#undef BW_WGMMA_TT64
#undef BW_F8

#endif  // JAX_FLASH_SM90A

// Warpgroup 0 is the producer (only its warp 0 works), warpgroups 1 and 2 the consumers.
// blockIdx.x enumerates the key tiles of one (batch, kv head) fastest, so that CTAs running
// together read the same Q, dO and dq_accum rows from L2.
template <class Tr>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    bwd_wgmma_kernel(const BwdWgmmaArgs args, const __grid_constant__ CUtensorMap tm_q,
                     const __grid_constant__ CUtensorMap tm_k,
                     const __grid_constant__ CUtensorMap tm_v,
                     const __grid_constant__ CUtensorMap tm_do) {
#if JAX_FLASH_SM90A
  using T = typename Tr::Element;
  constexpr bool kCausal = Tr::kIsCausal;
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
  float* const stats = reinterpret_cast<float*>(smem + Tr::kStatOffset);
  const uint32_t bar_kv = base + Tr::kBarOffset;
  const auto bar_full = [&](int stage) { return bar_kv + 8u * (1 + stage); };
  const auto bar_empty = [&](int stage) { return bar_kv + 8u * (1 + kStages + stage); };

  const int n_block = static_cast<int>(blockIdx.x) % args.n_blocks;
  const int bh = static_cast<int>(blockIdx.x) / args.n_blocks;
  const int head_kv = bh % args.heads_kv;
  const int batch = bh / args.heads_kv;
  const int n0 = n_block * kBlockN;
  const int m_begin = bwd_first_m_block<kCausal, kBlockM>(args, n0);
  const int num_m = args.m_blocks - m_begin;
  const int n_iters = num_m * args.group;
  // Iteration it visits query head head_kv * group + it / num_m, query tile m_begin + it % num_m.
  const auto iter_head = [&](int it) { return head_kv * args.group + it / num_m; };
  const auto iter_m0 = [&](int it) { return (m_begin + it % num_m) * kBlockM; };

  if (threadIdx.x == 0) {
    mbar_init(bar_kv, 1);
    for (int s = 0; s < kStages; ++s) {
      // The 32 lanes of the producer warp arrive after writing lse / delta; lane 0's arrival
      // also carries the TMA byte count.
      mbar_init(bar_full(s), 32);
      // Released by every consumer thread once its GEMMs and its own lse / delta reads are done
      // with the stage: each thread's arrival orders its own shared-memory reads before the
      // producer's next writes of that stage (one arrival per warp would not cover the reads of
      // the other 31 lanes).
      mbar_init(bar_empty(s), 128 * Tr::kConsumerWarpgroups);
    }
    fence_barrier_init();
  }
  __syncthreads();

  const int warpgroup = static_cast<int>(threadIdx.x) / 128;
  const int tid = static_cast<int>(threadIdx.x) % 128;
  const int warp = tid / 32;
  const int lane = tid % 32;

  if (warpgroup == 0) {
    // ------------------------------------------------------------------ producer
    setmaxnreg_dec<Tr::kProducerRegs>();
    if (warp != 0 || n_iters <= 0) return;
    if (lane == 0) {
      prefetch_tensormap(&tm_q);
      prefetch_tensormap(&tm_k);
      prefetch_tensormap(&tm_v);
      prefetch_tensormap(&tm_do);
      mbar_arrive_expect_tx(bar_kv, 2 * Tr::kKVBytes);
#pragma unroll
      for (int p = 0; p < Tr::kPanels; ++p) {
        tma_load_4d(k_smem + p * Tr::kKVPanelBytes, &tm_k, bar_kv, p * Tr::kPanelCols, head_kv, n0,
                    batch);
        tma_load_4d(v_smem + p * Tr::kKVPanelBytes, &tm_v, bar_kv, p * Tr::kPanelCols, head_kv, n0,
                    batch);
      }
    }
    for (int it = 0; it < n_iters; ++it) {
      const int stage = it % kStages;
      const int head = iter_head(it);
      const int m0 = iter_m0(it);
      if (it >= kStages) mbar_wait(bar_empty(stage), ((it / kStages) + 1) & 1);
      // Rows past seqlen_q and rows that saw no key (lse = -inf) get +inf, which makes
      // P = 2^(s - inf) = 0 exactly; their delta is 0.
      float* const lse_s = stats + stage * 2 * kBlockM;
      const int64_t stat_row = (static_cast<int64_t>(batch) * args.heads_q + head) * args.seqlen_q;
      for (int r = lane; r < kBlockM; r += 32) {
        float lse2 = CUDART_INF_F;
        float dlt = 0.f;
        if (m0 + r < args.seqlen_q) {
          const float l = args.lse[stat_row + m0 + r];
          if (l != -CUDART_INF_F) {
            lse2 = l * kLog2e;
            dlt = args.delta[stat_row + m0 + r];
          }
        }
        lse_s[r] = lse2;
        lse_s[kBlockM + r] = dlt;
      }
      if (lane == 0) {
        mbar_arrive_expect_tx(bar_full(stage), 2 * Tr::kQStageBytes);
#pragma unroll
        for (int p = 0; p < Tr::kPanels; ++p) {
          tma_load_4d(q_smem + stage * Tr::kQStageBytes + p * Tr::kQPanelBytes, &tm_q,
                      bar_full(stage), p * Tr::kPanelCols, head, m0, batch);
          tma_load_4d(do_smem + stage * Tr::kQStageBytes + p * Tr::kQPanelBytes, &tm_do,
                      bar_full(stage), p * Tr::kPanelCols, head, m0, batch);
        }
      } else {
        mbar_arrive(bar_full(stage));
      }
    }
    return;
  }

  // -------------------------------------------------------------------- consumers
  setmaxnreg_inc<Tr::kConsumerRegs>();
  const int cw = warpgroup - 1;
  const int g = lane / 4;
  const int t = lane % 4;
  // Key of accumulator rows r = 0 (and r = 1 at +8) of this thread.
  const int key = n0 + cw * 64 + warp * 16 + g;

  float dk[kD / 2];
  float dv[kD / 2];
#pragma unroll
  for (int i = 0; i < kD / 2; ++i) {
    dk[i] = 0.f;
    dv[i] = 0.f;
  }

  if (n_iters > 0) {
    float s[kBlockM / 2];
    float dp[kBlockM / 2];
    float dq[kBlockM / 2];
#pragma unroll
    for (int i = 0; i < kBlockM / 2; ++i) {
      s[i] = 0.f;
      dp[i] = 0.f;
      dq[i] = 0.f;
    }
    uint32_t p[kBlockM / 16][4];
    uint32_t ds[kBlockM / 16][4];

    // A operands of S^T and dP^T: this warpgroup's 64 rows of K and V, K-major.
    const uint64_t k_desc = smem_desc_sw128(k_smem + cw * 64 * Tr::kRowBytes, 16);
    const uint64_t v_desc = smem_desc_sw128(v_smem + cw * 64 * Tr::kRowBytes, 16);
    // B operand of dQ, MN-major: head-dim panel cw of K (this warpgroup's 64 dQ columns) or,
    // with head_dim 64, this warpgroup's 64 key rows of the single panel.
    const uint64_t k_mn_desc =
        Tr::kDqSplitD ? smem_desc_sw128(k_smem + cw * Tr::kKVPanelBytes, Tr::kKVPanelBytes)
                      : smem_desc_sw128(k_smem + cw * 64 * Tr::kRowBytes, Tr::kKVPanelBytes);

    mbar_wait(bar_kv, 0);

    for (int it = 0; it < n_iters; ++it) {
      const int stage = it % kStages;
      const int head = iter_head(it);
      const int m0 = iter_m0(it);
      const uint32_t q_stage = q_smem + stage * Tr::kQStageBytes;
      const uint32_t do_stage = do_smem + stage * Tr::kQStageBytes;
      const uint64_t q_desc = smem_desc_sw128(q_stage, 16);
      const uint64_t do_desc = smem_desc_sw128(do_stage, 16);
      const uint64_t q_mn_desc = smem_desc_sw128(q_stage, Tr::kQPanelBytes);
      const uint64_t do_mn_desc = smem_desc_sw128(do_stage, Tr::kQPanelBytes);
      const float* const lse_s = stats + stage * 2 * kBlockM;
      const float* const delta_s = lse_s + kBlockM;

      mbar_wait(bar_full(stage), (it / kStages) & 1);

      // S^T = K Q^T and dP^T = V dO^T over the head dimension, 16 columns per wgmma.
      wgmma_fence();
      wgmma_ss_kmajor<kBlockM, kD, Tr::kKVPanelBytes, Tr::kQPanelBytes, T>(s, k_desc, q_desc);
      wgmma_commit();
      wgmma_ss_kmajor<kBlockM, kD, Tr::kKVPanelBytes, Tr::kQPanelBytes, T>(dp, v_desc, do_desc);
      wgmma_commit();

      // P^T: accumulator element 4i + 2r + e is (key row g + 8r, query column 8i + 2t + e).
      wgmma_wait<1>();
      fence_operand(s);
      const bool need_mask =
          n0 + kBlockN > args.seqlen_k || (kCausal && n0 + kBlockN - 1 > m0 + args.causal_offset);
#pragma unroll
      for (int i = 0; i < kBlockM / 8; ++i) {
        const float2 l2 = *reinterpret_cast<const float2*>(lse_s + 8 * i + 2 * t);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float& s0 = s[4 * i + 2 * r];
          float& s1 = s[4 * i + 2 * r + 1];
          s0 = tc::fast_exp2(fmaf(s0, args.scale_log2, -l2.x));
          s1 = tc::fast_exp2(fmaf(s1, args.scale_log2, -l2.y));
          if (need_mask) {
            const int kr = key + 8 * r;
            const int q = m0 + 8 * i + 2 * t;
            const bool key_ok = kr < args.seqlen_k;
            if (!key_ok || (kCausal && kr > q + args.causal_offset)) s0 = 0.f;
            if (!key_ok || (kCausal && kr > q + 1 + args.causal_offset)) s1 = 0.f;
          }
        }
      }
      convert_p<kBlockM, T>(s, p);

      // dV += P^T dO over the tile's queries, 16 per wgmma, with dO as the MN-major B operand
      // (head_dim contiguous, as V in the forward's O += P V); it runs under the dS math below.
      wgmma_fence();
      wgmma_rs_mn<kD, kBlockM / 16, T>(dv, p, do_mn_desc);
      wgmma_commit();

      // dS^T = P^T (dP^T - delta), delta broadcast along the key rows. Groups retire in order:
      // leaving one pending means S^T and dP^T are done while dV may still run.
      wgmma_wait<1>();
      fence_operand(dp);
#pragma unroll
      for (int i = 0; i < kBlockM / 8; ++i) {
        const float2 dl = *reinterpret_cast<const float2*>(delta_s + 8 * i + 2 * t);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          dp[4 * i + 2 * r] = s[4 * i + 2 * r] * (dp[4 * i + 2 * r] - dl.x);
          dp[4 * i + 2 * r + 1] = s[4 * i + 2 * r + 1] * (dp[4 * i + 2 * r + 1] - dl.y);
        }
      }
      convert_p<kBlockM, T>(dp, ds);

      // dK += dS^T Q, Q as the MN-major B operand.
      wgmma_fence();
      wgmma_rs_mn<kD, kBlockM / 16, T>(dk, ds, q_mn_desc);
      wgmma_commit();

      // dS^T to shared memory: key row kr of the 128-key tile, query pair (8i + 2t, +1) in chunk i
      // of the row, swizzled to chunk i ^ (kr % 8) = i ^ g. Two buffers alternate: a warpgroup
      // can only reach iteration it + 2 (which rewrites buffer it % 2) after both passed the
      // barrier of it + 1, i.e. after both waited for their dQ GEMM of iteration it.
      const int buf = it & 1;
      uint8_t* const ds_tile = smem + Tr::kDsOffset + buf * Tr::kDsBytes;
#pragma unroll
      for (int i = 0; i < kBlockM / 8; ++i) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int kr = cw * 64 + warp * 16 + g + 8 * r;
          const uint32_t packed = tc::pack2<T>(dp[4 * i + 2 * r], dp[4 * i + 2 * r + 1]);
          *reinterpret_cast<uint32_t*>(ds_tile + kr * Tr::kRowBytes + ((i ^ g) * 16) + t * 4) =
              packed;
        }
      }
      fence_proxy_async_smem();
      if constexpr (Tr::kDqSplitD) {
        named_barrier_sync(kBwdBarDs, 128 * Tr::kConsumerWarpgroups);
      } else if (cw == 0) {
        named_barrier_sync(kBwdBarDsOwnBase, 128);
      } else {
        named_barrier_sync(kBwdBarDsOwnBase + 1, 128);
      }

      // dQ_i (64 queries x 64 head-dim columns) = dS K over kDqKeys keys: A = dS^T read as
      // MN-major dS, B = K MN-major; both advance 16 key rows per wgmma.
      const uint64_t ds_desc = smem_desc_sw128(
          ds_smem + buf * Tr::kDsBytes + (Tr::kDqSplitD ? 0 : cw * 64 * Tr::kRowBytes),
          static_cast<uint32_t>(Tr::kDsBytes));
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < Tr::kDqKeys / 16; ++k) {
        wgmma_ss_n64_trans<T>(dq, desc_advance(ds_desc, k * 16 * Tr::kRowBytes),
                              desc_advance(k_mn_desc, k * 16 * Tr::kRowBytes), k > 0 ? 1u : 0u);
      }
      wgmma_commit();
      wgmma_wait<0>();
      fence_operand(dq);
      fence_operand(dk);
      fence_operand(dv);
      fence_operand(p);
      fence_operand(ds);
      mbar_arrive(bar_empty(stage));

      // dq accumulator element 4i + 2r + e is (query row 16 warp + g + 8r, head-dim column
      // 64 cw + 8i + 2t + e when split, else 8i + 2t + e).
      float* const dq_head = args.dq_accum + static_cast<int64_t>(head) * kD +
                             (Tr::kDqSplitD ? cw * Tr::kDqColBase : 0) + 2 * t;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int q = m0 + warp * 16 + g + 8 * r;
        if (q < args.seqlen_q) {
          float* const dq_row = dq_head + (static_cast<int64_t>(batch) * args.seqlen_q + q) *
                                              args.heads_q * int64_t{kD};
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            tc::red_add_f32x2(dq_row + 8 * i, dq[4 * i + 2 * r], dq[4 * i + 2 * r + 1]);
          }
        }
      }
    }
  }

  // Epilogue: dK = scale * dS^T Q, dV, element 4i + 2r + e at (key row g + 8r, column 8i + 2t + e).
  // A CTA with no visible query still writes its zeros.
  T* const dk_out = static_cast<T*>(args.dk);
  T* const dv_out = static_cast<T*>(args.dv);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int kr = key + 8 * r;
    if (kr >= args.seqlen_k) continue;
    const int64_t off =
        ((static_cast<int64_t>(batch) * args.seqlen_k + kr) * args.heads_kv + head_kv) * kD + 2 * t;
#pragma unroll
    for (int i = 0; i < kD / 8; ++i) {
      *reinterpret_cast<uint32_t*>(dk_out + off + 8 * i) =
          tc::pack2<T>(dk[4 * i + 2 * r] * args.scale, dk[4 * i + 2 * r + 1] * args.scale);
      *reinterpret_cast<uint32_t*>(dv_out + off + 8 * i) =
          tc::pack2<T>(dv[4 * i + 2 * r], dv[4 * i + 2 * r + 1]);
    }
  }
#endif  // JAX_FLASH_SM90A
}

}  // namespace jax_flash::cuda::sm90
