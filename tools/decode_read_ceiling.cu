// Read-bandwidth ceilings of the decode pass's access pattern, independent of the decode kernel:
// what the GPU's memory system gives one block per (sequence, KV head, split) reading 64-key
// K and V tiles of a [B, S, 8, 128] bf16 cache (256-byte row pieces at a 2 KB stride), by copy
// mechanism, next to a flat streaming read of the same bytes. The kernels only copy (each thread
// touches one word of a landed tile), so the figures bound what the decode kernel can reach with
// the same mechanism. Needs an sm_90 GPU.
//
// Build (from the repository root):
//   nvcc -std=c++17 -O3 -I cpp -gencode=arch=compute_90a,code=sm_90a \
//       -DJAX_FLASH_BUILT_SM90A=1 tools/decode_read_ceiling.cu cpp/cuda/sm90_host.cu \
//       -o build/decode_read_ceiling
// Run: build/decode_read_ceiling
//
// Mechanisms (128 threads a block unless noted; 3-stage rings hold 96 KB, two blocks an SM):
//   flat ldcs            grid-stride ld.global.cs.v4 over K, then over V (4 blocks of 512 an SM)
//   cp.async L2::256B    the decode kernel's copies: cp.async.cg with the 256-byte L2 prefetch
//   cp.async plain       cp.async.cg without a prefetch hint
//   cp.async evict_first cp.async.cg, 256-byte prefetch, L2 evict-first policy
//   ldcs regs            ld.global.cs.v4 into registers, 256 threads, 16 loads in flight each
//   tma N stages         one thread issues 2 x 2 tensor-map boxes a stage (the maps of
//                        sm90_host.h, which ask for 256-byte L2 promotion); evict-first optional
//   chunks C x N         block i reads bytes [i C, (i + 1) C) of K and of V (no head stride)
// Order: 0 = blocks (sequence, head, split) with the split fastest (the decode grid's order),
// 1 = the head fastest. GB/s = bytes of K and V / mean time of back-to-back launches, rotating
// over 8 copies of the cache when it is under 1 GB (so it is never read from L2).
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <vector>

#include "cuda/fwd_wgmma.cuh"
#include "cuda/sm90_host.h"
#include "cuda/tc_primitives.cuh"
#include "cuda_check.h"

namespace {

using jax_flash::cuda::tc::cp_async_16;
using jax_flash::cuda::tc::cp_async_16_stream;
using jax_flash::cuda::tc::cp_async_commit;
using jax_flash::cuda::tc::cp_async_wait;
using jax_flash::cuda::tc::smem_addr;

constexpr int kHeads = 8;
constexpr int kDim = 128;
constexpr int kTileKeys = 64;
constexpr int kTileBytes = kTileKeys * kDim * 2;  // one of K or V

enum class Copy { kHint256, kPlain, kEvictFirst };

__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

template <Copy kCopy>
__device__ __forceinline__ void copy16(void* dst, const void* src, uint64_t policy) {
  if constexpr (kCopy == Copy::kPlain) {
    cp_async_16(dst, src, true);
  } else if constexpr (kCopy == Copy::kHint256) {
    cp_async_16_stream(dst, src, true);  // the decode kernel's own copy
  } else {
    asm volatile(
        "cp.async.cg.shared.global.L2::cache_hint.L2::256B [%0], [%1], 16, 16, %2;\n" ::"r"(
            smem_addr(dst)),
        "l"(src), "l"(policy));
  }
}

// The words a block touches of each landed tile, so that nothing is optimised away.
__device__ __forceinline__ void keep(unsigned acc, unsigned* sink) {
  if (acc == 0x12345678u) *sink = acc;
}

struct BlockKeys {
  int b, h, t0, tiles;
};

__device__ __forceinline__ BlockKeys block_keys(int seqlen, int splits, int order) {
  int split = blockIdx.x % splits;
  int h = (blockIdx.x / splits) % kHeads;
  int b = blockIdx.x / splits / kHeads;
  if (order == 1) {
    h = blockIdx.x % kHeads;
    split = (blockIdx.x / kHeads) % splits;
    b = blockIdx.x / kHeads / splits;
  }
  const int keys = seqlen / splits;
  return {b, h, split * keys / kTileKeys, keys / kTileKeys};
}

__global__ void read_flat(const uint4* __restrict__ p, size_t n, unsigned* sink) {
  unsigned acc = 0;
  size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    const uint4 a = __ldcs(p + i);
    const uint4 b = __ldcs(p + i + stride);
    const uint4 c = __ldcs(p + i + 2 * stride);
    const uint4 d = __ldcs(p + i + 3 * stride);
    acc ^= a.x ^ b.y ^ c.z ^ d.w;
  }
  for (; i < n; i += stride) acc ^= p[i].x;
  keep(acc, sink);
}

// The decode kernel's ring over `tiles` K+V tiles: wait for tile t, barrier, issue tile
// t + kStages - 1 with load(tile, stage).
template <int kStages, typename Load>
__device__ __forceinline__ void stream_ring(const char* ring, int tiles, Load load,
                                            unsigned* sink) {
  const int tid = static_cast<int>(threadIdx.x);
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < tiles) load(s, s);
    cp_async_commit();
  }
  unsigned acc = 0;
  for (int t = 0; t < tiles; ++t) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    if (t + kStages - 1 < tiles) load(t + kStages - 1, (t + kStages - 1) % kStages);
    cp_async_commit();
    acc ^=
        reinterpret_cast<const unsigned*>(ring + (t % kStages) * 2 * kTileBytes)[tid * 67 % 4096];
  }
  keep(acc, sink);
}

// The decode kernel's ring: wait for tile t, barrier, issue tile t + kStages - 1.
template <int kStages, Copy kCopy>
__global__ void __launch_bounds__(128)
    ring_cp_async(const __nv_bfloat16* k, const __nv_bfloat16* v, int seqlen, int splits, int order,
                  unsigned* sink) {
  extern __shared__ uint4 smem[];
  char* ring = reinterpret_cast<char*>(smem);
  const BlockKeys bk = block_keys(seqlen, splits, order);
  const int tid = static_cast<int>(threadIdx.x);
  const int chunk = tid % 16;
  const int row = tid / 16;
  const size_t base = static_cast<size_t>(bk.b) * seqlen * kHeads * kDim + bk.h * kDim + chunk * 8;
  const uint64_t policy = kCopy == Copy::kEvictFirst ? evict_first_policy() : 0;
  const auto load = [&](int t, int stage) {
    char* dst = ring + stage * 2 * kTileBytes + row * 256 + chunk * 16;
#pragma unroll
    for (int x = 0; x < kTileKeys / 8; ++x) {
      const size_t off =
          base + static_cast<size_t>((bk.t0 + t) * kTileKeys + row + 8 * x) * kHeads * kDim;
      copy16<kCopy>(dst + x * 8 * 256, k + off, policy);
      copy16<kCopy>(dst + kTileBytes + x * 8 * 256, v + off, policy);
    }
  };
  stream_ring<kStages>(ring, bk.tiles, load, sink);
}

// Block i streams its own contiguous chunk of K and of V through a 3-stage ring.
__global__ void __launch_bounds__(128)
    chunk_cp_async(const char* k, const char* v, size_t chunk_bytes, unsigned* sink) {
  extern __shared__ uint4 smem[];
  char* ring = reinterpret_cast<char*>(smem);
  const int tid = static_cast<int>(threadIdx.x);
  const char* kb = k + blockIdx.x * chunk_bytes;
  const char* vb = v + blockIdx.x * chunk_bytes;
  const int tiles = static_cast<int>(chunk_bytes / kTileBytes);
  const auto load = [&](int t, int stage) {
    char* dst = ring + stage * 2 * kTileBytes;
#pragma unroll
    for (int x = 0; x < kTileBytes / 2048; ++x) {
      const size_t off = static_cast<size_t>(t) * kTileBytes + x * 2048 + tid * 16;
      copy16<Copy::kHint256>(dst + x * 2048 + tid * 16, kb + off, 0);
      copy16<Copy::kHint256>(dst + kTileBytes + x * 2048 + tid * 16, vb + off, 0);
    }
  };
  stream_ring<3>(ring, tiles, load, sink);
}

// Register loads of the per-(sequence, head, split) pattern; no shared memory.
__global__ void __launch_bounds__(256) regs_ldcs(const __nv_bfloat16* k, const __nv_bfloat16* v,
                                                 int seqlen, int splits, unsigned* sink) {
  const BlockKeys bk = block_keys(seqlen, splits, 0);
  const int tid = static_cast<int>(threadIdx.x);
  const int chunk = tid % 16;
  const int row = tid / 16;  // 16 rows a pass
  const size_t base = static_cast<size_t>(bk.b) * seqlen * kHeads * kDim + bk.h * kDim + chunk * 8;
  const int j0 = bk.t0 * kTileKeys;
  const int keys = bk.tiles * kTileKeys;
  unsigned acc = 0;
  for (int j = 0; j + 128 <= keys; j += 128) {
    uint4 a[8];
    uint4 c[8];
#pragma unroll
    for (int x = 0; x < 8; ++x) {
      const size_t off = base + static_cast<size_t>(j0 + j + row + 16 * x) * kHeads * kDim;
      a[x] = __ldcs(reinterpret_cast<const uint4*>(k + off));
      c[x] = __ldcs(reinterpret_cast<const uint4*>(v + off));
    }
#pragma unroll
    for (int x = 0; x < 8; ++x) acc ^= a[x].x ^ c[x].y;
  }
  keep(acc, sink);
}

// One thread issues a stage's four boxes (two 64-column panels of K, then of V) on its mbarrier.
template <int kStages, bool kEvictFirst>
__global__ void __launch_bounds__(128)
    ring_tma(const __grid_constant__ CUtensorMap tk, const __grid_constant__ CUtensorMap tv,
             int seqlen, int splits, unsigned* sink) {
#if JAX_FLASH_SM90A
  using namespace jax_flash::cuda::sm90;
  extern __shared__ uint8_t raw[];
  const uint32_t raw_addr = smem_addr(raw);
  const uint32_t base = (raw_addr + 1023u) & ~1023u;
  const uint8_t* base_ptr = raw + (base - raw_addr);
  const uint32_t bars = base + kStages * 2 * kTileBytes;
  const BlockKeys bk = block_keys(seqlen, splits, 0);
  const int tid = static_cast<int>(threadIdx.x);
  const uint64_t policy = kEvictFirst ? evict_first_policy() : 0;
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) mbar_init(bars + 8 * s, 1);
    fence_barrier_init();
  }
  __syncthreads();
  const auto box = [&](uint32_t dst, const CUtensorMap* map, uint32_t bar, int col, int row) {
    if constexpr (kEvictFirst) {
      asm volatile(
          "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
          ".L2::cache_hint [%0], [%1, {%3, %4, %5, %6}], [%2], %7;\n" ::"r"(dst),
          "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(col), "r"(bk.h), "r"(row), "r"(bk.b),
          "l"(policy)
          : "memory");
    } else {
      tma_load_4d(dst, map, bar, col, bk.h, row, bk.b);
    }
  };
  const auto load = [&](int t, int stage) {
    const uint32_t dst = base + stage * 2 * kTileBytes;
    const uint32_t bar = bars + 8 * stage;
    mbar_arrive_expect_tx(bar, 2 * kTileBytes);
    const int row = (bk.t0 + t) * kTileKeys;
    for (int p = 0; p < 2; ++p) {
      box(dst + p * kTileKeys * 128, &tk, bar, p * 64, row);
      box(dst + kTileBytes + p * kTileKeys * 128, &tv, bar, p * 64, row);
    }
  };
  if (tid == 0) {
    for (int s = 0; s < kStages - 1 && s < bk.tiles; ++s) load(s, s);
  }
  unsigned acc = 0;
  for (int t = 0; t < bk.tiles; ++t) {
    const int stage = t % kStages;
    mbar_wait(bars + 8 * stage, (t / kStages) & 1);
    acc ^= reinterpret_cast<const unsigned*>(base_ptr + stage * 2 * kTileBytes)[tid * 67 % 4096];
    __syncthreads();  // every thread is done with stage (t - 1) % kStages
    if (tid == 0 && t + kStages - 1 < bk.tiles) load(t + kStages - 1, (t + kStages - 1) % kStages);
  }
  keep(acc, sink);
#endif
}

struct Case {
  int batch, seqlen, splits;
};

struct Cache {
  size_t elems = 0;  // of K (and of V)
  std::vector<__nv_bfloat16*> k, v;
  std::vector<CUtensorMap> tk, tv;
};

template <typename Launch>
void time_it(const Case& c, const Cache& cache, const char* name, int order, Launch launch) {
  const size_t bytes = 2 * cache.elems * 2;
  const int copies = static_cast<int>(cache.k.size());
  for (int i = 0; i < 3; ++i) launch(i % copies);
  CHECK_CUDA(cudaDeviceSynchronize());
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  const int reps = bytes > (size_t{1} << 30) ? 20 : 200;
  CHECK_CUDA(cudaEventRecord(e0));
  for (int i = 0; i < reps; ++i) launch(i % copies);
  CHECK_CUDA(cudaEventRecord(e1));
  CHECK_CUDA(cudaEventSynchronize(e1));
  CHECK_CUDA(cudaGetLastError());
  float ms = 0.f;
  CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
  CHECK_CUDA(cudaEventDestroy(e0));
  CHECK_CUDA(cudaEventDestroy(e1));
  const double us = ms * 1e3 / reps;
  std::printf("B=%-2d S=%-5d splits=%-2d order=%d %-22s %8.2f us %7.0f GB/s\n", c.batch, c.seqlen,
              c.splits, order, name, us, bytes / us * 1e-3);
}

template <int kStages, Copy kCopy>
void run_ring(const Case& c, const Cache& cache, const char* name, int order, unsigned* sink) {
  const int smem = kStages * 2 * kTileBytes;
  CHECK_CUDA(cudaFuncSetAttribute(ring_cp_async<kStages, kCopy>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const int blocks = c.batch * kHeads * c.splits;
  time_it(c, cache, name, order, [&](int i) {
    ring_cp_async<kStages, kCopy>
        <<<blocks, 128, smem>>>(cache.k[i], cache.v[i], c.seqlen, c.splits, order, sink);
  });
}

template <int kStages, bool kEvictFirst>
void run_tma(const Case& c, const Cache& cache, const char* name, unsigned* sink) {
  const int smem = kStages * 2 * kTileBytes + 8 * kStages + 1024;
  CHECK_CUDA(cudaFuncSetAttribute(ring_tma<kStages, kEvictFirst>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const int blocks = c.batch * kHeads * c.splits;
  time_it(c, cache, name, 0, [&](int i) {
    ring_tma<kStages, kEvictFirst>
        <<<blocks, 128, smem>>>(cache.tk[i], cache.tv[i], c.seqlen, c.splits, sink);
  });
}

}  // namespace

int main() {
  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  unsigned* sink = nullptr;
  CHECK_CUDA(cudaMalloc(&sink, 4));
  // The decode benchmark's cells (GQA 32 / 8, head_dim 128) at the decode call's split counts,
  // and the same bytes with the head fastest in the grid.
  const Case cases[] = {{32, 65536, 1}, {8, 65536, 4}, {1, 65536, 32}, {1, 8192, 32}};
  for (const Case& c : cases) {
    Cache cache;
    cache.elems = static_cast<size_t>(c.batch) * c.seqlen * kHeads * kDim;
    const size_t bytes = 2 * cache.elems * 2;
    const int copies = bytes < (size_t{1} << 30) ? 8 : 1;
    cache.k.resize(copies);
    cache.v.resize(copies);
    cache.tk.resize(copies);
    cache.tv.resize(copies);
    for (int i = 0; i < copies; ++i) {
      CHECK_CUDA(cudaMalloc(&cache.k[i], cache.elems * 2));
      CHECK_CUDA(cudaMalloc(&cache.v[i], cache.elems * 2));
      CHECK_CUDA(cudaMemset(cache.k[i], 0, cache.elems * 2));
      CHECK_CUDA(cudaMemset(cache.v[i], 0, cache.elems * 2));
      if (!jax_flash::cuda::sm90::encode_bshd(&cache.tk[i], CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                                              cache.k[i], c.batch, c.seqlen, kHeads, kDim,
                                              kTileKeys) ||
          !jax_flash::cuda::sm90::encode_bshd(&cache.tv[i], CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                                              cache.v[i], c.batch, c.seqlen, kHeads, kDim,
                                              kTileKeys)) {
        std::printf("tensor map encoding failed\n");
        return 1;
      }
    }
    time_it(c, cache, "flat ldcs", 0, [&](int i) {
      const size_t n = cache.elems * 2 / 16;
      read_flat<<<sms * 4, 512>>>(reinterpret_cast<const uint4*>(cache.k[i]), n, sink);
      read_flat<<<sms * 4, 512>>>(reinterpret_cast<const uint4*>(cache.v[i]), n, sink);
    });
    run_ring<3, Copy::kHint256>(c, cache, "cp.async L2::256B", 0, sink);
    run_ring<3, Copy::kHint256>(c, cache, "cp.async L2::256B", 1, sink);
    run_ring<6, Copy::kHint256>(c, cache, "cp.async 256B 6 st", 0, sink);
    run_ring<3, Copy::kPlain>(c, cache, "cp.async plain", 0, sink);
    run_ring<3, Copy::kEvictFirst>(c, cache, "cp.async evict_first", 0, sink);
    run_ring<6, Copy::kEvictFirst>(c, cache, "cp.async ef 6 st", 0, sink);
    const int blocks = c.batch * kHeads * c.splits;
    time_it(c, cache, "ldcs regs", 0, [&](int i) {
      regs_ldcs<<<blocks, 256>>>(cache.k[i], cache.v[i], c.seqlen, c.splits, sink);
    });
    run_tma<3, false>(c, cache, "tma 3 stages", sink);
    run_tma<4, false>(c, cache, "tma 4 stages", sink);
    run_tma<6, false>(c, cache, "tma 6 stages", sink);
    run_tma<4, true>(c, cache, "tma evict_first 4 st", sink);
    for (size_t chunk : {size_t{16} << 20, size_t{1} << 20, size_t{128} << 10}) {
      if (chunk > cache.elems * 2 / 64) continue;
      const int n = static_cast<int>(cache.elems * 2 / chunk);
      const int smem = 3 * 2 * kTileBytes;
      CHECK_CUDA(
          cudaFuncSetAttribute(chunk_cp_async, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      char name[64];
      std::snprintf(name, sizeof(name), "chunks %zuK x%d", chunk >> 10, n);
      time_it(c, cache, name, 0, [&](int i) {
        chunk_cp_async<<<n, 128, smem>>>(reinterpret_cast<const char*>(cache.k[i]),
                                         reinterpret_cast<const char*>(cache.v[i]), chunk, sink);
      });
    }
    for (int i = 0; i < copies; ++i) {
      CHECK_CUDA(cudaFree(cache.k[i]));
      CHECK_CUDA(cudaFree(cache.v[i]));
    }
  }
  CHECK_CUDA(cudaFree(sink));
  return 0;
}
