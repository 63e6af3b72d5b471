// The device-side summaries of a segment-id call's ids (cuda/segment_summaries.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_flash::cuda {

// ids [batch, seqlen] int32; ranges [batch, ceil(seqlen / kSegmentChunk), kSegmentRecord] int32
// (common/mask.h: q_ranges with suffix reaches, kv_ranges with prefix reaches); runs [batch,
// runs_per_row] int32 (common/schedule.h SeqLayout::runs) or nullptr for none, which needs
// seqlen_q == seqlen_k and 1 <= runs_per_row <= kMaxRunsPerRow.
struct SegmentSummaryParams {
  const int32_t* q_ids;
  const int32_t* kv_ids;
  int32_t* q_ranges;
  int32_t* kv_ranges;
  int32_t* runs;
  int64_t batch;
  int64_t seqlen_q;
  int64_t seqlen_k;
  int64_t runs_per_row;
};

// One launch on `stream`; returns the launch's error (invalid sizes: cudaErrorInvalidValue).
cudaError_t segment_summaries(const SegmentSummaryParams& params, cudaStream_t stream);

}  // namespace jax_flash::cuda
