#pragma once
// Shared sizes and inputs for kvq_bench.
#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

namespace kvq_bench {
/// Every bandwidth benchmark touches 64 MiB of float (or half) input, well beyond the caches.
constexpr std::size_t kInputBytes = std::size_t{64} << 20;
constexpr int64_t kHeadDim = 128;
constexpr int64_t kHeads = 8;

/// Deterministic KV-like data: Gaussian with a few large channels.
inline std::vector<float> make_input(std::size_t n, uint32_t seed = 1) {
  std::vector<float> v(n);
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (std::size_t i = 0; i < n; ++i) {
    float x = nd(rng);
    if (i % kHeadDim == 3 || i % kHeadDim == 77) x *= 12.f;
    v[i] = x;
  }
  return v;
}
}  // namespace kvq_bench
