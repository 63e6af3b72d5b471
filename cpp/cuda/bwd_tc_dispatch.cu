// The single place where the backward's runtime (dtype, head_dim, causal) becomes template
// arguments. Anything unsupported is cudaErrorInvalidValue, never a fallback.
#include "cuda/bwd_tc.cuh"
#include "cuda/kernels.h"

namespace jax_flash::cuda {
namespace {

template <typename T, int kHeadDim>
cudaError_t dispatch_causal(const BwdParams& params, cudaStream_t stream) {
  return params.causal ? bwd_tc::run_bwd<T, kHeadDim, true>(params, stream)
                       : bwd_tc::run_bwd<T, kHeadDim, false>(params, stream);
}

template <typename T>
cudaError_t dispatch_head_dim(const BwdParams& params, cudaStream_t stream) {
  switch (params.head_dim) {
    case 64:
      return dispatch_causal<T, 64>(params, stream);
    case 128:
      return dispatch_causal<T, 128>(params, stream);
    case 256:
      return dispatch_causal<T, 256>(params, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

bool valid_shapes(const BwdParams& p) {
  if (p.batch < 0 || p.seqlen_q < 0 || p.seqlen_k < 0) return false;
  if (p.heads_q < 1 || p.heads_kv < 1 || p.heads_q % p.heads_kv != 0) return false;
  if (!(p.softmax_scale > 0.0)) return false;
  const bool empty = p.batch == 0 || p.seqlen_q == 0 || p.seqlen_k == 0;
  return empty ||
         (p.q && p.k && p.v && p.dout && p.lse && p.delta && p.dq && p.dk && p.dv && p.dq_accum);
}

}  // namespace

cudaError_t bwd_tensor_core(const BwdParams& params, DType dtype, cudaStream_t stream) {
  if (!valid_shapes(params)) return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kF16:
      return dispatch_head_dim<__half>(params, stream);
    case DType::kBF16:
      return dispatch_head_dim<__nv_bfloat16>(params, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace jax_flash::cuda
