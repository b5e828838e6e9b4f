#pragma once
/// \file int8_dot.hpp
/// Integer dot products of the fused attention's int8 path (AttentionOptions::dot =
/// DotProduct::kInt8; attention/cpu/tiles_int8.hpp): 32-byte chunks of unsigned codes times
/// signed int8 operands, four byte products summed into each of eight int32 lanes.
///
///  - AVX-512 VNNI (+VL) builds: `vpdpbusd` on 256-bit vectors (Zen 4/5, Ice Lake and later);
///  - AVX-VNNI builds (Alder Lake and later without AVX-512): the VEX `vpdpbusd`;
///  - AVX2 builds: `vpmaddubsw` (pairs of u8 x s8 products summed into saturating int16) then
///    `vpmaddwd` by ones. No pair sum may exceed 32767 there: 4-bit codes (<= 15) times int8
///    (<= 127) give 3810, weights (<= 255) times 4-bit codes 7650; 8-bit key codes (255 x 127
///    x 2) would overflow, so they keep the exact kernels on AVX2 (kU8Codes).
/// 256-bit vectors on every ISA: one code chunk is 32 bytes (64 channels of 4-bit codes, 32 of
/// 8-bit codes), so head_dim 64 (SmolLM2, Llama 3.2 1B) is one chunk, and on Zen 4 a 256-bit
/// `vpdpbusd` issues twice per cycle (64 byte products per cycle, four times its fp32 FMAs).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "kvq/config.hpp"

#if KVQ_HAS_AVX2
#include <immintrin.h>

namespace kvq {
namespace kernels {
namespace attn {
namespace i8 {

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr bool kU8Codes = true;
inline __m256i dp4(__m256i acc, __m256i u8, __m256i s8) { return _mm256_dpbusd_epi32(acc, u8, s8); }
#elif defined(__AVXVNNI__)
constexpr bool kU8Codes = true;
inline __m256i dp4(__m256i acc, __m256i u8, __m256i s8) {
  return _mm256_dpbusd_avx_epi32(acc, u8, s8);
}
#else
/// 8-bit key codes are left to the exact kernels here (255 x 127 x 2 overflows int16; a
/// narrower query would double the rounding error).
constexpr bool kU8Codes = false;
inline __m256i dp4(__m256i acc, __m256i u8, __m256i s8) {
  return _mm256_add_epi32(
      acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u8, s8), _mm256_set1_epi16(1)));
}
#endif

/// Low and high nibbles of 32 packed 4-bit code bytes (byte b holds channels 2b and 2b + 1 of
/// its 64-channel chunk): lo = the even channels', hi = the odd channels' codes, one per byte.
inline void nibbles(const uint8_t* p, __m256i& lo, __m256i& hi) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i m = _mm256_set1_epi8(15);
  lo = _mm256_and_si256(x, m);
  hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), m);
}

/// Eight int32 lanes (each within +-127) as eight int8 bytes at out.
inline void store8_i8(__m256i v, int8_t* out) {
  const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packs_epi16(w, w));
}

/// max|x| and sum(x) over x[0, D), D a multiple of 8.
inline void row_stats(const float* x, int64_t D, float& amax, float& sum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_setzero_ps(), a = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 v = _mm256_loadu_ps(x + d);
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v));
    a = _mm256_add_ps(a, v);
  }
  alignas(32) float mv[8], av[8];
  _mm256_store_ps(mv, m);
  _mm256_store_ps(av, a);
  amax = 0.f;
  sum = 0.f;
  for (int i = 0; i < 8; ++i) {
    amax = std::max(amax, mv[i]);
    sum += av[i];
  }
}

/// Quantizes x[0, D) (D a multiple of 64 for 4-bit codes, of 32 for 8-bit codes) to int8 with
/// one scale, given amax = max|x| and sumx = sum(x) (row_stats): q = round-to-nearest-even(x /
/// s), s = amax / 127 (amax zero or not finite: q = 0, s = 0). Writes the codes in the chunk
/// layout of the code width: 4-bit codes per 64-channel chunk c at out + 64 c, even channels
/// first (out[64 c + i] = q[64 c + 2 i], out[64 c + 32 + i] = q[64 c + 2 i + 1]); 8-bit codes
/// in natural order. Returns s; *rsum = sum_d (s q_d - x_d), the rounding errors' sum (what
/// centered codes subtract).
inline float quantize_row(const float* x, int64_t D, bool four_bit, float amax, float sumx,
                          int8_t* out, float* rsum) {
  constexpr int qmax = 127;
  if (!(amax > 0.f) || !(amax < std::numeric_limits<float>::infinity())) {
    std::memset(out, 0, static_cast<std::size_t>(D));
    *rsum = -sumx;
    return 0.f;
  }
  const __m256 inv = _mm256_set1_ps(static_cast<float>(qmax) / amax);
  const __m256 hi = _mm256_set1_ps(static_cast<float>(qmax)), lo = _mm256_set1_ps(-static_cast<float>(qmax));
  __m256i qs = _mm256_setzero_si256();
  auto round8 = [&](__m256 v) {
    const __m256i q = _mm256_cvtps_epi32(_mm256_max_ps(lo, _mm256_min_ps(hi, _mm256_mul_ps(v, inv))));
    qs = _mm256_add_epi32(qs, q);
    return q;
  };
  if (four_bit) {
    for (int64_t b = 0; b < D; b += 16) {  // 16 channels: 8 evens, 8 odds
      const __m256 a = _mm256_loadu_ps(x + b), c = _mm256_loadu_ps(x + b + 8);
      const __m256 e = _mm256_castpd_ps(_mm256_permute4x64_pd(
          _mm256_castps_pd(_mm256_shuffle_ps(a, c, _MM_SHUFFLE(2, 0, 2, 0))), _MM_SHUFFLE(3, 1, 2, 0)));
      const __m256 o = _mm256_castpd_ps(_mm256_permute4x64_pd(
          _mm256_castps_pd(_mm256_shuffle_ps(a, c, _MM_SHUFFLE(3, 1, 3, 1))), _MM_SHUFFLE(3, 1, 2, 0)));
      int8_t* dst = out + (b / 64) * 64 + (b % 64) / 2;
      store8_i8(round8(e), dst);
      store8_i8(round8(o), dst + 32);
    }
  } else {
    for (int64_t d = 0; d < D; d += 8) store8_i8(round8(_mm256_loadu_ps(x + d)), out + d);
  }
  alignas(32) int32_t qv[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(qv), qs);
  int64_t qt = 0;
  for (int i = 0; i < 8; ++i) qt += qv[i];
  const float s = amax / static_cast<float>(qmax);
  *rsum = static_cast<float>(static_cast<double>(s) * static_cast<double>(qt) - static_cast<double>(sumx));
  return s;
}

/// Token-interleaved 4-bit codes of four rows for value accumulation: from each row's 32-byte
/// chunk, x[0..3] hold the even channels' codes and x[4..7] the odd channels', with int32 lane
/// l of x[k] (k < 4) holding byte b of the four rows (row u in byte u), b = 4 k + l for l < 4
/// and 16 + 4 k + (l - 4) for l >= 4.
inline void interleave4(const uint8_t* r0, const uint8_t* r1, const uint8_t* r2, const uint8_t* r3,
                        __m256i* x) {
  __m256i l[4], h[4];
  nibbles(r0, l[0], h[0]);
  nibbles(r1, l[1], h[1]);
  nibbles(r2, l[2], h[2]);
  nibbles(r3, l[3], h[3]);
  for (int s = 0; s < 2; ++s) {
    const __m256i* v = s == 0 ? l : h;
    const __m256i p0 = _mm256_unpacklo_epi8(v[0], v[1]), q0 = _mm256_unpacklo_epi8(v[2], v[3]);
    const __m256i p1 = _mm256_unpackhi_epi8(v[0], v[1]), q1 = _mm256_unpackhi_epi8(v[2], v[3]);
    x[4 * s + 0] = _mm256_unpacklo_epi16(p0, q0);
    x[4 * s + 1] = _mm256_unpackhi_epi16(p0, q0);
    x[4 * s + 2] = _mm256_unpacklo_epi16(p1, q1);
    x[4 * s + 3] = _mm256_unpackhi_epi16(p1, q1);
  }
}

}  // namespace i8
}  // namespace attn
}  // namespace kernels
}  // namespace kvq
#endif
