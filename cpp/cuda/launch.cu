// Chooses the kernel family by element type and device: for f16/bf16 the Hopper wgmma kernels
// where they apply (sm_90; forward at head_dim 64/128/256, backward at 64/128) and the mma.sync
// kernels elsewhere; exact scalar math for f32/f64 (no silent TF32).
#include "cuda/bwd_wgmma.h"
#include "cuda/fwd_wgmma.h"
#include "cuda/kernels.h"
#include "cuda/launch.h"

namespace jax_flash::cuda {

cudaError_t attention_fwd(const FwdParams& params, DType dtype, cudaStream_t stream) {
  if (!plain_causal_or_full(params)) return cudaErrorNotSupported;
  switch (dtype) {
    case DType::kF16:
    case DType::kBF16:
      if (fwd_wgmma_supported(params, dtype)) return fwd_wgmma(params, dtype, stream);
      return fwd_tensor_core(params, dtype, stream);
    case DType::kF32:
    case DType::kF64:
      return fwd_simt(params, dtype, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t attention_bwd(const BwdParams& params, DType dtype, cudaStream_t stream) {
  if (!plain_causal_or_full(params)) return cudaErrorNotSupported;
  switch (dtype) {
    case DType::kF16:
    case DType::kBF16:
      if (params.dq_accum == nullptr) return cudaErrorInvalidValue;
      if (bwd_wgmma_supported(params, dtype)) return bwd_wgmma(params, dtype, stream);
      return bwd_tensor_core(params, dtype, stream);
    case DType::kF32:
    case DType::kF64:
      return bwd_simt(params, dtype, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace jax_flash::cuda
