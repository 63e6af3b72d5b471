// Hopper-only forward kernel family: FlashAttention forward on warpgroup MMA (wgmma) with TMA
// loads, for f16/bf16 on devices of compute capability 9.0. Asynchronous on `stream`; never
// synchronises or allocates. cuda/launch.cu prefers it wherever fwd_wgmma_supported() holds.
#pragma once

#include <cuda_runtime.h>

#include "common/params.h"

namespace jax_flash::cuda {

// True when fwd_wgmma can run `params` on the current device: compute capability 9.0, dtype
// kF16/kBF16, head_dim 64, 128 or 256, rows, lengths and heads below 2^31, 16-byte aligned Q, K, V
// and O, a finite positive softmax scale, and a well-formed mask: band bounds >= 0 (kUnbounded for
// none), softcap finite and >= 0, segment ids only on dense batches. Every mask feature and both
// layouts (dense and packed) are served; nothing else is a reason to return false.
bool fwd_wgmma_supported(const FwdParams& params, DType dtype);

// Dense: Q, O [batch, seqlen_q, heads_q, head_dim]; K, V [batch, seqlen_k, heads_kv, head_dim];
// lse [batch, heads_q, seqlen_q]. Packed: Q, O [total_q, heads_q, head_dim]; K, V [total_k,
// heads_kv, head_dim]; lse [heads_q, total_q]. lse is float32; every row of O and lse is written.
// Returns cudaErrorNotSupported on devices other than compute capability 9.0 and
// cudaErrorInvalidValue for parameters fwd_wgmma_supported rejects.
cudaError_t fwd_wgmma(const FwdParams& params, DType dtype, cudaStream_t stream);

}  // namespace jax_flash::cuda
