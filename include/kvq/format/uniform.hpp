#pragma once
/// \file uniform.hpp
/// Uniform integer format: the per-group parameters and the per-element code formula.
///
/// Asymmetric b-bit (q4_1 style): zero z = min (stored), scale s = (max - z) / (2^b - 1)
///   (stored), code = RNE(clamp((x - z) / s, 0, 2^b - 1)), x' = fma(code, s, z).
/// Symmetric b-bit (q4_0 style): m = the value of largest magnitude (ties: the positive one),
///   s = m / -2^(b-1) (stored, may be negative), so that m maps exactly to code 0 and all 2^b
///   levels are usable; code = RNE(clamp(x / s + 2^(b-1), 0, 2^b - 1)),
///   x' = fma(code - 2^(b-1), s, 0).
/// Both are one formula with an offset: code = RNE(clamp(fma(x - z, inv, off), 0, qmax)),
/// x' = fma(code - off, s, z), where inv = 1/s (0 when s == 0) and z = 0 when symmetric.
/// Division is replaced by the stored reciprocal so every path computes identical bits.
///
/// Zero-range groups (all values equal): s = 0, inv = 0, every code = off, and the group
/// reconstructs to z (asymmetric: the common value rounded to the metadata type; symmetric:
/// when the common value is c != 0, s = -c/2^(b-1) and the reconstruction is c, exactly when
/// representable; all zeros reconstruct to 0).
#include <cmath>
#include <cstdint>

#include "kvq/config.hpp"
#include "kvq/core/error.hpp"
#include "kvq/format/meta.hpp"

namespace kvq {

/// Resolved parameters of one group.
struct UniformParams {
  float scale = 0.f;  ///< stored scale s
  float zero = 0.f;   ///< stored zero point z (0 for symmetric)
  float inv = 0.f;    ///< 1/s, or 0 when s == 0
};

/// Code offset and largest code for a uniform format.
struct UniformLevels {
  float off;
  float qmax;
};
inline void check_uniform_bits(int bits) {
  KVQ_REQUIRE(bits == 2 || bits == 3 || bits == 4 || bits == 8, kInvalidArgument,
              "integer formats support 2, 3, 4 or 8 bits, got ", bits);
}
/// Validates `bits` before shifting by it (a shift by >= 32 or a negative width is UB).
inline UniformLevels uniform_levels(int bits, bool symmetric) {
  check_uniform_bits(bits);
  const float qmax = static_cast<float>((1 << bits) - 1);
  return {symmetric ? static_cast<float>(1 << (bits - 1)) : 0.f, qmax};
}

namespace detail {

enum class UniformParamsResult : uint8_t { kOk, kZeroOverflow, kScaleOverflow };

/// The one definition of the int group parameters, host and device: the parameters of a group
/// whose finite values span [lo, hi] (bits 2, 3, 4 or 8, validated by the caller). `round`
/// rounds a value to what a metadata slot stores (fp16 or f32). Used by uniform_params (host,
/// throwing) and format/element.hpp's int_params (host and device, status codes).
#if defined(__CUDACC__)
#pragma nv_exec_check_disable  // host callers pass a host-only `round`
#endif
template <class Round>
KVQ_HOST_DEVICE UniformParamsResult uniform_params_of(float lo, float hi, int bits, bool symmetric,
                                                      const Round& round, UniformParams* p) {
  const auto finite = [](float x) { return (f32_bits(x) & 0x7f800000u) != 0x7f800000u; };
  const float levels = static_cast<float>((1 << bits) - 1);
  if (symmetric) {
    const float m = (hi >= -lo) ? hi : lo;  // signed value of largest magnitude
    p->scale = round(m / -static_cast<float>(1 << (bits - 1))) + 0.0f;  // no -0
    p->zero = 0.f;
  } else {
    p->zero = round(lo + 0.0f);  // + 0.0f turns -0 into +0 (canonical bits)
    if (!finite(p->zero)) return UniformParamsResult::kZeroOverflow;
    float s = (hi - p->zero) / levels;
    if (!(s > 0.f)) s = 0.f;
    p->scale = round(s);
  }
  if (!finite(p->scale)) return UniformParamsResult::kScaleOverflow;
  p->inv = (p->scale != 0.f) ? 1.0f / p->scale : 0.f;
  if (!finite(p->inv)) p->inv = 0.f;  // subnormal scale: treat as zero-range group
  return UniformParamsResult::kOk;
}

/// format/meta.hpp's round_meta as a functor (host).
struct RoundMetaHost {
  MetaDType meta;
  float operator()(float v) const { return round_meta(meta, v); }
};

}  // namespace detail

/// Parameters of a group whose finite values span [lo, hi]. `group` is used in messages.
/// Throws kOutOfRange when a parameter does not fit the metadata type (e.g. |x| > 65504 with
/// fp16 metadata): choose fp32 metadata for such tensors.
inline UniformParams uniform_params(float lo, float hi, int bits, bool symmetric, MetaDType meta,
                                    int64_t group) {
  check_uniform_bits(bits);
  UniformParams p;
  const auto r =
      detail::uniform_params_of(lo, hi, bits, symmetric, detail::RoundMetaHost{meta}, &p);
  KVQ_REQUIRE(r != detail::UniformParamsResult::kZeroOverflow, kOutOfRange, "zero point of group ",
              group, " (min ", lo, ") overflows ", to_string(meta), " metadata; use f32 metadata");
  KVQ_REQUIRE(r != detail::UniformParamsResult::kScaleOverflow, kOutOfRange, "scale of group ",
              group, " (range [", lo, ", ", hi, "]) overflows ", to_string(meta),
              " metadata; use f32 metadata");
  return p;
}

/// Scalar code formula (host and device): RNE(clamp(fma(x - z, inv, off), 0, qmax)). The fused
/// multiply-add is explicit so that no compiler contraction setting can change the bits.
KVQ_HOST_DEVICE uint8_t uniform_encode(float x, float zero, float inv, float off, float qmax) {
  float v = std::fma(x - zero, inv, off);
  v = v < 0.f ? 0.f : (v > qmax ? qmax : v);
  // Adding and subtracting 2^23 rounds a value in [0, 2^23) to nearest even in default mode.
  const float r = (v + 8388608.0f) - 8388608.0f;
  return static_cast<uint8_t>(r);
}

/// Scalar reconstruction: fma(code - off, s, z).
KVQ_HOST_DEVICE float uniform_decode(uint8_t code, float scale, float zero, float off) {
  return std::fma(static_cast<float>(code) - off, scale, zero);
}

}  // namespace kvq
