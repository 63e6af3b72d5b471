// Split pass of the decode call (common/decode_params.h) for fp16/bf16 at head_dim 128 with at
// most 16 packed rows per KV head (GQA up to 16 at Sq = 1): one block covers eight KV heads of a
// key range, a warp per head, so that a tile's K and V are sixteen whole key rows (8 heads x 256
// bytes, contiguous in both cache layouts) rather than one head's 256-byte pieces strided
// heads_kv * 256 bytes apart, which decode_tc.cuh reads. Opt-in (JAX_FLASH_DECODE_KERNEL=heads,
// decode.cu) until measured against decode_tc.cuh.
//
// Work split. One block of 8 warps owns (sequence, group of 8 KV heads, split) and streams the
// split's keys in 16-key tiles through a kStages-deep cp.async ring; warp w runs the whole online
// softmax of KV head 8 * group + w over every key of the split, exactly one warp's share of a
// decode_tc.cuh tile (QK^T and PV on mma.m16n8k16, the packed rows as M), so no state is merged
// across warps: each warp writes its own rows. One block per SM (204 KB of ring): the grid is
// batch * heads_kv / 8 * num_splits blocks, and the caller picks num_splits for that
// (_decode.choose_num_splits). Q is read once into registers through the ring's last stage,
// which the prologue's copies leave free.
//
// Paged caches as in decode_tc.cuh: the block-table entries of a thread's keys of tile t + 1 are
// loaded while tile t's copies issue.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>

#include "common/decode_params.h"
#include "cuda/decode_tc.cuh"
#include "cuda/grid_dependency.cuh"
#include "cuda/kernel_attributes.h"
#include "cuda/tc_primitives.cuh"

namespace jax_flash::cuda::decode {

struct HeadsTraits {
  static constexpr int kHeads = 8;  // KV heads per block, one warp each
  static constexpr int kNThreads = kHeads * 32;
  static constexpr int kHeadDim = 128;
  static constexpr int kBlockN = 16;  // keys per tile: one k16 step of PV; the split granule
  static constexpr int kStages = 3;
  static constexpr int kPitch = kHeadDim * 2 + 16;  // 16-byte pad: conflict-free ldmatrix
  static constexpr int kHeadTile = kBlockN * kPitch;
  static constexpr int kStageBytes = 2 * kHeads * kHeadTile;  // K of every head, then V
  static constexpr int kSmemBytes = kStages * kStageBytes;
  static constexpr int kChunksPerRow = kHeadDim * 2 / 16;
  // A key's row of the block's heads is kHeads * kChunksPerRow 16-byte chunks; a thread copies
  // one chunk of kLoadKeys keys per tile of K (and of V).
  static constexpr int kKeysPerPass = kNThreads / (kHeads * kChunksPerRow);
  static constexpr int kLoadKeys = kBlockN / kKeysPerPass;
  static constexpr int kQKSteps = kHeadDim / 16;
  static constexpr int kOTiles = kHeadDim / 8;
  static_assert(kNThreads % (kHeads * kChunksPerRow) == 0 && kBlockN % kKeysPerPass == 0);
  static_assert(kHeads * 16 * kPitch <= kStageBytes, "Q fits one stage");
  static_assert(kSmemBytes <= 232448, "sm_90's opt-in shared memory per block");
};

template <typename T, bool kPaged>
__global__ void __launch_bounds__(HeadsTraits::kNThreads, 1)
    decode_heads_kernel(const DecodeParams p, const TcArgs a) {
  using Tr = HeadsTraits;
  constexpr int kBlockN = Tr::kBlockN;
  constexpr int kStages = Tr::kStages;
  constexpr int kPitch = Tr::kPitch;
  constexpr int kHeads = Tr::kHeads;
  constexpr float kNegInf = -INFINITY;
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr float kLn2 = 0.6931471805599453f;
  // The merge pass, when there is one, is this grid's programmatic dependent (decode_tc.cuh).
  decode_allow_dependents();

  extern __shared__ uint4 smem_raw[];
  char* ring = reinterpret_cast<char*>(smem_raw);

  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int g = lane / 4;
  const int c = 2 * (lane % 4);

  int64_t bid = blockIdx.x;
  const int split = static_cast<int>(bid % p.num_splits);
  bid /= p.num_splits;
  const int head_groups = static_cast<int>(p.heads_kv / kHeads);
  const int hg = static_cast<int>(bid % head_groups);
  const int64_t b = bid / head_groups;
  const int kv_head = hg * kHeads + warp;

  const int seqlen_q = static_cast<int>(p.seqlen_q);
  const int seqlen_k = static_cast<int>(p.seqlen_k(b));
  const int group = a.group;
  const int rows = a.rows;  // <= 16
  const SeqMask mask = p.mask.band.for_seq(seqlen_q, seqlen_k);

  int t_begin, t_end;
  {
    const int64_t lo = mask.key_begin(0);
    const int64_t hi = mask.key_end(seqlen_q);
    const int64_t kb = p.split_begin(split, lo, hi, kBlockN);
    const int64_t ke = p.split_begin(split + 1, lo, hi, kBlockN);
    t_begin = static_cast<int>(kb / kBlockN);
    t_end = ke > kb ? static_cast<int>((ke + kBlockN - 1) / kBlockN) : t_begin;
  }
  const int n_tiles = t_end - t_begin;

  // Rows g and g + 8 of this warp's head; padding rows see no key.
  int key_lo[2], key_hi[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = g + 8 * h;
    key_lo[h] = r < rows ? static_cast<int>(mask.key_begin(r / group)) : 0;
    key_hi[h] = r < rows ? static_cast<int>(mask.key_end(r / group + 1)) : 0;
  }

  // Copy assignment: chunk ld_chunk of head ld_head of keys ld_key + x * kKeysPerPass, so that a
  // warp copies 512 contiguous bytes of one key row.
  const int ld_chunk = tid % Tr::kChunksPerRow;
  const int ld_head = tid / Tr::kChunksPerRow % kHeads;
  const int ld_key = tid / (Tr::kChunksPerRow * kHeads);
  const uint32_t ld_smem_off = ld_head * Tr::kHeadTile + ld_key * kPitch + ld_chunk * 16;
  const int64_t kv_row_stride = p.heads_kv * p.head_dim;
  const int64_t col = (static_cast<int64_t>(hg) * kHeads + ld_head) * p.head_dim + ld_chunk * 8;
  const T* k_base = static_cast<const T*>(p.k) + col;
  const T* v_base = static_cast<const T*>(p.v) + col;

  PageRows<kPaged ? Tr::kLoadKeys : 1> pages;
  const int32_t* table = kPaged ? p.block_table + b * p.max_pages : nullptr;
  const uint32_t page_size = kPaged ? static_cast<uint32_t>(p.page_size) : 1u;
  const int32_t last_page =
      kPaged ? static_cast<int32_t>(p.num_pages <= INT_MAX ? p.num_pages - 1 : INT_MAX) : 0;
  auto fetch_pages = [&](int tile) {
    if constexpr (kPaged) {
#pragma unroll
      for (int x = 0; x < Tr::kLoadKeys; ++x) {
        const uint32_t j = static_cast<uint32_t>(tile * kBlockN + ld_key + x * Tr::kKeysPerPass);
        const uint32_t blk = j / page_size;
        pages.offset[x] = static_cast<int32_t>(j - blk * page_size);
        pages.page[x] = static_cast<int>(j) < seqlen_k ? __ldg(table + blk) : 0;
      }
    }
  };
  auto load_kv = [&](int tile, int stage) {
    char* k_dst = ring + stage * Tr::kStageBytes + ld_smem_off;
    char* v_dst = k_dst + kHeads * Tr::kHeadTile;
#pragma unroll
    for (int x = 0; x < Tr::kLoadKeys; ++x) {
      const int j = tile * kBlockN + ld_key + x * Tr::kKeysPerPass;
      const bool valid = j < seqlen_k;
      int64_t row;
      if constexpr (kPaged) {
        const int32_t page = min(max(pages.page[x], 0), last_page);
        row = static_cast<int64_t>(page) * page_size + pages.offset[x];
      } else {
        row = b * p.cache_len + j;
      }
      const int64_t off = valid ? row * kv_row_stride : 0;
      tc::cp_async_16_stream(k_dst + x * Tr::kKeysPerPass * kPitch, k_base + off, valid);
      tc::cp_async_16_stream(v_dst + x * Tr::kKeysPerPass * kPitch, v_base + off, valid);
    }
    if (tile + 1 < t_end) fetch_pages(tile + 1);
  };

  // Prologue: Q of every head into the last stage (its own commit group), then kStages - 1
  // tiles into the others. Q row r of head w sits at row r of head w's tile slot.
  char* q_stage = ring + (kStages - 1) * Tr::kStageBytes;
  if (n_tiles > 0) {
    fetch_pages(t_begin);
    const T* q = static_cast<const T*>(p.q);
    constexpr int kQChunks = kHeads * 16 * Tr::kChunksPerRow;
#pragma unroll
    for (int x = tid; x < kQChunks; x += Tr::kNThreads) {
      const int ch = x % Tr::kChunksPerRow;
      const int r = x / Tr::kChunksPerRow % 16;
      const int w = x / (Tr::kChunksPerRow * 16);
      const bool valid = r < rows;
      const int64_t head = (static_cast<int64_t>(hg) * kHeads + w) * group + r % group;
      const int64_t off =
          valid ? ((b * p.seqlen_q + r / group) * p.heads_q + head) * p.head_dim + ch * 8 : 0;
      tc::cp_async_16(q_stage + w * Tr::kHeadTile + r * kPitch + ch * 16, q + off, valid);
    }
  }
  tc::cp_async_commit();
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n_tiles) load_kv(t_begin + s, s);
    tc::cp_async_commit();
  }

  const uint32_t qv_lane_off = (lane % 16) * kPitch + (lane / 16) * 16;
  const uint32_t k_lane_off = (lane % 8 + (lane / 16) * 8) * kPitch + ((lane / 8) % 2) * 16;

  // Q fragments in registers: the first loop iteration's copy overwrites the Q stage only after
  // the barrier that every warp reaches with its fragments loaded. A block without tiles copied
  // no Q and reads none.
  uint32_t qa[Tr::kQKSteps][4];
  tc::cp_async_wait<kStages - 1>();
  __syncthreads();
  if (n_tiles > 0) {
#pragma unroll
    for (int kk = 0; kk < Tr::kQKSteps; ++kk) {
      tc::ldmatrix_x4(qa[kk], q_stage + warp * Tr::kHeadTile + qv_lane_off + kk * 32);
    }
  }

  float acc_o[Tr::kOTiles][4];
#pragma unroll
  for (int j = 0; j < Tr::kOTiles; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_o[j][e] = 0.f;
  }
  float m_run[2] = {kNegInf, kNegInf};
  float row_sum[2] = {0.f, 0.f};

  int stage = 0;
  for (int t = 0; t < n_tiles; ++t) {
    tc::cp_async_wait<kStages - 2>();
    __syncthreads();
    if (t + kStages - 1 < n_tiles) {
      const int ahead = stage == 0 ? kStages - 1 : stage - 1;
      load_kv(t_begin + t + kStages - 1, ahead);
    }
    tc::cp_async_commit();

    const char* k_tile = ring + stage * Tr::kStageBytes + warp * Tr::kHeadTile;
    const char* v_tile = k_tile + kHeads * Tr::kHeadTile;
    const int key0 = (t_begin + t) * kBlockN;

    float s[2][4];
#pragma unroll
    for (int e = 0; e < 4; ++e) s[0][e] = s[1][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < Tr::kQKSteps; ++kk) {
      uint32_t bk[4];
      tc::ldmatrix_x4(bk, k_tile + k_lane_off + kk * 32);
      const uint32_t b_lo[2] = {bk[0], bk[1]};
      const uint32_t b_hi[2] = {bk[2], bk[3]};
      tc::mma_16816<T>(s[0], qa[kk], b_lo);
      tc::mma_16816<T>(s[1], qa[kk], b_hi);
    }

    // Softcap, mask and the base-2 online softmax, as in decode_tc.cuh.
    uint32_t pa[4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = kNegInf;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float x = s[j][2 * h + e];
          if (a.softcap) x = tc::fast_tanh(x * a.cap_scale);
          const int key = key0 + 8 * j + c + e;
          x = key >= key_lo[h] && key < key_hi[h] ? x * a.scale_log2 : kNegInf;
          s[j][2 * h + e] = x;
          mx = fmaxf(mx, x);
        }
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m_run[h], mx);
      const float m_sub = m_new == kNegInf ? 0.f : m_new;
      const float rescale = tc::fast_exp2(m_run[h] - m_sub);
      m_run[h] = m_new;
      float sum = row_sum[h] * rescale;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float pe = tc::fast_exp2(s[j][2 * h + e] - m_sub);
          s[j][2 * h + e] = pe;
          sum += pe;
        }
      }
      row_sum[h] = sum;
#pragma unroll
      for (int j = 0; j < Tr::kOTiles; ++j) {
        acc_o[j][2 * h] *= rescale;
        acc_o[j][2 * h + 1] *= rescale;
      }
    }
    pa[0] = tc::pack2<T>(s[0][0], s[0][1]);
    pa[1] = tc::pack2<T>(s[0][2], s[0][3]);
    pa[2] = tc::pack2<T>(s[1][0], s[1][1]);
    pa[3] = tc::pack2<T>(s[1][2], s[1][3]);

#pragma unroll
    for (int dp = 0; dp < Tr::kHeadDim / 16; ++dp) {
      uint32_t bv[4];
      tc::ldmatrix_x4_trans(bv, v_tile + qv_lane_off + dp * 32);
      const uint32_t b_lo[2] = {bv[0], bv[1]};
      const uint32_t b_hi[2] = {bv[2], bv[3]};
      tc::mma_16816<T>(acc_o[2 * dp], pa, b_lo);
      tc::mma_16816<T>(acc_o[2 * dp + 1], pa, b_hi);
    }
    stage = stage + 1 == kStages ? 0 : stage + 1;
  }
  tc::cp_async_wait<0>();  // no copy may outlive the block (trailing groups are empty)

  // Epilogue: the warp's rows are complete. With one split the sink enters the denominator
  // here, once; lse is the natural log of the row's sum, -inf (O = 0) for a row that sees
  // nothing.
  const bool single = p.num_splits == 1;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = row_sum[h];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int r = g + 8 * h;
    if (r >= rows) continue;
    const int64_t i = r / group;
    const int64_t head = static_cast<int64_t>(kv_head) * group + r % group;
    float sink = kNegInf;
    if (single && p.mask.sinks != nullptr) {
      sink = static_cast<const float*>(p.mask.sinks)[b * p.mask.sinks_batch_stride + head] * kLog2e;
    }
    const float m_tot = fmaxf(m_run[h], sink);
    const float ref = m_tot == kNegInf ? 0.f : m_tot;
    const float alpha = exp2f(m_run[h] - ref);
    const float l_tot = l * alpha + exp2f(sink - ref);
    const float lse = l_tot > 0.f ? (ref + log2f(l_tot)) * kLn2 : kNegInf;
    const float f = l_tot > 0.f ? alpha / l_tot : 0.f;
    if (single) {
      T* dst = static_cast<T*>(p.o) + ((b * p.seqlen_q + i) * p.heads_q + head) * p.head_dim + c;
#pragma unroll
      for (int j = 0; j < Tr::kOTiles; ++j) {
        *reinterpret_cast<uint32_t*>(dst + 8 * j) =
            tc::pack2<T>(acc_o[j][2 * h] * f, acc_o[j][2 * h + 1] * f);
      }
      if (lane % 4 == 0) static_cast<float*>(p.lse)[(b * p.heads_q + head) * p.seqlen_q + i] = lse;
    } else {
      const int64_t stat = ((b * p.num_splits + split) * p.heads_q + head) * p.seqlen_q + i;
      float* dst = static_cast<float*>(p.partial_o) + stat * p.head_dim + c;
#pragma unroll
      for (int j = 0; j < Tr::kOTiles; ++j) {
        *reinterpret_cast<float2*>(dst + 8 * j) =
            make_float2(acc_o[j][2 * h] * f, acc_o[j][2 * h + 1] * f);
      }
      if (lane % 4 == 0) static_cast<float*>(p.partial_lse)[stat] = lse;
    }
  }
}

// Whether decode_heads_kernel serves a call: fp16/bf16 (checked by the caller), head_dim 128,
// at most 16 packed rows, whole groups of 8 KV heads, and the device's opt-in shared memory.
inline bool heads_kernel_applies(const DecodeParams& p, int rows, int smem_optin) {
  return p.head_dim == HeadsTraits::kHeadDim && rows <= 16 &&
         p.heads_kv % HeadsTraits::kHeads == 0 && HeadsTraits::kSmemBytes <= smem_optin;
}

template <typename T, bool kPaged>
cudaError_t launch_heads(const DecodeParams& p, const TcArgs& args, cudaStream_t stream) {
  const int64_t blocks = p.batch * (p.heads_kv / HeadsTraits::kHeads) * p.num_splits;
  if (blocks > INT_MAX) return cudaErrorInvalidValue;
  const cudaError_t err = configure_kernel_once<decode_heads_kernel<T, kPaged>>(
      HeadsTraits::kSmemBytes, /*max_carveout=*/true);
  if (err != cudaSuccess) return err;
  decode_heads_kernel<T, kPaged>
      <<<static_cast<unsigned>(blocks), HeadsTraits::kNThreads, HeadsTraits::kSmemBytes, stream>>>(
          p, args);
  return cudaGetLastError();
}

}  // namespace jax_flash::cuda::decode
