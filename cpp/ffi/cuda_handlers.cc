// XLA FFI handlers for the CUDA kernels: decode buffers, build params, launch on XLA's stream.
// They never synchronise or allocate, so XLA may capture them in CUDA graphs.
#include <cuda_runtime.h>

#include <string>

#include "cuda/decode.h"
#include "cuda/launch.h"
#include "cuda/segment_summaries.h"
#include "ffi/decode_shapes.h"
#include "ffi/handlers.h"
#include "ffi/shapes.h"
#include "xla/ffi/api/ffi.h"

namespace jax_flash::ffi_glue {
namespace {

namespace ffi = xla::ffi;

ffi::Error cuda_status(cudaError_t status, const char* what) {
  if (status == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("jax_flash: ") + what +
                              " failed: " + cudaGetErrorString(status));
}

ffi::Error fwd_cuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                    ffi::RemainingArgs extras, ffi::Result<ffi::AnyBuffer> o,
                    ffi::Result<ffi::AnyBuffer> lse, ffi::Result<ffi::AnyBuffer> work_counter,
                    ffi::Dictionary attrs) {
  auto call = decode_fwd(q, k, v, extras, *o, *lse, attrs);
  if (call.has_error()) return call.error();
  // The persistent forward's tile counter (one int32; vmap may give each batch element its own,
  // of which the call uses the first).
  if (work_counter->element_type() != ffi::DataType::S32 || work_counter->element_count() < 1) {
    return invalid("work_counter must be int32 with at least one element");
  }
  call->params.work_counter = static_cast<int32_t*>(work_counter->untyped_data());
  return cuda_status(cuda::attention_fwd(call->params, call->dtype, stream),
                     "attention forward launch");
}

ffi::Error bwd_cuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                    ffi::AnyBuffer dout, ffi::AnyBuffer lse, ffi::AnyBuffer delta,
                    ffi::RemainingArgs extras, ffi::Result<ffi::AnyBuffer> dq,
                    ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                    ffi::Result<ffi::AnyBuffer> dq_accum, ffi::Result<ffi::AnyBuffer> dq_semaphores,
                    ffi::Dictionary attrs) {
  auto call = decode_bwd(q, k, v, dout, lse, delta, extras, *dq, *dk, *dv, attrs);
  if (call.has_error()) return call.error();
  // The scratch is only needed (and only sized) for the tensor-core path; the f32/f64 path gets
  // a one-element placeholder.
  if (call->dtype == DType::kF16 || call->dtype == DType::kBF16) {
    if (auto e = expect_buffer(*dq_accum, ffi::DataType::F32, dq->element_count(), "dq_accum");
        e.failure()) {
      return e;
    }
    call->params.dq_accum = static_cast<float*>(dq_accum->untyped_data());
    // The deterministic backward's counters, two per dQ row and head.
    if (call->deterministic) {
      const int64_t rows = call->params.layout.rows_q() * call->params.heads_q * 2;
      if (auto e = expect_buffer(*dq_semaphores, ffi::DataType::S32, rows, "dq_semaphores");
          e.failure()) {
        return e;
      }
      call->params.dq_semaphores = static_cast<int32_t*>(dq_semaphores->untyped_data());
    }
  }
  return cuda_status(cuda::attention_bwd(call->params, call->dtype, stream),
                     "attention backward launch");
}

// Length of the last axis and the product of the others (the folded batch) of an id array.
bool rows_of(const ffi::AnyBuffer& ids, int64_t& batch, int64_t& seqlen) {
  const auto dims = ids.dimensions();
  if (dims.size() < 1 || ids.element_type() != ffi::DataType::S32) return false;
  seqlen = dims.back();
  batch = seqlen > 0 ? static_cast<int64_t>(ids.element_count()) / seqlen : 0;
  return seqlen > 0;
}

// The segment-id summaries every CUDA attention kernel reads, for the calls that follow on the
// stream: the chunk records of the query and key ids and, with runs_per_row > 0, the rows'
// documents (cuda/segment_summaries.h).
ffi::Error segments_cuda(cudaStream_t stream, ffi::AnyBuffer q_ids, ffi::AnyBuffer kv_ids,
                         ffi::Result<ffi::AnyBuffer> q_ranges,
                         ffi::Result<ffi::AnyBuffer> kv_ranges, ffi::Result<ffi::AnyBuffer> runs,
                         int64_t runs_per_row) {
  cuda::SegmentSummaryParams p{};
  int64_t batch_k = 0;
  if (!rows_of(q_ids, p.batch, p.seqlen_q) || !rows_of(kv_ids, batch_k, p.seqlen_k) ||
      batch_k != p.batch) {
    return invalid("segment ids must be int32 [..., seqlen] with the same leading axes");
  }
  if (runs_per_row < 0 || runs_per_row > kMaxRunsPerRow ||
      (runs_per_row > 0 && p.seqlen_q != p.seqlen_k)) {
    return invalid("runs_per_row must be 0, or 1 .. 32 with seqlen_q == seqlen_k");
  }
  for (ffi::Error e :
       {expect_buffer(*q_ranges, ffi::DataType::S32,
                      p.batch * segment_chunks(p.seqlen_q) * kSegmentRecord, "q_segment_ranges"),
        expect_buffer(*kv_ranges, ffi::DataType::S32,
                      p.batch * segment_chunks(p.seqlen_k) * kSegmentRecord, "kv_segment_ranges"),
        expect_buffer(*runs, ffi::DataType::S32, p.batch * (runs_per_row > 0 ? runs_per_row : 1),
                      "segment_runs")}) {
    if (e.failure()) return e;
  }
  p.q_ids = static_cast<const int32_t*>(q_ids.untyped_data());
  p.kv_ids = static_cast<const int32_t*>(kv_ids.untyped_data());
  p.q_ranges = static_cast<int32_t*>(q_ranges->untyped_data());
  p.kv_ranges = static_cast<int32_t*>(kv_ranges->untyped_data());
  p.runs = runs_per_row > 0 ? static_cast<int32_t*>(runs->untyped_data()) : nullptr;
  p.runs_per_row = runs_per_row;
  return cuda_status(cuda::segment_summaries(p, stream), "segment summaries launch");
}

// The partials are XLA-owned outputs (placeholders when num_splits == 1), so the launch neither
// allocates nor synchronises.
ffi::Error decode_cuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                       ffi::AnyBuffer cache_seqlens, ffi::AnyBuffer block_table,
                       ffi::AnyBuffer sinks, ffi::Result<ffi::AnyBuffer> o,
                       ffi::Result<ffi::AnyBuffer> lse, ffi::Result<ffi::AnyBuffer> partial_o,
                       ffi::Result<ffi::AnyBuffer> partial_lse, ffi::Dictionary attrs) {
  auto call = read_decode_call(q, k, v, cache_seqlens, block_table, sinks, *o, *lse, *partial_o,
                               *partial_lse, attrs);
  if (call.has_error()) return call.error();
  return cuda_status(cuda::decode_fwd(call->params, call->dtype, stream), "decode launch");
}

}  // namespace
}  // namespace jax_flash::ffi_glue

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashFwdCuda, jax_flash::ffi_glue::fwd_cuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // q   [..., Sq, Hq, D]
                                  .Arg<xla::ffi::AnyBuffer>()  // k   [..., Sk, Hkv, D]
                                  .Arg<xla::ffi::AnyBuffer>()  // v   [..., Sk, Hkv, D]
                                  .RemainingArgs()  // the optional inputs, ffi/shapes.h Extra
                                  .Ret<xla::ffi::AnyBuffer>()  // out [..., Sq, Hq, D]
                                  .Ret<xla::ffi::AnyBuffer>()  // lse [..., Hq, Sq]
                                  .Ret<xla::ffi::AnyBuffer>()  // work_counter int32 scratch
                                  .Attrs<xla::ffi::Dictionary>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashBwdCuda, jax_flash::ffi_glue::bwd_cuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // q        [..., Sq, Hq, D]
                                  .Arg<xla::ffi::AnyBuffer>()  // k        [..., Sk, Hkv, D]
                                  .Arg<xla::ffi::AnyBuffer>()  // v        [..., Sk, Hkv, D]
                                  .Arg<xla::ffi::AnyBuffer>()  // dout     [..., Sq, Hq, D]
                                  .Arg<xla::ffi::AnyBuffer>()  // lse      [..., Hq, Sq]
                                  .Arg<xla::ffi::AnyBuffer>()  // delta    [..., Hq, Sq]
                                  .RemainingArgs()  // the optional inputs, ffi/shapes.h Extra
                                  .Ret<xla::ffi::AnyBuffer>()  // dq       [..., Sq, Hq, D]
                                  .Ret<xla::ffi::AnyBuffer>()  // dk       [..., Sk, Hkv, D]
                                  .Ret<xla::ffi::AnyBuffer>()  // dv       [..., Sk, Hkv, D]
                                  .Ret<xla::ffi::AnyBuffer>()  // dq_accum fp32 scratch
                                  .Ret<xla::ffi::AnyBuffer>()  // dq_semaphores int32 scratch
                                  .Attrs<xla::ffi::Dictionary>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashSegmentsCuda, jax_flash::ffi_glue::segments_cuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // q_ids  int32 [..., Sq]
                                  .Arg<xla::ffi::AnyBuffer>()  // kv_ids int32 [..., Sk]
                                  .Ret<xla::ffi::AnyBuffer>()  // q_ranges [..., chunks, 4]
                                  .Ret<xla::ffi::AnyBuffer>()  // kv_ranges [..., chunks, 4]
                                  .Ret<xla::ffi::AnyBuffer>()  // runs [..., runs_per_row] or [1]
                                  .Attr<int64_t>("runs_per_row"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashDecodeCuda, jax_flash::ffi_glue::decode_cuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // q   [..., Sq, Hq, D]
                                  .Arg<xla::ffi::AnyBuffer>()  // k_cache (ffi/decode_shapes.h)
                                  .Arg<xla::ffi::AnyBuffer>()  // v_cache, k_cache's shape
                                  .Arg<xla::ffi::AnyBuffer>()  // cache_seqlens int32 [...]
                                  .Arg<xla::ffi::AnyBuffer>()  // block_table int32 [..., pages]
                                  .Arg<xla::ffi::AnyBuffer>()  // sinks [..., Hq] or placeholder
                                  .Ret<xla::ffi::AnyBuffer>()  // out [..., Sq, Hq, D]
                                  .Ret<xla::ffi::AnyBuffer>()  // lse [..., Hq, Sq]
                                  .Ret<xla::ffi::AnyBuffer>()  // partial_o [..., n, Hq, Sq, D]
                                  .Ret<xla::ffi::AnyBuffer>()  // partial_lse [..., n, Hq, Sq]
                                  .Attrs<xla::ffi::Dictionary>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
