#pragma once
/// \file outliers.hpp
/// Outlier isolation (KVQuant's dense-and-sparse split): which k entries of every
/// (token, head) vector are kept exactly, and what the dense quantizer sees in their place.
///
/// Selection. Every entry is scored by its distance from its group's centre in units of the
/// group's spread, after the normalization the axis uses:
///   score = |x - mean_g| / sd_g        (0 when sd_g == 0)
/// where g is the entry's group box (quant axis + group size: per channel, the G tokens of one
/// channel; per token, G channels of one vector; per head / tensor, the whole box), mean_g and
/// sd_g its mean and population standard deviation (two passes, double, in [token, head,
/// channel] order). Each vector keeps exactly its k highest scores; ties, including all-equal
/// vectors, go to the lower channel index (the order (score descending, channel ascending) is
/// total, so the chosen set is unique). Positions are stored ascending.
///
/// Dense part. The dense ranges are computed without the outliers: every selected entry is
/// replaced by its value clamped to [min, max] of the non-selected entries of its group box (the
/// group mean when a box has no non-selected entry), so the dense quantizer's min/max (int,
/// nuq) and absmax (fp8) are exactly those of the remaining entries.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include "kvq/core/error.hpp"
#include "kvq/core/tensor.hpp"
#include "kvq/geometry/grouping.hpp"

namespace kvq {

/// Scratch of isolate_outliers (only grows).
struct OutlierScratch {
  std::vector<double> mean, sd;   // [boxes]
  std::vector<double> part;       // [boxes, 4] partial sums
  std::vector<float> lo, hi;      // [boxes]
  std::vector<float> score;       // [head_dim]
  std::vector<int32_t> idx;       // [head_dim]
  std::vector<uint8_t> mark;      // [head_dim]
};

namespace detail {
template <class V>
typename V::value_type* grow(V& v, std::size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}
}  // namespace detail

/// Isolates k outliers per vector of `x` ([s.tokens, s.heads, s.head_dim] contiguous f32,
/// finite): sel[(t * H + h) * k + j] gets the j-th selected channel (ascending), vals the
/// original value, and x is rewritten with the dense part (see the file comment). The group
/// box is that of (axis, group) on s (throws kShapeMismatch when it does not divide s).
inline void isolate_outliers(const Shape& s, Axis axis, int64_t group, int64_t k, float* x,
                             int32_t* sel, float* vals, OutlierScratch& sc) {
  const int64_t T = s.tokens, H = s.heads, D = s.head_dim;
  KVQ_REQUIRE(k >= 0 && k <= D, kInvalidArgument, k, " outliers per vector but head_dim is ", D);
  if (k == 0 || s.numel() == 0) return;
  const GroupBox box = group_box(axis, group, s);
  const auto nb = static_cast<std::size_t>(box.count());
  double* mean = detail::grow(sc.mean, nb);
  double* sd = detail::grow(sc.sd, nb);
  float* lo = detail::grow(sc.lo, nb);
  float* hi = detail::grow(sc.hi, nb);
  float* score = detail::grow(sc.score, static_cast<std::size_t>(D));
  int32_t* idx = detail::grow(sc.idx, static_cast<std::size_t>(D));
  uint8_t* mark = detail::grow(sc.mark, static_cast<std::size_t>(D));
  // Box sums in a fixed order (the oracle's too): four partial sums per box, partial j taking
  // the channels d = j (mod 4) in [token, head, channel] order, combined as (p0 + p1) + (p2 + p3).
  // Four independent chains instead of one keep the double adds from serializing.
  double* p4 = detail::grow(sc.part, 4 * nb);
  std::fill(p4, p4 + 4 * nb, 0.0);
  const double inv_n = 1.0 / static_cast<double>(box.size());
  // Box index of channel d in row (t, h): base + d / gc (gc == D except on the token axis).
  auto base_of = [&](int64_t t, int64_t h) { return ((t / box.gt) * box.nh + h / box.gh) * box.nc; };
  const int64_t gc = box.gc;
  const bool per_channel = gc == 1;
  const bool quads = gc % 4 == 0;
  // Adds f(r[d], box) over row (t, h) into the partials.
  auto accumulate = [&](const float* r, int64_t b0, auto&& f) {
    if (per_channel) {  // one channel per box: only partial d % 4 of box b0 + d is used
      for (int64_t d = 0; d < D; ++d) p4[4 * (b0 + d) + (d & 3)] += f(r[d], b0 + d);
    } else if (quads) {
      for (int64_t c0 = 0, b = b0; c0 < D; c0 += gc, ++b) {
        double a0 = p4[4 * b], a1 = p4[4 * b + 1], a2 = p4[4 * b + 2], a3 = p4[4 * b + 3];
        for (int64_t d = c0; d < c0 + gc; d += 4) {
          a0 += f(r[d], b);
          a1 += f(r[d + 1], b);
          a2 += f(r[d + 2], b);
          a3 += f(r[d + 3], b);
        }
        p4[4 * b] = a0, p4[4 * b + 1] = a1, p4[4 * b + 2] = a2, p4[4 * b + 3] = a3;
      }
    } else {
      for (int64_t c0 = 0, b = b0; c0 < D; c0 += gc, ++b)
        for (int64_t d = c0; d < c0 + gc; ++d) p4[4 * b + (d & 3)] += f(r[d], b);
    }
  };
  auto combine = [&](std::size_t b) { return (p4[4 * b] + p4[4 * b + 1]) + (p4[4 * b + 2] + p4[4 * b + 3]); };
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h)
      accumulate(x + (t * H + h) * D, base_of(t, h),
                 [](float v, int64_t) { return static_cast<double>(v); });
  for (std::size_t b = 0; b < nb; ++b) mean[b] = combine(b) * inv_n;
  std::fill(p4, p4 + 4 * nb, 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h)
      accumulate(x + (t * H + h) * D, base_of(t, h), [&](float v, int64_t b) {
        const double dv = static_cast<double>(v) - mean[b];
        return dv * dv;
      });
  // sd[] holds 1 / sd (0 for a constant box): score = |x - mean| * (1 / sd).
  for (std::size_t b = 0; b < nb; ++b) {
    const double v = std::sqrt(combine(b) * inv_n);
    sd[b] = v > 0.0 ? 1.0 / v : 0.0;
  }

  // Selection per vector, then the non-selected range of every box.
  std::fill(lo, lo + nb, std::numeric_limits<float>::infinity());
  std::fill(hi, hi + nb, -std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const float* r = x + (t * H + h) * D;
      const int64_t b0 = base_of(t, h);
      for (int64_t c0 = 0, b = b0; c0 < D; c0 += gc, b += per_channel ? gc : 1) {
        for (int64_t d = c0; d < c0 + gc; ++d) {
          const int64_t bd = per_channel ? b0 + d : b;
          score[d] = static_cast<float>(std::fabs(static_cast<double>(r[d]) - mean[bd]) * sd[bd]);
        }
      }
      int32_t* out = sel + (t * H + h) * k;
      auto before = [&](int32_t a, int32_t b) {  // (score desc, channel asc)
        return score[a] > score[b] || (score[a] == score[b] && a < b);
      };
      if (k <= 8) {  // one pass keeping the k best in (score desc, channel asc) order
        int64_t n = 0;
        for (int32_t d = 0; d < static_cast<int32_t>(D); ++d) {
          const float sd_ = score[d];
          if (n == k && !(sd_ > score[out[k - 1]])) continue;  // ties: the earlier channel stays
          int64_t j = n < k ? n++ : k - 1;
          while (j > 0 && sd_ > score[out[j - 1]]) {
            out[j] = out[j - 1];
            --j;
          }
          out[j] = d;
        }
      } else {
        std::iota(idx, idx + D, 0);
        std::nth_element(idx, idx + (k - 1), idx + D, before);
        std::copy(idx, idx + k, out);
      }
      std::sort(out, out + k);
      std::fill(mark, mark + D, uint8_t{0});
      for (int64_t j = 0; j < k; ++j) mark[out[j]] = 1;
      for (int64_t c0 = 0, bb = b0; c0 < D; c0 += gc, ++bb) {
        for (int64_t d = c0; d < c0 + gc; ++d) {
          if (mark[d]) continue;
          const int64_t b = per_channel ? b0 + d : bb;
          lo[b] = std::min(lo[b], r[d]);
          hi[b] = std::max(hi[b], r[d]);
        }
      }
    }
  // Values out, dense part in.
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      float* r = x + (t * H + h) * D;
      const int64_t b0 = base_of(t, h);
      const int32_t* s_ = sel + (t * H + h) * k;
      float* v = vals + (t * H + h) * k;
      for (int64_t j = 0; j < k; ++j) {
        const int32_t d = s_[j];
        const int64_t b = b0 + d / box.gc;
        v[j] = r[d];
        r[d] = lo[b] <= hi[b] ? std::min(std::max(r[d], lo[b]), hi[b])
                              : static_cast<float>(mean[b]);
      }
    }
}

}  // namespace kvq
