// The only data that crosses from the FFI layer into a kernel launcher: raw pointers, sizes and
// flags. Kernels and launchers include this header and nothing from XLA or nanobind.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/mask.h"
#include "common/schedule.h"

namespace jax_flash {

// Element type of Q, K, V, O and the gradients. lse and delta are float32, or float64 when the
// inputs are float64.
enum class DType : int { kF16 = 0, kBF16 = 1, kF32 = 2, kF64 = 3 };

// All tensors are dense and row-major, in the layout of jax.nn.dot_product_attention. Every leading
// axis (the batch axis and any axes added by vmap) is folded into `batch`.
//   Q, O, dO, dQ : [batch, seqlen_q, heads_q, head_dim]   packed: [total_q, heads_q, head_dim]
//   K, V, dK, dV : [batch, seqlen_k, heads_kv, head_dim]  packed: [total_k, heads_kv, head_dim]
//   lse, delta   : [batch, heads_q, seqlen_q]             packed: [heads_q, total_q]
// heads_q is a multiple of heads_kv; query head h reads key/value head h / (heads_q / heads_kv).
// `layout` says where each sequence lives (common/schedule.h) and `mask` which scores exist
// (common/mask.h). A query row that sees no key gives O = 0, lse = -inf (the sink with sinks) and
// zero gradients.
struct FwdParams {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  void* lse;  // natural-log log-sum-exp of the scaled scores
  int64_t heads_q;
  int64_t heads_kv;
  int64_t head_dim;
  double softmax_scale;
  MaskParams mask;
  SeqLayout layout;
  // int32 scratch of at least one element, or nullptr. Given, the wgmma forward may run a
  // persistent grid whose CTAs claim query tiles from it (cuda/fwd_wgmma.cu says when); the
  // launcher zeroes it on the stream.
  int32_t* work_counter = nullptr;
};

struct BwdParams {
  const void* q;
  const void* k;
  const void* v;
  const void* dout;   // dO, the cotangent of O
  const void* lse;    // as written by the forward pass
  const void* delta;  // rowsum(dO * O) - dlse, laid out like lse, computed by the caller
  void* dq;
  void* dk;
  void* dv;
  // fp32 scratch for atomically accumulated dQ, laid out like dQ; used by the
  // CUDA tensor-core path only, nullptr elsewhere. The launcher zeroes it on the stream.
  float* dq_accum;
  // int32 scratch of rows_q * heads_q * 2 counters (two per dQ row and head; only a query tile's
  // first row is used), or nullptr. Given, the tensor-core paths add each dQ tile's contributions
  // in a fixed order (key tiles descending), so dQ is bitwise reproducible; without it the fp32
  // atomics land in whatever order the CTAs reach them. The launcher zeroes it on the stream.
  int32_t* dq_semaphores;
  int64_t heads_q;
  int64_t heads_kv;
  int64_t head_dim;
  double softmax_scale;
  MaskParams mask;
  SeqLayout layout;
};

// What every kernel family relies on, checked in this one place: by the FFI decode for every call
// and by each family's launcher for direct callers (tools/), before the family's own limits (head
// dims, int ranges, alignment). Bounds are >= 0 (kUnbounded or more means none), the softcap
// finite and >= 0 (0: none), segment ids come with their ranges and only on dense batches.
template <class P>
inline bool params_well_formed(const P& p) {
  const SeqLayout& l = p.layout;
  const MaskParams& m = p.mask;
  if (p.heads_q < 1 || p.heads_kv < 1 || p.heads_q % p.heads_kv != 0 || l.heads_q != p.heads_q ||
      p.head_dim < 1) {
    return false;
  }
  if (!std::isfinite(p.softmax_scale) || p.softmax_scale <= 0.0) return false;
  if (!std::isfinite(m.softcap) || m.softcap < 0.0) return false;
  if (m.band.left < 0 || m.band.right < 0) return false;
  if (m.band.shift < -kMaxBandShift || m.band.shift > kMaxBandShift) return false;
  if (l.varlen()) {
    if (l.cu_seqlens_k == nullptr || l.num_seqs < 0 || l.total_q < 0 || l.total_k < 0 ||
        m.segments.enabled()) {
      return false;
    }
  } else if (l.batch < 0 || l.seqlen_q < 0 || l.seqlen_k < 0) {
    return false;
  }
  // Chunk ranges are read as (min, max) pairs of 8 bytes (id_range_fixed).
  const SegmentIds& s = m.segments;
  const auto pairs_aligned = [](const int32_t* r) {
    return reinterpret_cast<uintptr_t>(r) % 8 == 0;
  };
  return !s.enabled() || (s.kv_ids != nullptr && s.q_ranges != nullptr && s.kv_ranges != nullptr &&
                          pairs_aligned(s.q_ranges) && pairs_aligned(s.kv_ranges));
}

}  // namespace jax_flash
