// Tensor-core split pass of the decode call for fp16/bf16 on sm_90a, fed by the tensor memory
// accelerator: the same blocks, tiles and math as the cp.async pass (decode_tile.cuh), but one copy
// warp moves each K/V tile with a few TMA boxes into a ring guarded by mbarriers, while the four
// math warps only compute. Decode is a stream read: the cp.async pass spends 16 copy instructions
// per thread and tile on the math warps' issue slots and needs the 256-byte L2 prefetch hint to
// keep DRAM busy, which costs read bandwidth; the tensor maps here ask for no L2 promotion, the
// setting at which the bulk copy engine read this access pattern at the unhinted copy rate
// (benchmarks/results/decode_read_ceiling_h200.txt).
//
// Tensor maps (sm90_host.h, 128-byte swizzle, boxes of 64 head-dim columns): contiguous caches
// are [batch, cache_len, heads_kv, head_dim] with boxes of kBlockN keys; paged caches are
// [num_pages, page_size, heads_kv, head_dim] with boxes of gcd(page_size, kBlockN) keys (page sizes
// that are multiples of 16; decode.cu sends others to the cp.async pass), one box per page a tile
// touches, its page read from the block table by the copy warp's lanes.
//
// A sequence's last tile may hold keys at or past its length, which must never be read, so it gets
// no TMA box: the math warps copy it themselves, each warp the 16 rows it reads, zero-filled, into
// the same swizzled layout (see the math loop).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <numeric>
#include <type_traits>

#include "common/decode_params.h"
#include "cuda/decode_tile.cuh"
#include "cuda/grid_dependency.cuh"
#include "cuda/kernel_attributes.h"
#include "cuda/sm90_async.cuh"
#include "cuda/sm90_host.h"
#include "cuda/tc_primitives.cuh"

namespace jax_flash::cuda::decode {

template <typename Tr, bool kPaged>
__global__ void __launch_bounds__(Tr::kTmaThreads, Tr::kMinBlocks)
    decode_tma_kernel(const DecodeParams p, const TcArgs a,
                      const __grid_constant__ CUtensorMap tmap_k,
                      const __grid_constant__ CUtensorMap tmap_v) {
#if JAX_FLASH_SM90A
  static_assert(Tr::kTma, "a configuration the TMA pass does not serve");
  using sm90::mbar_arrive;
  using sm90::mbar_wait;
  constexpr int kBlockN = Tr::kBlockN;
  constexpr int kStages = Tr::kStages;
  constexpr int kPanels = Tr::kHeadDim / 64;  // 64-column boxes per key row
  constexpr int kPanelBytes = kBlockN * 128;
  constexpr int kMathBarrier = 1;  // named barrier of the math warps (0 is __syncthreads)
  // The merge pass is this grid's programmatic dependent (decode_tc.cuh says why).
  allow_dependents();

  extern __shared__ uint4 smem_raw[];
  // The swizzle pattern follows address bits 7-9: tiles start on 1024-byte boundaries.
  char* ring = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) &
                                       ~static_cast<uintptr_t>(1023));
  char* smem_q = ring + Tr::kTmaRingBytes;
  char* smem_stats = smem_q + Tr::kQBytes;
  const uint32_t full0 = tc::smem_addr(smem_stats + Tr::kStatBytes);  // full[s] at full0 + 8 s
  const uint32_t empty0 = full0 + 8 * kStages;                        // empty[s]

  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid % 32;
  const int warp = tid / 32;
  const BlockWork w = block_work<Tr>(p, a);
  const int n_tiles = w.t_end - w.t_begin;
  // The copy warp moves the whole tiles; a last tile that reaches past the sequence's end (there
  // is at most one) is copied by the math warps themselves (see the loop).
  const int n_whole = n_tiles > 0 && w.t_end * kBlockN > w.seqlen_k ? n_tiles - 1 : n_tiles;

  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      sm90::mbar_init(full0 + 8 * s, 1);             // the copy warp's arrival (+ TMA bytes)
      sm90::mbar_init(empty0 + 8 * s, Tr::kNWarps);  // one arrival per math warp
    }
    sm90::fence_barrier_init();
  }
  __syncthreads();

  if (warp == Tr::kNWarps) {
    // The copy warp. Use u of stage s is tile s + u * kStages; before refilling a stage it waits
    // for the math warps' release of its previous use (empty phase u - 1).
    if (lane == 0) {
      sm90::prefetch_tensormap(&tmap_k);
      sm90::prefetch_tensormap(&tmap_v);
    }
    const int32_t* table = kPaged ? p.block_table + w.b * p.max_pages : nullptr;
    const int32_t last_page =
        kPaged ? static_cast<int32_t>(p.num_pages <= INT_MAX ? p.num_pages - 1 : INT_MAX) : 0;
    const int boxes = kPaged ? kBlockN / a.box_rows : 1;
    int stage = 0;
    uint32_t phase = 0;
    for (int t = 0; t < n_whole; ++t) {
      if (t >= kStages) mbar_wait(empty0 + 8 * stage, phase ^ 1);
      const int tile = w.t_begin + t;
      const uint32_t k_dst = tc::smem_addr(ring + stage * Tr::kTmaStageBytes);
      const uint32_t v_dst = k_dst + Tr::kTmaTileBytes;
      const uint32_t full = full0 + 8 * stage;
      if (lane == 0) sm90::mbar_arrive_expect_tx(full, Tr::kTmaStageBytes);
      __syncwarp();
      if (lane < boxes) {
        int c2, c3;  // the box's key row within its sequence (page), and the sequence (page)
        if constexpr (kPaged) {
          const int j = tile * kBlockN + lane * a.box_rows;
          const int32_t page = __ldg(table + j / static_cast<int>(p.page_size));
          c3 = min(max(page, 0), last_page);
          c2 = j % static_cast<int>(p.page_size);
        } else {
          c2 = tile * kBlockN;
          c3 = static_cast<int>(w.b);
        }
        const uint32_t row_off = lane * a.box_rows * 128;
#pragma unroll
        for (int panel = 0; panel < kPanels; ++panel) {
          const uint32_t off = panel * kPanelBytes + row_off;
          sm90::tma_load_4d(k_dst + off, &tmap_k, full, panel * 64, w.kv_head, c2, c3);
          sm90::tma_load_4d(v_dst + off, &tmap_v, full, panel * 64, w.kv_head, c2, c3);
        }
      }
      if (++stage == kStages) {
        stage = 0;
        phase ^= 1;
      }
    }
    return;
  }

  // The math warps.
  if (n_tiles > 0) load_q<Tr>(p, a, w, smem_q, tid);
  tc::cp_async_commit();
  tc::cp_async_wait<0>();
  sm90::named_barrier_sync(kMathBarrier, Tr::kNThreads);

  WarpState<Tr> st;
  st.init(p, a, w, smem_q, lane);
  int stage = 0;
  uint32_t phase = 0;
  for (int t = 0; t < n_tiles; ++t) {
    char* k_tile = ring + stage * Tr::kTmaStageBytes;
    if (t < n_whole) {
      mbar_wait(full0 + 8 * stage, phase);
    } else {
      // The partial last tile: each warp reads only its own 16 key rows of a tile, so it copies
      // just those, through registers, and zero-fills rows at or past seqlen_k and columns at
      // or past head_dim (never read). The stage's earlier use was this warp's own (the copy
      // warp writes no further tile), so a warp barrier orders everything.
      __syncwarp();
      const uint4* k = static_cast<const uint4*>(p.k);
      const uint4* v = static_cast<const uint4*>(p.v);
      const int64_t kv_row_chunks = p.heads_kv * p.head_dim / 8;  // 16-byte chunks per key row
      for (int x = lane; x < Tr::kKeysPerWarp * Tr::kChunksPerRow; x += 32) {
        const int row = warp * Tr::kKeysPerWarp + x / Tr::kChunksPerRow;
        const int ch = x % Tr::kChunksPerRow;
        const int j = (w.t_begin + t) * kBlockN + row;
        uint4 k_val = make_uint4(0u, 0u, 0u, 0u);
        uint4 v_val = k_val;
        if (j < w.seqlen_k && ch * 8 < p.head_dim) {
          const int64_t off = p.key_row(w.b, j) * kv_row_chunks + w.kv_head * (p.head_dim / 8) + ch;
          k_val = __ldg(k + off);
          v_val = __ldg(v + off);
        }
        const uint32_t dst = SwizzledTiles<Tr>::offset(row, ch);
        *reinterpret_cast<uint4*>(k_tile + dst) = k_val;
        *reinterpret_cast<uint4*>(k_tile + Tr::kTmaTileBytes + dst) = v_val;
      }
      __syncwarp();
    }
    st.template attend<SwizzledTiles<Tr>>(a, k_tile, k_tile + Tr::kTmaTileBytes, w.t_begin + t,
                                          warp, lane);
    // The warp's reads of this stage are done (they fed its MMAs); release it to the copy warp.
    if (t < n_whole) {
      __syncwarp();
      if (lane == 0) mbar_arrive(empty0 + 8 * stage);
    }
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
  // Every tile the copy warp issued has been waited for, so the ring holds no pending copy.
  st.finish(p, a, w, smem_stats, reinterpret_cast<float*>(ring), tid,
            [] { sm90::named_barrier_sync(kMathBarrier, Tr::kNThreads); });
#else
  __trap();  // dispatched only where sm_90a code exists (tma_usable)
#endif
}

// Whether the TMA pass can serve `p` on the current device: sm_90a code and device, tensor-map
// coordinates within int32, 16-byte aligned caches, and (paged) pages of a multiple of 16 keys.
inline bool tma_usable(const DecodeParams& p) {
  if (!sm90::sm90a_kernels_usable()) return false;
  if (!sm90::aligned(p.k, 16) || !sm90::aligned(p.v, 16)) return false;
  if (p.paged()) return p.page_size % 16 == 0 && p.num_pages <= INT_MAX;
  return p.batch <= INT_MAX;
}

// Launches the TMA split pass on `stream`; the caller (decode.cu) has validated p, clamped its
// band, checked that the grid and every position fit, and that tma_usable(p).
template <typename Tr, bool kPaged>
cudaError_t launch_tma(const DecodeParams& p, TcArgs args, int64_t blocks, cudaStream_t stream) {
  using T = typename Tr::T;
  const CUtensorMapDataType type = std::is_same_v<T, __half> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                                             : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const int64_t outer = kPaged ? p.num_pages : p.batch;
  const int64_t rows = kPaged ? p.page_size : p.cache_len;
  args.box_rows =
      kPaged ? static_cast<int>(std::gcd(p.page_size, int64_t{Tr::kBlockN})) : Tr::kBlockN;
  CUtensorMap map_k;
  CUtensorMap map_v;
  if (!sm90::encode_bshd(&map_k, type, p.k, outer, rows, p.heads_kv, p.head_dim, args.box_rows, 2,
                         CU_TENSOR_MAP_L2_PROMOTION_NONE) ||
      !sm90::encode_bshd(&map_v, type, p.v, outer, rows, p.heads_kv, p.head_dim, args.box_rows, 2,
                         CU_TENSOR_MAP_L2_PROMOTION_NONE)) {
    return cudaErrorInvalidValue;
  }
  const auto kernel = decode_tma_kernel<Tr, kPaged>;
  const cudaError_t err = configure_kernel_once<decode_tma_kernel<Tr, kPaged>>(
      Tr::kTmaSmemBytes, /*max_carveout=*/true);
  if (err != cudaSuccess) return err;
  kernel<<<static_cast<unsigned>(blocks), Tr::kTmaThreads, Tr::kTmaSmemBytes, stream>>>(
      p, args, map_k, map_v);
  return cudaGetLastError();
}

}  // namespace jax_flash::cuda::decode
