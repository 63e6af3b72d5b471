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
  // The span's rows share their tensor rows with other spans' (a packed call's sequence, one
  // document of a dense row): a tile that runs past its end reads a neighbour's rows, which must
  // not enter a result, and may write only its own. False for a dense sequence, whose tail is
  // past the end of its row (loads read zeros, stores are clipped).
  bool packed;

  // True when the tile holds no row of its span (the spare slot of a packed span, or a slot of
  // malformed cu_seqlens): the kernel skips it.
  JF_HOST_DEVICE bool empty(int64_t size, bool keys) const {
    return block < 0 || block * size >= (keys ? span.len_k : span.len_q);
  }
};

// Set bits of x.
JF_HOST_DEVICE int popcount32(uint32_t x) {
#if defined(__CUDA_ARCH__)
  return __popc(x);
#else
  int n = 0;
  for (; x != 0u; x &= x - 1u) ++n;
  return n;
#endif
}

// The most documents a dense row can be scheduled by (SeqLayout::runs): a warp finds a slot's run
// with one ballot.
inline constexpr int64_t kMaxRunsPerRow = 32;

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
  // Documents of a dense call's rows (set by the launchers that schedule them, the wgmma ones;
  // nullptr for everything else): [batch, runs_per_row] int32, from segment ids whose runs are
  // documents. Row b's entry 0 is nonzero when the row's runs may be scheduled as sequences of
  // their own (every id forms one run, at most runs_per_row runs, the query ids equal the key ids,
  // seqlen_q == seqlen_k); then entry j >= 1 is the first position of run j (seqlen_q past the
  // row's last run). Such a row's tiles are its runs' tiles, each run a span of its own, so no
  // tile holds two documents; a row whose entry 0 is 0 keeps its dense tiles, and its kernel the
  // element-wise segment masking. Malformed positions are clamped: wrong results, no
  // out-of-bounds access.
  const int32_t* runs = nullptr;
  int64_t runs_per_row = 0;  // 1 .. kMaxRunsPerRow where runs is given

  JF_HOST_DEVICE bool varlen() const { return cu_seqlens_q != nullptr; }
  JF_HOST_DEVICE bool has_runs() const { return runs != nullptr; }
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
    if (!varlen()) return batch * row_tiles(size, keys);
    return (keys ? total_k : total_q) / size + num_seqs + 1;
  }

  // Tile slots of one row of a dense call. With runs, run j of a row owns the slots
  // [start_j / size + j, start_{j + 1} / size + j + 1) (the packed rule inside the row), which
  // hold its ceil(len / size) tiles; seqlen / size + runs_per_row slots cover every run a row may
  // have, and also the ceil(seqlen / size) dense tiles of a row whose runs are not documents (the
  // slots past them are empty).
  JF_HOST_DEVICE int64_t row_tiles(int64_t size, bool keys) const {
    const int64_t len = keys ? seqlen_k : seqlen_q;
    return has_runs() ? len / size + runs_per_row : ceil_div(len, size);
  }

  JF_HOST_DEVICE SeqTile tile(int64_t t, int64_t size, bool keys) const {
    if (!varlen()) {
      const int64_t per = row_tiles(size, keys);
      const int64_t n = per > 0 ? t / per : 0;
      if (has_runs()) return row_tile(n, t - n * per, size);
      return {span(n), t - n * per};
    }
    // Largest n in [0, num_seqs] with slot_start(n) <= t; slot_start is increasing in n.
    int64_t lo = 0, hi = num_seqs;
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (slot_start(mid, size, keys) <= t) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    return slot_tile(lo, t, size, keys);
  }

  // The span of tile slot t of a packed call, searched 32 candidate spans per round: vote(pred)
  // returns the mask of the lanes i in [0, 32) for which pred(i) holds. warp_tile votes with a
  // warp ballot, one candidate per lane, so up to 32 spans take one round of cu_seqlens loads
  // where the binary search of tile() waits for about log2(num_seqs) dependent ones; the host
  // check votes with a loop over the same code.
  template <class Vote>
  JF_HOST_DEVICE int64_t span_of_slot(int64_t t, int64_t size, bool keys, const Vote& vote) const {
    int64_t lo = 0, hi = num_seqs;  // the answer lies in [lo, hi]; slot_start(0) = 0 <= t
    while (lo < hi) {
      const int64_t step = (hi - lo + 31) / 32;
      // Candidate lo + (i + 1) step; slot_start is increasing, so the votes are a prefix of the
      // lanes and their count says how many steps the answer lies past lo.
      const uint32_t below = vote([&](int i) {
        const int64_t c = lo + (i + 1) * step;
        return c <= hi && slot_start(c, size, keys) <= t;
      });
      lo += popcount32(below) * step;
      hi = hi < lo + step - 1 ? hi : lo + step - 1;
    }
    return lo;
  }

  // Slot `slot` of dense row `row` of a call with runs (row_tiles), searched one run at a time.
  JF_HOST_DEVICE SeqTile row_tile(int64_t row, int64_t slot, int64_t size) const {
    const int32_t* r = runs + row * runs_per_row;
    if (r[0] == 0) return {span(row), slot};
    int64_t j = 0, s0 = 0;
    for (int64_t c = 1; c < runs_per_row; ++c) {
      const int64_t s = run_start(r, c);
      if (s / size + c <= slot) {
        j = c;
        s0 = s;
      }
    }
    const int64_t s1 = j + 1 < runs_per_row ? run_start(r, j + 1) : seqlen_q;
    return run_tile(row, s0, s1, slot - (s0 / size + j));
  }

  // Where a span's first row sits in the kernels' TMA maps: a dense call's maps are [batch,
  // seqlen] (a document is at its position inside its row), a packed call's one sequence of all
  // rows (its spans have batch 0).
  JF_HOST_DEVICE int64_t map_row_q(const SeqSpan& s) const {
    return s.q_start - s.batch * seqlen_q;
  }
  JF_HOST_DEVICE int64_t map_row_k(const SeqSpan& s) const {
    return s.k_start - s.batch * seqlen_k;
  }

#if defined(__CUDACC__)
  // row_tile() for a whole warp: every lane calls it, converged, with the same arguments, and gets
  // the same tile; lane c reads run c's start, and a ballot finds the run (runs_per_row <= 32).
  __device__ __forceinline__ SeqTile warp_row_tile(int64_t row, int64_t slot, int64_t size) const {
    const int32_t* r = runs + row * runs_per_row;
    const int lane = static_cast<int>(threadIdx.x % 32);
    const bool documents = r[0] != 0;
    const int64_t s = lane == 0 ? 0 : (lane < runs_per_row ? run_start(r, lane) : seqlen_q);
    if (!documents) return {span(row), slot};
    const uint32_t at = __ballot_sync(0xffffffffu, lane < runs_per_row && s / size + lane <= slot);
    const int j = 31 - __clz(static_cast<int>(at | 1u));
    const int64_t s0 = __shfl_sync(0xffffffffu, s, j);
    const int64_t next = __shfl_sync(0xffffffffu, s, (j + 1) & 31);
    return run_tile(row, s0, j + 1 < runs_per_row ? next : seqlen_q, slot - (s0 / size + j));
  }

  // tile() for a whole warp: every lane calls it, converged, with the same arguments, and gets
  // the same tile (a packed call's span found by span_of_slot with a warp ballot).
  __device__ __forceinline__ SeqTile warp_tile(int64_t t, int64_t size, bool keys) const {
    if (!varlen()) return tile(t, size, keys);
    const int lane = static_cast<int>(threadIdx.x % 32);
    const auto ballot = [lane](const auto& pred) {
      return static_cast<uint32_t>(__ballot_sync(0xffffffffu, pred(lane)));
    };
    return slot_tile(span_of_slot(t, size, keys, ballot), t, size, keys);
  }
#endif

 private:
  JF_HOST_DEVICE static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
  // cu[n] clamped to [0, total]; n == num_seqs + 1 (one past the padding span) reads as total.
  JF_HOST_DEVICE int64_t bound(const int32_t* cu, int64_t n, int64_t total) const {
    if (n > num_seqs) return total;
    return clamp64(cu[n], 0, total);
  }
  // Run c's first position in a row's runs record, clamped to the row.
  JF_HOST_DEVICE int64_t run_start(const int32_t* r, int64_t c) const {
    return clamp64(r[c], 0, seqlen_q);
  }
  // Block `block` of the run [s0, s1) of dense row `row`: a span with the row's statistics.
  JF_HOST_DEVICE SeqTile run_tile(int64_t row, int64_t s0, int64_t s1, int64_t block) const {
    const int64_t len = s1 > s0 ? s1 - s0 : 0;
    return {{row, row, row * seqlen_q + s0, row * seqlen_k + s0, len, len,
             row * heads_q * seqlen_q + s0, seqlen_q},
            block,
            true};
  }
  // The first tile slot of packed span n (see tiles()).
  JF_HOST_DEVICE int64_t slot_start(int64_t n, int64_t size, bool keys) const {
    return bound(keys ? cu_seqlens_k : cu_seqlens_q, n, keys ? total_k : total_q) / size + n;
  }
  // Tile slot t of packed span n.
  JF_HOST_DEVICE SeqTile slot_tile(int64_t n, int64_t t, int64_t size, bool keys) const {
    SeqSpan s = span(n);
    // A key tile of the padding span covers the keys past cu_seqlens_k[num_seqs]: its span needs
    // those keys and no queries.
    if (keys && n >= num_seqs) {
      s.len_k = total_k - s.k_start;
      s.len_q = 0;
    }
    return {s, t - slot_start(n, size, keys), true};
  }
};

// `l` with the documents of segment ids `s` (SegmentIds::runs), for the kernels that schedule
// rows by them; `l` as it is where there are none or they cannot apply.
JF_HOST_DEVICE SeqLayout with_runs(SeqLayout l, const SegmentIds& s) {
  if (s.runs != nullptr && !l.varlen() && l.seqlen_q == l.seqlen_k && s.runs_per_row >= 1 &&
      s.runs_per_row <= kMaxRunsPerRow) {
    l.runs = s.runs;
    l.runs_per_row = s.runs_per_row;
  }
  return l;
}

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

// The exception: the deterministic backward's group where the tiles do equal work (`dq_in_order`;
// 0: unit-major, as the default order; A/B builds move it). That backward adds each dQ tile's key
// tiles in a fixed order, each CTA waiting for the turns of the key tiles before it
// (dq_convert.cuh), and a unit-major launch starts a sequence's key tiles together: the last of
// them then reaches its first query tile's turn only after a chain of every other one's reductions,
// a lag that its single staging buffer cannot hide. Walking the levels of G units at a time (G =
// min(this, units)) starts only about SMs / G consecutive key tiles of a unit together; the rest
// start as earlier CTAs finish, behind predecessors already far ahead. A CTA still waits only for
// CTAs of lower grid index (its unit's lower levels), so the wait still always ends. Banded and
// packed calls keep their group. Measured on an H100 (docs/PERF_LOG.md): groups of 4 cut the
// deterministic order's cost on 4k unmasked calls from 8-17% to 4-5% of the backward (head_dim 64
// and 128) and from 21% to 12-13% (256); groups of 16 gained less.
#ifndef JAX_FLASH_DET_LAUNCH_GROUP
#define JAX_FLASH_DET_LAUNCH_GROUP 4
#endif

JF_HOST_DEVICE int64_t launch_group(bool unequal_tiles, int64_t unit_bytes, int64_t units,
                                    bool dq_in_order = false) {
  if (units <= 1) return 1;
  int64_t g = dq_in_order ? JAX_FLASH_DET_LAUNCH_GROUP : 1;
  if (unequal_tiles) {
    g = unit_bytes > 0 ? kLaunchGroupBytes / unit_bytes : kMaxLaunchGroup;
    g = g < kMaxLaunchGroup ? g : kMaxLaunchGroup;
  }
  g = g < units ? g : units;
  return g > 1 ? g : 1;
}

// Quotient by a divisor d the host fixes before a launch, as one multiply-high and a shift. With
// p = 31 + ceil(log2 d) and m = ceil(2^p / d) (below 2^32), m = (2^p + e) / d for some 0 <= e < d,
// so for 0 <= x < 2^31 the product x m / 2^p is x / d plus x e / (d 2^p) < 1 / d, and its floor
// is exactly floor(x / d). Kernels decode their grid position with it at every CTA start: the
// int64 divisions it replaces are software routines of about a hundred instructions each, and
// their dependent chain cost about 1 us of every CTA's start-up on an H200 (docs/PERF_LOG.md), a
// tenth of a CTA's life at 1k tokens.
struct FastDiv {
  uint32_t divisor = 1;
  uint32_t multiplier = 0;  // unused for divisor 1
  uint32_t shift = 0;

  FastDiv() = default;
  // d in [1, 2^31); anything below 1 is taken as 1.
  JF_HOST_DEVICE explicit FastDiv(int64_t d) : divisor(d > 1 ? static_cast<uint32_t>(d) : 1u) {
    if (divisor == 1) return;
    uint32_t log2 = 0;
    while ((uint64_t{1} << log2) < divisor) ++log2;
    const uint32_t p = 31 + log2;
    multiplier = static_cast<uint32_t>(((uint64_t{1} << p) + divisor - 1) / divisor);
    shift = p - 32;
  }

  // x / divisor for 0 <= x < 2^31.
  JF_HOST_DEVICE uint32_t div(uint32_t x) const {
    if (divisor == 1) return x;
#if defined(__CUDA_ARCH__)
    return __umulhi(x, multiplier) >> shift;
#else
    return static_cast<uint32_t>((uint64_t{x} * multiplier) >> 32) >> shift;
#endif
  }
};

// What one CTA works on: a head and a tile of one of the call's spans.
struct CtaWork {
  int64_t head;
  SeqTile tile;
};

struct LaunchOrder {
  int64_t units = 0;
  int64_t per_unit = 0;
  // The divisors of locate and work, fixed here once per launch: a group's grid positions
  // (group * per_unit), a whole group (by_group.divisor is the group, >= 1), the last group when
  // it is smaller, and the heads a unit index runs over (work's units are sequence-major
  // (sequence, head) pairs).
  FastDiv by_span, by_group, by_last, by_heads;

  LaunchOrder() = default;
  // Grid positions, and so units and per_unit, stay below 2^31 (a grid's limit), as FastDiv needs;
  // a group below 1 is taken as 1.
  JF_HOST_DEVICE LaunchOrder(int64_t units_, int64_t per_unit_, int64_t group, int64_t heads = 1)
      : LaunchOrder(units_, per_unit_, FastDiv(group), FastDiv(heads)) {}

  JF_HOST_DEVICE int64_t ctas() const { return units * per_unit; }

  // (unit, level) of grid position cta < ctas().
  JF_HOST_DEVICE void locate(int64_t cta, int64_t& unit, int64_t& level) const {
    const uint32_t c = static_cast<uint32_t>(cta);
    const uint32_t g = by_span.div(c);
    const uint32_t first = g * by_group.divisor;
    const uint32_t r = c - g * by_span.divisor;
    // Inside the last group, when it holds fewer units, each level has only that many CTAs.
    const FastDiv& size = first + by_group.divisor <= units ? by_group : by_last;
    const uint32_t lv = size.div(r);
    level = lv;
    unit = first + (r - lv * size.divisor);
  }

  // The head and tile of grid position cta < ctas() when the units are the (sequence, head)
  // pairs of a dense call, sequence-major, or the heads of a packed one (one unit per head, its
  // tiles the slots of every span), each unit's tiles of `size` rows over queries or keys
  // (SeqLayout::tile) taken first to last, or last to first when `reverse`. On the device every
  // lane of the calling warp must call it (a packed call's span comes from SeqLayout::warp_tile).
  JF_HOST_DEVICE CtaWork work(const SeqLayout& layout, int64_t cta, bool reverse, int64_t size,
                              bool keys) const {
    int64_t unit, level;
    locate(cta, unit, level);
    const int64_t index = reverse ? per_unit - 1 - level : level;
    const uint32_t seq = by_heads.div(static_cast<uint32_t>(unit));
    const int64_t head = unit - int64_t{seq} * by_heads.divisor;
#if defined(__CUDA_ARCH__)
    if (layout.varlen()) return {head, layout.warp_tile(index, size, keys)};
#else
    if (layout.varlen()) return {head, layout.tile(index, size, keys)};
#endif
    if (layout.has_runs()) {
#if defined(__CUDA_ARCH__)
      return {head, layout.warp_row_tile(seq, index, size)};
#else
      return {head, layout.row_tile(seq, index, size)};
#endif
    }
    return {head, {layout.span(seq), index}};
  }

 private:
  JF_HOST_DEVICE LaunchOrder(int64_t units_, int64_t per_unit_, FastDiv group, FastDiv heads)
      : units(units_),
        per_unit(per_unit_),
        by_span(int64_t{group.divisor} * per_unit_),
        by_group(group),
        by_last(units_ % group.divisor != 0 ? units_ % group.divisor : group.divisor),
        by_heads(heads) {}
};

// The launch order of `units` units of per_unit tiles each, for a call with this layout and mask,
// in its launch_group. A unit's tiles share one sequence's keys (keys = true: the forward's K and
// V) or queries (the backward's Q and dO): at most max_seqlen rows of a packed call, seqlen of a
// dense one, of row_bytes each, which shared_by adjacent units (the query heads of a GQA group)
// read too. `heads`: the heads a unit index runs over, for LaunchOrder::work. `dq_in_order`: the
// backward's deterministic order (JAX_FLASH_DET_LAUNCH_GROUP).
JF_HOST_DEVICE LaunchOrder launch_order(const SeqLayout& l, const MaskParams& m, int64_t units,
                                        int64_t per_unit, bool keys, int64_t row_bytes,
                                        int64_t shared_by, int64_t heads = 1,
                                        bool dq_in_order = false) {
  const bool segments = m.segments.enabled();
  const int64_t rows = keys ? (l.varlen() ? l.max_seqlen_k : l.seqlen_k)
                            : (l.varlen() ? l.max_seqlen_q : l.seqlen_q);
  const int64_t bytes = rows * row_bytes / shared_by;
  const bool unequal = l.varlen() || segments || m.band.one_sided();
  return {units, per_unit,
          launch_group(unequal, segments ? 0 : (bytes > 0 ? bytes : 1), units, dq_in_order), heads};
}

}  // namespace jax_flash
