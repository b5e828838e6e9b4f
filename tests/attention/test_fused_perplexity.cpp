// The real model through the fused kernels: stories260K perplexity with the cache's attention
// computed by kvq::attend_one (fused, fp32, straight from the codes: what CacheBackend and
// kvq_perplexity use) equals the perplexity with the double-precision oracle
// (reference/attention_ref.hpp) over the same cache, to 4 significant digits (measured: far
// closer), for kivi4, k8v4, kivi2, turbo4 and pre-RoPE keys.
#include <gtest/gtest.h>

#include "stories_data.hpp"

#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "kvq/attention/attention.hpp"
#include "kvq/eval/cache_backend.hpp"
#include "kvq/cache/kv_cache.hpp"
#include "kvq/eval/kv_backend.hpp"
#include "kvq/eval/llama2c.hpp"
#include "kvq/policy/spec.hpp"
#include "kvq/reference/attention_ref.hpp"

namespace {

/// CacheBackend's twin whose attention is the oracle (same cache, same appends).
class OracleCacheBackend final : public kvq::eval::KVBackend {
 public:
  OracleCacheBackend(kvq::Policy p, const kvq::eval::KVGeometry& g, bool prerope)
      : cache_(std::move(p), g.n_layers, g.n_kv_heads, g.head_dim, g.max_tokens),
        prerope_(prerope) {}
  void reset() override { cache_.clear(); }
  void append(int layer, int, const float* k_prerope, const float* k, const float* v) override {
    const int H = cache_.kv_heads(), D = cache_.head_dim();
    cache_.append(layer, kvq::KVView<const float>::nhd(prerope_ ? k_prerope : k, 1, H, D),
                  kvq::KVView<const float>::nhd(v, 1, H, D));
  }
  void attend(int layer, int, const float* q, int n_heads, float* out) override {
    const int D = cache_.head_dim();
    kvq::reference::attend_ref(cache_, layer, kvq::KVView<const float>::nhd(q, 1, n_heads, D),
                               kvq::KVView<float>::nhd(out, 1, n_heads, D), true, ws_,
                               prerope_ ? &rope_ : nullptr);
  }

 private:
  kvq::KVCache cache_;
  bool prerope_;
  kvq::RopeConfig rope_;
  kvq::reference::RefAttentionWorkspace ws_;
};

double perplexity(kvq::eval::Llama2cModel& model, const kvq::eval::Tokenizer& tok,
                  kvq::eval::KVBackend& kv, int lines) {
  std::ifstream in(kvq_test::text_path());
  std::string line;
  double nll = 0;
  int64_t count = 0;
  for (int i = 0; i < lines && std::getline(in, line); ++i) {
    std::vector<int> ids = tok.encode(line, true);
    if (ids.size() > 512) ids.resize(512);
    kv.reset();
    for (std::size_t pos = 0; pos + 1 < ids.size(); ++pos) {
      const std::vector<float> logits = model.forward(ids[pos], static_cast<int>(pos), kv);
      double mx = logits[0];
      for (float x : logits) mx = std::max<double>(mx, x);
      double z = 0;
      for (float x : logits) z += std::exp(x - mx);
      nll -= logits[static_cast<std::size_t>(ids[pos + 1])] - mx - std::log(z);
      ++count;
    }
  }
  return std::exp(nll / static_cast<double>(count));
}

TEST(FusedPerplexity, EqualsTheOracleToFourSignificantDigits) {
  KVQ_REQUIRE_STORIES();
  const std::string dir = kvq_test::stories_dir() + "/";
  kvq::eval::Llama2cModel model(dir + "stories260K.bin");
  const kvq::eval::Tokenizer tok(dir + "tok512.bin", model.config().vocab_size);
  const kvq::eval::KVGeometry g = model.kv_geometry();
  const int lines = KVQ_TEST_SANITIZED ? 1 : 3;
  struct Case {
    const char* spec;
    bool prerope;
  };
  for (const Case c : {Case{"kivi4", false}, Case{"k8v4", false}, Case{"kivi2", false},
                       Case{"turbo4", false}, Case{"kivi2", true}}) {
    kvq::CacheBackend fused(kvq::parse_policy(c.spec), g, c.prerope);
    OracleCacheBackend oracle(kvq::parse_policy(c.spec), g, c.prerope);
    const double pf = perplexity(model, tok, fused, lines);
    const double po = perplexity(model, tok, oracle, lines);
    std::printf("  stories260K, %d lines, %s%s: fused %.7f, oracle %.7f (rel. diff %.1e)\n", lines,
                c.spec, c.prerope ? " pre-RoPE" : "", pf, po, std::fabs(pf - po) / po);
    // 4 significant digits: |pf - po| < 0.5e-4 relative (perplexities here are 5..8).
    EXPECT_LT(std::fabs(pf - po) / po, 5e-5) << c.spec;
  }
}

}  // namespace
