// Checks the tile scheduler's launch order and the fixed-size chunk-range read, on the host:
// - LaunchOrder::locate is a bijection from grid positions onto (unit, level) pairs; within each
//   unit the levels come in increasing grid order (the deterministic backward waits only on
//   lower grid positions of the same unit, so its waits always end); the units of a group share
//   a level before any of them starts the next, and groups cover consecutive units;
// - FastDiv gives the exact quotient for divisors in [1, 2^31) and dividends in [0, 2^31);
// - LaunchOrder::work gives the head and tile the int64 arithmetic gives, dense and packed;
// - SeqLayout::span_of_slot (the GPU kernels' 32-lane span search), voting by a loop over the
//   lanes, finds the span tile()'s binary search finds, for up to 3000 sequences (three rounds);
// - SeqLayout's documents of dense rows (runs): every position in exactly one tile, each tile
//   inside one run;
// - launch_group stays within [1, min(kMaxLaunchGroup, units)] and is 1 for equal-work tiles;
// - id_range_fixed equals id_range for every range it is given (chunk-aligned starts, ends
//   anywhere up to kChunks chunks later, empty ranges included).
// Built and run by tests/test_schedule.py with the host C++ compiler; exits non-zero on the first
// failure.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "common/mask.h"
#include "common/schedule.h"

namespace {

bool check_order(int64_t units, int64_t per_unit, int64_t group) {
  const jax_flash::LaunchOrder order{units, per_unit, group};
  std::vector<int> seen(static_cast<size_t>(units * per_unit), 0);
  std::vector<int64_t> next_level(static_cast<size_t>(units), 0);
  for (int64_t cta = 0; cta < order.ctas(); ++cta) {
    int64_t unit = -1, level = -1;
    order.locate(cta, unit, level);
    if (unit < 0 || unit >= units || level < 0 || level >= per_unit) {
      std::printf("out of range: units=%lld per=%lld group=%lld cta=%lld -> (%lld, %lld)\n",
                  static_cast<long long>(units), static_cast<long long>(per_unit),
                  static_cast<long long>(group), static_cast<long long>(cta),
                  static_cast<long long>(unit), static_cast<long long>(level));
      return false;
    }
    if (level != next_level[unit]) {
      std::printf("unit %lld takes level %lld before %lld (units=%lld per=%lld group=%lld)\n",
                  static_cast<long long>(unit), static_cast<long long>(level),
                  static_cast<long long>(next_level[unit]), static_cast<long long>(units),
                  static_cast<long long>(per_unit), static_cast<long long>(group));
      return false;
    }
    ++next_level[unit];
    ++seen[static_cast<size_t>(unit * per_unit + level)];
    // Every unit of this CTA's group must already have taken the previous level.
    const int64_t first = unit / group * group;
    for (int64_t u = first; u < std::min(first + group, units) && level > 0; ++u) {
      if (next_level[u] < level) {
        std::printf("unit %lld at level %lld while unit %lld of its group is below it\n",
                    static_cast<long long>(unit), static_cast<long long>(level),
                    static_cast<long long>(u));
        return false;
      }
    }
  }
  for (int v : seen) {
    if (v != 1) {
      std::printf("not a bijection: units=%lld per=%lld group=%lld\n",
                  static_cast<long long>(units), static_cast<long long>(per_unit),
                  static_cast<long long>(group));
      return false;
    }
  }
  return true;
}

bool check_fast_div() {
  constexpr int64_t kTop = (int64_t{1} << 31) - 1;
  std::mt19937_64 rng(7);
  std::vector<int64_t> divisors;
  for (int64_t d = 1; d <= 4096; ++d) divisors.push_back(d);
  for (int k = 12; k <= 31; ++k) {
    divisors.push_back((int64_t{1} << k) - 1);
    if (k < 31) divisors.push_back(int64_t{1} << k);
    if (k < 31) divisors.push_back((int64_t{1} << k) + 1);
  }
  for (int i = 0; i < 2000; ++i) divisors.push_back(1 + static_cast<int64_t>(rng() % kTop));
  for (const int64_t d : divisors) {
    const jax_flash::FastDiv f(d);
    std::vector<int64_t> xs = {d - 1, d,        d + 1,        2 * d - 1,       2 * d,
                               kTop,  kTop - 1, kTop / d * d, kTop / d * d - 1};
    for (int64_t x = 0; x < 300; ++x) xs.push_back(x);
    for (int i = 0; i < 200; ++i) xs.push_back(static_cast<int64_t>(rng() % (kTop + 1)));
    for (const int64_t x : xs) {
      if (x < 0 || x > kTop) continue;
      const int64_t q = f.div(static_cast<uint32_t>(x));
      if (q != x / d) {
        std::printf("FastDiv(%lld).div(%lld) = %lld, not %lld\n", static_cast<long long>(d),
                    static_cast<long long>(x), static_cast<long long>(q),
                    static_cast<long long>(x / d));
        return false;
      }
    }
  }
  return true;
}

bool same_work(const jax_flash::CtaWork& a, int64_t head, const jax_flash::SeqTile& b) {
  const jax_flash::SeqSpan& x = a.tile.span;
  const jax_flash::SeqSpan& y = b.span;
  return a.head == head && a.tile.block == b.block && x.seq == y.seq && x.batch == y.batch &&
         x.q_start == y.q_start && x.k_start == y.k_start && x.len_q == y.len_q &&
         x.len_k == y.len_k && x.stat_start == y.stat_start && x.stat_head == y.stat_head;
}

// work() against the int64 decode every kernel used before it: dense units are (sequence, head)
// pairs, sequence-major; packed units are heads over every span's tile slots.
bool check_work() {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 300; ++trial) {
    jax_flash::SeqLayout l;
    const int64_t heads = 1 + rng() % 9;
    const int64_t size = (trial % 3 == 0) ? 64 : (trial % 3 == 1 ? 128 : 192);
    const bool keys = trial % 2 == 1;
    std::vector<int32_t> cu;
    if (trial % 4 == 3) {
      const int64_t n = 1 + rng() % 12;
      cu.push_back(0);
      for (int64_t i = 0; i < n; ++i) cu.push_back(cu.back() + static_cast<int32_t>(rng() % 700));
      l.cu_seqlens_q = cu.data();
      l.cu_seqlens_k = cu.data();
      l.num_seqs = n;
      l.total_q = l.total_k = cu.back() + static_cast<int64_t>(rng() % 100);
    } else {
      l.batch = 1 + rng() % 7;
      l.seqlen_q = 1 + rng() % 2000;
      l.seqlen_k = 1 + rng() % 2000;
    }
    l.heads_q = heads;
    const int64_t units = l.varlen() ? heads : l.batch * heads;
    const int64_t per = l.varlen() ? l.tiles(size, keys)
                                   : (keys ? l.seqlen_k + size - 1 : l.seqlen_q + size - 1) / size;
    const int64_t group = 1 + rng() % 17;
    const bool reverse = rng() % 2 == 1;
    const jax_flash::LaunchOrder order(units, per, group, heads);
    for (int64_t cta = 0; cta < order.ctas(); ++cta) {
      int64_t unit, level;
      order.locate(cta, unit, level);
      const int64_t idx = reverse ? per - 1 - level : level;
      const int64_t head = unit % heads;
      const int64_t slot = l.varlen() ? idx : (unit / heads) * per + idx;
      if (!same_work(order.work(l, cta, reverse, size, keys), head, l.tile(slot, size, keys))) {
        std::printf("work(%lld) differs: trial %d units=%lld per=%lld group=%lld heads=%lld\n",
                    static_cast<long long>(cta), trial, static_cast<long long>(units),
                    static_cast<long long>(per), static_cast<long long>(group),
                    static_cast<long long>(heads));
        return false;
      }
    }
  }
  return true;
}

bool check_span_search() {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t n = trial < 100 ? trial : 1 + rng() % 3000;
    std::vector<int32_t> cu(1, 0);
    for (int64_t i = 0; i < n; ++i) {
      // Mostly short sequences, some empty, a few long ones.
      const uint32_t r = rng() % 10;
      cu.push_back(cu.back() +
                   static_cast<int32_t>(r == 0 ? 0 : (r < 8 ? rng() % 200 : rng() % 3000)));
    }
    jax_flash::SeqLayout l;
    l.cu_seqlens_q = cu.data();
    l.cu_seqlens_k = cu.data();
    l.num_seqs = n;
    l.total_q = l.total_k = cu.back() + static_cast<int64_t>(rng() % 300);
    const int64_t size = trial % 2 == 0 ? 128 : 192;
    const bool keys = trial % 3 == 0;
    const auto vote = [](const auto& pred) {
      uint32_t mask = 0;
      for (int i = 0; i < 32; ++i) mask |= pred(i) ? uint32_t{1} << i : 0u;
      return mask;
    };
    for (int64_t t = 0; t < l.tiles(size, keys); ++t) {
      const int64_t span = l.span_of_slot(t, size, keys, vote);
      const int64_t expected = l.tile(t, size, keys).span.seq;
      if (span != expected) {
        std::printf("span_of_slot(%lld) = %lld, tile() says %lld (num_seqs %lld, size %lld)\n",
                    static_cast<long long>(t), static_cast<long long>(span),
                    static_cast<long long>(expected), static_cast<long long>(n),
                    static_cast<long long>(size));
        return false;
      }
    }
  }
  return true;
}

// build_segment_records against the definition: each chunk's own (min, max) and its reach, every
// id at or before the chunk (keys) or at or after it (queries), by brute force over positions.
bool check_records(std::mt19937& rng) {
  using jax_flash::kSegmentChunk;
  using jax_flash::kSegmentRecord;
  for (int positions : {1, 15, 16, 17, 200, 37 * kSegmentChunk + 5}) {
    const int batch = 3;
    const int chunks = static_cast<int>(jax_flash::segment_chunks(positions));
    std::vector<int32_t> ids(static_cast<size_t>(batch * positions));
    for (auto& x : ids) x = static_cast<int32_t>(rng() % 9) - 4;
    for (bool suffix : {false, true}) {
      std::vector<int32_t> rec(static_cast<size_t>(batch * chunks * kSegmentRecord));
      jax_flash::build_segment_records(ids.data(), batch, positions, suffix, rec.data());
      for (int b = 0; b < batch; ++b) {
        const int32_t* row = jax_flash::segment_row(rec.data(), b, positions);
        for (int c = 0; c < chunks; ++c) {
          int32_t lo = INT32_MAX, hi = INT32_MIN, rlo = INT32_MAX, rhi = INT32_MIN;
          for (int p = 0; p < positions; ++p) {
            const int32_t id = ids[static_cast<size_t>(b * positions + p)];
            if (p / kSegmentChunk == c) lo = std::min(lo, id), hi = std::max(hi, id);
            if (suffix ? p / kSegmentChunk >= c : p / kSegmentChunk <= c) {
              rlo = std::min(rlo, id);
              rhi = std::max(rhi, id);
            }
          }
          const jax_flash::IdRange reach = jax_flash::id_reach(row, c);
          if (row[kSegmentRecord * c] != lo || row[kSegmentRecord * c + 1] != hi ||
              reach.lo != rlo || reach.hi != rhi) {
            std::printf(
                "segment record %d of row %d (%d positions, %s): (%d, %d | %d, %d), "
                "expected (%d, %d | %d, %d)\n",
                c, b, positions, suffix ? "suffix" : "prefix", row[kSegmentRecord * c],
                row[kSegmentRecord * c + 1], reach.lo, reach.hi, lo, hi, rlo, rhi);
            return false;
          }
        }
      }
    }
  }
  return true;
}

template <int kChunks>
bool check_ranges(std::mt19937& rng) {
  using jax_flash::kSegmentChunk;
  const int positions = 37 * kSegmentChunk + 5;
  const int chunks = (positions + kSegmentChunk - 1) / kSegmentChunk;
  std::vector<int32_t> ids(static_cast<size_t>(positions));
  for (auto& x : ids) x = static_cast<int32_t>(rng() % 7) - 3;
  std::vector<int32_t> ranges(static_cast<size_t>(jax_flash::kSegmentRecord * chunks));
  jax_flash::build_segment_records(ids.data(), 1, positions, false, ranges.data());
  for (int start = 0; start < chunks; ++start) {
    const int64_t p0 = int64_t{start} * kSegmentChunk;
    for (int64_t p1 = p0; p1 <= std::min<int64_t>(p0 + kChunks * kSegmentChunk, positions); ++p1) {
      const jax_flash::IdRange a = jax_flash::id_range(ranges.data(), p0, p1);
      const jax_flash::IdRange b = jax_flash::id_range_fixed<kChunks>(ranges.data(), p0, p1);
      if (a.lo != b.lo || a.hi != b.hi) {
        std::printf("id_range_fixed<%d>(%lld, %lld) = (%d, %d), id_range = (%d, %d)\n", kChunks,
                    static_cast<long long>(p0), static_cast<long long>(p1), b.lo, b.hi, a.lo, a.hi);
        return false;
      }
    }
  }
  return true;
}

// The documents of a dense row (SeqLayout::runs): for random rows of runs, some of them marked as
// not documents, SeqLayout::tile over all tiles(size, keys) slots covers every position of every
// row exactly once; a documents row's tiles each lie inside one run, whose span has the run's
// rows, the row's statistics and `packed` set; any other row's tiles are its dense tiles.
bool check_runs(std::mt19937& rng) {
  for (int trial = 0; trial < 300; ++trial) {
    const int64_t batch = 1 + static_cast<int64_t>(rng() % 3);
    const int64_t seqlen = 1 + static_cast<int64_t>(rng() % 700);
    const int64_t per_row = 1 + static_cast<int64_t>(rng() % jax_flash::kMaxRunsPerRow);
    const int64_t size = int64_t{16} << (rng() % 4);
    std::vector<int32_t> runs(static_cast<size_t>(batch * per_row));
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t count = 1 + static_cast<int64_t>(rng() % per_row);
      std::vector<int32_t> cuts;
      for (int64_t j = 1; j < count; ++j) cuts.push_back(static_cast<int32_t>(rng() % seqlen));
      std::sort(cuts.begin(), cuts.end());
      runs[b * per_row] = rng() % 4 != 0 ? 1 : 0;
      for (int64_t j = 1; j < per_row; ++j) {
        runs[b * per_row + j] =
            j < count ? cuts[static_cast<size_t>(j - 1)] : static_cast<int32_t>(seqlen);
      }
    }
    jax_flash::SeqLayout l;
    l.batch = batch;
    l.seqlen_q = l.seqlen_k = seqlen;
    l.heads_q = 3;
    l.runs = runs.data();
    l.runs_per_row = per_row;
    std::vector<int> covered(static_cast<size_t>(batch * seqlen), 0);
    for (int64_t t = 0; t < l.tiles(size, false); ++t) {
      const jax_flash::SeqTile tile = l.tile(t, size, false);
      const jax_flash::SeqSpan& s = tile.span;
      const int64_t b = s.batch;
      if (tile.empty(size, false)) continue;
      const bool documents = runs[b * per_row] != 0;
      const int64_t start = s.q_start - b * seqlen;
      if (tile.packed != documents || s.k_start != s.q_start || s.len_k != s.len_q ||
          s.stat_start != b * 3 * seqlen + start || s.stat_head != seqlen ||
          (!documents && (start != 0 || s.len_q != seqlen))) {
        std::printf("runs: wrong span for slot %lld\n", static_cast<long long>(t));
        return false;
      }
      if (documents) {
        // The span must be one whole run of the row.
        bool run = start == 0;
        for (int64_t j = 1; j < per_row; ++j) run = run || runs[b * per_row + j] == start;
        const int64_t end = start + s.len_q;
        bool ends = end == seqlen;
        for (int64_t j = 1; j < per_row; ++j) ends = ends || runs[b * per_row + j] == end;
        for (int64_t j = 1; j < per_row; ++j) {
          const int64_t c = runs[b * per_row + j];
          if (c > start && c < end) run = false;
        }
        if (!run || !ends) {
          std::printf("runs: slot %lld is not one run\n", static_cast<long long>(t));
          return false;
        }
      }
      const int64_t r0 = start + tile.block * size;
      const int64_t r1 = std::min(start + s.len_q, r0 + size);
      for (int64_t r = r0; r < r1; ++r) ++covered[static_cast<size_t>(b * seqlen + r)];
    }
    for (int c : covered) {
      if (c != 1) {
        std::printf("runs: a position covered %d times (batch %lld, seqlen %lld, %lld runs)\n", c,
                    static_cast<long long>(batch), static_cast<long long>(seqlen),
                    static_cast<long long>(per_row));
        return false;
      }
    }
  }
  return true;
}

}  // namespace

int main() {
  int64_t orders = 0;
  for (int64_t units = 1; units <= 37; ++units) {
    for (int64_t per = 1; per <= 11; ++per) {
      for (int64_t group = 1; group <= units + 2; ++group) {
        if (!check_order(units, per, group)) return 1;
        ++orders;
      }
    }
  }
  if (!check_fast_div() || !check_work() || !check_span_search()) return 1;
  std::mt19937 runs_rng(5);
  if (!check_runs(runs_rng)) return 1;
  for (int64_t units = 1; units <= 64; ++units) {
    for (int64_t bytes :
         {int64_t{0}, int64_t{1}, int64_t{1} << 20, int64_t{8} << 20, int64_t{64} << 20}) {
      for (bool unequal : {false, true}) {
        const int64_t g = jax_flash::launch_group(unequal, bytes, units);
        const int64_t most = std::min(jax_flash::kMaxLaunchGroup, units);
        if (g < 1 || g > most || (!unequal && g != 1)) {
          std::printf("launch_group(%d, %lld, %lld) = %lld\n", unequal ? 1 : 0,
                      static_cast<long long>(bytes), static_cast<long long>(units),
                      static_cast<long long>(g));
          return 1;
        }
      }
    }
  }
  std::mt19937 rng(99);
  for (int trial = 0; trial < 20; ++trial) {
    if (!check_ranges<1>(rng) || !check_ranges<4>(rng) || !check_ranges<8>(rng) ||
        !check_ranges<12>(rng) || !check_records(rng)) {
      return 1;
    }
  }
  std::printf(
      "schedule: %lld launch orders, FastDiv, work, the span search, the rows' documents, the "
      "chunk ranges and their reaches check out\n",
      static_cast<long long>(orders));
  return 0;
}
