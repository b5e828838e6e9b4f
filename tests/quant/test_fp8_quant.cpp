// Scaled FP8 quantizer: fast path == scalar reference byte for byte over axes x dtypes x
// layouts x metadata types; accountant == packed bytes; documented scale rules. KVQ_TEST_SCALAR_TOO
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kvq/accounting/accountant.hpp"
#include "kvq/quant/quantize.hpp"
#include "kvq/reference/fp8_quant_ref.hpp"
#include "test_util.hpp"

namespace {

using kvq::Axis;
using kvq::Format;
using kvq::KVView;
using kvq::QuantConfig;
using kvq::Shape;

QuantConfig fcfg(Format f, Axis a, int64_t g = 0, kvq::MetaDType m = kvq::MetaDType::kF32) {
  QuantConfig c;
  c.format = f;
  c.bits = 8;
  c.axis = a;
  c.group = g;
  c.meta = m;
  return c;
}

template <class T>
void check(const QuantConfig& cfg, const Shape& s, kvq::Layout layout) {
  auto data = kvq_test::kv_data(s, 21, true);
  std::vector<T> st(data.size());
  KVView<T> sv(st.data(), s, layout);
  size_t i = 0;
  for (int64_t t = 0; t < s.tokens; ++t)
    for (int64_t h = 0; h < s.heads; ++h)
      for (int64_t d = 0; d < s.head_dim; ++d) sv.at(t, h, d) = kvq::from_float<T>(data[i++]);
  KVView<const T> x = sv;
  const auto fast = kvq::quantize(cfg, x);
  const auto ref = kvq::reference::quantize_fp8(cfg, x);
  ASSERT_EQ(fast.codes, ref.codes) << cfg.name();
  ASSERT_TRUE(fast.scales == ref.scales) << cfg.name();
  ASSERT_EQ(fast.breakdown(), kvq::account(cfg, s)) << cfg.name();
  std::vector<float> a(data.size()), b(data.size());
  kvq::dequantize(fast, KVView<float>(a.data(), s, layout));
  kvq::reference::dequantize_fp8(ref, KVView<float>(b.data(), s, layout));
  for (size_t k = 0; k < a.size(); ++k) ASSERT_EQ(a[k], b[k]) << cfg.name() << " " << k;
  // fp8 e4m3 keeps ~3 mantissa bits: relative MSE around 1e-3; e5m2 around 4e-3
  std::vector<float> orig(data.size());
  for (size_t k = 0; k < orig.size(); ++k) orig[k] = kvq::to_float(st[k]);
  std::vector<float> y(data.size());
  kvq::dequantize(fast, KVView<float>(y.data(), s, kvq::Layout::kNHD));
  std::vector<float> x_nhd(data.size());
  kvq::dequantize(kvq::quantize(QuantConfig{Format::kF32}, x), KVView<float>(x_nhd.data(), s));
  EXPECT_LT(kvq_test::rel_mse(x_nhd, y), cfg.format == Format::kE4M3 ? 3e-3 : 1.2e-2) << cfg.name();
}

TEST(Fp8Quant, FastEqualsReference) {
  for (Format f : {Format::kE4M3, Format::kE5M2})
    for (Axis a : {Axis::kToken, Axis::kChannel, Axis::kHead, Axis::kTensor})
      for (int64_t g : {0, 32})
        for (auto m : {kvq::MetaDType::kF16, kvq::MetaDType::kF32})
          for (auto layout : {kvq::Layout::kNHD, kvq::Layout::kHND}) {
            const auto cfg = fcfg(f, a, g, m);
            check<float>(cfg, Shape{64, 3, 128}, layout);
            check<kvq::f16>(cfg, Shape{64, 3, 96}, layout);
            check<kvq::bf16>(cfg, Shape{32, 2, 64}, layout);
          }
}

TEST(Fp8Quant, AccountantKnownValues) {
  // per-token-per-head fp32 scale at head_dim 128: 8 + 32/128 = 8.25 bits/value
  EXPECT_DOUBLE_EQ(kvq::effective_bits(fcfg(Format::kE4M3, Axis::kToken, 0), Shape{16, 8, 128}),
                   8.25);
  // per-head scales over 1024 tokens: 8 + 32 / (1024 * 128)
  EXPECT_NEAR(kvq::effective_bits(fcfg(Format::kE4M3, Axis::kHead, 0), Shape{1024, 8, 128}),
              8.0 + 32.0 / (1024 * 128), 1e-12);
}

TEST(Fp8Quant, ZeroGroupsDecodeToZero) {
  const Shape s{4, 2, 32};
  std::vector<float> data(static_cast<size_t>(s.numel()), 0.f);
  for (size_t i = 64; i < 128; ++i) data[i] = 0.5f * static_cast<float>(i % 7) - 1.f;
  for (Axis a : {Axis::kToken, Axis::kHead}) {
    auto q = kvq::quantize(fcfg(Format::kE4M3, a), KVView<const float>(data.data(), s));
    std::vector<float> y(data.size(), 1.f);
    kvq::dequantize(q, KVView<float>(y.data(), s));
    for (size_t i = 0; i < 64; ++i) ASSERT_EQ(y[i], 0.f);
    for (float v : y) ASSERT_TRUE(std::isfinite(v));
  }
}

TEST(Fp8Quant, AmaxMapsToMaxFinite) {
  const Shape s{1, 1, 16};
  std::vector<float> data(16, 0.25f);
  data[3] = -3.5f;
  auto q = kvq::quantize(fcfg(Format::kE4M3, Axis::kToken), KVView<const float>(data.data(), s));
  EXPECT_EQ(q.codes[3], 0xFE);  // -448
  EXPECT_FLOAT_EQ(q.scales.get(0), 3.5f / 448.f);
}

TEST(Fp8Quant, NonFiniteRejected) {
  const Shape s{4, 2, 32};
  std::vector<float> data(static_cast<size_t>(s.numel()), 1.f);
  data[77] = std::numeric_limits<float>::infinity();
  EXPECT_THROW(kvq::quantize(fcfg(Format::kE5M2, Axis::kTensor), KVView<const float>(data.data(), s)),
               kvq::Error);
}

TEST(Fp8Quant, Fp16ScaleOverflowIsAnError) {
  const Shape s{1, 1, 16};
  std::vector<float> data(16, 1e9f);
  EXPECT_THROW(kvq::quantize(fcfg(Format::kE4M3, Axis::kToken, 0, kvq::MetaDType::kF16),
                             KVView<const float>(data.data(), s)),
               kvq::Error);
  // f32 metadata holds the scale: every value is the group's amax, so code +448 (0x7E), scale
  // 1e9 / 448, and the reconstruction is 1e9 to float precision.
  const auto q = kvq::quantize(fcfg(Format::kE4M3, Axis::kToken, 0, kvq::MetaDType::kF32),
                               KVView<const float>(data.data(), s));
  for (int i = 0; i < 16; ++i) EXPECT_EQ(q.codes[i], 0x7E) << i;
  EXPECT_FLOAT_EQ(q.scales.get(0), 1e9f / 448.f);
  std::vector<float> back(16);
  kvq::dequantize(q, KVView<float>(back.data(), s));
  for (float v : back) EXPECT_NEAR(v, 1e9f, 1e9f * 1e-6f);
}

}  // namespace
