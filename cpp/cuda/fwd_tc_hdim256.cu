// Explicit instantiations of the tensor-core forward for head_dim 256 (one file per head_dim so
// that the build compiles them in parallel).
#include "cuda/fwd_tc.cuh"

namespace jax_flash::cuda::fwd_tc {

template cudaError_t run_fwd<__half, 256, false>(const FwdParams&, cudaStream_t);
template cudaError_t run_fwd<__half, 256, true>(const FwdParams&, cudaStream_t);
template cudaError_t run_fwd<__nv_bfloat16, 256, false>(const FwdParams&, cudaStream_t);
template cudaError_t run_fwd<__nv_bfloat16, 256, true>(const FwdParams&, cudaStream_t);

}  // namespace jax_flash::cuda::fwd_tc
