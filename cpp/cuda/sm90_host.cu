// Host-side helpers shared by the Hopper kernel families (see sm90_host.h).
#include <cudaTypedefs.h>

#include <atomic>
#include <cstdint>

#include "cuda/sm90_host.h"

namespace jax_flash::cuda::sm90 {
namespace {

// Per-device values read once: compute capability (major * 10 + minor) and SM count; 0 = not
// read yet.
constexpr int kMaxDevices = 64;
#ifdef JAX_FLASH_BUILT_SM90A
std::atomic<int> g_device_cc[kMaxDevices];
#endif
std::atomic<int> g_device_sms[kMaxDevices];

// The current device's entry of `cache`, from read(device) the first time (a read that gives 0,
// a failure, is not kept; devices past kMaxDevices are read every time). 0 without a device.
template <class Read>
int per_device(std::atomic<int> (&cache)[kMaxDevices], Read read) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0) return 0;
  if (device < kMaxDevices) {
    const int cached = cache[device].load(std::memory_order_relaxed);
    if (cached != 0) return cached;
  }
  const int value = read(device);
  if (device < kMaxDevices && value != 0) cache[device].store(value, std::memory_order_relaxed);
  return value;
}

// cuTensorMapEncodeTiled through the runtime's driver entry point, so that nothing links libcuda.
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encoder = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult query = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                         &query) != cudaSuccess ||
        query != cudaDriverEntryPointSuccess) {
      return static_cast<PFN_cuTensorMapEncodeTiled_v12000>(nullptr);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encoder;
}

}  // namespace

bool sm90a_kernels_usable() {
#ifndef JAX_FLASH_BUILT_SM90A
  return false;  // the Hopper kernels' device code was not compiled for sm_90a
#else
  const int cc = per_device(g_device_cc, [](int device) {
    int major = 0;
    int minor = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
      return 0;
    }
    return major * 10 + minor;
  });
  return cc == 90;
#endif
}

int sm_count() {
  return per_device(g_device_sms, [](int device) {
    int n = 0;
    return cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) == cudaSuccess ? n
                                                                                             : 0;
  });
}

bool encode_bshd(CUtensorMap* map, CUtensorMapDataType type, const void* ptr, int64_t batch,
                 int64_t seqlen, int64_t heads, int64_t head_dim, int box_rows, int elem_bytes,
                 CUtensorMapL2promotion promotion, int box_bytes) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  if (elem_bytes != 2 && elem_bytes != 4) return false;
  if (box_bytes != 128 && box_bytes != 64) return false;
  const int64_t kElemBytes = elem_bytes;
  if (seqlen == 0) seqlen = 1;
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(head_dim), static_cast<cuuint64_t>(heads),
                              static_cast<cuuint64_t>(seqlen), static_cast<cuuint64_t>(batch)};
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(head_dim * kElemBytes),
                                 static_cast<cuuint64_t>(heads * head_dim * kElemBytes),
                                 static_cast<cuuint64_t>(seqlen * heads * head_dim * kElemBytes)};
  const cuuint32_t box[4] = {static_cast<cuuint32_t>(box_bytes / elem_bytes), 1,
                             static_cast<cuuint32_t>(box_rows), 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  return encode(map, type, 4, const_cast<void*>(ptr), dims, strides, box, element_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE,
                box_bytes == 64 ? CU_TENSOR_MAP_SWIZZLE_64B : CU_TENSOR_MAP_SWIZZLE_128B, promotion,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace jax_flash::cuda::sm90
