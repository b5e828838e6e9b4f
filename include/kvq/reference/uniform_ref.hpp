#pragma once
/// \file uniform_ref.hpp
/// Scalar reference oracle for the grouped uniform integer quantizer: element-by-element loops
/// over the logical [tokens, heads, head_dim] index, std::nearbyint rounding, bit-by-bit
/// packing. Slow and obvious on purpose; tests require the fast path to match it byte for byte.
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kvq/core/tensor.hpp"
#include "kvq/format/uniform.hpp"
#include "kvq/geometry/grouping.hpp"
#include "kvq/quant/qtensor.hpp"

namespace kvq::reference {

/// Writes `code` (bits wide) at element index i of a LSB-first bitstream, one bit at a time.
inline void put_code(std::vector<uint8_t>& out, std::size_t i, int bits, uint32_t code) {
  for (int b = 0; b < bits; ++b) {
    const std::size_t bit = i * static_cast<std::size_t>(bits) + static_cast<std::size_t>(b);
    if ((code >> b) & 1u) out[bit / 8] = static_cast<uint8_t>(out[bit / 8] | (1u << (bit % 8)));
  }
}
inline uint32_t get_code(const std::vector<uint8_t>& in, std::size_t i, int bits) {
  uint32_t code = 0;
  for (int b = 0; b < bits; ++b) {
    const std::size_t bit = i * static_cast<std::size_t>(bits) + static_cast<std::size_t>(b);
    code |= static_cast<uint32_t>((in[bit / 8] >> (bit % 8)) & 1u) << b;
  }
  return code;
}

template <class T>
QTensor quantize_uniform(const QuantConfig& cfg, const KVView<const T>& x) {
  check_uniform_bits(cfg.bits);
  const Shape s = x.shape();
  const GroupBox box = group_box(cfg.axis, cfg.group, s);
  QTensor q;
  q.config = cfg;
  q.shape = s;
  const auto n = static_cast<std::size_t>(s.numel());
  q.codes.assign((n * static_cast<std::size_t>(cfg.bits) + 7) / 8, 0);
  const auto groups = static_cast<std::size_t>(n > 0 ? box.count() : 0);
  q.scales.reset(cfg.meta, groups);
  q.zeros.reset(cfg.meta, cfg.symmetric ? 0 : groups);
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
    p[g] = uniform_params(lo[g], hi[g], cfg.bits, cfg.symmetric, cfg.meta,
                          static_cast<int64_t>(g));
    q.scales.set(g, p[g].scale);
    if (!cfg.symmetric) q.zeros.set(g, p[g].zero);
  }
  const UniformLevels lv = uniform_levels(cfg.bits, cfg.symmetric);
  std::size_t i = 0;
  for (int64_t t = 0; t < s.tokens; ++t)
    for (int64_t h = 0; h < s.heads; ++h)
      for (int64_t d = 0; d < s.head_dim; ++d, ++i) {
        const UniformParams& pg = p[static_cast<std::size_t>(box.index(t, h, d))];
        float v = std::fma(to_float(x.at(t, h, d)) - pg.zero, pg.inv, lv.off);
        v = std::fmin(std::fmax(v, 0.f), lv.qmax);
        put_code(q.codes, i, cfg.bits, static_cast<uint32_t>(std::nearbyint(v)));
      }
  return q;
}

template <class T>
void dequantize_uniform(const QTensor& q, const KVView<T>& out) {
  const QuantConfig& cfg = q.config;
  const Shape s = q.shape;
  KVQ_REQUIRE(out.shape() == s, kShapeMismatch, "dequantize into ", out.shape().str(),
              " but the tensor is ", s.str());
  if (s.numel() == 0) return;
  const GroupBox box = group_box(cfg.axis, cfg.group, s);
  const UniformLevels lv = uniform_levels(cfg.bits, cfg.symmetric);
  std::size_t i = 0;
  for (int64_t t = 0; t < s.tokens; ++t)
    for (int64_t h = 0; h < s.heads; ++h)
      for (int64_t d = 0; d < s.head_dim; ++d, ++i) {
        const auto g = static_cast<std::size_t>(box.index(t, h, d));
        const float sc = q.scales.get(g);
        const float z = cfg.symmetric ? 0.f : q.zeros.get(g);
        const float c = static_cast<float>(get_code(q.codes, i, cfg.bits));
        out.at(t, h, d) = from_float<std::remove_const_t<T>>(std::fma(c - lv.off, sc, z));
      }
}

}  // namespace kvq::reference
