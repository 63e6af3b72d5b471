// The decode call: a few query rows per sequence against a key/value cache whose length differs
// per sequence, contiguous or paged. The keys of one sequence are split across `num_splits`
// independent pieces of work, each writing a partial (O, lse) that a merge step combines through
// the lse; the split count is chosen on the host from the shape and the device.
//
// Layouts (row-major; every leading axis of q is folded into `batch`):
//   q, o           : [batch, seqlen_q, heads_q, head_dim]
//   k, v contiguous: [batch, cache_len, heads_kv, head_dim]
//   k, v paged     : [num_pages, page_size, heads_kv, head_dim]; block_table [batch, max_pages]
//                    maps logical block j of sequence b (keys j * page_size ..) to a page.
//   cache_seqlens  : [batch] int32; sequence b holds keys 0 .. cache_seqlens[b] - 1, clamped to
//                    [0, cache_capacity()]. Keys at or past it are never read.
//   lse            : [batch, heads_q, seqlen_q], stats dtype (float32; float64 for float64)
//   partial_o      : [batch, num_splits, heads_q, seqlen_q, head_dim], stats dtype
//   partial_lse    : [batch, num_splits, heads_q, seqlen_q], stats dtype
// The partials are workspace owned by XLA (the handler never allocates); with num_splits == 1 they
// may be null and the kernel writes o and lse directly.
//
// The mask is the one policy of common/mask.h, applied per sequence with
// seqlen_k = cache_seqlens[b]: mask.band.for_seq(seqlen_q, seqlen_k). With bottom_right (the
// default) the seqlen_q queries are the last seqlen_q positions of the sequence, so causal means
// query i sees keys j <= seqlen_k - seqlen_q + i. Softcap and sinks as in MaskParams; a sink
// enters each row's denominator once (the merge adds it, not every split). Segment ids are not
// part of a decode call. A row that sees no key gives O = 0 and lse = -inf (the sink with sinks).
// Page indices read from block_table are clamped to [0, num_pages): a wrong table gives wrong
// results, never an out-of-bounds read.
#pragma once

#include <cstdint>

#include "common/mask.h"

namespace jax_flash {

struct DecodeParams {
  const void* q;
  const void* k;
  const void* v;
  const int32_t* cache_seqlens;
  const int32_t* block_table;  // nullptr: contiguous cache
  void* o;
  void* lse;
  void* partial_o;
  void* partial_lse;
  int64_t batch;
  int64_t seqlen_q;
  int64_t heads_q;
  int64_t heads_kv;
  int64_t head_dim;
  int64_t cache_len;  // contiguous: the cache's capacity per sequence; paged: unused (0)
  int64_t num_pages;  // paged only
  int64_t page_size;  // paged only
  int64_t max_pages;  // paged only: block_table's second axis
  int64_t num_splits;
  double softmax_scale;
  MaskParams mask;  // mask.segments stays disabled

  JF_HOST_DEVICE bool paged() const { return block_table != nullptr; }
  // The most keys a sequence can hold.
  JF_HOST_DEVICE int64_t cache_capacity() const {
    return paged() ? max_pages * page_size : cache_len;
  }
  // Sequence b's key count, clamped into the cache.
  JF_HOST_DEVICE int64_t seqlen_k(int64_t b) const {
    return clamp64(cache_seqlens[b], 0, cache_capacity());
  }
  // Row offset of key `j` of sequence `b` in the [rows, heads_kv, head_dim] view of k and v.
  JF_HOST_DEVICE int64_t key_row(int64_t b, int64_t j) const {
    if (!paged()) return b * cache_len + j;
    const int64_t page = clamp64(block_table[b * max_pages + j / page_size], 0, num_pages - 1);
    return page * page_size + j % page_size;
  }
  // The keys some row of sequence b may see, [lo, hi) (mask.band.for_seq(seqlen_q, seqlen_k(b))
  // .key_begin(0) and .key_end(seqlen_q)), are split into num_splits pieces: keys
  // [split_begin(s, lo, hi, granule), split_begin(s + 1, lo, hi, granule)) belong to split s.
  // The range starts at lo rounded down to a multiple of `granule` (the kernel's key tile) and the
  // shares are whole granules, so no tile straddles two splits. Trailing splits may be empty.
  JF_HOST_DEVICE int64_t split_begin(int64_t s, int64_t lo, int64_t hi, int64_t granule) const {
    const int64_t start = lo / granule * granule;
    const int64_t tiles = hi > start ? (hi - start + granule - 1) / granule : 0;
    const int64_t per = (tiles + num_splits - 1) / num_splits;
    const int64_t begin = start + s * per * granule;
    return begin < hi ? (begin > start ? begin : start) : (hi > start ? hi : start);
  }
};

// What every decode implementation relies on, checked by the FFI decode and by direct callers.
inline bool decode_params_well_formed(const DecodeParams& p) {
  if (p.batch < 0 || p.seqlen_q < 0 || p.heads_q < 1 || p.heads_kv < 1 ||
      p.heads_q % p.heads_kv != 0 || p.head_dim < 1 || p.num_splits < 1) {
    return false;
  }
  if (!(p.softmax_scale > 0.0) || !(p.softmax_scale < 1e300)) return false;
  if (!(p.mask.softcap >= 0.0) || !(p.mask.softcap < 1e300)) return false;
  if (p.mask.band.left < 0 || p.mask.band.right < 0 || p.mask.segments.enabled()) return false;
  if (p.mask.band.shift < -kMaxBandShift || p.mask.band.shift > kMaxBandShift) return false;
  if (p.paged()) {
    if (p.num_pages < 1 || p.page_size < 1 || p.max_pages < 0) return false;
  } else if (p.cache_len < 0) {
    return false;
  }
  return p.num_splits == 1 || (p.partial_o != nullptr && p.partial_lse != nullptr);
}

}  // namespace jax_flash
