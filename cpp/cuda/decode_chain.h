// Whether a decode call's passes chain to the kernels around them (decode_tc.cuh, decode_tma.cuh,
// decode_merge.cuh), in a header of its own so that the switch rebuilds decode.cu alone.
#pragma once

namespace jax_flash::cuda {

// Experiment switch: a decode call's split pass (decode_tc.cuh, decode_tma.cuh) launched as the
// programmatic dependent of whatever kernel precedes it on the stream, its blocks waiting for that
// grid before their first global access, and the merge pass (decode_merge.cuh) letting its own
// dependents launch once its wait has returned. In a decode loop the next step's split blocks are
// then resident and started while the merge finishes, instead of launching after it. Measured on
// an H100 (docs/PERF_LOG.md): B=1 / 8k keys 2 us a step faster in a plain stream of calls
// (tools/decode_check.cu --bench), unchanged inside one JAX program, whose steps already ran at
// the chained rate. 0 (default): ordinary stream-ordered launches of the split pass.
#ifndef JAX_FLASH_DECODE_PDL
#define JAX_FLASH_DECODE_PDL 0
#endif
inline constexpr bool kDecodeChained = JAX_FLASH_DECODE_PDL != 0;

}  // namespace jax_flash::cuda
