// The one mask policy of every kernel family (CPU, scalar CUDA, mma.sync, wgmma), forward and
// backward: which keys a query row may see, which key tiles a query tile must visit (and the
// reverse, for the backward's key-major loops), and which tiles need element masking at all.
// Usable on the host and on the device; it holds only integers, so its answers are exact.
//
// Within one sequence of seqlen_q queries and seqlen_k keys, query i sees key j iff
//   0 <= j < seqlen_k,  i + offset - left <= j <= i + offset + right,
// and, with segment ids, q_segment_ids[i] == kv_segment_ids[j]. offset = seqlen_k - seqlen_q
// aligns the band to the bottom-right corner (causal is right = 0); a top-left aligned mask is the
// same band with offset 0. A side without a bound holds kUnbounded.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define JF_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define JF_HOST_DEVICE inline
#endif

namespace jax_flash {

// "No bound" on one side of the band. Positions are below 2^31, so adding or subtracting this to
// a position never overflows int64 and always lands outside every sequence.
inline constexpr int64_t kUnbounded = int64_t{1} << 40;

// The largest diagonal shift a call may ask for: a position difference, so below 2^31.
inline constexpr int64_t kMaxBandShift = int64_t{1} << 31;

// Segment ids are summarised per kSegmentChunk consecutive positions as (min, max), so that a
// kernel can prove a tile pair shares no segment (skip it) or a single one (no element masking)
// from a few loads, whatever its tile size. Every kernel tile size is a multiple of it.
inline constexpr int kSegmentChunk = 16;

// Each chunk's summary is a record of kSegmentRecord ints: the (min, max) of its own ids, then its
// reach, the (min, max) of the ids of every chunk that a tile walk still has ahead once it gets
// there. Walks go one way per axis: a query tile walks its key blocks downwards (forward), a key
// tile its query tiles upwards (backward). So a key chunk's reach covers chunks 0 .. c (a prefix)
// and a query chunk's covers c .. the row's last (a suffix). A walk whose tile's ids are disjoint
// from the reach at its next candidate can stop there: in a packed row of documents it ends at
// the document's edge instead of the row's.
inline constexpr int kSegmentRecord = 4;

JF_HOST_DEVICE int64_t clamp64(int64_t x, int64_t lo, int64_t hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}

// Clamps a tile-relative bound to the int range; beyond a tile's extent a bound only has to keep
// its sign and its magnitude relative to the tile sizes.
JF_HOST_DEVICE int clamp_to_int(int64_t x) {
  constexpr int64_t kFar = int64_t{1} << 30;
  return static_cast<int>(clamp64(x, -kFar, kFar));
}

// Element-wise visibility inside one (query tile at m0, key tile at n0) pair: local row r sees
// local column c iff lo(r) <= c < hi(r). Built once per tile pair, so the hot loop does two integer
// compares per element.
struct TileMask {
  int lo_diag;  // c >= r + lo_diag
  int hi_diag;  // c <= r + hi_diag
  int n_limit;  // c < n_limit (the end of the sequence's keys)

  JF_HOST_DEVICE int lo(int r) const { return r + lo_diag > 0 ? r + lo_diag : 0; }
  JF_HOST_DEVICE int hi(int r) const {
    const int h = r + hi_diag + 1;
    return h < n_limit ? h : n_limit;
  }
  JF_HOST_DEVICE bool visible(int r, int c) const {
    return c >= r + lo_diag && c <= r + hi_diag && c < n_limit;
  }
  // Column c's visibility for the rows r0 + 8i + e (i < steps <= 16, e = 0, 1), the rows of one
  // thread's accumulator column pairs in an m64nN wgmma fragment read transposed: bit 2i + e is
  // visible(r0 + 8i + e, c). The rows that see c are [c - hi_diag, c - lo_diag] (none when
  // c >= n_limit) and the pattern's rows increase with the bit index, so the set bits run from
  // the count of pattern rows below c - hi_diag to the count below c - lo_diag + 1.
  JF_HOST_DEVICE uint32_t pair_row_bits(int c, int r0, int steps) const {
    // #{(i, e) : r0 + 8i + e < x}: both e for every i < y / 8, then min(y % 8, 2) more.
    const auto below = [&](int x) {
      const int d = x - r0;
      const int m = d > 0 ? d : 0;
      const int y = m < 8 * steps ? m : 8 * steps;
      return 2 * (y / 8) + (y % 8 < 2 ? y % 8 : 2);
    };
    const auto low_bits = [](int n) { return n >= 32 ? ~0u : (1u << n) - 1u; };
    const int b0 = below(c - hi_diag);
    const int b1 = below(c - lo_diag + 1);
    return c < n_limit ? low_bits(b1) & ~low_bits(b0) : 0u;
  }
};

// The band of one sequence: what every kernel asks of the mask, in sequence-local positions.
struct SeqMask {
  int64_t lo_shift;  // key j is visible to query i only if j >= i + lo_shift
  int64_t hi_shift;  // ... and j <= i + hi_shift
  int64_t seqlen_q;
  int64_t seqlen_k;

  JF_HOST_DEVICE bool visible(int64_t i, int64_t j) const {
    return j >= 0 && j < seqlen_k && j >= i + lo_shift && j <= i + hi_shift;
  }
  // Keys that some query row of [r0, r1) may see: [key_begin(r0), key_end(r1)). Empty when
  // key_begin >= key_end.
  JF_HOST_DEVICE int64_t key_begin(int64_t r0) const { return clamp64(r0 + lo_shift, 0, seqlen_k); }
  JF_HOST_DEVICE int64_t key_end(int64_t r1) const {
    return r1 <= 0 ? 0 : clamp64(r1 - 1 + hi_shift + 1, 0, seqlen_k);
  }
  // Query rows that may see some key of [c0, c1): [row_begin(c0), row_end(c1)).
  JF_HOST_DEVICE int64_t row_begin(int64_t c0) const { return clamp64(c0 - hi_shift, 0, seqlen_q); }
  JF_HOST_DEVICE int64_t row_end(int64_t c1) const {
    return c1 <= 0 ? 0 : clamp64(c1 - 1 - lo_shift + 1, 0, seqlen_q);
  }
  // True when every row of [r0, r1) sees every key of [c0, c1) as far as the band and the
  // sequence end go: such a tile pair needs no element masking (segment ids aside).
  JF_HOST_DEVICE bool tile_full(int64_t r0, int64_t r1, int64_t c0, int64_t c1) const {
    return c1 <= seqlen_k && c0 >= (r1 - 1) + lo_shift && (c1 - 1) <= r0 + hi_shift;
  }
  // True when no row of [r0, r1) sees any key of [c0, c1).
  JF_HOST_DEVICE bool tile_empty(int64_t r0, int64_t r1, int64_t c0, int64_t c1) const {
    return c0 >= key_end(r1) || c1 <= key_begin(r0) || r1 <= r0 || c1 <= c0;
  }
  JF_HOST_DEVICE TileMask tile(int64_t m0, int64_t n0) const {
    return {clamp_to_int(m0 + lo_shift - n0), clamp_to_int(m0 + hi_shift - n0),
            clamp_to_int(seqlen_k - n0)};
  }
};

// The band as given to a call: both bounds >= 0 or kUnbounded, causal already folded into
// right = 0. The diagonal offset is a value: offset = (bottom_right ? seqlen_k - seqlen_q : 0) +
// shift. Bottom-right alignment is the default; the jax.nn-compatible entry point passes top-left
// (bottom_right = false), and a sequence-sharded caller shifts the diagonal by the distance between
// its query block and key block.
struct Band {
  int64_t left = kUnbounded;
  int64_t right = kUnbounded;
  int64_t shift = 0;  // |shift| <= kMaxBandShift
  bool bottom_right = true;

  JF_HOST_DEVICE bool unbounded() const { return left >= kUnbounded && right >= kUnbounded; }
  // Exactly one side bounded (causal, say): a sequence's query tiles see key ranges of different
  // lengths, so its tiles do unequal work. Both sides bounded (a sliding window) or neither: every
  // tile away from the sequence's ends sees as many keys as the next.
  JF_HOST_DEVICE bool one_sided() const { return (left >= kUnbounded) != (right >= kUnbounded); }
  // Any bound from kUnbounded up means none; clamping keeps every kernel's band arithmetic far
  // from int64 overflow.
  JF_HOST_DEVICE Band clamped() const {
    Band b = *this;
    b.left = left < kUnbounded ? left : kUnbounded;
    b.right = right < kUnbounded ? right : kUnbounded;
    return b;
  }
  JF_HOST_DEVICE SeqMask for_seq(int64_t seqlen_q, int64_t seqlen_k) const {
    const int64_t offset = (bottom_right ? seqlen_k - seqlen_q : 0) + shift;
    return {offset - left, offset + right, seqlen_q, seqlen_k};
  }
};

// Segment masking (dense batches only). ranges hold one record (kSegmentRecord ints) per
// kSegmentChunk positions: q_ranges with suffix reaches, kv_ranges with prefix reaches.
struct SegmentIds {
  const int32_t* q_ids = nullptr;      // [batch, seqlen_q]
  const int32_t* kv_ids = nullptr;     // [batch, seqlen_k]
  const int32_t* q_ranges = nullptr;   // [batch, ceil(seqlen_q / kSegmentChunk), kSegmentRecord]
  const int32_t* kv_ranges = nullptr;  // [batch, ceil(seqlen_k / kSegmentChunk), kSegmentRecord]
  // The rows' documents, for the kernels that schedule by them (SeqLayout::runs): [batch,
  // runs_per_row], or nullptr.
  const int32_t* runs = nullptr;
  int64_t runs_per_row = 0;

  JF_HOST_DEVICE bool enabled() const { return q_ids != nullptr; }
};

JF_HOST_DEVICE int64_t segment_chunks(int64_t seqlen) {
  return (seqlen + kSegmentChunk - 1) / kSegmentChunk;
}

// The records of batch row `batch` of a [batch, seqlen] id array.
JF_HOST_DEVICE const int32_t* segment_row(const int32_t* ranges, int64_t batch, int64_t seqlen) {
  return ranges + batch * segment_chunks(seqlen) * kSegmentRecord;
}

// (min, max) of segment ids over positions [p0, p1) of one batch row, from its chunk ranges.
// `ranges` points at the row's first chunk; p0 and p1 are clamped to the row by the caller.
struct IdRange {
  int32_t lo;
  int32_t hi;

  JF_HOST_DEVICE bool disjoint(const IdRange& o) const { return hi < o.lo || o.hi < lo; }
  // Both sides hold one and the same id: the pair needs no segment masking.
  JF_HOST_DEVICE bool same_single(const IdRange& o) const {
    return lo == hi && o.lo == o.hi && lo == o.lo;
  }
};

JF_HOST_DEVICE IdRange id_range(const int32_t* ranges, int64_t p0, int64_t p1) {
  IdRange r{2147483647, -2147483647 - 1};
  for (int64_t c = p0 / kSegmentChunk; c * kSegmentChunk < p1; ++c) {
    const int32_t lo = ranges[kSegmentRecord * c];
    const int32_t hi = ranges[kSegmentRecord * c + 1];
    r.lo = lo < r.lo ? lo : r.lo;
    r.hi = hi > r.hi ? hi : r.hi;
  }
  return r;
}

// id_range over [p0, p1) for a range of at most kChunks chunks starting on a chunk boundary: every
// load is issued before any is used (one memory round trip), each chunk's (min, max) as one 8-byte
// load. `ranges` must be 8-byte aligned.
template <int kChunks>
JF_HOST_DEVICE IdRange id_range_fixed(const int32_t* ranges, int64_t p0, int64_t p1) {
  const int64_t c0 = p0 / kSegmentChunk;
  int32_t lo[kChunks], hi[kChunks];
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const bool in = (c0 + i) * kSegmentChunk < p1;
#if defined(__CUDA_ARCH__)
    const int2 v = in ? *reinterpret_cast<const int2*>(ranges + kSegmentRecord * (c0 + i))
                      : make_int2(2147483647, -2147483647 - 1);
    lo[i] = v.x;
    hi[i] = v.y;
#else
    lo[i] = in ? ranges[kSegmentRecord * (c0 + i)] : 2147483647;
    hi[i] = in ? ranges[kSegmentRecord * (c0 + i) + 1] : -2147483647 - 1;
#endif
  }
  IdRange r{lo[0], hi[0]};
#pragma unroll
  for (int i = 1; i < kChunks; ++i) {
    r.lo = lo[i] < r.lo ? lo[i] : r.lo;
    r.hi = hi[i] > r.hi ? hi[i] : r.hi;
  }
  return r;
}

// The reach of chunk `chunk` of a row's records (see kSegmentRecord): for key records every id at
// or before the chunk, for query records every id at or after it. One 8-byte load on the device.
JF_HOST_DEVICE IdRange id_reach(const int32_t* ranges, int64_t chunk) {
#if defined(__CUDA_ARCH__)
  const int2 v = *reinterpret_cast<const int2*>(ranges + kSegmentRecord * chunk + 2);
  return {v.x, v.y};
#else
  return {ranges[kSegmentRecord * chunk + 2], ranges[kSegmentRecord * chunk + 3]};
#endif
}

// Builds the records of a [batch, seqlen] id array on the host (the drivers and native checks;
// jax_flash/_kernel.py builds the same in XLA): prefix reaches for keys, suffix reaches for
// queries. `out` holds batch * segment_chunks(seqlen) * kSegmentRecord ints.
inline void build_segment_records(const int32_t* ids, int64_t batch, int64_t seqlen,
                                  bool suffix_reach, int32_t* out) {
  const int64_t chunks = segment_chunks(seqlen);
  for (int64_t b = 0; b < batch; ++b) {
    int32_t* const row = out + b * chunks * kSegmentRecord;
    for (int64_t c = 0; c < chunks; ++c) {
      int32_t lo = 2147483647, hi = -2147483647 - 1;
      for (int64_t p = c * kSegmentChunk; p < (c + 1) * kSegmentChunk && p < seqlen; ++p) {
        const int32_t id = ids[b * seqlen + p];
        lo = id < lo ? id : lo;
        hi = id > hi ? id : hi;
      }
      row[kSegmentRecord * c] = lo;
      row[kSegmentRecord * c + 1] = hi;
    }
    for (int64_t i = 0; i < chunks; ++i) {
      const int64_t c = suffix_reach ? chunks - 1 - i : i;
      const int64_t prev = suffix_reach ? c + 1 : c - 1;
      int32_t lo = row[kSegmentRecord * c], hi = row[kSegmentRecord * c + 1];
      if (i > 0) {
        lo = row[kSegmentRecord * prev + 2] < lo ? row[kSegmentRecord * prev + 2] : lo;
        hi = row[kSegmentRecord * prev + 3] > hi ? row[kSegmentRecord * prev + 3] : hi;
      }
      row[kSegmentRecord * c + 2] = lo;
      row[kSegmentRecord * c + 3] = hi;
    }
  }
}

// Everything about which scores exist and what they are, besides the sizes: the band, segment
// ids, logit soft-capping and attention sinks.
struct MaskParams {
  Band band;
  SegmentIds segments;
  // s = softcap * tanh(softmax_scale * q.k / softcap) when > 0; 0 turns it off.
  double softcap = 0.0;
  // One extra logit per query head in every row's softmax denominator, with no value:
  // [batch, heads_q] (the batch stride is 0 for a packed varlen call), float32 (float64 for
  // float64 inputs); nullptr when the call has none. A forward kernel starts each row's online
  // softmax at m = sink, l = 1; nothing else changes, since lse includes the sink.
  const void* sinks = nullptr;
  int64_t sinks_batch_stride = 0;
};

}  // namespace jax_flash
