// Hopper-only backward kernel family, dispatched by cuda/launch.cu: FlashAttention backward on
// warpgroup MMA (wgmma) with TMA loads, for f16/bf16 with head_dim 64, 128 or 256 on devices of
// compute capability 9.0. tools/bwd_wgmma_check.cu tests it. Same contract as the tensor-core
// backward (cuda/bwd_tc.cuh): lse is the forward's natural-log lse, delta is supplied, dq_accum is
// fp32 scratch that this launcher zeroes and converts into dq. It serves all of MaskParams (band,
// segment ids on dense batches, soft-capping; sinks need nothing here, lse includes them) and
// both SeqLayouts (dense and packed cu_seqlens). Asynchronous on `stream`; never synchronises or
// allocates.
#pragma once

#include <cuda_runtime.h>

#include "common/params.h"

namespace jax_flash::cuda {

// True when bwd_wgmma can run `params` on the current device: compute capability 9.0, dtype
// kF16/kBF16, head_dim 64, 128 or 256, rows and heads below 2^31, 16-byte aligned Q/K/V/dO, a
// finite positive softmax scale, and no segment ids on a packed layout (the only MaskParams
// combination it does not serve, and one that no caller may pass).
bool bwd_wgmma_supported(const BwdParams& params, DType dtype);

// Returns cudaErrorNotSupported on devices other than compute capability 9.0 and for segment ids
// with a packed layout, and cudaErrorInvalidValue for other parameters bwd_wgmma_supported
// rejects.
cudaError_t bwd_wgmma(const BwdParams& params, DType dtype, cudaStream_t stream);

}  // namespace jax_flash::cuda
