#pragma once
/// \file tiles_int8.hpp
/// The all-heads tile loop's int8 dot-product path (AttentionOptions::dot = DotProduct::kInt8):
/// int key codes scored against int8 queries, 4-bit value codes accumulated with uint8 softmax
/// weights, both with simd/int8_dot.hpp's `vpdpbusd` (or its AVX2 equivalent).
///
/// Keys (4- or 8-bit int codes, per-row or per-channel scales):
///  - per-row scale s_t and zero z_t: logit = s_t * sq * (q8 . c_t) + z_t * sum(q), q8 the
///    query row (already times the softmax scale) rounded to int8 with one scale sq = max|q| /
///    127 per row and tile;
///  - per-channel scales s_d, zeros z_d of a block of tokens: the block's q'_d = q_d s_d is
///    rounded to int8 (sq = max|q'| / 127, once per row and block), logit = sq * (q8 . c_t) +
///    q . z (exact).
/// Values (4-bit int codes, per-row scales or per-token groups): w'_{t,g} = p_t s_{t,g} (p the
/// tile's softmax weight) rounded to uint8 with one scale sw = max_t w' / 255 per (row, group,
/// tile); acc_d += sw * sum_t w8_t c_{t,d} over the tile's tokens, zero points as the exact
/// sum_t p_t z_{t,g} per row and group. Value codes of four tokens are interleaved per byte
/// (i8::interleave4) once per head and tile, then every query row of the head reads them.
/// Key codes of eight tokens are transposed to 4-byte words (i8::transpose8x32) so that the int32
/// lanes of one accumulator are eight tokens' dot products (no horizontal sums).
/// Integer sums cannot overflow: at most 64 tokens x 255 x 15 or 128 channels x 255 x 127.
#include "kvq/attention/cpu/unit.hpp"

namespace kvq {
namespace kernels {
namespace attn {

#if KVQ_HAS_AVX2 && KVQ_HAS_F16C
template <class S>
bool Unit<S>::int8_keys(const Stream& st, Load L) const {
  if (!P_.int8 || !st.packed || st.raw || st.lm || st.qjl || st.nuq || st.fp4 || st.unpack)
    return false;
  if (L == Load::kU4) {
    if (P_.D % 64 != 0) return false;
  } else if (L == Load::kU8) {
    if (!i8::kU8Codes || P_.D % 32 != 0) return false;
  } else {
    return false;
  }
  return st.scale == Scale::kRow || st.scale == Scale::kChannel;
}

template <class S>
bool Unit<S>::int8_values(const Stream& st, Load L) const {
  if (!P_.int8 || L != Load::kU4 || !st.packed || st.raw || st.lm || st.qjl || st.nuq || st.fp4)
    return false;
  if (P_.D % 64 != 0) return false;
  if (st.scale == Scale::kRow) return true;
  return st.scale == Scale::kGroup && (st.box.gc == 32 || st.box.gc % 64 == 0);
}

namespace i8 {
/// The 8x8 transpose of 32-bit words: y[j] lane u = word j of x[u] (bytes 4j..4j+3 of row u's
/// 32-byte chunk).
KVQ_AVX2_INLINE void transpose8x32(const __m256i* x, __m256i* y) {
  __m256i t[8], s[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_epi32(x[2 * i], x[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi32(x[2 * i], x[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    const __m256i* a = t + 4 * i;  // rows 4i .. 4i + 3
    s[4 * i + 0] = _mm256_unpacklo_epi64(a[0], a[2]);  // words 0 | 4
    s[4 * i + 1] = _mm256_unpackhi_epi64(a[0], a[2]);  // words 1 | 5
    s[4 * i + 2] = _mm256_unpacklo_epi64(a[1], a[3]);  // words 2 | 6
    s[4 * i + 3] = _mm256_unpackhi_epi64(a[1], a[3]);  // words 3 | 7
  }
  for (int j = 0; j < 4; ++j) {
    y[j] = _mm256_permute2x128_si256(s[j], s[4 + j], 0x20);
    y[j + 4] = _mm256_permute2x128_si256(s[j], s[4 + j], 0x31);
  }
}

/// out[r * stride + u] = q[r] . codes of row p[u], u < nt (nt <= 8; rows past nt repeat a valid
/// one and are not stored), RB query rows (stride D) in quantize_row's chunk layout, nb code
/// bytes per row. Eight tokens per int32 lane set: each 32-byte chunk of the eight rows is
/// transposed to words (4 codes of one token per lane), and a broadcast 4-byte piece of the
/// query multiplies it, so the lanes end as the eight tokens' sums (no horizontal reduction).
template <Load L, int RB>
KVQ_AVX2_INLINE void idot8(const uint8_t* const* p, int64_t nb, const int8_t* q, int64_t D,
                           int64_t nt, int32_t* out, int64_t stride) {
  __m256i a[RB];
  for (int r = 0; r < RB; ++r) a[r] = _mm256_setzero_si256();
  const __m256i m = _mm256_set1_epi8(15);
  for (int64_t c = 0; c < nb; c += 32) {
    __m256i x[8], y[8];
    for (int u = 0; u < 8; ++u) x[u] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p[u] + c));
    transpose8x32(x, y);
    for (int j = 0; j < 8; ++j) {
      if constexpr (L == Load::kU4) {
        // byte b of the chunk: channel 2b (low nibble, query byte 2c + b) and 2b + 1 (high
        // nibble, query byte 2c + 32 + b)
        const __m256i lo = _mm256_and_si256(y[j], m);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(y[j], 4), m);
        for (int r = 0; r < RB; ++r) {
          const int8_t* qr = q + r * D + 2 * c + 4 * j;
          int32_t qe, qo;
          std::memcpy(&qe, qr, 4);
          std::memcpy(&qo, qr + 32, 4);
          a[r] = dp4(dp4(a[r], lo, _mm256_set1_epi32(qe)), hi, _mm256_set1_epi32(qo));
        }
      } else {
        for (int r = 0; r < RB; ++r) {
          int32_t qw;
          std::memcpy(&qw, q + r * D + c + 4 * j, 4);
          a[r] = dp4(a[r], y[j], _mm256_set1_epi32(qw));
        }
      }
    }
  }
  if (nt == 8) {
    for (int r = 0; r < RB; ++r) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * stride), a[r]);
  } else {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(nt)), lane);
    for (int r = 0; r < RB; ++r) _mm256_maskstore_epi32(out + r * stride, keep, a[r]);
  }
}
}  // namespace i8

template <class S>
template <Load L>
void Unit<S>::idot_tokens(int64_t t0, int64_t t1, int64_t n, int64_t hs, int64_t kspan,
                          int64_t vspan) {
  const int64_t D = P_.D, H = P_.H, R = R_;
  const int64_t nb = L == Load::kU4 ? D / 2 : D;
  const uint8_t* const* krp = sc_.krp.data();
  const uint8_t* const* vrp = sc_.vrp.data();
  const int8_t* q8 = sc_.q8.data();
  int32_t* I = sc_.idot.data();
  for (int64_t t = t0; t < t1; t += 8) {
    const int64_t nt = std::min<int64_t>(8, t1 - t);
    for (int64_t u = 0; u < nt; ++u) {
      if (t + u + kKeyAhead < n) prefetch_rows(krp[t + u + kKeyAhead], kspan);
      prefetch_rows(vrp[t + u], vspan);
    }
    for (int64_t h = 0; h < H; ++h) {
      const uint8_t* p[8];
      for (int64_t u = 0; u < 8; ++u) p[u] = krp[t + std::min(u, nt - 1)] + h * hs;
      const int8_t* qh = q8 + h * R * D;
      int32_t* o = I + h * R * kTile + t;
      int64_t r = 0;
      for (; r + 4 <= R; r += 4) i8::idot8<L, 4>(p, nb, qh + r * D, D, nt, o + r * kTile, kTile);
      switch (R - r) {
        case 3:
          i8::idot8<L, 3>(p, nb, qh + r * D, D, nt, o + r * kTile, kTile);
          break;
        case 2:
          i8::idot8<L, 2>(p, nb, qh + r * D, D, nt, o + r * kTile, kTile);
          break;
        case 1:
          i8::idot8<L, 1>(p, nb, qh + r * D, D, nt, o + r * kTile, kTile);
          break;
        default:
          break;
      }
    }
  }
}

template <class S>
template <Load L>
void Unit<S>::score_int8(int64_t n, int64_t hs, int64_t kspan, int64_t vspan) {
  const auto& pcs = sc_.pieces;
  const int64_t D = P_.D, R = R_, H = P_.H, HR = P_.nq * P_.G;
  const Stream& ks0 = ws_.ks[pcs.front().si];
  constexpr bool four = L == Load::kU4;
  const float* qs = (ks0.rot ? ws_.qrot : ws_.qs).data() + i0_ * P_.G * D;
  float* sc = sc_.s.data();
  float* ms = sc_.kms.data();
  float* mz = sc_.kmz.data();
  int8_t* q8 = sc_.q8.data();
  float* q8s = sc_.q8s.data();
  float* q8a = sc_.q8a.data();
  const int32_t* I = sc_.idot.data();
  // centered codes: sum_d q_d c_d = sq q8 . c - mid * A + sum_d e_d (c_d - mid), with
  // A = sum_d (sq q8_d - q_d) known exactly, so the rounding error e multiplies c - mid (half the
  // code range) instead of c
  const float mid = ks0.bits == 4 ? 7.5f : 127.5f;
  if (ks0.scale == Scale::kRow) {
    meta_tile(ws_.ks, n, 1, ms, mz);
    const int kind = 1 + (ks0.rot ? 1 : 0) + (four ? 2 : 0);  // the unit's queries stay
    if (q8_kind_ != kind) {
      for (int64_t h = 0; h < H; ++h)
        for (int64_t r = 0; r < R; ++r) {
          const float* x = qs + h * HR * D + r * D;
          float amax, sum;
          i8::row_stats(x, D, amax, sum);
          q8s[h * R + r] =
              i8::quantize_row(x, D, four, amax, sum, q8 + (h * R + r) * D, &q8a[h * R + r]);
        }
      q8_kind_ = kind;
    }
    idot_tokens<L>(0, n, n, hs, kspan, vspan);
    for (int64_t h = 0; h < H; ++h) {
      const float* qsum = (ks0.rot ? ws_.qrotsum : ws_.qsum).data() + h * HR + i0_ * P_.G;
      const float* hms = ms + h * kTile;
      const float* hmz = mz + h * kTile;
      for (int64_t r = 0; r < R; ++r) {
        float* o = sc + (h * R + r) * kTile;
        const int32_t* ir = I + (h * R + r) * kTile;
        const float s = q8s[h * R + r], qr = qsum[r], mA = mid * q8a[h * R + r];
        for (int64_t t = 0; t < n; ++t)
          o[t] = std::fma(hms[t], std::fma(s, static_cast<float>(ir[t]), -mA), hmz[t] * qr);
      }
    }
    return;
  }
  // kChannel: per block (piece), q' = q * s folded and rounded once per row
  float* f = sc_.tmp.data();
  float* qz = sc_.qz.data();
  q8_kind_ = 0;
  for (const Piece& p : pcs) {
    for (int64_t h = 0; h < H; ++h) {
      meta_channel(ws_.ks[p.si], p.loc0, h, ms, mz);
      for (int64_t r = 0; r < R; ++r) {
        const float* qr = qs + h * HR * D + r * D;
        // q' = q * s folded, with its max|.| and sum in the same pass
        const __m256 sign = _mm256_set1_ps(-0.f);
        __m256 z = _mm256_setzero_ps(), mx = _mm256_setzero_ps(), sm = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
          const __m256 q = _mm256_loadu_ps(qr + d);
          const __m256 v = _mm256_mul_ps(q, _mm256_loadu_ps(ms + d));
          _mm256_storeu_ps(f + d, v);
          mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v));
          sm = _mm256_add_ps(sm, v);
          z = _mm256_fmadd_ps(q, _mm256_loadu_ps(mz + d), z);
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        q8s[h * R + r] = i8::quantize_row(f, D, four, _mm_cvtss_f32(m4), Simd256::reduce(sm),
                                          q8 + (h * R + r) * D, &q8a[h * R + r]);
        qz[h * R + r] = Simd256::reduce(z);
      }
    }
    idot_tokens<L>(p.o, p.o + p.n, n, hs, kspan, vspan);
    for (int64_t hr = 0; hr < H * R; ++hr) {
      float* o = sc + hr * kTile;
      const int32_t* ir = I + hr * kTile;
      const float s = q8s[hr], z = qz[hr] - mid * q8a[hr];
      for (int64_t t = p.o; t < p.o + p.n; ++t) o[t] = std::fma(s, static_cast<float>(ir[t]), z);
    }
  }
}

template <class S>
template <Load L>
bool Unit<S>::accumulate_int8(int64_t n, int64_t hs) {
  using V = avx2::V;
  static_assert(L == Load::kU4, "int8 values read 4-bit codes");
  const auto& pcs = sc_.pieces;
  const int64_t D = P_.D, R = R_, H = P_.H;
  const Stream& vs0 = ws_.vs[pcs.front().si];
  const bool grouped = vs0.scale == Scale::kGroup;
  const int64_t gc = grouped ? vs0.box.gc : D, ng = D / gc;
  float* ms = sc_.vms.data();
  float* mz = sc_.vmz.data();
  meta_tile(ws_.vs, n, ng, ms, mz);
  const float* p = sc_.s.data();
  const int64_t n8 = (n + 7) & ~int64_t{7}, n4 = (n + 3) & ~int64_t{3};
  uint8_t* w8 = sc_.w8.data();
  float* w8s = sc_.w8s.data();
  float* zg = sc_.zg.data();
  // ---- per head and group: the scales must be finite and >= 0 (else the exact path), and the
  // zeros become centered ones, z + 7.5 s (shared by the head's rows)
  for (int64_t c = 0; c < H * ng; ++c) {
    const float* gs = ms + c * kTile;
    V mn = _mm256_setzero_ps(), ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    const V inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
    for (int64_t t = 0; t < n8; t += 8) {
      const V sv = _mm256_loadu_ps(gs + t);
      mn = _mm256_min_ps(mn, sv);
      ok = _mm256_and_ps(ok, _mm256_cmp_ps(sv, inf, _CMP_LT_OQ));
    }
    if (_mm256_movemask_ps(_mm256_cmp_ps(mn, _mm256_setzero_ps(), _CMP_LT_OQ)) != 0 ||
        _mm256_movemask_ps(ok) != 0xFF)
      return false;  // nothing written yet: the exact path reads the same metadata
  }
  for (int64_t c = 0; c < H * ng; ++c)
    for (int64_t t = 0; t < n8; t += 8) {
      float* z = mz + c * kTile + t;
      _mm256_storeu_ps(z, _mm256_fmadd_ps(_mm256_set1_ps(7.5f), _mm256_loadu_ps(ms + c * kTile + t),
                                          _mm256_loadu_ps(z)));
    }
  // ---- weights w' = p * s per (row, group), rounded to uint8 with sw = max w' / 255 per tile.
  // Centered codes (as for keys): sum_t w'_t (s c_t + z) = sum_t w'_t (c_t - 7.5) + sum_t p_t
  // (z_t + 7.5 s_t), and the first sum is taken as sw sum_t w8_t (c_t - 7.5), so a rounding
  // error multiplies c - 7.5 (at most 7.5) instead of c.
  for (int64_t hr = 0; hr < H * R; ++hr) {
    const int64_t h = hr / R;
    const float* pr = p + hr * kTile;
    for (int64_t g = 0; g < ng; ++g) {
      const float* gs = ms + (h * ng + g) * kTile;
      const float* gz = mz + (h * ng + g) * kTile;
      V mx = _mm256_setzero_ps(), zs = _mm256_setzero_ps();
      for (int64_t t = 0; t < n8; t += 8) {
        const V pv = _mm256_loadu_ps(pr + t);
        mx = _mm256_max_ps(mx, _mm256_mul_ps(pv, _mm256_loadu_ps(gs + t)));
        zs = _mm256_fmadd_ps(pv, _mm256_loadu_ps(gz + t), zs);
      }
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
      const V inv = _mm256_set1_ps(amax > 0.f ? 255.f / amax : 0.f);
      uint8_t* out = w8 + (hr * ng + g) * kTile;
      __m256i wsum = _mm256_setzero_si256();
      for (int64_t t = 0; t < n8; t += 8) {
        const V w = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(pr + t), _mm256_loadu_ps(gs + t)), inv);
        const __m256i wi = _mm256_cvtps_epi32(w);  // <= 255 up to rounding; packus saturates
        wsum = _mm256_add_epi32(wsum, wi);
#if defined(__AVX512VL__)
        _mm_storel_epi64(reinterpret_cast<__m128i*>(out + t), _mm256_cvtusepi32_epi8(wi));
#else
        const __m128i w16 = _mm_packus_epi32(_mm256_castsi256_si128(wi), _mm256_extracti128_si256(wi, 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(out + t), _mm_packus_epi16(w16, w16));
#endif
      }
      const float sw = amax / 255.f;
      w8s[hr * ng + g] = sw;
      zg[hr * ng + g] = Simd256::reduce(zs) - 7.5f * sw * static_cast<float>(Simd256::reduce(_mm256_cvtepi32_ps(wsum)));
    }
  }
  acc_order(true);
  float* const accb = vs0.rot ? sc_.acc_rot.data() : sc_.acc.data();
  const int64_t nch = D / 64;
  uint8_t* xb = sc_.xb.data();
  const uint8_t* const* vrp = sc_.vrp.data();
  auto xv = [xb, nch](int64_t tg, int64_t c, int k) {
    return reinterpret_cast<__m256i*>(xb + ((tg * nch + c) * 8 + k) * 32);
  };
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t tg = 0; tg < n4 / 4; ++tg) {
      const uint8_t* rw[4];
      for (int64_t u = 0; u < 4; ++u) rw[u] = vrp[std::min(4 * tg + u, n - 1)] + h * hs;
      for (int64_t c = 0; c < nch; ++c) {
        __m256i x[8];
        i8::interleave4(rw[0] + 32 * c, rw[1] + 32 * c, rw[2] + 32 * c, rw[3] + 32 * c, x);
        for (int k = 0; k < 8; ++k) _mm256_storeu_si256(xv(tg, c, k), x[k]);
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      const int64_t hr = h * R + r;
      float* arow = accb + hr * D;
      for (int64_t c = 0; c < nch; ++c) {
        const int64_t glo = 64 * c / gc, ghi = (64 * c + 32) / gc;
        const uint8_t* wl = w8 + (hr * ng + glo) * kTile;
        const uint8_t* wh = w8 + (hr * ng + ghi) * kTile;
        __m256i a[8];
        for (int k = 0; k < 8; ++k) a[k] = _mm256_setzero_si256();
        for (int64_t tg = 0; tg < n4 / 4; ++tg) {
          int32_t bl, bh;
          std::memcpy(&bl, wl + 4 * tg, 4);
          std::memcpy(&bh, wh + 4 * tg, 4);
          const __m256i wv = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_set1_epi32(bl)),
                                                     _mm_set1_epi32(bh), 1);
          for (int k = 0; k < 8; ++k) a[k] = i8::dp4(a[k], wv, _mm256_loadu_si256(xv(tg, c, k)));
        }
        // lanes -> even/odd channel blocks J = 4 c + jp (evens at 16 J, odds at 16 J + 8)
        for (int jp = 0; jp < 4; ++jp) {
          const int k0 = (jp & 1) * 2;
          const __m256i ev = (jp < 2) ? _mm256_permute2x128_si256(a[k0], a[k0 + 1], 0x20)
                                      : _mm256_permute2x128_si256(a[k0], a[k0 + 1], 0x31);
          const __m256i od = (jp < 2) ? _mm256_permute2x128_si256(a[4 + k0], a[5 + k0], 0x20)
                                      : _mm256_permute2x128_si256(a[4 + k0], a[5 + k0], 0x31);
          const V s = _mm256_set1_ps(w8s[hr * ng + (64 * c + 16 * jp) / gc]);
          float* o = arow + 16 * (4 * c + jp);
          _mm256_storeu_ps(o, _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(ev), _mm256_loadu_ps(o)));
          _mm256_storeu_ps(o + 8, _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(od), _mm256_loadu_ps(o + 8)));
        }
      }
      for (int64_t g = 0; g < ng; ++g) {
        const V z = _mm256_set1_ps(zg[hr * ng + g]);
        float* a = arow + g * gc;
        for (int64_t j = 0; j < gc; j += 8)
          _mm256_storeu_ps(a + j, _mm256_add_ps(_mm256_loadu_ps(a + j), z));
      }
    }
  }
  return true;
}
#endif

}  // namespace attn
}  // namespace kernels
}  // namespace kvq
