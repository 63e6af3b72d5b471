// Tensor-core split pass of the decode call (common/decode_params.h) for fp16/bf16 on any sm_80+
// GPU: split-KV "flash-decoding" on mma.sync m16n8k16 with fp32 accumulation (decode_tile.cuh),
// its K/V tiles copied by every thread of the block through a kStages-deep cp.async ring. On sm_90
// the TMA-fed pass (decode_tma.cuh) serves the layouts its tensor maps can describe.
//
// Paged caches. A key row's address is page * page_size + j % page_size (DecodeParams::key_row,
// done in 32-bit arithmetic here); each loading thread reads the block-table entries of its rows
// of tile t + 1 while it issues the copies of tile t, so the table lookup never stalls the copy
// issue. Rows of one key are head_dim * 2 contiguous bytes whatever the page size, so the 16-byte
// copies are the same for every layout.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>

#include "common/decode_params.h"
#include "cuda/decode_tile.cuh"
#include "cuda/grid_dependency.cuh"
#include "cuda/kernel_attributes.h"
#include "cuda/tc_primitives.cuh"

namespace jax_flash::cuda::decode {

// Block-table lookups of one thread's rows of the next tile to copy (paged caches only): the
// page, loaded early, and the row within it.
template <int kRows>
struct PageRows {
  int32_t page[kRows];
  int32_t offset[kRows];
};

template <typename Tr, bool kPaged>
__global__ void __launch_bounds__(Tr::kNThreads, Tr::kMinBlocks)
    decode_tc_kernel(const DecodeParams p, const TcArgs a) {
  using T = typename Tr::T;
  constexpr int kBlockN = Tr::kBlockN;
  constexpr int kStages = Tr::kStages;
  constexpr int kPitch = Tr::kPitch;
  constexpr int kChunksPerRow = Tr::kChunksPerRow;
  // The merge pass is launched as this grid's programmatic dependent: letting it launch as soon
  // as every block of this grid has started hides its launch latency (its blocks wait for this
  // grid's completion and memory before reading a partial). A no-op without a dependent.
  allow_dependents();

  extern __shared__ uint4 smem_raw[];  // 16-byte alignment for cp.async and ldmatrix
  char* smem_q = reinterpret_cast<char*>(smem_raw);
  char* ring = smem_q + Tr::kQBytes;
  char* smem_stats = ring + Tr::kRingBytes;

  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid % 32;
  const int warp = tid / 32;
  const BlockWork w = block_work<Tr>(p, a);
  const int n_tiles = w.t_end - w.t_begin;
  const int seqlen_k = w.seqlen_k;
  const int head_dim = static_cast<int>(p.head_dim);

  // cp.async assignment: chunk ld_chunk of rows ld_row + x * kRowsPerPass, so a warp reads whole
  // contiguous rows. Chunks at or past head_dim are zero-filled, never read.
  const int ld_chunk = tid % kChunksPerRow;
  const int ld_row = tid / kChunksPerRow;
  const bool chunk_valid = ld_chunk * 8 < head_dim;
  const uint32_t ld_smem_off = ld_row * kPitch + ld_chunk * 16;
  const int64_t kv_row_stride = p.heads_kv * p.head_dim;
  const T* k_base = static_cast<const T*>(p.k) + w.kv_head * p.head_dim + ld_chunk * 8;
  const T* v_base = static_cast<const T*>(p.v) + w.kv_head * p.head_dim + ld_chunk * 8;

  PageRows<kPaged ? Tr::kLoadRows : 1> pages;
  const int32_t* table = kPaged ? p.block_table + w.b * p.max_pages : nullptr;
  const uint32_t page_size = kPaged ? static_cast<uint32_t>(p.page_size) : 1u;
  const int32_t last_page =
      kPaged ? static_cast<int32_t>(p.num_pages <= INT_MAX ? p.num_pages - 1 : INT_MAX) : 0;
  // Starts the block-table loads of tile `tile`'s rows; their values are first used one tile
  // later, so the loads' latency hides behind a tile of work.
  auto fetch_pages = [&](int tile) {
    if constexpr (kPaged) {
#pragma unroll
      for (int x = 0; x < Tr::kLoadRows; ++x) {
        const uint32_t j = static_cast<uint32_t>(tile * kBlockN + ld_row + x * Tr::kRowsPerPass);
        const uint32_t blk = j / page_size;
        pages.offset[x] = static_cast<int32_t>(j - blk * page_size);
        pages.page[x] = static_cast<int>(j) < seqlen_k ? __ldg(table + blk) : 0;
      }
    }
  };
  auto load_kv = [&](int tile, int stage) {
    char* k_dst = ring + stage * Tr::kStageBytes + ld_smem_off;
    char* v_dst = k_dst + kBlockN * kPitch;
#pragma unroll
    for (int x = 0; x < Tr::kLoadRows; ++x) {
      const int j = tile * kBlockN + ld_row + x * Tr::kRowsPerPass;
      const bool valid = chunk_valid && j < seqlen_k;
      int64_t row;
      if constexpr (kPaged) {
        // DecodeParams::key_row: the page index is clamped into the pool.
        const int32_t page = min(max(pages.page[x], 0), last_page);
        row = static_cast<int64_t>(page) * page_size + pages.offset[x];
      } else {
        row = w.b * p.cache_len + j;
      }
      const int64_t off = valid ? row * kv_row_stride : 0;
      tc::cp_async_16_stream(k_dst + x * Tr::kRowsPerPass * kPitch, k_base + off, valid);
      tc::cp_async_16_stream(v_dst + x * Tr::kRowsPerPass * kPitch, v_base + off, valid);
    }
    if (tile + 1 < w.t_end) fetch_pages(tile + 1);
  };

  // Prologue: Q (its own commit group), then kStages - 1 tiles ahead.
  if (n_tiles > 0) {
    fetch_pages(w.t_begin);
    load_q<Tr>(p, a, w, smem_q, tid);
  }
  tc::cp_async_commit();
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n_tiles) load_kv(w.t_begin + s, s);
    tc::cp_async_commit();
  }

  WarpState<Tr> st;
  st.init(p, a, w, smem_q, lane);

  int stage = 0;
  for (int t = 0; t < n_tiles; ++t) {
    // Tile t has landed for this thread; the barrier publishes every thread's copies and proves
    // that all warps are done with tile t - 1, whose stage the next copy overwrites.
    tc::cp_async_wait<kStages - 2>();
    __syncthreads();
    if (t + kStages - 1 < n_tiles) {
      const int ahead = stage == 0 ? kStages - 1 : stage - 1;  // (t + kStages - 1) % kStages
      load_kv(w.t_begin + t + kStages - 1, ahead);
    }
    tc::cp_async_commit();
    const char* k_tile = ring + stage * Tr::kStageBytes;
    st.template attend<PaddedTiles<Tr>>(a, k_tile, k_tile + kBlockN * kPitch, w.t_begin + t, warp,
                                        lane);
    stage = stage + 1 == kStages ? 0 : stage + 1;
  }

  // The ring is free once no copy is pending (trailing commit groups are empty, but a block with
  // no tiles still copied nothing, so the wait is cheap) and every warp has left the loop.
  st.finish(p, a, w, smem_stats, reinterpret_cast<float*>(ring), tid, [] {
    tc::cp_async_wait<0>();
    __syncthreads();
  });
}

// Launches the split pass on `stream`; the caller (decode.cu) has validated p, clamped its band
// and checked that the grid and every position fit.
template <typename Tr, bool kPaged>
cudaError_t launch_tc(const DecodeParams& p, const TcArgs& args, int64_t blocks,
                      cudaStream_t stream) {
  const auto kernel = decode_tc_kernel<Tr, kPaged>;
  // The dynamic shared-memory limit is a per-device function attribute (set once per device); the
  // largest carveout lets kMinBlocks blocks share an SM (K/V pass through shared memory only, L1
  // has nothing to keep).
  const cudaError_t err =
      configure_kernel_once<decode_tc_kernel<Tr, kPaged>>(Tr::kSmemBytes, /*max_carveout=*/true);
  if (err != cudaSuccess) return err;
  kernel<<<static_cast<unsigned>(blocks), Tr::kNThreads, Tr::kSmemBytes, stream>>>(p, args);
  return cudaGetLastError();
}

}  // namespace jax_flash::cuda::decode
