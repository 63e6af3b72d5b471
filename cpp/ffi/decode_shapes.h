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

#include <cmath>
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

struct DecodeOptions {
  double softmax_scale;
  int64_t window_left;   // -1: unbounded
  int64_t window_right;  // -1: unbounded (causal arrives as 0)
  int64_t band_shift;
  bool band_bottom_right;
  double softcap;  // 0: none
  bool has_sinks;
  bool paged;
  int64_t num_splits;
};

inline ffi::ErrorOr<DecodeOptions> decode_decode_options(const ffi::Dictionary& attrs) {
  DecodeOptions o{};
  ffi::Error error = ffi::Error::Success();
  const auto read = [&](auto& out, std::string_view name) {
    using T = std::decay_t<decltype(out)>;
    auto value = attr<T>(attrs, name);
    if (value.has_error()) {
      if (error.success()) error = value.error();
    } else {
      out = *value;
    }
  };
  read(o.softmax_scale, "softmax_scale");
  read(o.window_left, "window_left");
  read(o.window_right, "window_right");
  read(o.band_shift, "band_shift");
  read(o.band_bottom_right, "band_bottom_right");
  read(o.softcap, "softcap");
  read(o.has_sinks, "has_sinks");
  read(o.paged, "paged");
  read(o.num_splits, "num_splits");
  if (error.failure()) return ffi::Unexpected(error);
  if (!std::isfinite(o.softmax_scale) || o.softmax_scale <= 0.0) {
    return ffi::Unexpected(invalid("softmax_scale must be finite and positive"));
  }
  if (o.window_left < -1 || o.window_right < -1) {
    return ffi::Unexpected(invalid("window bounds must be -1 (unbounded) or >= 0"));
  }
  if (o.band_shift < -kMaxBandShift || o.band_shift > kMaxBandShift) {
    return ffi::Unexpected(invalid("band_shift must be within +-2^31"));
  }
  if (!std::isfinite(o.softcap) || o.softcap < 0.0) {
    return ffi::Unexpected(invalid("softcap must be finite and >= 0 (0: none)"));
  }
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

  MaskParams& m = p.mask;
  m.band.left = o.window_left < 0 ? kUnbounded : o.window_left;
  m.band.right = o.window_right < 0 ? kUnbounded : o.window_right;
  m.band.shift = o.band_shift;
  m.band.bottom_right = o.band_bottom_right;
  m.softcap = o.softcap;
  const ffi::DataType stats = stats_type(call.dtype);
  if (o.has_sinks) {
    if (auto e = expect_buffer(sinks, stats, p.batch * p.heads_q, "sinks"); e.failure()) {
      return ffi::Unexpected(e);
    }
    m.sinks = sinks.untyped_data();
    m.sinks_batch_stride = p.heads_q;
  }
  p.softmax_scale = o.softmax_scale;
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
