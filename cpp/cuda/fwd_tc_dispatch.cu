// The one place where the forward's runtime values (dtype, head_dim, mask features) become
// template arguments. Values the tensor-core kernel does not take are cudaErrorInvalidValue,
// features it cannot honour cudaErrorNotSupported; nothing falls back to another kernel.
#include <cuda_runtime.h>

#include <climits>
#include <cmath>

#include "common/params.h"
#include "cuda/fwd_tc.cuh"
#include "cuda/kernels.h"

namespace jax_flash::cuda {
namespace {

template <typename T, int kHeadDim, bool kBand, bool kSegments>
cudaError_t fwd_softcap_switch(const FwdParams& params, cudaStream_t stream) {
  return params.mask.softcap > 0.0
             ? fwd_tc::run_fwd<T, kHeadDim, kBand, kSegments, true>(params, stream)
             : fwd_tc::run_fwd<T, kHeadDim, kBand, kSegments, false>(params, stream);
}

// Segment ids run on the band kernel (an unbounded band costs only the boundary tiles' compares);
// an unbounded band without them needs only the sequence-end mask.
template <typename T, int kHeadDim>
cudaError_t fwd_mask_switch(const FwdParams& params, cudaStream_t stream) {
  if (params.mask.segments.enabled()) {
    return fwd_softcap_switch<T, kHeadDim, true, true>(params, stream);
  }
  if (!params.mask.band.unbounded()) {
    return fwd_softcap_switch<T, kHeadDim, true, false>(params, stream);
  }
  return fwd_softcap_switch<T, kHeadDim, false, false>(params, stream);
}

template <typename T>
cudaError_t fwd_head_dim_switch(const FwdParams& params, cudaStream_t stream) {
  switch (params.head_dim) {
    case 64:
      return fwd_mask_switch<T, 64>(params, stream);
    case 128:
      return fwd_mask_switch<T, 128>(params, stream);
    case 256:
      return fwd_mask_switch<T, 256>(params, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

// The kernel indexes sequence positions in 32-bit ints and folds scale * log2(e) (or
// softcap * log2(e)) into one FMA, which keeps the row max only for a positive factor.
bool fwd_params_supported(const FwdParams& p) {
  constexpr int64_t kMaxSeqlen = INT_MAX / 4;
  const SeqLayout& l = p.layout;
  if (!params_well_formed(p)) return false;
  return l.varlen() ? l.total_q <= kMaxSeqlen && l.total_k <= kMaxSeqlen
                    : l.seqlen_q <= kMaxSeqlen && l.seqlen_k <= kMaxSeqlen;
}

}  // namespace

int fwd_tensor_core_smem_bytes(int64_t head_dim, bool segments) {
  // Traits depend on the element type only through its size, which both half types share.
  switch (head_dim) {
    case 64:
      return fwd_tc::FwdTraitsFor<__half, 64>::smem_bytes(segments);
    case 128:
      return fwd_tc::FwdTraitsFor<__half, 128>::smem_bytes(segments);
    case 256:
      return fwd_tc::FwdTraitsFor<__half, 256>::smem_bytes(segments);
    default:
      return 0;
  }
}

cudaError_t fwd_tensor_core(const FwdParams& params, DType dtype, cudaStream_t stream) {
  if (!fwd_params_supported(params)) return cudaErrorInvalidValue;
  if (dtype != DType::kF16 && dtype != DType::kBF16) return cudaErrorInvalidValue;
  if (params.head_dim != 64 && params.head_dim != 128 && params.head_dim != 256) {
    return cudaErrorInvalidValue;
  }
  // Segment ids are per dense batch row; a packed call has none.
  if (params.layout.varlen() && params.mask.segments.enabled()) return cudaErrorNotSupported;
  if (params.layout.rows_q() == 0 || params.heads_q == 0) return cudaSuccess;
  return dtype == DType::kF16 ? fwd_head_dim_switch<__half>(params, stream)
                              : fwd_head_dim_switch<__nv_bfloat16>(params, stream);
}

}  // namespace jax_flash::cuda
