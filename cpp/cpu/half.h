// Storage types of the CPU kernels and their conversions to and from the compute type. f16 and bf16
// travel as raw 16-bit patterns; every conversion rounds to nearest even and keeps inf and NaN.
// The decoders never produce or consume float subnormals, so they stay exact when the calling
// thread runs with denormals flushed (FTZ/DAZ), which XLA's thread pools may enable.
#pragma once

#include <cstdint>
#include <cstring>

namespace jax_flash::cpu {

struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Written with masks rather than branches or selects so that conversion loops vectorise.
// Subnormal halves are m * 2^-24, computed from the integer m so that no float subnormal is formed.
inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;
  // Rebiasing the exponent from 15 to 127 adds 112 << 23.
  const uint32_t normal = (em << 13) + 0x38000000u;
  const uint32_t subnormal =
      FloatBits(static_cast<float>(static_cast<int32_t>(em)) * 5.9604644775390625e-8f);
  const uint32_t inf_nan = (em << 13) | 0x7f800000u;
  const uint32_t is_subnormal = 0u - static_cast<uint32_t>(em < 0x0400u);
  const uint32_t is_inf_nan = 0u - static_cast<uint32_t>(em >= 0x7c00u);
  uint32_t mag = (normal & ~is_subnormal) | (subnormal & is_subnormal);
  mag = (mag & ~is_inf_nan) | (inf_nan & is_inf_nan);
  return BitsFloat(mag | sign);
}

inline uint16_t FloatToHalf(float f) {
  const uint32_t x = FloatBits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t a = x & 0x7fffffffu;
  if (a > 0x7f800000u) {
    // Keep the top payload bits and force the quiet bit so the result is still a NaN.
    return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x01ffu));
  }
  // 65520 is the midpoint between the largest half (65504) and 2^16; ties go to the even 2^16,
  // which is inf.
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);
  if (a >= 0x38800000u) {
    // Normal half. Rebias the exponent, then round the 13 dropped bits to nearest even; a carry
    // out of the mantissa correctly bumps the exponent.
    const uint32_t r = a - 0x38000000u;
    return static_cast<uint16_t>(sign | ((r + 0x0fffu + ((r >> 13) & 1u)) >> 13));
  }
  // Subnormal half (or zero): adding 0.5 leaves a float whose unit in the last place is 2^-24,
  // the half subnormal step, so the hardware add performs the round-to-nearest-even for us. A
  // result of 0x400 is the smallest normal half, which is also the right encoding.
  const float shifted = BitsFloat(a) + 0.5f;
  return static_cast<uint16_t>(sign | (FloatBits(shifted) - 0x3f000000u));
}

inline float BFloat16ToFloat(uint16_t b) { return BitsFloat(static_cast<uint32_t>(b) << 16); }

inline uint16_t FloatToBFloat16(float f) {
  const uint32_t x = FloatBits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x0040u);
  // Round to nearest even on the 16 dropped bits; overflow of the largest finite values into the
  // exponent gives inf, as it should.
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

// Load/Store convert one element between a storage type and the compute type T.
template <class T>
inline T Load(const float* p) {
  return static_cast<T>(*p);
}
template <class T>
inline T Load(const double* p) {
  return static_cast<T>(*p);
}
template <class T>
inline T Load(const Half* p) {
  return static_cast<T>(HalfToFloat(p->bits));
}
template <class T>
inline T Load(const BFloat16* p) {
  return static_cast<T>(BFloat16ToFloat(p->bits));
}

template <class T>
inline void Store(float* p, T v) {
  *p = static_cast<float>(v);
}
template <class T>
inline void Store(double* p, T v) {
  *p = static_cast<double>(v);
}
template <class T>
inline void Store(Half* p, T v) {
  p->bits = FloatToHalf(static_cast<float>(v));
}
template <class T>
inline void Store(BFloat16* p, T v) {
  p->bits = FloatToBFloat16(static_cast<float>(v));
}

}  // namespace jax_flash::cpu
