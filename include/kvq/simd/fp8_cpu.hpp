#pragma once
/// \file fp8_cpu.hpp
/// Bulk FP8 conversions on the CPU: encode/decode spans of float or f16 with a scale.
///
/// Contract (checked bit for bit by tests/format/test_fp8*.cpp against the scalar functions and
/// against CUDA's cuda_fp8.h):
///   encode: dst[i] == fp8::encode(kind, x[i] * inv_scale, saturate), the product in fp32;
///   decode: dst[i] == fp8::decode(kind, c[i]) * scale in fp32 (for f16 output then rounded to
///           half with kvq::float_to_half_bits); NaN codes give the canonical NaN 0x7FFFFFFF.
/// (If scale itself is NaN every output is NaN; the NaN payload is then unspecified.)
///
/// SIMD paths (chosen at compile time, see config.hpp) and why they are exact:
///  - encode, normal results: integer round-to-nearest-even on the float bits with one added
///    constant that also rebiases the exponent (the same formula as the scalar code);
///  - encode, subnormal results: |x| + 2^(23+1-bias-mant) with round-to-nearest-even (embedded
///    rounding on AVX-512) rounds |x| to whole fp8 subnormal steps, which land in the low bits;
///  - overflow, saturation, inf and NaN: one clamp of |x| (vminps, which keeps a NaN) to
///    max_finite (saturating) or to the value of the overflow code (non-saturating: 480 for
///    e4m3, whose code is the NaN 0x7F; 65536 for e5m2, code 0x7C = inf); a NaN gives a code
///    above 255 which the unsigned-saturating packs turn into 0xFF, and the sign merge maps
///    0xFF to 0x7F, CUDA's sign-less NaN;
///  - decode: the code's bits moved into an fp16 (exact: e5m2 is the top byte of an fp16, e4m3
///    is an fp16 scaled by 2^-8), widened with vcvtph2ps, multiplied by scale (times 2^8 for
///    e4m3, exact) with one rounding; NaN lanes are then overwritten.
/// The SIMD encoders assume the default MXCSR round-to-nearest mode only in that the product
/// x * inv_scale is rounded by it, exactly like the scalar code; the AVX2 subnormal step also
/// uses it (AVX2 has no embedded rounding).
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kvq/config.hpp"
#include "kvq/core/half.hpp"
#include "kvq/format/fp8.hpp"
#include "kvq/simd/prefetch.hpp"

namespace kvq {
namespace detail {

/// Values per SIMD block; tails are run through the same block code via a padded buffer.
constexpr std::size_t kFp8Block = 64;

#if KVQ_HAS_AVX512 || KVQ_HAS_AVX2
/// Outputs at least this large are written with non-temporal (streaming) stores: they would not
/// stay in cache anyway, and streaming skips the read-for-ownership of every destination line,
/// which is a quarter to a half of the DRAM traffic of a decode. Smaller outputs (one head or
/// one group, consumed right away) keep ordinary cached stores.
constexpr std::size_t kFp8StreamMinBytes = std::size_t{4} << 20;

/// Elements to convert one by one before dst + k is 64-byte aligned; n if dst cannot be aligned
/// (not a multiple of its element size) or the output is too small to stream.
template <class T>
inline std::size_t fp8_stream_start(const T* dst, std::size_t n) {
  if (n * sizeof(T) < kFp8StreamMinBytes) return n;
  const std::size_t mis = reinterpret_cast<std::uintptr_t>(dst) & 63u;
  if (mis % sizeof(T) != 0) return n;
  const std::size_t k = ((64u - mis) & 63u) / sizeof(T);
  return k < n ? k : n;
}
#endif

/// float bits of the normal fp8 magnitude `code` (used for the clamp constants).
template <class F>
constexpr uint32_t fp8_code_value_bits(uint32_t code) {
  return (((code >> F::kMantBits) + 127u - F::kExpBias) << 23) |
         ((code & ((1u << F::kMantBits) - 1u)) << (23 - F::kMantBits));
}

/// |x| is clamped to this before rounding: max finite (saturating) or the value whose code is
/// the non-saturating overflow code (e4m3: 480 -> 0x7F; e5m2: 65536 -> 0x7C).
template <class F>
inline float fp8_clamp(bool saturate) {
  return bits_f32(fp8_code_value_bits<F>(saturate ? F::kMaxFiniteCode : F::kNoSatOverflowCode));
}

inline float fp8_load_scalar(float x) { return x; }
inline float fp8_load_scalar(f16 x) { return half_bits_to_float(x.bits); }

template <class F, class Src>
inline void fp8_encode_scalar(const Src* src, uint8_t* dst, std::size_t n, float inv_scale,
                              bool saturate) {
  for (std::size_t i = 0; i < n; ++i) {
    dst[i] = fp8_encode_bits<F>(fp8_load_scalar(src[i]) * inv_scale, saturate);
  }
}

template <class F>
inline float fp8_decode_one(uint8_t c) {
  return F::kHasInf ? fp8::decode_e5m2(c) : fp8::decode_e4m3(c);
}

inline void fp8_store_scalar(float* dst, float v) { *dst = v; }
inline void fp8_store_scalar(f16* dst, float v) { dst->bits = float_to_half_bits(v); }

template <class F, class Dst>
inline void fp8_decode_scalar(const uint8_t* src, Dst* dst, std::size_t n, float scale) {
  for (std::size_t i = 0; i < n; ++i) fp8_store_scalar(dst + i, fp8_decode_one<F>(src[i]) * scale);
}

#if defined(__GNUC__) && !defined(__clang__)
// GCC 12's AVX-512 intrinsics read a self-initialized _mm512_undefined_*() value, which trips
// -Wuninitialized at -O2 (GCC bug 105593, fixed in later releases). And when a caller's n is a
// small compile-time constant, -Warray-bounds looks into the (never entered) whole-block loop.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Warray-bounds"
#endif

#if KVQ_HAS_AVX512

inline __m512 fp8_load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 fp8_load16(const f16* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

/// AVX-512 (F/BW/VL/DQ) encoder: 64 values -> 64 codes per block, about 12 vector ops per 16.
template <class F>
struct Fp8EncodeAvx512 {
  __m512 clamp, min_normal, magic, inv_scale;
  __m512i abs_mask, round_rebias, lsb_bit, one, magic_bits, sign_bit, perm;

  Fp8EncodeAvx512(float inv, bool saturate)
      : clamp(_mm512_set1_ps(fp8_clamp<F>(saturate))),
        min_normal(_mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(F::kMinNormalBits)))),
        magic(_mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(F::kSubMagicBits)))),
        inv_scale(_mm512_set1_ps(inv)),
        abs_mask(_mm512_set1_epi32(0x7fffffff)),
        round_rebias(_mm512_set1_epi32(static_cast<int>(F::kRoundRebias))),
        lsb_bit(_mm512_set1_epi32(1 << F::kShift)),
        one(_mm512_set1_epi32(1)),
        magic_bits(_mm512_set1_epi32(static_cast<int>(F::kSubMagicBits))),
        sign_bit(_mm512_set1_epi8(static_cast<char>(0x80))),
        perm(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15)) {}

  /// Magnitude codes as int32: 0..max for numbers, > 255 for NaN.
  __m512i magnitude(__m512 p) const {
    // vminps returns its second operand when either is NaN, so a NaN |p| survives the clamp
    // (vrangeps would do abs and min in one op but returns the non-NaN operand).
    const __m512 ax = _mm512_min_ps(
        clamp, _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(p), abs_mask)));
    const __m512i axi = _mm512_castps_si512(ax);
    __m512i t = _mm512_add_epi32(axi, round_rebias);
    t = _mm512_mask_add_epi32(t, _mm512_test_epi32_mask(axi, lsb_bit), t, one);
    const __m512i code = _mm512_srli_epi32(t, F::kShift);
    const __mmask16 sub = _mm512_cmp_ps_mask(ax, min_normal, _CMP_LT_OQ);
    const __m512 y = _mm512_add_round_ps(ax, magic, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_mask_sub_epi32(code, sub, _mm512_castps_si512(y), magic_bits);
  }

  template <bool kStream>
  void block(__m512 p0, __m512 p1, __m512 p2, __m512 p3, uint8_t* dst) const {
    const __m512i c = _mm512_packus_epi16(_mm512_packus_epi32(magnitude(p0), magnitude(p1)),
                                          _mm512_packus_epi32(magnitude(p2), magnitude(p3)));
    // Signed saturating packs keep each value's sign in bit 7 of its byte.
    const __m512i s =
        _mm512_packs_epi16(_mm512_packs_epi32(_mm512_castps_si512(p0), _mm512_castps_si512(p1)),
                           _mm512_packs_epi32(_mm512_castps_si512(p2), _mm512_castps_si512(p3)));
    // bits 0..6 from c; bit 7 = s & ~c (a saturated 0xFF, i.e. NaN, becomes 0x7F).
    const __m512i r = _mm512_ternarylogic_epi32(c, s, sign_bit, 0x58);
    const __m512i out = _mm512_permutexvar_epi32(perm, r);
    if (kStream) {
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), out);  // dst is 64-byte aligned
    } else {
      _mm512_storeu_si512(dst, out);
    }
  }

  template <bool kScale, bool kStream, class Src>
  void run_block(const Src* src, uint8_t* dst) const {
    __m512 p0 = fp8_load16(src), p1 = fp8_load16(src + 16), p2 = fp8_load16(src + 32),
           p3 = fp8_load16(src + 48);
    if (kScale) {
      p0 = _mm512_mul_ps(p0, inv_scale);
      p1 = _mm512_mul_ps(p1, inv_scale);
      p2 = _mm512_mul_ps(p2, inv_scale);
      p3 = _mm512_mul_ps(p3, inv_scale);
    }
    block<kStream>(p0, p1, p2, p3, dst);
  }
};

/// AVX-512 decoder: 64 codes per block; codes become fp16 bits 32 at a time, then vcvtph2ps,
/// one multiply and the NaN fix-up 16 at a time.
template <class F>
struct Fp8DecodeAvx512 {
  __m512 mul, nan;
  __m512i low7, nan_min, e4m3_keep;

  explicit Fp8DecodeAvx512(float scale)
      : mul(_mm512_set1_ps(F::kHasInf ? scale : scale * 256.f)),
        nan(_mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff))),
        low7(_mm512_set1_epi8(0x7f)),
        nan_min(_mm512_set1_epi8(F::kHasInf ? 0x7d : 0x7f)),
        e4m3_keep(_mm512_set1_epi16(static_cast<short>(0xBFFF))) {}

  /// 32 codes -> 32 fp16 bit patterns (exact: e5m2 = the top byte of an fp16; e4m3 = an fp16
  /// times 2^8, its sign-extended byte << 7 puts the sign in bit 15 and the magnitude in bits
  /// 7..13, and bit 14 is cleared).
  __m512i half_bits(__m256i c) const {
    if (F::kHasInf) return _mm512_slli_epi16(_mm512_cvtepu8_epi16(c), 8);
    return _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(c), 7), e4m3_keep);
  }

  __m512 f32x16(__m256i h, __mmask16 is_nan) const {
    return _mm512_mask_mov_ps(_mm512_mul_ps(_mm512_cvtph_ps(h), mul), is_nan, nan);
  }

  // Streaming stores need 64 (float) or 32 (f16) byte alignment: the caller provides it.
  template <bool kStream>
  static void store16(float* dst, __m512 f) {
    if (kStream) {
      _mm512_stream_ps(dst, f);
    } else {
      _mm512_storeu_ps(dst, f);
    }
  }
  template <bool kStream>
  static void store16(f16* dst, __m512 f) {
    const __m256i h = _mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    if (kStream) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), h);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), h);
    }
  }

  template <bool kStream, class Dst>
  void block(const uint8_t* src, Dst* dst) const {
    const __m512i c = _mm512_loadu_si512(src);
    const __mmask64 is_nan = _mm512_cmpge_epu8_mask(_mm512_and_si512(c, low7), nan_min);
    for (int k = 0; k < 2; ++k) {
      const __m512i h =
          half_bits(k == 0 ? _mm512_castsi512_si256(c) : _mm512_extracti64x4_epi64(c, 1));
      const __mmask32 m = static_cast<__mmask32>(is_nan >> (32 * k));
      store16<kStream>(dst + 32 * k, f32x16(_mm512_castsi512_si256(h), static_cast<__mmask16>(m)));
      store16<kStream>(dst + 32 * k + 16,
                       f32x16(_mm512_extracti64x4_epi64(h, 1), static_cast<__mmask16>(m >> 16)));
    }
  }
};

#elif KVQ_HAS_AVX2

inline __m256 fp8_load8(const float* p) { return _mm256_loadu_ps(p); }
#if KVQ_HAS_F16C
inline __m256 fp8_load8(const f16* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif

/// AVX2 encoder: the same arithmetic as the AVX-512 one with blends instead of masks.
template <class F>
struct Fp8EncodeAvx2 {
  __m256 clamp, min_normal, magic, inv_scale, abs_mask;
  __m256i round_rebias, one, magic_bits, low7, bit7, perm;

  Fp8EncodeAvx2(float inv, bool saturate)
      : clamp(_mm256_set1_ps(fp8_clamp<F>(saturate))),
        min_normal(_mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(F::kMinNormalBits)))),
        magic(_mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(F::kSubMagicBits)))),
        inv_scale(_mm256_set1_ps(inv)),
        abs_mask(_mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))),
        round_rebias(_mm256_set1_epi32(static_cast<int>(F::kRoundRebias))),
        one(_mm256_set1_epi32(1)),
        magic_bits(_mm256_set1_epi32(static_cast<int>(F::kSubMagicBits))),
        low7(_mm256_set1_epi8(0x7f)),
        bit7(_mm256_set1_epi8(static_cast<char>(0x80))),
        perm(_mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)) {}

  __m256i magnitude(__m256 p) const {
    // vminps returns its second operand when either is NaN, so a NaN |p| survives the clamp.
    const __m256 ax = _mm256_min_ps(clamp, _mm256_and_ps(p, abs_mask));
    const __m256i axi = _mm256_castps_si256(ax);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(axi, F::kShift), one);
    const __m256i t = _mm256_add_epi32(_mm256_add_epi32(axi, round_rebias), lsb);
    const __m256i code = _mm256_srli_epi32(t, F::kShift);
    const __m256i sub = _mm256_castps_si256(_mm256_cmp_ps(ax, min_normal, _CMP_LT_OQ));
    const __m256i ycode =
        _mm256_sub_epi32(_mm256_castps_si256(_mm256_add_ps(ax, magic)), magic_bits);
    return _mm256_blendv_epi8(code, ycode, sub);
  }

  template <bool kStream>
  void block(__m256 p0, __m256 p1, __m256 p2, __m256 p3, uint8_t* dst) const {
    const __m256i c = _mm256_packus_epi16(_mm256_packus_epi32(magnitude(p0), magnitude(p1)),
                                          _mm256_packus_epi32(magnitude(p2), magnitude(p3)));
    const __m256i s =
        _mm256_packs_epi16(_mm256_packs_epi32(_mm256_castps_si256(p0), _mm256_castps_si256(p1)),
                           _mm256_packs_epi32(_mm256_castps_si256(p2), _mm256_castps_si256(p3)));
    const __m256i r = _mm256_or_si256(_mm256_and_si256(c, low7),
                                      _mm256_and_si256(_mm256_andnot_si256(c, s), bit7));
    const __m256i out = _mm256_permutevar8x32_epi32(r, perm);
    if (kStream) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), out);  // dst is 32-byte aligned
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), out);
    }
  }

  template <bool kScale, bool kStream, class Src>
  void run_block(const Src* src, uint8_t* dst) const {
    for (int k = 0; k < 2; ++k) {
      __m256 p0 = fp8_load8(src + 32 * k), p1 = fp8_load8(src + 32 * k + 8),
             p2 = fp8_load8(src + 32 * k + 16), p3 = fp8_load8(src + 32 * k + 24);
      if (kScale) {
        p0 = _mm256_mul_ps(p0, inv_scale);
        p1 = _mm256_mul_ps(p1, inv_scale);
        p2 = _mm256_mul_ps(p2, inv_scale);
        p3 = _mm256_mul_ps(p3, inv_scale);
      }
      block<kStream>(p0, p1, p2, p3, dst + 32 * k);
    }
  }
};

#if KVQ_HAS_F16C
/// AVX2 + F16C decoder: 8 codes -> 8 floats.
template <class F>
struct Fp8DecodeAvx2 {
  __m256 mul, nan;
  __m128i e4m3_keep, low7, nan_above;

  explicit Fp8DecodeAvx2(float scale)
      : mul(_mm256_set1_ps(F::kHasInf ? scale : scale * 256.f)),
        nan(_mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))),
        e4m3_keep(_mm_set1_epi16(static_cast<short>(0xBFFF))),
        low7(_mm_set1_epi8(0x7f)),
        nan_above(_mm_set1_epi8(F::kHasInf ? 0x7c : 0x7e)) {}

  __m256 f32x8(const uint8_t* src) const {
    const __m128i c = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src));
    __m128i h;
    if (F::kHasInf) {
      h = _mm_slli_epi16(_mm_cvtepu8_epi16(c), 8);
    } else {
      h = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(c), 7), e4m3_keep);
    }
    const __m256 f = _mm256_mul_ps(_mm256_cvtph_ps(h), mul);
    // magnitudes are <= 0x7F, so a signed byte compare is an unsigned one here
    const __m128i is_nan = _mm_cmpgt_epi8(_mm_and_si128(c, low7), nan_above);
    return _mm256_blendv_ps(f, nan, _mm256_castsi256_ps(_mm256_cvtepi8_epi32(is_nan)));
  }

  template <bool kStream>
  void block(const uint8_t* src, float* dst) const {
    for (int k = 0; k < 8; ++k) {
      if (kStream) {
        _mm256_stream_ps(dst + 8 * k, f32x8(src + 8 * k));
      } else {
        _mm256_storeu_ps(dst + 8 * k, f32x8(src + 8 * k));
      }
    }
  }
  template <bool kStream>
  void block(const uint8_t* src, f16* dst) const {
    for (int k = 0; k < 8; ++k) {
      const __m128i h =
          _mm256_cvtps_ph(f32x8(src + 8 * k), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      if (kStream) {
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 8 * k), h);
      } else {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 8 * k), h);
      }
    }
  }
};
#endif  // KVQ_HAS_F16C

#endif  // KVQ_HAS_AVX512 / KVQ_HAS_AVX2

#if KVQ_HAS_AVX512
#define KVQ_FP8_SIMD_ENCODE_F32 1
#define KVQ_FP8_SIMD_ENCODE_F16 1
#define KVQ_FP8_SIMD_DECODE 1
template <class F>
using Fp8Encoder = Fp8EncodeAvx512<F>;
template <class F>
using Fp8Decoder = Fp8DecodeAvx512<F>;
#elif KVQ_HAS_AVX2
#define KVQ_FP8_SIMD_ENCODE_F32 1
#define KVQ_FP8_SIMD_ENCODE_F16 KVQ_HAS_F16C
#define KVQ_FP8_SIMD_DECODE KVQ_HAS_F16C
template <class F>
using Fp8Encoder = Fp8EncodeAvx2<F>;
#if KVQ_HAS_F16C
template <class F>
using Fp8Decoder = Fp8DecodeAvx2<F>;
#endif
#else
#define KVQ_FP8_SIMD_ENCODE_F32 0
#define KVQ_FP8_SIMD_ENCODE_F16 0
#define KVQ_FP8_SIMD_DECODE 0
#endif

#if KVQ_FP8_SIMD_ENCODE_F32
/// Whole blocks with the SIMD encoder, the tail through the same code on a zero-padded copy.
/// Large outputs: a scalar head up to 64-byte alignment, then blocks with streaming stores.
template <class F, bool kScale, class Src>
inline void fp8_encode_simd(const Src* src, uint8_t* dst, std::size_t n, float inv_scale,
                            bool saturate) {
  const Fp8Encoder<F> enc(inv_scale, saturate);
  std::size_t i = fp8_stream_start(dst, n);
  if (i < n) {
    fp8_encode_scalar<F>(src, dst, i, inv_scale, saturate);
    for (; i + kFp8Block <= n; i += kFp8Block) {
      kernels::prefetch_ahead(src + i, kFp8Block * sizeof(Src));
      enc.template run_block<kScale, true>(src + i, dst + i);
    }
    _mm_sfence();
  } else {
    i = 0;
  }
  for (; i + kFp8Block <= n; i += kFp8Block) {
    enc.template run_block<kScale, false>(src + i, dst + i);
  }
  if (i < n) {
    Src in[kFp8Block] = {};
    uint8_t out[kFp8Block];
    std::memcpy(in, src + i, (n - i) * sizeof(Src));
    enc.template run_block<kScale, false>(in, out);
    std::memcpy(dst + i, out, n - i);
  }
}
#endif

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

template <class F, class Src>
inline void fp8_encode_span(const Src* src, uint8_t* dst, std::size_t n, float inv_scale,
                            bool saturate) {
#if KVQ_FP8_SIMD_ENCODE_F32
  constexpr bool kSimd = sizeof(Src) == 4 || KVQ_FP8_SIMD_ENCODE_F16;
  if constexpr (kSimd) {
    // x * 1.0f == x for every non-signalling input, and every NaN encodes alike: skip the mul.
    if (inv_scale == 1.f) {
      fp8_encode_simd<F, false>(src, dst, n, inv_scale, saturate);
    } else {
      fp8_encode_simd<F, true>(src, dst, n, inv_scale, saturate);
    }
    return;
  }
#endif
  fp8_encode_scalar<F>(src, dst, n, inv_scale, saturate);
}

template <class F, class Dst>
inline void fp8_decode_span(const uint8_t* src, Dst* dst, std::size_t n, float scale) {
#if KVQ_FP8_SIMD_DECODE
  // e4m3 lanes hold decode(c) * 2^-8, so the SIMD path multiplies by scale * 2^8 (exact, the
  // same single rounding) unless that overflows; such huge scales take the scalar loop.
  const bool scale_finite = (f32_bits(scale) & 0x7fffffffu) < 0x7f800000u;
  const bool scaled_finite = (f32_bits(scale * 256.f) & 0x7fffffffu) < 0x7f800000u;
  const bool fold_ok = F::kHasInf || scaled_finite || !scale_finite;
  if (fold_ok) {
    const Fp8Decoder<F> dec(scale);
    std::size_t i = fp8_stream_start(dst, n);
    if (i < n) {  // large output: scalar head up to 64-byte alignment, then streaming stores
      fp8_decode_scalar<F>(src, dst, i, scale);
      for (; i + kFp8Block <= n; i += kFp8Block) {
        kernels::prefetch_ahead(src + i, kFp8Block);
        dec.template block<true>(src + i, dst + i);
      }
      _mm_sfence();
    } else {
      i = 0;
    }
    for (; i + kFp8Block <= n; i += kFp8Block) dec.template block<false>(src + i, dst + i);
    if (i < n) {
      uint8_t in[kFp8Block] = {};
      Dst out[kFp8Block];
      std::memcpy(in, src + i, n - i);
      dec.template block<false>(in, out);
      std::memcpy(dst + i, out, (n - i) * sizeof(Dst));
    }
    return;
  }
#endif
  fp8_decode_scalar<F>(src, dst, n, scale);
}

}  // namespace detail

namespace fp8 {

/// dst[i] = encode(kind, src[i] * inv_scale, saturate) for i < n, bit for bit (the product is
/// rounded to fp32 once). Use inv_scale = 1 / compute_scale(kind, amax).
inline void encode(Fp8Kind kind, const float* src, uint8_t* dst, std::size_t n,
                   float inv_scale = 1.f, bool saturate = true) {
  if (kind == Fp8Kind::kE4M3) {
    detail::fp8_encode_span<detail::E4M3Format>(src, dst, n, inv_scale, saturate);
  } else {
    detail::fp8_encode_span<detail::E5M2Format>(src, dst, n, inv_scale, saturate);
  }
}

/// dst[i] = encode(kind, float(src[i]) * inv_scale, saturate) for i < n (fp16 input).
inline void encode(Fp8Kind kind, const f16* src, uint8_t* dst, std::size_t n, float inv_scale = 1.f,
                   bool saturate = true) {
  if (kind == Fp8Kind::kE4M3) {
    detail::fp8_encode_span<detail::E4M3Format>(src, dst, n, inv_scale, saturate);
  } else {
    detail::fp8_encode_span<detail::E5M2Format>(src, dst, n, inv_scale, saturate);
  }
}

/// dst[i] = decode(kind, src[i]) * scale for i < n (fp32, one rounding).
inline void decode(Fp8Kind kind, const uint8_t* src, float* dst, std::size_t n, float scale = 1.f) {
  if (kind == Fp8Kind::kE4M3) {
    detail::fp8_decode_span<detail::E4M3Format>(src, dst, n, scale);
  } else {
    detail::fp8_decode_span<detail::E5M2Format>(src, dst, n, scale);
  }
}

/// dst[i] = half(decode(kind, src[i]) * scale) for i < n: the fp32 product rounded to fp16
/// (nearest even, overflow -> inf) as kvq::float_to_half_bits does.
inline void decode(Fp8Kind kind, const uint8_t* src, f16* dst, std::size_t n, float scale = 1.f) {
  if (kind == Fp8Kind::kE4M3) {
    detail::fp8_decode_span<detail::E4M3Format>(src, dst, n, scale);
  } else {
    detail::fp8_decode_span<detail::E5M2Format>(src, dst, n, scale);
  }
}

}  // namespace fp8
}  // namespace kvq
