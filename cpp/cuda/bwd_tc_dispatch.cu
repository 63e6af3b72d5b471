// The single place where the backward's runtime values (dtype, head_dim, mask features) become
// template arguments. Values the tensor-core kernel does not take are cudaErrorInvalidValue,
// features it cannot honour cudaErrorNotSupported; nothing falls back to another kernel.
#include "cuda/bwd_tc.cuh"
#include "cuda/kernels.h"

namespace jax_flash::cuda {
namespace {

template <typename T, int kHeadDim, bool kBand, bool kSegments>
cudaError_t dispatch_softcap(const BwdParams& params, cudaStream_t stream) {
  return params.mask.softcap > 0.0
             ? bwd_tc::run_bwd<T, kHeadDim, kBand, kSegments, true>(params, stream)
             : bwd_tc::run_bwd<T, kHeadDim, kBand, kSegments, false>(params, stream);
}

// Segment ids run on the band kernel; an unbounded band without them needs only the
// sequence-end mask. Sinks need nothing here: P = exp(s - lse) already includes them.
template <typename T, int kHeadDim>
cudaError_t dispatch_mask(const BwdParams& params, cudaStream_t stream) {
  if (params.mask.segments.enabled())
    return dispatch_softcap<T, kHeadDim, true, true>(params, stream);
  if (!params.mask.band.unbounded())
    return dispatch_softcap<T, kHeadDim, true, false>(params, stream);
  return dispatch_softcap<T, kHeadDim, false, false>(params, stream);
}

template <typename T>
cudaError_t dispatch_head_dim(const BwdParams& params, cudaStream_t stream) {
  switch (params.head_dim) {
    case 64:
      return dispatch_mask<T, 64>(params, stream);
    case 128:
      return dispatch_mask<T, 128>(params, stream);
    case 256:
      return dispatch_mask<T, 256>(params, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

bool valid_shapes(const BwdParams& p) {
  const SeqLayout& l = p.layout;
  if (!params_well_formed(p)) return false;
  // An empty tensor may come without storage; every other one must have it.
  const bool queries_ok =
      l.rows_q() == 0 || (p.q && p.dout && p.lse && p.delta && p.dq && p.dq_accum);
  const bool keys_ok = l.rows_k() == 0 || (p.k && p.v && p.dk && p.dv);
  return queries_ok && keys_ok;
}

}  // namespace

int bwd_tensor_core_smem_bytes(int64_t head_dim, bool segments) {
  // Traits depend on the element type only through its size, which both half types share.
  switch (head_dim) {
    case 64:
      return bwd_tc::BwdConfig<__half, 64>::Traits::smem_bytes(segments);
    case 128:
      return bwd_tc::BwdConfig<__half, 128>::Traits::smem_bytes(segments);
    case 256:
      return bwd_tc::BwdConfig<__half, 256>::Traits::smem_bytes(segments);
    default:
      return 0;
  }
}

cudaError_t bwd_tensor_core(const BwdParams& params, DType dtype, cudaStream_t stream) {
  if (!valid_shapes(params)) return cudaErrorInvalidValue;
  // Segment ids are per dense batch row; a packed call has none.
  if (params.layout.varlen() && params.mask.segments.enabled()) return cudaErrorNotSupported;
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
