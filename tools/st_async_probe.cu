// Probe: does st.async (an async-proxy store counted on an mbarrier's transaction) into a CTA's own
// shared memory work without a cluster launch, with a cluster of one CTA, with clusters of two?
// Each CTA's thread 0 arms an mbarrier for 4 bytes, st.async's 1000 + its block index, all
// threads wait for the phase and thread 0 reads the value back. Build: nvcc -std=c++17
// -gencode=arch=compute_90a,code=sm_90a tools/st_async_probe.cu; run: ./a.out CLUSTER (0, 1, 2),
// each in its own process (a failed launch leaves the context unusable).
#include <cuda_runtime.h>

#include <cstdio>
__global__ void probe(int* out) {
  __shared__ alignas(8) unsigned long long bar;
  __shared__ alignas(16) int slot[4];
  const unsigned b = static_cast<unsigned>(__cvta_generic_to_shared(&bar));
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(&slot[0]));
  if (threadIdx.x == 0) {
    slot[0] = -7;
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(b) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], 4;" ::"r"(b) : "memory");
    const int v = 1000 + static_cast<int>(blockIdx.x);
    asm volatile(
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(s),
        "r"(v), "r"(b)
        : "memory");
  }
  unsigned done = 0;
  while (!done) {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0; selp.u32 %0, 1, 0, "
        "p; }"
        : "=r"(done)
        : "r"(b)
        : "memory");
  }
  if (threadIdx.x == 0) out[blockIdx.x] = slot[0];
}
int run(int cluster) {
  int* d;
  cudaMalloc(&d, 8 * sizeof(int));
  cudaMemset(d, 0, 8 * sizeof(int));
  cudaError_t e;
  if (cluster == 0) {
    probe<<<4, 32>>>(d);
    e = cudaGetLastError();
  } else {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(4);
    cfg.blockDim = dim3(32);
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = cluster;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    e = cudaLaunchKernelEx(&cfg, probe, d);
  }
  cudaError_t s = cudaDeviceSynchronize();
  int h[4] = {0, 0, 0, 0};
  cudaMemcpy(h, d, sizeof(h), cudaMemcpyDeviceToHost);
  std::printf("cluster=%d launch=%s sync=%s out=%d %d %d %d\n", cluster, cudaGetErrorString(e),
              cudaGetErrorString(s), h[0], h[1], h[2], h[3]);
  cudaFree(d);
  return s == cudaSuccess;
}
int main(int argc, char** argv) {
  const int c = argc > 1 ? atoi(argv[1]) : 0;
  return run(c) ? 0 : 1;
}
