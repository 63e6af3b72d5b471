// The private extension module jax_flash._jax_flash: it only hands XLA FFI handlers to Python.
#include <nanobind/nanobind.h>

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
#ifdef JAX_FLASH_WITH_CUDA
  m.attr("has_cuda") = true;
#else
  m.attr("has_cuda") = false;
#endif
}
