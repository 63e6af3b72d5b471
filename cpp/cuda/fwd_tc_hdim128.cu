// Explicit instantiations of the tensor-core forward for head_dim 128 (one file per head_dim so
// that the build compiles them in parallel).
#include "cuda/fwd_tc.cuh"

namespace jax_flash::cuda::fwd_tc {

#define JAX_FLASH_FWD_TC_DEFINE(T, D, B, S, C) \
  template cudaError_t run_fwd<T, D, B, S, C>(const FwdParams&, cudaStream_t);
JAX_FLASH_TC_FLAGS(JAX_FLASH_FWD_TC_DEFINE, __half, 128)
JAX_FLASH_TC_FLAGS(JAX_FLASH_FWD_TC_DEFINE, __nv_bfloat16, 128)
#undef JAX_FLASH_FWD_TC_DEFINE

}  // namespace jax_flash::cuda::fwd_tc
