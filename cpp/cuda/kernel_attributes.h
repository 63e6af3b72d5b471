// Per-kernel launch attributes that only have to be set once per device: the opt-in dynamic
// shared memory beyond 48 KB and the shared-memory carveout. cudaFuncSetAttribute is a host call
// of a few microseconds, which a small call (a decode step) would otherwise pay on every launch.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

namespace jax_flash::cuda {

// Sets `kernel`'s dynamic shared-memory limit to `smem_bytes` (when above the 48 KB default) and,
// with `max_carveout`, prefers the largest shared-memory carveout, on the current device; later
// calls on a device where this succeeded return at once. Kernel: the kernel function itself (a
// constant), so that every kernel has its own record. Races between threads only repeat the
// (idempotent) attribute calls.
template <auto Kernel>
cudaError_t configure_kernel_once(int smem_bytes, bool max_carveout = false) {
  static std::atomic<uint64_t> configured{0};  // bit d: device d is done
  int device = 0;
  if (const cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  const uint64_t bit = device >= 0 && device < 64 ? uint64_t{1} << device : 0;
  if (bit != 0 && (configured.load(std::memory_order_acquire) & bit) != 0) return cudaSuccess;
  if (smem_bytes > 48 * 1024) {
    const cudaError_t err =
        cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
    if (err != cudaSuccess) return err;
  }
  if (max_carveout) {
    const cudaError_t err = cudaFuncSetAttribute(
        Kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
    if (err != cudaSuccess) return err;
  }
  configured.fetch_or(bit, std::memory_order_release);
  return cudaSuccess;
}

}  // namespace jax_flash::cuda
