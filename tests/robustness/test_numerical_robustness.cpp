// Numerical robustness properties across every quantizer configuration and every policy
// (issue 13, item 4), through the public API only:
//   - finite input never becomes NaN or Inf: quantize() either refuses it with kvq::Error or
//     dequantize() returns finite values; a KVCache either refuses an append or read() and
//     attend() return finite values;
//   - input the format is documented to hold (|x| <= 65504 for fp16 values and metadata, row
//     norms <= 65504 for Lloyd-Max with fp16 norms) is never refused.
// Input classes: random normal, magnitudes over 1e-30..6e4, f32 and fp16 denormals, all-zero
// and all-equal groups, +-65504, one huge outlier per group, zero vectors (Lloyd-Max's n = 0
// path), one-hot vectors, and beyond-fp16 magnitudes up to FLT_MAX.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "kvq/attention/attention.hpp"
#include "kvq/cache/kv_cache.hpp"
#include "kvq/policy/spec.hpp"
#include "kvq/quant/quantize.hpp"
#include "robustness/robustness_util.hpp"

namespace {

using kvq_robust::all_finite;
using kvq_robust::documented_holdable;

TEST(NumericalRobustness, QuantizeNeverTurnsFiniteInputIntoNaNOrInf) {
  const kvq::Shape s{32, 2, 64};  // [tokens, heads, head_dim]
  int cases = 0, refused = 0;
  uint32_t seed = 1;
  for (const std::string& term : kvq_robust::all_terms()) {
    const kvq::QuantConfig cfg = kvq_robust::usable_term(term);
    for (const auto& cls : kvq_robust::input_classes()) {
      const std::vector<float> x = cls.make(s, seed++);
      ASSERT_TRUE(all_finite(x)) << cls.name;
      ++cases;
      const auto xv = kvq::KVView<const float>::nhd(x.data(), s.tokens, s.heads, s.head_dim);
      kvq::QTensor q;
      try {
        q = kvq::quantize(cfg, xv);
      } catch (const kvq::Error& e) {
        ++refused;
        EXPECT_FALSE(documented_holdable(cfg, x, s.head_dim))
            << term << " refused holdable input '" << cls.name << "': " << e.what();
        continue;
      }
      std::vector<float> y(x.size());
      kvq::dequantize(q, kvq::KVView<float>::nhd(y.data(), s.tokens, s.heads, s.head_dim));
      EXPECT_TRUE(all_finite(y)) << term << " on '" << cls.name << "' dequantized to NaN/Inf";
    }
  }
  std::printf("[robustness] quantize/dequantize: %d cases (%zu configs), %d refused\n", cases,
              kvq_robust::all_terms().size(), refused);
}

/// Appends `k` and `v` ([T, H, D]) to every layer in chunks of 1, 7, 16, ... tokens, so that
/// flushes happen inside chunks, at their ends and token by token.
void append_chunked(kvq::KVCache& c, const std::vector<float>& k, const std::vector<float>& v,
                    int64_t T) {
  const int64_t H = c.kv_heads(), D = c.head_dim();
  const int64_t chunks[] = {1, 7, 16, 3, 40, 13};
  for (int layer = 0; layer < c.n_layers(); ++layer) {
    int64_t t = 0;
    for (int i = 0; t < T; ++i) {
      const int64_t n = std::min(chunks[i % 6], T - t);
      const size_t off = static_cast<size_t>(t * H * D);
      c.append(layer, kvq::KVView<const float>::nhd(k.data() + off, n, H, D),
               kvq::KVView<const float>::nhd(v.data() + off, n, H, D));
      t += n;
    }
  }
}

TEST(NumericalRobustness, CacheReadAndAttentionStayFiniteOrRefuse) {
  constexpr int kLayers = 3, kHeads = 2, kDim = 64, kQHeads = 4, kQ = 5;
  constexpr int64_t kTokens = 90;
  const kvq::Shape s{kTokens, kHeads, kDim};
  int cases = 0, refused = 0, attention_outputs = 0, beyond_fp32 = 0;
  uint32_t seed = 1000;
  for (const std::string& spec : kvq_robust::all_policies()) {
    const kvq::Policy policy = kvq_robust::usable_policy(spec);
    for (const auto& cls : kvq_robust::input_classes()) {
      const std::vector<float> k = cls.make(s, seed++);
      const std::vector<float> v = cls.make(s, seed++);
      ++cases;
      kvq::KVCache cache(policy, kLayers, kHeads, kDim);
      bool holdable = true;
      for (int l = 0; l < kLayers; ++l) {
        holdable = holdable && documented_holdable(cache.key_config(l), k, kDim) &&
                   documented_holdable(cache.value_config(l), v, kDim);
      }
      try {
        append_chunked(cache, k, v, kTokens);
      } catch (const kvq::Error& e) {
        ++refused;
        EXPECT_FALSE(holdable) << spec << " refused holdable input '" << cls.name
                               << "': " << e.what();
        continue;
      }
      for (int l = 0; l < kLayers; ++l) {
        std::vector<float> kr(k.size()), vr(v.size());
        cache.read(l, 0, kTokens, kvq::KVView<float>::nhd(kr.data(), kTokens, kHeads, kDim),
                   kvq::KVView<float>::nhd(vr.data(), kTokens, kHeads, kDim));
        EXPECT_TRUE(all_finite(kr) && all_finite(vr))
            << spec << " layer " << l << " read NaN/Inf back from '" << cls.name << "'";
        // Queries: ordinary ones, and the (finite, possibly extreme) keys themselves.
        const kvq::Shape qs{kQ, kQHeads, kDim};
        std::vector<float> q1 = kvq_robust::normal(qs, seed++);
        std::vector<float> q2(q1.size());
        for (size_t i = 0; i < q2.size(); ++i) q2[i] = k[i % k.size()];
        for (const auto* q : {&q1, &q2}) {
          std::vector<float> out(q->size());
          kvq::attend(cache, l, kvq::KVView<const float>::nhd(q->data(), kQ, kQHeads, kDim),
                      kvq::KVView<float>::nhd(out.data(), kQ, kQHeads, kDim), true);
          // Attention is fp32 throughout (attention.hpp): finiteness is guaranteed while every
          // score |q.k| / sqrt(D) and every weighted value sum fits fp32.
          const double smax = double(kvq_robust::max_abs(*q)) * kvq_robust::max_abs(kr) * kDim /
                              std::sqrt(double(kDim));
          const double vsum = double(kvq_robust::max_abs(vr)) * kTokens;
          if (smax > 1e37 || vsum > 1e37) {
            ++beyond_fp32;
            continue;
          }
          ++attention_outputs;
          EXPECT_TRUE(all_finite(out))
              << spec << " layer " << l << ": attention output NaN/Inf on '" << cls.name << "'";
        }
      }
    }
  }
  std::printf(
      "[robustness] cache + attention: %d cases (%zu policies x %zu input classes), %d refused, "
      "%d attention outputs checked finite, %d beyond the fp32 score range not asserted\n",
      cases, kvq_robust::all_policies().size(), kvq_robust::input_classes().size(), refused,
      attention_outputs, beyond_fp32);
}

}  // namespace
