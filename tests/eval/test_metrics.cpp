// Tests for kvq/eval/metrics.hpp: every metric against cases computed by hand.
#include "kvq/eval/metrics.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

namespace kvq::eval {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// ---------------------------------------------------------------------------------------------
// Element-wise errors
// ---------------------------------------------------------------------------------------------

TEST(RelativeMse, KnownPair) {
  // ref = [1, 2, 2] (energy 9), test differs by 1 in one element: 1/9.
  const std::vector<float> ref = {1, 2, 2};
  const std::vector<float> test = {1, 2, 3};
  EXPECT_DOUBLE_EQ(relative_mse(ref.data(), test.data(), 3), 1.0 / 9.0);
  EXPECT_DOUBLE_EQ(relative_error(ref.data(), test.data(), 3), 1.0 / 3.0);
  EXPECT_DOUBLE_EQ(relative_mse(ref.data(), ref.data(), 3), 0.0);
  // Asymmetric on purpose: normalised by the reference.
  EXPECT_DOUBLE_EQ(relative_mse(test.data(), ref.data(), 3), 1.0 / 14.0);
}

TEST(RelativeMse, DoubleInput) {
  const std::vector<double> ref = {3, 4};
  const std::vector<double> test = {3, 3};
  EXPECT_DOUBLE_EQ(relative_mse(ref.data(), test.data(), 2), 1.0 / 25.0);
}

TEST(RelativeMse, ZeroDenominatorRule) {
  const std::vector<float> zero = {0, 0, 0};
  const std::vector<float> some = {0, 1e-30f, 0};
  EXPECT_EQ(relative_mse(zero.data(), zero.data(), 3), 0.0);  // exact zero vs zero
  EXPECT_EQ(relative_mse(zero.data(), some.data(), 3), kInf);
  EXPECT_EQ(relative_mse(zero.data(), zero.data(), 0), 0.0);  // empty: nothing wrong
  const std::vector<float> nan = {0, std::nanf(""), 0};
  EXPECT_TRUE(std::isnan(relative_mse(zero.data(), nan.data(), 3)));
  EXPECT_TRUE(std::isnan(relative_mse(nan.data(), zero.data(), 3)));
}

TEST(RelativeMse, ViewsOfDifferentLayouts) {
  // The same logical [2 tokens, 2 heads, 2 dims] tensor in NHD and HND.
  const std::vector<float> nhd = {1, 2, 3, 4, 5, 6, 7, 8};  // t0:h0,h1; t1:h0,h1
  const std::vector<float> hnd = {1, 2, 5, 6, 3, 4, 7, 8};  // h0:t0,t1; h1:t0,t1
  KVView<const float> a = KVView<const float>::nhd(nhd.data(), 2, 2, 2);
  KVView<const float> b = KVView<const float>::hnd(hnd.data(), 2, 2, 2);
  EXPECT_EQ(relative_mse(a, b), 0.0);
  EXPECT_EQ(max_abs_error(a, b), 0.0);
  std::vector<float> c = nhd;
  c[7] = 10;  // (t1, h1, d1): 8 -> 10
  KVView<const float> cv = KVView<const float>::nhd(c.data(), 2, 2, 2);
  EXPECT_DOUBLE_EQ(relative_mse(b, cv), 4.0 / 204.0);
  EXPECT_DOUBLE_EQ(max_abs_error(b, cv), 2.0);
  KVView<const float> wrong = KVView<const float>::nhd(nhd.data(), 2, 1, 4);
  try {
    relative_mse(a, wrong);
    FAIL() << "expected a shape mismatch";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kShapeMismatch);
  }
}

TEST(MaxAbsError, KnownAndNaN) {
  const std::vector<float> a = {1, 2, 3};
  const std::vector<float> b = {1.5f, 2, 1};
  EXPECT_DOUBLE_EQ(max_abs_error(a.data(), b.data(), 3), 2.0);
  EXPECT_EQ(max_abs_error(a.data(), b.data(), 0), 0.0);
  const std::vector<float> n = {1, std::nanf(""), 3};
  EXPECT_TRUE(std::isnan(max_abs_error(a.data(), n.data(), 3)));
  std::vector<float> nv = {1, 2, 3, 4, 5, 6, 7, std::nanf("")};
  std::vector<float> ok = {1, 2, 3, 4, 5, 6, 7, 8};
  EXPECT_TRUE(std::isnan(max_abs_error(KVView<const float>::nhd(ok.data(), 2, 2, 2),
                                       KVView<const float>::nhd(nv.data(), 2, 2, 2))));
}

TEST(CosineSimilarity, KnownCasesAndZeroRule) {
  const std::vector<float> x = {1, 0};
  const std::vector<float> y = {0, 1};
  const std::vector<float> z = {1, 2};
  const std::vector<float> z2 = {2, 4};
  const std::vector<float> zneg = {-1, -2};
  const std::vector<float> zero = {0, 0};
  EXPECT_DOUBLE_EQ(cosine_similarity(x.data(), y.data(), 2), 0.0);
  EXPECT_DOUBLE_EQ(cosine_similarity(z.data(), z2.data(), 2), 1.0);
  EXPECT_DOUBLE_EQ(cosine_similarity(z.data(), zneg.data(), 2), -1.0);
  // [1,0]·[1,2] / (1 * sqrt 5)
  EXPECT_DOUBLE_EQ(cosine_similarity(x.data(), z.data(), 2), 1.0 / std::sqrt(5.0));
  EXPECT_EQ(cosine_similarity(zero.data(), zero.data(), 2), 1.0);
  EXPECT_EQ(cosine_similarity(zero.data(), z.data(), 2), 0.0);
  EXPECT_EQ(cosine_similarity(z.data(), zero.data(), 2), 0.0);
}

// ---------------------------------------------------------------------------------------------
// Softmax, log-softmax, KL
// ---------------------------------------------------------------------------------------------

TEST(Softmax, KnownVectors) {
  // exp(log 3) : exp(0) = 3 : 1.
  const std::vector<double> p = softmax(std::vector<double>{0.0, std::log(3.0)});
  EXPECT_NEAR(p[0], 0.25, 1e-15);
  EXPECT_NEAR(p[1], 0.75, 1e-15);
  // 1 : e : e^2.
  const std::vector<float> x = {0, 1, 2};
  const double z = 1 + std::exp(1.0) + std::exp(2.0);
  const std::vector<double> q = softmax(x);
  EXPECT_NEAR(q[0], 1 / z, 1e-15);
  EXPECT_NEAR(q[1], std::exp(1.0) / z, 1e-15);
  EXPECT_NEAR(q[2], std::exp(2.0) / z, 1e-15);
}

TEST(Softmax, StableForHugeLogitsAndMasked) {
  const std::vector<float> big = {1000.0f, 1000.0f, -1000.0f};
  const std::vector<double> p = softmax(big);
  EXPECT_DOUBLE_EQ(p[0], 0.5);
  EXPECT_DOUBLE_EQ(p[1], 0.5);
  EXPECT_EQ(p[2], 0.0);
  const std::vector<float> masked = {0.0f, -INFINITY};
  const std::vector<double> m = softmax(masked);
  EXPECT_EQ(m[0], 1.0);
  EXPECT_EQ(m[1], 0.0);
  const std::vector<double> lm = log_softmax(masked);
  EXPECT_EQ(lm[0], 0.0);
  EXPECT_EQ(lm[1], -kInf);
}

TEST(Softmax, ShiftInvariantAndInPlace) {
  std::vector<double> a = {0.5, -1.25, 3.0, 2.0};
  std::vector<double> b = a;
  for (double& v : b) v += 123.0;
  const std::vector<double> pa = softmax(a);
  const std::vector<double> pb = softmax(b);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(pa[i], pb[i], 1e-15);
  softmax(a.data(), a.size(), a.data());  // in place
  for (size_t i = 0; i < a.size(); ++i) EXPECT_DOUBLE_EQ(a[i], pa[i]);
}

TEST(LogSoftmax, KnownVectorsAndPrecision) {
  const std::vector<double> l = log_softmax(std::vector<float>{0.0f, 0.0f});
  EXPECT_DOUBLE_EQ(l[0], -std::log(2.0));
  EXPECT_DOUBLE_EQ(l[1], -std::log(2.0));
  // A tiny probability keeps its precision: log p = -200 - log(1 + e^-200) = -200 exactly.
  const std::vector<double> t = log_softmax(std::vector<double>{0.0, -200.0});
  EXPECT_DOUBLE_EQ(t[1], -200.0);
  EXPECT_EQ(t[0], 0.0);
}

TEST(Softmax, RejectsNonFiniteAndEmpty) {
  std::vector<double> out(3);
  const std::vector<float> nan = {0.0f, std::nanf(""), 1.0f};
  const std::vector<float> pinf = {0.0f, INFINITY};
  const std::vector<float> all_masked = {-INFINITY, -INFINITY};
  for (const auto* v : {&nan, &pinf, &all_masked}) {
    try {
      log_softmax(v->data(), v->size(), out.data());
      FAIL() << "expected kNonFinite";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kNonFinite) << e.what();
    }
  }
  try {
    softmax(nan.data(), 0, out.data());
    FAIL() << "expected kInvalidArgument";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
  }
}

TEST(KlDivergence, HandComputedCase) {
  // P = softmax([0, 0]) = [1/2, 1/2]; Q = softmax([log 3, 0]) = [3/4, 1/4].
  // KL(P||Q) = 1/2 log((1/2)/(3/4)) + 1/2 log((1/2)/(1/4)) = 1/2 log(4/3).
  const std::vector<float> p = {0.0f, 0.0f};
  const std::vector<float> q = {static_cast<float>(std::log(3.0)), 0.0f};
  const double expected = 0.5 * std::log(4.0 / 3.0);  // 0.143841036...
  EXPECT_NEAR(kl_divergence_logits(p.data(), q.data(), 2), expected, 1e-7);
  const std::vector<double> pd = {0.0, 0.0};
  const std::vector<double> qd = {std::log(3.0), 0.0};
  EXPECT_NEAR(kl_divergence_logits(pd.data(), qd.data(), 2), expected, 1e-15);
  // Reverse direction: KL(Q||P) = 3/4 log(3/2) + 1/4 log(1/2).
  EXPECT_NEAR(kl_divergence_logits(qd.data(), pd.data(), 2),
              0.75 * std::log(1.5) + 0.25 * std::log(0.5), 1e-15);
}

TEST(KlDivergence, ZeroForIdenticalAndShifted) {
  const std::vector<float> a = {1.0f, -2.0f, 0.5f, 7.0f};
  std::vector<float> b = a;
  EXPECT_EQ(kl_divergence_logits(a.data(), b.data(), a.size()), 0.0);
  for (float& v : b) v += 4.0f;  // same distribution
  EXPECT_NEAR(kl_divergence_logits(a.data(), b.data(), a.size()), 0.0, 1e-12);
}

TEST(KlDivergence, SupportRules) {
  // Reference puts no mass where the test does: finite. The reverse: infinite.
  const std::vector<double> masked = {0.0, -kInf};
  const std::vector<double> full = {0.0, 0.0};
  EXPECT_DOUBLE_EQ(kl_divergence_logits(masked.data(), full.data(), 2), std::log(2.0));
  EXPECT_EQ(kl_divergence_logits(full.data(), masked.data(), 2), kInf);
}

TEST(KlDivergence, FromLogProbs) {
  const std::vector<double> lp = {std::log(0.5), std::log(0.5)};
  const std::vector<double> lq = {std::log(0.75), std::log(0.25)};
  EXPECT_NEAR(kl_divergence_log_probs(lp.data(), lq.data(), 2), 0.5 * std::log(4.0 / 3.0), 1e-15);
}

// ---------------------------------------------------------------------------------------------
// Attention
// ---------------------------------------------------------------------------------------------

// Two tokens, one kv head shared by two query heads, head_dim 2 (scale 1/sqrt 2).
//   K = [[1, 0], [0, 1]], V = [[1, 2], [3, 4]]
//   head 0: q = [sqrt2 log 3, 0] -> scores [log 3, 0] -> weights [3/4, 1/4]
//           -> out = 3/4 [1, 2] + 1/4 [3, 4] = [1.5, 2.5]
//   head 1: q = [0, 0] -> weights [1/2, 1/2] -> out [2, 3]
struct ToyAttention {
  std::vector<float> q = {static_cast<float>(std::sqrt(2.0) * std::log(3.0)), 0.0f, 0.0f, 0.0f};
  std::vector<float> k = {1, 0, 0, 1};  // [tokens=2, heads=1, head_dim=2]
  std::vector<float> v = {1, 2, 3, 4};
  KVView<const float> kv() const { return KVView<const float>::nhd(k.data(), 2, 1, 2); }
  KVView<const float> vv() const { return KVView<const float>::nhd(v.data(), 2, 1, 2); }
};

TEST(Attention, ScoresWeightsOutputByHand) {
  ToyAttention a;
  const std::vector<double> s = attention_scores(a.q.data(), 2, a.kv());
  ASSERT_EQ(s.size(), 4u);
  EXPECT_NEAR(s[0], std::log(3.0), 1e-6);
  EXPECT_EQ(s[1], 0.0);
  EXPECT_EQ(s[2], 0.0);
  EXPECT_EQ(s[3], 0.0);
  const std::vector<double> w = attention_weights(a.q.data(), 2, a.kv());
  EXPECT_NEAR(w[0], 0.75, 1e-7);
  EXPECT_NEAR(w[1], 0.25, 1e-7);
  EXPECT_DOUBLE_EQ(w[2], 0.5);
  EXPECT_DOUBLE_EQ(w[3], 0.5);
  const std::vector<double> o = attention_output(a.q.data(), 2, a.kv(), a.vv());
  ASSERT_EQ(o.size(), 4u);
  EXPECT_NEAR(o[0], 1.5, 1e-6);
  EXPECT_NEAR(o[1], 2.5, 1e-6);
  EXPECT_DOUBLE_EQ(o[2], 2.0);
  EXPECT_DOUBLE_EQ(o[3], 3.0);
}

TEST(Attention, GqaMapsQueryHeadsToKvHeads) {
  // Two kv heads, four query heads: heads 0,1 -> kv 0 and heads 2,3 -> kv 1.
  // One token, so every weight is 1 and the output is the value of the mapped kv head.
  const std::vector<float> k = {1, 1, 1, 1};      // [1, 2, 2]
  const std::vector<float> v = {10, 20, 30, 40};  // kv0 = [10,20], kv1 = [30,40]
  const std::vector<float> q(8, 0.5f);
  const std::vector<double> o =
      attention_output(q.data(), 4, KVView<const float>::nhd(k.data(), 1, 2, 2),
                       KVView<const float>::nhd(v.data(), 1, 2, 2));
  const std::vector<double> want = {10, 20, 10, 20, 30, 40, 30, 40};
  ASSERT_EQ(o.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_DOUBLE_EQ(o[i], want[i]) << i;
}

TEST(Attention, ErrorsByHand) {
  ToyAttention a;
  // Test keys: token 0's key becomes [1.1, 0]. Head 0's score on token 0 grows by 10%, the
  // other scores are 0 in both, so the pooled relative score error is exactly 0.1.
  std::vector<float> k2 = {1.1f, 0, 0, 1};
  KVView<const float> kt = KVView<const float>::nhd(k2.data(), 2, 1, 2);
  EXPECT_NEAR(attention_score_error(a.q.data(), 2, a.kv(), kt), 0.1, 1e-6);

  // Test keys all zero: head 0's weights become [1/2, 1/2]; head 1 unchanged.
  // weight KL = mean(KL([3/4,1/4] || [1/2,1/2]), 0) = (3/4 log 1.5 + 1/4 log 0.5) / 2.
  std::vector<float> kz = {0, 0, 0, 0};
  KVView<const float> kzv = KVView<const float>::nhd(kz.data(), 2, 1, 2);
  EXPECT_NEAR(attention_weight_kl(a.q.data(), 2, a.kv(), kzv),
              (0.75 * std::log(1.5) + 0.25 * std::log(0.5)) / 2, 1e-7);
  // Output: head 0 becomes [2, 3] (was [1.5, 2.5]), head 1 stays [2, 3]:
  // sqrt((0.5^2 + 0.5^2) / (1.5^2 + 2.5^2 + 2^2 + 3^2)) = sqrt(0.5 / 21.5).
  EXPECT_NEAR(attention_output_error(a.q.data(), 2, a.kv(), a.vv(), kzv, a.vv()),
              std::sqrt(0.5 / 21.5), 1e-7);
  // Value error only: V' = V + [0, 1] on token 1. Head 0 gains 1/4 in channel 1, head 1 gains
  // 1/2: sqrt((1/16 + 1/4) / 21.5).
  std::vector<float> v2 = {1, 2, 3, 5};
  KVView<const float> vt = KVView<const float>::nhd(v2.data(), 2, 1, 2);
  const AttentionErrors e = attention_errors(a.q.data(), 2, a.kv(), a.vv(), a.kv(), vt);
  EXPECT_EQ(e.score_rel_error, 0.0);
  EXPECT_EQ(e.weight_kl, 0.0);
  EXPECT_NEAR(e.output_rel_error, std::sqrt((1.0 / 16 + 1.0 / 4) / 21.5), 1e-7);
}

TEST(Attention, LayoutDoesNotMatter) {
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int tokens = 5, kv_heads = 2, head_dim = 4, n_heads = 4;
  std::vector<float> k_nhd(tokens * kv_heads * head_dim), v_nhd(k_nhd.size());
  std::vector<float> q(n_heads * head_dim);
  for (float& x : k_nhd) x = nd(rng);
  for (float& x : v_nhd) x = nd(rng);
  for (float& x : q) x = nd(rng);
  // Same data in HND.
  std::vector<float> k_hnd(k_nhd.size()), v_hnd(v_nhd.size());
  for (int t = 0; t < tokens; ++t)
    for (int h = 0; h < kv_heads; ++h)
      for (int d = 0; d < head_dim; ++d) {
        k_hnd[(h * tokens + t) * head_dim + d] = k_nhd[(t * kv_heads + h) * head_dim + d];
        v_hnd[(h * tokens + t) * head_dim + d] = v_nhd[(t * kv_heads + h) * head_dim + d];
      }
  const auto a = attention_output(q.data(), n_heads,
                                  KVView<const float>::nhd(k_nhd.data(), tokens, kv_heads, 4),
                                  KVView<const float>::nhd(v_nhd.data(), tokens, kv_heads, 4));
  const auto b = attention_output(q.data(), n_heads,
                                  KVView<const float>::hnd(k_hnd.data(), kv_heads, tokens, 4),
                                  KVView<const float>::hnd(v_hnd.data(), kv_heads, tokens, 4));
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i], b[i]);
}

TEST(Attention, RejectsBadArguments) {
  ToyAttention a;
  auto expect_kind = [](ErrorKind kind, auto&& fn) {
    try {
      fn();
      FAIL() << "expected " << to_string(kind);
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), kind) << e.what();
    }
  };
  // 3 query heads cannot share 2 kv heads evenly.
  std::vector<float> k2(2 * 2 * 2, 1.0f);
  std::vector<float> q3(3 * 2, 1.0f);
  expect_kind(ErrorKind::kInvalidArgument, [&] {
    attention_scores(q3.data(), 3, KVView<const float>::nhd(k2.data(), 2, 2, 2));
  });
  expect_kind(ErrorKind::kInvalidArgument, [&] { attention_scores(a.q.data(), 0, a.kv()); });
  expect_kind(ErrorKind::kShapeMismatch, [&] {
    attention_output(a.q.data(), 2, a.kv(), KVView<const float>::nhd(a.v.data(), 1, 1, 2));
  });
  expect_kind(ErrorKind::kShapeMismatch, [&] {
    attention_scores(a.q.data(), 2, KVView<const float>::nhd(a.k.data(), 0, 1, 2));
  });
  expect_kind(ErrorKind::kShapeMismatch, [&] {
    attention_score_error(a.q.data(), 2, a.kv(), KVView<const float>::nhd(a.k.data(), 1, 1, 2));
  });
}

}  // namespace
}  // namespace kvq::eval
