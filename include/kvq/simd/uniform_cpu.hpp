#pragma once
/// \file uniform_cpu.hpp
/// CPU kernels for grouped uniform integer quantization: group statistics, encode/decode of
/// contiguous runs, and 2/4-bit packing. AVX-512 when KVQ_HAS_AVX512, else AVX2 (+FMA, and F16C
/// where fp16 values are rounded) when KVQ_HAS_AVX2, scalar otherwise; every path produces bits
/// identical to reference/uniform_ref.hpp (tests compare them).
///
/// How the SIMD paths stay bit-identical to the scalar formulas: the same IEEE operations in the
/// same order (x - z, then one fused multiply-add with inv and off; a separate sub and div for
/// the parameters, never a reciprocal estimate), clamps by min/max (equal to the scalar
/// compare-and-select for every non-NaN value), round-to-nearest-even conversions (vcvtps2dq in
/// the default MXCSR mode, as the scalar 2^23 trick; vcvtps2ph with RNE, as float_to_half_bits).
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#include "kvq/config.hpp"
#include "kvq/core/bitpack.hpp"
#include "kvq/core/half.hpp"
#include "kvq/format/uniform.hpp"
#include "kvq/simd/prefetch.hpp"

namespace kvq::kernels {

#if KVQ_HAS_AVX2 && !KVQ_HAS_AVX512
namespace avx2 {
/// Lanes of v - v: +0 for finite v, NaN for NaN or +-inf; or-ed together, nonzero bits flag a
/// non-finite value (two cheap ops per vector).
inline __m256 nonfinite_acc(__m256 acc, __m256 v) { return _mm256_or_ps(acc, _mm256_sub_ps(v, v)); }
inline bool any_bits(__m256 v) {
  const __m256i i = _mm256_castps_si256(v);
  return !_mm256_testz_si256(i, i);
}
/// All ones in the lanes where v is NaN or +-inf.
inline __m256 nonfinite_mask(__m256 v) {
  const __m256 ax = _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)));
  return _mm256_cmp_ps(ax, _mm256_castsi256_ps(_mm256_set1_epi32(0x7f800000)), _CMP_NLT_UQ);
}
/// Every lane = min (max) over the 8 lanes.
inline __m256 all_min(__m256 v) {
  v = _mm256_min_ps(v, _mm256_permute2f128_ps(v, v, 0x01));
  v = _mm256_min_ps(v, _mm256_permute_ps(v, 0x4E));
  return _mm256_min_ps(v, _mm256_permute_ps(v, 0xB1));
}
inline __m256 all_max(__m256 v) {
  v = _mm256_max_ps(v, _mm256_permute2f128_ps(v, v, 0x01));
  v = _mm256_max_ps(v, _mm256_permute_ps(v, 0x4E));
  return _mm256_max_ps(v, _mm256_permute_ps(v, 0xB1));
}
/// All ones in lanes 0 .. n-1 (n in [0, 8]).
inline __m256i lanes_below(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
/// Codes of 8 values: RNE(clamp(fma(x - z, inv, off), 0, qmax)) as int32 lanes.
inline __m256i encode8(__m256 x, __m256 z, __m256 inv, __m256 off, __m256 qmax) {
  const __m256 v = _mm256_fmadd_ps(_mm256_sub_ps(x, z), inv, off);
  return _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, _mm256_setzero_ps()), qmax));
}
/// 8 codes (int32 lanes in 0..255) -> 8 bytes in the low half of the result.
inline __m128i bytes8(__m256i c) {
  const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
  return _mm_packus_epi16(w, w);
}
/// 32 codes (four vectors of int32 lanes in 0..255) -> 32 bytes in order.
inline __m256i bytes32(__m256i a, __m256i b, __m256i c, __m256i d) {
  // packs/packus work per 128-bit lane: dwords come out as a0-3 b0-3 c0-3 d0-3 a4-7 b4-7 ...
  const __m256i p = _mm256_packus_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
  return _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
/// 32 code bytes -> 16 bytes of 4-bit codes, LSB first (code 2k | code 2k+1 << 4).
inline __m128i nibbles32(__m256i b) {
  const __m256i t = _mm256_maddubs_epi16(_mm256_and_si256(b, _mm256_set1_epi8(0x0f)),
                                         _mm256_set1_epi16(0x1001));  // c0 * 1 + c1 * 16
  return _mm_packus_epi16(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
}
/// 8 code bytes (low half of b) -> 4 bytes of 4-bit codes.
inline uint32_t nibbles8(__m128i b) {
  const __m128i t = _mm_maddubs_epi16(_mm_and_si128(b, _mm_set1_epi8(0x0f)), _mm_set1_epi16(0x1001));
  return static_cast<uint32_t>(_mm_cvtsi128_si32(_mm_packus_epi16(t, t)));
}
/// 32 code bytes -> 8 bytes of 2-bit codes in the low 64 bits of 32-bit lane pairs: returns
/// the 8 int32 lanes (c0 | c1 << 2 | c2 << 4 | c3 << 6), one per 4 codes.
inline __m256i crumbs32(__m256i b) {
  const __m256i t = _mm256_maddubs_epi16(_mm256_and_si256(b, _mm256_set1_epi8(0x03)),
                                         _mm256_set1_epi16(0x0401));    // c0 + 4 c1
  return _mm256_madd_epi16(t, _mm256_set1_epi32(0x00100001));          // + 16 (c2 + 4 c3)
}
inline void store_u32(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }
}  // namespace avx2
#endif


/// lo = min(lo, x[0..n)), hi = max(hi, x[0..n)). Returns false if any x is NaN or +/-inf.
inline bool minmax(const float* x, int64_t n, float& lo, float& hi) {
  int64_t i = 0;
  bool finite = true;
#if KVQ_HAS_AVX512
  if (n >= 16) {
    __m512 vlo = _mm512_set1_ps(lo), vhi = _mm512_set1_ps(hi);
    __mmask16 bad = 0;
    for (; i + 16 <= n; i += 16) {
      const __m512 v = _mm512_loadu_ps(x + i);
      bad |= _mm512_fpclass_ps_mask(v, 0x99);  // QNaN | +inf | -inf | SNaN
      vlo = _mm512_min_ps(vlo, v);
      vhi = _mm512_max_ps(vhi, v);
    }
    lo = _mm512_reduce_min_ps(vlo);
    hi = _mm512_reduce_max_ps(vhi);
    finite = bad == 0;
  }
#elif KVQ_HAS_AVX2
  if (n >= 8) {
    __m256 vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi), bad = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      bad = avx2::nonfinite_acc(bad, v);
      vlo = _mm256_min_ps(vlo, v);
      vhi = _mm256_max_ps(vhi, v);
    }
    lo = _mm256_cvtss_f32(avx2::all_min(vlo));
    hi = _mm256_cvtss_f32(avx2::all_max(vhi));
    finite = !avx2::any_bits(bad);
  }
#endif
  for (; i < n; ++i) {
    const float v = x[i];
    finite &= std::isfinite(v);
    lo = v < lo ? v : lo;
    hi = v > hi ? v : hi;
  }
  return finite;
}

/// Element-wise lo[i] = min(lo[i], x[i]), hi[i] = max(hi[i], x[i]). Returns false on NaN/inf.
inline bool minmax_elementwise(const float* x, float* lo, float* hi, int64_t n) {
  int64_t i = 0;
  bool finite = true;
#if KVQ_HAS_AVX512
  __mmask16 bad = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    bad |= _mm512_fpclass_ps_mask(v, 0x99);
    _mm512_storeu_ps(lo + i, _mm512_min_ps(_mm512_loadu_ps(lo + i), v));
    _mm512_storeu_ps(hi + i, _mm512_max_ps(_mm512_loadu_ps(hi + i), v));
  }
  finite = bad == 0;
#elif KVQ_HAS_AVX2
  __m256 bad = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    bad = avx2::nonfinite_acc(bad, v);
    _mm256_storeu_ps(lo + i, _mm256_min_ps(_mm256_loadu_ps(lo + i), v));
    _mm256_storeu_ps(hi + i, _mm256_max_ps(_mm256_loadu_ps(hi + i), v));
  }
  finite = !avx2::any_bits(bad);
#endif
  for (; i < n; ++i) {
    const float v = x[i];
    finite &= std::isfinite(v);
    lo[i] = v < lo[i] ? v : lo[i];
    hi[i] = v > hi[i] ? v : hi[i];
  }
  return finite;
}

/// codes[i] = uniform_encode(x[i], z, inv, off, qmax) with one (z, inv) for the run.
inline void encode_run(const float* x, int64_t n, float z, float inv, float off, float qmax,
                       uint8_t* codes) {
  int64_t i = 0;
#if KVQ_HAS_AVX512
  const __m512 vz = _mm512_set1_ps(z), vinv = _mm512_set1_ps(inv), voff = _mm512_set1_ps(off);
  const __m512 vq = _mm512_set1_ps(qmax), v0 = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    __m512 v = _mm512_fmadd_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), vz), vinv, voff);
    v = _mm512_min_ps(_mm512_max_ps(v, v0), vq);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i),
                     _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v)));
  }
#elif KVQ_HAS_AVX2
  const __m256 vz = _mm256_set1_ps(z), vinv = _mm256_set1_ps(inv), voff = _mm256_set1_ps(off);
  const __m256 vq = _mm256_set1_ps(qmax);
  for (; i + 32 <= n; i += 32) {
    const __m256i c0 = avx2::encode8(_mm256_loadu_ps(x + i), vz, vinv, voff, vq);
    const __m256i c1 = avx2::encode8(_mm256_loadu_ps(x + i + 8), vz, vinv, voff, vq);
    const __m256i c2 = avx2::encode8(_mm256_loadu_ps(x + i + 16), vz, vinv, voff, vq);
    const __m256i c3 = avx2::encode8(_mm256_loadu_ps(x + i + 24), vz, vinv, voff, vq);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + i), avx2::bytes32(c0, c1, c2, c3));
  }
  for (; i + 8 <= n; i += 8) {
    _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + i),
                     avx2::bytes8(avx2::encode8(_mm256_loadu_ps(x + i), vz, vinv, voff, vq)));
  }
#endif
  for (; i < n; ++i) codes[i] = uniform_encode(x[i], z, inv, off, qmax);
}

/// codes[i] = uniform_encode(x[i], z[i], inv[i], off, qmax) (per-element parameters).
inline void encode_run_vec(const float* x, const float* z, const float* inv, int64_t n, float off,
                           float qmax, uint8_t* codes) {
  int64_t i = 0;
#if KVQ_HAS_AVX512
  const __m512 voff = _mm512_set1_ps(off), vq = _mm512_set1_ps(qmax), v0 = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    __m512 v = _mm512_fmadd_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(z + i)),
                               _mm512_loadu_ps(inv + i), voff);
    v = _mm512_min_ps(_mm512_max_ps(v, v0), vq);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i),
                     _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v)));
  }
#elif KVQ_HAS_AVX2
  const __m256 voff = _mm256_set1_ps(off), vq = _mm256_set1_ps(qmax);
  auto enc = [&](int64_t k) {
    return avx2::encode8(_mm256_loadu_ps(x + k), _mm256_loadu_ps(z + k), _mm256_loadu_ps(inv + k),
                         voff, vq);
  };
  for (; i + 32 <= n; i += 32) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + i),
                        avx2::bytes32(enc(i), enc(i + 8), enc(i + 16), enc(i + 24)));
  }
  for (; i + 8 <= n; i += 8) {
    _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + i), avx2::bytes8(enc(i)));
  }
#endif
  for (; i < n; ++i) codes[i] = uniform_encode(x[i], z[i], inv[i], off, qmax);
}

/// out[i] = uniform_decode(codes[i], s, z, off) with one (s, z) for the run.
inline void decode_run(const uint8_t* codes, int64_t n, float s, float z, float off, float* out) {
  int64_t i = 0;
#if KVQ_HAS_AVX512
  const __m512 vs = _mm512_set1_ps(s), vz = _mm512_set1_ps(z), voff = _mm512_set1_ps(off);
  for (; i + 16 <= n; i += 16) {
    const __m512 c = _mm512_cvtepi32_ps(
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i))));
    _mm512_storeu_ps(out + i, _mm512_fmadd_ps(_mm512_sub_ps(c, voff), vs, vz));
  }
#elif KVQ_HAS_AVX2
  const __m256 vs = _mm256_set1_ps(s), vz = _mm256_set1_ps(z), voff = _mm256_set1_ps(off);
  for (; i + 8 <= n; i += 8) {
    const __m256 c = _mm256_cvtepi32_ps(
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i))));
    _mm256_storeu_ps(out + i, _mm256_fmadd_ps(_mm256_sub_ps(c, voff), vs, vz));
  }
#endif
  for (; i < n; ++i) out[i] = uniform_decode(codes[i], s, z, off);
}

/// out[i] = uniform_decode(codes[i], s[i], z[i], off) (per-element parameters).
inline void decode_run_vec(const uint8_t* codes, const float* s, const float* z, int64_t n,
                           float off, float* out) {
  int64_t i = 0;
#if KVQ_HAS_AVX512
  const __m512 voff = _mm512_set1_ps(off);
  for (; i + 16 <= n; i += 16) {
    const __m512 c = _mm512_cvtepi32_ps(
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i))));
    _mm512_storeu_ps(out + i, _mm512_fmadd_ps(_mm512_sub_ps(c, voff), _mm512_loadu_ps(s + i),
                                              _mm512_loadu_ps(z + i)));
  }
#elif KVQ_HAS_AVX2
  const __m256 voff = _mm256_set1_ps(off);
  for (; i + 8 <= n; i += 8) {
    const __m256 c = _mm256_cvtepi32_ps(
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i))));
    _mm256_storeu_ps(out + i, _mm256_fmadd_ps(_mm256_sub_ps(c, voff), _mm256_loadu_ps(s + i),
                                              _mm256_loadu_ps(z + i)));
  }
#endif
  for (; i < n; ++i) out[i] = uniform_decode(codes[i], s[i], z[i], off);
}

/// KVQ_ROW_TOKEN_KERNEL: 1 when quantize_row_token / uniform_params_array are compiled in
/// (AVX-512, or AVX2 with F16C), 0 otherwise.
#if KVQ_HAS_AVX512 || (KVQ_HAS_AVX2 && KVQ_HAS_F16C)
#define KVQ_ROW_TOKEN_KERNEL 1
#else
#define KVQ_ROW_TOKEN_KERNEL 0
#endif

#if KVQ_HAS_AVX2 && KVQ_HAS_F16C
/// Parameters of up to 8 groups at once (lane j = group j) from their minima L and maxima Hv,
/// bit for bit the scalar uniform_params (qdiv = qmax) and nuq_params (asymmetric, qdiv = 1):
/// the same IEEE operations in the same order, fp16 rounding (f16) by the same RNE conversion.
/// Asymmetric: Z = round_meta(L + 0), S = round_meta((Hv - Z) / qdiv), +0 unless that is > 0.
/// Symmetric: Z = 0, S = round_meta(m / -2^(bits - 1)) + 0, m = (Hv >= -L) ? Hv : L.
/// I = 1 / S, or 0 where S is 0 or 1 / S is infinite. Returns false when a lane below n has a
/// non-finite Z or S (the scalar function then throws, naming the group); lanes >= n are junk.
__attribute__((always_inline)) inline bool group_params8(__m256 L, __m256 Hv, int n,
                                                         bool symmetric, int bits, float qdiv,
                                                         bool f16, __m256& Z, __m256& S,
                                                         __m256& I) {
  const __m256 zero = _mm256_setzero_ps();
  auto round_meta8 = [f16](__m256 v) {
    return f16 ? _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))
               : v;
  };
  if (symmetric) {
    const __m256 ge = _mm256_cmp_ps(Hv, _mm256_sub_ps(zero, L), _CMP_GE_OQ);
    S = _mm256_add_ps(round_meta8(_mm256_div_ps(_mm256_blendv_ps(L, Hv, ge),
                                                _mm256_set1_ps(-static_cast<float>(1 << (bits - 1))))),
                      zero);
    Z = zero;
  } else {
    Z = round_meta8(_mm256_add_ps(L, zero));
    __m256 sv = _mm256_div_ps(_mm256_sub_ps(Hv, Z), _mm256_set1_ps(qdiv));
    sv = _mm256_and_ps(_mm256_cmp_ps(sv, zero, _CMP_GT_OQ), sv);  // !(s > 0) -> +0
    S = round_meta8(sv);
  }
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 inf8 = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  const __m256 ok = _mm256_and_ps(_mm256_cmp_ps(_mm256_and_ps(Z, abs_mask), inf8, _CMP_LT_OQ),
                                  _mm256_cmp_ps(_mm256_and_ps(S, abs_mask), inf8, _CMP_LT_OQ));
  if ((_mm256_movemask_ps(ok) & ((1 << n) - 1)) != (1 << n) - 1) return false;
  // Lanes with S == 0 divide by zero (inf, flag only: exceptions are masked) and are cleared.
  I = _mm256_and_ps(_mm256_cmp_ps(S, zero, _CMP_NEQ_OQ), _mm256_div_ps(_mm256_set1_ps(1.f), S));
  I = _mm256_and_ps(_mm256_cmp_ps(_mm256_and_ps(I, abs_mask), inf8, _CMP_LT_OQ), I);
  return true;
}

/// Stores the n <= 8 low lanes of v as metadata values (fp16 bits when f16, else f32) at dst.
inline void store_meta8(__m256 v, int n, bool f16, uint8_t* dst) {
  if (!f16) {
    if (n == 8) {
      _mm256_storeu_ps(reinterpret_cast<float*>(dst), v);
    } else {
      alignas(32) float tmp[8];
      _mm256_store_ps(tmp, v);
      std::memcpy(dst, tmp, static_cast<std::size_t>(n) * 4);
    }
    return;
  }
  const __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  switch (n) {
    case 8: _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), h); return;
    case 4: _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), h); return;
    case 2: {
      const auto w = static_cast<uint32_t>(_mm_cvtsi128_si32(h));
      std::memcpy(dst, &w, 4);
      return;
    }
    default: {
      alignas(16) uint16_t tmp[8];
      _mm_store_si128(reinterpret_cast<__m128i*>(tmp), h);
      std::memcpy(dst, tmp, static_cast<std::size_t>(n) * 2);
    }
  }
}

/// Minima and maxima of n <= 8 consecutive groups of gc channels (gc % 8 == 0) of row r into
/// lanes 0 .. n-1 of L and Hv (lanes >= n are junk). Returns false if a value is NaN or +-inf.
__attribute__((always_inline)) inline bool group_minmax8(const float* r, int64_t gc, int n,
                                                         __m256& L, __m256& Hv) {
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  L = _mm256_setzero_ps();
  Hv = _mm256_setzero_ps();
  __m256 bad = _mm256_setzero_ps();  // v - v: +0 for finite v, NaN otherwise
  for (int j = 0; j < n; ++j) {
    const float* g = r + j * gc;
    __m256 vlo = _mm256_loadu_ps(g), vhi = vlo;
    bad = _mm256_or_ps(bad, _mm256_sub_ps(vlo, vlo));
    for (int64_t k = 8; k < gc; k += 8) {
      const __m256 v = _mm256_loadu_ps(g + k);
      bad = _mm256_or_ps(bad, _mm256_sub_ps(v, v));
      vlo = _mm256_min_ps(vlo, v);
      vhi = _mm256_max_ps(vhi, v);
    }
    vlo = _mm256_min_ps(vlo, _mm256_permute2f128_ps(vlo, vlo, 0x01));
    vhi = _mm256_max_ps(vhi, _mm256_permute2f128_ps(vhi, vhi, 0x01));
    vlo = _mm256_min_ps(vlo, _mm256_permute_ps(vlo, 0x4E));
    vhi = _mm256_max_ps(vhi, _mm256_permute_ps(vhi, 0x4E));
    vlo = _mm256_min_ps(vlo, _mm256_permute_ps(vlo, 0xB1));
    vhi = _mm256_max_ps(vhi, _mm256_permute_ps(vhi, 0xB1));
    const __m256 lane = _mm256_castsi256_ps(_mm256_cmpeq_epi32(iota, _mm256_set1_epi32(j)));
    L = _mm256_blendv_ps(L, vlo, lane);
    Hv = _mm256_blendv_ps(Hv, vhi, lane);
  }
  const __m256i b = _mm256_castps_si256(bad);
  return _mm256_testz_si256(b, b) != 0;
}
#endif

#if KVQ_HAS_AVX512
/// uniform_params for up to 16 groups at once (lane j = group j, lanes outside m ignored): the
/// same IEEE operations in the same order as the scalar function, fp16 rounding by the same RNE
/// conversion, so the results are bit-identical. Stores the scales (and zero points unless
/// symmetric) of the lanes in m to meta_scale / meta_zero (fp16 bits or f32) and returns the
/// zero points and inverse scales in z / inv. Returns false, storing nothing, when a zero point
/// or scale is not finite (the caller's scalar path then throws the precise error).
inline bool uniform_params16(__m512 L, __m512 Hv, __mmask16 m, int bits, bool symmetric,
                             bool f16meta, float qmax, uint8_t* meta_scale, uint8_t* meta_zero,
                             __m512& z, __m512& inv) {
  const __m512 zero = _mm512_setzero_ps();
  constexpr int kRne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  auto round_meta_v = [&](__m512 v) {
    return f16meta ? _mm512_cvtph_ps(_mm512_cvtps_ph(v, kRne)) : v;
  };
  __m512 sc;
  z = zero;
  if (symmetric) {
    // m = (hi >= -lo) ? hi : lo; scale = round_meta(m / -2^(bits-1)) + 0
    const __mmask16 ge = _mm512_cmp_ps_mask(Hv, _mm512_sub_ps(zero, L), _CMP_GE_OQ);
    const __m512 mv = _mm512_mask_blend_ps(ge, L, Hv);
    sc = _mm512_add_ps(
        round_meta_v(_mm512_div_ps(mv, _mm512_set1_ps(-static_cast<float>(1 << (bits - 1))))),
        zero);
  } else {
    z = round_meta_v(_mm512_add_ps(L, zero));
    if (_mm512_mask_fpclass_ps_mask(m, z, 0x99)) return false;
    __m512 sv = _mm512_div_ps(_mm512_sub_ps(Hv, z), _mm512_set1_ps(qmax));
    sv = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(sv, zero, _CMP_GT_OQ), sv);  // !(s > 0) -> 0
    sc = round_meta_v(sv);
  }
  if (_mm512_mask_fpclass_ps_mask(m, sc, 0x99)) return false;
  const __mmask16 nz = _mm512_cmp_ps_mask(sc, zero, _CMP_NEQ_UQ);
  inv = _mm512_maskz_div_ps(nz, _mm512_set1_ps(1.0f), sc);
  inv = _mm512_mask_mov_ps(inv, _mm512_fpclass_ps_mask(inv, 0x99), zero);  // subnormal scale
  if (f16meta) {
    _mm256_mask_storeu_epi16(meta_scale, m, _mm512_cvtps_ph(sc, kRne));
    if (!symmetric) _mm256_mask_storeu_epi16(meta_zero, m, _mm512_cvtps_ph(z, kRne));
  } else {
    _mm512_mask_storeu_ps(meta_scale, m, sc);
    if (!symmetric) _mm512_mask_storeu_ps(meta_zero, m, z);
  }
  return true;
}

/// uniform_params for n groups whose minima and maxima are lo[0..n), hi[0..n): writes the
/// metadata of group k at meta_scale / meta_zero + k * meta_bytes, and zero points and inverse
/// scales to zv / iv. Same bits and the same false-on-error contract as uniform_params16; on
/// false, metadata of earlier groups may have been written (the caller rewrites or throws).
inline bool uniform_params_array(const float* lo, const float* hi, int64_t n, int bits,
                                 bool symmetric, bool f16meta, float qmax, uint8_t* meta_scale,
                                 uint8_t* meta_zero, float* zv, float* iv) {
  const int64_t mb = f16meta ? 2 : 4;
  for (int64_t k = 0; k < n; k += 16) {
    const int64_t left = n - k;
    const __mmask16 m = left >= 16 ? static_cast<__mmask16>(0xFFFF)
                                   : static_cast<__mmask16>((1u << left) - 1u);
    __m512 z, inv;
    if (!uniform_params16(_mm512_maskz_loadu_ps(m, lo + k), _mm512_maskz_loadu_ps(m, hi + k), m,
                          bits, symmetric, f16meta, qmax, meta_scale + k * mb,
                          symmetric ? nullptr : meta_zero + k * mb, z, inv))
      return false;
    _mm512_mask_storeu_ps(zv + k, m, z);
    _mm512_mask_storeu_ps(iv + k, m, inv);
  }
  return true;
}

/// Largest number of token-axis groups quantize_row_token handles in one row.
constexpr int64_t kRowTokenMaxGroups = 16;
/// Group sizes quantize_row_token handles are multiples of this.
constexpr int64_t kRowTokenGroupMultiple = 16;

/// Per-token integer groups of one contiguous f32 row, all groups of the row at once:
/// statistics, parameters (vectorized across the row's groups) and codes. Needs gc % 16 == 0
/// and D / gc <= kRowTokenMaxGroups. Bit-identical to uniform_params + encode_run per group
/// (the same IEEE operations in the same order; fp16 rounding by the same RNE conversion).
/// Writes the groups' scales (and zero points unless symmetric) to meta_scale / meta_zero as
/// fp16 or f32 values, and one code byte per value to `codes` — or, for 4-bit codes with
/// `packed4` set, the packed nibbles (LSB first, as pack_bits) to packed4. Returns false, having written
/// nothing, when a value is non-finite or a parameter does not fit the metadata type: the
/// caller then runs the scalar path, which throws the precise error.
inline bool quantize_row_token(const float* row, int64_t D, int64_t gc, int bits, bool symmetric,
                               bool f16meta, float off, float qmax, uint8_t* meta_scale,
                               uint8_t* meta_zero, uint8_t* codes, uint8_t* packed4 = nullptr) {
  const int ng = static_cast<int>(D / gc);
  // Group minima/maxima gathered in registers (lane j = group j): no scalar round trip through
  // memory, whose narrow stores would not forward to a vector load.
  auto all_min = [](__m512 v) {  // every lane = min over the 16 lanes
    v = _mm512_min_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));
    v = _mm512_min_ps(v, _mm512_shuffle_f32x4(v, v, 0xB1));
    v = _mm512_min_ps(v, _mm512_permute_ps(v, 0x4E));
    return _mm512_min_ps(v, _mm512_permute_ps(v, 0xB1));
  };
  auto all_max = [](__m512 v) {
    v = _mm512_max_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));
    v = _mm512_max_ps(v, _mm512_shuffle_f32x4(v, v, 0xB1));
    v = _mm512_max_ps(v, _mm512_permute_ps(v, 0x4E));
    return _mm512_max_ps(v, _mm512_permute_ps(v, 0xB1));
  };
  __m512 L = _mm512_setzero_ps(), Hv = _mm512_setzero_ps();
  __mmask16 bad = 0;
  for (int j = 0; j < ng; ++j) {
    const float* g = row + j * gc;
    __m512 vlo = _mm512_loadu_ps(g), vhi = vlo;
    bad |= _mm512_fpclass_ps_mask(vlo, 0x99);
    for (int64_t k = 16; k < gc; k += 16) {
      const __m512 v = _mm512_loadu_ps(g + k);
      bad |= _mm512_fpclass_ps_mask(v, 0x99);
      vlo = _mm512_min_ps(vlo, v);
      vhi = _mm512_max_ps(vhi, v);
    }
    const __mmask16 lane = static_cast<__mmask16>(1u << j);
    L = _mm512_mask_mov_ps(L, lane, all_min(vlo));
    Hv = _mm512_mask_mov_ps(Hv, lane, all_max(vhi));
  }
  if (bad) return false;
  const __mmask16 m = static_cast<__mmask16>((1u << ng) - 1u);
  __m512 z, inv;
  if (!uniform_params16(L, Hv, m, bits, symmetric, f16meta, qmax, meta_scale, meta_zero, z, inv))
    return false;
  const __m512 zero = _mm512_setzero_ps();
  const __m512 voff = _mm512_set1_ps(off), vq = _mm512_set1_ps(qmax);
  for (int j = 0; j < ng; ++j) {
    const __m512i lane = _mm512_set1_epi32(j);
    const __m512 vz = _mm512_permutexvar_ps(lane, z), vinv = _mm512_permutexvar_ps(lane, inv);
    for (int64_t k = 0; k < gc; k += 16) {
      const int64_t i = j * gc + k;
      __m512 v = _mm512_fmadd_ps(_mm512_sub_ps(_mm512_loadu_ps(row + i), vz), vinv, voff);
      v = _mm512_min_ps(_mm512_max_ps(v, zero), vq);
      const __m512i c = _mm512_cvtps_epi32(v);
      if (packed4 != nullptr) {
        // 64-bit lane = (code 2k) | (code 2k+1) << 32 -> byte (code 2k) | (code 2k+1) << 4
        const __m512i p = _mm512_or_si512(c, _mm512_srli_epi64(c, 28));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(packed4 + i / 2), _mm512_cvtepi64_epi8(p));
      } else {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i), _mm512_cvtepi32_epi8(c));
      }
    }
  }
  return true;
}
#elif KVQ_HAS_AVX2 && KVQ_HAS_F16C
/// The AVX2 twin of the AVX-512 uniform_params16: up to 8 groups at once (lane j = group j,
/// lanes >= n ignored), the same IEEE operations in the same order as uniform_params, fp16
/// rounding by the same RNE conversion, so bit-identical. Stores the n groups' scales (and zero
/// points unless symmetric) and returns zero points and inverse scales in z / inv. Returns
/// false, storing nothing, when a zero point or scale is not finite.
inline bool uniform_params8(__m256 L, __m256 Hv, int n, int bits, bool symmetric, bool f16meta,
                            float qmax, uint8_t* meta_scale, uint8_t* meta_zero, __m256& z,
                            __m256& inv) {
  __m256 sc;
  if (!group_params8(L, Hv, n, symmetric, bits, qmax, f16meta, z, sc, inv)) return false;
  store_meta8(sc, n, f16meta, meta_scale);
  if (!symmetric) store_meta8(z, n, f16meta, meta_zero);
  return true;
}

/// uniform_params for n groups whose minima and maxima are lo[0..n), hi[0..n) (AVX2 twin of
/// the AVX-512 function of the same name; same bits, same false-on-error contract).
inline bool uniform_params_array(const float* lo, const float* hi, int64_t n, int bits,
                                 bool symmetric, bool f16meta, float qmax, uint8_t* meta_scale,
                                 uint8_t* meta_zero, float* zv, float* iv) {
  const int64_t mb = f16meta ? 2 : 4;
  for (int64_t k = 0; k < n; k += 8) {
    const int cnt = n - k >= 8 ? 8 : static_cast<int>(n - k);
    const __m256i m = avx2::lanes_below(cnt);
    __m256 z, inv;
    if (!uniform_params8(_mm256_maskload_ps(lo + k, m), _mm256_maskload_ps(hi + k, m), cnt, bits,
                         symmetric, f16meta, qmax, meta_scale + k * mb,
                         symmetric ? nullptr : meta_zero + k * mb, z, inv))
      return false;
    _mm256_maskstore_ps(zv + k, m, z);
    _mm256_maskstore_ps(iv + k, m, inv);
  }
  return true;
}

/// Largest number of token-axis groups quantize_row_token handles in one row (AVX2: one lane
/// of a ymm register per group).
constexpr int64_t kRowTokenMaxGroups = 8;
/// Group sizes quantize_row_token handles are multiples of this.
constexpr int64_t kRowTokenGroupMultiple = 8;

/// Per-token integer groups of one contiguous f32 row, all groups of the row at once (AVX2 twin
/// of the AVX-512 kernel): statistics, parameters (vectorized across the row's groups) and
/// codes, bit-identical to uniform_params + encode_run per group. Needs gc % 8 == 0 and
/// D / gc <= 8. Writes metadata like uniform_params8 and one code byte per value to `codes`,
/// or for 4-bit codes with `packed4` set the packed nibbles (LSB first, as pack_bits). Returns
/// false, having written nothing, on a non-finite value or a parameter that does not fit the
/// metadata type: the caller's scalar path then throws the precise error.
inline bool quantize_row_token(const float* row, int64_t D, int64_t gc, int bits, bool symmetric,
                               bool f16meta, float off, float qmax, uint8_t* meta_scale,
                               uint8_t* meta_zero, uint8_t* codes, uint8_t* packed4 = nullptr) {
  const int ng = static_cast<int>(D / gc);
  // Group minima/maxima gathered in registers (lane j = group j), no round trip through memory.
  __m256 L, Hv;
  if (!group_minmax8(row, gc, ng, L, Hv)) return false;
  __m256 z, inv;
  if (!uniform_params8(L, Hv, ng, bits, symmetric, f16meta, qmax, meta_scale, meta_zero, z, inv))
    return false;
  const __m256 voff = _mm256_set1_ps(off), vq = _mm256_set1_ps(qmax);
  for (int j = 0; j < ng; ++j) {
    const __m256i lane = _mm256_set1_epi32(j);
    const __m256 vz = _mm256_permutevar8x32_ps(z, lane), vinv = _mm256_permutevar8x32_ps(inv, lane);
    auto enc = [&](int64_t i) {
      return avx2::encode8(_mm256_loadu_ps(row + i), vz, vinv, voff, vq);
    };
    int64_t k = 0;
    for (; k + 32 <= gc; k += 32) {
      const int64_t i = j * gc + k;
      const __m256i b = avx2::bytes32(enc(i), enc(i + 8), enc(i + 16), enc(i + 24));
      if (packed4 != nullptr) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(packed4 + i / 2), avx2::nibbles32(b));
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + i), b);
      }
    }
    for (; k < gc; k += 8) {
      const int64_t i = j * gc + k;
      const __m128i b = avx2::bytes8(enc(i));
      if (packed4 != nullptr) {
        avx2::store_u32(packed4 + i / 2, avx2::nibbles8(b));
      } else {
        _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + i), b);
      }
    }
  }
  return true;
}
#endif

/// decode_run / decode_run_vec writing fp16 bits (RNE, as store_row's conversion) straight to
/// `out`: no float round trip through a row buffer. `s`/`z` are per element when `vec`.
template <bool kVec>
inline void decode_run_f16(const uint8_t* codes, int64_t n, const float* s, const float* z,
                           float off, uint16_t* out) {
  if (n <= 0) return;  // s/z may be empty (null) for an empty run: read nothing
  int64_t i = 0;
#if KVQ_HAS_AVX512
  const __m512 voff = _mm512_set1_ps(off);
  const __m512 vs1 = _mm512_set1_ps(s[0]), vz1 = _mm512_set1_ps(z[0]);
  for (; i + 16 <= n; i += 16) {
    const __m512 c = _mm512_cvtepi32_ps(
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i))));
    const __m512 vs = kVec ? _mm512_loadu_ps(s + i) : vs1;
    const __m512 vz = kVec ? _mm512_loadu_ps(z + i) : vz1;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm512_cvtps_ph(_mm512_fmadd_ps(_mm512_sub_ps(c, voff), vs, vz),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
#elif KVQ_HAS_AVX2 && KVQ_HAS_F16C
  const __m256 voff = _mm256_set1_ps(off);
  const __m256 vs1 = _mm256_set1_ps(s[0]), vz1 = _mm256_set1_ps(z[0]);
  for (; i + 8 <= n; i += 8) {
    const __m256 c = _mm256_cvtepi32_ps(
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i))));
    const __m256 vs = kVec ? _mm256_loadu_ps(s + i) : vs1;
    const __m256 vz = kVec ? _mm256_loadu_ps(z + i) : vz1;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(_mm256_fmadd_ps(_mm256_sub_ps(c, voff), vs, vz),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
#endif
  for (; i < n; ++i)
    out[i] = float_to_half_bits_fast(uniform_decode(codes[i], kVec ? s[i] : s[0],
                                                    kVec ? z[i] : z[0], off));
}

#if KVQ_HAS_AVX2
/// Packs 32 codes (the bytes of b, in order, each < 2^B) LSB-first into exactly 4 * B bytes at
/// out: pairs by maddubs, quads by madd, then per-B byte gathering.
template <int B>
__attribute__((always_inline)) inline void pack32_store(__m256i b, uint8_t* out) {
  if constexpr (B == 8) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), b);
  } else if constexpr (B == 4) {
    const __m256i w = _mm256_maddubs_epi16(b, _mm256_set1_epi16(0x1001));  // c0 + 16 c1
    const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi16(w, w), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(p));
  } else {
    constexpr int kPair = B == 3 ? 0x0801 : 0x0401;          // c0 + 2^B c1
    constexpr int kQuad = B == 3 ? 0x00400001 : 0x00100001;  // w0 + 2^2B w1
    const __m256i d = _mm256_madd_epi16(_mm256_maddubs_epi16(b, _mm256_set1_epi16(kPair)),
                                        _mm256_set1_epi32(kQuad));  // 4 codes per dword
    if constexpr (B == 2) {  // the low byte of every dword
      const __m256i g = _mm256_shuffle_epi8(
          d, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8,
                              12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
      const __m256i p = _mm256_permutevar8x32_epi32(g, _mm256_setr_epi32(0, 4, 1, 1, 1, 1, 1, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(p));
    } else {  // B == 3: 24 bits per qword, then the low 3 bytes of each
      const __m256i q = _mm256_and_si256(_mm256_or_si256(d, _mm256_srli_epi64(d, 20)),
                                         _mm256_set1_epi64x(0xffffff));
      // the low lane's 6 bytes to bytes 0-5 of its half, the high lane's to bytes 6-11 of its
      // half: one OR of the halves holds the 12 bytes in order
      const __m256i g = _mm256_shuffle_epi8(
          q, _mm256_setr_epi8(0, 1, 2, 8, 9, 10, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                              -1, -1, -1, -1, 0, 1, 2, 8, 9, 10, -1, -1, -1, -1));
      const __m128i c = _mm_or_si128(_mm256_castsi256_si128(g), _mm256_extracti128_si256(g, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(out), c);
      const auto w1 = static_cast<uint32_t>(_mm_extract_epi32(c, 2));
      std::memcpy(out + 8, &w1, 4);
    }
  }
}

#endif

/// pack_bits with vectorized 2-, 3- and 4-bit paths for byte-aligned runs.
inline void pack_codes(const uint8_t* codes, std::size_t n, int bits, uint8_t* out,
                       std::size_t bit_offset) {
#if KVQ_HAS_AVX2
  if (bit_offset % 8 == 0 && bits == 3) {  // 32 codes into 12 bytes in registers
    uint8_t* o = out + bit_offset / 8;
    std::size_t i = 0;
    const __m256i m3 = _mm256_set1_epi8(7);
    for (; i + 32 <= n; i += 32, o += 12)
      pack32_store<3>(_mm256_and_si256(
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + i)), m3),
                      o);
    if (i < n) pack_bits(codes + i, n - i, bits, out, bit_offset + i * bits);
    return;
  }
#endif
#if KVQ_HAS_AVX512
  if (bit_offset % 8 == 0 && (bits == 4 || bits == 2)) {
    uint8_t* o = out + bit_offset / 8;
    std::size_t i = 0;
    if (bits == 4) {
      const __m512i m0 = _mm512_set1_epi16(0x0f), m1 = _mm512_set1_epi16(0xf0);
      for (; i + 64 <= n; i += 64, o += 32) {
        const __m512i w = _mm512_loadu_si512(codes + i);  // 32 lanes of (c0 | c1 << 8)
        const __m512i p = _mm512_or_si512(_mm512_and_si512(w, m0),
                                          _mm512_and_si512(_mm512_srli_epi16(w, 4), m1));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm512_cvtepi16_epi8(p));
      }
    } else {
      const __m512i m3 = _mm512_set1_epi32(0x3);
      for (; i + 64 <= n; i += 64, o += 16) {
        const __m512i w = _mm512_loadu_si512(codes + i);  // 16 lanes of c0..c3
        __m512i p = _mm512_and_si512(w, m3);
        p = _mm512_or_si512(p, _mm512_and_si512(_mm512_srli_epi32(w, 6), _mm512_set1_epi32(0xc)));
        p = _mm512_or_si512(p,
                            _mm512_and_si512(_mm512_srli_epi32(w, 12), _mm512_set1_epi32(0x30)));
        p = _mm512_or_si512(p,
                            _mm512_and_si512(_mm512_srli_epi32(w, 18), _mm512_set1_epi32(0xc0)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm512_cvtepi32_epi8(p));
      }
    }
    if (i < n) pack_bits(codes + i, n - i, bits, out, bit_offset + i * bits);
    return;
  }
#elif KVQ_HAS_AVX2
  if (bit_offset % 8 == 0 && (bits == 4 || bits == 2)) {
    uint8_t* o = out + bit_offset / 8;
    std::size_t i = 0;
    if (bits == 4) {
      for (; i + 32 <= n; i += 32, o += 16) {
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + i));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o), avx2::nibbles32(b));
      }
    } else {
      for (; i + 64 <= n; i += 64, o += 16) {
        const __m256i a = avx2::crumbs32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + i)));
        const __m256i b =
            avx2::crumbs32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + i + 32)));
        // dwords: a0-3 b0-3 | a4-7 b4-7 (bytes, after the two packs) -> a0-7 b0-7
        const __m256i w = _mm256_packs_epi32(a, b);
        const __m256i p = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(w, w),
                                                      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm256_castsi256_si128(p));
      }
    }
    if (i < n) pack_bits(codes + i, n - i, bits, out, bit_offset + i * bits);
    return;
  }
#endif
  pack_bits(codes, n, bits, out, bit_offset);
}

/// unpack_bits with vectorized 2- and 4-bit paths for byte-aligned runs, and 3-bit runs 8 codes
/// (3 bytes) at a time.
inline void unpack_codes(const uint8_t* in, std::size_t n, int bits, uint8_t* codes,
                         std::size_t bit_offset) {
  if (bits == 3 && bit_offset % 8 == 0) {
    const uint8_t* p = in + bit_offset / 8;
    std::size_t i = 0;
    for (; i + 8 <= n; i += 8, p += 3) {
      const uint32_t w = uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16;
#if defined(__BMI2__) && KVQ_HAS_AVX2
      // x86 (little-endian): byte j of the deposit is code j
      const uint64_t c = _pdep_u64(w, 0x0707070707070707ull);
      std::memcpy(codes + i, &c, 8);
#else
      for (int j = 0; j < 8; ++j) codes[i + j] = static_cast<uint8_t>((w >> (3 * j)) & 7u);
#endif
    }
    if (i < n) unpack_bits(in, n - i, bits, codes + i, bit_offset + i * bits);
    return;
  }
#if KVQ_HAS_AVX512
  if (bit_offset % 8 == 0 && (bits == 4 || bits == 2)) {
    const uint8_t* p = in + bit_offset / 8;
    std::size_t i = 0;
    if (bits == 4) {
      const __m512i m0 = _mm512_set1_epi16(0x0f);
      for (; i + 64 <= n; i += 64, p += 32) {
        const __m512i b =
            _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
        const __m512i w = _mm512_or_si512(_mm512_and_si512(b, m0),
                                          _mm512_slli_epi16(_mm512_srli_epi16(b, 4), 8));
        _mm512_storeu_si512(codes + i, w);
      }
    } else {
      const __m512i m3 = _mm512_set1_epi32(0x3);
      for (; i + 64 <= n; i += 64, p += 16) {
        const __m512i b =
            _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        __m512i w = _mm512_and_si512(b, m3);
        w = _mm512_or_si512(w, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(b, 2), m3), 8));
        w = _mm512_or_si512(w,
                            _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(b, 4), m3), 16));
        w = _mm512_or_si512(w, _mm512_slli_epi32(_mm512_srli_epi32(b, 6), 24));
        _mm512_storeu_si512(codes + i, w);
      }
    }
    if (i < n) unpack_bits(in, n - i, bits, codes + i, bit_offset + i * bits);
    return;
  }
#elif KVQ_HAS_AVX2
  if (bit_offset % 8 == 0 && (bits == 4 || bits == 2)) {
    const uint8_t* p = in + bit_offset / 8;
    std::size_t i = 0;
    if (bits == 4) {
      const __m256i m0 = _mm256_set1_epi16(0x0f);
      for (; i + 32 <= n; i += 32, p += 16) {
        const __m256i b =
            _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        const __m256i w = _mm256_or_si256(_mm256_and_si256(b, m0),
                                          _mm256_slli_epi16(_mm256_srli_epi16(b, 4), 8));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + i), w);
      }
    } else {
      const __m256i m3 = _mm256_set1_epi32(0x3);
      for (; i + 32 <= n; i += 32, p += 8) {
        const __m256i b =
            _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
        __m256i w = _mm256_and_si256(b, m3);
        w = _mm256_or_si256(w, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(b, 2), m3), 8));
        w = _mm256_or_si256(w,
                            _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(b, 4), m3), 16));
        w = _mm256_or_si256(w, _mm256_slli_epi32(_mm256_srli_epi32(b, 6), 24));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + i), w);
      }
    }
    if (i < n) unpack_bits(in, n - i, bits, codes + i, bit_offset + i * bits);
    return;
  }
#endif
  unpack_bits(in, n, bits, codes, bit_offset);
}

}  // namespace kvq::kernels
