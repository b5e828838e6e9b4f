#pragma once
/// \file nuq_ref.hpp
/// Scalar reference oracle of the nuq<b> quantizer (quant/nuq_quant.hpp): element loops over
/// the logical index, group min/max by scanning, the code found by counting thresholds below u
/// (a linear scan, not the binary search of the fast path), bit-by-bit packing.
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kvq/core/tensor.hpp"
#include "kvq/format/nuq.hpp"
#include "kvq/geometry/grouping.hpp"
#include "kvq/quant/nuq_quant.hpp"
#include "kvq/quant/qtensor.hpp"
#include "kvq/reference/uniform_ref.hpp"

namespace kvq::reference {

template <class T>
QTensor quantize_nuq(const QuantConfig& cfg, const KVView<const T>& x) {
  ::kvq::detail::require_nuq_codebook(cfg);
  const Shape s = x.shape();
  const GroupBox box = group_box(cfg.axis, cfg.group, s);
  QTensor q;
  q.config = cfg;
  q.shape = s;
  const auto n = static_cast<std::size_t>(s.numel());
  q.codes.assign((n * static_cast<std::size_t>(cfg.bits) + 7) / 8, 0);
  const auto groups = static_cast<std::size_t>(n > 0 ? box.count() : 0);
  q.scales.reset(cfg.meta, groups);
  q.zeros.reset(cfg.meta, groups);
  if (n == 0) return q;
  std::vector<float> lo(groups, std::numeric_limits<float>::infinity());
  std::vector<float> hi(groups, -std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < s.tokens; ++t)
    for (int64_t h = 0; h < s.heads; ++h)
      for (int64_t d = 0; d < s.head_dim; ++d) {
        const float v = to_float(x.at(t, h, d));
        if (!std::isfinite(v))
          fail(ErrorKind::kNonFinite, "quantize: element (token=", t, ", head=", h,
               ", channel=", d, ") is ", v, "; kvq quantizes finite values only");
        const auto g = static_cast<std::size_t>(box.index(t, h, d));
        lo[g] = std::fmin(lo[g], v);
        hi[g] = std::fmax(hi[g], v);
      }
  std::vector<UniformParams> p(groups);
  for (std::size_t g = 0; g < groups; ++g) {
    p[g] = ::kvq::detail::nuq_params(lo[g], hi[g], cfg.meta, static_cast<int64_t>(g));
    q.scales.set(g, p[g].scale);
    q.zeros.set(g, p[g].zero);
  }
  const int levels = 1 << cfg.bits;
  std::vector<float> thr(static_cast<std::size_t>(levels - 1));
  nuq_thresholds(cfg.nuq_levels.data(), levels, thr.data());
  std::size_t i = 0;
  for (int64_t t = 0; t < s.tokens; ++t)
    for (int64_t h = 0; h < s.heads; ++h)
      for (int64_t d = 0; d < s.head_dim; ++d, ++i) {
        const UniformParams& pg = p[static_cast<std::size_t>(box.index(t, h, d))];
        const float u = (to_float(x.at(t, h, d)) - pg.zero) * pg.inv;
        uint32_t code = 0;
        for (float th : thr) code += u >= th ? 1u : 0u;  // ties go up
        put_code(q.codes, i, cfg.bits, code);
      }
  return q;
}

template <class T>
void dequantize_nuq(const QTensor& q, const KVView<T>& out) {
  const QuantConfig& cfg = q.config;
  const Shape s = q.shape;
  KVQ_REQUIRE(out.shape() == s, kShapeMismatch, "dequantize into ", out.shape().str(),
              " but the tensor is ", s.str());
  ::kvq::detail::require_nuq_codebook(cfg);
  if (s.numel() == 0) return;
  const GroupBox box = group_box(cfg.axis, cfg.group, s);
  std::size_t i = 0;
  for (int64_t t = 0; t < s.tokens; ++t)
    for (int64_t h = 0; h < s.heads; ++h)
      for (int64_t d = 0; d < s.head_dim; ++d, ++i) {
        const auto g = static_cast<std::size_t>(box.index(t, h, d));
        const uint32_t c = get_code(q.codes, i, cfg.bits);
        const float v = std::fma(q.scales.get(g), cfg.nuq_levels[c], q.zeros.get(g));
        out.at(t, h, d) = from_float<std::remove_const_t<T>>(v);
      }
}

}  // namespace kvq::reference
