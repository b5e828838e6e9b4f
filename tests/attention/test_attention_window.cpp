// Sliding-window attention (AttentionOptions::window, what Gemma's local layers use through
// CacheBackend::attend_window / attend_chunk): for several policies (f32, fp8, int4 per channel
// with a residual window, int2, k8v4, Lloyd-Max with rotation, pre-RoPE keys), one decode query
// and a chunk of prefill queries, windows shorter than a tile, across page and chunk boundaries
// and longer than the context, the fused kernel equals double-precision attention over the
// cache's own dequantized tokens (KVCache::read) restricted to each query's window.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "kvq/attention/attention.hpp"
#include "kvq/cache/kv_cache.hpp"
#include "kvq/core/rope.hpp"
#include "kvq/policy/spec.hpp"

namespace {

std::vector<float> gauss(std::mt19937& g, size_t n, float s) {
  std::normal_distribution<float> d(0.f, s);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

/// Double-precision windowed causal attention over explicit [T, kvh, D] tensors.
std::vector<double> window_ref(const std::vector<float>& k, const std::vector<float>& v, int64_t T,
                               int kvh, int D, const std::vector<float>& q, int64_t nq, int nh,
                               int64_t window) {
  std::vector<double> out(static_cast<size_t>(nq * nh * D), 0.0);
  const int group = nh / kvh;
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t last = T - nq + i;
    const int64_t first = window > 0 ? std::max<int64_t>(0, last - window + 1) : 0;
    for (int h = 0; h < nh; ++h) {
      const int g = h / group;
      std::vector<double> s;
      double mx = -1e300;
      for (int64_t t = first; t <= last; ++t) {
        double dot = 0;
        for (int d = 0; d < D; ++d) dot += double(q[(i * nh + h) * D + d]) * k[(t * kvh + g) * D + d];
        s.push_back(dot / std::sqrt(double(D)));
        mx = std::max(mx, s.back());
      }
      double sum = 0;
      for (double& e : s) sum += (e = std::exp(e - mx));
      for (int64_t t = first; t <= last; ++t)
        for (int d = 0; d < D; ++d)
          out[(i * nh + h) * D + d] += s[t - first] / sum * v[(t * kvh + g) * D + d];
    }
  }
  return out;
}

void check(const std::string& spec, bool prerope, int64_t T, int64_t nq, int64_t window,
           int64_t split = 0) {
  const int kvh = 1, nh = 4, D = 64;
  std::mt19937 g(static_cast<uint32_t>(T * 131 + nq * 7 + window));
  const kvq::RopeConfig rope{10000.0, kvq::RopeStyle::kHalf};
  kvq::KVCache cache(kvq::parse_policy(spec), 1, kvh, D, static_cast<int>(T));
  auto k = gauss(g, static_cast<size_t>(T * kvh * D), 1.0f);
  for (int64_t t = 0; t < T; ++t) k[t * D + 5] += 4.0f;  // a fixed outlier channel
  const auto v = gauss(g, k.size(), 1.0f);
  // Appended in uneven chunks, as a prefill then decode would.
  for (int64_t t = 0; t < T;) {
    const int64_t n = std::min<int64_t>(T - t, 1 + (t * 7) % 23);
    cache.append(0, kvq::KVView<const float>::nhd(k.data() + t * kvh * D, n, kvh, D),
                 kvq::KVView<const float>::nhd(v.data() + t * kvh * D, n, kvh, D));
    t += n;
  }
  std::vector<float> kd(k.size()), vd(v.size());
  cache.read(0, 0, T, kvq::KVView<float>::nhd(kd.data(), T, kvh, D),
             kvq::KVView<float>::nhd(vd.data(), T, kvh, D));
  if (prerope) kvq::apply_rope_pairs(kd.data(), static_cast<int>(T), kvh, D, 0, rope);
  const auto q = gauss(g, static_cast<size_t>(nq * nh * D), 0.3f);
  const auto want = window_ref(kd, vd, T, kvh, D, q, nq, nh, window);
  std::vector<float> out(q.size());
  kvq::AttentionWorkspace ws;
  kvq::AttentionOptions opt;
  opt.window = window;
  opt.split_tokens = split;
  kvq::attend(cache, 0, kvq::KVView<const float>::nhd(q.data(), nq, nh, D),
              kvq::KVView<float>::nhd(out.data(), nq, nh, D), true, ws, prerope ? &rope : nullptr,
              opt);
  double err = 0, ref = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    err = std::max(err, std::abs(out[i] - want[i]));
    ref = std::max(ref, std::abs(want[i]));
  }
  EXPECT_LT(err / ref, 2e-5) << spec << (prerope ? " pre-RoPE" : "") << " T=" << T << " nq=" << nq
                             << " window=" << window << " split=" << split;
}

TEST(AttentionWindow, KernelEqualsWindowedReference) {
  for (const char* spec : {"f32", "fp8", "kivi4", "kivi2,residual=0", "k8v4", "turbo4"}) {
    for (const int64_t window : {1, 5, 64, 100, 150, 1000}) {
      check(spec, false, 200, 1, window);
      check(spec, false, 200, 37, window);
    }
  }
  check("kivi4", true, 200, 1, 70);
  check("kivi4", true, 200, 20, 70);
  check("f32", false, 300, 3, 90, 64);  // a flash-decoding split inside the window
  check("kivi2", false, 300, 40, 33, 128);
}

TEST(AttentionWindow, ZeroIsNoWindowNegativeIsRefused) {
  kvq::KVCache cache(kvq::parse_policy("f32"), 1, 1, 8, 16);
  std::vector<float> kv(8 * 4, 0.5f), q(8, 1.0f), out(8);
  cache.append(0, kvq::KVView<const float>::nhd(kv.data(), 4, 1, 8),
               kvq::KVView<const float>::nhd(kv.data(), 4, 1, 8));
  kvq::AttentionWorkspace ws;
  kvq::AttentionOptions opt;
  opt.window = -1;
  EXPECT_THROW(kvq::attend(cache, 0, kvq::KVView<const float>::nhd(q.data(), 1, 1, 8),
                           kvq::KVView<float>::nhd(out.data(), 1, 1, 8), true, ws, nullptr, opt),
               kvq::Error);
}

}  // namespace
