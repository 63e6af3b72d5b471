// The fp32 dQ accumulator shared by the tensor-core backward passes: the key tiles of one query
// row run in different CTAs and add into it with atomics, so it is zeroed before the main kernel
// and scaled and rounded to T once after it.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
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

// Zeroes the `elems` floats of dq_accum on `stream`.
inline cudaError_t zero_dq_accum(float* dq_accum, int64_t elems, cudaStream_t stream) {
  if (elems == 0) return cudaSuccess;
  return cudaMemsetAsync(dq_accum, 0, elems * sizeof(float), stream);
}

// dq = T(scale * dq_accum) over `elems` elements on `stream`.
template <typename T>
cudaError_t convert_dq(const float* dq_accum, void* dq, int64_t elems, double scale,
                       cudaStream_t stream) {
  if (elems == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const int64_t n4 = elems / 4;
  const int64_t blocks = std::min<int64_t>((n4 + kThreads - 1) / kThreads, 65536);
  dq_convert_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      reinterpret_cast<const float4*>(dq_accum), static_cast<T*>(dq), n4,
      static_cast<float>(scale));
  return cudaGetLastError();
}

}  // namespace jax_flash::cuda
