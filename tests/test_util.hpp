#pragma once
// Shared helpers for kvq tests: deterministic data generators.
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kvq/core/tensor.hpp"
#include "kvq/quant/qtensor.hpp"

namespace kvq_test {

/// A grouped uniform integer config (asymmetric unless `sym`), fp16 metadata by default.
inline kvq::QuantConfig int_cfg(int bits, bool sym, kvq::Axis axis, int64_t group,
                                kvq::MetaDType meta = kvq::MetaDType::kF16) {
  kvq::QuantConfig c;
  c.format = kvq::Format::kInt;
  c.bits = bits;
  c.symmetric = sym;
  c.axis = axis;
  c.group = group;
  c.meta = meta;
  return c;
}

/// KV-like data: Gaussian, with a few channels scaled up (key-style outliers) when
/// `outlier_channels` is true.
inline std::vector<float> kv_data(const kvq::Shape& s, uint32_t seed, bool outlier_channels) {
  std::vector<float> v(static_cast<size_t>(s.numel()));
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  size_t i = 0;
  for (int64_t t = 0; t < s.tokens; ++t)
    for (int64_t h = 0; h < s.heads; ++h)
      for (int64_t d = 0; d < s.head_dim; ++d, ++i) {
        float x = nd(rng);
        if (outlier_channels && (d % 16 == 5)) x = x * 8.f + 3.f;
        v[i] = x;
      }
  return v;
}

inline double rel_mse(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(a[i]) * a[i];
  }
  return den > 0 ? num / den : num;
}

}  // namespace kvq_test
