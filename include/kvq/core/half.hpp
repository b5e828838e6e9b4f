#pragma once
/// \file half.hpp
/// fp16 (IEEE binary16) and bf16 storage types with round-to-nearest-even conversion.
///
/// The scalar conversions are exact bit manipulations written once for host and device; the
/// bulk conversions use F16C / AVX-512 when compiled in and give bit-identical results (tests
/// compare them over all 65536 half values both ways).
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kvq/config.hpp"

namespace kvq {

namespace detail {
KVQ_HOST_DEVICE uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
KVQ_HOST_DEVICE float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
}  // namespace detail

/// float -> binary16 bits, round to nearest even; overflow -> inf; NaN stays NaN (quieted,
/// top payload bits kept, as F16C does).
KVQ_HOST_DEVICE uint16_t float_to_half_bits(float f) {
  const uint32_t x = detail::f32_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) {  // inf or NaN
    if (ax == 0x7f800000u) return static_cast<uint16_t>(sign | 0x7c00u);
    return static_cast<uint16_t>(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
  }
  if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520 -> inf
  if (ax < 0x38800000u) {                                               // below 2^-14
    if (ax <= 0x33000000u) return static_cast<uint16_t>(sign);  // <= 2^-25 -> 0 (tie to even)
    const uint32_t e = ax >> 23;
    const uint32_t m = (ax & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - e;  // 14..24
    uint32_t k = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u);
    const uint32_t halfway = 1u << (shift - 1u);
    k += (rem > halfway || (rem == halfway && (k & 1u))) ? 1u : 0u;
    return static_cast<uint16_t>(sign | k);
  }
  // normal range: rebias exponent (127 -> 15), round the 13 dropped mantissa bits
  uint32_t h = ((ax - 0x38000000u) >> 13);
  const uint32_t rem = ax & 0x1fffu;
  h += (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ? 1u : 0u;
  return static_cast<uint16_t>(sign | h);
}

/// binary16 bits -> float (exact; signalling NaNs come back quiet, as F16C does).
KVQ_HOST_DEVICE float half_bits_to_float(uint16_t h) {
  const uint32_t sign = (static_cast<uint32_t>(h) & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu;
  const uint32_t m = h & 0x3ffu;
  uint32_t out;
  if (e == 0) {
    if (m == 0) {
      out = sign;
    } else {  // subnormal: value = m * 2^-24, normalize
      uint32_t mm = m;
      int32_t ee = 113;  // biased exponent of 2^-14
      while ((mm & 0x400u) == 0) {
        mm <<= 1;
        --ee;
      }
      out = sign | (static_cast<uint32_t>(ee) << 23) | ((mm & 0x3ffu) << 13);
    }
  } else if (e == 31) {
    out = sign | 0x7f800000u | (m << 13) | (m ? 0x400000u : 0u);
  } else {
    out = sign | ((e + 112u) << 23) | (m << 13);
  }
  return detail::bits_f32(out);
}

/// float -> bfloat16 bits, round to nearest even; NaN stays NaN (quieted). Subnormals are kept
/// (unlike AVX512-BF16's VCVTNEPS2BF16, which flushes them, so that instruction is not used).
KVQ_HOST_DEVICE uint16_t float_to_bf16_bits(float f) {
  const uint32_t x = detail::f32_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  const uint32_t r = x + 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(r >> 16);
}

/// bfloat16 bits -> float (exact).
KVQ_HOST_DEVICE float bf16_bits_to_float(uint16_t b) {
  return detail::bits_f32(static_cast<uint32_t>(b) << 16);
}

/// Host fast path of float_to_half_bits (single F16C instruction when compiled in); same bits.
inline uint16_t float_to_half_bits_fast(float f) {
#if KVQ_HAS_F16C
  return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
  return float_to_half_bits(f);
#endif
}
/// Host fast path of half_bits_to_float; same bits.
inline float half_bits_to_float_fast(uint16_t h) {
#if KVQ_HAS_F16C
  return _cvtsh_ss(h);
#else
  return half_bits_to_float(h);
#endif
}

/// IEEE binary16 storage type (no arithmetic: convert to float to compute).
struct f16 {
  uint16_t bits = 0;
  f16() = default;
  KVQ_HOST_DEVICE explicit f16(float f) : bits(float_to_half_bits(f)) {}
  KVQ_HOST_DEVICE static f16 from_bits(uint16_t b) {
    f16 h;
    h.bits = b;
    return h;
  }
  KVQ_HOST_DEVICE explicit operator float() const { return half_bits_to_float(bits); }
  KVQ_HOST_DEVICE float to_float() const { return half_bits_to_float(bits); }
};

/// bfloat16 storage type.
struct bf16 {
  uint16_t bits = 0;
  bf16() = default;
  KVQ_HOST_DEVICE explicit bf16(float f) : bits(float_to_bf16_bits(f)) {}
  KVQ_HOST_DEVICE static bf16 from_bits(uint16_t b) {
    bf16 h;
    h.bits = b;
    return h;
  }
  KVQ_HOST_DEVICE explicit operator float() const { return bf16_bits_to_float(bits); }
  KVQ_HOST_DEVICE float to_float() const { return bf16_bits_to_float(bits); }
};

static_assert(sizeof(f16) == 2 && sizeof(bf16) == 2, "storage types must be 2 bytes");

/// Element -> float for every storage type kvq reads.
KVQ_HOST_DEVICE float to_float(float x) { return x; }
KVQ_HOST_DEVICE float to_float(f16 x) { return half_bits_to_float(x.bits); }
KVQ_HOST_DEVICE float to_float(bf16 x) { return bf16_bits_to_float(x.bits); }

/// float -> element, round to nearest even.
template <class T>
KVQ_HOST_DEVICE T from_float(float x);
template <>
KVQ_HOST_DEVICE float from_float<float>(float x) {
  return x;
}
template <>
KVQ_HOST_DEVICE f16 from_float<f16>(float x) {
  return f16(x);
}
template <>
KVQ_HOST_DEVICE bf16 from_float<bf16>(float x) {
  return bf16(x);
}

// ---------------------------------------------------------------------------------------------
// Bulk conversions (host). Bit-identical to the scalar functions above.

/// dst[i] = half(src[i]) for i < n.
inline void convert(const float* src, f16* dst, std::size_t n) {
  std::size_t i = 0;
#if KVQ_HAS_AVX512
  for (; i + 16 <= n; i += 16) {
    __m256i h = _mm512_cvtps_ph(_mm512_loadu_ps(src + i),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), h);
  }
#elif KVQ_HAS_F16C
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
#endif
  for (; i < n; ++i) dst[i].bits = float_to_half_bits(src[i]);
}

/// dst[i] = float(src[i]) for i < n.
inline void convert(const f16* src, float* dst, std::size_t n) {
  std::size_t i = 0;
#if KVQ_HAS_AVX512
  for (; i + 16 <= n; i += 16) {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(h));
  }
#elif KVQ_HAS_F16C
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
#endif
  for (; i < n; ++i) dst[i] = half_bits_to_float(src[i].bits);
}

/// dst[i] = bf16(src[i]) for i < n.
inline void convert(const float* src, bf16* dst, std::size_t n) {
  std::size_t i = 0;
#if KVQ_HAS_AVX512
  const __m512i k7fff = _mm512_set1_epi32(0x7fff);
  const __m512i one = _mm512_set1_epi32(1);
  const __m512i absmask = _mm512_set1_epi32(0x7fffffff);
  const __m512i inf = _mm512_set1_epi32(0x7f800000);
  const __m512i quiet = _mm512_set1_epi32(0x400000);
  for (; i + 16 <= n; i += 16) {
    __m512i x = _mm512_castps_si512(_mm512_loadu_ps(src + i));
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), one);
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(x, k7fff), lsb);
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(x, absmask), inf);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(x, quiet));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
  }
#endif
  for (; i < n; ++i) dst[i].bits = float_to_bf16_bits(src[i]);
}

/// dst[i] = float(src[i]) for i < n.
inline void convert(const bf16* src, float* dst, std::size_t n) {
  std::size_t i = 0;
#if KVQ_HAS_AVX512
  for (; i + 16 <= n; i += 16) {
    __m512i b = _mm512_cvtepu16_epi32(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)));
  }
#endif
  for (; i < n; ++i) dst[i] = bf16_bits_to_float(src[i].bits);
}

}  // namespace kvq
