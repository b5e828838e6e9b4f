// Rotate-then-Lloyd-Max quantizer: distortion matches the codebook's theory, the accountant
// matches real bytes, the rotated-query score path equals the plain path, QJL removes the
// inner-product bias, and bad input is rejected. KVQ_TEST_SCALAR_TOO
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "kvq/accounting/accountant.hpp"
#include "kvq/quant/quantize.hpp"
#include "test_util.hpp"

namespace {

using kvq::KVView;
using kvq::QuantConfig;
using kvq::Shape;

QuantConfig lm(int bits, bool qjl = false, uint64_t seed = 7,
               kvq::MetaDType meta = kvq::MetaDType::kF16) {
  QuantConfig c;
  c.format = kvq::Format::kLloydMax;
  c.bits = bits;
  c.qjl = qjl;
  c.seed = seed;
  c.meta = meta;
  return c;
}

// Per-vector normalized distortion E||x - x'||^2 / ||x||^2 equals d * codebook mse (the
// coordinate distortion of a random unit vector) within 3% for Gaussian vectors.
TEST(LloydMaxQuant, DistortionMatchesCodebookTheory) {
  const Shape s{512, 4, 128};
  auto data = kvq_test::kv_data(s, 3, false);
  std::vector<float> y(data.size());
  for (int b = 1; b <= 4; ++b) {
    auto q = kvq::quantize(lm(b, false, 7, kvq::MetaDType::kF32), KVView<const float>(data.data(), s));
    kvq::dequantize(q, KVView<float>(y.data(), s));
    double sum = 0;
    for (int64_t v = 0; v < s.tokens * s.heads; ++v) {
      double num = 0, den = 0;
      for (int64_t i = 0; i < 128; ++i) {
        const double a = data[v * 128 + i], c = y[v * 128 + i];
        num += (a - c) * (a - c);
        den += a * a;
      }
      sum += num / den;
    }
    const double measured = sum / static_cast<double>(s.tokens * s.heads);
    const double theory = 128 * kvq::lloyd_max_sphere(128, b).mse;
    EXPECT_NEAR(measured, theory, 0.03 * theory) << "bits " << b;
  }
}

TEST(LloydMaxQuant, AccountantMatchesBytes) {
  for (int64_t d : {64, 96, 128, 256})
    for (int b = 1; b <= 4; ++b)
      for (bool qjl : {false, true})
        for (auto meta : {kvq::MetaDType::kF16, kvq::MetaDType::kF32}) {
          const Shape s{9, 3, d};
          auto data = kvq_test::kv_data(s, 5, true);
          const auto cfg = lm(b, qjl, 1, meta);
          auto q = kvq::quantize(cfg, KVView<const float>(data.data(), s));
          ASSERT_EQ(q.breakdown(), kvq::account(cfg, s)) << cfg.name() << " d=" << d;
        }
  // lm4 at head_dim 128, fp16 norm: 4 + 16/128 bits per value (+ 8 seed bytes per tensor)
  const Shape big{1024, 8, 128};
  EXPECT_NEAR(kvq::effective_bits(lm(4), big), 4.125 + 64.0 / static_cast<double>(big.numel()),
              1e-12);
}

TEST(LloydMaxQuant, RotatedQueryScoresEqualPlainScores) {
  const Shape s{40, 2, 128};
  auto data = kvq_test::kv_data(s, 9, true);
  std::vector<float> q(4 * 128);
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  for (auto& v : q) v = nd(rng);
  for (bool qjl : {false, true}) {
    auto k = kvq::quantize(lm(3, qjl), KVView<const float>(data.data(), s));
    std::vector<float> fast(4 * 40), kd(data.size());
    kvq::lloyd_max_scores(k, q.data(), 4, 0.125f, fast.data());
    kvq::dequantize(k, KVView<float>(kd.data(), s));
    for (int hq = 0; hq < 4; ++hq)
      for (int t = 0; t < 40; ++t) {
        double plain = 0;
        for (int i = 0; i < 128; ++i) plain += double(q[hq * 128 + i]) * kd[(t * 2 + hq / 2) * 128 + i];
        plain *= 0.125;
        ASSERT_NEAR(fast[hq * 40 + t], plain, 1e-4 * (1 + std::fabs(plain))) << hq << " " << t;
      }
  }
}

// The plain Lloyd-Max reconstruction shrinks inner products (biased); adding the QJL residual
// makes the estimate unbiased. Averaged over many seeds (rotations and projections).
TEST(LloydMaxQuant, QjlRemovesInnerProductBias) {
  const Shape s{1, 1, 128};
  std::mt19937 rng(11);
  std::normal_distribution<float> nd;
  std::vector<float> x(128), q(128), y(128);
  for (auto& v : x) v = nd(rng);
  for (size_t i = 0; i < 128; ++i) q[i] = x[i] + 0.5f * nd(rng);
  double truth = 0;
  for (int i = 0; i < 128; ++i) truth += double(q[i]) * x[i];
  double plain = 0, corrected = 0;
  const int trials = 400;
  for (int seed = 0; seed < trials; ++seed)
    for (bool qjl : {false, true}) {
      auto k = kvq::quantize(lm(1, qjl, 1000 + seed, kvq::MetaDType::kF32),
                             KVView<const float>(x.data(), s));
      kvq::dequantize(k, KVView<float>(y.data(), s));
      double ip = 0;
      for (int i = 0; i < 128; ++i) ip += double(q[i]) * y[i];
      (qjl ? corrected : plain) += ip / truth / trials;
    }
  // 1-bit Lloyd-Max keeps a fraction 1 - mse*d ~ 0.64 of the inner product (2/pi)
  EXPECT_NEAR(plain, 1 - 128 * kvq::lloyd_max_sphere(128, 1).mse, 0.03);
  EXPECT_NEAR(corrected, 1.0, 0.05);
}

TEST(LloydMaxQuant, ZeroVectorsAndBadInput) {
  const Shape s{3, 2, 64};
  std::vector<float> data(static_cast<size_t>(s.numel()), 0.f);
  for (int i = 128; i < 192; ++i) data[i] = 0.1f * i;
  auto q = kvq::quantize(lm(2), KVView<const float>(data.data(), s));
  std::vector<float> y(data.size(), 5.f);
  kvq::dequantize(q, KVView<float>(y.data(), s));
  for (int i = 0; i < 128; ++i) ASSERT_EQ(y[i], 0.f);
  for (float v : y) ASSERT_TRUE(std::isfinite(v));
  data[200] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THROW(kvq::quantize(lm(2), KVView<const float>(data.data(), s)), kvq::Error);
  std::vector<float> odd(3 * 2 * 100, 1.f);
  try {
    kvq::quantize(lm(2), KVView<const float>(odd.data(), Shape{3, 2, 100}));
    FAIL();
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.kind(), kvq::ErrorKind::kUnsupported);
    EXPECT_NE(std::string(e.what()).find("head_dim 100"), std::string::npos) << e.what();
  }
  EXPECT_THROW(kvq::quantize(lm(5), KVView<const float>(data.data(), s)), kvq::Error);
}

TEST(LloydMaxQuant, DeterministicForSeedAndNonPowerOfTwoDims) {
  for (int64_t d : {80, 96, 192}) {
    const Shape s{16, 2, d};
    auto data = kvq_test::kv_data(s, 2, true);
    auto a = kvq::quantize(lm(4), KVView<const float>(data.data(), s));
    auto b = kvq::quantize(lm(4), KVView<const float>(data.data(), s));
    EXPECT_EQ(a.codes, b.codes);
    std::vector<float> y(data.size());
    kvq::dequantize(a, KVView<float>(y.data(), s));
    EXPECT_LT(kvq_test::rel_mse(data, y), 0.02) << d;
  }
}

}  // namespace
