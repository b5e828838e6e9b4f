#pragma once
/// \file rope.hpp
/// Unit's RoPE for pre-RoPE key caches: the per-tile table of cos/sin and rotated key rows.
#include "kvq/attention/cpu/unit.hpp"

namespace kvq {
namespace kernels {
namespace attn {

template <class S>
int64_t Unit<S>::rope_table(int64_t t0, int64_t n) {
  if (t0 >= sc_.rope_t0 && t0 + n <= sc_.rope_t0 + sc_.rope_n) return t0 - sc_.rope_t0;
  const int64_t half = P_.D / 2;
  float* rc = sc_.rc.data();
  float* rs = sc_.rs.data();
  double* c = sc_.rope_c.data();
  double* s = sc_.rope_s.data();
  const double* c1 = ws_.rope_c1.data();
  const double* s1 = ws_.rope_s1.data();
  for (int64_t i = 0; i < half; ++i) {
    const double ang = static_cast<double>(t0) * ws_.inv_freq[static_cast<std::size_t>(i)];
    c[i] = std::cos(ang);
    s[i] = std::sin(ang);
  }
  for (int64_t t = 0; t < n; ++t) {  // frequencies inner: independent chains, vectorized
    for (int64_t i = 0; i < half; ++i) {
      rc[t * half + i] = static_cast<float>(c[i]);
      rs[t * half + i] = static_cast<float>(s[i]);
      const double cn = c[i] * c1[i] - s[i] * s1[i];
      s[i] = s[i] * c1[i] + c[i] * s1[i];
      c[i] = cn;
    }
  }
  sc_.rope_t0 = t0;
  sc_.rope_n = n;
  return 0;
}

template <class S>
void Unit<S>::rope_key_row(const Stream& ks, int64_t loc, int64_t h, int64_t t, int64_t tr,
                           float* out) {
  const int64_t D = P_.D;
  if (!ks.packed) {
    std::copy(ks.rows.row(loc, h), ks.rows.row(loc, h) + D, out);
  } else {
    const uint8_t* row = packed_row(ks, loc, h, sc_.ku.data());
    if (ks.qjl) {
      const auto vi = static_cast<std::size_t>(loc * ks.view.shape.heads + h);
      unpack_bits(ks.view.qjl_signs, static_cast<std::size_t>(D), 1, sc_.ksg.data(),
                  vi * static_cast<std::size_t>(D));
    }
    with_load(ks.load, [&](auto LC) {
      decode_row<S, LC.value>(ks, row, sc_.ksg.data(), t, sc_.kms.data(), sc_.kmz.data(),
                              sc_.kq.data(), out, D);
    });
    // Rotated int / fp8 / FP4 codes decode in the rotated domain: back to the original basis
    // before RoPE (decode_row does this for Lloyd-Max).
    if (ks.rot && !ks.lm) ks.rotation->apply_inverse(out);
    if (ks.nout > 0)  // the exact outlier values over the dense ones, before the rotation
      for_outliers(ks, loc, h, [&](int64_t pos, float val) { out[pos] = val; });
  }
  rope_row(out, D, sc_.rc.data() + tr * (D / 2), sc_.rs.data() + tr * (D / 2), P_.rope->style);
}

template <class S>
void Unit<S>::score_rope(const CacheSegment& seg, const Stream& ks, int64_t h, int64_t t0,
                         int64_t n, const float* qs) {
  const int64_t D = P_.D, nj = D / S::W, R = R_, loc0 = t0 - seg.begin;
  float* kr = sc_.krow.data();
  const int64_t tr0 = rope_table(t0, n);
  for (int64_t t = 0; t < n; ++t) rope_key_row(ks, loc0 + t, h, t, tr0 + t, kr + t * D);
  dot_rows<S>([&](int64_t t, int64_t j) { return S::load(kr + t * D + j * S::W); }, n, nj, qs, D, R,
              sc_.s.data());
}

}  // namespace attn
}  // namespace kernels
}  // namespace kvq
