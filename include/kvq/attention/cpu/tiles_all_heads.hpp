#pragma once
/// \file tiles_all_heads.hpp
/// Unit's all-heads tile loop (AVX2 and AVX-512 builds, head_dim a multiple of 16): tiles
/// gathered over pages, keys read token-major for every kv head, metadata, dot and axpy over
/// all heads, pre-RoPE key blocks (attention_cpu.hpp, "Design").
#include "kvq/attention/cpu/unit.hpp"

namespace kvq {
namespace kernels {
namespace attn {

#if KVQ_HAS_AVX2 && KVQ_HAS_F16C
template <class S>
bool Unit<S>::fast_stream(const Stream& st) {
  if (!st.packed) return st.rows.dim_contiguous();
  if (st.qjl) return false;
  if (st.lm) return true;
  if (st.scale == Scale::kExpand) return false;
  return st.scale != Scale::kGroup || st.box.gc % 16 == 0;
}
#endif

#if KVQ_HAS_AVX2 && KVQ_HAS_F16C
template <class S>
bool Unit<S>::same_kind(const Stream& a, const Stream& b) {
  if (a.packed != b.packed || !fast_stream(a) || !fast_stream(b)) return false;
  if (!a.packed) return a.rows.strides().head == b.rows.strides().head;
  return a.load == b.load && a.scale == b.scale && a.bits == b.bits && a.lm == b.lm &&
         a.rot == b.rot &&
         a.zeros == b.zeros && a.raw == b.raw && a.off == b.off && a.mul == b.mul &&
         a.box.gt == b.box.gt && a.box.gh == b.box.gh && a.box.gc == b.box.gc && a.ctx == b.ctx &&
         a.view.config.meta == b.view.config.meta && a.nout == b.nout && a.nuq == b.nuq &&
         a.fp4 == b.fp4 && (!a.nuq || std::memcmp(a.lut, b.lut, sizeof a.lut) == 0);
}
#endif

#if KVQ_HAS_AVX2 && KVQ_HAS_F16C
template <class S>
int64_t Unit<S>::next_tile(int64_t a, int64_t b, std::size_t& si, int64_t& t,
                           std::vector<Piece>& out) const {
  out.clear();
  int64_t tn = 0;
  for (; si < ws_.segs.size(); ++si) {
    const CacheSegment& seg = ws_.segs[si];
    const int64_t s0 = std::max(a, seg.begin), s1 = std::min(b, seg.end);
    if (s0 >= s1) continue;
    if (t < s0) t = s0;
    if (t >= s1) continue;
    const Stream& ks = ws_.ks[si];
    const Stream& vs = ws_.vs[si];
    if (tn > 0 && !(same_kind(ws_.ks[out.front().si], ks) && same_kind(ws_.vs[out.front().si], vs)))
      return tn;
    const bool alone = !(keys_in_tile(ks) && fast_stream(vs));
    while (t < s1) {
      int64_t e = std::min(s1, t + kTile - tn);
      for (const Stream* st : {&ks, &vs})
        if (st->packed && st->scale == Scale::kChannel) {
          const int64_t gt = st->box.gt, loc = t - seg.begin;
          e = std::min(e, seg.begin + (loc / gt + 1) * gt);
        }
      out.push_back(Piece{si, t - seg.begin, e - t, tn});
      tn += e - t;
      t = e;
      if (tn == kTile || alone) return tn;
    }
  }
  return tn;
}
#endif

#if KVQ_HAS_AVX2 && KVQ_HAS_F16C
template <class S>
void Unit<S>::acc_order(bool eo) {
  if (eo == acc_eo_) return;
  const int64_t D = P_.D, rows = P_.H * R_;
  auto conv = [&](float* x) {
    for (int64_t i = 0; i < rows; ++i) {
      if (eo) {
        avx2::to_eo(x + i * D, x + i * D, D);
      } else {
        avx2::from_eo(x + i * D, x + i * D, D);
      }
    }
  };
  conv(sc_.acc.data());
  if (P_.v_rot != nullptr) conv(sc_.acc_rot.data());
  acc_eo_ = eo;
}
#endif

#if KVQ_HAS_AVX2 && KVQ_HAS_F16C
template <class S>
void Unit<S>::run_tiles(int64_t a, int64_t b) {
  std::size_t si = 0;
  int64_t t = a;
  int64_t n = next_tile(a, b, si, t, sc_.pieces);
  for (const Piece& p : sc_.pieces) {
    prefetch_meta(ws_.ks[p.si], p);
    prefetch_meta(ws_.vs[p.si], p);
  }
  while (n > 0) {
    // the next tile, so that its metadata (read first thing when its keys are scored) is
    // prefetched while this tile is processed
    const int64_t nn = next_tile(a, b, si, t, sc_.next);
    const std::size_t si0 = sc_.pieces.front().si;
    if (keys_in_tile(ws_.ks[si0]) && fast_stream(ws_.vs[si0])) {
      for (const Piece& p : sc_.next) {
        prefetch_meta(ws_.ks[p.si], p);
        prefetch_meta(ws_.vs[p.si], p);
      }
      tile_all(n);
    } else {
      acc_order(false);
      for (const Piece& p : sc_.pieces) {
        const CacheSegment& seg = ws_.segs[p.si];
        for (int64_t h = 0; h < P_.H; ++h)
          tile(seg, ws_.ks[p.si], ws_.vs[p.si], h, seg.begin + p.loc0, seg.begin + p.loc0 + p.n);
      }
    }
    std::swap(sc_.pieces, sc_.next);
    n = nn;
  }
}
#endif

#if KVQ_HAS_AVX2 && KVQ_HAS_F16C
template <class S>
int64_t Unit<S>::row_ptrs(const std::vector<Stream>& streams, const std::vector<Piece>& pcs,
                          const uint8_t** rp, int64_t& span, uint8_t* ubuf) const {
  const int64_t H = P_.H, D = P_.D;
  int64_t hs = 0;
  for (const Piece& p : pcs) {
    const Stream& st = streams[p.si];
    if (st.packed && st.unpack) {
      const auto row = static_cast<std::size_t>(H * D);
      unpack_codes(st.view.codes, static_cast<std::size_t>(p.n) * row, st.bits,
                   ubuf + static_cast<std::size_t>(p.o) * row,
                   static_cast<std::size_t>(p.loc0) * row * static_cast<std::size_t>(st.bits));
      for (int64_t t = 0; t < p.n; ++t) rp[p.o + t] = ubuf + (p.o + t) * H * D;
      hs = D;
      span = H * D;
    } else if (st.packed) {
      hs = D * st.bits / 8;
      const uint8_t* base = st.view.codes + p.loc0 * H * hs;
      for (int64_t t = 0; t < p.n; ++t) rp[p.o + t] = base + t * H * hs;
      span = H * hs;
    } else {
      hs = st.rows.strides().head * static_cast<int64_t>(sizeof(float));
      for (int64_t t = 0; t < p.n; ++t)
        rp[p.o + t] = reinterpret_cast<const uint8_t*>(st.rows.row(p.loc0 + t, 0));
      span = (H - 1) * hs + D * static_cast<int64_t>(sizeof(float));
    }
  }
  return hs;
}
#endif

#if KVQ_HAS_AVX2 && KVQ_HAS_F16C
template <class S>
void Unit<S>::prefetch_meta(const Stream& st, const Piece& p) const {
  if (!st.packed || st.raw) return;
  const PackedView& v = st.view;
  const auto msz = st.fp4 ? int64_t{1} : static_cast<int64_t>(meta_size(v.config.meta));
  auto run = [](const uint8_t* base, int64_t from, int64_t to) {
    if (base == nullptr) return;
    for (int64_t o = from & ~int64_t{63}; o < to; o += 64)
      _mm_prefetch(reinterpret_cast<const char*>(base + o), _MM_HINT_T0);
  };
  if (st.lm) {
    run(v.norms, p.loc0 * P_.H * msz, (p.loc0 + p.n) * P_.H * msz);
    return;
  }
  const GroupBox& b = st.box;
  const int64_t g0 = b.index(p.loc0, 0, 0), g1 = b.index(p.loc0 + p.n - 1, P_.H - 1, P_.D - 1) + 1;
  run(v.scales, g0 * msz, g1 * msz);
  if (st.zeros) run(v.zeros, g0 * msz, g1 * msz);
}
#endif

#if KVQ_HAS_AVX2 && KVQ_HAS_F16C
template <class S>
void Unit<S>::prefetch_rows(const uint8_t* p, int64_t span) {
  for (int64_t o = 0; o < span; o += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p + o), _MM_HINT_T1);
}
#endif

#if KVQ_HAS_AVX2 && KVQ_HAS_F16C
template <class S>
void Unit<S>::meta_rows(const Stream& st, const Piece& p, int64_t h, float* ms, float* mz) const {
  const PackedView& v = st.view;
  const GroupBox& b = st.box;
  const MetaDType md = v.config.meta;
  if (st.lm) {
    for (int64_t t = 0; t < p.n; ++t) {
      ms[p.o + t] =
          detail::load_meta(v.norms, md, static_cast<std::size_t>((p.loc0 + t) * P_.H + h));
      mz[p.o + t] = 0.f;
    }
    return;
  }
  const int64_t ng = st.scale == Scale::kGroup ? P_.D / b.gc : 1;
  int64_t tb = p.loc0 / b.gt, tr = p.loc0 % b.gt;
  const int64_t hb = h / b.gh;
  for (int64_t t = 0; t < p.n; tr = 0, ++tb) {  // runs of tokens sharing one token block
    const int64_t len = std::min(p.n - t, b.gt - tr);
    const auto g0 = static_cast<std::size_t>((tb * b.nh + hb) * b.nc);
    for (int64_t g = 0; g < ng; ++g) {
      const std::size_t i = g0 + static_cast<std::size_t>(g);
      const float sc = st.fp4 ? fp4_scale(st, v.scales[i]) : detail::load_meta(v.scales, md, i);
      const float z =
          st.zeros ? detail::load_meta(v.zeros, md, g0 + static_cast<std::size_t>(g)) : 0.f;
      std::fill_n(ms + g * kTile + p.o + t, len, sc * st.mul);
      std::fill_n(mz + g * kTile + p.o + t, len, z - st.off * sc);
    }
    t += len;
  }
}
#endif

#if KVQ_HAS_AVX2 && KVQ_HAS_F16C
template <class S>
avx2::V Unit<S>::meta8(const uint8_t* base, MetaDType md, std::size_t i) {
  if (md == MetaDType::kF16)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(base + 2 * i)));
  return _mm256_loadu_ps(reinterpret_cast<const float*>(base + 4 * i));
}
#endif

#if KVQ_HAS_AVX2 && KVQ_HAS_F16C
template <class S>
avx2::V Unit<S>::fp4_scale8(const Stream& st, const uint8_t* codes) {
  // 8 block-scale bytes -> fl(stab[byte] * tscale) per lane: fp4_scale's result in every lane
  const __m256i idx =
      _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes)));
  return _mm256_mul_ps(_mm256_i32gather_ps(st.stab, idx, 4), _mm256_set1_ps(st.tscale));
}
#endif

#if KVQ_HAS_AVX2 && KVQ_HAS_F16C
template <class S>
void Unit<S>::transpose8(avx2::V* v) {
  using V = avx2::V;
  const V t0 = _mm256_unpacklo_ps(v[0], v[1]), t1 = _mm256_unpackhi_ps(v[0], v[1]);
  const V t2 = _mm256_unpacklo_ps(v[2], v[3]), t3 = _mm256_unpackhi_ps(v[2], v[3]);
  const V t4 = _mm256_unpacklo_ps(v[4], v[5]), t5 = _mm256_unpackhi_ps(v[4], v[5]);
  const V t6 = _mm256_unpacklo_ps(v[6], v[7]), t7 = _mm256_unpackhi_ps(v[6], v[7]);
  const V u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const V u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const V u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const V u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  v[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  v[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  v[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  v[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  v[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  v[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  v[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  v[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}
#endif

#if KVQ_HAS_AVX2 && KVQ_HAS_F16C
template <class S>
bool Unit<S>::meta_token_groups(const Stream& st, const Piece& p, int64_t ng, float* ms,
                                float* mz) const {
  using V = avx2::V;
  const GroupBox& b = st.box;
  const int64_t cols = P_.H * ng;
  if (st.lm || b.gt != 1 || b.gh != 1 || b.nc != ng || cols % 8 != 0) return false;
  const PackedView& v = st.view;
  const MetaDType md = v.config.meta;
  const V mul = _mm256_set1_ps(st.mul), off = _mm256_set1_ps(st.off);
  int64_t t = 0;
  for (; t + 8 <= p.n; t += 8)
    for (int64_t c = 0; c < cols; c += 8) {
      V sv[8], zv[8];
      for (int u = 0; u < 8; ++u) {
        const auto i = static_cast<std::size_t>((p.loc0 + t + u) * cols + c);
        sv[u] = st.fp4 ? fp4_scale8(st, v.scales + i) : meta8(v.scales, md, i);
        zv[u] = st.zeros ? meta8(v.zeros, md, i) : _mm256_setzero_ps();
      }
      transpose8(sv);
      if (st.zeros) transpose8(zv);
      for (int k = 0; k < 8; ++k) {
        _mm256_storeu_ps(ms + (c + k) * kTile + p.o + t, _mm256_mul_ps(sv[k], mul));
        _mm256_storeu_ps(mz + (c + k) * kTile + p.o + t, _mm256_fnmadd_ps(off, sv[k], zv[k]));
      }
    }
  for (; t < p.n; ++t)
    for (int64_t c = 0; c < cols; ++c) {
      const auto i = static_cast<std::size_t>((p.loc0 + t) * cols + c);
      const float sc = st.fp4 ? fp4_scale(st, v.scales[i]) : detail::load_meta(v.scales, md, i);
      const float z = st.zeros ? detail::load_meta(v.zeros, md, i) : 0.f;
      ms[c * kTile + p.o + t] = sc * st.mul;
      mz[c * kTile + p.o + t] = z - st.off * sc;
    }
  return true;
}
#endif

#if KVQ_HAS_AVX2 && KVQ_HAS_F16C
template <class S>
void Unit<S>::meta_channel(const Stream& st, int64_t t0, int64_t h, float* ms, float* mz) const {
  using V = avx2::V;
  const GroupBox& b = st.box;
  const PackedView& v = st.view;
  const MetaDType md = v.config.meta;
  const int64_t D = P_.D;
  const auto g0 = static_cast<std::size_t>(((t0 / b.gt) * b.nh + h / b.gh) * b.nc);
  if (b.gc != 1 || D % 8 != 0) {
    tile_meta(st, t0, 1, h, ms, mz, nullptr);
    return;
  }
  const V mul = _mm256_set1_ps(st.mul), off = _mm256_set1_ps(st.off);
  for (int64_t d = 0; d < D; d += 8) {
    const V sv = meta8(v.scales, md, g0 + static_cast<std::size_t>(d));
    const V zv =
        st.zeros ? meta8(v.zeros, md, g0 + static_cast<std::size_t>(d)) : _mm256_setzero_ps();
    _mm256_storeu_ps(ms + d, _mm256_mul_ps(sv, mul));
    _mm256_storeu_ps(mz + d, _mm256_fnmadd_ps(off, sv, zv));
  }
}
#endif

#if KVQ_HAS_AVX2 && KVQ_HAS_F16C
template <class S>
void Unit<S>::meta_tile(const std::vector<Stream>& streams, int64_t n, int64_t ng, float* ms,
                        float* mz) const {
  const int64_t n8 = (n + 7) & ~int64_t{7};
  for (const Piece& p : sc_.pieces) {
    if (meta_token_groups(streams[p.si], p, ng, ms, mz)) continue;
    for (int64_t h = 0; h < P_.H; ++h)
      meta_rows(streams[p.si], p, h, ms + h * ng * kTile, mz + h * ng * kTile);
  }
  for (int64_t c = 0; c < P_.H * ng; ++c)
    for (int64_t t = n; t < n8; ++t) ms[c * kTile + t] = mz[c * kTile + t] = 0.f;
}
#endif

#if KVQ_HAS_AVX2 && KVQ_HAS_F16C
template <class S>
template <int TB, class MakeKL>
void Unit<S>::dot_heads(int64_t a, int64_t b, int64_t n, const float* q, int64_t qh,
                        const MakeKL& make, int64_t kspan, int64_t vspan) {
  const int64_t D = P_.D, njp = D / 16, R = R_, H = P_.H;
  const uint8_t* const* krp = sc_.krp.data();
  const uint8_t* const* vrp = sc_.vrp.data();
  float* sc = sc_.s.data();
  auto rows = [&](int64_t t, auto tb) {
    constexpr int T = decltype(tb)::value;
    for (int u = 0; u < T; ++u) {
      if (t + u + kKeyAhead < n) prefetch_rows(krp[t + u + kKeyAhead], kspan);
      prefetch_rows(vrp[t + u], vspan);
    }
    for (int64_t h = 0; h < H; ++h) {
      const auto kl = make(h);
      const float* qr = q + h * qh;
      float* s = sc + h * R * kTile;
      int64_t r = 0;
      if constexpr (T == 1 || T == 2 || (avx2::kWide && T == 4))
        for (; r + 4 <= R; r += 4)
          avx2::dot_blk<4, T>(kl, t, njp, qr + r * D, D, s + r * kTile, kTile);
      if constexpr (T <= 4)
        for (; r + 2 <= R; r += 2)
          avx2::dot_blk<2, T>(kl, t, njp, qr + r * D, D, s + r * kTile, kTile);
      for (; r < R; ++r) avx2::dot_blk<1, T>(kl, t, njp, qr + r * D, D, s + r * kTile, kTile);
    }
  };
  int64_t t = a;
  for (; t + TB <= b; t += TB) rows(t, std::integral_constant<int, TB>());
  for (; t < b; ++t) rows(t, std::integral_constant<int, 1>());
}
#endif

#if KVQ_HAS_AVX2 && KVQ_HAS_F16C
template <class S>
template <class MakeKL>
void Unit<S>::dot_all(int64_t a, int64_t b, int64_t n, const float* q, int64_t qh,
                      const MakeKL& make, int64_t kspan, int64_t vspan) {
  if (R_ >= 4) {
    dot_heads<avx2::kWide ? 4 : 2>(a, b, n, q, qh, make, kspan, vspan);
  } else if (R_ >= 2) {
    dot_heads<4>(a, b, n, q, qh, make, kspan, vspan);
  } else {
    dot_heads<8>(a, b, n, q, qh, make, kspan, vspan);
  }
}
#endif

#if KVQ_HAS_AVX2 && KVQ_HAS_F16C
template <class S>
template <class MakeVL>
void Unit<S>::axpy_all(int64_t a, int64_t b, const float* w, int64_t wr, int64_t wg, int64_t gc,
                       float* base, const MakeVL& make) {
  const int64_t D = P_.D, njp = D / 16, R = R_, H = P_.H;
  for (int64_t t0 = a; t0 < b; t0 += avx2::kTokBlock) {
    const int64_t t1 = std::min(b, t0 + avx2::kTokBlock);
    for (int64_t h = 0; h < H; ++h) {
      const auto vl = make(h);
      int64_t r = 0;
      // channel pairs per block: 8 (AVX2) or 16 (AVX-512) vector accumulators
      constexpr int kJ = avx2::kWide ? 2 : 1;
      for (; r + 4 <= R; r += 4)
        avx2::axpy_tokens<4, kJ>(vl, t0, t1, njp, w + (h * R + r) * wr, wr, wg, gc,
                                 base + (h * R + r) * D, D);
      for (; r + 2 <= R; r += 2)
        avx2::axpy_tokens<2, 2 * kJ>(vl, t0, t1, njp, w + (h * R + r) * wr, wr, wg, gc,
                                     base + (h * R + r) * D, D);
      for (; r < R; ++r)
        avx2::axpy_tokens<1, 4 * kJ>(vl, t0, t1, njp, w + (h * R + r) * wr, wr, wg, gc,
                                     base + (h * R + r) * D, D);
    }
  }
}
#endif

#if KVQ_HAS_AVX2 && KVQ_HAS_F16C
template <class S>
int64_t Unit<S>::rope_keys_all(int64_t a, int64_t b, int64_t& span) {
  const int64_t H = P_.H, D = P_.D;
  float* kr = sc_.krow.data();
  for (const Piece& p : sc_.pieces) {
    const int64_t lo = std::max(a, p.o), hi = std::min(b, p.o + p.n);
    if (lo >= hi) continue;
    const Stream& ks = ws_.ks[p.si];
    const int64_t loc = p.loc0 + (lo - p.o);
    const int64_t tr0 = rope_table(ws_.segs[p.si].begin + loc, hi - lo);
    for (int64_t h = 0; h < H; ++h) {
      if (ks.packed) tile_meta(ks, loc, hi - lo, h, sc_.kms.data(), sc_.kmz.data(), sc_.kq.data());
      for (int64_t t = lo; t < hi; ++t)
        rope_key_row(ks, loc + (t - lo), h, t - lo, tr0 + (t - lo), kr + ((t - a) * H + h) * D);
    }
  }
  for (int64_t t = a; t < b; ++t)
    sc_.krp[static_cast<std::size_t>(t)] = reinterpret_cast<const uint8_t*>(kr + (t - a) * H * D);
  span = H * D * static_cast<int64_t>(sizeof(float));
  return D * static_cast<int64_t>(sizeof(float));
}
#endif

#if KVQ_HAS_AVX2 && KVQ_HAS_F16C
template <class S>
void Unit<S>::tile_all(int64_t n) {
  using V = avx2::V;
  const auto& pcs = sc_.pieces;
  const int64_t R = R_, H = P_.H;
  const Stream& ks0 = ws_.ks[pcs.front().si];
  const Stream& vs0 = ws_.vs[pcs.front().si];
  const int64_t t0 = ws_.segs[pcs.front().si].begin + pcs.front().loc0;
  int64_t kspan = 0, vspan = 0;
  const int64_t vhs = row_ptrs(ws_.vs, pcs, sc_.vrp.data(), vspan, sc_.vub.data());
  if (P_.rope != nullptr) {
    // ---- pre-RoPE keys: the tile's rows of every head decoded and rotated into f32 rows
    // (sc_.krow, [n, H, D]), then scored by the same all-heads kernels as f32 keys
    rope_table(t0, n);
    const float* qs = ws_.qs.data() + i0_ * P_.G * P_.D;
    const uint8_t* const* rp = sc_.krp.data();
    const int64_t khs = P_.D * static_cast<int64_t>(sizeof(float));
    auto plain = [rp, khs](int64_t h) {
      const int64_t off = h * khs;
      return [rp, off](int64_t t, int64_t jp) {
        return avx2::ld2<Load::kF32>(rp[t] + off, jp, nullptr);
      };
    };
    for (int64_t a = 0; a < n; a += kRopeBlock) {
      const int64_t b = std::min(n, a + kRopeBlock);
      rope_keys_all(a, b, kspan);
      dot_all(a, b, b, qs, P_.nq * P_.G * P_.D, plain, kspan, vspan);
    }
  } else {
    const int64_t khs = row_ptrs(ws_.ks, pcs, sc_.krp.data(), kspan, sc_.kub.data());
    for (int64_t t = 0; t < std::min(n, kKeyAhead); ++t)
      prefetch_rows(sc_.krp[static_cast<std::size_t>(t)], kspan);
    // ---- keys: scores [H, R, n]
    with_load(ks0.packed ? ks0.load : Load::kF32,
              [&](auto LC) { score_all<LC.value>(n, khs, kspan, vspan); });
  }
  if (ks0.nout > 0 && P_.rope == nullptr)
    for (const Piece& p : pcs)
      for (int64_t h = 0; h < H; ++h)
        outlier_scores(ws_.ks[p.si], p.loc0, p.n, h,
                       ws_.qs.data() + (h * P_.nq * P_.G + i0_ * P_.G) * P_.D,
                       sc_.s.data() + h * R * kTile + p.o);
  // ---- masks and soft-cap (mask.hpp), online softmax: weights into sc (entries [n, n8) are 0)
  float* sc = sc_.s.data();
  const int64_t n8 = (n + 7) & ~int64_t{7};
  for (int64_t h = 0; h < H; ++h)
    for (int64_t r = 0; r < R; ++r) {
      float* s = sc + (h * R + r) * kTile;
      if (!mask_logits(P_, i0_ + r / P_.G, t0, n, n8, s)) continue;  // sees none of the tile
      const std::size_t st = static_cast<std::size_t>(h * R + r);
      V mv = _mm256_loadu_ps(s);
      for (int64_t t = 8; t < n8; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + t));
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      float alpha;
      if (sc_.sm[st].raise(_mm_cvtss_f32(m4), softmax_exp, &alpha)) {
        rescale(row_acc(sc_.acc.data(), h, r), alpha);
        if (P_.v_rot != nullptr) rescale(row_acc(sc_.acc_rot.data(), h, r), alpha);
        if (P_.v_ctx != nullptr) {
          rescale(row_acc(sc_.sacc.data(), h, r), alpha);
          sc_.sconst[st] *= alpha;
        }
      }
      const float mnew = sc_.sm[st].m;
      V sum = _mm256_setzero_ps();
      const V mneg = _mm256_set1_ps(-mnew);
      for (int64_t t = 0; t < n8; t += 8) {
        const V e = Simd256::exp(_mm256_add_ps(_mm256_loadu_ps(s + t), mneg));
        _mm256_storeu_ps(s + t, e);
        sum = _mm256_add_ps(sum, e);
      }
      sc_.sm[st].l += Simd256::reduce(sum);
    }
  // ---- values
  with_load(vs0.packed ? vs0.load : Load::kF32, [&](auto LC) { accumulate_all<LC.value>(n, vhs); });
  if (vs0.nout > 0)
    for (const Piece& p : pcs)
      for (int64_t h = 0; h < H; ++h)
        outlier_values(ws_.vs[p.si], p.loc0, p.n, h, sc + h * R * kTile + p.o,
                       row_acc(sc_.acc.data(), h, 0), acc_eo_);
}
#endif

#if KVQ_HAS_AVX2 && KVQ_HAS_F16C
template <class S>
template <Load L>
void Unit<S>::score_all(int64_t n, int64_t hs, int64_t kspan, int64_t vspan) {
  using V = avx2::V;
  const auto& pcs = sc_.pieces;
  const int64_t D = P_.D, R = R_, H = P_.H, HR = P_.nq * P_.G;
  const Stream& ks0 = ws_.ks[pcs.front().si];
  if constexpr (L == Load::kU4 || L == Load::kU8)
    if (int8_keys(ks0, L)) {
      score_int8<L>(n, hs, kspan, vspan);
      return;
    }
  constexpr bool eo = avx2::eo_order(L);  // 4-bit codes: queries in even/odd order
  // head h at + h * HR * D; rotated keys (Lloyd-Max, /rot) read the rotated queries
  const float* qs = (eo ? (ks0.rot ? ws_.qrot_eo : ws_.qs_eo) : (ks0.rot ? ws_.qrot : ws_.qs)).data() +
                    i0_ * P_.G * D;
  float* sc = sc_.s.data();
  float* ms = sc_.kms.data();
  float* mz = sc_.kmz.data();
  const uint8_t* const* rp = sc_.krp.data();
  const float* lut = ks0.lut;
  auto plain = [rp, hs, lut](int64_t h) {
    const int64_t off = h * hs;
    return [rp, off, lut](int64_t t, int64_t jp) { return avx2::ld2<L>(rp[t] + off, jp, lut); };
  };
  if (!ks0.packed || ks0.raw) {
    dot_all(0, n, n, qs, HR * D, plain, kspan, vspan);
    return;
  }
  if (ks0.lm) {
    meta_tile(ws_.ks, n, 1, ms, mz);
    const float* qr = (eo ? ws_.qrot_eo : ws_.qrot).data() + i0_ * P_.G * D;
    dot_all(0, n, n, qr, HR * D, plain, kspan, vspan);
    for (int64_t h = 0; h < H; ++h)
      for (int64_t r = 0; r < R; ++r)
        for (int64_t t = 0; t < n; ++t) sc[(h * R + r) * kTile + t] *= ms[h * kTile + t];
    return;
  }
  switch (ks0.scale) {
    case Scale::kRow: {
      meta_tile(ws_.ks, n, 1, ms, mz);
      dot_all(0, n, n, qs, HR * D, plain, kspan, vspan);
      for (int64_t h = 0; h < H; ++h) {
        const float* qsum = (ks0.rot ? ws_.qrotsum : ws_.qsum).data() + h * HR + i0_ * P_.G;
        for (int64_t r = 0; r < R; ++r) {
          float* o = sc + (h * R + r) * kTile;
          const float qr = qsum[r];
          const float* hms = ms + h * kTile;
          const float* hmz = mz + h * kTile;
          for (int64_t t = 0; t < n; ++t) o[t] = std::fma(hms[t], o[t], hmz[t] * qr);
        }
      }
      return;
    }
    case Scale::kGroup: {
      const int64_t gc = ks0.box.gc, ng = D / gc;
      meta_tile(ws_.ks, n, ng, ms, mz);
      auto deq = [rp, hs, lut, gc, ng, ms, mz](int64_t h) {
        const int64_t off = h * hs;
        const float* hms = ms + h * ng * kTile;
        const float* hmz = mz + h * ng * kTile;
        return [rp, off, lut, gc, hms, hmz](int64_t t, int64_t jp) {
          const int64_t g = (16 * jp / gc) * kTile + t;
          return avx2::fma_bcast(avx2::ld2<L>(rp[t] + off, jp, lut), hms + g, hmz + g);
        };
      };
      dot_all(0, n, n, qs, HR * D, deq, kspan, vspan);
      return;
    }
    default: {                    // kChannel: per block, the block's scales folded into the queries
      float* qf = sc_.qf.data();  // [H, R, D]
      float* qz = sc_.qz.data();  // [H, R]
      qs = (ks0.rot ? ws_.qrot : ws_.qs).data() + i0_ * P_.G * D;  // natural order, then permuted
      for (const Piece& p : pcs) {
        for (int64_t h = 0; h < H; ++h) {
          meta_channel(ws_.ks[p.si], p.loc0, h, ms, mz);
          for (int64_t r = 0; r < R; ++r) {
            V z = _mm256_setzero_ps();
            const float* qr = qs + h * HR * D + r * D;
            float* f = qf + (h * R + r) * D;
            for (int64_t j = 0; j < D; j += 8) {
              const V q = _mm256_loadu_ps(qr + j);
              _mm256_storeu_ps(f + j, _mm256_mul_ps(q, _mm256_loadu_ps(ms + j)));
              z = _mm256_fmadd_ps(q, _mm256_loadu_ps(mz + j), z);
            }
            qz[h * R + r] = Simd256::reduce(z);
          }
        }
        if constexpr (eo)
          for (int64_t v = 0; v < H * R; ++v) avx2::to_eo(qf + v * D, qf + v * D, D);
        dot_all(p.o, p.o + p.n, n, qf, R * D, plain, kspan, vspan);
        for (int64_t h = 0; h < H; ++h)
          for (int64_t r = 0; r < R; ++r) {
            float* o = sc + (h * R + r) * kTile + p.o;
            const float z = qz[h * R + r];
            for (int64_t t = 0; t < p.n; ++t) o[t] += z;
          }
      }
      return;
    }
  }
}
#endif

#if KVQ_HAS_AVX2 && KVQ_HAS_F16C
template <class S>
template <Load L>
void Unit<S>::accumulate_all(int64_t n, int64_t hs) {
  using V = avx2::V;
  const auto& pcs = sc_.pieces;
  const int64_t D = P_.D, R = R_, H = P_.H;
  const Stream& vs0 = ws_.vs[pcs.front().si];
  if constexpr (L == Load::kU4)
    if (int8_values(vs0, L) && accumulate_int8<L>(n, hs)) return;
  acc_order(vs0.packed && avx2::eo_order(L));
  const float* p = sc_.s.data();
  float* ms = sc_.vms.data();
  float* mz = sc_.vmz.data();
  const uint8_t* const* rp = sc_.vrp.data();
  const float* lut = vs0.lut;
  const int64_t n8 = (n + 7) & ~int64_t{7};
  auto plain = [rp, hs, lut](int64_t h) {
    const int64_t off = h * hs;
    return [rp, off, lut](int64_t t, int64_t jp) { return avx2::ld2<L>(rp[t] + off, jp, lut); };
  };
  if (!vs0.packed || vs0.raw) {
    axpy_all(0, n, p, kTile, 0, 0, sc_.acc.data(), plain);
    return;
  }
  float* const accb = vs0.rot ? sc_.acc_rot.data() : sc_.acc.data();  // rotated: R^T in finish()
  if (vs0.scale == Scale::kChannel && !vs0.lm) {
    // the block's per-channel vectors, [H, D], dequantized in the loader
    for (const Piece& pc : pcs) {
      for (int64_t h = 0; h < H; ++h)
        meta_channel(ws_.vs[pc.si], pc.loc0, h, ms + h * D, mz + h * D);
      if constexpr (avx2::eo_order(L))
        for (int64_t h = 0; h < H; ++h) {
          avx2::to_eo(ms + h * D, ms + h * D, D);
          avx2::to_eo(mz + h * D, mz + h * D, D);
        }
      auto deq = [rp, hs, lut, ms, mz, D](int64_t h) {
        const int64_t off = h * hs;
        const float* hms = ms + h * D;
        const float* hmz = mz + h * D;
        return [rp, off, lut, hms, hmz](int64_t t, int64_t jp) {
          return avx2::fma_vec(avx2::ld2<L>(rp[t] + off, jp, lut), hms + 16 * jp, hmz + 16 * jp);
        };
      };
      axpy_all(pc.o, pc.o + pc.n, p, kTile, 0, 0, accb, deq);
    }
    return;
  }
  if (vs0.lm || vs0.scale == Scale::kRow) {
    // w = p * s (row scale or norm); zero points: one scalar per row.
    meta_tile(ws_.vs, n, 1, ms, mz);
    float* w = sc_.w.data();
    for (int64_t h = 0; h < H; ++h)
      for (int64_t r = 0; r < R; ++r) {
        V zs = _mm256_setzero_ps();
        const float* pr = p + (h * R + r) * kTile;
        float* wr = w + (h * R + r) * kTile;
        for (int64_t t = 0; t < n8; t += 8) {
          const V pv = _mm256_loadu_ps(pr + t);
          _mm256_storeu_ps(wr + t, _mm256_mul_ps(pv, _mm256_loadu_ps(ms + h * kTile + t)));
          zs = _mm256_fmadd_ps(pv, _mm256_loadu_ps(mz + h * kTile + t), zs);
        }
        sc_.zacc[static_cast<std::size_t>(h * R + r)] = Simd256::reduce(zs);
      }
    float* acc = accb;
    axpy_all(0, n, w, kTile, 0, 0, acc, plain);
    if (!vs0.lm && (vs0.zeros || vs0.off != 0.f)) {
      for (int64_t hr = 0; hr < H * R; ++hr) {
        float* a = acc + hr * D;
        const V z = _mm256_set1_ps(sc_.zacc[static_cast<std::size_t>(hr)]);
        for (int64_t j = 0; j < D; j += 8)
          _mm256_storeu_ps(a + j, _mm256_add_ps(_mm256_loadu_ps(a + j), z));
      }
    }
    return;
  }
  // kGroup: w'[h, r, g, t] = p[h, r, t] * s[h, g, t]; zero points: one sum per row and group.
  const int64_t gc = vs0.box.gc, ng = D / gc;
  meta_tile(ws_.vs, n, ng, ms, mz);
  float* wg = sc_.wg.data();
  float* zg = sc_.zg.data();
  for (int64_t h = 0; h < H; ++h)
    for (int64_t r = 0; r < R; ++r)
      for (int64_t g = 0; g < ng; ++g) {
        V zs = _mm256_setzero_ps();
        const float* pr = p + (h * R + r) * kTile;
        const float* gs = ms + (h * ng + g) * kTile;
        const float* gz = mz + (h * ng + g) * kTile;
        float* wo = wg + ((h * R + r) * ng + g) * kTile;
        for (int64_t t = 0; t < n8; t += 8) {
          const V pv = _mm256_loadu_ps(pr + t);
          _mm256_storeu_ps(wo + t, _mm256_mul_ps(pv, _mm256_loadu_ps(gs + t)));
          zs = _mm256_fmadd_ps(pv, _mm256_loadu_ps(gz + t), zs);
        }
        zg[(h * R + r) * ng + g] = Simd256::reduce(zs);
      }
  float* acc = accb;
  axpy_all(0, n, wg, ng * kTile, kTile, gc, acc, plain);
  for (int64_t hr = 0; hr < H * R; ++hr)
    for (int64_t g = 0; g < ng; ++g) {
      const V z = _mm256_set1_ps(zg[hr * ng + g]);
      float* a = acc + hr * D + g * gc;
      for (int64_t j = 0; j < gc; j += 8)
        _mm256_storeu_ps(a + j, _mm256_add_ps(_mm256_loadu_ps(a + j), z));
    }
}
#endif

}  // namespace attn
}  // namespace kernels
}  // namespace kvq
