// Explicit instantiations of the tensor-core backward for head_dim 256 (one file per head dim so
// the build compiles them in parallel).
#include "cuda/bwd_tc.cuh"

namespace jax_flash::cuda::bwd_tc {

template cudaError_t run_bwd<__half, 256, false>(const BwdParams&, cudaStream_t);
template cudaError_t run_bwd<__half, 256, true>(const BwdParams&, cudaStream_t);
template cudaError_t run_bwd<__nv_bfloat16, 256, false>(const BwdParams&, cudaStream_t);
template cudaError_t run_bwd<__nv_bfloat16, 256, true>(const BwdParams&, cudaStream_t);

}  // namespace jax_flash::cuda::bwd_tc
