// The CUDA entry points the FFI layer calls: one per direction, choosing the kernel family by
// element type. Asynchronous on `stream`; returns the first CUDA error.
#pragma once

#include <cuda_runtime.h>

#include "common/params.h"

namespace jax_flash::cuda {

cudaError_t attention_fwd(const FwdParams& params, DType dtype, cudaStream_t stream);
// For f16/bf16, params.dq_accum must point at an fp32 scratch of the size of dQ.
cudaError_t attention_bwd(const BwdParams& params, DType dtype, cudaStream_t stream);

}  // namespace jax_flash::cuda
