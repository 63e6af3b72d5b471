// Turns the FFI buffers of one attention call into the framework-free params structs. Python
// validates everything at trace time; these checks only stop a malformed custom call (for
// example one built by hand) from reaching a kernel.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>

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
  bool deterministic;  // Options::deterministic, for the handler that provides the scratch
};
using FwdCall = Call<FwdParams>;
// params.dq_accum is left null for the caller to fill where needed.
using BwdCall = Call<BwdParams>;

// The optional inputs that follow q, k, v (and, in the backward, dO, lse, delta) in every call,
// in this order. Python passes a one-element placeholder for each one a call does not use.
enum Extra : size_t {
  kQSegmentIds = 0,  // int32 [batch, seqlen_q]
  kKvSegmentIds,     // int32 [batch, seqlen_k]
  kQSegmentRanges,   // int32 [batch, ceil(seqlen_q / kSegmentChunk), 2]
  kKvSegmentRanges,  // int32 [batch, ceil(seqlen_k / kSegmentChunk), 2]
  kSinks,            // float32 (float64 for f64 inputs) [batch, heads_q], or [heads_q] packed
  kCuSeqlensQ,       // int32 [num_seqs + 1]
  kCuSeqlensK,       // int32 [num_seqs + 1]
  kSegmentRuns,      // int32 [batch, segment_runs]: the rows' documents (SeqLayout::runs)
  kNumExtras,
};

inline ffi::Error invalid(const std::string& what) {
  return ffi::Error::InvalidArgument("jax_flash: " + what);
}

template <typename T>
inline ffi::ErrorOr<T> attr(const ffi::Dictionary& attrs, std::string_view name) {
  auto value = attrs.get<T>(name);
  if (value.has_error()) {
    return ffi::Unexpected(invalid("missing or mistyped attribute " + std::string(name)));
  }
  return *value;
}

// Reads attributes one at a time, keeping the first error, so that a malformed call is told the
// first attribute that is missing or mistyped.
class AttrReader {
 public:
  explicit AttrReader(const ffi::Dictionary& attrs) : attrs_(attrs) {}

  template <typename T>
  void operator()(T& out, std::string_view name) {
    auto value = attr<T>(attrs_, name);
    if (value.has_error()) {
      if (error_.success()) error_ = value.error();
    } else {
      out = *value;
    }
  }

  const ffi::Error& error() const { return error_; }

 private:
  const ffi::Dictionary& attrs_;
  ffi::Error error_ = ffi::Error::Success();
};

// What every call says about its scores, whichever entry point made it (attention, its backward,
// decode): the scale, the band and the soft cap. Read, checked and applied here only.
struct ScoreOptions {
  double softmax_scale;
  int64_t window_left;     // -1: unbounded
  int64_t window_right;    // -1: unbounded (causal arrives as 0)
  int64_t band_shift;      // added to the diagonal offset
  bool band_bottom_right;  // offset starts from seqlen_k - seqlen_q (else from 0)
  double softcap;          // 0: none
};

inline void read_score_options(AttrReader& read, ScoreOptions& s) {
  read(s.softmax_scale, "softmax_scale");
  read(s.window_left, "window_left");
  read(s.window_right, "window_right");
  read(s.band_shift, "band_shift");
  read(s.band_bottom_right, "band_bottom_right");
  read(s.softcap, "softcap");
}

inline ffi::Error check_score_options(const ScoreOptions& s) {
  if (!std::isfinite(s.softmax_scale) || s.softmax_scale <= 0.0) {
    return invalid("softmax_scale must be finite and positive");
  }
  if (s.window_left < -1 || s.window_right < -1) {
    return invalid("window bounds must be -1 (unbounded) or >= 0");
  }
  if (s.band_shift < -kMaxBandShift || s.band_shift > kMaxBandShift) {
    return invalid("band_shift must be within +-2^31");
  }
  if (!std::isfinite(s.softcap) || s.softcap < 0.0) {
    return invalid("softcap must be finite and >= 0 (0: none)");
  }
  return ffi::Error::Success();
}

// The scale, band and soft cap of params P (FwdParams, BwdParams, DecodeParams); the mask's other
// fields (sinks, segment ids) and the layout are the caller's.
template <class P>
inline void apply_score_options(const ScoreOptions& s, P& p) {
  p.softmax_scale = s.softmax_scale;
  MaskParams& m = p.mask;
  m.band.left = s.window_left < 0 ? kUnbounded : s.window_left;
  m.band.right = s.window_right < 0 ? kUnbounded : s.window_right;
  m.band.shift = s.band_shift;
  m.band.bottom_right = s.band_bottom_right;
  m.softcap = s.softcap;
}

// The options of an attention call (forward or backward), decoded from its attributes in one
// place for all four handlers.
struct Options : ScoreOptions {
  int64_t max_seqlen_q;  // -1: not given
  int64_t max_seqlen_k;
  bool has_segments;
  int64_t segment_runs;  // 0: no documents given; else runs per row of the kSegmentRuns input
  bool has_sinks;
  bool varlen;
  bool deterministic;  // backward: add dQ contributions in a fixed order (CUDA)
};

inline ffi::ErrorOr<Options> decode_options(const ffi::Dictionary& attrs) {
  Options o{};
  AttrReader read(attrs);
  read_score_options(read, o);
  read(o.max_seqlen_q, "max_seqlen_q");
  read(o.max_seqlen_k, "max_seqlen_k");
  read(o.has_segments, "has_segments");
  read(o.segment_runs, "segment_runs");
  read(o.has_sinks, "has_sinks");
  read(o.varlen, "varlen");
  read(o.deterministic, "deterministic");
  if (read.error().failure()) return ffi::Unexpected(read.error());
  if (auto e = check_score_options(o); e.failure()) return ffi::Unexpected(e);
  if (o.max_seqlen_q < -1 || o.max_seqlen_k < -1) {
    return ffi::Unexpected(invalid("max_seqlen_q/k must be -1 (not given) or >= 0"));
  }
  if (o.segment_runs < 0 || o.segment_runs > kMaxRunsPerRow ||
      (o.segment_runs > 0 && !o.has_segments)) {
    return ffi::Unexpected(
        invalid("segment_runs must be 0, or 1 .. 32 with segment ids (runs per row)"));
  }
  if (o.varlen && o.has_segments) {
    return ffi::Unexpected(invalid("segment ids are not supported with cu_seqlens"));
  }
  return o;
}

inline ffi::ErrorOr<ffi::AnyBuffer> extra(const ffi::RemainingArgs& extras, Extra which) {
  if (extras.size() != kNumExtras) {
    return ffi::Unexpected(invalid("expected 7 optional inputs after the tensors"));
  }
  auto b = extras.get<ffi::AnyBuffer>(which);
  if (b.has_error()) return ffi::Unexpected(invalid("an optional input is not a buffer"));
  return *b;
}

// Fills params.softmax_scale, params.mask and params.layout from the options and the optional
// inputs, checking every buffer that is used.
template <class P>
inline ffi::Error decode_mask(const ffi::RemainingArgs& extras, const Options& o,
                              const AttentionDims& d, DType dtype, P& p) {
  apply_score_options(o, p);
  MaskParams& m = p.mask;
  SeqLayout& l = p.layout;
  l.heads_q = p.heads_q;
  if (o.varlen) {
    auto cu_q = extra(extras, kCuSeqlensQ);
    auto cu_k = extra(extras, kCuSeqlensK);
    if (cu_q.has_error()) return cu_q.error();
    if (cu_k.has_error()) return cu_k.error();
    const int64_t n = static_cast<int64_t>(cu_q->element_count()) - 1;
    if (d.batch != 1 || n < 0 || cu_q->element_type() != ffi::DataType::S32 ||
        cu_k->element_type() != ffi::DataType::S32 ||
        static_cast<int64_t>(cu_k->element_count()) != n + 1) {
      return invalid("cu_seqlens_q and cu_seqlens_k must be int32 [num_seqs + 1] with rank-3 q");
    }
    l.cu_seqlens_q = static_cast<const int32_t*>(cu_q->untyped_data());
    l.cu_seqlens_k = static_cast<const int32_t*>(cu_k->untyped_data());
    l.num_seqs = n;
    l.total_q = d.seqlen_q;
    l.total_k = d.seqlen_k;
    l.batch = 1;
    l.max_seqlen_q = o.max_seqlen_q < 0 ? d.seqlen_q : o.max_seqlen_q;
    l.max_seqlen_k = o.max_seqlen_k < 0 ? d.seqlen_k : o.max_seqlen_k;
  } else {
    l.batch = d.batch;
    l.max_seqlen_q = d.seqlen_q;
    l.max_seqlen_k = d.seqlen_k;
  }
  l.seqlen_q = d.seqlen_q;
  l.seqlen_k = d.seqlen_k;
  if (o.has_segments) {
    auto q_ids = extra(extras, kQSegmentIds);
    auto kv_ids = extra(extras, kKvSegmentIds);
    auto q_rng = extra(extras, kQSegmentRanges);
    auto kv_rng = extra(extras, kKvSegmentRanges);
    for (const auto* b : {&q_ids, &kv_ids, &q_rng, &kv_rng}) {
      if (b->has_error()) return b->error();
    }
    for (ffi::Error e :
         {expect_buffer(*q_ids, ffi::DataType::S32, d.batch * d.seqlen_q, "q_segment_ids"),
          expect_buffer(*kv_ids, ffi::DataType::S32, d.batch * d.seqlen_k, "kv_segment_ids"),
          expect_buffer(*q_rng, ffi::DataType::S32,
                        d.batch * segment_chunks(d.seqlen_q) * kSegmentRecord, "q_segment_ranges"),
          expect_buffer(*kv_rng, ffi::DataType::S32,
                        d.batch * segment_chunks(d.seqlen_k) * kSegmentRecord,
                        "kv_segment_ranges")}) {
      if (e.failure()) return e;
    }
    m.segments.q_ids = static_cast<const int32_t*>(q_ids->untyped_data());
    m.segments.kv_ids = static_cast<const int32_t*>(kv_ids->untyped_data());
    m.segments.q_ranges = static_cast<const int32_t*>(q_rng->untyped_data());
    m.segments.kv_ranges = static_cast<const int32_t*>(kv_rng->untyped_data());
    if (o.segment_runs > 0) {
      auto runs = extra(extras, kSegmentRuns);
      if (runs.has_error()) return runs.error();
      if (d.seqlen_q != d.seqlen_k) {
        return invalid("segment_runs needs seqlen_q == seqlen_k");
      }
      if (auto e =
              expect_buffer(*runs, ffi::DataType::S32, d.batch * o.segment_runs, "segment_runs");
          e.failure()) {
        return e;
      }
      m.segments.runs = static_cast<const int32_t*>(runs->untyped_data());
      m.segments.runs_per_row = o.segment_runs;
    }
  }
  if (o.has_sinks) {
    auto sinks = extra(extras, kSinks);
    if (sinks.has_error()) return sinks.error();
    const int64_t rows = o.varlen ? 1 : d.batch;
    if (auto e = expect_buffer(*sinks, stats_type(dtype), rows * p.heads_q, "sinks"); e.failure()) {
      return e;
    }
    m.sinks = sinks->untyped_data();
    m.sinks_batch_stride = o.varlen ? 0 : p.heads_q;
  }
  return ffi::Error::Success();
}

// What decode_fwd and decode_bwd share: checks q, k, v and their element type, and fills the
// fields FwdParams and BwdParams have in common. The output buffers are the caller's.
template <class P>
inline ffi::ErrorOr<Call<P>> decode_inputs(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                                           const ffi::AnyBuffer& v,
                                           const ffi::RemainingArgs& extras,
                                           const ffi::Dictionary& attrs) {
  auto options = decode_options(attrs);
  if (options.has_error()) return ffi::Unexpected(options.error());
  auto dims = attention_dims(q, k, v);
  if (dims.has_error()) return ffi::Unexpected(dims.error());
  auto dtype = to_dtype(q.element_type());
  if (dtype.has_error()) return ffi::Unexpected(dtype.error());
  const AttentionDims& d = *dims;
  Call<P> call{};
  call.dtype = *dtype;
  call.deterministic = options->deterministic;
  P& p = call.params;
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.heads_q = d.heads_q;
  p.heads_kv = d.heads_kv;
  p.head_dim = d.head_dim;
  if (auto e = decode_mask(extras, *options, d, call.dtype, p); e.failure()) {
    return ffi::Unexpected(e);
  }
  if (!params_well_formed(p)) {
    return ffi::Unexpected(invalid("q, k, v and the options do not form a valid call"));
  }
  return call;
}

inline ffi::ErrorOr<FwdCall> decode_fwd(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                                        const ffi::AnyBuffer& v, const ffi::RemainingArgs& extras,
                                        ffi::AnyBuffer o, ffi::AnyBuffer lse,
                                        const ffi::Dictionary& attrs) {
  auto call = decode_inputs<FwdParams>(q, k, v, extras, attrs);
  if (call.has_error()) return ffi::Unexpected(call.error());
  FwdParams& p = call->params;
  const int64_t rows = p.layout.rows_q() * p.heads_q;
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
                                        const ffi::RemainingArgs& extras, ffi::AnyBuffer dq,
                                        ffi::AnyBuffer dk, ffi::AnyBuffer dv,
                                        const ffi::Dictionary& attrs) {
  auto call = decode_inputs<BwdParams>(q, k, v, extras, attrs);
  if (call.has_error()) return ffi::Unexpected(call.error());
  BwdParams& p = call->params;
  const ffi::DataType elem = q.element_type();
  const int64_t rows = p.layout.rows_q() * p.heads_q;
  const int64_t q_elems = rows * p.head_dim;
  const int64_t kv_elems = p.layout.rows_k() * p.heads_kv * p.head_dim;
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
  p.dq_semaphores = nullptr;
  return call;
}

}  // namespace jax_flash::ffi_glue
