// Host side of the Hopper wgmma backward: checks, TMA tensor maps, dq_accum zeroing, the
// dtype -> causal dispatch to the kernel instantiations and the dQ conversion.
#include <cstdint>
#include <limits>

#include "cuda/bwd_wgmma.cuh"
#include "cuda/bwd_wgmma.h"
#include "cuda/dq_convert.cuh"
#include "cuda/sm90_host.h"

namespace jax_flash::cuda {
namespace {

using sm90::aligned;
using sm90::BwdWgmmaArgs;
using sm90::BwdWgmmaTraits;
using sm90::current_device_is_sm90;
using sm90::encode_bshd;

bool params_supported(const BwdParams& p, DType dtype) {
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  if (!sm90::common_params_supported(p, dtype)) return false;
  if (p.head_dim != 64 && p.head_dim != 128) return false;
  // Positions (plus one tile) and head indices are int inside the kernel.
  if (p.batch > kIntMax || p.seqlen_q > kIntMax - 1024 || p.seqlen_k > kIntMax - 1024 ||
      p.heads_q > kIntMax) {
    return false;
  }
  const int64_t n_blocks = (p.seqlen_k + 127) / 128;
  const int64_t m_blocks = (p.seqlen_q + 63) / 64;
  if (n_blocks * p.heads_kv * p.batch > kIntMax) return false;
  if (m_blocks * (p.heads_q / p.heads_kv) > kIntMax) return false;
  const bool empty = p.batch == 0 || p.seqlen_q == 0 || p.seqlen_k == 0;
  if (empty) return true;
  if (!p.q || !p.k || !p.v || !p.dout || !p.lse || !p.delta || !p.dq || !p.dk || !p.dv ||
      !p.dq_accum) {
    return false;
  }
  // TMA sources need 16-byte alignment; dq_accum takes 8-byte vector reductions, dQ 8-byte and
  // dK/dV 4-byte stores.
  return aligned(p.q, 16) && aligned(p.k, 16) && aligned(p.v, 16) && aligned(p.dout, 16) &&
         aligned(p.dq_accum, 16) && aligned(p.dq, 8) && aligned(p.dk, 4) && aligned(p.dv, 4);
}

// Zeroes dq_accum, runs the main kernel and converts dQ, all on `stream`.
template <typename T, int kHeadDim, bool kCausal>
cudaError_t launch(const BwdParams& p, CUtensorMapDataType type, cudaStream_t stream) {
  using Tr = BwdWgmmaTraits<T, kHeadDim, kCausal>;
  const int64_t dq_elems = p.batch * p.seqlen_q * p.heads_q * Tr::kD;
  if (const cudaError_t err = zero_dq_accum(p.dq_accum, dq_elems, stream); err != cudaSuccess) {
    return err;
  }

  const int64_t n_blocks = (p.seqlen_k + Tr::kBlockN - 1) / Tr::kBlockN;
  const int64_t grid = n_blocks * p.heads_kv * p.batch;
  // With seqlen_q = 0 the kernel still runs to write zero dK and dV; its Q / dO maps go unread.
  if (grid > 0) {
    CUtensorMap tm_q, tm_k, tm_v, tm_do;
    if (!encode_bshd(&tm_q, type, p.q, p.batch, p.seqlen_q, p.heads_q, Tr::kD, Tr::kBlockM) ||
        !encode_bshd(&tm_do, type, p.dout, p.batch, p.seqlen_q, p.heads_q, Tr::kD, Tr::kBlockM) ||
        !encode_bshd(&tm_k, type, p.k, p.batch, p.seqlen_k, p.heads_kv, Tr::kD, Tr::kBlockN) ||
        !encode_bshd(&tm_v, type, p.v, p.batch, p.seqlen_k, p.heads_kv, Tr::kD, Tr::kBlockN)) {
      return cudaErrorInvalidValue;
    }
    BwdWgmmaArgs args;
    args.lse = static_cast<const float*>(p.lse);
    args.delta = static_cast<const float*>(p.delta);
    args.dq_accum = p.dq_accum;
    args.dk = p.dk;
    args.dv = p.dv;
    args.seqlen_q = static_cast<int>(p.seqlen_q);
    args.seqlen_k = static_cast<int>(p.seqlen_k);
    args.heads_q = static_cast<int>(p.heads_q);
    args.heads_kv = static_cast<int>(p.heads_kv);
    args.group = static_cast<int>(p.heads_q / p.heads_kv);
    args.n_blocks = static_cast<int>(n_blocks);
    args.m_blocks = static_cast<int>((p.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM);
    args.causal_offset = static_cast<int>(p.seqlen_k - p.seqlen_q);
    args.scale = static_cast<float>(p.softmax_scale);
    args.scale_log2 = static_cast<float>(p.softmax_scale * 1.4426950408889634);

    const auto kernel = sm90::bwd_wgmma_kernel<Tr>;
    cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes);
    if (err != cudaSuccess) return err;
    kernel<<<static_cast<unsigned>(grid), Tr::kThreads, Tr::kSmemBytes, stream>>>(args, tm_q, tm_k,
                                                                                  tm_v, tm_do);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }

  return convert_dq<T>(p.dq_accum, p.dq, dq_elems, p.softmax_scale, stream);
}

template <typename T, int kHeadDim>
cudaError_t dispatch_causal(const BwdParams& p, CUtensorMapDataType type, cudaStream_t stream) {
  return p.causal ? launch<T, kHeadDim, true>(p, type, stream)
                  : launch<T, kHeadDim, false>(p, type, stream);
}

template <typename T>
cudaError_t dispatch_head_dim(const BwdParams& p, CUtensorMapDataType type, cudaStream_t stream) {
  return p.head_dim == 64 ? dispatch_causal<T, 64>(p, type, stream)
                          : dispatch_causal<T, 128>(p, type, stream);
}

}  // namespace

bool bwd_wgmma_supported(const BwdParams& params, DType dtype) {
  return params_supported(params, dtype) && current_device_is_sm90();
}

cudaError_t bwd_wgmma(const BwdParams& params, DType dtype, cudaStream_t stream) {
  if (!current_device_is_sm90()) return cudaErrorNotSupported;
  if (!params_supported(params, dtype)) return cudaErrorInvalidValue;
  if (params.batch == 0) return cudaSuccess;
  if (dtype == DType::kBF16) {
    return dispatch_head_dim<__nv_bfloat16>(params, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, stream);
  }
  return dispatch_head_dim<__half>(params, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, stream);
}

}  // namespace jax_flash::cuda
