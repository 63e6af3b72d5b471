// The one description of where a (sequence, head, tile) of a call lives, for every kernel family:
// dense batches of equal-length sequences and packed variable-length (cu_seqlens) batches alike.
// A kernel enumerates tiles of one head with `tiles(block)` and turns a tile index into the
// sequence's span and the tile's block index with `tile(t, block)`; everything it then reads or
// writes is addressed through the span. Usable on the host and on the device.
//
// Q, O, dO and dQ are viewed as [rows, heads_q, head_dim] and K, V, dK, dV as [rows, heads_kv,
// head_dim]: a dense [batch, seqlen, heads, head_dim] tensor has batch * seqlen rows with sequence
// b at rows b * seqlen ..; a packed one has total rows with sequence n at cu_seqlens[n] ..
// cu_seqlens[n + 1]. Rows past cu_seqlens[num_seqs] form one more, key-less (query-less for the
// backward's key tiles) span, so that every output row is written by the kernel that owns it.
#pragma once

#include <cstdint>

#include "common/mask.h"

namespace jax_flash {

// One sequence of a call as a kernel sees it.
struct SeqSpan {
  int64_t seq;      // dense: batch index; varlen: sequence index (num_seqs for the padding span)
  int64_t batch;    // index of per-batch arrays (segment ids, sinks): seq when dense, 0 when packed
  int64_t q_start;  // first row of the sequence in the [rows, heads_q, head_dim] view of Q
  int64_t k_start;  // first row in the [rows, heads_kv, head_dim] view of K
  int64_t len_q;
  int64_t len_k;
  // lse and delta of (query head h, sequence-local row i) sit at stat_start + h * stat_head + i.
  int64_t stat_start;
  int64_t stat_head;
};

// One tile of a span: block index `block` of the span, whose rows [block * size, ...) may lie past
// the span's end (then the kernel has nothing to do for it, but must still leave no output row
// unwritten: every row of the span is covered by the tiles with block * size < len).
struct SeqTile {
  SeqSpan span;
  int64_t block;

  // True when the tile holds no row of its span (the spare slot of a packed span, or a slot of
  // malformed cu_seqlens): the kernel skips it.
  JF_HOST_DEVICE bool empty(int64_t size, bool keys) const {
    return block < 0 || block * size >= (keys ? span.len_k : span.len_q);
  }
};

struct SeqLayout {
  // Dense: `batch` sequences of seqlen_q queries and seqlen_k keys; lse [batch, heads_q, seqlen_q].
  int64_t batch = 0;
  int64_t seqlen_q = 0;
  int64_t seqlen_k = 0;
  int64_t heads_q = 0;
  // Packed (cu_seqlens_q != nullptr): num_seqs sequences in total_q query rows and total_k key
  // rows; lse [heads_q, total_q]. cu_seqlens_* are [num_seqs + 1] int32 on the kernel's device.
  // Malformed values (decreasing, negative, past the totals) are clamped, never trusted: they can
  // give wrong results but no out-of-bounds access.
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_k = nullptr;
  int64_t num_seqs = 0;
  int64_t total_q = 0;
  int64_t total_k = 0;
  // Static upper bounds of the sequence lengths (total_q / total_k when not given); kernels may
  // use them to choose tile configurations only, never to bound an access or a loop.
  int64_t max_seqlen_q = 0;
  int64_t max_seqlen_k = 0;

  JF_HOST_DEVICE bool varlen() const { return cu_seqlens_q != nullptr; }
  JF_HOST_DEVICE int64_t rows_q() const { return varlen() ? total_q : batch * seqlen_q; }
  JF_HOST_DEVICE int64_t rows_k() const { return varlen() ? total_k : batch * seqlen_k; }
  // Spans a call has: dense batch, packed num_seqs + 1 (the padding span last).
  JF_HOST_DEVICE int64_t spans() const { return varlen() ? num_seqs + 1 : batch; }

  JF_HOST_DEVICE SeqSpan span(int64_t n) const {
    if (!varlen()) {
      return {n,        n,        n * seqlen_q,           n * seqlen_k,
              seqlen_q, seqlen_k, n * heads_q * seqlen_q, seqlen_q};
    }
    const int64_t q0 = bound(cu_seqlens_q, n, total_q);
    const int64_t k0 = bound(cu_seqlens_k, n, total_k);
    const int64_t q1 = clamp64(bound(cu_seqlens_q, n + 1, total_q), q0, total_q);
    const int64_t k1 = clamp64(bound(cu_seqlens_k, n + 1, total_k), k0, total_k);
    // The padding span has queries without keys (forward) and keys without queries (backward).
    const bool padding = n >= num_seqs;
    return {n, 0, q0, k0, q1 - q0, padding ? 0 : k1 - k0, q0, total_q};
  }

  // Tiles of `size` rows per head, over queries (keys = false) or keys (keys = true). Dense: every
  // sequence has ceil(seqlen / size) tiles. Packed: span n owns tile slots
  // [floor(cu[n] / size) + n, floor(cu[n + 1] / size) + n + 1), which hold its ceil(len / size)
  // tiles (at most one slot per span stays empty), so the slots of all spans are contiguous and
  // number floor(total / size) + num_seqs + 1 whatever the lengths.
  JF_HOST_DEVICE int64_t tiles(int64_t size, bool keys) const {
    if (!varlen()) return batch * ceil_div(keys ? seqlen_k : seqlen_q, size);
    return (keys ? total_k : total_q) / size + num_seqs + 1;
  }

  JF_HOST_DEVICE SeqTile tile(int64_t t, int64_t size, bool keys) const {
    if (!varlen()) {
      const int64_t per = ceil_div(keys ? seqlen_k : seqlen_q, size);
      const int64_t n = per > 0 ? t / per : 0;
      return {span(n), t - n * per};
    }
    const int32_t* cu = keys ? cu_seqlens_k : cu_seqlens_q;
    const int64_t total = keys ? total_k : total_q;
    // Largest n in [0, num_seqs] with slot_start(n) <= t; slot_start is increasing in n.
    int64_t lo = 0, hi = num_seqs;
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (bound(cu, mid, total) / size + mid <= t) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    SeqSpan s = span(lo);
    // A key tile of the padding span covers the keys past cu_seqlens_k[num_seqs]: its span needs
    // those keys and no queries.
    if (keys && lo >= num_seqs) {
      const int64_t k0 = s.k_start;
      s.len_k = total_k - k0;
      s.len_q = 0;
    }
    return {s, t - (bound(cu, lo, total) / size + lo)};
  }

 private:
  JF_HOST_DEVICE static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
  // cu[n] clamped to [0, total]; n == num_seqs + 1 (one past the padding span) reads as total.
  JF_HOST_DEVICE int64_t bound(const int32_t* cu, int64_t n, int64_t total) const {
    if (n > num_seqs) return total;
    return clamp64(cu[n], 0, total);
  }
};

// The order in which a grid's CTAs take their tiles. A unit is what a CTA's tiles share through
// L2 (one head of one sequence, or one head of a packed call: its K/V in the forward, its Q/dO in
// the backward); each unit has per_unit tiles, taken by `level` (0 first). Units go in groups of
// `group`: inside a group the CTAs walk the levels one by one with the group's units fastest, so a
// group's heaviest tiles (level 0, when the caller puts them there) all start before any of its
// lighter ones. group = 1 is unit-major order (all of a unit's tiles, then the next unit's), which
// keeps the fewest units' data in L2 but lets the last unit's heavy tiles start last and finish
// after every other CTA; a larger group shortens that tail at the cost of group units' data in
// L2 at once.
//
// launch_group chooses the group (measured on an H200, docs/PERF_LOG.md): grouping pays where a
// unit's tiles do unequal work (a causal band, packed documents of different lengths, segment
// ids) and costs L2 reuse where they all do the same (no band, a sliding window); so those launch
// unit-major, and the others group as many units as keep about kLaunchGroupBytes of the data
// their tiles share (unit_bytes: K and V of a sequence-head in the forward, Q and dO in the
// backward; 0 when unknown, as with segment ids) in flight, at most kMaxLaunchGroup.
inline constexpr int64_t kLaunchGroupBytes = int64_t{16} << 20;
inline constexpr int64_t kMaxLaunchGroup = 16;

JF_HOST_DEVICE int64_t launch_group(bool unequal_tiles, int64_t unit_bytes, int64_t units) {
  if (!unequal_tiles || units <= 1) return 1;
  int64_t g = unit_bytes > 0 ? kLaunchGroupBytes / unit_bytes : kMaxLaunchGroup;
  g = g < kMaxLaunchGroup ? g : kMaxLaunchGroup;
  g = g < units ? g : units;
  return g > 1 ? g : 1;
}

struct LaunchOrder {
  int64_t units = 0;
  int64_t per_unit = 0;
  int64_t group = 1;  // >= 1

  JF_HOST_DEVICE int64_t ctas() const { return units * per_unit; }
  // (unit, level) of grid position cta < ctas().
  JF_HOST_DEVICE void locate(int64_t cta, int64_t& unit, int64_t& level) const {
    const int64_t span = group * per_unit;
    const int64_t first = (cta / span) * group;
    const int64_t size = units - first < group ? units - first : group;
    const int64_t r = cta - first * per_unit;
    level = r / size;
    unit = first + (r - level * size);
  }
};

// The launch order of `units` units of per_unit tiles each, for a call with this layout and mask,
// in its launch_group. A unit's tiles share one sequence's keys (keys = true: the forward's K and
// V) or queries (the backward's Q and dO): at most max_seqlen rows of a packed call, seqlen of a
// dense one, of row_bytes each, which shared_by adjacent units (the query heads of a GQA group)
// read too.
JF_HOST_DEVICE LaunchOrder launch_order(const SeqLayout& l, const MaskParams& m, int64_t units,
                                        int64_t per_unit, bool keys, int64_t row_bytes,
                                        int64_t shared_by) {
  const bool segments = m.segments.enabled();
  const int64_t rows = keys ? (l.varlen() ? l.max_seqlen_k : l.seqlen_k)
                            : (l.varlen() ? l.max_seqlen_q : l.seqlen_q);
  const int64_t bytes = rows * row_bytes / shared_by;
  const bool unequal = l.varlen() || segments || m.band.one_sided();
  return {units, per_unit, launch_group(unequal, segments ? 0 : (bytes > 0 ? bytes : 1), units)};
}

}  // namespace jax_flash
