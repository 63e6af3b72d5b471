// Explicit instantiations of the tensor-core backward for head_dim 256 (one file per head dim so
// the build compiles them in parallel).
#include "cuda/bwd_tc.cuh"

namespace jax_flash::cuda::bwd_tc {

#define JAX_FLASH_BWD_TC_DEFINE(T, D, B, S, C) \
  template cudaError_t run_bwd<T, D, B, S, C>(const BwdParams&, cudaStream_t);
JAX_FLASH_TC_FLAGS(JAX_FLASH_BWD_TC_DEFINE, __half, 256)
JAX_FLASH_TC_FLAGS(JAX_FLASH_BWD_TC_DEFINE, __nv_bfloat16, 256)
#undef JAX_FLASH_BWD_TC_DEFINE

}  // namespace jax_flash::cuda::bwd_tc
