// Declarations of the FFI handler symbols that the nanobind module exposes as capsules.
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFlashFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFlashBwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFlashDecodeCpu);
#ifdef JAX_FLASH_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFlashFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFlashBwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFlashDecodeCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFlashSegmentsCuda);
#endif
