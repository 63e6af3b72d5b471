// Turns the FFI buffers of one attention call into the framework-free params structs. Python
// validates everything at trace time; these checks only stop a malformed custom call (for
// example one built by hand) from reaching a kernel.
#pragma once

#include <cstdint>
#include <string>

#include "common/params.h"
#include "xla/ffi/api/ffi.h"

namespace jax_flash::ffi_glue {

namespace ffi = xla::ffi;

// Sizes of one call; all leading axes of [..., S, H, D] are folded into `batch`.
struct AttentionDims {
  int64_t batch = 1;
  int64_t seqlen_q = 0;
  int64_t seqlen_k = 0;
  int64_t heads_q = 0;
  int64_t heads_kv = 0;
  int64_t head_dim = 0;
};

inline ffi::ErrorOr<DType> to_dtype(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F16:
      return DType::kF16;
    case ffi::DataType::BF16:
      return DType::kBF16;
    case ffi::DataType::F32:
      return DType::kF32;
    case ffi::DataType::F64:
      return DType::kF64;
    default:
      return ffi::Unexpected(
          ffi::Error::InvalidArgument("jax_flash: element type must be f16, bf16, f32 or f64"));
  }
}

// lse and delta are float64 for float64 inputs and float32 otherwise.
inline ffi::DataType stats_type(DType dtype) {
  return dtype == DType::kF64 ? ffi::DataType::F64 : ffi::DataType::F32;
}

inline bool same_dims(ffi::AnyBuffer::Dimensions a, ffi::AnyBuffer::Dimensions b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] != b[i]) return false;
  }
  return true;
}

// q [..., Sq, Hq, D], k and v [..., Sk, Hkv, D] with identical leading axes.
inline ffi::ErrorOr<AttentionDims> attention_dims(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                                                  const ffi::AnyBuffer& v) {
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  const size_t rank = qd.size();
  if (rank < 3 || kd.size() != rank || !same_dims(kd, v.dimensions())) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        "jax_flash: q, k, v must have equal rank >= 3 and k, v equal shapes"));
  }
  AttentionDims d;
  for (size_t i = 0; i + 3 < rank; ++i) {
    if (qd[i] != kd[i]) {
      return ffi::Unexpected(
          ffi::Error::InvalidArgument("jax_flash: q and k leading (batch) axes differ"));
    }
    d.batch *= qd[i];
  }
  d.seqlen_q = qd[rank - 3];
  d.heads_q = qd[rank - 2];
  d.head_dim = qd[rank - 1];
  d.seqlen_k = kd[rank - 3];
  d.heads_kv = kd[rank - 2];
  if (kd[rank - 1] != d.head_dim || d.heads_kv <= 0 || d.heads_q % d.heads_kv != 0) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        "jax_flash: k must share q's head_dim and divide its number of heads"));
  }
  if (q.element_type() != k.element_type() || q.element_type() != v.element_type()) {
    return ffi::Unexpected(ffi::Error::InvalidArgument("jax_flash: q, k, v dtypes differ"));
  }
  return d;
}

// Checks that a buffer has `count` elements of `type`.
inline ffi::Error expect_buffer(const ffi::AnyBuffer& b, ffi::DataType type, int64_t count,
                                const char* name) {
  if (b.element_type() != type || static_cast<int64_t>(b.element_count()) != count) {
    return ffi::Error::InvalidArgument(std::string("jax_flash: unexpected type or size of ") +
                                       name);
  }
  return ffi::Error::Success();
}

// A decoded call: the params for the launcher and the element type to dispatch on.
template <class P>
struct Call {
  P params;
  DType dtype;
};
using FwdCall = Call<FwdParams>;
// params.dq_accum is left null for the caller to fill where needed.
using BwdCall = Call<BwdParams>;

// What decode_fwd and decode_bwd share: checks q, k, v and their element type, and fills the
// fields FwdParams and BwdParams have in common. The output buffers are the caller's.
template <class P>
inline ffi::ErrorOr<Call<P>> decode_inputs(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                                           const ffi::AnyBuffer& v, double softmax_scale,
                                           bool causal) {
  auto dims = attention_dims(q, k, v);
  if (dims.has_error()) return ffi::Unexpected(dims.error());
  auto dtype = to_dtype(q.element_type());
  if (dtype.has_error()) return ffi::Unexpected(dtype.error());
  const AttentionDims& d = *dims;
  Call<P> call{};
  call.dtype = *dtype;
  P& p = call.params;
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.batch = d.batch;
  p.seqlen_q = d.seqlen_q;
  p.seqlen_k = d.seqlen_k;
  p.heads_q = d.heads_q;
  p.heads_kv = d.heads_kv;
  p.head_dim = d.head_dim;
  p.softmax_scale = softmax_scale;
  p.causal = causal;
  return call;
}

inline ffi::ErrorOr<FwdCall> decode_fwd(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                                        const ffi::AnyBuffer& v, ffi::AnyBuffer o,
                                        ffi::AnyBuffer lse, double softmax_scale, bool causal) {
  auto call = decode_inputs<FwdParams>(q, k, v, softmax_scale, causal);
  if (call.has_error()) return ffi::Unexpected(call.error());
  FwdParams& p = call->params;
  const int64_t rows = p.batch * p.heads_q * p.seqlen_q;
  for (ffi::Error e : {expect_buffer(o, q.element_type(), rows * p.head_dim, "out"),
                       expect_buffer(lse, stats_type(call->dtype), rows, "lse")}) {
    if (e.failure()) return ffi::Unexpected(e);
  }
  p.o = o.untyped_data();
  p.lse = lse.untyped_data();
  return call;
}

inline ffi::ErrorOr<BwdCall> decode_bwd(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                                        const ffi::AnyBuffer& v, const ffi::AnyBuffer& dout,
                                        const ffi::AnyBuffer& lse, const ffi::AnyBuffer& delta,
                                        ffi::AnyBuffer dq, ffi::AnyBuffer dk, ffi::AnyBuffer dv,
                                        double softmax_scale, bool causal) {
  auto call = decode_inputs<BwdParams>(q, k, v, softmax_scale, causal);
  if (call.has_error()) return ffi::Unexpected(call.error());
  BwdParams& p = call->params;
  const ffi::DataType elem = q.element_type();
  const int64_t q_elems = p.batch * p.seqlen_q * p.heads_q * p.head_dim;
  const int64_t kv_elems = p.batch * p.seqlen_k * p.heads_kv * p.head_dim;
  const int64_t rows = p.batch * p.heads_q * p.seqlen_q;
  for (ffi::Error e :
       {expect_buffer(dout, elem, q_elems, "dout"),
        expect_buffer(lse, stats_type(call->dtype), rows, "lse"),
        expect_buffer(delta, stats_type(call->dtype), rows, "delta"),
        expect_buffer(dq, elem, q_elems, "dq"), expect_buffer(dk, elem, kv_elems, "dk"),
        expect_buffer(dv, elem, kv_elems, "dv")}) {
    if (e.failure()) return ffi::Unexpected(e);
  }
  p.dout = dout.untyped_data();
  p.lse = lse.untyped_data();
  p.delta = delta.untyped_data();
  p.dq = dq.untyped_data();
  p.dk = dk.untyped_data();
  p.dv = dv.untyped_data();
  p.dq_accum = nullptr;
  return call;
}

}  // namespace jax_flash::ffi_glue
