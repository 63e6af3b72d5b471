// Host check of tc::poly_exp2 (cpp/cuda/tc_primitives.cuh), the softmax's exp2 on the FMA pipes:
// its host branch forms the same bits as the device's, so no GPU is needed.
//
// Build and run (from the repository root):
//   nvcc -std=c++17 -O3 -I cpp tools/poly_exp2_check.cu -o poly_exp2_check && ./poly_exp2_check
//
// For every float x in [-126, 2^-10] it reports the maximum relative error against exp2 in
// double; below -126 (where ex2.approx.ftz flushes to 0) it requires 0 <= result < 2^-126, and
// at -127 and below, -inf included, exactly +0. Exit 1 when degree 4 exceeds 4e-6 or degree 5
// exceeds 3e-7, or any of the range conditions fails.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>

#include "cuda/tc_primitives.cuh"

namespace {

using jax_flash::cuda::tc::bits_float;
using jax_flash::cuda::tc::float_bits;
using jax_flash::cuda::tc::poly_exp2;

struct Sweep {
  double max_rel = 0.0;
  float worst_x = 0.f;
  int64_t checked = 0;
  int64_t range_bad = 0;
};

// Walks the floats of [lo, hi] in order of their bit patterns (both ends of one sign each).
template <int kDegree>
void sweep_sign(uint32_t from, uint32_t to, Sweep& s) {
  constexpr float kTiny = 1.17549435e-38f;  // 2^-126
  for (uint32_t u = from;; ++u) {
    const float x = bits_float(u);
    const float y = poly_exp2<kDegree>(x);
    ++s.checked;
    if (x >= -126.f) {
      const double ref = std::exp2(static_cast<double>(x));
      const double rel = std::fabs(static_cast<double>(y) / ref - 1.0);
      if (!(rel <= s.max_rel)) {
        s.max_rel = std::isnan(rel) ? 1e30 : rel;
        s.worst_x = x;
      }
    } else if (x <= -127.f) {
      s.range_bad += float_bits(y) != 0u;
    } else {
      s.range_bad += !(y >= 0.f && y < kTiny);
    }
    if (u == to) break;
  }
}

template <int kDegree>
bool check(double limit) {
  Sweep s;
  // Negative floats from -0 down to -130 (bit patterns rise with the magnitude), then +0 to 2^-10.
  sweep_sign<kDegree>(float_bits(-0.f), float_bits(-130.f), s);
  sweep_sign<kDegree>(float_bits(0.f), float_bits(0.0009765625f), s);
  const float inf = std::numeric_limits<float>::infinity();
  s.range_bad += float_bits(poly_exp2<kDegree>(-inf)) != 0u;
  s.range_bad += poly_exp2<kDegree>(0.f) != 1.f;
  const bool ok = s.max_rel <= limit && s.range_bad == 0;
  std::printf(
      "degree %d: %lld inputs, max relative error %.3e at x = %.9g (limit %.0e), "
      "range failures %lld, exp2(-inf) = %g: %s\n",
      kDegree, static_cast<long long>(s.checked), s.max_rel, s.worst_x, limit,
      static_cast<long long>(s.range_bad), poly_exp2<kDegree>(-inf), ok ? "ok" : "FAIL");
  return ok;
}

}  // namespace

int main() {
  const bool ok4 = check<4>(4e-6);
  const bool ok5 = check<5>(3e-7);
  return ok4 && ok5 ? 0 : 1;
}
