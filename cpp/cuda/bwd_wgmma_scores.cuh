// The wgmma backward's element-wise work (bwd_wgmma.cuh): P^T and dS^T from the S^T and dP^T
// accumulators with their masks, and the 16-bit operand tiles of P^T / dS^T in shared memory.
#pragma once

#include "cuda/bwd_wgmma_traits.cuh"

namespace jax_flash::cuda::sm90 {

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

// A pair's lse or delta at a thread's query columns 8i + 2t and 8i + 2t + 1 of the stage's row `s`.
__device__ __forceinline__ float2 pair_stat(const float* s, int i, int t) {
  return *reinterpret_cast<const float2*>(s + 8 * i + 2 * t);
}
// The same for i < kN, loaded into registers ahead of their use (kLseAhead / kDeltaAhead), before
// a GEMM wait.
template <int kN>
__device__ __forceinline__ void load_pair_stats(float2 (&v)[kN], const float* s, int t) {
#pragma unroll
  for (int i = 0; i < kN; ++i) v[i] = pair_stat(s, i, t);
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

// kPackedFactor's element masking as two bit masks, one per accumulator row r of the thread (key
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

// kPackedFactor's element masking, applied to the 16-bit P^T (p) and the f16 factor of dS (wh) once
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
// P (1 - t^2) with soft-capping (kPackedFactor: wh holds it as f16 pairs in p's layout, and s is
// dead), and p the 16-bit P packed as it is computed into the register fragments of the dV GEMM
// (k16 step i / 2, register 2 (i % 2) + r: the layout convert_p produces; kLateP leaves p to a
// later convert_p of s, which then holds P). With kMask, elements the TileMask
// (or, with `seg`, the segment ids) hides are selected to 0, never multiplied, so a NaN there
// cannot leak.
// kPre: the first kPre lse pairs were loaded ahead (lse_pre[i] = lse_s[8i + 2t], [8i + 2t + 1];
// BwdWgmmaTraits::kLseAhead, load_pair_stats).
template <class Tr, bool kMask, int kPre = 0>
__device__ __forceinline__ void bwd_probs(float (&s)[Tr::kSCols / 2],
                                          uint32_t (&p)[Tr::kSCols / 16][4],
                                          uint32_t (&wh)[Tr::kSCols / 16][4], const float* lse_s,
                                          const int* qid_s, const TileMask tm, bool seg,
                                          const int* kvid_s, int key, int q0, int t,
                                          const BwdWgmmaArgs& args,
                                          const float2* lse_pre = nullptr) {
  using T = typename Tr::Element;
  static_assert(!(kMask && Tr::kPackedFactor), "kPackedFactor masks afterwards (bwd_mask_packed)");
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
    const float2 l2 = i < kPre ? lse_pre[i] : pair_stat(lse_s, i, t);
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
      if constexpr (Tr::kPackedFactor) {
        wh[i / 2][2 * (i % 2) + r] = tc::pack2<__half>(w0, w1);
      } else {
        s[4 * i + 2 * r] = w0;
        s[4 * i + 2 * r + 1] = w1;
      }
      if constexpr (!Tr::kLateP) p[i / 2][2 * (i % 2) + r] = tc::pack2<T>(p0, p1);
    }
  }
}

// dS^T = P^T (dP^T - delta) in place of dP^T, delta broadcast along the key rows, with w (the
// factor bwd_probs left in s, or with kPackedFactor in wh) for P^T. With kMask every masked element
// has w = 0 and is selected to 0, since dP^T there may come from a neighbour's V rows; a visible
// element whose P underflowed to 0 gets 0 either way.
// kPre: the first kPre delta pairs were loaded ahead, as bwd_probs's lse (kDeltaAhead).
template <class Tr, bool kMask, int kI0 = 0, int kI1 = Tr::kSCols / 8, int kPre = 0>
__device__ __forceinline__ void bwd_dscores(float (&dp)[Tr::kSCols / 2],
                                            const float (&w)[Tr::kSCols / 2],
                                            const uint32_t (&wh)[Tr::kSCols / 16][4],
                                            const float* delta_s, int t,
                                            const float2* delta_pre = nullptr) {
#pragma unroll
  for (int i = kI0; i < kI1; ++i) {
    const float2 dl = i < kPre ? delta_pre[i] : pair_stat(delta_s, i, t);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float w0, w1;
      if constexpr (Tr::kPackedFactor) {
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

// The same tile written with stmatrix (JAX_FLASH_BWD_DS_STSM): k16 step j's four registers are the
// four 8x8 matrices of one stmatrix.x4, in the order store_operand_tile writes them (keys row0 +
// 0..7 / 8..15 at chunk chunk0 + 2j, then the same at chunk0 + 2j + 1), and lane 8m + r addresses
// row r of matrix m. row0 is a multiple of 8, so a row's place in its 8-row group, which swizzles
// its chunks, is r = lane % 8; chunk0 is even, so chunk (c + h) ^ r of an even c is
// (c ^ (r & 6)) + ((h ^ r) & 1): the lane's odd part is added once, the step's even part is one
// XOR with a lane constant.
template <int kPanels, int kPanelBytes, int kSteps>
__device__ __forceinline__ void store_operand_tile_stsm(uint8_t* tile,
                                                        const uint32_t (&f)[kSteps][4], int row0,
                                                        int chunk0, int lane) {
  const int m = lane >> 3;
  const int sw = lane & 7;
  const uint32_t row =
      tc::smem_addr(tile) + (row0 + (m & 1) * 8 + sw) * 128 + ((((m >> 1) ^ sw) & 1) << 4);
#pragma unroll
  for (int j = 0; j < kSteps; ++j) {
    const int c = chunk0 + 2 * j;
    const int panel = kPanels > 1 ? c / 8 : 0;
    const int chunk = kPanels > 1 ? c % 8 : c;
    tc::stmatrix_x4(row + panel * kPanelBytes + ((chunk ^ (sw & 6)) << 4), f[j][0], f[j][1],
                    f[j][2], f[j][3]);
  }
}

// An exchanged tile (dS^T, or P^T between split-query warpgroups) with the stores Tr::kDsStsm
// picks (JAX_FLASH_BWD_DS_STSM). g, t = lane / 4, lane % 4.
template <class Tr, int kSteps>
__device__ __forceinline__ void store_exchanged_tile(uint8_t* tile, const uint32_t (&f)[kSteps][4],
                                                     int row0, int chunk0, int lane, int g, int t) {
  if constexpr (Tr::kDsStsm) {
    store_operand_tile_stsm<Tr::kDsPanels, Tr::kDsPanelBytes>(tile, f, row0, chunk0, lane);
  } else {
    store_operand_tile<Tr::kDsPanels, Tr::kDsPanelBytes>(tile, f, row0, chunk0, g, t);
  }
}

// kDqT: the warp's dS^T fragments (16 keys key0.., kBlockM queries) stored transposed, as dS: rows
// of kBlockM queries, the tile's kBlockN keys in 64-key panels of 128-byte swizzled rows (K-major,
// the B operand of dQ^T = K^T dS^T). One stmatrix.x4.trans per k16 step: its matrix m is register
// m of the A fragment, keys key0 + 8 (m % 2).. x queries 16j + 8 (m / 2)..; transposed, it is rows
// 16j + 8 (m / 2) + 0..7 at the 16-byte chunk of those 8 keys, which lane 8m + row addresses. The
// swizzle puts a matrix's 8 rows on 8 different chunks: no bank conflict.
template <class Tr>
__device__ __forceinline__ void store_ds_kmajor(uint8_t* tile,
                                                const uint32_t (&ds)[Tr::kBlockM / 16][4], int key0,
                                                int lane) {
  const int m = lane / 8;
  const int key = key0 + 8 * (m % 2);
  // Row q = 16j + 8 (m / 2) + lane % 8 has q % 8 = lane % 8: one address plus 2 KB a step.
  const int row = 8 * (m / 2) + lane % 8;
  const uint32_t at = tc::smem_addr(tile) + (key / 64) * Tr::kDsPanelBytes + row * 128 +
                      (((key % 64 / 8) ^ (lane % 8)) * 16);
#pragma unroll
  for (int j = 0; j < Tr::kBlockM / 16; ++j) {
    tc::stmatrix_x4_trans(at + j * 16 * 128, ds[j][0], ds[j][1], ds[j][2], ds[j][3]);
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

#endif  // JAX_FLASH_SM90A

}  // namespace jax_flash::cuda::sm90
