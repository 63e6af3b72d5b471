// Programmatic dependent launch (sm_90+): a kernel launched as the programmatic dependent of the
// previous kernel on its stream may start while that kernel still runs, once every block of it
// has allowed it; the dependent's blocks wait for the previous grid's completion (and memory)
// where they call wait_for_primary. This hides the second kernel's launch latency in a two-pass
// call (decode's split pass and merge; the segment summaries and the segment-id attention
// kernels). On older devices both calls compile to nothing and the launch attribute makes
// the launch an ordinary, stream-ordered one.
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace jax_flash::cuda {

__device__ __forceinline__ void allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_for_primary() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// kernel<<<grid, threads, smem, stream>>>(args...) as the programmatic dependent of the kernel
// before it on `stream`.
template <typename... Params, typename... Args>
cudaError_t launch_dependent(void (*kernel)(Params...), unsigned grid, unsigned threads,
                             size_t smem, cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace jax_flash::cuda
