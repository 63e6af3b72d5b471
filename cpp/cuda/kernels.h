// Entry points of the CUDA kernel families. Each takes a params struct and XLA's stream, launches
// asynchronously, never synchronises or allocates, and returns the launch status.
#pragma once

#include <cuda_runtime.h>

#include "common/params.h"

namespace jax_flash::cuda {

// Tensor-core path, DType::kF16 / kBF16. head_dim must be 64, 128 or 256 (the Python layer
// zero-pads other head dims up to the next one). Returns cudaErrorInvalidValue otherwise.
cudaError_t fwd_tensor_core(const FwdParams& params, DType dtype, cudaStream_t stream);
// Needs params.dq_accum (zeroed inside, on the stream).
cudaError_t bwd_tensor_core(const BwdParams& params, DType dtype, cudaStream_t stream);

// Dynamic shared memory, in bytes, of the tensor-core kernels at head_dim 64/128/256 (0 for other
// head dims), with or without segment ids: what a device's opt-in per-block limit must allow.
// The Hopper (wgmma) kernels need at most 227 KB, which every sm_90 device has.
int fwd_tensor_core_smem_bytes(int64_t head_dim, bool segments);
int bwd_tensor_core_smem_bytes(int64_t head_dim, bool segments);

// Exact scalar path, DType::kF32 / kF64: float32 math stays float32 (no TF32), float64 stays
// float64. Any head_dim in [1, 256]. Does not use dq_accum.
cudaError_t fwd_simt(const FwdParams& params, DType dtype, cudaStream_t stream);
cudaError_t bwd_simt(const BwdParams& params, DType dtype, cudaStream_t stream);

}  // namespace jax_flash::cuda
