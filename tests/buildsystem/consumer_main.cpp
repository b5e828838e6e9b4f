// A consumer program: includes the umbrella header, quantizes a small tensor, checks the
// round trip, and exits non-zero if anything is off.
#include <kvq/kvq.hpp>

#include <cmath>
#include <cstdio>
#include <vector>

int main() {
  const kvq::Shape shape{64, 2, 32};
  std::vector<float> x(static_cast<size_t>(shape.numel()));
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.37f * static_cast<float>(i));
  kvq::QuantConfig cfg;
  cfg.format = kvq::Format::kInt;
  cfg.bits = 4;
  cfg.symmetric = true;
  cfg.axis = kvq::Axis::kToken;
  cfg.group = 32;
  auto q = kvq::quantize(cfg, kvq::KVView<const float>(x.data(), shape));
  std::vector<float> y(x.size());
  kvq::dequantize(q, kvq::KVView<float>(y.data(), shape));
  double err = 0;
  for (size_t i = 0; i < x.size(); ++i) err = std::fmax(err, std::fabs(x[i] - y[i]));
  const double bits = kvq::effective_bits(cfg, shape);
  std::printf("kvq %s consumer: max abs err %.4f, %.3f bits/value\n", KVQ_VERSION_STRING, err,
              bits);
  // Engine-style: a k8v4 cache for 2 layers, one prefill chunk, read back.
  kvq::KVCache cache(kvq::parse_policy("k8v4,residual=0"), 2, 2, 32);
  const kvq::KVView<const float> kv(x.data(), shape);
  for (int l = 0; l < 2; ++l) cache.append(l, kv, kv);
  std::vector<float> kd(x.size()), vd(x.size());
  cache.read(1, 0, shape.tokens, kvq::KVView<float>(kd.data(), shape),
             kvq::KVView<float>(vd.data(), shape));
  double cache_err = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    cache_err = std::fmax(cache_err, std::fabs(x[i] - kd[i]) + std::fabs(x[i] - vd[i]));
  }
  // What an f32 cache of the same tokens holds: 2 layers x (K + V) x 64 x 2 x 32 floats. The
  // k8v4 cache must be smaller (its f32 tails included in total()).
  const std::size_t f32_bytes = 2 * 2 * x.size() * sizeof(float);
  std::printf("k8v4 cache: %zu bytes (f32 cache: %zu), max abs err %.4f\n",
              cache.memory_report().total(), f32_bytes, cache_err);
  return (err < 0.2 && bits == 4.5 && q.bytes() == kvq::account(cfg, shape).total() &&
          cache_err < 0.3 && cache.memory_report().total() < f32_bytes)
             ? 0
             : 1;
}
