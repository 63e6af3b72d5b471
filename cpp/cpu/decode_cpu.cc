// CPU decode kernel. One task per (sequence, kv head, split): the task's rows are the seqlen_q * G
// (position, query head) pairs that read kv head hk, row r being position r / G of query head
// hk * G + r % G. Each key tile of the split is converted to the compute type once and every row
// that sees some of it runs its online softmax over the keys it sees (the band of common/mask.h,
// per sequence). The partials and their merge follow common/decode_params.h, so this kernel and
// the CUDA one split and merge the same way.
#include "cpu/decode_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpu/half.h"

namespace jax_flash::cpu {
namespace {

// n elements of a K, V or Q row to the compute type.
template <class T, class S>
inline void LoadRow(const S* src, int64_t n, T scale, T* dst) {
  for (int64_t d = 0; d < n; ++d) dst[d] = Load<T>(src + d) * scale;
}

// Eight independent partial sums: the compiler vectorises them without reassociating a single
// sum (no -ffast-math), and the products stay in the compute type.
template <class T>
inline T Dot(const T* a, const T* b, int64_t n) {
  constexpr int kU = 8;
  T acc[kU] = {};
  int64_t d = 0;
  for (; d + kU <= n; d += kU) {
    for (int u = 0; u < kU; ++u) acc[u] += a[d + u] * b[d + u];
  }
  T s = 0;
  for (; d < n; ++d) s += a[d] * b[d];
  for (int u = 0; u < kU; ++u) s += acc[u];
  return s;
}

// Where one sequence's rows, keys and outputs live, for one kv head.
struct TaskView {
  const DecodeParams& p;
  int64_t b, hk, group, len_k;
  SeqMask band;

  TaskView(const DecodeParams& params, int64_t batch_index, int64_t kv_head)
      : p(params),
        b(batch_index),
        hk(kv_head),
        group(params.heads_q / params.heads_kv),
        len_k(params.seqlen_k(batch_index)),
        band(params.mask.band.for_seq(params.seqlen_q, params.seqlen_k(batch_index))) {}

  int64_t Rows() const { return p.seqlen_q * group; }
  int64_t Position(int64_t r) const { return r / group; }
  int64_t Head(int64_t r) const { return hk * group + r % group; }
  // Element offset of row r in Q and O [batch, seqlen_q, heads_q, head_dim].
  int64_t QOffset(int64_t r) const {
    return ((b * p.seqlen_q + Position(r)) * p.heads_q + Head(r)) * p.head_dim;
  }
  // Offset of row r in lse [batch, heads_q, seqlen_q].
  int64_t LseOffset(int64_t r) const {
    return (b * p.heads_q + Head(r)) * p.seqlen_q + Position(r);
  }
  // Offset of row r of split s in partial_lse [batch, num_splits, heads_q, seqlen_q] (times
  // head_dim: in partial_o).
  int64_t PartialOffset(int64_t s, int64_t r) const {
    return ((b * p.num_splits + s) * p.heads_q + Head(r)) * p.seqlen_q + Position(r);
  }
  // The sink of row r's query head, -inf without sinks (no term in the denominator).
  template <class T>
  double Sink(int64_t r) const {
    if (p.mask.sinks == nullptr) return -std::numeric_limits<double>::infinity();
    return static_cast<const T*>(p.mask.sinks)[b * p.mask.sinks_batch_stride + Head(r)];
  }
};

// One row's online-softmax state over the keys seen so far: O unnormalised relative to e^max.
template <class T>
struct RowState {
  T* o;
  T max;
  T sum;
};

// Runs keys [k0, k1) of one split through the online softmax of every row of the task.
template <class T, class S>
void SplitRows(const TaskView& t, int64_t k0, int64_t k1, const T* q,
               std::vector<RowState<T>>& rows, T* kt, T* vt, T* scores) {
  const DecodeParams& p = t.p;
  const int64_t d_dim = p.head_dim;
  const int64_t kv_ld = p.heads_kv * d_dim;
  const S* k_src = static_cast<const S*>(p.k) + t.hk * d_dim;
  const S* v_src = static_cast<const S*>(p.v) + t.hk * d_dim;
  const T cap = static_cast<T>(p.mask.softcap);
  for (int64_t c0 = k0; c0 < k1; c0 += kDecodeKeyTile) {
    const int64_t c1 = std::min(c0 + kDecodeKeyTile, k1);
    for (int64_t j = c0; j < c1; ++j) {
      const int64_t row = p.key_row(t.b, j);
      LoadRow(k_src + row * kv_ld, d_dim, T(1), kt + (j - c0) * d_dim);
      LoadRow(v_src + row * kv_ld, d_dim, T(1), vt + (j - c0) * d_dim);
    }
    for (int64_t r = 0; r < t.Rows(); ++r) {
      const int64_t i = t.Position(r);
      const int64_t a = std::max(c0, t.band.key_begin(i));
      const int64_t e = std::min(c1, t.band.key_end(i + 1));
      if (a >= e) continue;
      const T* qr = q + r * d_dim;
      T tile_max = -std::numeric_limits<T>::infinity();
      for (int64_t j = a; j < e; ++j) {
        T s = Dot(qr, kt + (j - c0) * d_dim, d_dim);
        if (cap > 0) s = cap * std::tanh(s / cap);
        scores[j - a] = s;
        tile_max = std::max(tile_max, s);
      }
      RowState<T>& st = rows[r];
      const T new_max = std::max(st.max, tile_max);
      // The first tile a row sees has max = -inf, whose rescale exp(-inf) = 0 clears nothing
      // that was there; a score of +inf or NaN propagates as it would in the reference.
      const T alpha = std::exp(st.max - new_max);
      if (alpha != T(1)) {
        for (int64_t d = 0; d < d_dim; ++d) st.o[d] *= alpha;
        st.sum *= alpha;
      }
      for (int64_t j = a; j < e; ++j) {
        const T w = std::exp(scores[j - a] - new_max);
        st.sum += w;
        const T* vj = vt + (j - c0) * d_dim;
        for (int64_t d = 0; d < d_dim; ++d) st.o[d] += w * vj[d];
      }
      st.max = new_max;
    }
  }
}

// Merges n partial results of one row, each a normalised O_s [head_dim] (at o + s * o_stride)
// and lse_s (at lse + s * lse_stride; -inf for a split that saw no key), with the row's sink:
// lse = log(sum_s e^lse_s + e^sink), O = sum_s e^(lse_s - lse) O_s. The sink enters once, here,
// never in a split. A row without keys gives O = 0 and lse = -inf, or the sink.
template <class T, class S>
void MergeRow(int64_t n, const T* lse, int64_t lse_stride, const T* o, int64_t o_stride,
              int64_t d_dim, double sink, double* acc, S* out, T* lse_out) {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  double top = sink;
  for (int64_t s = 0; s < n; ++s) top = std::max<double>(top, lse[s * lse_stride]);
  std::fill(acc, acc + d_dim, 0.0);
  if (top == -kInf) {
    for (int64_t d = 0; d < d_dim; ++d) Store(out + d, 0.0);
    *lse_out = -std::numeric_limits<T>::infinity();
    return;
  }
  double total = sink > -kInf ? std::exp(sink - top) : 0.0;
  for (int64_t s = 0; s < n; ++s) {
    const double l = lse[s * lse_stride];
    if (l == -kInf) continue;
    const double w = std::exp(l - top);
    total += w;
    const T* os = o + s * o_stride;
    for (int64_t d = 0; d < d_dim; ++d) acc[d] += w * static_cast<double>(os[d]);
  }
  for (int64_t d = 0; d < d_dim; ++d) Store(out + d, acc[d] / total);
  *lse_out = static_cast<T>(top + std::log(total));
}

template <class T, class S>
void Decode(const DecodeParams& p, const ParallelFor& parallel_for) {
  const int64_t d_dim = p.head_dim;
  const int64_t splits = p.num_splits;
  const int64_t group = p.heads_q / p.heads_kv;
  const int64_t n_rows = p.seqlen_q * group;
  const T scale = static_cast<T>(p.softmax_scale);
  T* const partial_o = static_cast<T*>(p.partial_o);
  T* const partial_lse = static_cast<T*>(p.partial_lse);

  parallel_for(p.batch * p.heads_kv * splits, [&](int64_t task) {
    const int64_t s = task % splits;
    const TaskView t(p, task / splits / p.heads_kv, task / splits % p.heads_kv);
    // The keys some row sees, cut into whole tiles per split; the first split may start below
    // lo (the range is tile-aligned), where no row sees anything.
    const int64_t lo = t.band.key_begin(0);
    const int64_t hi = t.band.key_end(p.seqlen_q);
    const int64_t k0 = std::max(lo, p.split_begin(s, lo, hi, kDecodeKeyTile));
    const int64_t k1 = std::min(hi, p.split_begin(s + 1, lo, hi, kDecodeKeyTile));

    std::vector<T> buffer(
        static_cast<size_t>(n_rows * d_dim * 2 + 2 * kDecodeKeyTile * d_dim + kDecodeKeyTile));
    T* q = buffer.data();
    T* o = q + n_rows * d_dim;
    T* kt = o + n_rows * d_dim;
    T* vt = kt + kDecodeKeyTile * d_dim;
    T* scores = vt + kDecodeKeyTile * d_dim;
    std::vector<RowState<T>> rows(static_cast<size_t>(n_rows));
    for (int64_t r = 0; r < n_rows; ++r) {
      rows[r] = {o + r * d_dim, -std::numeric_limits<T>::infinity(), T(0)};
      // The rows carry the softmax scale, so a score is one dot product.
      LoadRow(static_cast<const S*>(p.q) + t.QOffset(r), d_dim, scale, q + r * d_dim);
    }
    if (k0 < k1) SplitRows<T, S>(t, k0, k1, q, rows, kt, vt, scores);

    std::vector<double> acc(static_cast<size_t>(d_dim));
    for (int64_t r = 0; r < n_rows; ++r) {
      RowState<T>& st = rows[r];
      // The split's normalised partial: O / sum and lse = max + log(sum).
      const T inv = st.sum > 0 ? T(1) / st.sum : T(0);
      for (int64_t d = 0; d < d_dim; ++d) st.o[d] *= inv;
      const T lse =
          st.sum > 0
              ? static_cast<T>(static_cast<double>(st.max) + std::log(static_cast<double>(st.sum)))
              : -std::numeric_limits<T>::infinity();
      if (splits == 1) {
        MergeRow<T, S>(1, &lse, 0, st.o, 0, d_dim, t.Sink<T>(r), acc.data(),
                       static_cast<S*>(p.o) + t.QOffset(r),
                       static_cast<T*>(p.lse) + t.LseOffset(r));
      } else {
        const int64_t at = t.PartialOffset(s, r);
        std::copy(st.o, st.o + d_dim, partial_o + at * d_dim);
        partial_lse[at] = lse;
      }
    }
  });
  if (splits == 1) return;

  // Merge in split order, one task per (sequence, kv head): deterministic.
  parallel_for(p.batch * p.heads_kv, [&](int64_t task) {
    const TaskView t(p, task / p.heads_kv, task % p.heads_kv);
    const int64_t split_stride = p.heads_q * p.seqlen_q;
    std::vector<double> acc(static_cast<size_t>(d_dim));
    for (int64_t r = 0; r < n_rows; ++r) {
      const int64_t at = t.PartialOffset(0, r);
      MergeRow<T, S>(splits, partial_lse + at, split_stride, partial_o + at * d_dim,
                     split_stride * d_dim, d_dim, t.Sink<T>(r), acc.data(),
                     static_cast<S*>(p.o) + t.QOffset(r), static_cast<T*>(p.lse) + t.LseOffset(r));
    }
  });
}

}  // namespace

void decode_fwd(const DecodeParams& params, DType dtype, const ParallelFor& parallel_for) {
  switch (dtype) {
    case DType::kF16:
      return Decode<float, Half>(params, parallel_for);
    case DType::kBF16:
      return Decode<float, BFloat16>(params, parallel_for);
    case DType::kF32:
      return Decode<float, float>(params, parallel_for);
    case DType::kF64:
      return Decode<double, double>(params, parallel_for);
  }
}

}  // namespace jax_flash::cpu
