// Host side of the Hopper wgmma forward: checks, TMA tensor maps and the dtype -> head_dim ->
// causal dispatch to the kernel instantiations.
#include <cstdint>
#include <limits>

#include "cuda/fwd_wgmma.cuh"
#include "cuda/fwd_wgmma.h"
#include "cuda/sm90_host.h"

namespace jax_flash::cuda {
namespace {

using sm90::aligned;
using sm90::current_device_is_sm90;
using sm90::encode_bshd;
using sm90::FwdWgmmaArgs;
using sm90::FwdWgmmaTraits;

bool params_supported(const FwdParams& p, DType dtype) {
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  if (!sm90::common_params_supported(p, dtype)) return false;
  if (p.head_dim != 64 && p.head_dim != 128 && p.head_dim != 256) return false;
  if (p.batch > kIntMax || p.seqlen_q > kIntMax || p.seqlen_k > kIntMax || p.heads_q > kIntMax) {
    return false;
  }
  // 128 is the smallest query tile of the family, so this bounds every grid.
  const int64_t m_blocks = (p.seqlen_q + 127) / 128;
  if (m_blocks * p.heads_q * p.batch > kIntMax) return false;
  return aligned(p.q, 16) && aligned(p.k, 16) && aligned(p.v, 16) && aligned(p.o, 16);
}

template <typename T, int kHeadDim, bool kCausal, bool kLongKeys>
cudaError_t launch(const FwdParams& p, CUtensorMapDataType type, cudaStream_t stream) {
  using Tr = FwdWgmmaTraits<T, kHeadDim, kCausal, kLongKeys>;
  CUtensorMap tm_q, tm_k, tm_v, tm_o;
  if (!encode_bshd(&tm_q, type, p.q, p.batch, p.seqlen_q, p.heads_q, kHeadDim, Tr::kBlockM) ||
      !encode_bshd(&tm_k, type, p.k, p.batch, p.seqlen_k, p.heads_kv, kHeadDim, Tr::kBlockN) ||
      !encode_bshd(&tm_v, type, p.v, p.batch, p.seqlen_k, p.heads_kv, kHeadDim, Tr::kBlockN) ||
      !encode_bshd(&tm_o, type, p.o, p.batch, p.seqlen_q, p.heads_q, kHeadDim,
                   Tr::kBlockM / Tr::kConsumerWarpgroups)) {
    return cudaErrorInvalidValue;
  }
  FwdWgmmaArgs args;
  args.lse = static_cast<float*>(p.lse);
  args.seqlen_q = static_cast<int>(p.seqlen_q);
  args.seqlen_k = static_cast<int>(p.seqlen_k);
  args.heads_q = static_cast<int>(p.heads_q);
  args.group = static_cast<int>(p.heads_q / p.heads_kv);
  args.m_blocks = static_cast<int>((p.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM);
  args.scale_log2 = static_cast<float>(p.softmax_scale * 1.4426950408889634);

  const auto kernel = sm90::fwd_wgmma_kernel<Tr>;
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes);
  if (err != cudaSuccess) return err;
  const unsigned grid = static_cast<unsigned>(args.m_blocks * p.heads_q * p.batch);
  kernel<<<grid, Tr::kThreads, Tr::kSmemBytes, stream>>>(args, tm_q, tm_k, tm_v, tm_o);
  return cudaGetLastError();
}

// Instantiates the long-keys variant only where its tile differs.
template <typename T, int kHeadDim, bool kCausal>
cudaError_t dispatch_length(const FwdParams& p, CUtensorMapDataType type, cudaStream_t stream) {
  constexpr bool kDiffers = sm90::fwd_wgmma_tile(kHeadDim, kCausal, true).block_n !=
                            sm90::fwd_wgmma_tile(kHeadDim, kCausal, false).block_n;
  if constexpr (kDiffers) {
    if (p.seqlen_k >= sm90::kLongKeys) return launch<T, kHeadDim, kCausal, true>(p, type, stream);
  }
  return launch<T, kHeadDim, kCausal, false>(p, type, stream);
}

template <typename T, int kHeadDim>
cudaError_t dispatch_causal(const FwdParams& p, CUtensorMapDataType type, cudaStream_t stream) {
  return p.causal ? dispatch_length<T, kHeadDim, true>(p, type, stream)
                  : dispatch_length<T, kHeadDim, false>(p, type, stream);
}

template <typename T>
cudaError_t dispatch_head_dim(const FwdParams& p, CUtensorMapDataType type, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64:
      return dispatch_causal<T, 64>(p, type, stream);
    case 128:
      return dispatch_causal<T, 128>(p, type, stream);
    case 256:
      return dispatch_causal<T, 256>(p, type, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace

bool fwd_wgmma_supported(const FwdParams& params, DType dtype) {
  return params_supported(params, dtype) && current_device_is_sm90();
}

cudaError_t fwd_wgmma(const FwdParams& params, DType dtype, cudaStream_t stream) {
  if (!current_device_is_sm90()) return cudaErrorNotSupported;
  if (!params_supported(params, dtype)) return cudaErrorInvalidValue;
  if (params.batch == 0 || params.seqlen_q == 0) return cudaSuccess;
  if (dtype == DType::kBF16) {
    return dispatch_head_dim<__nv_bfloat16>(params, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, stream);
  }
  return dispatch_head_dim<__half>(params, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, stream);
}

}  // namespace jax_flash::cuda
