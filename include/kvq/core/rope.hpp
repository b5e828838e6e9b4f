#pragma once
/// \file rope.hpp
/// Rotary position embedding (RoPE) as llama2.c applies it, for caches that store keys before
/// RoPE (KVQuant: per-channel key groups are far tighter before the position-dependent rotation)
/// and rotate them after dequantization.
///
/// Pair i of every head is rotated by the angle pos * theta^(-2i / head_dim); cos and sin are
/// computed in double and rounded to float, the rotation itself is float arithmetic
/// (x0 c - x1 s, x0 s + x1 c). Pairs: RopeStyle::kAdjacent (2i, 2i+1) — llama2.c / Meta Llama,
/// so keys rotated here equal llama2.c's own post-RoPE keys up to the compiler's FMA
/// contraction — or RopeStyle::kHalf (i, i + head_dim/2), Hugging Face's "rotate_half".
#include <cmath>
#include <cstdint>
#include <vector>

#include "kvq/core/error.hpp"

namespace kvq {

enum class RopeStyle { kAdjacent, kHalf };

struct RopeConfig {
  double theta = 10000.0;
  RopeStyle style = RopeStyle::kAdjacent;
};

/// Rotates x ([tokens, heads, head_dim] contiguous) in place; token t sits at position pos0 + t.
inline void apply_rope_pairs(float* x, int64_t tokens, int64_t heads, int64_t head_dim,
                             int64_t pos0, const RopeConfig& rc = {}) {
  KVQ_REQUIRE(head_dim % 2 == 0, kInvalidArgument, "RoPE needs an even head_dim, got ", head_dim);
  const int64_t half = head_dim / 2;
  std::vector<float> cs(static_cast<std::size_t>(half)), sn(cs.size());
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      const double a = static_cast<double>(pos0 + t) *
                       std::pow(rc.theta, -static_cast<double>(2 * i) / static_cast<double>(head_dim));
      cs[static_cast<std::size_t>(i)] = static_cast<float>(std::cos(a));
      sn[static_cast<std::size_t>(i)] = static_cast<float>(std::sin(a));
    }
    for (int64_t h = 0; h < heads; ++h) {
      float* r = x + (t * heads + h) * head_dim;
      for (int64_t i = 0; i < half; ++i) {
        const int64_t i0 = rc.style == RopeStyle::kAdjacent ? 2 * i : i;
        const int64_t i1 = rc.style == RopeStyle::kAdjacent ? 2 * i + 1 : i + half;
        const float a = r[i0], b = r[i1];
        const float c = cs[static_cast<std::size_t>(i)], s = sn[static_cast<std::size_t>(i)];
        r[i0] = a * c - b * s;
        r[i1] = a * s + b * c;
      }
    }
  }
}

}  // namespace kvq
