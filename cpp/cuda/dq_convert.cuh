// The last step of the tensor-core backward passes: dQ was accumulated in fp32 with atomics (the
// key tiles of one query row run in different CTAs), so it is scaled and rounded to T once here.
#pragma once

#include <cstdint>

#include "cuda/tc_primitives.cuh"

namespace jax_flash::cuda {

// dQ = T(scale * dq_accum), four elements per thread and step (n4 = elements / 4; head_dim is a
// multiple of 64, so the element count is a multiple of 4).
template <typename T>
__global__ void dq_convert_kernel(const float4* __restrict__ dq_accum, T* __restrict__ dq,
                                  int64_t n4, float scale) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n4;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float4 a = dq_accum[i];
    uint2 out;
    out.x = tc::pack2<T>(a.x * scale, a.y * scale);
    out.y = tc::pack2<T>(a.z * scale, a.w * scale);
    reinterpret_cast<uint2*>(dq)[i] = out;
  }
}

}  // namespace jax_flash::cuda
