// The private extension module jax_flash._jax_flash: it only hands XLA FFI handlers to Python.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

#include "cpu/attention_cpu.h"
#include "ffi/handlers.h"
#include "xla/ffi/api/c_api.h"

#ifdef JAX_FLASH_WITH_CUDA
#include <cuda_runtime.h>

#include "cuda/kernels.h"
#endif

// Set by CMake: the jax and jaxlib versions whose headers this module was compiled with, and the
// nvcc -gencode flags of the CUDA kernels.
#ifndef JAX_FLASH_BUILT_WITH_JAX
#define JAX_FLASH_BUILT_WITH_JAX "unknown"
#endif
#ifndef JAX_FLASH_BUILT_WITH_JAXLIB
#define JAX_FLASH_BUILT_WITH_JAXLIB "unknown"
#endif
#ifndef JAX_FLASH_CUDA_GENCODE_FLAGS
#define JAX_FLASH_CUDA_GENCODE_FLAGS ""
#endif

namespace nb = nanobind;

namespace {

template <typename Fn>
nb::capsule capsule(Fn* handler) {
  return nb::capsule(reinterpret_cast<void*>(handler));
}

}  // namespace

NB_MODULE(_jax_flash, m) {
  // Target name -> (handler capsule, XLA platform name). Platform names are case-sensitive:
  // "cpu" and "CUDA" exactly.
  m.def("registrations", []() {
    nb::dict out;
    out["jax_flash_fwd_cpu"] = nb::make_tuple(capsule(JaxFlashFwdCpu), "cpu");
    out["jax_flash_bwd_cpu"] = nb::make_tuple(capsule(JaxFlashBwdCpu), "cpu");
    out["jax_flash_decode_cpu"] = nb::make_tuple(capsule(JaxFlashDecodeCpu), "cpu");
#ifdef JAX_FLASH_WITH_CUDA
    out["jax_flash_fwd_cuda"] = nb::make_tuple(capsule(JaxFlashFwdCuda), "CUDA");
    out["jax_flash_bwd_cuda"] = nb::make_tuple(capsule(JaxFlashBwdCuda), "CUDA");
    out["jax_flash_decode_cuda"] = nb::make_tuple(capsule(JaxFlashDecodeCuda), "CUDA");
    out["jax_flash_segments_cuda"] = nb::make_tuple(capsule(JaxFlashSegmentsCuda), "CUDA");
#endif
    return out;
  });
  // The XLA FFI API version of the headers the handlers were compiled against: XLA refuses
  // handlers of another major version or a newer minor version than its own.
  m.attr("xla_ffi_api_version") = nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
  m.attr("built_with_jax") = JAX_FLASH_BUILT_WITH_JAX;
  m.attr("built_with_jaxlib") = JAX_FLASH_BUILT_WITH_JAXLIB;
  m.attr("cuda_gencode") = JAX_FLASH_CUDA_GENCODE_FLAGS;
  // The CPU kernels' level in use, for the capability report; never raises (a refused
  // JAX_FLASH_CPU_ISA reads "none (<reason>)").
  m.def("cpu_simd_level", []() { return jax_flash::cpu::simd_level(); });
  // The instruction-set build the CPU kernels of this process use (see cpu/attention_cpu.h);
  // raises ValueError when JAX_FLASH_CPU_ISA names an unknown level or one the CPU lacks.
  m.def("cpu_isa", []() -> std::string {
    const jax_flash::cpu::IsaChoice& choice = jax_flash::cpu::isa_choice();
    if (!choice.error.empty()) throw nb::value_error(choice.error.c_str());
    return jax_flash::cpu::isa_name(choice.isa);
  });
  // The levels this CPU can run, in increasing order of preference.
  m.def("cpu_isas_supported", []() {
    std::vector<std::string> names;
    for (auto isa : jax_flash::cpu::supported_isas())
      names.emplace_back(jax_flash::cpu::isa_name(isa));
    return names;
  });
#ifdef JAX_FLASH_WITH_CUDA
  // For the trace-time check that a device can run the kernels: the mma.sync kernels' dynamic
  // shared memory, and a device's opt-in per-block limit.
  m.def("cuda_tensor_core_smem_bytes", [](bool backward, int64_t head_dim, bool segments) {
    return backward ? jax_flash::cuda::bwd_tensor_core_smem_bytes(head_dim, segments)
                    : jax_flash::cuda::fwd_tensor_core_smem_bytes(head_dim, segments);
  });
  m.def("cuda_device_smem_optin", [](int ordinal) {
    int bytes = 0;
    const cudaError_t status =
        cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, ordinal);
    if (status != cudaSuccess) {
      throw nb::value_error((std::string("cudaDeviceGetAttribute(MaxSharedMemoryPerBlockOptin, ") +
                             std::to_string(ordinal) + ") failed: " + cudaGetErrorString(status))
                                .c_str());
    }
    return bytes;
  });
  m.attr("has_cuda") = true;
#else
  m.attr("has_cuda") = false;
#endif
}
