#pragma once
/// \file element.hpp
/// Per-element math shared by the CPU quantizers and the CUDA kernels (cuda/), written
/// once as KVQ_HOST_DEVICE functions so that a page written on the GPU holds the same bytes as
/// one written by quantize_page() on the CPU.
///
/// The formulas are those of format/uniform.hpp (uniform_params), quant/grouped_quant.hpp
/// (Fp8Codec::params), format/fp8.hpp (compute_scale), format/meta.hpp (round_meta) and
/// core/bitpack.hpp (the little-endian bitstream), restated without exceptions, std::vector or
/// host intrinsics: errors come back as an ElementStatus the caller turns into a kvq::Error
/// (host) or a device status word (GPU). tests/kernels/common/test_element.cpp compares every
/// function here with its CPU original, bit for bit, over random and adversarial inputs, so
/// the CPU test suite exercises the code the GPU runs.
///
/// Floating-point contraction: every multiply-add that must round once is an explicit fma,
/// and every product that must round on its own goes through mul_rn (a plain multiply on the
/// host; __fmul_rn on the device, which nvcc never fuses into an FMA).
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kvq/config.hpp"
#include "kvq/core/half.hpp"
#include "kvq/format/codebook.hpp"
#include "kvq/format/fp8.hpp"
#include "kvq/format/uniform.hpp"

namespace kvq {
namespace elem {

/// Outcome of a parameter computation (non-zero: what the CPU would have thrown for).
enum class ElementStatus : int32_t {
  kOk = 0,
  kNonFinite = 1,      ///< a NaN/Inf input element (CPU: kNonFinite)
  kZeroOverflow = 2,   ///< the zero point does not fit the metadata type (CPU: kOutOfRange)
  kScaleOverflow = 3,  ///< the scale or norm does not fit the metadata type (CPU: kOutOfRange)
  kOutlierRange = 4,   ///< an isolated outlier does not fit fp16 (CPU: kOutOfRange)
};

/// a * b rounded once, never fused with a following addition.
KVQ_HOST_DEVICE float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

/// a * b in double rounded once, never fused with a following addition or subtraction
/// (__dmul_rn on the device; on the host the product is materialized, so no contraction
/// setting of the host compiler can fuse it either).
KVQ_HOST_DEVICE double mul_rn_d(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  double r = a * b;
#if defined(__GNUC__)
  __asm__ volatile("" : "+m"(r));
#endif
  return r;
#endif
}

/// True when x is neither NaN nor infinite (bit test: independent of fast-math settings).
KVQ_HOST_DEVICE bool is_finite_bits(float x) {
  return (detail::f32_bits(x) & 0x7f800000u) != 0x7f800000u;
}

/// What a metadata slot stores for v: fp16 round trip when f16, else v (format/meta.hpp).
KVQ_HOST_DEVICE float round_meta(bool f16, float v) {
  return f16 ? half_bits_to_float(float_to_half_bits(v)) : v;
}

/// Reads metadata slot i of an fp16 (f16 = true) or f32 array (unaligned is fine).
KVQ_HOST_DEVICE float load_meta(const uint8_t* base, bool f16, std::size_t i) {
  if (f16) {
    const uint16_t h =
        static_cast<uint16_t>(base[2 * i] | (static_cast<uint16_t>(base[2 * i + 1]) << 8));
    return half_bits_to_float(h);
  }
  const uint32_t u = static_cast<uint32_t>(base[4 * i]) |
                     (static_cast<uint32_t>(base[4 * i + 1]) << 8) |
                     (static_cast<uint32_t>(base[4 * i + 2]) << 16) |
                     (static_cast<uint32_t>(base[4 * i + 3]) << 24);
  return detail::bits_f32(u);
}

/// Stores v rounded to the slot type at slot i (little-endian) and returns the stored value.
KVQ_HOST_DEVICE float store_meta(uint8_t* base, bool f16, std::size_t i, float v) {
  if (f16) {
    const uint16_t h = float_to_half_bits(v);
    base[2 * i] = static_cast<uint8_t>(h & 0xffu);
    base[2 * i + 1] = static_cast<uint8_t>(h >> 8);
    return half_bits_to_float(h);
  }
  const uint32_t u = detail::f32_bits(v);
  for (int b = 0; b < 4; ++b) base[4 * i + b] = static_cast<uint8_t>((u >> (8 * b)) & 0xffu);
  return v;
}

/// Parameters of one group: stored scale and zero, and the reciprocal the encoder multiplies by
/// (format/uniform.hpp's UniformParams: one type for every format's group parameters).
using GroupParams = UniformParams;

/// round_meta(f16, v) as a functor (host and device).
struct RoundMetaBits {
  bool f16;
  KVQ_HOST_DEVICE float operator()(float v) const { return round_meta(f16, v); }
};

/// Uniform-int parameters of a group spanning [lo, hi] (format/uniform.hpp uniform_params, same
/// bits; bits must be 2, 3, 4 or 8, which the caller validated).
KVQ_HOST_DEVICE ElementStatus int_params(float lo, float hi, int bits, bool symmetric, bool f16,
                                         GroupParams* p) {
  // The one definition (format/uniform.hpp), with this file's host/device fp16 rounding.
  switch (detail::uniform_params_of(lo, hi, bits, symmetric, RoundMetaBits{f16}, p)) {
    case detail::UniformParamsResult::kZeroOverflow: return ElementStatus::kZeroOverflow;
    case detail::UniformParamsResult::kScaleOverflow: return ElementStatus::kScaleOverflow;
    default: return ElementStatus::kOk;
  }
}

/// The encoder's reciprocal of a stored int scale (what int_params put in inv).
KVQ_HOST_DEVICE float int_inv(float scale) {
  float inv = (scale != 0.f) ? 1.0f / scale : 0.f;
  if (!is_finite_bits(inv)) inv = 0.f;
  return inv;
}

/// fp8::compute_scale for a finite amax >= 0 and a finite margin > 0 (validated by the caller).
KVQ_HOST_DEVICE float fp8_compute_scale(bool e5m2, float amax, float margin) {
  if (amax == 0.f) return 1.f;
  const double s = static_cast<double>(amax) * static_cast<double>(margin) /
                   (e5m2 ? 57344.0 : 448.0);
  constexpr double kMinNormal = 1.1754943508222875e-38;
  constexpr double kMaxFloat = 3.4028234663852886e+38;
  if (s < kMinNormal) return static_cast<float>(kMinNormal);
  if (s > kMaxFloat) return static_cast<float>(kMaxFloat);
  return static_cast<float>(s);
}

/// Scaled-FP8 parameters of a group spanning [lo, hi] (grouped_quant.hpp Fp8Codec::params).
KVQ_HOST_DEVICE ElementStatus fp8_params(float lo, float hi, bool e5m2, float margin, bool f16,
                                         GroupParams* p) {
  const float amax = ((-lo < hi) ? hi : -lo) + 0.0f;  // std::max(-lo, hi), same operand order
  p->zero = 0.f;
  p->scale = round_meta(f16, fp8_compute_scale(e5m2, amax, margin));
  if (p->scale == 0.f) p->scale = half_bits_to_float(1);
  if (!is_finite_bits(p->scale)) return ElementStatus::kScaleOverflow;
  p->inv = 1.0f / p->scale;
  return ElementStatus::kOk;
}

/// One fp8 code of x with the group's reciprocal scale (saturating, as the CPU encoder).
KVQ_HOST_DEVICE uint8_t fp8_encode_scaled(bool e5m2, float x, float inv) {
  const float v = mul_rn(x, inv);
  return e5m2 ? fp8::encode_e5m2(v, true) : fp8::encode_e4m3(v, true);
}
/// decode(code) * scale, one rounding.
KVQ_HOST_DEVICE float fp8_decode_scaled(bool e5m2, uint8_t c, float scale) {
  return mul_rn(e5m2 ? fp8::decode_e5m2(c) : fp8::decode_e4m3(c), scale);
}

/// Code i (bits wide) of a little-endian bitstream (core/bitpack.hpp order).
KVQ_HOST_DEVICE uint8_t get_code(const uint8_t* stream, std::size_t i, int bits) {
  if (bits == 8) return stream[i];
  const std::size_t bit = i * static_cast<std::size_t>(bits);
  const std::size_t byte = bit >> 3;
  const unsigned sh = static_cast<unsigned>(bit & 7u);
  uint32_t w = stream[byte];
  if (sh + static_cast<unsigned>(bits) > 8u) w |= static_cast<uint32_t>(stream[byte + 1]) << 8;
  return static_cast<uint8_t>((w >> sh) & ((1u << bits) - 1u));
}

/// Byte j of the bitstream holding codes[0 .. n) (bits wide, codes[i] < 2^bits): the bits of
/// every code that overlaps the byte; bits past code n - 1 are zero (pack_bits on zeroed
/// memory). Lets one thread write one output byte with no read-modify-write.
KVQ_HOST_DEVICE uint8_t packed_byte(const uint8_t* codes, std::size_t n, int bits, std::size_t j) {
  if (bits == 8) return j < n ? codes[j] : 0;
  const std::size_t b0 = j * 8;
  const auto ub = static_cast<std::size_t>(bits);
  std::size_t i = b0 / ub;  // first code overlapping the byte
  uint32_t out = 0;
  const uint32_t mask = (1u << bits) - 1u;
  for (; i < n && i * ub < b0 + 8; ++i) {
    const std::size_t start = i * ub;  // may be below b0 (code straddles the byte start)
    const uint32_t c = codes[i] & mask;
    if (start >= b0) {
      out |= c << (start - b0);
    } else {
      out |= c >> (b0 - start);
    }
  }
  return static_cast<uint8_t>(out & 0xffu);
}

/// Sign of FWHT coordinate i from a packed sign mask (bit set: -1), as Rotation::signs().
KVQ_HOST_DEVICE float sign_of(const uint32_t* mask, int i) {
  return ((mask[i >> 5] >> (i & 31)) & 1u) ? -1.f : 1.f;
}

/// nuq normalization parameters of a group spanning [lo, hi] (quant/nuq_quant.hpp nuq_params,
/// same bits): zero = min, scale = max - min, both rounded to the metadata type.
KVQ_HOST_DEVICE ElementStatus nuq_params(float lo, float hi, bool f16, GroupParams* p) {
  p->zero = round_meta(f16, lo + 0.0f);
  if (!is_finite_bits(p->zero)) return ElementStatus::kZeroOverflow;
  float s = hi - p->zero;
  if (!(s > 0.f)) s = 0.f;
  p->scale = round_meta(f16, s);
  if (!is_finite_bits(p->scale)) return ElementStatus::kScaleOverflow;
  p->inv = int_inv(p->scale);
  return ElementStatus::kOk;
}

/// nuq code of x: the nearest of the layer's levels to u = (x - zero) * inv, found against the
/// 2^bits - 1 midpoint thresholds (format/nuq.hpp nuq_thresholds; ties go up).
KVQ_HOST_DEVICE uint8_t nuq_encode(const float* thresholds, int bits, float x, float zero,
                                   float inv) {
  return codebook_encode(thresholds, bits, mul_rn(x - zero, inv));
}

/// nuq reconstruction fma(scale, level[code], zero), one rounding (NuqCodec::decode).
KVQ_HOST_DEVICE float nuq_decode(const float* levels, int bits, uint8_t code, float scale,
                                 float zero) {
  return std::fma(scale, levels[code & ((1u << bits) - 1u)], zero);
}

/// Lloyd-Max code of x against 2^bits - 1 thresholds (format/codebook.hpp codebook_encode).
KVQ_HOST_DEVICE uint8_t lm_encode(const float* thresholds, int bits, float x) {
  return codebook_encode(thresholds, bits, x);
}

}  // namespace elem
}  // namespace kvq
