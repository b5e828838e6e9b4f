// KVQ_TEST_SCALAR_TOO
// Tests of quant/outlier_quant.hpp (dense-and-sparse) against reference/outlier_ref.hpp:
// identical bytes for int, fp8 and nuq on every axis, exact outliers, fp16 range errors, the
// accountant, token-range decodes.
#include "kvq/quant/outlier_quant.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kvq/accounting/accountant.hpp"
#include "kvq/quant/quantize.hpp"
#include "kvq/reference/outlier_ref.hpp"
#include "test_util.hpp"

namespace {

kvq::QuantConfig make(kvq::Format f, int bits, kvq::Axis axis, int64_t group, int out,
                      float pct = 0.f) {
  kvq::QuantConfig c;
  c.format = f;
  c.bits = f == kvq::Format::kE4M3 || f == kvq::Format::kE5M2 ? 8 : bits;
  c.axis = axis;
  c.group = group;
  c.outliers = out;
  c.outlier_pct = pct;
  if (f == kvq::Format::kNuq) {
    const int n = 1 << bits;
    for (int i = 0; i < n; ++i) c.nuq_levels[static_cast<std::size_t>(i)] = (i + 0.5f) / n;
    c.nuq_ready = true;
  }
  return c;
}

struct Case {
  kvq::Format f;
  int bits;
  kvq::Axis axis;
  int64_t group;
  int out;
  float pct;
  int64_t head_dim;
};

class OutlierQuant : public ::testing::TestWithParam<Case> {};

TEST_P(OutlierQuant, MatchesOracleAndKeepsOutliersExactly) {
  const Case cs = GetParam();
  const kvq::Shape s{32, 2, cs.head_dim};
  auto x = kvq_test::kv_data(s, 9, true);
  for (std::size_t i = 0; i < x.size(); i += 37) x[i] *= 20.f;  // sparse token outliers
  const auto cfg = make(cs.f, cs.bits, cs.axis, cs.group, cs.out, cs.pct);
  const kvq::KVView<const float> xv(x.data(), s);
  const kvq::QTensor fast = kvq::quantize(cfg, xv);
  const kvq::QTensor ref = kvq::reference::quantize_with_outliers(cfg, xv);
  EXPECT_EQ(fast.codes, ref.codes);
  EXPECT_EQ(fast.scales, ref.scales);
  EXPECT_EQ(fast.zeros, ref.zeros);
  EXPECT_EQ(fast.outlier_values, ref.outlier_values);
  EXPECT_EQ(fast.outlier_pos, ref.outlier_pos);
  EXPECT_EQ(fast.bytes(), kvq::account(cfg, s).total());
  EXPECT_EQ(fast.breakdown(), kvq::account(cfg, s));
  const int64_t k = kvq::outlier_count(cfg, s.head_dim);
  EXPECT_EQ(fast.breakdown().outliers,
            static_cast<std::size_t>(s.tokens * s.heads * k *
                                     (2 + kvq::outlier_pos_bytes(s.head_dim))));

  std::vector<float> a(x.size()), b(x.size());
  kvq::dequantize(fast, kvq::KVView<float>(a.data(), s));
  kvq::reference::dequantize_with_outliers(ref, kvq::KVView<float>(b.data(), s));
  EXPECT_EQ(a, b);
  // Exactly k positions per vector, ascending, reconstructed as the fp16 of the input.
  const auto split = kvq::reference::split_outliers(cfg.axis, cfg.group, k, xv);
  ASSERT_EQ(split.sel.size(), static_cast<std::size_t>(s.tokens * s.heads * k));
  for (int64_t v = 0; v < s.tokens * s.heads; ++v)
    for (int64_t j = 0; j < k; ++j) {
      const int32_t d = split.sel[static_cast<std::size_t>(v * k + j)];
      if (j > 0) {
        EXPECT_LT(split.sel[static_cast<std::size_t>(v * k + j - 1)], d);
      }
      const std::size_t i = static_cast<std::size_t>(v * s.head_dim + d);
      EXPECT_EQ(a[i], kvq::half_bits_to_float(kvq::float_to_half_bits(x[i])));
    }
  // Token-range decodes agree with the whole decode.
  std::vector<float> part(static_cast<std::size_t>(8 * s.heads * s.head_dim));
  kvq::QuantWorkspace ws;
  kvq::dequantize_tokens(kvq::view_of(fast), 8,
                         kvq::KVView<float>(part.data(), {8, s.heads, s.head_dim}), ws);
  EXPECT_TRUE(std::equal(part.begin(), part.end(), a.begin() + 8 * s.heads * s.head_dim));
}

INSTANTIATE_TEST_SUITE_P(
    All, OutlierQuant,
    ::testing::Values(Case{kvq::Format::kInt, 3, kvq::Axis::kChannel, 32, 0, 1.f, 64},
                      Case{kvq::Format::kInt, 2, kvq::Axis::kChannel, 16, 3, 0.f, 64},
                      Case{kvq::Format::kInt, 4, kvq::Axis::kToken, 32, 1, 0.f, 128},
                      Case{kvq::Format::kInt, 3, kvq::Axis::kToken, 16, 8, 0.f, 64},
                      Case{kvq::Format::kInt, 3, kvq::Axis::kHead, 8, 2, 0.f, 32},
                      Case{kvq::Format::kE4M3, 8, kvq::Axis::kHead, 0, 2, 0.f, 64},
                      Case{kvq::Format::kE5M2, 8, kvq::Axis::kToken, 32, 0, 5.f, 64},
                      Case{kvq::Format::kNuq, 3, kvq::Axis::kChannel, 32, 0, 1.f, 64},
                      Case{kvq::Format::kNuq, 2, kvq::Axis::kToken, 64, 6, 0.f, 64},
                      Case{kvq::Format::kNuq, 4, kvq::Axis::kTensor, 16, 1, 0.f, 96},
                      Case{kvq::Format::kInt, 3, kvq::Axis::kToken, 0, 2, 0.f, 320},
                      Case{kvq::Format::kInt, 3, kvq::Axis::kToken, 6, 2, 0.f, 36},
                      Case{kvq::Format::kInt, 4, kvq::Axis::kChannel, 8, 5, 0.f, 36},
                      Case{kvq::Format::kInt, 3, kvq::Axis::kToken, 16, 12, 0.f, 64}));

TEST(OutlierQuant, OutliersImproveHeavyTailedData) {
  const kvq::Shape s{64, 2, 64};
  auto x = kvq_test::kv_data(s, 2, false);
  for (std::size_t i = 0; i < x.size(); i += 61) x[i] = 40.f;
  const kvq::KVView<const float> xv(x.data(), s);
  auto err = [&](const kvq::QuantConfig& c) {
    std::vector<float> y(x.size());
    kvq::dequantize(kvq::quantize(c, xv), kvq::KVView<float>(y.data(), s));
    return kvq_test::rel_mse(x, y);
  };
  const double plain = err(make(kvq::Format::kInt, 3, kvq::Axis::kToken, 64, 0));
  const double sparse = err(make(kvq::Format::kInt, 3, kvq::Axis::kToken, 64, 1));
  EXPECT_LT(sparse, 0.5 * plain) << plain << " " << sparse;
}

TEST(OutlierQuant, PercentRoundsUp) {
  kvq::QuantConfig c = make(kvq::Format::kInt, 3, kvq::Axis::kChannel, 32, 0, 1.f);
  EXPECT_EQ(kvq::outlier_count(c, 128), 2);
  EXPECT_EQ(kvq::outlier_count(c, 64), 1);
  EXPECT_EQ(kvq::outlier_count(c, 100), 1);
  EXPECT_EQ(kvq::outlier_count(c, 8), 1);
  c.outlier_pct = 5.f;
  EXPECT_EQ(kvq::outlier_count(c, 128), 7);
  // head_dim 128, k = 2: 6 bytes per vector = 0.375 bits on top of int3 channel g32 (4.0).
  c.outlier_pct = 1.f;
  EXPECT_DOUBLE_EQ(kvq::effective_bits(c, {32, 4, 128}), 4.375);
}

TEST(OutlierQuant, TiesAndAllEqualVectors) {
  const kvq::Shape s{2, 1, 16};
  std::vector<float> x(static_cast<std::size_t>(s.numel()), 3.f);
  const auto cfg = make(kvq::Format::kInt, 3, kvq::Axis::kToken, 16, 3);
  const kvq::QTensor q = kvq::quantize(cfg, kvq::KVView<const float>(x.data(), s));
  ASSERT_EQ(q.outlier_pos.size(), 6u);
  // All scores equal: the lowest channels win.
  EXPECT_EQ(q.outlier_pos, (std::vector<uint8_t>{0, 1, 2, 0, 1, 2}));
  std::vector<float> y(x.size());
  kvq::dequantize(q, kvq::KVView<float>(y.data(), s));
  EXPECT_EQ(x, y);
  // Symmetric ties: +-5 at channels 4 and 9 score equally; k = 1 takes channel 4.
  std::vector<float> z(16, 0.f);
  z[9] = 5.f;
  z[4] = -5.f;
  const auto cfg1 = make(kvq::Format::kInt, 3, kvq::Axis::kToken, 16, 1);
  const kvq::QTensor q1 = kvq::quantize(cfg1, kvq::KVView<const float>(z.data(), {1, 1, 16}));
  EXPECT_EQ(q1.outlier_pos, (std::vector<uint8_t>{4}));
  // k == head_dim: everything exact (to fp16).
  const auto all = make(kvq::Format::kInt, 2, kvq::Axis::kToken, 16, 16);
  std::vector<float> r = kvq_test::kv_data({2, 1, 16}, 4, false), back(32);
  kvq::dequantize(kvq::quantize(all, kvq::KVView<const float>(r.data(), {2, 1, 16})),
                  kvq::KVView<float>(back.data(), {2, 1, 16}));
  for (std::size_t i = 0; i < r.size(); ++i)
    EXPECT_EQ(back[i], kvq::half_bits_to_float(kvq::float_to_half_bits(r[i])));
}

TEST(OutlierQuant, Fp16RangeAndBadConfigsRejected) {
  const kvq::Shape s{1, 1, 32};
  std::vector<float> x(32, 0.f);
  x[7] = 70000.f;
  const auto cfg = make(kvq::Format::kInt, 3, kvq::Axis::kToken, 32, 1);
  kvq::QTensor keep = kvq::quantize(cfg, kvq::KVView<const float>(std::vector<float>(32, 1.f).data(), s));
  const kvq::QTensor before = keep;
  try {
    kvq::quantize(cfg, kvq::KVView<const float>(x.data(), s), keep);
    FAIL() << "no throw";
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.kind(), kvq::ErrorKind::kOutOfRange);
    EXPECT_NE(std::string(e.what()).find("channel=7"), std::string::npos) << e.what();
  }
  EXPECT_EQ(keep.codes, before.codes);
  EXPECT_EQ(keep.outlier_values, before.outlier_values);
  x[7] = NAN;
  EXPECT_THROW(kvq::quantize(cfg, kvq::KVView<const float>(x.data(), s)), kvq::Error);
  auto big = make(kvq::Format::kInt, 3, kvq::Axis::kToken, 32, 33);
  EXPECT_THROW(kvq::account(big, s), kvq::Error);
  kvq::QuantConfig lm;
  lm.format = kvq::Format::kLloydMax;
  lm.bits = 3;
  lm.outliers = 1;
  EXPECT_THROW(kvq::account(lm, s), kvq::Error);
  auto neg = make(kvq::Format::kInt, 3, kvq::Axis::kToken, 32, -1);
  EXPECT_THROW(kvq::account(neg, s), kvq::Error);
}

}  // namespace
