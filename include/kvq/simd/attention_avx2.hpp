#pragma once
/// \file attention_avx2.hpp
/// Microkernels of the fused attention's all-heads tile loop (attention/cpu/attention_cpu.hpp,
/// Unit::run_tiles, head_dim a multiple of 16; pre-RoPE keys arrive as f32 rows): AVX2+FMA+F16C, and on
/// AVX-512 builds the same kernels over one 16-lane vector per 16 channels (V2, kWide). The
/// per-head and scalar paths keep the generic templates of that file.
///
/// Why they are shaped this way (measured on a 2-core AMD EPYC (Zen 3) VM, where one core runs
/// two 256-bit FMAs per cycle at 4 cycles latency and AVX2 has 16 vector registers):
///  - Every inner step loads 16 channels of one row (`ld2`: two 8-lane vectors), so one code
///    unpack serves two vectors (4-bit: 8 bytes, fp8: one 16-byte widening to fp16 lanes).
///  - Scores: RB query rows x TB tokens with RB * TB = 8 accumulators (8 independent FMA chains
///    saturate two FMA pipes at latency 4) plus the operands fit in 16 registers; the generic
///    kernel's 16 accumulators spilled. One horizontal-add tree turns the 8 sums into scores.
///  - Values: RB rows x JP channel pairs accumulated in registers over a block of kTokBlock
///    tokens, then written back: acc traffic is 2 x 8 vectors per 8 x kTokBlock FMAs, and a
///    block's rows stay in L1 (rows of one head are H*D*bytes apart, a power of two: a long
///    walk over them per channel chunk keeps hitting the same two L1 sets).
///  - Per-token group scales of values (int4/token/g32) are folded into the softmax weights
///    (w' = p s per token and group, zero points as one sum per row and group), so a code
///    costs one FMA per query row instead of a dequantizing FMA plus one per row.
#include <cstdint>
#include <cstring>

#include "kvq/config.hpp"
#include "kvq/simd/attention_simd.hpp"

#if KVQ_HAS_AVX2 && KVQ_HAS_F16C
namespace kvq {
namespace kernels {
namespace attn {
namespace avx2 {

using V = __m256;
#if KVQ_HAS_AVX512
/// AVX-512 builds: 16 consecutive channels in one 16-lane vector (the AVX2 build's vector a is
/// its low half, b its high half, so even/odd order and every layout below are the same). The
/// microkernels then issue half the loads, conversions and FMAs of the AVX2 build.
struct V2 {
  __m512 v;
};
/// True when V2 is one 16-lane vector.
constexpr bool kWide = true;
#else
/// Two vectors: 16 consecutive channels. Loaders return it by value (GCC keeps the kernels'
/// accumulators in registers then; with vectors passed by reference it spilled them).
struct V2 {
  V a, b;
};
constexpr bool kWide = false;
#endif

#if defined(__GNUC__)
#define KVQ_AVX2_INLINE inline __attribute__((always_inline))
#else
#define KVQ_AVX2_INLINE inline
#endif

/// Tokens per value block (accumulators stay in registers across them).
constexpr int64_t kTokBlock = 8;

/// True when ld2<L> returns its 16 channels in even/odd order: vector a holds channels
/// 16 jp + 0, 2, .., 14 and b channels 16 jp + 1, 3, .., 15 (4-bit codes: the queries and the
/// value accumulators are kept in that order instead, see to_eo() / from_eo()).
constexpr bool eo_order(Load L) { return L == Load::kU4 || L == Load::kLut4; }

/// x[0, D) in natural channel order -> out in even/odd order (per 16 channels), D % 16 == 0;
/// in place allowed.
inline void to_eo(const float* x, float* out, int64_t D) {
  for (int64_t j = 0; j < D; j += 16) {
    const V lo = _mm256_loadu_ps(x + j), hi = _mm256_loadu_ps(x + j + 8);
    const V e = _mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(2, 0, 2, 0));
    const V o = _mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(3, 1, 3, 1));
    _mm256_storeu_ps(out + j, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e), _MM_SHUFFLE(3, 1, 2, 0))));
    _mm256_storeu_ps(out + j + 8, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(o), _MM_SHUFFLE(3, 1, 2, 0))));
  }
}

/// Inverse of to_eo(); in place allowed.
inline void from_eo(const float* x, float* out, int64_t D) {
  for (int64_t j = 0; j < D; j += 16) {
    const V e = _mm256_loadu_ps(x + j), o = _mm256_loadu_ps(x + j + 8);
    const V l = _mm256_unpacklo_ps(e, o), h = _mm256_unpackhi_ps(e, o);
    _mm256_storeu_ps(out + j, _mm256_permute2f128_ps(l, h, 0x20));
    _mm256_storeu_ps(out + j + 8, _mm256_permute2f128_ps(l, h, 0x31));
  }
}

/// Channels [16 jp, 16 jp + 16) of one stored row as two vectors (unscaled, as Simd256's
/// loaders give them: raw values, integer codes, fp8 values times 2^-8 for e4m3, centroids),
/// in natural order, or in even/odd order when eo_order(L).
/// 16 fp8 bytes (e4m3 or e5m2) as 16 fp16 lanes (unscaled: e4m3 values come out times 2^-8):
/// e5m2 is the high byte of an fp16; e4m3 (sign, 4 exponent bits, 3 mantissa bits) is
/// (b & 0x80) << 8 | (b & 0x7f) << 7, i.e. b << 8 shifted right arithmetically by one with the
/// copied sign bit (bit 14) cleared.
template <Load L>
KVQ_AVX2_INLINE __m256i fp8_halves(const uint8_t* p) {
  const __m256i w =
      _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 8);
  if constexpr (L == Load::kE4M3)
    return _mm256_and_si256(_mm256_srai_epi16(w, 1), _mm256_set1_epi16(static_cast<short>(0xBFFF)));
  return w;
}

#if KVQ_HAS_AVX512
template <Load L>
KVQ_AVX2_INLINE V2 ld2(const uint8_t* row, int64_t jp, const float* lut) {
  (void)lut;
  __m512 x;
  if constexpr (L == Load::kF32) {
    x = _mm512_loadu_ps(reinterpret_cast<const float*>(row) + 16 * jp);
  } else if constexpr (L == Load::kF16) {
    x = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * jp)));
  } else if constexpr (L == Load::kBF16) {
    x = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * jp))), 16));
  } else if constexpr (L == Load::kU8 || L == Load::kLut8) {
    const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * jp)));
    if constexpr (L == Load::kU8) {
      x = _mm512_cvtepi32_ps(c);
    } else {  // codes < 16: one permute over the 16-entry table
      x = _mm512_permutexvar_ps(c, _mm512_loadu_ps(lut));
    }
  } else if constexpr (L == Load::kU4 || L == Load::kLut4) {
    // even/odd order: the 8 bytes twice, low nibbles in lanes 0-7, high nibbles in lanes 8-15
    int64_t w;
    std::memcpy(&w, row + 8 * jp, 8);
    const __m512i b = _mm512_cvtepu8_epi32(_mm_set1_epi64x(w));
    const __m512i c = _mm512_and_si512(
        _mm512_srlv_epi32(b, _mm512_set_epi32(4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0)),
        _mm512_set1_epi32(15));
    if constexpr (L == Load::kU4) {
      x = _mm512_cvtepi32_ps(c);
    } else {
      x = _mm512_permutexvar_ps(c, _mm512_loadu_ps(lut));
    }
  } else if constexpr (L == Load::kU2) {
    int32_t w;
    std::memcpy(&w, row + 4 * jp, 4);
    x = _mm512_cvtepi32_ps(_mm512_and_si512(
        _mm512_srlv_epi32(_mm512_set1_epi32(w), _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16,
                                                                 14, 12, 10, 8, 6, 4, 2, 0)),
        _mm512_set1_epi32(3)));
  } else if constexpr (L == Load::kE4M3 || L == Load::kE5M2) {
    x = _mm512_cvtph_ps(fp8_halves<L>(row + 16 * jp));
  }
  return V2{x};
}

/// x * s + z with one scale and zero point for all 16 channels.
KVQ_AVX2_INLINE V2 fma_bcast(V2 x, const float* s, const float* z) {
  return V2{_mm512_fmadd_ps(x.v, _mm512_set1_ps(*s), _mm512_set1_ps(*z))};
}
/// x * s[0, 16) + z[0, 16) channel by channel.
KVQ_AVX2_INLINE V2 fma_vec(V2 x, const float* s, const float* z) {
  return V2{_mm512_fmadd_ps(x.v, _mm512_loadu_ps(s), _mm512_loadu_ps(z))};
}
#else
template <Load L>
inline V2 ld2(const uint8_t* row, int64_t jp, const float* lut) {
  (void)lut;
  V a, b;
  if constexpr (L == Load::kF32) {
    const float* p = reinterpret_cast<const float*>(row) + 16 * jp;
    a = _mm256_loadu_ps(p);
    b = _mm256_loadu_ps(p + 8);
  } else if constexpr (L == Load::kF16) {
    const __m128i* p = reinterpret_cast<const __m128i*>(row + 32 * jp);
    a = _mm256_cvtph_ps(_mm_loadu_si128(p));
    b = _mm256_cvtph_ps(_mm_loadu_si128(p + 1));
  } else if constexpr (L == Load::kBF16) {
    const __m128i* p = reinterpret_cast<const __m128i*>(row + 32 * jp);
    a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(p)), 16));
    b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(p + 1)), 16));
  } else if constexpr (L == Load::kU8 || L == Load::kLut8) {
    const uint8_t* p = row + 16 * jp;
    const __m256i c0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i c1 =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
    if constexpr (L == Load::kU8) {
      a = _mm256_cvtepi32_ps(c0);
      b = _mm256_cvtepi32_ps(c1);
    } else {  // codes < 16 (Lloyd-Max tables have at most 16 centroids)
      a = Simd256::lut(c0, lut);
      b = Simd256::lut(c1, lut);
    }
  } else if constexpr (L == Load::kU4 || L == Load::kLut4) {
    // Even/odd order (see eo_order()): byte i holds channels 2i (low nibble) and 2i + 1, so
    // one widening gives both vectors with one mask and one shift (no interleave).
    const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8 * jp)));
    const __m256i c0 = _mm256_and_si256(x, _mm256_set1_epi32(15));
    const __m256i c1 = _mm256_srli_epi32(x, 4);
    if constexpr (L == Load::kU4) {
      a = _mm256_cvtepi32_ps(c0);
      b = _mm256_cvtepi32_ps(c1);
    } else {
      a = Simd256::lut(c0, lut);
      b = Simd256::lut(c1, lut);
    }
  } else if constexpr (L == Load::kU2) {
    int32_t w;
    std::memcpy(&w, row + 4 * jp, 4);
    const __m256i x = _mm256_set1_epi32(w);
    const __m256i m = _mm256_set1_epi32(3);
    a = _mm256_cvtepi32_ps(
        _mm256_and_si256(_mm256_srlv_epi32(x, _mm256_set_epi32(14, 12, 10, 8, 6, 4, 2, 0)), m));
    b = _mm256_cvtepi32_ps(_mm256_and_si256(
        _mm256_srlv_epi32(x, _mm256_set_epi32(30, 28, 26, 24, 22, 20, 18, 16)), m));
  } else if constexpr (L == Load::kE4M3 || L == Load::kE5M2) {
    const __m256i h = fp8_halves<L>(row + 16 * jp);
    a = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    b = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
  }
  return V2{a, b};
}

KVQ_AVX2_INLINE V2 fma_bcast(V2 x, const float* s, const float* z) {
  const V sv = _mm256_broadcast_ss(s), zv = _mm256_broadcast_ss(z);
  return V2{_mm256_fmadd_ps(x.a, sv, zv), _mm256_fmadd_ps(x.b, sv, zv)};
}
KVQ_AVX2_INLINE V2 fma_vec(V2 x, const float* s, const float* z) {
  return V2{_mm256_fmadd_ps(x.a, _mm256_loadu_ps(s), _mm256_loadu_ps(z)),
            _mm256_fmadd_ps(x.b, _mm256_loadu_ps(s + 8), _mm256_loadu_ps(z + 8))};
}
#endif

/// The 8 horizontal sums of v[0..7], in order, in one vector.
inline V hsum8(const V* v) {
  const V h01 = _mm256_hadd_ps(v[0], v[1]), h23 = _mm256_hadd_ps(v[2], v[3]);
  const V h45 = _mm256_hadd_ps(v[4], v[5]), h67 = _mm256_hadd_ps(v[6], v[7]);
  const V a = _mm256_hadd_ps(h01, h23), b = _mm256_hadd_ps(h45, h67);
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

#if KVQ_HAS_AVX512
/// Scores of TB tokens (t .. t+TB-1) x RB query rows: sc[r * ss + t + u] = q[r, :] . k(t + u, :).
/// kl(t, jp) returns channels [16 jp, 16 jp + 16) of token t. AVX-512: one FMA per row, token
/// and 16 channels; the keys of the TB tokens stay in registers (32 of them).
template <int RB, int TB, class KL>
KVQ_AVX2_INLINE void dot_blk(const KL& kl, int64_t t, int64_t njp, const float* q, int64_t D,
                             float* sc, int64_t ss) {
  __m512 acc[RB * TB];
  for (int i = 0; i < RB * TB; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t jp = 0; jp < njp; ++jp) {
    __m512 k[TB];
    for (int u = 0; u < TB; ++u) k[u] = kl(t + u, jp).v;
    for (int r = 0; r < RB; ++r) {
      const __m512 qv = _mm512_loadu_ps(q + r * D + 16 * jp);
      for (int u = 0; u < TB; ++u) acc[r * TB + u] = _mm512_fmadd_ps(qv, k[u], acc[r * TB + u]);
    }
  }
  if constexpr (RB * TB % 8 == 0) {
    for (int i0 = 0; i0 < RB * TB; i0 += 8) {
      V h[8];
      for (int i = 0; i < 8; ++i)
        h[i] = _mm256_add_ps(_mm512_castps512_ps256(acc[i0 + i]),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[i0 + i]), 1)));
      alignas(32) float s[8];
      _mm256_store_ps(s, hsum8(h));
      for (int i = 0; i < 8; ++i) sc[((i0 + i) / TB) * ss + t + (i0 + i) % TB] = s[i];
    }
  } else {
    for (int r = 0; r < RB; ++r)
      for (int u = 0; u < TB; ++u) sc[r * ss + t + u] = _mm512_reduce_add_ps(acc[r * TB + u]);
  }
}
#else
/// Scores of TB tokens (t .. t+TB-1) x RB query rows: sc[r * ss + t + u] = q[r, :] . k(t + u, :).
/// kl(t, jp) returns channels [16 jp, 16 jp + 16) of token t.
template <int RB, int TB, class KL>
KVQ_AVX2_INLINE void dot_blk(const KL& kl, int64_t t, int64_t njp, const float* q, int64_t D, float* sc,
                    int64_t ss) {
  V acc[RB * TB];
  for (int i = 0; i < RB * TB; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t jp = 0; jp < njp; ++jp) {
    if constexpr (TB <= 2) {
      // the tokens' 16 channels in registers (4 vectors), each query pair loaded once
      V2 k[TB];
      for (int u = 0; u < TB; ++u) k[u] = kl(t + u, jp);
      for (int r = 0; r < RB; ++r) {
        const V q0 = _mm256_loadu_ps(q + r * D + 16 * jp);
        const V q1 = _mm256_loadu_ps(q + r * D + 16 * jp + 8);
        for (int u = 0; u < TB; ++u) {
          acc[r * TB + u] = _mm256_fmadd_ps(q0, k[u].a, acc[r * TB + u]);
          acc[r * TB + u] = _mm256_fmadd_ps(q1, k[u].b, acc[r * TB + u]);
        }
      }
    } else {
      // one token's 16 channels at a time; queries come from L1 as memory operands
      for (int u = 0; u < TB; ++u) {
        const V2 k = kl(t + u, jp);
        for (int r = 0; r < RB; ++r) {
          acc[r * TB + u] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * D + 16 * jp), k.a,
                                            acc[r * TB + u]);
          acc[r * TB + u] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * D + 16 * jp + 8), k.b,
                                            acc[r * TB + u]);
        }
      }
    }
  }
  if constexpr (RB * TB == 8) {
    alignas(32) float s[8];
    _mm256_store_ps(s, hsum8(acc));
    for (int r = 0; r < RB; ++r)
      for (int u = 0; u < TB; ++u) sc[r * ss + t + u] = s[r * TB + u];
  } else {
    for (int r = 0; r < RB; ++r)
      for (int u = 0; u < TB; ++u) sc[r * ss + t + u] = Simd256::reduce(acc[r * TB + u]);
  }
}
#endif

template <int RB, int TB, class KL>
inline void dot_tok(const KL& kl, int64_t n, int64_t njp, const float* q, int64_t D, float* sc,
                    int64_t ss) {
  int64_t t = 0;
  for (; t + TB <= n; t += TB) dot_blk<RB, TB>(kl, t, njp, q, D, sc, ss);
  for (; t < n; ++t) dot_blk<RB, 1>(kl, t, njp, q, D, sc, ss);
}

/// sc[r * ss + t] = q[r, :] . k(t, :) for R query rows (stride D) and n tokens; D = 16 njp.
template <class KL>
inline void dot(const KL& kl, int64_t n, int64_t njp, const float* q, int64_t D, int64_t R,
                float* sc, int64_t ss) {
  int64_t r = 0;
  for (; r + 4 <= R; r += 4) dot_tok<4, 2>(kl, n, njp, q + r * D, D, sc + r * ss, ss);
  if (r + 2 <= R) {
    dot_tok<2, 4>(kl, n, njp, q + r * D, D, sc + r * ss, ss);
    r += 2;
  }
  if (r < R) dot_tok<1, 8>(kl, n, njp, q + r * D, D, sc + r * ss, ss);
}

#if KVQ_HAS_AVX512
/// acc[r, 16 jp0 .. 16 (jp0 + JP)) += sum_t w_r(t) v(t, ...) for RB rows and the tokens
/// [t0, t1) (at most kTokBlock), accumulated in registers (one 16-lane vector per row and 16
/// channels).
template <int RB, int JP, class VL>
KVQ_AVX2_INLINE void axpy_blk(const VL& vl, int64_t t0, int64_t t1, int64_t jp0, const float* w,
                              int64_t wr, float* acc, int64_t D) {
  __m512 a[RB * JP];
  for (int r = 0; r < RB; ++r)
    for (int p = 0; p < JP; ++p) a[r * JP + p] = _mm512_loadu_ps(acc + r * D + 16 * (jp0 + p));
  for (int64_t t = t0; t < t1; ++t) {
    __m512 v[JP];
    for (int p = 0; p < JP; ++p) v[p] = vl(t, jp0 + p).v;
    for (int r = 0; r < RB; ++r) {
      const __m512 wb = _mm512_set1_ps(w[r * wr + t]);
      for (int p = 0; p < JP; ++p) a[r * JP + p] = _mm512_fmadd_ps(wb, v[p], a[r * JP + p]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int p = 0; p < JP; ++p) _mm512_storeu_ps(acc + r * D + 16 * (jp0 + p), a[r * JP + p]);
}
#else
/// acc[r, 16 jp0 .. 16 (jp0 + JP)) += sum_t w_r(t) v(t, ...) for RB rows and the tokens
/// [t0, t1) (at most kTokBlock), accumulated in registers.
template <int RB, int JP, class VL>
KVQ_AVX2_INLINE void axpy_blk(const VL& vl, int64_t t0, int64_t t1, int64_t jp0, const float* w,
                              int64_t wr, float* acc, int64_t D) {
  constexpr int NA = RB * 2 * JP;
  V a[NA];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < 2 * JP; ++c) a[r * 2 * JP + c] = _mm256_loadu_ps(acc + r * D + 16 * jp0 + 8 * c);
  for (int64_t t = t0; t < t1; ++t) {
    if constexpr (RB * JP <= 4) {
      V2 v[JP];
      for (int p = 0; p < JP; ++p) v[p] = vl(t, jp0 + p);
      for (int r = 0; r < RB; ++r) {
        const V wb = _mm256_broadcast_ss(w + r * wr + t);
        for (int p = 0; p < JP; ++p) {
          a[r * 2 * JP + 2 * p] = _mm256_fmadd_ps(wb, v[p].a, a[r * 2 * JP + 2 * p]);
          a[r * 2 * JP + 2 * p + 1] = _mm256_fmadd_ps(wb, v[p].b, a[r * 2 * JP + 2 * p + 1]);
        }
      }
    } else {
      for (int p = 0; p < JP; ++p) {
        const V2 v = vl(t, jp0 + p);
        for (int r = 0; r < RB; ++r) {
          const V wb = _mm256_broadcast_ss(w + r * wr + t);
          a[r * 2 * JP + 2 * p] = _mm256_fmadd_ps(wb, v.a, a[r * 2 * JP + 2 * p]);
          a[r * 2 * JP + 2 * p + 1] = _mm256_fmadd_ps(wb, v.b, a[r * 2 * JP + 2 * p + 1]);
        }
      }
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < 2 * JP; ++c) _mm256_storeu_ps(acc + r * D + 16 * jp0 + 8 * c, a[r * 2 * JP + c]);
}
#endif

/// One block of tokens [t0, t1), every channel pair (a block's rows stay in L1 while all of
/// their channels are accumulated).
template <int RB, int JP, class VL>
inline void axpy_tokens(const VL& vl, int64_t t0, int64_t t1, int64_t njp, const float* w,
                        int64_t wr, int64_t wg, int64_t gc, float* acc, int64_t D) {
  int64_t jp = 0;
  if constexpr (JP > 1) {
    if (gc == 0 || gc % (16 * JP) == 0)
      for (; jp + JP <= njp; jp += JP)
        axpy_blk<RB, JP>(vl, t0, t1, jp, w + (gc ? 16 * jp / gc : 0) * wg, wr, acc, D);
  }
  for (; jp < njp; ++jp)
    axpy_blk<RB, 1>(vl, t0, t1, jp, w + (gc ? 16 * jp / gc : 0) * wg, wr, acc, D);
}

template <int RB, class VL>
inline void axpy_rows(const VL& vl, int64_t n, int64_t njp, const float* w, int64_t wr,
                      int64_t wg, int64_t gc, float* acc, int64_t D) {
  constexpr int JP = RB >= 4 ? 1 : RB == 2 ? 2 : 4;
  for (int64_t t0 = 0; t0 < n; t0 += kTokBlock)
    axpy_tokens<RB, JP>(vl, t0, t0 + kTokBlock < n ? t0 + kTokBlock : n, njp, w, wr, wg, gc, acc, D);
}

/// acc[r, :] += sum_t w[r * wr + g * wg + t] v(t, :) for R rows (acc stride D), n tokens, with
/// g the value group of the channel (groups of gc channels, gc a multiple of 16; gc = 0: one
/// group, g = 0).
template <class VL>
inline void axpy(const VL& vl, int64_t n, int64_t njp, const float* w, int64_t wr, int64_t wg,
                 int64_t gc, float* acc, int64_t D, int64_t R) {
  int64_t r = 0;
  for (; r + 4 <= R; r += 4) axpy_rows<4>(vl, n, njp, w + r * wr, wr, wg, gc, acc + r * D, D);
  if (r + 2 <= R) {
    axpy_rows<2>(vl, n, njp, w + r * wr, wr, wg, gc, acc + r * D, D);
    r += 2;
  }
  if (r < R) axpy_rows<1>(vl, n, njp, w + r * wr, wr, wg, gc, acc + r * D, D);
}

}  // namespace avx2
}  // namespace attn
}  // namespace kernels
}  // namespace kvq
#endif
