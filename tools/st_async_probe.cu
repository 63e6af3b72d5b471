// Probe: how a value written by one warp reaches another warp of its CTA under an mbarrier, and
// which launches each way needs. Warp 0's thread 0 arms an mbarrier and hands over 1000 + its
// block index; warp 1 waits for the phase and reads it from shared memory. Ways (second argument):
//   async   - st.async (an async-proxy store counted on the barrier's transaction bytes);
//   bulk    - a store to global memory, fence.proxy.async, then a 16-byte cp.async.bulk copy into
//             shared memory counted on the barrier (the TMA unit, as tensor loads);
//   generic - a plain shared store before the arrival (ordered by the arrival's release;
//             racecheck's reference case).
// First argument: cluster size, 0 for a launch without a cluster. Run each way in its own process
// (a failed launch leaves the context unusable), plainly and under compute-sanitizer.
// Build: nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a tools/st_async_probe.cu
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

enum Way { kAsync, kBulk, kGeneric };

__global__ void probe(int* out, int* slots, Way way) {
  __shared__ alignas(8) unsigned long long bar;
  __shared__ alignas(16) int slot[4];
  const unsigned b = static_cast<unsigned>(__cvta_generic_to_shared(&bar));
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(&slot[0]));
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(b) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int v = 1000 + static_cast<int>(blockIdx.x);
  if (threadIdx.x == 0) {
    if (way == kAsync) {
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], 4;" ::"r"(b) : "memory");
      asm volatile(
          "st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(s),
          "r"(v), "r"(b)
          : "memory");
    } else if (way == kBulk) {
      int* g = slots + 4 * blockIdx.x;
      g[0] = v;
      asm volatile("fence.proxy.async.global;" ::: "memory");
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], 16;" ::"r"(b) : "memory");
      asm volatile(
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], 16, "
          "[%2];" ::"r"(s),
          "l"(g), "r"(b)
          : "memory");
    } else {
      slot[0] = v;
      asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(b) : "memory");
    }
  }
  if (threadIdx.x == 32) {
    unsigned done = 0;
    while (!done) {
      asm volatile(
          "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0; selp.u32 %0, 1, "
          "0, p; }"
          : "=r"(done)
          : "r"(b)
          : "memory");
    }
    out[blockIdx.x] = slot[0];
  }
}

int main(int argc, char** argv) {
  const int cluster = argc > 1 ? std::atoi(argv[1]) : 0;
  const char* name = argc > 2 ? argv[2] : "async";
  const Way way = std::strcmp(name, "bulk") == 0      ? kBulk
                  : std::strcmp(name, "generic") == 0 ? kGeneric
                                                      : kAsync;
  int* d = nullptr;
  int* slots = nullptr;
  cudaMalloc(&d, 8 * sizeof(int));
  cudaMalloc(&slots, 4 * 8 * sizeof(int));
  cudaMemset(d, 0, 8 * sizeof(int));
  cudaError_t e;
  if (cluster == 0) {
    probe<<<4, 64>>>(d, slots, way);
    e = cudaGetLastError();
  } else {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(4);
    cfg.blockDim = dim3(64);
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = cluster;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    e = cudaLaunchKernelEx(&cfg, probe, d, slots, way);
  }
  const cudaError_t s = cudaDeviceSynchronize();
  int h[4] = {0, 0, 0, 0};
  cudaMemcpy(h, d, sizeof(h), cudaMemcpyDeviceToHost);
  std::printf("way=%s cluster=%d launch=%s sync=%s out=%d %d %d %d\n", name, cluster,
              cudaGetErrorString(e), cudaGetErrorString(s), h[0], h[1], h[2], h[3]);
  return s == cudaSuccess ? 0 : 1;
}
