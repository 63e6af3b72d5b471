// The CUDA decode entry point (common/decode_params.h): the split pass and, when
// params.num_splits > 1, the merge pass, asynchronous on `stream`. Returns the first CUDA error, or
// cudaErrorInvalidValue / cudaErrorNotSupported for params it cannot serve.
#pragma once

#include <cuda_runtime.h>

#include "common/decode_params.h"
#include "common/params.h"

namespace jax_flash::cuda {

cudaError_t decode_fwd(const DecodeParams& params, DType dtype, cudaStream_t stream);

}  // namespace jax_flash::cuda
