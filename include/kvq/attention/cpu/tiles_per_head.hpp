#pragma once
/// \file tiles_per_head.hpp
/// Unit's per-head tile path: one segment piece and one kv head at a time (every
/// instruction set; the streams the all-heads microkernels do not read).
#include "kvq/attention/cpu/unit.hpp"

namespace kvq {
namespace kernels {
namespace attn {

template <class S>
void Unit<S>::tile(const CacheSegment& seg, const Stream& ks, const Stream& vs, int64_t h,
                   int64_t t0, int64_t t1) {
  const int64_t n = t1 - t0, D = P_.D, nj = D / S::W, loc0 = t0 - seg.begin;
  const int64_t R = R_, HR = P_.nq * P_.G;
  // Rotated keys (Lloyd-Max, /rot) are scored against the rotated queries; pre-RoPE keys are
  // decoded back to the original basis first (rope.hpp), f32 rows never rotate.
  const float* qs =
      (ks.rot && P_.rope == nullptr ? ws_.qrot : ws_.qs).data() + (h * HR + i0_ * P_.G) * D;
  float* sc = sc_.s.data();
  // ---- keys: scores [R, n]
  if (ks.packed) tile_meta(ks, loc0, n, h, sc_.kms.data(), sc_.kmz.data(), sc_.kq.data());
  if (P_.rope != nullptr) {
    score_rope(seg, ks, h, t0, n, qs);
  } else if (!ks.packed) {
    dot_rows<S>([&](int64_t t, int64_t j) { return S::load(ks.rows.row(loc0 + t, h) + j * S::W); },
                n, nj, qs, D, R, sc);
  } else {
    with_load(ks.load, [&](auto LC) { score_packed<LC.value>(ks, h, loc0, n, qs); });
    if (ks.nout > 0) outlier_scores(ks, loc0, n, h, qs, sc);
  }
  // ---- masks and soft-cap (mask.hpp), online softmax: weights into sc
  for (int64_t r = 0; r < R; ++r) {
    float* s = sc + r * kTile;
    const std::size_t st = static_cast<std::size_t>(h * R + r);
    if (!mask_logits(P_, i0_ + r / P_.G, t0, n, kTile, s)) continue;  // sees none of the tile
    float mx;
    {
      auto mv = S::load(s);
      for (int64_t t = S::W; t < kTile; t += S::W) mv = S::max(mv, S::load(s + t));
      alignas(64) float lanes[S::W];
      S::store(lanes, mv);
      mx = lanes[0];
      for (int k = 1; k < S::W; ++k) mx = std::max(mx, lanes[k]);
    }
    float alpha;
    if (sc_.sm[st].raise(mx, softmax_exp, &alpha)) {
      rescale(row_acc(sc_.acc.data(), h, r), alpha);
      if (P_.v_rot != nullptr) rescale(row_acc(sc_.acc_rot.data(), h, r), alpha);
      if (P_.v_ctx != nullptr) {
        rescale(row_acc(sc_.sacc.data(), h, r), alpha);
        sc_.sconst[st] *= alpha;
      }
    }
    const float mnew = sc_.sm[st].m;
    using V = typename S::V;
    V sum = S::zero();
    const V mv = S::set1(mnew);
    for (int64_t t = 0; t < kTile; t += S::W) {
      const V p = S::exp(S::fma(mv, S::set1(-1.f), S::load(s + t)));
      S::store(s + t, p);
      sum = S::add(sum, p);
    }
    sc_.sm[st].l += S::reduce(sum);
  }
  // ---- values
  if (!vs.packed) {
    float* acc = row_acc(sc_.acc.data(), h, 0);
    axpy_rows<S>([&](int64_t t, int64_t j) { return S::load(vs.rows.row(loc0 + t, h) + j * S::W); },
                 n, nj, sc, acc, D, R);
    return;
  }
  tile_meta(vs, loc0, n, h, sc_.vms.data(), sc_.vmz.data(), sc_.vq.data());
  with_load(vs.load, [&](auto LC) { accumulate_packed<LC.value>(vs, h, loc0, n); });
  if (vs.nout > 0) outlier_values(vs, loc0, n, h, sc, row_acc(sc_.acc.data(), h, 0), false);
}

template <class S>
void Unit<S>::rescale(float* x, float alpha) {
  const auto a = S::set1(alpha);
  for (int64_t d = 0; d < P_.D; d += S::W) S::store(x + d, S::mul(S::load(x + d), a));
}

template <class S>
template <Load L>
void Unit<S>::score_packed(const Stream& ks, int64_t h, int64_t loc0, int64_t n, const float* qs) {
  using V = typename S::V;
  const int64_t D = P_.D, nj = D / S::W, R = R_, HR = P_.nq * P_.G;
  float* sc = sc_.s.data();
  const float* ms = sc_.kms.data();
  const float* mz = sc_.kmz.data();
  const uint8_t** rp = sc_.krp.data();
  for (int64_t t = 0; t < n; ++t) rp[t] = packed_row(ks, loc0 + t, h, sc_.ku.data() + t * D);
  auto plain = [&](int64_t t, int64_t j) { return load_chunk<S, L>(rp[t], j, ks.lut); };
  if (ks.lm) {
    const float* qr = ws_.qrot.data() + (h * HR + i0_ * P_.G) * D;
    dot_rows<S>(plain, n, nj, qr, D, R, sc);
    if (ks.qjl) {
      const float* sq = ws_.sq.data() + (h * HR + i0_ * P_.G) * D;
      const float* sqs = ws_.sqsum.data() + h * HR + i0_ * P_.G;
      uint8_t* sg = sc_.ksg.data();
      for (int64_t t = 0; t < n; ++t) {
        const auto vi = static_cast<std::size_t>((loc0 + t) * ks.view.shape.heads + h);
        unpack_bits(ks.view.qjl_signs, static_cast<std::size_t>(D), 1, sg + t * D,
                    vi * static_cast<std::size_t>(D));
      }
      float* w = sc_.w.data();  // scratch: sign dot products
      dot_rows<S>([&](int64_t t, int64_t j) { return S::cvt(S::codes_u8(sg + t * D + j * S::W)); },
                  n, nj, sq, D, R, w);
      for (int64_t r = 0; r < R; ++r)
        for (int64_t t = 0; t < n; ++t)
          sc[r * kTile + t] += sc_.kq[t] * (2.f * w[r * kTile + t] - sqs[r]);
    }
    for (int64_t r = 0; r < R; ++r)
      for (int64_t t = 0; t < n; ++t) sc[r * kTile + t] *= ms[t];
    return;
  }
  switch (ks.scale) {
    case Scale::kRow: {
      dot_rows<S>(plain, n, nj, qs, D, R, sc);
      const float* qsum = (ks.rot ? ws_.qrotsum : ws_.qsum).data() + h * HR + i0_ * P_.G;
      for (int64_t r = 0; r < R; ++r) {
        float* o = sc + r * kTile;
        const float qr = qsum[r];
        for (int64_t t = 0; t < n; ++t) o[t] = std::fma(ms[t], o[t], mz[t] * qr);
      }
      return;
    }
    case Scale::kGroup: {
      const int64_t gc = ks.box.gc, ng = D / gc;
      dot_rows<S>(
          [&](int64_t t, int64_t j) {
            const int64_t g = t * ng + j * S::W / gc;
            return S::fma(load_chunk<S, L>(rp[t], j, ks.lut), S::set1(ms[g]), S::set1(mz[g]));
          },
          n, nj, qs, D, R, sc);
      return;
    }
    case Scale::kExpand:
      dot_rows<S>(
          [&](int64_t t, int64_t j) {
            return S::fma(load_chunk<S, L>(rp[t], j, ks.lut), S::load(ms + t * D + j * S::W),
                          S::load(mz + t * D + j * S::W));
          },
          n, nj, qs, D, R, sc);
      return;
    case Scale::kChannel: {
      // Fold the block's per-channel scales into the queries, zero points into one constant.
      float* qf = sc_.qf.data();
      float* qz = sc_.qz.data();
      for (int64_t r = 0; r < R; ++r) {
        V z = S::zero();
        for (int64_t j = 0; j < nj; ++j) {
          const V q = S::load(qs + r * D + j * S::W);
          S::store(qf + r * D + j * S::W, S::mul(q, S::load(ms + j * S::W)));
          z = S::fma(q, S::load(mz + j * S::W), z);
        }
        qz[r] = S::reduce(z);
      }
      dot_rows<S>(plain, n, nj, qf, D, R, sc);
      for (int64_t r = 0; r < R; ++r)
        for (int64_t t = 0; t < n; ++t) sc[r * kTile + t] += qz[r];
      return;
    }
  }
}

template <class S>
template <Load L>
void Unit<S>::accumulate_packed(const Stream& vs, int64_t h, int64_t loc0, int64_t n) {
  const int64_t D = P_.D, nj = D / S::W, R = R_;
  const float* p = sc_.s.data();
  float* w = sc_.w.data();
  const uint8_t** rp = sc_.vrp.data();
  for (int64_t t = 0; t < n; ++t) rp[t] = packed_row(vs, loc0 + t, h, sc_.vu.data() + t * D);
  const float* ms = sc_.vms.data();
  const float* mz = sc_.vmz.data();
  float* const accb = vs.rot ? sc_.acc_rot.data() : sc_.acc.data();  // rotated: R^T in finish()
  if (vs.lm || vs.scale == Scale::kRow) {
    // w = p * s (row scale or norm); zero points: one scalar per row.
    for (int64_t r = 0; r < R; ++r) {
      float zsum = 0.f;
      for (int64_t t = 0; t < n; ++t) {
        w[r * kTile + t] = p[r * kTile + t] * ms[t];
        zsum += p[r * kTile + t] * mz[t];
      }
      sc_.zacc[static_cast<std::size_t>(r)] = zsum;
    }
    float* acc = row_acc(accb, h, 0);
    axpy_rows<S>([&](int64_t t, int64_t j) { return load_chunk<S, L>(rp[t], j, vs.lut); }, n, nj, w,
                 acc, D, R);
    if (vs.lm) {
      if (vs.qjl) {
        // sacc_j += 2 w c s01_j, sconst += w c  (sign = 2 s01 - 1)
        uint8_t* sg = sc_.vsg.data();
        for (int64_t t = 0; t < n; ++t) {
          const auto vi = static_cast<std::size_t>((loc0 + t) * vs.view.shape.heads + h);
          unpack_bits(vs.view.qjl_signs, static_cast<std::size_t>(D), 1, sg + t * D,
                      vi * static_cast<std::size_t>(D));
        }
        for (int64_t r = 0; r < R; ++r) {
          float cs = 0.f;
          for (int64_t t = 0; t < n; ++t) {
            const float wc = w[r * kTile + t] * sc_.vq[t];
            cs += wc;
            w[r * kTile + t] = 2.f * wc;
          }
          sc_.sconst[static_cast<std::size_t>(h * R + r)] += cs;
        }
        axpy_rows<S>(
            [&](int64_t t, int64_t j) { return S::cvt(S::codes_u8(sg + t * D + j * S::W)); }, n, nj,
            w, row_acc(sc_.sacc.data(), h, 0), D, R);
      }
      return;
    }
    if (vs.zeros || vs.off != 0.f) {
      for (int64_t r = 0; r < R; ++r) {
        float* a = row_acc(accb, h, r);
        const auto z = S::set1(sc_.zacc[static_cast<std::size_t>(r)]);
        for (int64_t j = 0; j < nj; ++j) S::store(a + j * S::W, S::add(S::load(a + j * S::W), z));
      }
    }
    return;
  }
  float* acc = row_acc(accb, h, 0);
  switch (vs.scale) {
    case Scale::kGroup: {
      const int64_t gc = vs.box.gc, ng = D / gc;
      axpy_rows<S>(
          [&](int64_t t, int64_t j) {
            const int64_t g = t * ng + j * S::W / gc;
            return S::fma(load_chunk<S, L>(rp[t], j, vs.lut), S::set1(ms[g]), S::set1(mz[g]));
          },
          n, nj, p, acc, D, R);
      return;
    }
    case Scale::kExpand:
      axpy_rows<S>(
          [&](int64_t t, int64_t j) {
            return S::fma(load_chunk<S, L>(rp[t], j, vs.lut), S::load(ms + t * D + j * S::W),
                          S::load(mz + t * D + j * S::W));
          },
          n, nj, p, acc, D, R);
      return;
    default:  // kChannel: the block's per-channel vectors
      axpy_rows<S>(
          [&](int64_t t, int64_t j) {
            return S::fma(load_chunk<S, L>(rp[t], j, vs.lut), S::load(ms + j * S::W),
                          S::load(mz + j * S::W));
          },
          n, nj, p, acc, D, R);
      return;
  }
}

}  // namespace attn
}  // namespace kernels
}  // namespace kvq
