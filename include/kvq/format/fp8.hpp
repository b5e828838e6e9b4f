#pragma once
/// \file fp8.hpp
/// FP8 KV formats e4m3fn and e5m2, bit-exact with CUDA's conversions (cuda_fp8.h).
///
/// Scalar conversions are written once for host and device (KVQ_HOST_DEVICE), so a CUDA kernel
/// and the CPU produce the same bytes. They use integer bit arithmetic only, which makes them
/// independent of the floating-point environment (rounding mode, FTZ/DAZ).
///
/// Semantics (those of `__nv_cvt_float_to_fp8` / `__nv_cvt_fp8_to_halfraw`):
///  - round to nearest, ties to even, subnormals kept;
///  - e4m3fn: max 448, no infinity, NaN = 0x7F/0xFF; e5m2: max 57344, inf = 0x7C/0xFC;
///  - saturating mode (`__NV_SATFINITE`): finite overflow and +-inf -> +-max;
///    non-saturating (`__NV_NOSAT`): overflow and +-inf -> e4m3 NaN 0x7F|sign, e5m2 inf 0x7C|sign;
///    e4m3: 464 (= 448 + half an ulp) rounds to 448 in both modes (tie to the even mantissa);
///    e5m2: values >= 61440 overflow;
///  - every NaN input, of either sign, encodes to 0x7F in both formats (CUDA canonicalizes NaN
///    to +NaN before converting);
///  - decoding a NaN code gives the canonical float NaN 0x7FFFFFFF, sign dropped (what CUDA's
///    fp8 -> half -> float path returns on host and device).
///
/// The bulk span API (encode/decode over arrays with a scale, SIMD) lives in
/// kvq/simd/fp8_cpu.hpp, above this header in the layer order: include it where spans
/// are converted (this header includes nothing above format/).
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kvq/config.hpp"
#include "kvq/core/error.hpp"
#include "kvq/core/half.hpp"

namespace kvq {
namespace fp8 {

/// The two FP8 KV-cache formats.
enum class Fp8Kind : uint8_t {
  kE4M3,  ///< e4m3fn: 4 exponent bits (bias 7), 3 mantissa bits, max 448, no inf.
  kE5M2,  ///< e5m2: 5 exponent bits (bias 15), 2 mantissa bits, max 57344, has inf.
};

inline const char* to_string(Fp8Kind k) { return k == Fp8Kind::kE4M3 ? "e4m3" : "e5m2"; }

/// Largest finite magnitude of the format (448 or 57344).
KVQ_HOST_DEVICE constexpr float max_finite(Fp8Kind k) {
  return k == Fp8Kind::kE4M3 ? 448.f : 57344.f;
}

}  // namespace fp8

namespace detail {

/// Compile-time description of an FP8 format, shared by the scalar and SIMD encoders.
/// kMant mantissa bits, kBias exponent bias, kMaxCode the largest finite magnitude code,
/// kOverflowCode what a non-saturating overflow produces (e4m3: NaN 0x7F, e5m2: inf 0x7C).
template <int kMant, int kBias, uint32_t kMaxCode, uint32_t kOverflowCode>
struct Fp8Format {
  static constexpr int kMantBits = kMant;
  static constexpr int kExpBias = kBias;
  static constexpr uint32_t kMaxFiniteCode = kMaxCode;
  static constexpr uint32_t kNoSatOverflowCode = kOverflowCode;
  /// e5m2 keeps IEEE infinities (all-ones exponent, zero mantissa); e4m3fn has none.
  static constexpr bool kHasInf = kOverflowCode != 0x7Fu;
  /// float mantissa bits dropped for a normal result.
  static constexpr int kShift = 23 - kMant;
  /// float bits of the smallest normal fp8 value, 2^(1 - bias).
  static constexpr uint32_t kMinNormalBits = static_cast<uint32_t>(128 - kBias) << 23;
  /// Added to |x|'s bits (plus the kept lsb) before >> kShift: the round-to-nearest-even bias
  /// (half an fp8 ulp minus one) and the exponent rebias 127 -> kBias, folded in one constant.
  /// Unsigned wrap-around is intended; normal inputs never wrap.
  static constexpr uint32_t kRoundRebias =
      ((uint32_t{1} << (kShift - 1)) - 1u) - (static_cast<uint32_t>(127 - kBias) << 23);
  /// Subnormal inputs: |x| / 2^(1 - bias - mant) = m24 >> (kSubShiftBase - exponent field).
  static constexpr uint32_t kSubShiftBase = static_cast<uint32_t>(151 - kBias - kMant);
  /// 2^(23 + 1 - bias - mant): adding it to |x| < min normal rounds |x| to a whole number of
  /// fp8 subnormal steps, which then sit in the low bits of the sum (used by the SIMD paths).
  static constexpr uint32_t kSubMagicBits = static_cast<uint32_t>(151 - kBias - kMant) << 23;
};

using E4M3Format = Fp8Format<3, 7, 0x7Eu, 0x7Fu>;
using E5M2Format = Fp8Format<2, 15, 0x7Bu, 0x7Cu>;

/// float -> fp8 code, round to nearest even, in integer arithmetic.
template <class F>
KVQ_HOST_DEVICE uint8_t fp8_encode_bits(float x, bool saturate) {
  const uint32_t u = f32_bits(x);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t ax = u & 0x7fffffffu;
  if (ax > 0x7f800000u) return 0x7Fu;  // any NaN -> +NaN, as CUDA
  uint32_t code;
  if (ax >= F::kMinNormalBits) {
    // Normal result: keep kMant mantissa bits, round the rest to nearest even, rebias.
    // +inf lands far above kMaxFiniteCode, so it takes the overflow branch below.
    const uint32_t lsb = (ax >> F::kShift) & 1u;
    code = (ax + F::kRoundRebias + lsb) >> F::kShift;
    if (code > F::kMaxFiniteCode) {
      return static_cast<uint8_t>(sign | (saturate ? F::kMaxFiniteCode : F::kNoSatOverflowCode));
    }
  } else {
    // Subnormal (or zero) result: count of 2^(1-bias-mant) steps, rounded to nearest even.
    // A count of 2^kMant is the smallest normal code, so rounding up across the boundary works.
    const uint32_t e = ax >> 23;
    const uint32_t s = F::kSubShiftBase - e;  // >= kShift + 1 here
    if (s > 24u) {
      code = 0;  // below half the smallest subnormal (ties included): +-0
    } else {
      const uint32_t m24 = (ax & 0x7fffffu) | 0x800000u;
      code = (m24 + ((1u << (s - 1u)) - 1u) + ((m24 >> s) & 1u)) >> s;
    }
  }
  return static_cast<uint8_t>(sign | code);
}

/// fp8 code -> float (exact; NaN codes give the canonical NaN 0x7FFFFFFF).
template <class F>
KVQ_HOST_DEVICE float fp8_decode_bits(uint8_t c, bool is_nan) {
  if (is_nan) return bits_f32(0x7fffffffu);
  const uint32_t sign = static_cast<uint32_t>(c & 0x80u) << 24;
  const uint32_t mag = c & 0x7fu;
  const uint32_t e = mag >> F::kMantBits;
  const uint32_t m = mag & ((1u << F::kMantBits) - 1u);
  if (e == 0) {
    // Subnormal: m steps of 2^(1-bias-mant); the product is exact (m has <= 3 bits).
    const float step = bits_f32(static_cast<uint32_t>(128 - F::kExpBias - F::kMantBits) << 23);
    return bits_f32(sign | f32_bits(static_cast<float>(m) * step));
  }
  if (F::kHasInf && e == (1u << (7 - F::kMantBits)) - 1u) {
    return bits_f32(sign | 0x7f800000u);  // e5m2 all-ones exponent, m == 0: infinity
  }
  return bits_f32(sign | ((e + 127u - F::kExpBias) << 23) | (m << (23 - F::kMantBits)));
}

}  // namespace detail

namespace fp8 {

/// float -> e4m3fn code, round to nearest even. saturate=true is CUDA's __NV_SATFINITE
/// (overflow and +-inf -> +-448), false is __NV_NOSAT (overflow and +-inf -> NaN 0x7F|sign).
KVQ_HOST_DEVICE uint8_t encode_e4m3(float x, bool saturate = true) {
  return detail::fp8_encode_bits<detail::E4M3Format>(x, saturate);
}

/// e4m3fn code -> float (exact). 0x7F and 0xFF are NaN (returned as 0x7FFFFFFF).
KVQ_HOST_DEVICE float decode_e4m3(uint8_t c) {
  return detail::fp8_decode_bits<detail::E4M3Format>(c, (c & 0x7fu) == 0x7fu);
}

/// float -> e5m2 code, round to nearest even. saturate=true is CUDA's __NV_SATFINITE
/// (overflow and +-inf -> +-57344), false is __NV_NOSAT (|x| >= 61440 and +-inf -> inf).
KVQ_HOST_DEVICE uint8_t encode_e5m2(float x, bool saturate = true) {
  return detail::fp8_encode_bits<detail::E5M2Format>(x, saturate);
}

/// e5m2 code -> float (exact). 0x7C/0xFC are +-inf; 0x7D..0x7F and 0xFD..0xFF are NaN
/// (returned as 0x7FFFFFFF).
KVQ_HOST_DEVICE float decode_e5m2(uint8_t c) {
  return detail::fp8_decode_bits<detail::E5M2Format>(c, (c & 0x7fu) > 0x7cu);
}

/// encode_e4m3 or encode_e5m2 chosen at run time.
KVQ_HOST_DEVICE uint8_t encode(Fp8Kind k, float x, bool saturate = true) {
  return k == Fp8Kind::kE4M3 ? encode_e4m3(x, saturate) : encode_e5m2(x, saturate);
}

/// decode_e4m3 or decode_e5m2 chosen at run time.
KVQ_HOST_DEVICE float decode(Fp8Kind k, uint8_t c) {
  return k == Fp8Kind::kE4M3 ? decode_e4m3(c) : decode_e5m2(c);
}

/// Per-tensor (or per-head) scale so that amax maps onto the format's largest finite value:
/// store encode(x / scale), read decode(c) * scale.
///
/// scale = amax * margin / max_finite(kind), computed in double and rounded once to float.
/// margin > 1 leaves headroom for values larger than the calibrated amax; margin < 1 clips
/// the largest values (saturating encode) in exchange for resolution.
///
/// Rules, so that the result and 1/scale are always finite and positive:
///  - amax == 0 (an all-zero tensor): scale 1.0; every code is +-0 and decodes to exactly 0.
///  - amax NaN or +-inf: throws kvq::Error(kNonFinite) naming the value (a scale computed from
///    it would turn every code into 0 or NaN).
///  - amax < 0, or margin not finite or <= 0: throws kvq::Error(kInvalidArgument).
///  - a scale below FLT_MIN (tiny amax) is raised to FLT_MIN, so 1/scale does not overflow
///    (such a tensor's values then encode to +-0 or tiny codes); above FLT_MAX it is lowered
///    to FLT_MAX.
inline float compute_scale(Fp8Kind kind, float amax, float margin = 1.f) {
  const uint32_t abits = kvq::detail::f32_bits(amax) & 0x7fffffffu;
  if (abits >= 0x7f800000u) {
    fail(ErrorKind::kNonFinite, "fp8 ", to_string(kind), " compute_scale: amax is ", amax,
         " (must be finite)");
  }
  if (amax < 0.f) {
    fail(ErrorKind::kInvalidArgument, "fp8 ", to_string(kind),
         " compute_scale: amax must be >= 0, got ", amax);
  }
  const uint32_t mbits = kvq::detail::f32_bits(margin) & 0x7fffffffu;
  if (mbits >= 0x7f800000u || !(margin > 0.f)) {
    fail(ErrorKind::kInvalidArgument, "fp8 ", to_string(kind),
         " compute_scale: margin must be finite and > 0, got ", margin);
  }
  if (amax == 0.f) return 1.f;
  const double s = static_cast<double>(amax) * static_cast<double>(margin) /
                   static_cast<double>(max_finite(kind));
  constexpr double kMinNormal = 1.1754943508222875e-38;  // FLT_MIN
  constexpr double kMaxFloat = 3.4028234663852886e+38;   // FLT_MAX
  if (s < kMinNormal) return static_cast<float>(kMinNormal);
  if (s > kMaxFloat) return static_cast<float>(kMaxFloat);
  return static_cast<float>(s);
}

}  // namespace fp8
}  // namespace kvq

