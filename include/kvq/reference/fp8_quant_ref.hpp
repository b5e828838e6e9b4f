#pragma once
/// \file fp8_quant_ref.hpp
/// Scalar reference oracle for the scaled FP8 quantizer: element-by-element loops over the
/// logical index, std::fabs amax, the scalar encode/decode functions. Tests require the fast
/// path to match it byte for byte.
#include <cmath>
#include <cstdint>
#include <vector>

#include "kvq/core/tensor.hpp"
#include "kvq/format/fp8.hpp"
#include "kvq/geometry/grouping.hpp"
#include "kvq/quant/qtensor.hpp"

namespace kvq::reference {

inline float fp8_group_scale(const QuantConfig& cfg, float amax) {
  const auto kind = cfg.format == Format::kE5M2 ? fp8::Fp8Kind::kE5M2 : fp8::Fp8Kind::kE4M3;
  float s = round_meta(cfg.meta, fp8::compute_scale(kind, amax, cfg.fp8_margin));
  if (s == 0.f) s = half_bits_to_float(1);
  if (!std::isfinite(s)) fail(ErrorKind::kOutOfRange, "fp8 scale overflows metadata");
  return s;
}

template <class T>
QTensor quantize_fp8(const QuantConfig& cfg, const KVView<const T>& x) {
  const Shape s = x.shape();
  const GroupBox box = group_box(cfg.axis, cfg.group, s);
  const auto n = static_cast<std::size_t>(s.numel());
  const auto groups = static_cast<std::size_t>(n > 0 ? box.count() : 0);
  QTensor q;
  q.config = cfg;
  q.shape = s;
  q.codes.assign(n, 0);
  q.scales.reset(cfg.meta, groups);
  std::vector<float> amax(groups, 0.f);
  for (int64_t t = 0; t < s.tokens; ++t)
    for (int64_t h = 0; h < s.heads; ++h)
      for (int64_t d = 0; d < s.head_dim; ++d) {
        const float v = to_float(x.at(t, h, d));
        if (!std::isfinite(v))
          fail(ErrorKind::kNonFinite, "quantize: element (token=", t, ", head=", h,
               ", channel=", d, ") is ", v);
        auto& a = amax[static_cast<std::size_t>(box.index(t, h, d))];
        a = std::fmax(a, std::fabs(v));
      }
  std::vector<float> inv(groups);
  for (std::size_t g = 0; g < groups; ++g) {
    const float sc = fp8_group_scale(cfg, amax[g]);
    q.scales.set(g, sc);
    inv[g] = 1.0f / sc;
  }
  std::size_t i = 0;
  for (int64_t t = 0; t < s.tokens; ++t)
    for (int64_t h = 0; h < s.heads; ++h)
      for (int64_t d = 0; d < s.head_dim; ++d, ++i) {
        const float v = to_float(x.at(t, h, d)) * inv[static_cast<std::size_t>(box.index(t, h, d))];
        q.codes[i] = cfg.format == Format::kE5M2 ? fp8::encode_e5m2(v) : fp8::encode_e4m3(v);
      }
  return q;
}

template <class T>
void dequantize_fp8(const QTensor& q, const KVView<T>& out) {
  const Shape s = q.shape;
  const GroupBox box = group_box(q.config.axis, q.config.group, s);
  std::size_t i = 0;
  for (int64_t t = 0; t < s.tokens; ++t)
    for (int64_t h = 0; h < s.heads; ++h)
      for (int64_t d = 0; d < s.head_dim; ++d, ++i) {
        const uint8_t c = q.codes[i];
        const float v = q.config.format == Format::kE5M2 ? fp8::decode_e5m2(c) : fp8::decode_e4m3(c);
        out.at(t, h, d) = from_float<std::remove_const_t<T>>(
            v * q.scales.get(static_cast<std::size_t>(box.index(t, h, d))));
      }
}

}  // namespace kvq::reference
