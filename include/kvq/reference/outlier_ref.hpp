#pragma once
/// \file outlier_ref.hpp
/// Scalar reference oracle of dense-and-sparse quantization (quant/outlier_quant.hpp,
/// geometry/outliers.hpp): group statistics by element loops over the logical index (sums of
/// squares with an explicit fma, as the fast paths), the
/// selection by sorting every channel of a vector by (score descending, channel ascending), the
/// dense part quantized by the format's own reference oracle (uniform_ref, fp8_quant_ref,
/// nuq_ref), the sparse arrays written byte by byte.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include "kvq/core/half.hpp"
#include "kvq/core/tensor.hpp"
#include "kvq/geometry/grouping.hpp"
#include "kvq/quant/qtensor.hpp"
#include "kvq/reference/fp8_quant_ref.hpp"
#include "kvq/reference/nuq_ref.hpp"
#include "kvq/reference/uniform_ref.hpp"

namespace kvq::reference {

/// The split of a tensor: dense part ([T, H, D]), selected channels and their values
/// ([T, H, k], channels ascending per vector).
struct OutlierSplit {
  std::vector<float> dense;
  std::vector<int32_t> sel;
  std::vector<float> vals;
};

template <class T>
OutlierSplit split_outliers(Axis axis, int64_t group, int64_t k, const KVView<const T>& x) {
  const Shape s = x.shape();
  const GroupBox box = group_box(axis, group, s);
  const auto nb = static_cast<std::size_t>(s.numel() > 0 ? box.count() : 0);
  OutlierSplit r;
  r.dense.resize(static_cast<std::size_t>(s.numel()));
  for (int64_t t = 0; t < s.tokens; ++t)
    for (int64_t h = 0; h < s.heads; ++h)
      for (int64_t d = 0; d < s.head_dim; ++d)
        r.dense[static_cast<std::size_t>((t * s.heads + h) * s.head_dim + d)] = to_float(x.at(t, h, d));
  // Four partial sums per box (channel d goes to partial d % 4), combined (p0 + p1) + (p2 + p3).
  std::vector<double> mean(nb, 0.0), sd(nb, 0.0), part(4 * nb, 0.0);
  auto combine = [&](std::size_t b) {
    return (part[4 * b] + part[4 * b + 1]) + (part[4 * b + 2] + part[4 * b + 3]);
  };
  auto at = [&](int64_t t, int64_t h, int64_t d) -> float& {
    return r.dense[static_cast<std::size_t>((t * s.heads + h) * s.head_dim + d)];
  };
  for (int64_t t = 0; t < s.tokens; ++t)
    for (int64_t h = 0; h < s.heads; ++h)
      for (int64_t d = 0; d < s.head_dim; ++d)
        part[4 * static_cast<std::size_t>(box.index(t, h, d)) + static_cast<std::size_t>(d % 4)] +=
            at(t, h, d);
  for (std::size_t b = 0; b < nb; ++b) mean[b] = combine(b) * (1.0 / static_cast<double>(box.size()));
  std::fill(part.begin(), part.end(), 0.0);
  for (int64_t t = 0; t < s.tokens; ++t)
    for (int64_t h = 0; h < s.heads; ++h)
      for (int64_t d = 0; d < s.head_dim; ++d) {
        const double dv = static_cast<double>(at(t, h, d)) - mean[box.index(t, h, d)];
        double& p = part[4 * static_cast<std::size_t>(box.index(t, h, d)) + static_cast<std::size_t>(d % 4)];
        p = std::fma(dv, dv, p);  // explicit: no contraction setting changes the bits
      }
  // Inverse spread (0 for a constant box), as the fast path: score = |x - mean| * (1 / sd).
  for (std::size_t b = 0; b < nb; ++b) {
    const double r = std::sqrt(combine(b) * (1.0 / static_cast<double>(box.size())));
    sd[b] = r > 0.0 ? 1.0 / r : 0.0;
  }
  std::vector<uint8_t> chosen(r.dense.size(), 0);
  for (int64_t t = 0; t < s.tokens; ++t)
    for (int64_t h = 0; h < s.heads; ++h) {
      std::vector<float> score(static_cast<std::size_t>(s.head_dim));
      for (int64_t d = 0; d < s.head_dim; ++d) {
        const auto b = static_cast<std::size_t>(box.index(t, h, d));
        score[d] = static_cast<float>(std::fabs(static_cast<double>(at(t, h, d)) - mean[b]) * sd[b]);
      }
      std::vector<int32_t> order(static_cast<std::size_t>(s.head_dim));
      std::iota(order.begin(), order.end(), 0);
      std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
        return score[a] > score[b] || (score[a] == score[b] && a < b);
      });
      order.resize(static_cast<std::size_t>(k));
      std::sort(order.begin(), order.end());
      for (int32_t d : order) {
        r.sel.push_back(d);
        chosen[static_cast<std::size_t>((t * s.heads + h) * s.head_dim + d)] = 1;
      }
    }
  std::vector<float> lo(nb, std::numeric_limits<float>::infinity());
  std::vector<float> hi(nb, -std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < s.tokens; ++t)
    for (int64_t h = 0; h < s.heads; ++h)
      for (int64_t d = 0; d < s.head_dim; ++d) {
        if (chosen[static_cast<std::size_t>((t * s.heads + h) * s.head_dim + d)]) continue;
        const auto b = static_cast<std::size_t>(box.index(t, h, d));
        lo[b] = std::min(lo[b], at(t, h, d));
        hi[b] = std::max(hi[b], at(t, h, d));
      }
  std::size_t i = 0;
  for (int64_t t = 0; t < s.tokens; ++t)
    for (int64_t h = 0; h < s.heads; ++h)
      for (int64_t j = 0; j < k; ++j, ++i) {
        const int32_t d = r.sel[i];
        const auto b = static_cast<std::size_t>(box.index(t, h, d));
        float& v = at(t, h, d);
        r.vals.push_back(v);
        v = lo[b] <= hi[b] ? std::min(std::max(v, lo[b]), hi[b]) : static_cast<float>(mean[b]);
      }
  return r;
}

/// Reference dense-and-sparse quantization (k = outlier_count(cfg, head_dim) > 0).
template <class T>
QTensor quantize_with_outliers(const QuantConfig& cfg, const KVView<const T>& x) {
  const Shape s = x.shape();
  const int64_t k = outlier_count(cfg, s.head_dim);
  for (int64_t t = 0; t < s.tokens; ++t)
    for (int64_t h = 0; h < s.heads; ++h)
      for (int64_t d = 0; d < s.head_dim; ++d)
        if (!std::isfinite(to_float(x.at(t, h, d))))
          fail(ErrorKind::kNonFinite, "quantize: element (token=", t, ", head=", h,
               ", channel=", d, ") is non-finite");
  const OutlierSplit sp = split_outliers(cfg.axis, cfg.group, k, x);
  for (std::size_t i = 0; i < sp.vals.size(); ++i)
    if (!(std::fabs(sp.vals[i]) < 65520.f))
      fail(ErrorKind::kOutOfRange, "quantize: outlier ", sp.vals[i], " fp16 cannot store");
  QuantConfig dc = cfg;
  dc.outliers = 0;
  dc.outlier_pct = 0.f;
  const KVView<const float> dv(sp.dense.data(), s);
  QTensor q;
  switch (cfg.format) {
    case Format::kInt: q = quantize_uniform(dc, dv); break;
    case Format::kE4M3:
    case Format::kE5M2: q = quantize_fp8(dc, dv); break;
    case Format::kNuq: q = quantize_nuq(dc, dv); break;
    default: fail(ErrorKind::kInvalidArgument, "outliers need an int, fp8 or nuq config");
  }
  q.config = cfg;
  const int pb = outlier_pos_bytes(s.head_dim);
  for (std::size_t i = 0; i < sp.vals.size(); ++i) {
    const uint16_t hb = float_to_half_bits(sp.vals[i]);
    q.outlier_values.push_back(static_cast<uint8_t>(hb & 0xff));
    q.outlier_values.push_back(static_cast<uint8_t>(hb >> 8));
    q.outlier_pos.push_back(static_cast<uint8_t>(sp.sel[i] & 0xff));
    if (pb == 2) q.outlier_pos.push_back(static_cast<uint8_t>(sp.sel[i] >> 8));
  }
  return q;
}

/// Reference reconstruction: dense part by the format's oracle, then the exact outliers.
template <class T>
void dequantize_with_outliers(const QTensor& q, const KVView<T>& out) {
  QTensor dense = q;
  dense.config.outliers = 0;
  dense.config.outlier_pct = 0.f;
  switch (q.config.format) {
    case Format::kInt: dequantize_uniform(dense, out); break;
    case Format::kE4M3:
    case Format::kE5M2: dequantize_fp8(dense, out); break;
    case Format::kNuq: dequantize_nuq(dense, out); break;
    default: fail(ErrorKind::kInvalidArgument, "outliers need an int, fp8 or nuq config");
  }
  const int64_t k = outlier_count(q.config, q.shape.head_dim);
  const int pb = outlier_pos_bytes(q.shape.head_dim);
  std::size_t i = 0;
  for (int64_t t = 0; t < q.shape.tokens; ++t)
    for (int64_t h = 0; h < q.shape.heads; ++h)
      for (int64_t j = 0; j < k; ++j, ++i) {
        const uint16_t hb = static_cast<uint16_t>(q.outlier_values[2 * i] | (q.outlier_values[2 * i + 1] << 8));
        const int64_t d = pb == 1 ? q.outlier_pos[i] : (q.outlier_pos[2 * i] | (q.outlier_pos[2 * i + 1] << 8));
        out.at(t, h, d) = from_float<std::remove_const_t<T>>(half_bits_to_float(hb));
      }
}

}  // namespace kvq::reference
