#pragma once
/// \file fp4.hpp
/// FP4 KV formats: the e2m1 element, the e8m0 power-of-two scale, and the block rules of NVFP4
/// and MXFP4, bit-exact with CUDA's conversions (cuda_fp4.h, cuda_fp8.h).
///
/// Element e2m1 (1 sign, 2 exponent bits with bias 1, 1 mantissa bit): magnitudes
/// {0, 0.5, 1, 1.5, 2, 3, 4, 6}; code = sign << 3 | magnitude index. Encoding follows
/// `__nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest)`:
///  - round to nearest, ties to even (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2,
///    3.5 -> 4, 5 -> 4);
///  - saturating: |x| > 6 and +-inf -> +-6 (e2m1 has no infinity and no NaN);
///  - every NaN, of either sign, -> +6 (code 0x7), as CUDA;
///  - negative values that round to zero keep their sign (code 0x8, -0).
///
/// Scales:
///  - e8m0 (OCP MX): an unsigned biased exponent, value 2^(e - 127), code 255 = NaN.
///    `e8m0_floor` is `__nv_cvt_float_to_e8m0(x, __NV_SATFINITE, cudaRoundZero)` for x >= 0:
///    the exponent field of x (0 for zero and subnormals).
///  - e4m3 (NVFP4's block scale): kvq::fp8::encode_e4m3 (format/fp8.hpp), saturating.
///
/// Block rules (kvq's definitions of the two formats; the scalar oracle in
/// reference/fp4_ref.hpp restates them independently):
///  - MXFP4 (OCP Microscaling v1.0): a block of 32 elements shares X = 2^(floor(log2(amax)) - 2)
///    (2 = the exponent of e2m1's largest power of two, 4), stored as e8m0 and clamped to
///    [2^-127, 2^127]; an all-zero block stores code 0. Elements are e2m1(x / X): exact
///    division by a power of two, then round; values in [6X, 8X) saturate to 6X.
///  - NVFP4 (TensorRT-LLM's KV cache): a block of 16 elements shares an e4m3 scale
///    s = e4m3(fl(amax / 6) / g), and the tensor an fp32 scale g (decode scale, > 0): given by
///    calibration, 1 by default (TensorRT-LLM's and vLLM's uncalibrated KV scale), or computed
///    from a whole tensor as amax / (6 * 448). Elements are e2m1(x / fl(decode(s) * g)); a
///    block whose scale decodes to 0 stores code 0 for every element. Reconstruction:
///    fl(decode(code) * fl(decode(s) * g)).
///    (fl: one float rounding, to nearest even.)
#include <cstdint>

#include "kvq/config.hpp"
#include "kvq/core/half.hpp"
#include "kvq/format/fp8.hpp"

namespace kvq {
namespace fp4 {

/// a * b and a / b rounded once (never fused into an FMA: __fmul_rn / __fdiv_rn on the device;
/// on the host each result is a separate IEEE operation).
KVQ_HOST_DEVICE float rn_mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
KVQ_HOST_DEVICE float rn_div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

/// Largest e2m1 magnitude.
inline constexpr float kE2M1Max = 6.0f;
/// Block sizes of the two standard formats.
inline constexpr int kNvfp4Block = 16;
inline constexpr int kMxfp4Block = 32;

/// float -> e2m1 code (4 bits), round to nearest even, saturating, in integer arithmetic
/// (independent of the floating-point environment).
KVQ_HOST_DEVICE uint8_t encode_e2m1(float x) {
  const uint32_t u = detail::f32_bits(x);
  const uint32_t ax = u & 0x7fffffffu;
  if (ax > 0x7f800000u) return 0x7u;  // NaN -> +6, as CUDA
  const uint32_t sign = (u >> 28) & 0x8u;
  if (ax > 0x40c00000u) return static_cast<uint8_t>(sign | 0x7u);  // > 6 (inf too): saturate
  if (ax >= 0x3f800000u) {
    // Normal: exponent field 1..3 (|x| in [1, 6]), one mantissa bit, round the 22 others.
    const uint32_t e = (ax >> 23) - 126u;  // 1, 2 or 3
    const uint32_t m = (ax >> 22) & 1u;
    const uint32_t rest = ax & 0x3fffffu;
    uint32_t code = (e << 1) | m;
    if (rest > 0x200000u || (rest == 0x200000u && m != 0)) ++code;  // (6 itself has rest 0)
    return static_cast<uint8_t>(sign | code);
  }
  // |x| < 1: a count of 0.5 steps (0, 1, or 2 = the normal 1.0), rounded to nearest even.
  const uint32_t e = ax >> 23;
  if (e < 125u) return static_cast<uint8_t>(sign);  // |x| < 0.25: +-0
  const uint32_t s = 149u - e;                      // 23 or 24
  const uint32_t m24 = (ax & 0x7fffffu) | 0x800000u;
  const uint32_t code = (m24 + ((1u << (s - 1u)) - 1u) + ((m24 >> s) & 1u)) >> s;
  return static_cast<uint8_t>(sign | code);
}

/// e2m1 code (low 4 bits) -> float (exact; code 0x8 is -0).
KVQ_HOST_DEVICE float decode_e2m1(uint8_t c) {
  // Magnitude index i: 0, 0.5, 1, 1.5, 2, 3, 4, 6 = (i < 2 ? i / 2 : (2 + (i & 1)) * 2^((i >> 1) - 2)).
  const uint32_t i = c & 0x7u;
  uint32_t bits = 0;
  if (i == 1) {
    bits = 0x3f000000u;  // 0.5
  } else if (i >= 2) {
    bits = ((126u + (i >> 1)) << 23) | ((i & 1u) << 22);
  }
  return detail::bits_f32(bits | (static_cast<uint32_t>(c & 0x8u) << 28));
}

/// e8m0 code of x >= 0 rounded toward zero: its exponent field (0 for zero and subnormals);
/// +inf saturates to 254, NaN gives 255 (CUDA's __NV_SATFINITE, cudaRoundZero).
KVQ_HOST_DEVICE uint8_t e8m0_floor(float x) {
  const uint32_t ax = detail::f32_bits(x) & 0x7fffffffu;
  if (ax > 0x7f800000u) return 0xffu;
  const uint32_t e = ax >> 23;
  return static_cast<uint8_t>(e == 255u ? 254u : e);
}

/// e8m0 code -> float: 2^(e - 127) (exact; 2^-127 is a float subnormal), 255 -> NaN.
KVQ_HOST_DEVICE float decode_e8m0(uint8_t e) {
  if (e == 0xffu) return detail::bits_f32(0x7fffffffu);
  if (e == 0u) return detail::bits_f32(0x00400000u);  // 2^-127
  return detail::bits_f32(static_cast<uint32_t>(e) << 23);
}

/// MXFP4 shared scale code of a block with largest magnitude amax (finite, >= 0):
/// floor(log2(amax)) - 2, biased, clamped to [0, 254]; 0 for an all-zero block.
KVQ_HOST_DEVICE uint8_t mx_scale_code(float amax) {
  const uint32_t e = e8m0_floor(amax);
  return static_cast<uint8_t>(e > 2u ? e - 2u : 0u);
}

/// 1 / decode_e8m0(code) (exact power of two; the MX element encoder multiplies by it).
KVQ_HOST_DEVICE float mx_inverse_scale(uint8_t code) {
  // 2^(127 - e): e in [0, 254] -> exponent field 254 - e (>= 0; e = 254 gives 2^-127).
  const uint32_t f = 254u - code;
  return f == 0u ? detail::bits_f32(0x00400000u) : detail::bits_f32(f << 23);
}

/// MXFP4 element code of x in a block with scale code `code` (x / 2^(code - 127), exact, then
/// e2m1).
KVQ_HOST_DEVICE uint8_t mx_encode(float x, uint8_t code) {
  return encode_e2m1(x * mx_inverse_scale(code));
}

/// MXFP4 reconstruction: decode(c) * 2^(code - 127) (one rounding; exact unless subnormal).
KVQ_HOST_DEVICE float mx_decode(uint8_t c, uint8_t code) {
  return rn_mul(decode_e2m1(c), decode_e8m0(code));
}

/// NVFP4 block scale code (e4m3, saturating) of a block with largest magnitude amax
/// (finite, >= 0) under the tensor decode scale g (finite, > 0): e4m3(fl(amax / 6) / g).
KVQ_HOST_DEVICE uint8_t nv_scale_code(float amax, float g) {
  return fp8::encode_e4m3(rn_div(rn_div(amax, kE2M1Max), g), true);
}

/// The element scale of an NVFP4 block: fl(decode_e4m3(code) * g).
KVQ_HOST_DEVICE float nv_element_scale(uint8_t code, float g) {
  return rn_mul(fp8::decode_e4m3(code), g);
}

/// NVFP4 element code of x under element scale es (nv_element_scale): e2m1(fl(x / es)); 0 when
/// es is 0.
KVQ_HOST_DEVICE uint8_t nv_encode(float x, float es) {
  return es > 0.f ? encode_e2m1(rn_div(x, es)) : uint8_t{0};
}

/// NVFP4 reconstruction: fl(decode(c) * es).
KVQ_HOST_DEVICE float nv_decode(uint8_t c, float es) {
  return rn_mul(decode_e2m1(c), es);
}

/// The tensor decode scale that maps a whole tensor's largest magnitude onto the largest block
/// scale: amax / (6 * 448), or 1 for an all-zero tensor.
KVQ_HOST_DEVICE float nv_tensor_scale_from_amax(float amax) {
  const float g = rn_div(amax, kE2M1Max * 448.0f);
  return g > 0.f ? g : 1.0f;
}

}  // namespace fp4
}  // namespace kvq
