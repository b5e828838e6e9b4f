#pragma once
/// \file nuq_quant.hpp
/// nuq<b> quantizer (fast path): the grouped driver of quant/grouped_quant.hpp with a codec
/// that normalizes each group like the asymmetric int formats (zero = min, scale = max - min,
/// both rounded to the metadata type) and encodes u = (x - zero) * inv with the layer's learned
/// codebook (format/nuq.hpp). Same metadata regions as asymmetric int (one scale and one zero
/// per group box) and the same b-bit bitstream; the codebook itself is per-layer metadata in
/// the config. reference/nuq_ref.hpp is the scalar oracle (identical bytes). Encoding counts the
/// thresholds <= u, 16 lanes (AVX-512) or 8 (AVX2) at a time, scalar otherwise. With AVX2 + F16C
/// the token axis (groups a multiple of 8 channels) runs one vector at a time
/// (quantize_nuq_rows): group ranges and parameters 8 groups at a time in registers, codes found
/// by a binary search over the thresholds (NuqSearch8) and packed 32 at a time.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kvq/config.hpp"
#include "kvq/format/codebook.hpp"
#include "kvq/format/meta.hpp"
#include "kvq/format/nuq.hpp"
#include "kvq/simd/prefetch.hpp"
#include "kvq/quant/grouped_quant.hpp"

#if KVQ_HAS_AVX512
#include <immintrin.h>
#endif

namespace kvq {

namespace detail {

/// Throws kInvalidArgument unless `c` is a nuq config with a calibrated, valid codebook.
inline void require_nuq_codebook(const QuantConfig& c) {
  KVQ_REQUIRE(c.format == Format::kNuq, kInvalidArgument, "nuq quantizer needs a nuq config");
  check_nuq_bits(c.bits);
  KVQ_REQUIRE(c.nuq_ready, kInvalidArgument, c.name(),
              " needs a calibrated codebook: run kvq::calibrate (policy/calibrate.hpp) or load "
              "a calibration file (tools: --calibrate PATH)");
  check_nuq_levels(c.nuq_levels.data(), c.bits, "nuq codebook of the config");
}

/// nuq normalization parameters of a group [lo, hi] (shared with the oracle and calibration).
inline UniformParams nuq_params(float lo, float hi, MetaDType meta, int64_t g) {
  UniformParams p;
  p.zero = round_meta(meta, lo + 0.0f);
  KVQ_REQUIRE(std::isfinite(p.zero), kOutOfRange, "zero point of group ", g, " (min ", lo,
              ") overflows ", to_string(meta), " metadata; use f32 metadata");
  float s = hi - p.zero;
  if (!(s > 0.f)) s = 0.f;
  p.scale = round_meta(meta, s);
  KVQ_REQUIRE(std::isfinite(p.scale), kOutOfRange, "scale of group ", g, " (range [", lo, ", ",
              hi, "]) overflows ", to_string(meta), " metadata; use f32 metadata");
  p.inv = p.scale != 0.f ? 1.0f / p.scale : 0.f;
  if (!std::isfinite(p.inv)) p.inv = 0.f;
  return p;
}

struct NuqCodec {
  int bits;
  MetaDType meta;
  float lv[kNuqMaxLevels];
  float thr[kNuqMaxLevels];
  explicit NuqCodec(const QuantConfig& c) : bits(c.bits), meta(c.meta), lv{}, thr{} {
    require_nuq_codebook(c);
    for (int i = 0; i < (1 << bits); ++i) lv[i] = c.nuq_levels[static_cast<std::size_t>(i)];
    nuq_thresholds(lv, 1 << bits, thr);
  }
  bool has_zero() const { return true; }
  UniformParams params(float lo, float hi, int64_t g) const { return nuq_params(lo, hi, meta, g); }
  void encode(const float* x, int64_t n, float z, float inv, uint8_t* c) const {
    int64_t i = 0;
#if KVQ_HAS_AVX512
    // 16 lanes: u = (x - z) * inv, code = number of thresholds <= u (the binary search's
    // answer for ascending thresholds; NaN compares false, as in codebook_encode).
    const int nthr = (1 << bits) - 1;
    const __m512 zv = _mm512_set1_ps(z), iv = _mm512_set1_ps(inv);
    const __m512i one = _mm512_set1_epi32(1);
    for (; i + 16 <= n; i += 16) {
      const __m512 u = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), zv), iv);
      __m512i code = _mm512_setzero_si512();
      for (int j = 0; j < nthr; ++j)
        code = _mm512_mask_add_epi32(
            code, _mm512_cmp_ps_mask(u, _mm512_set1_ps(thr[j]), _CMP_GE_OQ), code, one);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(c + i), _mm512_cvtepi32_epi8(code));
    }
#elif KVQ_HAS_AVX2
    // 8 lanes, the same count: a true compare is -1, so subtracting it adds 1.
    const int nthr = (1 << bits) - 1;
    const __m256 zv = _mm256_set1_ps(z), iv = _mm256_set1_ps(inv);
    for (; i + 8 <= n; i += 8) {
      const __m256 u = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), zv), iv);
      __m256i code = _mm256_setzero_si256();
      for (int j = 0; j < nthr; ++j)
        code = _mm256_sub_epi32(
            code, _mm256_castps_si256(_mm256_cmp_ps(u, _mm256_set1_ps(thr[j]), _CMP_GE_OQ)));
      const __m128i w =
          _mm_packs_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(c + i), _mm_packus_epi16(w, w));
    }
#endif
    for (; i < n; ++i) c[i] = codebook_encode(thr, bits, (x[i] - z) * inv);
  }
  void encode_vec(const float* x, const float* z, const float* inv, int64_t n, uint8_t* c) const {
    for (int64_t i = 0; i < n; ++i) c[i] = codebook_encode(thr, bits, (x[i] - z[i]) * inv[i]);
  }
  void decode(const uint8_t* c, int64_t n, float s, float z, float* out) const {
    const int mask = (1 << bits) - 1;
    for (int64_t i = 0; i < n; ++i) out[i] = std::fma(s, lv[c[i] & mask], z);
  }
  void decode_vec(const uint8_t* c, const float* s, const float* z, int64_t n, float* out) const {
    const int mask = (1 << bits) - 1;
    for (int64_t i = 0; i < n; ++i) out[i] = std::fma(s[i], lv[c[i] & mask], z[i]);
  }
};

#if KVQ_HAS_AVX2
/// Appends chunks of w = 8 * bits bits to a byte stream as little-endian 64-bit words (x86).
struct ChunkWriter {
  uint8_t* out;
  int w;
  uint64_t acc = 0;
  int n = 0;  // bits pending in acc
  void put(uint64_t p) {
    acc |= p << n;
    n += w;
    if (n >= 64) {
      std::memcpy(out, &acc, 8);
      out += 8;
      n -= 64;
      acc = n > 0 ? p >> (w - n) : 0;
    }
  }
  void flush() { std::memcpy(out, &acc, static_cast<std::size_t>(n / 8)); }  // n % 8 == 0
};

/// 8 codes held in 32-bit lanes as the 8 bytes of a word.
inline uint64_t codes8_word(__m256i c) {
  const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
  return static_cast<uint64_t>(_mm_cvtsi128_si64(_mm_packus_epi16(w, w)));
}

using kernels::pack32_store;  // simd/uniform_cpu.hpp

/// Writes the D codes of one row (D % 8 == 0), B bits each, to out: codes8(i) returns codes
/// i .. i + 7 in the 32-bit lanes of a vector. 32 codes at a time are narrowed to bytes and
/// packed in registers (pack32_store); a tail of 8-code chunks goes through ChunkWriter.
template <int B, class Codes8>
inline void write_row_codes(int64_t D, uint8_t* out, Codes8&& codes8) {
  int64_t i = 0;
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (; i + 32 <= D; i += 32, out += 4 * B) {
    const __m256i a = _mm256_packs_epi32(codes8(i), codes8(i + 8));        // 0-3 8-11 | 4-7 12-15
    const __m256i c = _mm256_packs_epi32(codes8(i + 16), codes8(i + 24));  // 16-19 24-27 | ...
    pack32_store<B>(_mm256_permutevar8x32_epi32(_mm256_packus_epi16(a, c), order), out);
  }
  if (i < D) {
    ChunkWriter cw{out, 8 * B};
    for (; i < D; i += 8) cw.put(pack8_codes(codes8_word(codes8(i)), B));
    cw.flush();
  }
}
template <class Codes8>
inline void write_row_codes(int bits, int64_t D, uint8_t* out, Codes8&& codes8) {
  switch (bits) {
    case 2: return write_row_codes<2>(D, out, codes8);
    case 3: return write_row_codes<3>(D, out, codes8);
    case 4: return write_row_codes<4>(D, out, codes8);
    default: return write_row_codes<8>(D, out, codes8);
  }
}

/// The nuq codes of x[0..8) (32-bit lanes): the number of thresholds <= (x - z) * inv.
__attribute__((always_inline)) inline __m256i nuq_codes8(const float* x, __m256 z, __m256 inv, const __m256* thr, int nthr) {
  const __m256 u = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x), z), inv);
  __m256i code = _mm256_setzero_si256();
  for (int j = 0; j < nthr; ++j)
    code = _mm256_sub_epi32(code, _mm256_castps_si256(_mm256_cmp_ps(u, thr[j], _CMP_GE_OQ)));
  return code;
}

/// The nuq code of 8 values u at once for B-bit codes: the number of the 2^B - 1 thresholds
/// <= u, as codebook_encode (NaN compares false: code 0). B = 2 counts the 3 compares; B = 3
/// and 4 binary-search the ascending thresholds (3 or 4 compares instead of 7 or 15): the
/// first threshold is a broadcast, the second a blend of two broadcasts by the first answer,
/// the rest are looked up by vpermps in the thresholds held in lanes (lo: 0-7, hi: 8-14).
template <int B>
struct NuqSearch8 {
  static constexpr int kThr = (1 << B) - 1;
  __m256 thr[kThr];  // thr[j] in every lane
  __m256 lo, hi;
  explicit NuqSearch8(const float* t) {
    for (int j = 0; j < kThr; ++j) thr[j] = _mm256_set1_ps(t[j]);
    alignas(32) float lanes[16];
    for (int j = 0; j < 16; ++j) lanes[j] = j < kThr ? t[j] : INFINITY;
    lo = _mm256_load_ps(lanes);
    hi = _mm256_load_ps(lanes + 8);
  }
  __attribute__((always_inline)) __m256i operator()(__m256 u) const {
    auto ge = [&](__m256 t) __attribute__((always_inline)) { return _mm256_cmp_ps(u, t, _CMP_GE_OQ); };
    auto bits = [](__m256 m, int b) __attribute__((always_inline)) {
      return _mm256_and_si256(_mm256_castps_si256(m), _mm256_set1_epi32(b));
    };
    if constexpr (B == 2) {
      __m256i code = _mm256_setzero_si256();
      for (int j = 0; j < kThr; ++j)  // a true compare is -1: subtracting it adds 1
        code = _mm256_sub_epi32(code, _mm256_castps_si256(ge(thr[j])));
      return code;
    } else if constexpr (B == 3) {
      const __m256 m1 = ge(thr[3]);                           // code >= 4
      const __m256 m2 = ge(_mm256_blendv_ps(thr[1], thr[5], m1));  // code >= c + 2
      const __m256i c = _mm256_or_si256(bits(m1, 4), bits(m2, 2));
      return _mm256_sub_epi32(c, _mm256_castps_si256(ge(_mm256_permutevar8x32_ps(lo, c))));
    } else {
      static_assert(B == 4, "NuqSearch8: B is 2, 3 or 4");
      const __m256 m1 = ge(thr[7]);                           // code >= 8
      const __m256 m2 = ge(_mm256_blendv_ps(thr[3], thr[11], m1));  // code >= c + 4
      __m256i c = _mm256_or_si256(bits(m1, 8), bits(m2, 4));
      auto at = [&](__m256i i) __attribute__((always_inline)) {  // threshold i (lanes of i & 7, half by m1)
        return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, i), _mm256_permutevar8x32_ps(hi, i), m1);
      };
      c = _mm256_or_si256(c, bits(ge(at(_mm256_or_si256(c, _mm256_set1_epi32(1)))), 2));
      return _mm256_sub_epi32(c, _mm256_castps_si256(ge(at(c))));
    }
  }
};

#if KVQ_HAS_F16C
/// Per-token nuq rows (token axis, group % 8 == 0), B-bit codes: the grouped driver's work for
/// one vector at a time. Group minima/maxima and parameters 8 groups at a time in registers
/// (kernels::group_minmax8 / group_params8, nuq_params bit for bit), codes packed 32 at a
/// time (with the group's zero and inverse scale hoisted when the group is a multiple of 32).
/// A row with a non-finite value or a parameter the metadata cannot hold reruns the scalar
/// per-group loop, which throws the grouped driver's error: same bytes, same errors.
template <int B, class T>
void quantize_nuq_rows_b(const QuantConfig& cfg, const NuqCodec& codec, const KVView<const T>& x,
                         const PackedSpan& q, QuantWorkspace& ws) {
  const Shape s = x.shape();
  const int64_t n = s.numel();
  if (n == 0) return;
  const GroupBox box = group_box(Axis::kToken, cfg.group, s);
  const int64_t H = s.heads, D = s.head_dim, gc = box.gc, nc = box.nc;
  q.codes[packed_bytes(static_cast<std::size_t>(n), B) - 1] = 0;
  const auto np = static_cast<std::size_t>((nc + 7) / 8 * 8);
  float* buf = QuantWorkspace::at_least(ws.buf, static_cast<std::size_t>(D));
  float* zg = QuantWorkspace::at_least(ws.zv, np);  // per group zero / inverse scale
  float* ig = QuantWorkspace::at_least(ws.iv, np);
  float* cz = QuantWorkspace::at_least(ws.lo, static_cast<std::size_t>(D / 8));  // per 8 channels
  float* ci = QuantWorkspace::at_least(ws.hi, static_cast<std::size_t>(D / 8));
  const NuqSearch8<B> search(codec.thr);
  const bool f16 = cfg.meta == MetaDType::kF16;
  const int64_t mb = f16 ? 2 : 4;
  const std::size_t row_bytes = static_cast<std::size_t>(D) * sizeof(T);
  for (int64_t t = 0; t < s.tokens; ++t)
    for (int64_t h = 0; h < H; ++h) {
      if (x.dim_contiguous()) kernels::prefetch_ahead(x.row(t, h), row_bytes);
      const float* r = load_row(x, t, h, buf);
      const int64_t v = t * H + h;
      bool fast = true;
      for (int64_t b0 = 0; b0 < nc && fast; b0 += 8) {
        const int cnt = static_cast<int>(std::min<int64_t>(8, nc - b0));
        __m256 L, Hv, Z, S, I;
        fast = kernels::group_minmax8(r + b0 * gc, gc, cnt, L, Hv) &&
               kernels::group_params8(L, Hv, cnt, false, B, 1.f, f16, Z, S, I);
        if (!fast) break;
        const int64_t g = v * nc + b0;
        kernels::store_meta8(S, cnt, f16, q.scales + g * mb);
        kernels::store_meta8(Z, cnt, f16, q.zeros + g * mb);
        _mm256_storeu_ps(zg + b0, Z);
        _mm256_storeu_ps(ig + b0, I);
      }
      if (!fast)  // the scalar loop: the same parameters, or the grouped driver's error
        for (int64_t b = 0; b < nc; ++b) {
          float l = INFINITY, u = -INFINITY;
          if (!kernels::minmax(r + b * gc, gc, l, u)) throw_non_finite_row(x, t, h, "quantize");
          const auto g = static_cast<std::size_t>(v * nc + b);
          const UniformParams p = codec.params(l, u, static_cast<int64_t>(g));
          store_meta(q.scales, cfg.meta, g, p.scale);
          store_meta(q.zeros, cfg.meta, g, p.zero);
          zg[b] = p.zero;
          ig[b] = p.inv;
        }
      uint8_t* out = q.codes + static_cast<std::size_t>(v * D * B / 8);
      auto code8 = [&](const float* e, __m256 z, __m256 inv) __attribute__((always_inline)) {
        return search(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(e), z), inv));
      };
      if (gc % 32 == 0) {
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        for (int64_t b = 0; b < nc; ++b) {
          const __m256 z = _mm256_broadcast_ss(zg + b), inv = _mm256_broadcast_ss(ig + b);
          for (int64_t c = 0; c < gc; c += 32, out += 4 * B) {
            const float* e = r + b * gc + c;
            const __m256i p = _mm256_packs_epi32(code8(e, z, inv), code8(e + 8, z, inv));
            const __m256i u = _mm256_packs_epi32(code8(e + 16, z, inv), code8(e + 24, z, inv));
            pack32_store<B>(_mm256_permutevar8x32_epi32(_mm256_packus_epi16(p, u), order), out);
          }
        }
      } else {
        for (int64_t b = 0, c = 0; b < nc; ++b)
          for (int64_t e = 0; e < gc; e += 8, ++c) {
            cz[c] = zg[b];
            ci[c] = ig[b];
          }
        write_row_codes<B>(D, out, [&](int64_t e) __attribute__((always_inline)) {
          return code8(r + e, _mm256_broadcast_ss(cz + e / 8), _mm256_broadcast_ss(ci + e / 8));
        });
      }
    }
}

/// quantize_nuq_rows_b for the config's bits (2, 3 or 4).
template <class T>
void quantize_nuq_rows(const QuantConfig& cfg, const NuqCodec& codec, const KVView<const T>& x,
                       const PackedSpan& q, QuantWorkspace& ws) {
  switch (cfg.bits) {
    case 2: return quantize_nuq_rows_b<2>(cfg, codec, x, q, ws);
    case 3: return quantize_nuq_rows_b<3>(cfg, codec, x, q, ws);
    default: return quantize_nuq_rows_b<4>(cfg, codec, x, q, ws);
  }
}
#endif
#endif

}  // namespace detail

/// Quantizes `x` under a calibrated nuq config into caller memory `q` (sized by packed_sizes).
/// Throws kInvalidArgument when the config has no codebook (a spec that needs calibration and
/// has none), kNonFinite on NaN/inf input, kOutOfRange on metadata overflow.
template <class T>
void quantize_nuq(const QuantConfig& cfg, const KVView<const T>& x, const PackedSpan& q,
                  QuantWorkspace& ws) {
  const detail::NuqCodec codec(cfg);
#if KVQ_HAS_AVX2 && KVQ_HAS_F16C
  if (cfg.axis == Axis::kToken && group_box(cfg.axis, cfg.group, x.shape()).gc % 8 == 0)
    return detail::quantize_nuq_rows(cfg, codec, x, q, ws);
#endif
  detail::grouped_quantize(cfg, codec, cfg.bits, x, q, ws);
}
/// Reconstructs tokens [t0, t0 + out.tokens()) of nuq data into `out`.
template <class T>
void dequantize_nuq(const PackedView& q, int64_t t0, const KVView<T>& out, QuantWorkspace& ws) {
  detail::grouped_dequantize(q, detail::NuqCodec(q.config), q.config.bits, t0, out, ws);
}

}  // namespace kvq
