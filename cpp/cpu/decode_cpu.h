// CPU decode: a few query rows per sequence against a contiguous or paged key/value cache
// (common/decode_params.h), split over the keys exactly as the CUDA decode call is.
#pragma once

#include "common/decode_params.h"
#include "common/params.h"
#include "cpu/attention_cpu.h"

namespace jax_flash::cpu {

// Keys per tile of the CPU decode kernel, and the granule of its split ranges
// (DecodeParams::split_begin), so that no tile straddles two splits.
inline constexpr int64_t kDecodeKeyTile = 64;

// Any head_dim >= 1; f16/bf16 and f32 compute in float32, f64 in float64. With num_splits > 1
// every split writes its normalised partial O and lse into params.partial_o / partial_lse and a
// second pass merges them (adding the sink once); otherwise o and lse are written directly.
// Tasks are (sequence, kv head, split): the G = heads_q / heads_kv query heads of a kv head and
// all seqlen_q positions are processed together, so each K/V row is read once per kv head.
void decode_fwd(const DecodeParams& params, DType dtype, const ParallelFor& parallel_for);

}  // namespace jax_flash::cpu
