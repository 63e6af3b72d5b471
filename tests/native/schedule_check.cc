// Checks the tile scheduler's launch order and the fixed-size chunk-range read, on the host:
// - LaunchOrder::locate is a bijection from grid positions onto (unit, level) pairs; within each
//   unit the levels come in increasing grid order (the deterministic backward waits only on
//   lower grid positions of the same unit, so its waits always end); the units of a group share
//   a level before any of them starts the next, and groups cover consecutive units;
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

template <int kChunks>
bool check_ranges(std::mt19937& rng) {
  using jax_flash::kSegmentChunk;
  const int positions = 37 * kSegmentChunk + 5;
  const int chunks = (positions + kSegmentChunk - 1) / kSegmentChunk;
  std::vector<int32_t> ids(static_cast<size_t>(positions));
  for (auto& x : ids) x = static_cast<int32_t>(rng() % 7) - 3;
  std::vector<int32_t> ranges(static_cast<size_t>(2 * chunks));
  for (int c = 0; c < chunks; ++c) {
    int32_t lo = ids[static_cast<size_t>(c * kSegmentChunk)], hi = lo;
    for (int p = c * kSegmentChunk; p < std::min(positions, (c + 1) * kSegmentChunk); ++p) {
      lo = std::min(lo, ids[static_cast<size_t>(p)]);
      hi = std::max(hi, ids[static_cast<size_t>(p)]);
    }
    ranges[static_cast<size_t>(2 * c)] = lo;
    ranges[static_cast<size_t>(2 * c + 1)] = hi;
  }
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
        !check_ranges<12>(rng)) {
      return 1;
    }
  }
  std::printf("schedule: %lld launch orders and the chunk ranges check out\n",
              static_cast<long long>(orders));
  return 0;
}
