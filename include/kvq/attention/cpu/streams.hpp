#pragma once
/// \file streams.hpp
/// Packed streams of the per-head path: loading a chunk of codes as floats, the dot and
/// axpy microkernels over token blocks, stream setup from a PackedView, row and metadata access
/// of a tile, row decoding and one-row RoPE.
#include "kvq/attention/cpu/problem.hpp"

namespace kvq {
namespace kernels {
namespace attn {

template <class S, Load L>
inline typename S::V load_chunk(const uint8_t* row, int64_t j, const float* lut) {
  constexpr int W = S::W;
  if constexpr (W == 1 && (L == Load::kF32 || L == Load::kF16 || L == Load::kBF16)) {
    if constexpr (L == Load::kF32) {
      float f;
      std::memcpy(&f, row + 4 * j, 4);
      return f;
    } else {
      uint16_t h;
      std::memcpy(&h, row + 2 * j, 2);
      return L == Load::kF16 ? S::from_f16(&h) : S::from_bf16(&h);
    }
  } else if constexpr (L == Load::kF32) {
    return S::load(reinterpret_cast<const float*>(row) + j * W);
  } else if constexpr (L == Load::kF16) {
    return S::from_f16(reinterpret_cast<const uint16_t*>(row) + j * W);
  } else if constexpr (L == Load::kBF16) {
    return S::from_bf16(reinterpret_cast<const uint16_t*>(row) + j * W);
  } else if constexpr (L == Load::kU8) {
    return S::cvt(S::codes_u8(row + j * W));
  } else if constexpr (L == Load::kE4M3) {
    return S::from_e4m3(row + j * W);
  } else if constexpr (L == Load::kE5M2) {
    return S::from_e5m2(row + j * W);
  } else if constexpr (L == Load::kLut8) {
    return S::lut(S::codes_u8(row + j * W), lut);
  } else if constexpr (W >= 4) {
    if constexpr (L == Load::kU4) return S::cvt(S::codes_u4(row + j * W / 2));
    if constexpr (L == Load::kU2) return S::cvt(S::codes_u2(row + j * W / 4));
    if constexpr (L == Load::kLut4) return S::lut(S::codes_u4(row + j * W / 2), lut);
  }
  return S::zero();  // unreachable: the stream setup never picks these for narrow vectors
}

/// Scores of 4 tokens (t .. t+3) x RB query rows: sc[r * kTile + t + u] = q[r, :] . kl(t + u, :).
/// 4 x RB independent FMA chains hide the FMA latency; one reduce4 per row gives the four
/// tokens' sums in one store.
template <class S, int RB, class KL>
inline void dot_block4(const KL& kl, int64_t t, int64_t nj, const float* q, int64_t D, float* sc) {
  using V = typename S::V;
  V a[4][RB];
  for (int u = 0; u < 4; ++u)
    for (int r = 0; r < RB; ++r) a[u][r] = S::zero();
  for (int64_t j = 0; j < nj; ++j) {
    const V k0 = kl(t, j), k1 = kl(t + 1, j), k2 = kl(t + 2, j), k3 = kl(t + 3, j);
    for (int r = 0; r < RB; ++r) {
      const V qv = S::load(q + r * D + j * S::W);
      a[0][r] = S::fma(qv, k0, a[0][r]);
      a[1][r] = S::fma(qv, k1, a[1][r]);
      a[2][r] = S::fma(qv, k2, a[2][r]);
      a[3][r] = S::fma(qv, k3, a[3][r]);
    }
  }
  for (int r = 0; r < RB; ++r) S::reduce4(a[0][r], a[1][r], a[2][r], a[3][r], sc + r * kTile + t);
}

template <class S, int RB, class KL>
inline void dot_block1(const KL& kl, int64_t t, int64_t nj, const float* q, int64_t D, float* sc) {
  using V = typename S::V;
  V a[RB];
  for (int r = 0; r < RB; ++r) a[r] = S::zero();
  for (int64_t j = 0; j < nj; ++j) {
    const V k = kl(t, j);
    for (int r = 0; r < RB; ++r) a[r] = S::fma(S::load(q + r * D + j * S::W), k, a[r]);
  }
  for (int r = 0; r < RB; ++r) sc[r * kTile + t] = S::reduce(a[r]);
}

template <class S, int RB, class KL>
inline void dot_tokens(const KL& kl, int64_t n, int64_t nj, const float* q, int64_t D, float* sc) {
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) dot_block4<S, RB>(kl, t, nj, q, D, sc);
  for (; t < n; ++t) dot_block1<S, RB>(kl, t, nj, q, D, sc);
}

/// sc[r * kTile + t] = q[r, :] . kl(t, :) for R rows of q (stride D) and n tokens.
template <class S, class KL>
inline void dot_rows(const KL& kl, int64_t n, int64_t nj, const float* q, int64_t D, int64_t R,
                     float* sc) {
  int64_t r = 0;
  for (; r + 4 <= R; r += 4) dot_tokens<S, 4>(kl, n, nj, q + r * D, D, sc + r * kTile);
  if (r + 2 <= R) {
    dot_tokens<S, 2>(kl, n, nj, q + r * D, D, sc + r * kTile);
    r += 2;
  }
  if (r < R) dot_tokens<S, 1>(kl, n, nj, q + r * D, D, sc + r * kTile);
}

/// acc[r, :] += sum_t w[r, t] * vl(t, :) for RB rows (acc stride D, w stride kTile); tokens
/// alternate between two accumulator sets (2 x RB independent FMA chains).
template <class S, int RB, class VL>
inline void axpy_block(const VL& vl, int64_t nt, int64_t nj, const float* w, float* acc,
                       int64_t D) {
  using V = typename S::V;
  for (int64_t j = 0; j < nj; ++j) {
    V a[RB], b[RB];
    for (int r = 0; r < RB; ++r) {
      a[r] = S::load(acc + r * D + j * S::W);
      b[r] = S::zero();
    }
    int64_t t = 0;
    for (; t + 2 <= nt; t += 2) {
      const V v0 = vl(t, j), v1 = vl(t + 1, j);
      for (int r = 0; r < RB; ++r) {
        a[r] = S::fma(S::set1(w[r * kTile + t]), v0, a[r]);
        b[r] = S::fma(S::set1(w[r * kTile + t + 1]), v1, b[r]);
      }
    }
    if (t < nt) {
      const V v0 = vl(t, j);
      for (int r = 0; r < RB; ++r) a[r] = S::fma(S::set1(w[r * kTile + t]), v0, a[r]);
    }
    for (int r = 0; r < RB; ++r) S::store(acc + r * D + j * S::W, S::add(a[r], b[r]));
  }
}

template <class S, class VL>
inline void axpy_rows(const VL& vl, int64_t nt, int64_t nj, const float* w, float* acc, int64_t D,
                      int64_t n) {
  int64_t r = 0;
  for (; r + 8 <= n; r += 8) axpy_block<S, 8>(vl, nt, nj, w + r * kTile, acc + r * D, D);
  if (r + 4 <= n) {
    axpy_block<S, 4>(vl, nt, nj, w + r * kTile, acc + r * D, D);
    r += 4;
  }
  if (r + 2 <= n) {
    axpy_block<S, 2>(vl, nt, nj, w + r * kTile, acc + r * D, D);
    r += 2;
  }
  if (r < n) axpy_block<S, 1>(vl, nt, nj, w + r * kTile, acc + r * D, D);
}

/// Dispatches a run-time Load to a compile-time one.
template <class F>
inline void with_load(Load l, F&& f) {
  switch (l) {
    case Load::kF32:
      return f(std::integral_constant<Load, Load::kF32>());
    case Load::kF16:
      return f(std::integral_constant<Load, Load::kF16>());
    case Load::kBF16:
      return f(std::integral_constant<Load, Load::kBF16>());
    case Load::kU8:
      return f(std::integral_constant<Load, Load::kU8>());
    case Load::kU4:
      return f(std::integral_constant<Load, Load::kU4>());
    case Load::kU2:
      return f(std::integral_constant<Load, Load::kU2>());
    case Load::kE4M3:
      return f(std::integral_constant<Load, Load::kE4M3>());
    case Load::kE5M2:
      return f(std::integral_constant<Load, Load::kE5M2>());
    case Load::kLut8:
      return f(std::integral_constant<Load, Load::kLut8>());
    case Load::kLut4:
      return f(std::integral_constant<Load, Load::kLut4>());
  }
}

/// The 256 decoded FP4 block-scale bytes of a format: e4m3 (nvfp4) or e8m0 (mxfp4).
inline const float* fp4_scale_table(Format f) {
  using Table = std::array<float, 256>;
  auto make = [](float (*decode)(uint8_t)) {
    Table t{};
    for (std::size_t c = 0; c < t.size(); ++c) t[c] = decode(static_cast<uint8_t>(c));
    return t;
  };
  static const Table nv = make(fp8::decode_e4m3);
  static const Table mx = make(fp4::decode_e8m0);
  return f == Format::kNvfp4 ? nv.data() : mx.data();
}

/// The element scale of an FP4 block with scale byte `code`, exactly as dequantization computes
/// it (fp4::nv_element_scale(code, g) = fl(e4m3(code) * g); fp4::decode_e8m0(code) * 1), so
/// fma(e2m1[c], scale, 0) is the dequantized value bit for bit.
inline float fp4_scale(const Stream& st, uint8_t code) { return st.stab[code] * st.tscale; }

/// Sets up how a packed view is read with vector width W.
inline void setup_packed(Stream& st, const PackedView& v, int W) {
  st.packed = true;
  st.view = v;
  const QuantConfig& c = v.config;
  const int64_t D = v.shape.head_dim;
  st.box = group_box(c.axis, c.group, v.shape);
  st.scale = Scale::kRow;
  st.mul = 1.f;
  st.off = 0.f;
  st.lm = st.qjl = st.zeros = st.unpack = st.nuq = st.fp4 = st.rot = false;
  st.stab = nullptr;
  st.tscale = 1.f;
  st.rotation = nullptr;
  st.raw = c.is_raw();
  st.ctx = nullptr;
  st.nout = outlier_count(c, D);
  switch (c.format) {
    case Format::kF32:
      st.load = Load::kF32;
      st.bits = 32;
      return;
    case Format::kF16:
      st.load = Load::kF16;
      st.bits = 16;
      return;
    case Format::kBF16:
      st.load = Load::kBF16;
      st.bits = 16;
      return;
    case Format::kE4M3:
    case Format::kE5M2:
      st.bits = 8;
      st.load = c.format == Format::kE4M3 ? Load::kE4M3 : Load::kE5M2;
      st.mul = c.format == Format::kE4M3 ? 256.f : 1.f;
      break;
    case Format::kInt:
      st.bits = c.bits;
      st.off = uniform_levels(c.bits, c.symmetric).off;
      st.zeros = !c.symmetric;
      break;
    case Format::kNuq:  // x = scale * level[c] + zero: the int path with a table load
      st.bits = c.bits;
      st.nuq = true;
      st.zeros = true;
      for (int k = 0; k < 16; ++k)
        st.lut[k] = k < (1 << c.bits) ? c.nuq_levels[static_cast<std::size_t>(k)] : 0.f;
      break;
    case Format::kNvfp4:
    case Format::kMxfp4:  // x = block scale * e2m1[c]: the nuq table path without zeros
      st.bits = 4;
      st.nuq = true;
      st.fp4 = true;
      st.stab = fp4_scale_table(c.format);
      st.tscale = c.format == Format::kNvfp4 ? c.fp4_tensor_scale : 1.f;
      for (int k = 0; k < 16; ++k) st.lut[k] = fp4::decode_e2m1(static_cast<uint8_t>(k));
      break;
    case Format::kLloydMax: {
      st.bits = c.bits;
      st.lm = true;
      st.qjl = c.qjl;
      st.ctx = &detail::lloyd_max_context(static_cast<int>(D), c.bits, c.seed);
      st.rot = true;
      st.rotation = &st.ctx->rotation;
      const auto& cent = st.ctx->codebook->centroids;
      for (int k = 0; k < 16; ++k)
        st.lut[k] = k < static_cast<int>(cent.size()) ? cent[static_cast<std::size_t>(k)] : 0.f;
      break;
    }
  }
  if (rotated_plain(c)) {  // codes of the rotated vectors (quant/rotated_quant.hpp)
    st.rot = true;
    st.rotation = &hadamard_rotation_for(D, c.seed);
  }
  if (c.format == Format::kInt || c.format == Format::kLloydMax || st.nuq) {
    const bool lm = c.format == Format::kLloydMax || st.nuq;  // table loads
    const bool aligned = (D * st.bits) % 8 == 0;
    if (st.bits == 8) {
      st.load = lm ? Load::kLut8 : Load::kU8;
    } else if (st.bits == 4 && aligned && W % 2 == 0 && W >= 4) {
      st.load = lm ? Load::kLut4 : Load::kU4;
    } else if (st.bits == 2 && aligned && W % 4 == 0 && !lm) {
      st.load = Load::kU2;
    } else {
      st.unpack = true;
      st.load = lm ? Load::kLut8 : Load::kU8;
    }
  }
  if (st.lm) return;  // per-row norm: kRow
  if (c.axis == Axis::kChannel) {
    st.scale = Scale::kChannel;
  } else if (st.box.gc == D) {
    st.scale = Scale::kRow;
  } else if (st.box.gc % W == 0) {
    st.scale = Scale::kGroup;
  } else {
    st.scale = Scale::kExpand;
  }
}

/// Pointer to the packed row (t, h) of a stream, or the unpacked bytes in `buf`.
inline const uint8_t* packed_row(const Stream& st, int64_t t, int64_t h, uint8_t* buf) {
  const int64_t H = st.view.shape.heads, D = st.view.shape.head_dim;
  const auto e = static_cast<std::size_t>((t * H + h) * D);
  if (st.unpack) {
    unpack_codes(st.view.codes, static_cast<std::size_t>(D), st.bits, buf,
                 e * static_cast<std::size_t>(st.bits));
    return buf;
  }
  return st.view.codes + e * static_cast<std::size_t>(st.bits) / 8;
}

/// Fills the tile's metadata for rows t0..t0+n (segment-local) of head h: kRow -> ms[t], mz[t];
/// kGroup -> ms[t * ng + g]; kExpand -> ms[t * D + d]; kChannel -> ms[d] (the block's).
/// Zero points carry the folded offset: z' = z - off * s (so x = fma(code, s, z')); scales
/// carry the fp8 unscale factor.
inline void tile_meta(const Stream& st, int64_t t0, int64_t n, int64_t h, float* ms, float* mz,
                      float* qn) {
  const PackedView& v = st.view;
  const GroupBox& b = st.box;
  const int64_t D = v.shape.head_dim;
  auto sz = [&](std::size_t g, float* s, float* z) {
    const float sc = st.fp4 ? fp4_scale(st, v.scales[g]) : v.scale(g);
    *s = sc * st.mul;
    *z = (st.zeros ? v.zero(g) : 0.f) - st.off * sc;
  };
  if (st.raw) {
    for (int64_t t = 0; t < n; ++t) {
      ms[t] = 1.f;
      mz[t] = 0.f;
    }
    return;
  }
  if (st.lm) {
    const int64_t H = v.shape.heads;
    for (int64_t t = 0; t < n; ++t) {
      const auto vi = static_cast<std::size_t>((t0 + t) * H + h);
      ms[t] = v.norm(vi);
      mz[t] = 0.f;
      if (st.qjl)
        qn[t] = v.qjl_norm(vi) * static_cast<float>(std::sqrt(M_PI / 2.0) / static_cast<double>(D));
    }
    return;
  }
  // Group index of (token t0 + t, head h, group g of the row) = b.index(t0 + t, h, g * gc),
  // with the token block counted along the tokens (no integer division per token and group).
  const int64_t hb = h / b.gh;
  int64_t tb = t0 / b.gt, tr = t0 % b.gt;
  auto row_base = [&]() { return static_cast<std::size_t>((tb * b.nh + hb) * b.nc); };
  auto next_token = [&]() {
    if (++tr == b.gt) {
      tr = 0;
      ++tb;
    }
  };
  switch (st.scale) {
    case Scale::kRow:
      for (int64_t t = 0; t < n; ++t, next_token()) sz(row_base(), ms + t, mz + t);
      return;
    case Scale::kGroup: {
      const int64_t ng = D / b.gc;
      for (int64_t t = 0; t < n; ++t, next_token()) {
        const std::size_t g0 = row_base();
        for (int64_t g = 0; g < ng; ++g)
          sz(g0 + static_cast<std::size_t>(g), ms + t * ng + g, mz + t * ng + g);
      }
      return;
    }
    case Scale::kExpand:
      for (int64_t t = 0; t < n; ++t, next_token())
        for (int64_t g = 0; g < D / b.gc; ++g) {
          float s, z;
          sz(row_base() + static_cast<std::size_t>(g), &s, &z);
          for (int64_t d = g * b.gc; d < (g + 1) * b.gc; ++d) {
            ms[t * D + d] = s;
            mz[t * D + d] = z;
          }
        }
      return;
    case Scale::kChannel: {
      const auto g0 = static_cast<std::size_t>(b.index(t0, h, 0));
      for (int64_t d = 0; d < D; ++d) sz(g0 + static_cast<std::size_t>(d), ms + d, mz + d);
      return;
    }
  }
}

/// Decodes the packed row at `row` (tile position t) into floats (real domain for Lloyd-Max:
/// centroids, QJL correction, inverse rotation, norm).
template <class S, Load L>
inline void decode_row(const Stream& st, const uint8_t* row, const uint8_t* sg, int64_t t,
                       const float* ms, const float* mz, const float* qn, float* out, int64_t D) {
  using V = typename S::V;
  const int64_t nj = D / S::W;
  if (!st.packed || st.lm) {
    for (int64_t j = 0; j < nj; ++j) S::store(out + j * S::W, load_chunk<S, L>(row, j, st.lut));
    if (st.lm) {
      const auto& ctx = *st.ctx;
      if (st.qjl) {
        const float* qjl_s = ctx.qjl_matrix();
        for (int64_t jj = 0; jj < D; ++jj) {
          const float c = sg[jj] ? qn[t] : -qn[t];
          const float* srow = qjl_s + jj * D;
          for (int64_t i = 0; i < D; ++i) out[i] += c * srow[i];
        }
      }
      ctx.rotation.apply_inverse(out);
      for (int64_t i = 0; i < D; ++i) out[i] *= ms[t];
    }
    return;
  }
  const int64_t gc = st.box.gc;
  for (int64_t j = 0; j < nj; ++j) {
    const V c = load_chunk<S, L>(row, j, st.lut);
    V s, z;
    switch (st.scale) {
      case Scale::kRow:
        s = S::set1(ms[t]);
        z = S::set1(mz[t]);
        break;
      case Scale::kGroup: {
        const int64_t ng = D / gc, g = j * S::W / gc;
        s = S::set1(ms[t * ng + g]);
        z = S::set1(mz[t * ng + g]);
        break;
      }
      case Scale::kExpand:
        s = S::load(ms + t * D + j * S::W);
        z = S::load(mz + t * D + j * S::W);
        break;
      default:
        s = S::load(ms + j * S::W);
        z = S::load(mz + j * S::W);
        break;
    }
    S::store(out + j * S::W, S::fma(c, s, z));
  }
}

/// Rotates row x (head_dim D) at position pos (core/rope.hpp's formula and rounding).
inline void rope_row(float* x, int64_t D, const float* c, const float* s, RopeStyle style) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {
    const int64_t i0 = style == RopeStyle::kAdjacent ? 2 * i : i;
    const int64_t i1 = style == RopeStyle::kAdjacent ? 2 * i + 1 : i + half;
    const float a = x[i0], b = x[i1];
    x[i0] = a * c[i] - b * s[i];
    x[i1] = a * s[i] + b * c[i];
  }
}

/// One work unit: tokens [a, b) x queries [i0, i1), all kv heads.

}  // namespace attn
}  // namespace kernels
}  // namespace kvq
