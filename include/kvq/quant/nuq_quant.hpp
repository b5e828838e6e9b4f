#pragma once
/// \file nuq_quant.hpp
/// nuq<b> quantizer (fast path): the grouped driver of quant/grouped_quant.hpp with a codec
/// that normalizes each group like the asymmetric int formats (zero = min, scale = max - min,
/// both rounded to the metadata type) and encodes u = (x - zero) * inv with the layer's learned
/// codebook (format/nuq.hpp). Same metadata regions as asymmetric int (one scale and one zero
/// per group box) and the same b-bit bitstream; the codebook itself is per-layer metadata in
/// the config. reference/nuq_ref.hpp is the scalar oracle (identical bytes). Encoding counts the
/// thresholds <= u, 16 lanes (AVX-512) or 8 (AVX2) at a time, scalar otherwise.
#include <cmath>
#include <cstdint>

#include "kvq/config.hpp"
#include "kvq/format/codebook.hpp"
#include "kvq/format/meta.hpp"
#include "kvq/format/nuq.hpp"
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
              " needs a calibrated codebook: run kvq::calibrate (quant/calibrate.hpp) or load "
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

}  // namespace detail

/// Quantizes `x` under a calibrated nuq config into caller memory `q` (sized by packed_sizes).
/// Throws kInvalidArgument when the config has no codebook (a spec that needs calibration and
/// has none), kNonFinite on NaN/inf input, kOutOfRange on metadata overflow.
template <class T>
void quantize_nuq(const QuantConfig& cfg, const KVView<const T>& x, const PackedSpan& q,
                  QuantWorkspace& ws) {
  detail::grouped_quantize(cfg, detail::NuqCodec(cfg), cfg.bits, x, q, ws);
}
/// Reconstructs tokens [t0, t0 + out.tokens()) of nuq data into `out`.
template <class T>
void dequantize_nuq(const PackedView& q, int64_t t0, const KVView<T>& out, QuantWorkspace& ws) {
  detail::grouped_dequantize(q, detail::NuqCodec(q.config), q.config.bits, t0, out, ws);
}

}  // namespace kvq
