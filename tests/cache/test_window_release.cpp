// Sliding-window layers release their oldest pages (KVCache::release_before, what CacheBackend
// does after each windowed attention of Gemma's local layers): whole pages only, sinks and the
// f32 residual kept; memory_report counts only what is held; reading or truncating into the
// released range is refused; windowed attention over what is left equals double-precision
// windowed attention over the tokens as they were, across policies, with sinks and for decode
// and prefill queries; a window that reaches released tokens is refused; appending, flushing
// and truncating go on after a release; an archive refuses a released cache.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "kvq/attention/attention.hpp"
#include "kvq/cache/kv_cache.hpp"
#include "kvq/io/archive.hpp"
#include "kvq/policy/spec.hpp"

namespace {

constexpr int kKvh = 1, kNh = 4, kD = 64;

std::vector<float> gauss(std::mt19937& g, size_t n, float s) {
  std::normal_distribution<float> d(0.f, s);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

/// Double-precision causal attention of the newest nq queries over [T, kvh, D] tensors, each
/// over its last `window` positions.
std::vector<double> window_ref(const std::vector<float>& k, const std::vector<float>& v, int64_t T,
                               const std::vector<float>& q, int64_t nq, int64_t window) {
  std::vector<double> out(static_cast<size_t>(nq * kNh * kD), 0.0);
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t last = T - nq + i, first = std::max<int64_t>(0, last - window + 1);
    for (int h = 0; h < kNh; ++h) {
      std::vector<double> s;
      double mx = -1e300;
      for (int64_t t = first; t <= last; ++t) {
        double dot = 0;
        for (int d = 0; d < kD; ++d) dot += double(q[(i * kNh + h) * kD + d]) * k[t * kD + d];
        s.push_back(dot / 8.0);
        mx = std::max(mx, s.back());
      }
      double sum = 0;
      for (double& e : s) sum += (e = std::exp(e - mx));
      for (int64_t t = first; t <= last; ++t)
        for (int d = 0; d < kD; ++d) out[(i * kNh + h) * kD + d] += s[t - first] / sum * v[t * kD + d];
    }
  }
  return out;
}

struct Filled {
  kvq::KVCache cache;
  std::vector<float> kd, vd;  // the cache's tokens dequantized before any release
};

Filled fill(const std::string& spec, int64_t T, uint32_t seed) {
  std::mt19937 g(seed);
  Filled f{kvq::KVCache(kvq::parse_policy(spec), 1, kKvh, kD), {}, {}};
  auto k = gauss(g, static_cast<size_t>(T * kD), 1.0f);
  for (int64_t t = 0; t < T; ++t) k[t * kD + 3] += 5.0f;
  const auto v = gauss(g, k.size(), 1.0f);
  for (int64_t t = 0; t < T;) {
    const int64_t n = std::min<int64_t>(T - t, 1 + (t * 5) % 19);
    f.cache.append(0, kvq::KVView<const float>::nhd(k.data() + t * kD, n, kKvh, kD),
                   kvq::KVView<const float>::nhd(v.data() + t * kD, n, kKvh, kD));
    t += n;
  }
  f.kd.resize(k.size());
  f.vd.resize(v.size());
  f.cache.read(0, 0, T, kvq::KVView<float>::nhd(f.kd.data(), T, kKvh, kD),
               kvq::KVView<float>::nhd(f.vd.data(), T, kKvh, kD));
  return f;
}

double attend_err(const Filled& f, int64_t nq, int64_t window, uint32_t seed) {
  std::mt19937 g(seed);
  const int64_t T = f.cache.tokens(0);
  const auto q = gauss(g, static_cast<size_t>(nq * kNh * kD), 0.3f);
  const auto want = window_ref(f.kd, f.vd, T, q, nq, window);
  std::vector<float> out(q.size());
  kvq::AttentionWorkspace ws;
  kvq::AttentionOptions opt;
  opt.window = window;
  kvq::attend(f.cache, 0, kvq::KVView<const float>::nhd(q.data(), nq, kNh, kD),
              kvq::KVView<float>::nhd(out.data(), nq, kNh, kD), true, ws, nullptr, opt);
  double err = 0, ref = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    err = std::max(err, std::abs(out[i] - want[i]));
    ref = std::max(ref, std::abs(want[i]));
  }
  return err / ref;
}

TEST(WindowRelease, AttentionOverWhatIsLeft) {
  for (const char* spec : {"f16", "fp8", "kivi4", "kivi2,residual=0", "k8v4", "turbo4",
                           "kivi4,sinks=4", "k8v4,sinks=3"}) {
    const int64_t T = 300, W = 100;
    for (const int64_t nq : {1, 9}) {
      Filled f = fill(spec, T, 11);
      const int64_t first_seen = T - nq - W + 1;  // the first query's window start
      const int64_t released = f.cache.release_before(0, first_seen);
      EXPECT_GT(released, 0) << spec;
      const int64_t B = f.cache.block_tokens(0);
      EXPECT_EQ(f.cache.released_tokens(0), released * B);
      EXPECT_LE(f.cache.sink_tokens(0) + f.cache.released_tokens(0), first_seen) << spec;
      EXPECT_GT(f.cache.sink_tokens(0) + f.cache.released_tokens(0) + B, first_seen) << spec;
      EXPECT_LT(attend_err(f, nq, W, 5), 2e-5) << spec << " nq=" << nq;
    }
  }
}

TEST(WindowRelease, AccountsRefusesAndGoesOn) {
  Filled f = fill("kivi4", 300, 3);
  const auto before = f.cache.memory_report();
  const int64_t n = f.cache.release_before(0, 200);
  ASSERT_EQ(n, 6);  // pages of 32 tokens wholly before position 200
  const auto after = f.cache.memory_report();
  EXPECT_EQ(after.layers[0].released_tokens, 192);
  EXPECT_EQ(after.layers[0].tokens, 300 - 192);
  EXPECT_EQ(after.layers[0].blocks, before.layers[0].blocks - 6);
  EXPECT_LT(after.total(), before.total());
  // Held bytes over held values: the f32 residual is a larger share of what is left.
  EXPECT_GT(after.effective_bits(), before.effective_bits());
  EXPECT_EQ(f.cache.tokens(0), 300);
  EXPECT_EQ(f.cache.page_table(0).first_token, 192);
  std::vector<float> k(10 * kD), v(10 * kD);
  EXPECT_THROW(f.cache.read(0, 185, 195, kvq::KVView<float>::nhd(k.data(), 10, kKvh, kD),
                            kvq::KVView<float>::nhd(v.data(), 10, kKvh, kD)),
               kvq::Error);
  f.cache.read(0, 192, 202, kvq::KVView<float>::nhd(k.data(), 10, kKvh, kD),
               kvq::KVView<float>::nhd(v.data(), 10, kKvh, kD));
  for (int i = 0; i < 10 * kD; ++i) EXPECT_EQ(k[i], f.kd[192 * kD + i]);
  EXPECT_THROW(f.cache.truncate(100), kvq::Error);
  EXPECT_EQ(f.cache.release_before(0, 150), 0);  // nothing more before 150
  // A window that reaches the released tokens is refused; one that does not is served.
  kvq::AttentionWorkspace ws;
  std::vector<float> q(kNh * kD, 0.1f), o(q.size());
  kvq::AttentionOptions opt;
  opt.window = 150;  // the query at 299 sees from 150: released tokens
  EXPECT_THROW(kvq::attend(f.cache, 0, kvq::KVView<const float>::nhd(q.data(), 1, kNh, kD),
                           kvq::KVView<float>::nhd(o.data(), 1, kNh, kD), true, ws, nullptr, opt),
               kvq::Error);
  EXPECT_THROW(kvq::attend(f.cache, 0, kvq::KVView<const float>::nhd(q.data(), 1, kNh, kD),
                           kvq::KVView<float>::nhd(o.data(), 1, kNh, kD), true, ws),
               kvq::Error);  // no window at all
  // Appending, flushing into the freed slots, truncating after the release.
  std::mt19937 g(9);
  const auto nk = gauss(g, 100 * kD, 1.0f), nv = gauss(g, 100 * kD, 1.0f);
  f.cache.append(0, kvq::KVView<const float>::nhd(nk.data(), 100, kKvh, kD),
                 kvq::KVView<const float>::nhd(nv.data(), 100, kKvh, kD));
  EXPECT_EQ(f.cache.tokens(0), 400);
  EXPECT_EQ(f.cache.release_before(0, 400 - 100 + 1), 3);
  f.cache.truncate(0, 350);
  EXPECT_EQ(f.cache.tokens(0), 350);
  std::vector<float> k2(kD), v2(kD);
  f.cache.read(0, 349, 350, kvq::KVView<float>::nhd(k2.data(), 1, kKvh, kD),
               kvq::KVView<float>::nhd(v2.data(), 1, kKvh, kD));
  f.cache.clear();
  EXPECT_EQ(f.cache.released_tokens(0), 0);
  EXPECT_EQ(f.cache.tokens(0), 0);
}

TEST(WindowRelease, ArchiveRefusesAReleasedCache) {
  Filled f = fill("kivi4", 200, 4);
  f.cache.release_before(0, 150);
  try {
    kvq::io::save_archive(f.cache, ::testing::TempDir() + "/released.kvqa");
    FAIL() << "a released cache was archived";
  } catch (const kvq::Error& e) {
    EXPECT_NE(std::string(e.what()).find("released"), std::string::npos) << e.what();
  }
}

}  // namespace
