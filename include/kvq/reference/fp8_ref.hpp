#pragma once
/// \file fp8_ref.hpp
/// Reference oracle for the FP8 formats, written to be obviously right rather than fast, and
/// in a different style from kvq/format/fp8.hpp so that the two cannot share a mistake:
///  - decode evaluates the format definition, (-1)^s * 2^(e - bias) * (1 + m / 2^mant), in
///    double with std::ldexp;
///  - encode searches the sorted table of all finite fp8 magnitudes for the two neighbours of
///    |x| and picks the nearer one, ties to the even code, comparing 2|x| with lo + hi (both
///    sides exact in double, so no rounding can decide a tie).
/// Overflow follows CUDA's __nv_cvt_float_to_fp8: the table gets one virtual entry above the
/// largest finite value (the value the next code would have: 480 for e4m3, 65536 for e5m2);
/// landing on or beyond it is an overflow. Tests only; not used by the library.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kvq/format/fp8.hpp"

namespace kvq {
namespace reference {

/// Exact value of an fp8 code as a double (NaN codes -> quiet NaN, e5m2 0x7C/0xFC -> +-inf).
inline double fp8_value(fp8::Fp8Kind kind, uint8_t c) {
  const bool e4m3 = kind == fp8::Fp8Kind::kE4M3;
  const int mant_bits = e4m3 ? 3 : 2;
  const int exp_bits = 7 - mant_bits;
  const int bias = e4m3 ? 7 : 15;
  const int sign = c >> 7;
  const int e = (c >> mant_bits) & ((1 << exp_bits) - 1);
  const int m = c & ((1 << mant_bits) - 1);
  const int e_max = (1 << exp_bits) - 1;
  if (e4m3 && e == e_max && m == (1 << mant_bits) - 1) {
    return std::numeric_limits<double>::quiet_NaN();
  }
  if (!e4m3 && e == e_max) {
    if (m != 0) return std::numeric_limits<double>::quiet_NaN();
    return sign ? -std::numeric_limits<double>::infinity()
                : std::numeric_limits<double>::infinity();
  }
  const double mag =
      e == 0 ? std::ldexp(static_cast<double>(m), 1 - bias - mant_bits)
             : std::ldexp(static_cast<double>((1 << mant_bits) + m), e - bias - mant_bits);
  return sign ? -mag : mag;
}

namespace detail {
struct Fp8Entry {
  double value;
  uint8_t code;  // magnitude code; the virtual overflow entry has max code + 1
};

/// Finite non-negative magnitudes (codes 0..last_finite) in increasing order, plus the virtual
/// overflow entry.
inline std::vector<Fp8Entry> fp8_make_table(fp8::Fp8Kind kind, int last_finite, double overflow) {
  std::vector<Fp8Entry> t;
  for (int c = 0; c <= last_finite; ++c) {
    const uint8_t code = static_cast<uint8_t>(c);
    t.push_back({fp8_value(kind, code), code});
  }
  t.push_back({overflow, static_cast<uint8_t>(last_finite + 1)});
  return t;
}

inline const std::vector<Fp8Entry>& fp8_table(fp8::Fp8Kind kind) {
  static const std::vector<Fp8Entry> e4m3 = fp8_make_table(fp8::Fp8Kind::kE4M3, 0x7e, 480.0);
  static const std::vector<Fp8Entry> e5m2 = fp8_make_table(fp8::Fp8Kind::kE5M2, 0x7b, 65536.0);
  return kind == fp8::Fp8Kind::kE4M3 ? e4m3 : e5m2;
}
}  // namespace detail

/// float -> fp8 code by nearest-value search (see the file comment). saturate as in CUDA.
inline uint8_t fp8_encode(fp8::Fp8Kind kind, float x, bool saturate) {
  if (std::isnan(x)) return 0x7f;  // CUDA: every NaN -> +NaN
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const double a = std::fabs(static_cast<double>(x));
  const auto& t = detail::fp8_table(kind);
  const uint8_t max_code = kind == fp8::Fp8Kind::kE4M3 ? 0x7e : 0x7b;
  const uint8_t overflow_code = kind == fp8::Fp8Kind::kE4M3 ? 0x7f : 0x7c;
  uint8_t code;
  if (a >= t.back().value) {
    code = t.back().code;  // overflow (inf included)
  } else {
    // first entry with value > a; its predecessor is <= a (t[0] is 0)
    const auto hi = std::upper_bound(
        t.begin(), t.end(), a, [](double v, const detail::Fp8Entry& e) { return v < e.value; });
    const auto lo = hi - 1;
    const double twice = 2.0 * a;
    const double mid2 = lo->value + hi->value;
    if (twice < mid2) {
      code = lo->code;
    } else if (twice > mid2) {
      code = hi->code;
    } else {
      code = (lo->code & 1) == 0 ? lo->code : hi->code;
    }
  }
  if (code > max_code) code = saturate ? max_code : overflow_code;
  return static_cast<uint8_t>(sign | code);
}

}  // namespace reference
}  // namespace kvq
