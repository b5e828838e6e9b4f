#pragma once
/// \file uniform_cpu.hpp
/// CPU kernels for grouped uniform integer quantization: group statistics, encode/decode of
/// contiguous runs, and 2/4-bit packing. AVX-512 when KVQ_HAS_AVX512, scalar otherwise; both
/// produce bits identical to reference/uniform_ref.hpp (tests compare them).
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "kvq/config.hpp"
#include "kvq/core/bitpack.hpp"
#include "kvq/core/half.hpp"
#include "kvq/format/uniform.hpp"
#include "kvq/kernels/cpu/prefetch.hpp"

namespace kvq::kernels {

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
#endif
  for (; i < n; ++i) out[i] = uniform_decode(codes[i], s[i], z[i], off);
}

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
#endif

/// decode_run / decode_run_vec writing fp16 bits (RNE, as store_row's conversion) straight to
/// `out`: no float round trip through a row buffer. `s`/`z` are per element when `vec`.
template <bool kVec>
inline void decode_run_f16(const uint8_t* codes, int64_t n, const float* s, const float* z,
                           float off, uint16_t* out) {
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
#endif
  for (; i < n; ++i)
    out[i] = float_to_half_bits_fast(uniform_decode(codes[i], kVec ? s[i] : s[0],
                                                    kVec ? z[i] : z[0], off));
}

/// pack_bits with vectorized 2- and 4-bit paths for byte-aligned runs.
inline void pack_codes(const uint8_t* codes, std::size_t n, int bits, uint8_t* out,
                       std::size_t bit_offset) {
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
#endif
  pack_bits(codes, n, bits, out, bit_offset);
}

/// unpack_bits with vectorized 2- and 4-bit paths for byte-aligned runs.
inline void unpack_codes(const uint8_t* in, std::size_t n, int bits, uint8_t* codes,
                         std::size_t bit_offset) {
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
#endif
  unpack_bits(in, n, bits, codes, bit_offset);
}

}  // namespace kvq::kernels
