// Explicit instantiations of the tensor-core forward for head_dim 64 (one file per head_dim so
// that the build compiles them in parallel).
#include "cuda/fwd_tc.cuh"

namespace jax_flash::cuda::fwd_tc {

template cudaError_t run_fwd<__half, 64, false>(const FwdParams&, cudaStream_t);
template cudaError_t run_fwd<__half, 64, true>(const FwdParams&, cudaStream_t);
template cudaError_t run_fwd<__nv_bfloat16, 64, false>(const FwdParams&, cudaStream_t);
template cudaError_t run_fwd<__nv_bfloat16, 64, true>(const FwdParams&, cudaStream_t);

}  // namespace jax_flash::cuda::fwd_tc
