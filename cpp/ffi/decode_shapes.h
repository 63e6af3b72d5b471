// Turns the FFI buffers and attributes of one decode call (jax_flash_decode_cpu / _cuda) into
// DecodeParams. Python checks every argument at trace time; these checks stop a malformed custom
// call from reaching a kernel.
//
// Operands, every leading axis of q folded into `batch`:
//   q              [..., seqlen_q, heads_q, head_dim]
//   k, v           contiguous: [..., cache_len, heads_kv, head_dim], the leading axes of q;
//                  paged: [num_pages, page_size, heads_kv, head_dim]
//   cache_seqlens  int32, `batch` elements
//   block_table    paged: int32 [..., max_pages] with `batch` rows; contiguous: a placeholder
//   sinks          with has_sinks: stats dtype [..., heads_q]; otherwise a placeholder
// Results:
//   out            q's shape and dtype
//   lse            stats dtype [..., heads_q, seqlen_q]
//   partial_o      stats dtype [..., num_splits, heads_q, seqlen_q, head_dim] (num_splits > 1)
//   partial_lse    stats dtype [..., num_splits, heads_q, seqlen_q] (num_splits > 1)
// With num_splits == 1 the partials are placeholders of any size, never touched.
#pragma once

#include <cstdint>
#include <string>

#include "common/decode_params.h"
#include "common/params.h"
#include "ffi/shapes.h"
#include "xla/ffi/api/ffi.h"

namespace jax_flash::ffi_glue {

// The most splits a call may ask for: the host picks at most 64; the bound keeps the partials'
// size arithmetic far from overflow.
inline constexpr int64_t kMaxDecodeSplits = 1024;

// The options of a decode call: the score's (ffi/shapes.h) and the decode kernel's own.
struct DecodeOptions : ScoreOptions {
  bool has_sinks;
  bool paged;
  int64_t num_splits;
};

inline ffi::ErrorOr<DecodeOptions> decode_decode_options(const ffi::Dictionary& attrs) {
  DecodeOptions o{};
  AttrReader read(attrs);
  read_score_options(read, o);
  read(o.has_sinks, "has_sinks");
  read(o.paged, "paged");
  read(o.num_splits, "num_splits");
  if (read.error().failure()) return ffi::Unexpected(read.error());
  if (auto e = check_score_options(o); e.failure()) return ffi::Unexpected(e);
  if (o.num_splits < 1 || o.num_splits > kMaxDecodeSplits) {
    return ffi::Unexpected(invalid("num_splits must be between 1 and 1024"));
  }
  return o;
}

// A decoded decode call: the params for the kernel and the element type to dispatch on.
using DecodeCall = Call<DecodeParams>;

inline ffi::ErrorOr<DecodeCall> read_decode_call(
    const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
    const ffi::AnyBuffer& cache_seqlens, const ffi::AnyBuffer& block_table,
    const ffi::AnyBuffer& sinks, ffi::AnyBuffer out, ffi::AnyBuffer lse, ffi::AnyBuffer partial_o,
    ffi::AnyBuffer partial_lse, const ffi::Dictionary& attrs) {
  auto options = decode_decode_options(attrs);
  if (options.has_error()) return ffi::Unexpected(options.error());
  const DecodeOptions& o = *options;
  auto dtype = to_dtype(q.element_type());
  if (dtype.has_error()) return ffi::Unexpected(dtype.error());
  if (k.element_type() != q.element_type() || v.element_type() != q.element_type()) {
    return ffi::Unexpected(invalid("decode: q, k_cache and v_cache dtypes differ"));
  }
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  const size_t rank = qd.size();
  if (rank < 3 || !same_dims(kd, v.dimensions())) {
    return ffi::Unexpected(invalid("decode: q must have rank >= 3 and k_cache, v_cache one shape"));
  }
  DecodeCall call{};
  call.dtype = *dtype;
  DecodeParams& p = call.params;
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.batch = 1;
  for (size_t i = 0; i + 3 < rank; ++i) p.batch *= qd[i];
  p.seqlen_q = qd[rank - 3];
  p.heads_q = qd[rank - 2];
  p.head_dim = qd[rank - 1];
  if (o.paged) {
    if (kd.size() != 4) {
      return ffi::Unexpected(
          invalid("decode: paged k_cache must be [num_pages, page_size, heads_kv, head_dim]"));
    }
    p.num_pages = kd[0];
    p.page_size = kd[1];
    auto td = block_table.dimensions();
    if (block_table.element_type() != ffi::DataType::S32 || td.size() < 1) {
      return ffi::Unexpected(invalid("decode: block_table must be int32 [..., max_pages]"));
    }
    p.max_pages = td[td.size() - 1];
    if (static_cast<int64_t>(block_table.element_count()) != p.batch * p.max_pages) {
      return ffi::Unexpected(invalid("decode: block_table must have one row per sequence"));
    }
    p.block_table = static_cast<const int32_t*>(block_table.untyped_data());
  } else {
    if (kd.size() != rank) {
      return ffi::Unexpected(invalid("decode: contiguous k_cache must have q's rank"));
    }
    for (size_t i = 0; i + 3 < rank; ++i) {
      if (kd[i] != qd[i]) {
        return ffi::Unexpected(invalid("decode: q and k_cache leading (batch) axes differ"));
      }
    }
    p.cache_len = kd[rank - 3];
    p.block_table = nullptr;
  }
  const size_t kr = kd.size();
  p.heads_kv = kd[kr - 2];
  if (kd[kr - 1] != p.head_dim || p.heads_kv <= 0 || p.heads_q % p.heads_kv != 0) {
    return ffi::Unexpected(
        invalid("decode: k_cache must share q's head_dim and divide its number of heads"));
  }
  if (auto e = expect_buffer(cache_seqlens, ffi::DataType::S32, p.batch, "cache_seqlens");
      e.failure()) {
    return ffi::Unexpected(e);
  }
  p.cache_seqlens = static_cast<const int32_t*>(cache_seqlens.untyped_data());

  apply_score_options(o, p);
  MaskParams& m = p.mask;
  const ffi::DataType stats = stats_type(call.dtype);
  if (o.has_sinks) {
    if (auto e = expect_buffer(sinks, stats, p.batch * p.heads_q, "sinks"); e.failure()) {
      return ffi::Unexpected(e);
    }
    m.sinks = sinks.untyped_data();
    m.sinks_batch_stride = p.heads_q;
  }
  p.num_splits = o.num_splits;

  const int64_t rows = p.batch * p.heads_q * p.seqlen_q;
  for (ffi::Error e : {expect_buffer(out, q.element_type(), rows * p.head_dim, "out"),
                       expect_buffer(lse, stats, rows, "lse")}) {
    if (e.failure()) return ffi::Unexpected(e);
  }
  p.o = out.untyped_data();
  p.lse = lse.untyped_data();
  p.partial_o = nullptr;
  p.partial_lse = nullptr;
  if (p.num_splits > 1) {
    const int64_t split_rows = rows * p.num_splits;
    for (ffi::Error e : {expect_buffer(partial_o, stats, split_rows * p.head_dim, "partial_o"),
                         expect_buffer(partial_lse, stats, split_rows, "partial_lse")}) {
      if (e.failure()) return ffi::Unexpected(e);
    }
    p.partial_o = partial_o.untyped_data();
    p.partial_lse = partial_lse.untyped_data();
  }
  if (!decode_params_well_formed(p)) {
    return ffi::Unexpected(invalid("decode: the buffers and options do not form a valid call"));
  }
  return call;
}

}  // namespace jax_flash::ffi_glue
