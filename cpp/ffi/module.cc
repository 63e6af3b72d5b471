// The private extension module jax_flash._jax_flash: it only hands XLA FFI handlers to Python.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

#include "cpu/attention_cpu.h"
#include "ffi/handlers.h"

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
#ifdef JAX_FLASH_WITH_CUDA
    out["jax_flash_fwd_cuda"] = nb::make_tuple(capsule(JaxFlashFwdCuda), "CUDA");
    out["jax_flash_bwd_cuda"] = nb::make_tuple(capsule(JaxFlashBwdCuda), "CUDA");
#endif
    return out;
  });
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
  m.attr("has_cuda") = true;
#else
  m.attr("has_cuda") = false;
#endif
}
