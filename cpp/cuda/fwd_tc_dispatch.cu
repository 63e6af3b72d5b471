// The one place where the forward's runtime values (dtype, head_dim, causal) become template
// arguments; anything the tensor-core kernel does not support is cudaErrorInvalidValue.
#include <cuda_runtime.h>

#include <climits>
#include <cmath>

#include "common/params.h"
#include "cuda/fwd_tc.cuh"
#include "cuda/kernels.h"

namespace jax_flash::cuda {
namespace {

template <typename T, int kHeadDim>
cudaError_t fwd_causal_switch(const FwdParams& params, cudaStream_t stream) {
  return params.causal ? fwd_tc::run_fwd<T, kHeadDim, true>(params, stream)
                       : fwd_tc::run_fwd<T, kHeadDim, false>(params, stream);
}

template <typename T>
cudaError_t fwd_head_dim_switch(const FwdParams& params, cudaStream_t stream) {
  switch (params.head_dim) {
    case 64:
      return fwd_causal_switch<T, 64>(params, stream);
    case 128:
      return fwd_causal_switch<T, 128>(params, stream);
    case 256:
      return fwd_causal_switch<T, 256>(params, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

// The kernel indexes sequence positions in 32-bit ints and folds scale * log2(e) into one FMA,
// which keeps the row max only for a positive scale.
bool fwd_params_supported(const FwdParams& p) {
  constexpr int64_t kMaxSeqlen = INT_MAX / 4;
  return p.batch >= 0 && p.heads_q >= 0 && p.heads_kv > 0 && p.heads_q % p.heads_kv == 0 &&
         p.seqlen_q >= 0 && p.seqlen_q <= kMaxSeqlen && p.seqlen_k >= 0 &&
         p.seqlen_k <= kMaxSeqlen && std::isfinite(p.softmax_scale) && p.softmax_scale > 0.0;
}

}  // namespace

cudaError_t fwd_tensor_core(const FwdParams& params, DType dtype, cudaStream_t stream) {
  if (!fwd_params_supported(params)) return cudaErrorInvalidValue;
  if (dtype != DType::kF16 && dtype != DType::kBF16) return cudaErrorInvalidValue;
  if (params.head_dim != 64 && params.head_dim != 128 && params.head_dim != 256) {
    return cudaErrorInvalidValue;
  }
  if (params.batch == 0 || params.heads_q == 0 || params.seqlen_q == 0) return cudaSuccess;
  return dtype == DType::kF16 ? fwd_head_dim_switch<__half>(params, stream)
                              : fwd_head_dim_switch<__nv_bfloat16>(params, stream);
}

}  // namespace jax_flash::cuda
