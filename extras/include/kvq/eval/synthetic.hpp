#pragma once
/// \file synthetic.hpp
/// A built-in synthetic KV generator with the geometry real models show, so the comparison
/// runs anywhere without a model. It is synthetic and every tool that uses it says so.
///
/// How it is made (per layer, per KV head; seeded, deterministic):
///  - Pre-RoPE keys: k[t, c] = mu_c + sigma_c * (0.8 z[t, c] + 0.6 s[t, c]) where z is i.i.d.
///    N(0,1) and s is a slowly drifting AR(1) series (phi 0.95) per channel; sigma_c =
///    exp(N(0, 0.4)); a few fixed "outlier channels" (4 per 64 channels) get sigma x 8 and a
///    mean mu_c of +/- 6 sigma. Outliers therefore live in fixed channels, as in LLM keys
///    (KIVI, KVQuant).
///  - Post-RoPE keys: RoPE (theta 10000, adjacent channel pairs (2i, 2i+1), position t) applied
///    to the pre-RoPE keys, which smears each outlier channel's energy into its pair partner
///    with a position-dependent rotation.
///  - Values: v[t, c] = a_t * z[t, c] with i.i.d. N(0,1) z and a per-token scale a_t =
///    exp(N(0, 0.5)): no channel structure, strong token-to-token magnitude variation.
///  - Queries (`queries` positions, the last ones: tokens - queries .. tokens - 1; one vector
///    per query head, GQA): drawn like keys (same outlier channels, means aligned with the key
///    means) then RoPE at their position, and scaled so that the fp32 attention scores of each
///    head over its causal prefix have standard deviation 2 (neither uniform nor one-hot).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kvq/core/error.hpp"
#include "kvq/core/tensor.hpp"

namespace kvq::eval {

struct SyntheticSpec {
  int layers = 4;
  int tokens = 1024;
  int kv_heads = 4;
  int q_heads = 8;
  int head_dim = 128;
  int queries = 1;  ///< query positions per layer (the last ones), at most tokens
  uint32_t seed = 2024;
};

/// One layer of synthetic KV: [tokens, kv_heads, head_dim] tensors and [queries, q_heads,
/// head_dim] queries at positions tokens - queries .. tokens - 1.
struct SyntheticLayer {
  std::vector<float> k_prerope, k, v, q;
};

/// Applies RoPE in place to x [tokens, heads, head_dim] (NHD) with positions pos0, pos0 + 1...
inline void apply_rope(float* x, int64_t tokens, int64_t heads, int64_t head_dim, int64_t pos0,
                       double theta = 10000.0) {
  KVQ_REQUIRE(head_dim % 2 == 0, kInvalidArgument, "RoPE needs an even head_dim, got ", head_dim);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      float* r = x + (t * heads + h) * head_dim;
      for (int64_t i = 0; i < head_dim; i += 2) {
        const double freq = std::pow(theta, -static_cast<double>(i) / head_dim);
        const double a = static_cast<double>(pos0 + t) * freq;
        const double c = std::cos(a), s = std::sin(a);
        const double x0 = r[i], x1 = r[i + 1];
        r[i] = static_cast<float>(x0 * c - x1 * s);
        r[i + 1] = static_cast<float>(x0 * s + x1 * c);
      }
    }
}

inline std::vector<SyntheticLayer> make_synthetic_kv(const SyntheticSpec& sp) {
  KVQ_REQUIRE(sp.layers > 0 && sp.tokens > 0 && sp.kv_heads > 0 && sp.head_dim > 0 &&
                  sp.q_heads % sp.kv_heads == 0 && sp.head_dim % 2 == 0 && sp.queries >= 1 &&
                  sp.queries <= sp.tokens,
              kInvalidArgument, "synthetic spec needs positive sizes, even head_dim and q_heads ",
              "a multiple of kv_heads, 1 <= queries <= tokens (got layers=", sp.layers, " tokens=", sp.tokens,
              " queries=", sp.queries,
              " kv_heads=", sp.kv_heads, " q_heads=", sp.q_heads, " head_dim=", sp.head_dim, ")");
  std::mt19937_64 rng(sp.seed);
  std::normal_distribution<double> nd(0.0, 1.0);
  const int T = sp.tokens, H = sp.kv_heads, D = sp.head_dim, Q = sp.q_heads, NQ = sp.queries;
  std::vector<SyntheticLayer> out(static_cast<size_t>(sp.layers));
  for (auto& L : out) {
    L.k_prerope.resize(static_cast<size_t>(T) * H * D);
    L.v.resize(L.k_prerope.size());
    L.q.resize(static_cast<size_t>(NQ) * Q * D);
    std::vector<double> mu(static_cast<size_t>(H * D)), sigma(static_cast<size_t>(H * D));
    for (int h = 0; h < H; ++h)
      for (int c = 0; c < D; ++c) {
        const size_t i = static_cast<size_t>(h * D + c);
        sigma[i] = std::exp(0.4 * nd(rng));
        mu[i] = 0.3 * sigma[i] * nd(rng);
        if ((c * 7 + h * 3) % 16 == 5) {  // fixed outlier channels, 4 per 64
          sigma[i] *= 8.0;
          mu[i] = (nd(rng) > 0 ? 1.5 : -1.5) * sigma[i];
        }
      }
    std::vector<double> drift(static_cast<size_t>(H * D), 0.0);
    for (int t = 0; t < T; ++t) {
      const double a_t = std::exp(0.5 * nd(rng));
      for (int h = 0; h < H; ++h)
        for (int c = 0; c < D; ++c) {
          const size_t i = static_cast<size_t>(h * D + c);
          drift[i] = 0.95 * drift[i] + std::sqrt(1 - 0.95 * 0.95) * nd(rng);
          const size_t e = (static_cast<size_t>(t) * H + h) * D + c;
          L.k_prerope[e] = static_cast<float>(mu[i] + sigma[i] * (0.8 * nd(rng) + 0.6 * drift[i]));
          L.v[e] = static_cast<float>(a_t * nd(rng));
        }
    }
    L.k = L.k_prerope;
    apply_rope(L.k.data(), T, H, D, 0);
    // queries: key-like statistics of their KV head, RoPE at their position
    for (int j = 0; j < NQ; ++j) {
      const int pos = T - NQ + j;
      float* qj = L.q.data() + static_cast<size_t>(j) * Q * D;
      for (int qh = 0; qh < Q; ++qh) {
        const int h = qh / (Q / H);
        for (int c = 0; c < D; ++c) {
          const size_t i = static_cast<size_t>(h * D + c);
          qj[qh * D + c] =
              static_cast<float>(0.5 * mu[i] / sigma[i] + nd(rng) * (sigma[i] > 4 ? 1.5 : 1.0));
        }
      }
      apply_rope(qj, 1, Q, D, pos);
      // scale each query head so its fp32 scores over tokens [0, pos] have standard deviation 2
      for (int qh = 0; qh < Q; ++qh) {
        const int h = qh / (Q / H);
        double s1 = 0, s2 = 0;
        for (int t = 0; t <= pos; ++t) {
          double dot = 0;
          for (int c = 0; c < D; ++c)
            dot += static_cast<double>(qj[qh * D + c]) * L.k[(static_cast<size_t>(t) * H + h) * D + c];
          dot /= std::sqrt(static_cast<double>(D));
          s1 += dot;
          s2 += dot * dot;
        }
        const double n = pos + 1;
        const double sd = std::sqrt(std::max(s2 / n - (s1 / n) * (s1 / n), 1e-30));
        for (int c = 0; c < D; ++c) qj[qh * D + c] *= static_cast<float>(2.0 / sd);
      }
    }
  }
  return out;
}

}  // namespace kvq::eval
