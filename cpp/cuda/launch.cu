// Chooses the kernel family by element type and device: for f16/bf16 the Hopper wgmma kernels
// where they apply (sm_90; head_dim 64/128/256, forward and backward) and the mma.sync
// kernels elsewhere; exact scalar math for f32/f64 (no silent TF32). Every family implements the
// whole mask policy (common/mask.h) and both layouts (common/schedule.h), so the choice depends on
// the device and the shape only, never on which features a call uses.
#include <cstdlib>
#include <cstring>

#include "cuda/bwd_wgmma.h"
#include "cuda/fwd_wgmma.h"
#include "cuda/kernels.h"
#include "cuda/launch.h"

namespace jax_flash::cuda {
namespace {

// JAX_FLASH_CUDA_FAMILY picks the f16/bf16 family for testing every family on one device:
// "mma" runs the mma.sync kernels even where wgmma applies, "wgmma" refuses calls wgmma cannot
// serve, unset or "auto" prefers wgmma. Read once per process.
enum class Family { kAuto, kMma, kWgmma, kInvalid };

Family requested_family() {
  static const Family family = [] {
    const char* value = std::getenv("JAX_FLASH_CUDA_FAMILY");
    if (value == nullptr || value[0] == '\0' || std::strcmp(value, "auto") == 0) {
      return Family::kAuto;
    }
    if (std::strcmp(value, "mma") == 0) return Family::kMma;
    if (std::strcmp(value, "wgmma") == 0) return Family::kWgmma;
    return Family::kInvalid;
  }();
  return family;
}

// Runs the wgmma launcher where it applies (and the family allows it), else mma.sync.
template <typename Params, typename Supported, typename Wgmma, typename Mma>
cudaError_t dispatch_half(const Params& params, DType dtype, Supported supported, Wgmma wgmma,
                          Mma mma) {
  switch (requested_family()) {
    case Family::kInvalid:
      return cudaErrorInvalidValue;
    case Family::kMma:
      return mma();
    case Family::kWgmma:
      return supported(params, dtype) ? wgmma() : cudaErrorNotSupported;
    case Family::kAuto:
      break;
  }
  return supported(params, dtype) ? wgmma() : mma();
}

}  // namespace

cudaError_t attention_fwd(const FwdParams& params, DType dtype, cudaStream_t stream) {
  switch (dtype) {
    case DType::kF16:
    case DType::kBF16:
      return dispatch_half(
          params, dtype, fwd_wgmma_supported, [&] { return fwd_wgmma(params, dtype, stream); },
          [&] { return fwd_tensor_core(params, dtype, stream); });
    case DType::kF32:
    case DType::kF64:
      return fwd_simt(params, dtype, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t attention_bwd(const BwdParams& params, DType dtype, cudaStream_t stream) {
  switch (dtype) {
    case DType::kF16:
    case DType::kBF16:
      if (params.dq_accum == nullptr) return cudaErrorInvalidValue;
      return dispatch_half(
          params, dtype, bwd_wgmma_supported, [&] { return bwd_wgmma(params, dtype, stream); },
          [&] { return bwd_tensor_core(params, dtype, stream); });
    case DType::kF32:
    case DType::kF64:
      return bwd_simt(params, dtype, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace jax_flash::cuda
