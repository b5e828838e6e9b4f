#pragma once
/// \file attention_simd.hpp
/// The vector vocabulary of the fused attention kernels (attention/cpu/attention_cpu.hpp): one
/// struct per instruction set with the same static functions, so the kernels are written once
/// as templates and instantiated for AVX2+F16C (8 lanes; AVX-512 builds run this instance too,
/// with the 16-lane microkernels of attention_avx2.hpp) and the portable scalar path (1 lane,
/// the only one under KVQ_NO_SIMD). There is no 16-lane instance of the per-head path: no
/// AVX-512 target lacks AVX2/FMA/F16C, so it was never selected (issue 29).
///
/// Code loaders turn packed codes into floats *without* their scale: integers as the raw code
/// (the offset of symmetric formats is folded into the zero point by the caller), fp8 as the
/// unscaled fp8 value (e4m3 times 2^-8: the byte shifted into fp16 position; e5m2 exactly: the
/// byte is the high half of an fp16), Lloyd-Max codes through a 16-entry centroid table. Only
/// AVX-512F/BW/DQ/VL and AVX2/FMA/F16C instructions are used (no VNNI, no BF16 instructions),
/// so the AVX-512 path runs on Skylake-SP as well as on newer cores.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kvq/config.hpp"
#include "kvq/core/half.hpp"

namespace kvq {
namespace kernels {
namespace attn {

/// How the codes of a stored row are read (raw f32/f16/bf16, unsigned integer codes of 8/4/2
/// bits, fp8, Lloyd-Max codes through a centroid table).
enum class Load : uint8_t { kF32, kF16, kBF16, kU8, kU4, kU2, kE4M3, kE5M2, kLut8, kLut4 };

/// fp32 exp for softmax weights (arguments <= 0; -inf gives 0): Cody-Waite reduction by ln 2
/// and a degree-7 Taylor polynomial on |r| <= ln2/2 (truncation error < 3e-9 relative), then
/// scaling by 2^n. Written as one scalar formula so all three paths compute the same function.
inline float exp_neg(float x) {
  if (!(x > -87.0f)) return x == x ? 0.f : x;  // also -inf -> 0
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = std::fma(n, -0.693145751953125f, x);
  r = std::fma(n, -1.428606765330187045e-06f, r);
  float p = 1.f / 5040.f;
  p = std::fma(p, r, 1.f / 720.f);
  p = std::fma(p, r, 1.f / 120.f);
  p = std::fma(p, r, 1.f / 24.f);
  p = std::fma(p, r, 1.f / 6.f);
  p = std::fma(p, r, 0.5f);
  p = std::fma(p, r, 1.f);
  p = std::fma(p, r, 1.f);
  return std::ldexp(p, static_cast<int>(n));
}

/// Portable scalar "vectors" of one lane.
struct SimdScalar {
  static constexpr int W = 1;
  using V = float;
  using VI = int32_t;
  static V zero() { return 0.f; }
  static V set1(float x) { return x; }
  static V load(const float* p) { return *p; }
  static void store(float* p, V v) { *p = v; }
  static V fma(V a, V b, V c) { return std::fma(a, b, c); }
  static V mul(V a, V b) { return a * b; }
  static V add(V a, V b) { return a + b; }
  static V max(V a, V b) { return a > b ? a : b; }
  static float reduce(V v) { return v; }
  static void reduce4(V a, V b, V c, V d, float* out) {
    out[0] = a;
    out[1] = b;
    out[2] = c;
    out[3] = d;
  }
  static V exp(V x) { return exp_neg(x); }
  static VI codes_u8(const uint8_t* p) { return *p; }
  static V cvt(VI c) { return static_cast<float>(c); }
  static V lut(VI c, const float* table16) { return table16[c & 15]; }
  static V from_f16(const uint16_t* p) { return half_bits_to_float_fast(*p); }
  static V from_bf16(const uint16_t* p) {
    const uint32_t u = static_cast<uint32_t>(*p) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  static V from_e4m3(const uint8_t* p) {
    const uint16_t h = static_cast<uint16_t>(((*p & 0x80u) << 8) | ((*p & 0x7fu) << 7));
    return half_bits_to_float_fast(h);
  }
  static V from_e5m2(const uint8_t* p) {
    return half_bits_to_float_fast(static_cast<uint16_t>(*p << 8));
  }
};

#if KVQ_HAS_AVX2 && KVQ_HAS_F16C
/// AVX2 + FMA + F16C, 8 lanes.
struct Simd256 {
  static constexpr int W = 8;
  using V = __m256;
  using VI = __m256i;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static float reduce(V v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
  }
  static void reduce4(V a, V b, V c, V d, float* out) {
    const V h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  }
  static V exp(V x) {
    const V live = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GT_OQ);
    const V n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    V r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693145751953125f), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(-1.428606765330187045e-06f), r);
    V p = _mm256_set1_ps(1.f / 5040.f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 720.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    // 2^n for n in [-126, 127]: (n + 127) << 23 (live lanes have n >= -126).
    const VI e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), live);
  }
  static VI codes_u8(const uint8_t* p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  static VI codes_u4(const uint8_t* p) {
    uint32_t w;
    std::memcpy(&w, p, 4);
    const VI sh = _mm256_set_epi32(28, 24, 20, 16, 12, 8, 4, 0);
    return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w)), sh),
                            _mm256_set1_epi32(15));
  }
  static VI codes_u2(const uint8_t* p) {
    uint16_t w;
    std::memcpy(&w, p, 2);
    const VI sh = _mm256_set_epi32(14, 12, 10, 8, 6, 4, 2, 0);
    return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(w), sh), _mm256_set1_epi32(3));
  }
  static V cvt(VI c) { return _mm256_cvtepi32_ps(c); }
  static V lut(VI c, const float* table16) {
    const V lo = _mm256_permutevar8x32_ps(_mm256_loadu_ps(table16), c);
    const V hi = _mm256_permutevar8x32_ps(_mm256_loadu_ps(table16 + 8), c);
    const VI sel = _mm256_slli_epi32(c, 28);  // bit 3 of the code into the sign bit
    return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(sel));
  }
  static V from_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static V from_bf16(const uint16_t* p) {
    const VI w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static V from_e4m3(const uint8_t* p) {
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                                   _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), 7));
    return _mm256_cvtph_ps(h);
  }
  static V from_e5m2(const uint8_t* p) {
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return _mm256_cvtph_ps(_mm_slli_epi16(b, 8));
  }
};
#endif

}  // namespace attn
}  // namespace kernels
}  // namespace kvq
