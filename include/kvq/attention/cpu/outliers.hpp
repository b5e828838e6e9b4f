#pragma once
/// \file outliers.hpp
/// Unit's dense-and-sparse outlier corrections: the sparse part of outlier streams added
/// to scores and value accumulators.
#include "kvq/attention/cpu/unit.hpp"

namespace kvq {
namespace kernels {
namespace attn {

template <class S>
std::pair<int64_t, float> Unit<S>::outlier_at(const PackedView& v, std::size_t i) {
  uint16_t hb;
  std::memcpy(&hb, v.outlier_values + 2 * i, 2);
  const int64_t D = v.shape.head_dim;
  const int64_t pos =
      D > 256 ? (v.outlier_pos[2 * i] | (v.outlier_pos[2 * i + 1] << 8)) : v.outlier_pos[i];
  return {pos < D ? pos : D - 1, half_bits_to_float_fast(hb)};
}

template <class S>
template <class F>
void Unit<S>::for_outliers(const Stream& st, int64_t loc, int64_t h, F&& f) {
  const auto base = static_cast<std::size_t>((loc * st.view.shape.heads + h) * st.nout);
  for (int64_t j = 0; j < st.nout; ++j) {
    const auto o = outlier_at(st.view, base + static_cast<std::size_t>(j));
    f(o.first, o.second);
  }
}

template <class S>
template <class F>
void Unit<S>::for_outlier_deltas(const Stream& st, int64_t loc0, int64_t n, int64_t h, F&& f) {
  if (st.load == Load::kE4M3) {
    outlier_deltas<1>(st, loc0, n, h, f);
  } else if (st.load == Load::kE5M2) {
    outlier_deltas<2>(st, loc0, n, h, f);
  } else {
    outlier_deltas<0>(st, loc0, n, h, f);
  }
}

template <class S>
template <int Kind, class F>
void Unit<S>::outlier_deltas(const Stream& st, int64_t loc0, int64_t n, int64_t h, F& f) {
  const PackedView& v = st.view;
  const int64_t H = v.shape.heads, D = v.shape.head_dim, k = st.nout;
  const GroupBox& b = st.box;
  const bool gc1 = b.gc == D;  // one group over the vector's channels
  // pos / gc == (pos * gmul) >> 32 exactly for pos, gc < 2^16
  const bool fast_div = D < (int64_t{1} << 16);
  const uint64_t gmul = (uint64_t{1} << 32) / static_cast<uint64_t>(b.gc) + 1;
  auto group_of = [&](int64_t pos) {
    if (gc1) return int64_t{0};
    return fast_div ? static_cast<int64_t>((static_cast<uint64_t>(pos) * gmul) >> 32) : pos / b.gc;
  };
  const auto bits = static_cast<std::size_t>(st.bits);
  const uint32_t mask = (1u << st.bits) - 1u;
  const float mul = st.mul, off = st.off;
  const bool zeros = st.zeros, nuq = st.nuq;
  const int64_t hb = h / b.gh;
  int64_t tb = loc0 / b.gt, tr = loc0 % b.gt;  // token block of loc0 + t, and t's place in it
  for (int64_t t = 0; t < n; ++t) {
    const int64_t vec = (loc0 + t) * H + h;
    const int64_t gbase = (tb * b.nh + hb) * b.nc;
    const auto ebase = static_cast<std::size_t>(vec * D);
    const auto obase = static_cast<std::size_t>(vec * k);
    for (int64_t j = 0; j < k; ++j) {
      const auto [pos, val] = outlier_at(v, obase + static_cast<std::size_t>(j));
      const std::size_t e = ebase + static_cast<std::size_t>(pos);
      float c;
      if constexpr (Kind == 1) {
        c = SimdScalar::from_e4m3(v.codes + e);
      } else if constexpr (Kind == 2) {
        c = SimdScalar::from_e5m2(v.codes + e);
      } else {
        const std::size_t bit = e * bits;
        uint32_t w = v.codes[bit / 8];
        if (bit % 8 + bits > 8) w |= static_cast<uint32_t>(v.codes[bit / 8 + 1]) << 8;
        const uint32_t code = (w >> (bit % 8)) & mask;
        c = nuq ? st.lut[code] : static_cast<float>(code);
      }
      const auto g = static_cast<std::size_t>(gbase + group_of(pos));
      const float sc = v.scale(g);
      f(t, pos, val - std::fma(c, sc * mul, (zeros ? v.zero(g) : 0.f) - off * sc));
    }
    if (++tr == b.gt) {
      tr = 0;
      ++tb;
    }
  }
}

template <class S>
void Unit<S>::outlier_table(const Stream& st, int64_t loc0, int64_t n, int64_t h) const {
  const int64_t k = st.nout;
  const auto need = static_cast<std::size_t>(k * kTile);
  if (sc_.opos.size() < need) {
    sc_.opos.resize(need);
    sc_.odv.resize(need);
  }
  int32_t* pos = sc_.opos.data();
  float* dv = sc_.odv.data();
  int64_t t0 = 0;
#if KVQ_HAS_AVX2 && KVQ_HAS_F16C
  t0 = outlier_table8(st, loc0, n, h, pos, dv);
#endif
  int64_t i = 0;  // outliers arrive token by token, k per token
  for_outlier_deltas(st, loc0 + t0, n - t0, h, [&](int64_t t, int64_t c, float d) {
    const int64_t j = i++ % k;
    pos[j * kTile + t0 + t] = static_cast<int32_t>(c);
    dv[j * kTile + t0 + t] = d;
  });
}

#if KVQ_HAS_AVX2 && KVQ_HAS_F16C
template <class S>
int64_t Unit<S>::outlier_table8(const Stream& st, int64_t loc0, int64_t n, int64_t h, int32_t* pos,
                                float* dv) {
  const PackedView& v = st.view;
  const int64_t H = v.shape.heads, D = v.shape.head_dim, k = st.nout, T = v.shape.tokens;
  const GroupBox& b = st.box;
  const bool gc1 = b.gc == D;
  const bool gc_pow2 = (b.gc & (b.gc - 1)) == 0;
  const int64_t numel = T * H * D;
  if (n < 8 || (!gc1 && !gc_pow2) || numel * st.bits >= (int64_t{1} << 31) ||
      T * H * k >= (int64_t{1} << 29))
    return 0;
  const int gshift = gc1 ? 31 : __builtin_ctzll(static_cast<unsigned long long>(b.gc));
  const int64_t pb = D > 256 ? 2 : 1;
  const bool f16m = v.config.meta == MetaDType::kF16;
  // Bytes a 4-byte read may touch: the regions' sizes.
  const int64_t code_bytes = (numel * st.bits + 7) / 8;
  const int64_t n_out = T * H * k;
  const int64_t meta_bytes = b.count() * (f16m ? 2 : 4);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i m16 = _mm256_set1_epi32(0xffff);
  const __m256i cmask = _mm256_set1_epi32((1 << st.bits) - 1);
  const __m256i vD = _mm256_set1_epi32(static_cast<int>(D));
  const __m256i vDm1 = _mm256_set1_epi32(static_cast<int>(D - 1));
  const __m256i vbits = _mm256_set1_epi32(st.bits);
  const __m256 vmul = _mm256_set1_ps(st.mul), voff = _mm256_set1_ps(st.off);
  const __m256 lut_lo = _mm256_loadu_ps(st.lut), lut_hi = _mm256_loadu_ps(st.lut + 8);
  const int64_t hb = h / b.gh;
  const bool e4m3 = st.load == Load::kE4M3, e5m2 = st.load == Load::kE5M2;
  auto f16x8 = [&](__m256i w) {  // low 16 bits of each lane -> 8 floats
    const __m256i p = _mm256_packus_epi32(_mm256_and_si256(w, m16), _mm256_setzero_si256());
    return _mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permute4x64_epi64(p, 0x08)));
  };
  auto meta8 = [&](const uint8_t* base, __m256i g) {
    if (!f16m) return _mm256_i32gather_ps(reinterpret_cast<const float*>(base), g, 4);
    return f16x8(
        _mm256_i32gather_epi32(reinterpret_cast<const int*>(base), _mm256_add_epi32(g, g), 1));
  };
  const __m256i vk = _mm256_set1_epi32(static_cast<int>(k));
  int32_t gb[8];
  int64_t tb = loc0 / b.gt, tr = loc0 % b.gt;  // token block of loc0 + m + i, place in it
  int64_t m = 0;
  for (; m + 8 <= n; m += 8) {
    const int64_t tok = loc0 + m;  // first token of the block
    const int64_t vlast = (tok + 7) * H + h;
    const int64_t gmax = (((tok + 7) / b.gt) * b.nh + hb) * b.nc + b.nc - 1;
    // A gather reads 4 bytes at each address: stay inside each region.
    if ((vlast * D + D) * st.bits / 8 + 4 > code_bytes || (vlast * k + k) * 2 + 2 > 2 * n_out ||
        (vlast * k + k) * pb + 3 > pb * n_out || (f16m ? 2 * gmax + 4 : 4 * gmax + 4) > meta_bytes)
      break;
    for (int i = 0; i < 8; ++i) {  // group box base of each token
      gb[i] = static_cast<int32_t>((tb * b.nh + hb) * b.nc);
      if (++tr == b.gt) {
        tr = 0;
        ++tb;
      }
    }
    const __m256i gbase = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb));
    // vector index of each token, and its first outlier's index
    const __m256i vec =
        _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(tok * H + h)),
                         _mm256_mullo_epi32(lane, _mm256_set1_epi32(static_cast<int>(H))));
    const __m256i o0 = _mm256_mullo_epi32(vec, vk);
    const __m256i e0 = _mm256_mullo_epi32(vec, vD);
    for (int64_t j = 0; j < k; ++j) {
      const __m256i o = _mm256_add_epi32(o0, _mm256_set1_epi32(static_cast<int>(j)));
      __m256i c = _mm256_i32gather_epi32(reinterpret_cast<const int*>(v.outlier_pos),
                                         pb == 2 ? _mm256_add_epi32(o, o) : o, 1);
      c = _mm256_and_si256(c, pb == 2 ? m16 : _mm256_set1_epi32(0xff));
      c = _mm256_min_epi32(c, vDm1);  // as outlier_at: corrupt positions stay in the vector
      const __m256 val = f16x8(_mm256_i32gather_epi32(
          reinterpret_cast<const int*>(v.outlier_values), _mm256_add_epi32(o, o), 1));
      const __m256i bit = _mm256_mullo_epi32(_mm256_add_epi32(e0, c), vbits);
      const __m256i w = _mm256_i32gather_epi32(reinterpret_cast<const int*>(v.codes),
                                               _mm256_srli_epi32(bit, 3), 1);
      const __m256i code = _mm256_and_si256(
          _mm256_srlv_epi32(w, _mm256_and_si256(bit, _mm256_set1_epi32(7))), cmask);
      __m256 cf;
      if (e4m3) {  // sign to bit 15, exponent and mantissa to bits 7..14 (Simd256::from_e4m3)
        cf = f16x8(
            _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(code, _mm256_set1_epi32(0x80)), 8),
                            _mm256_slli_epi32(_mm256_and_si256(code, _mm256_set1_epi32(0x7f)), 7)));
      } else if (e5m2) {
        cf = f16x8(_mm256_slli_epi32(code, 8));
      } else if (st.nuq) {  // level[code]: two 8-entry tables, the high one where code >= 8
        cf = _mm256_blendv_ps(_mm256_permutevar8x32_ps(lut_lo, code),
                              _mm256_permutevar8x32_ps(lut_hi, code),
                              _mm256_castsi256_ps(_mm256_slli_epi32(code, 28)));
      } else {
        cf = _mm256_cvtepi32_ps(code);
      }
      const __m256i g =
          gc1 ? gbase : _mm256_add_epi32(gbase, _mm256_srl_epi32(c, _mm_cvtsi32_si128(gshift)));
      const __m256 sc = meta8(v.scales, g);
      const __m256 z = st.zeros ? meta8(v.zeros, g) : _mm256_setzero_ps();
      const __m256 dense =
          _mm256_fmadd_ps(cf, _mm256_mul_ps(sc, vmul), _mm256_fnmadd_ps(voff, sc, z));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pos + j * kTile + m), c);
      _mm256_storeu_ps(dv + j * kTile + m, _mm256_sub_ps(val, dense));
    }
  }
  return m;
}
#endif

template <class S>
void Unit<S>::outlier_scores(const Stream& st, int64_t loc0, int64_t n, int64_t h, const float* q,
                             float* sc) const {
  const int64_t R = R_, D = P_.D, k = st.nout;
  outlier_table(st, loc0, n, h);
  for (int64_t j = 0; j < k; ++j) {
    const int32_t* pos = sc_.opos.data() + j * kTile;
    const float* dv = sc_.odv.data() + j * kTile;
    for (int64_t r = 0; r < R; ++r) {
      const float* qr = q + r * D;
      float* s = sc + r * kTile;
      int64_t t = 0;
#if KVQ_HAS_AVX2 && KVQ_HAS_F16C
      for (; t + 8 <= n; t += 8) {
        const __m256 qv = _mm256_i32gather_ps(
            qr, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pos + t)), 4);
        _mm256_storeu_ps(s + t,
                         _mm256_fmadd_ps(qv, _mm256_loadu_ps(dv + t), _mm256_loadu_ps(s + t)));
      }
#endif
      for (; t < n; ++t) s[t] = std::fma(qr[pos[t]], dv[t], s[t]);
    }
  }
}

template <class S>
void Unit<S>::outlier_values(const Stream& st, int64_t loc0, int64_t n, int64_t h, const float* p,
                             float* acc, bool eo) const {
  const int64_t R = R_, D = P_.D, k = st.nout;
  outlier_table(st, loc0, n, h);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t pos = sc_.opos[static_cast<std::size_t>(j * kTile + t)];
      const float dv = sc_.odv[static_cast<std::size_t>(j * kTile + t)];
      const int64_t i = eo ? (pos & ~int64_t{15}) + (pos & 1) * 8 + ((pos & 15) >> 1) : pos;
      for (int64_t r = 0; r < R; ++r) acc[r * D + i] += p[r * kTile + t] * dv;
    }
}

}  // namespace attn
}  // namespace kernels
}  // namespace kvq
