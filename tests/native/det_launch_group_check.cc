// Checks launch_order's group for the deterministic backward with JAX_FLASH_DET_LAUNCH_GROUP set
// to 6, a group the library's default does not use (common/schedule.h), on the host:
// - a deterministic call whose tiles do equal work (dense, no band or a two-sided one, no segment
//   ids) walks min(G, units) units at a time;
// - every other call, deterministic or not, keeps launch_group's choice, which the same call gets
//   without the flag;
// - in the grouped order each unit's levels still come in increasing grid order, so a CTA of the
//   deterministic order waits only on lower grid positions (LaunchOrder::locate).
// Built and run by tests/test_schedule.py with the host C++ compiler; exits non-zero on the first
// failure.
#define JAX_FLASH_DET_LAUNCH_GROUP 6
#include <cstdint>
#include <cstdio>
#include <vector>

#include "common/mask.h"
#include "common/schedule.h"

namespace {

using jax_flash::Band;
using jax_flash::LaunchOrder;
using jax_flash::MaskParams;
using jax_flash::SeqLayout;

int64_t group_of(const LaunchOrder& o) { return o.by_group.divisor; }

bool levels_in_order(const LaunchOrder& o) {
  std::vector<int64_t> last(static_cast<size_t>(o.units), -1);
  for (int64_t cta = 0; cta < o.ctas(); ++cta) {
    int64_t unit = 0, level = 0;
    o.locate(cta, unit, level);
    if (level != last[static_cast<size_t>(unit)] + 1) return false;
    last[static_cast<size_t>(unit)] = level;
  }
  return true;
}

}  // namespace

int main() {
  SeqLayout l;
  l.batch = 4;
  l.seqlen_q = 4096;
  l.seqlen_k = 4096;
  l.heads_q = 16;
  int64_t checked = 0;
  for (int kind = 0; kind < 3; ++kind) {
    MaskParams m;
    if (kind == 1) m.band = Band{jax_flash::kUnbounded, 0};  // causal: unequal work
    if (kind == 2) m.band = Band{1023, 0};                   // a sliding window: equal work
    const bool equal = kind != 1;
    for (int64_t units = 1; units <= 20; ++units) {
      for (bool det : {false, true}) {
        const LaunchOrder base = jax_flash::launch_order(l, m, units, 128, false, 512, 1, 1, false);
        const LaunchOrder o = jax_flash::launch_order(l, m, units, 128, false, 512, 1, 1, det);
        const int64_t want = det && equal ? (units < 6 ? units : 6) : group_of(base);
        if (group_of(o) != want || !levels_in_order(o)) {
          std::printf("kind %d units %lld det %d: group %lld, want %lld\n", kind,
                      static_cast<long long>(units), det ? 1 : 0,
                      static_cast<long long>(group_of(o)), static_cast<long long>(want));
          return 1;
        }
        ++checked;
      }
    }
  }
  std::printf("deterministic launch group: %lld orders check out\n",
              static_cast<long long>(checked));
  return 0;
}
