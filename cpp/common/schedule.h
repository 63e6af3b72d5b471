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

}  // namespace jax_flash
