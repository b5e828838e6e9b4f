#pragma once
/// \file fp4_ref.hpp
/// Reference oracle for the FP4 formats (format/fp4.hpp), written from the format definitions
/// in a different style so the two cannot share a mistake:
///  - e2m1 values come from the definition (-1)^s * 2^(e - 1) * (1 + m / 2) (e > 0) or m / 2
///    (e = 0), in double; encoding searches the eight magnitudes for the nearest to |x|
///    (exact double comparisons), ties to the even code, anything above 6 to 6, NaN to +6;
///  - e8m0 and the MX shared exponent use std::frexp and std::ldexp;
///  - the block quantizers run on whole spans: per block the largest magnitude, the scale,
///    every code, every reconstruction, in double where the definition allows and with one
///    explicit float rounding where the format specifies one.
/// Tests only; not used by the library.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "kvq/reference/fp8_ref.hpp"

namespace kvq {
namespace reference {

/// Exact value of an e2m1 code (low 4 bits).
inline double e2m1_value(uint8_t c) {
  const int s = (c >> 3) & 1, e = (c >> 1) & 3, m = c & 1;
  const double mag = e == 0 ? m * 0.5 : std::ldexp(1.0 + m / 2.0, e - 1);
  return s ? -mag : mag;
}

/// Nearest e2m1 code of x, ties to the even code, saturating; NaN -> +6 (0x7); a negative value
/// that rounds to zero gives -0 (0x8).
inline uint8_t e2m1_encode(float x) {
  if (std::isnan(x)) return 0x7;
  const double a = std::fabs(static_cast<double>(x));
  const uint8_t sign = std::signbit(x) ? 0x8 : 0x0;
  if (a >= 6.0) return static_cast<uint8_t>(sign | 0x7);  // 6, and saturation above it
  // Below 6 every distance |v - a| is exact in double (a is a float), so comparisons decide.
  int best = 0;
  for (int i = 1; i < 8; ++i) {
    const double di = std::fabs(e2m1_value(static_cast<uint8_t>(i)) - a);
    const double db = std::fabs(e2m1_value(static_cast<uint8_t>(best)) - a);
    if (di < db || (di == db && (i % 2 == 0) && (best % 2 == 1))) best = i;
  }
  return static_cast<uint8_t>(sign | best);
}

/// floor(log2(x)) + 127 for finite x > 0 in the normal range, 0 for zero and subnormals,
/// 254 for +inf, 255 for NaN.
inline uint8_t e8m0_floor_ref(float x) {
  if (std::isnan(x)) return 255;
  if (std::isinf(x)) return 254;
  const double a = std::fabs(static_cast<double>(x));
  if (a < std::ldexp(1.0, -126)) return 0;
  int e = 0;
  (void)std::frexp(a, &e);  // a = f * 2^e, f in [0.5, 1)
  return static_cast<uint8_t>(e - 1 + 127);
}

inline double e8m0_value(uint8_t c) {
  return c == 255 ? std::numeric_limits<double>::quiet_NaN() : std::ldexp(1.0, c - 127);
}

/// One quantized span of an FP4 block format: codes (one per element), the scale code of
/// each block, and the reconstruction.
struct Fp4Blocks {
  std::vector<uint8_t> codes, scales;
  std::vector<float> values;
};

/// MXFP4 over x[0 .. n) in blocks of `block` (OCP: shared exponent floor(log2(amax)) - 2,
/// clamped to [-127, 127]; an all-zero block gets -127).
inline Fp4Blocks mxfp4_ref(const float* x, std::size_t n, std::size_t block) {
  Fp4Blocks r;
  r.codes.resize(n);
  r.values.resize(n);
  for (std::size_t b0 = 0; b0 < n; b0 += block) {
    const std::size_t b1 = b0 + block < n ? b0 + block : n;
    double amax = 0;
    for (std::size_t i = b0; i < b1; ++i) amax = std::fmax(amax, std::fabs(static_cast<double>(x[i])));
    int shared = -127;
    if (amax >= std::ldexp(1.0, -126)) {
      int e = 0;
      (void)std::frexp(amax, &e);
      shared = e - 1 - 2;
      if (shared < -127) shared = -127;
    }
    r.scales.push_back(static_cast<uint8_t>(shared + 127));
    const double X = std::ldexp(1.0, shared);
    for (std::size_t i = b0; i < b1; ++i) {
      // x / X is exact in double; rounding it to float first (the library's float product)
      // is exact too unless it underflows below 2^-126, where every code is 0 anyway.
      r.codes[i] = e2m1_encode(static_cast<float>(static_cast<double>(x[i]) / X));
      r.values[i] = static_cast<float>(e2m1_value(r.codes[i]) * X);
    }
  }
  return r;
}

/// NVFP4 over x[0 .. n) in blocks of `block` with tensor decode scale g: scale code
/// e4m3(fl(fl(amax / 6) / g)), element scale fl(value(scale) * g), codes e2m1(fl(x / es)),
/// values fl(value(code) * es).
inline Fp4Blocks nvfp4_ref(const float* x, std::size_t n, std::size_t block, float g) {
  Fp4Blocks r;
  r.codes.resize(n);
  r.values.resize(n);
  for (std::size_t b0 = 0; b0 < n; b0 += block) {
    const std::size_t b1 = b0 + block < n ? b0 + block : n;
    float amax = 0.f;
    for (std::size_t i = b0; i < b1; ++i) amax = std::fmax(amax, std::fabs(x[i]));
    const float sd = static_cast<float>(static_cast<double>(amax) / 6.0);
    const float sg = static_cast<float>(static_cast<double>(sd) / g);
    const uint8_t sc = fp8_encode(fp8::Fp8Kind::kE4M3, sg, true);
    r.scales.push_back(sc);
    const float es = static_cast<float>(fp8_value(fp8::Fp8Kind::kE4M3, sc) * g);
    for (std::size_t i = b0; i < b1; ++i) {
      r.codes[i] = es > 0.f ? e2m1_encode(static_cast<float>(static_cast<double>(x[i]) / es)) : 0;
      r.values[i] = static_cast<float>(e2m1_value(r.codes[i]) * es);
    }
  }
  return r;
}

}  // namespace reference
}  // namespace kvq
