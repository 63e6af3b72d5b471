// Checks TileMask::pair_row_bits, the closed form that the head_dim-64 wgmma backward masks its
// 128-query pairs with, against TileMask::visible bit by bit, over random masks (bounded and
// unbounded diagonals, sequence ends before, inside and past the tile) and row patterns. Built
// and run by tests/test_mask_bits.py with the host C++ compiler; prints the number of bits checked
// and exits non-zero on the first mismatch.
#include <cstdint>
#include <cstdio>
#include <random>

#include "common/mask.h"

int main() {
  std::mt19937 rng(1234);
  const auto uniform = [&](int lo, int hi) {
    return std::uniform_int_distribution<int>(lo, hi)(rng);
  };
  constexpr int kFar = 1 << 30;  // clamp_to_int's bound: an unbounded side of the band
  int64_t checked = 0;
  for (int trial = 0; trial < 200000; ++trial) {
    jax_flash::TileMask tm{};
    tm.lo_diag = uniform(0, 9) == 0 ? -kFar : uniform(-200, 200);
    tm.hi_diag = uniform(0, 9) == 0 ? kFar : uniform(-200, 200);
    tm.n_limit = uniform(0, 9) == 0 ? kFar : uniform(0, 300);
    const int steps = 4 << uniform(0, 2);  // 4, 8 or 16 column pairs
    const int r0 = uniform(-300, 300);
    const int c = uniform(-20, 300);
    const uint32_t bits = tm.pair_row_bits(c, r0, steps);
    for (int i = 0; i < 16; ++i) {
      for (int e = 0; e < 2; ++e) {
        const bool want = i < steps && tm.visible(r0 + 8 * i + e, c);
        const bool got = ((bits >> (2 * i + e)) & 1u) != 0u;
        ++checked;
        if (want != got) {
          std::printf("mismatch: lo_diag=%d hi_diag=%d n_limit=%d c=%d r0=%d steps=%d bit %d\n",
                      tm.lo_diag, tm.hi_diag, tm.n_limit, c, r0, steps, 2 * i + e);
          return 1;
        }
      }
    }
  }
  std::printf("pair_row_bits: %lld bits agree with TileMask::visible\n",
              static_cast<long long>(checked));
  return 0;
}
