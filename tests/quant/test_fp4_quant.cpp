// FP4 block quantizers (NVFP4, MXFP4) over KV tensors: codes, block scales and reconstruction
// equal the independent oracle (reference/fp4_ref.hpp) vector by vector over formats x tensor
// scales x dtypes x layouts x magnitudes; accountant == packed bytes (4.5 / 4.25 bits);
// NaN/Inf refused naming the element; zero blocks; shape and config errors. KVQ_TEST_SCALAR_TOO
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kvq/accounting/accountant.hpp"
#include "kvq/quant/quantize.hpp"
#include "kvq/reference/fp4_ref.hpp"
#include "test_util.hpp"

namespace {

using kvq::Format;
using kvq::KVView;
using kvq::QuantConfig;
using kvq::Shape;

QuantConfig fp4(Format f, float g = 1.0f) {
  QuantConfig c;
  c.format = f;
  c.bits = 4;
  c.axis = kvq::Axis::kToken;
  c.group = kvq::fp4_block(f);
  c.fp4_tensor_scale = g;
  return c;
}

uint8_t nibble(const std::vector<uint8_t>& codes, size_t i) {
  return static_cast<uint8_t>((codes[i / 2] >> (4 * (i % 2))) & 0xf);
}

// Quantizes x (values `data`, stored as T in `layout`) and compares every vector with the oracle.
template <class T>
void check(const QuantConfig& cfg, const Shape& s, kvq::Layout layout, float magnitude,
           uint32_t seed) {
  auto data = kvq_test::kv_data(s, seed, true);
  std::vector<T> st(data.size());
  KVView<T> sv(st.data(), s, layout);
  size_t i = 0;
  for (int64_t t = 0; t < s.tokens; ++t)
    for (int64_t h = 0; h < s.heads; ++h)
      for (int64_t d = 0; d < s.head_dim; ++d)
        sv.at(t, h, d) = kvq::from_float<T>(data[i++] * magnitude);
  KVView<const T> x = sv;
  const kvq::QTensor q = kvq::quantize(cfg, x);
  ASSERT_EQ(q.breakdown(), kvq::account(cfg, s)) << cfg.name();
  std::vector<float> out(data.size());
  kvq::dequantize(q, KVView<float>(out.data(), s, kvq::Layout::kNHD));
  const int64_t D = s.head_dim, blk = kvq::fp4_block(cfg.format);
  std::vector<float> row(static_cast<size_t>(D));
  for (int64_t t = 0; t < s.tokens; ++t)
    for (int64_t h = 0; h < s.heads; ++h) {
      for (int64_t d = 0; d < D; ++d) row[d] = kvq::to_float(x.at(t, h, d));
      const auto r = cfg.format == Format::kMxfp4
                         ? kvq::reference::mxfp4_ref(row.data(), D, blk)
                         : kvq::reference::nvfp4_ref(row.data(), D, blk, cfg.fp4_tensor_scale);
      const size_t v = static_cast<size_t>(t * s.heads + h);
      for (int64_t b = 0; b < D / blk; ++b)
        ASSERT_EQ(q.scales.raw()[v * (D / blk) + b], r.scales[b])
            << cfg.name() << " token " << t << " head " << h << " block " << b;
      for (int64_t d = 0; d < D; ++d) {
        ASSERT_EQ(nibble(q.codes, v * D + d), r.codes[d])
            << cfg.name() << " token " << t << " head " << h << " channel " << d << " x "
            << row[d];
        const float got = out[v * D + d];
        ASSERT_EQ(std::memcmp(&got, &r.values[d], 4), 0)
            << cfg.name() << " token " << t << " head " << h << " channel " << d << ": " << got
            << " vs " << r.values[d];
      }
    }
}

TEST(Fp4Quant, MatchesOracleOverFormatsScalesDtypesLayouts) {
  const Shape shapes[] = {{5, 3, 64}, {3, 2, 32}, {2, 4, 128}};
  for (Format f : {Format::kNvfp4, Format::kMxfp4})
    for (float g : {1.0f, 0.01f, 3.5f})
      for (const Shape& s : shapes)
        for (kvq::Layout l : {kvq::Layout::kNHD, kvq::Layout::kHND})
          for (float m : {1.0f, 1e-3f, 500.0f}) {
            if (f == Format::kMxfp4 && g != 1.0f) continue;  // MXFP4 has no tensor scale
            const QuantConfig c = fp4(f, g);
            check<float>(c, s, l, m, 7);
            check<kvq::f16>(c, s, l, m, 8);
            check<kvq::bf16>(c, s, l, m, 9);
          }
}

TEST(Fp4Quant, TensorScaleFromDataAvoidsSaturation) {
  // Values up to ~5000: with g = 1 NVFP4's e4m3 block scale saturates at 448 (elements clip to
  // 6 * 448 = 2688); the data-derived tensor scale amax / (6 * 448) keeps them.
  const Shape s{4, 2, 32};
  auto data = kvq_test::kv_data(s, 3, true);
  float amax = 0;
  for (float& v : data) {
    v *= 300.f;
    amax = std::fmax(amax, std::fabs(v));
  }
  ASSERT_GT(amax, 2688.f);
  const float g = kvq::fp4::nv_tensor_scale_from_amax(amax);
  std::vector<float> y1(data.size()), yg(data.size());
  KVView<const float> x(data.data(), s);
  kvq::dequantize(kvq::quantize(fp4(Format::kNvfp4, 1.f), x), KVView<float>(y1.data(), s));
  kvq::dequantize(kvq::quantize(fp4(Format::kNvfp4, g), x), KVView<float>(yg.data(), s));
  float m1 = 0, mg = 0;
  for (size_t i = 0; i < data.size(); ++i) {
    m1 = std::fmax(m1, std::fabs(y1[i]));
    mg = std::fmax(mg, std::fabs(yg[i]));
  }
  EXPECT_EQ(m1, 2688.f);
  EXPECT_GT(mg, 2688.f);
  EXPECT_LT(kvq_test::rel_mse(data, yg), 0.02);
  check<float>(fp4(Format::kNvfp4, g), s, kvq::Layout::kNHD, 300.f, 3);
}

TEST(Fp4Quant, AccountantBitsAndLayerMetadata) {
  const Shape s{8, 4, 128};
  const auto nv = kvq::account(fp4(Format::kNvfp4), s);
  const auto mx = kvq::account(fp4(Format::kMxfp4), s);
  EXPECT_EQ(nv.codes, 8u * 4 * 128 / 2);
  EXPECT_EQ(nv.scales, 8u * 4 * 128 / 16);
  EXPECT_EQ(mx.scales, 8u * 4 * 128 / 32);
  EXPECT_EQ(nv.zeros + nv.norms + nv.outliers, 0u);
  EXPECT_DOUBLE_EQ(kvq::effective_bits(fp4(Format::kNvfp4), s), 4.5);
  EXPECT_DOUBLE_EQ(kvq::effective_bits(fp4(Format::kMxfp4), s), 4.25);
  EXPECT_EQ(kvq::layer_metadata_bytes(fp4(Format::kNvfp4)), 4u);
  EXPECT_EQ(kvq::layer_metadata_bytes(fp4(Format::kMxfp4)), 0u);
  for (Format f : {Format::kNvfp4, Format::kMxfp4}) {
    auto data = kvq_test::kv_data(s, 1, false);
    const auto q = kvq::quantize(fp4(f), KVView<const float>(data.data(), s));
    EXPECT_EQ(q.bytes(), kvq::account(fp4(f), s).total());
    EXPECT_EQ(q.scales.raw().size(), static_cast<size_t>(s.numel() / kvq::fp4_block(f)));
  }
}

TEST(Fp4Quant, RefusesNanAndInfNamingTheElement) {
  const Shape s{3, 2, 32};
  for (Format f : {Format::kNvfp4, Format::kMxfp4})
    for (float bad : {std::numeric_limits<float>::quiet_NaN(), INFINITY, -INFINITY}) {
      auto data = kvq_test::kv_data(s, 5, false);
      data[(2 * 2 + 1) * 32 + 17] = bad;  // token 2, head 1, channel 17
      try {
        (void)kvq::quantize(fp4(f), KVView<const float>(data.data(), s));
        FAIL() << "no throw for " << bad;
      } catch (const kvq::Error& e) {
        EXPECT_EQ(e.kind(), kvq::ErrorKind::kNonFinite);
        EXPECT_NE(std::string(e.what()).find("token=2, head=1, channel=17"), std::string::npos)
            << e.what();
      }
    }
}

TEST(Fp4Quant, ZeroBlocks) {
  const Shape s{2, 1, 64};
  std::vector<float> data(static_cast<size_t>(s.numel()), 0.f);
  for (int d = 32; d < 64; ++d) data[d] = 0.25f * static_cast<float>(d - 40);  // token 0, 2nd half
  data[64 + 3] = -0.f;
  for (Format f : {Format::kNvfp4, Format::kMxfp4}) {
    const auto q = kvq::quantize(fp4(f), KVView<const float>(data.data(), s));
    const int64_t blk = kvq::fp4_block(f);
    std::vector<float> y(data.size(), 1.f);
    kvq::dequantize(q, KVView<float>(y.data(), s));
    // Blocks of token 0's first half and all of token 1 are zero: scale code 0, codes 0 for
    // +0 inputs, values zero (the -0 input's code is the oracle's: compared in check()).
    for (int64_t b = 0; b < 32 / blk; ++b) EXPECT_EQ(q.scales.raw()[b], 0) << to_string(f);
    for (int64_t b = 64 / blk; b < 128 / blk; ++b) EXPECT_EQ(q.scales.raw()[b], 0);
    for (int d = 0; d < 32; ++d) EXPECT_EQ(nibble(q.codes, d), 0);
    for (int d = 64; d < 128; ++d) EXPECT_EQ(y[d], 0.f);
    check<float>(fp4(f), s, kvq::Layout::kNHD, 0.f, 1);  // an all-zero tensor
  }
}

TEST(Fp4Quant, ShapeAndConfigErrors) {
  auto expect = [](const QuantConfig& c, const Shape& s, kvq::ErrorKind k, const char* needle) {
    try {
      (void)kvq::packed_sizes(c, s);
      ADD_FAILURE() << c.name() << " on " << s.str() << " accepted";
    } catch (const kvq::Error& e) {
      EXPECT_EQ(e.kind(), k) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect(fp4(Format::kNvfp4), Shape{2, 2, 24}, kvq::ErrorKind::kShapeMismatch,
         "nvfp4 needs head_dim to be a multiple of its block of 16");
  expect(fp4(Format::kMxfp4), Shape{2, 2, 48}, kvq::ErrorKind::kShapeMismatch,
         "mxfp4 needs head_dim to be a multiple of its block of 32");
  QuantConfig c = fp4(Format::kNvfp4);
  c.group = 32;
  expect(c, Shape{1, 1, 32}, kvq::ErrorKind::kInvalidArgument, "blocks of 16 channels");
  c = fp4(Format::kMxfp4);
  c.axis = kvq::Axis::kChannel;
  expect(c, Shape{1, 1, 32}, kvq::ErrorKind::kInvalidArgument, "blocks of 32 channels");
  c = fp4(Format::kNvfp4);
  c.bits = 8;
  expect(c, Shape{1, 1, 32}, kvq::ErrorKind::kInvalidArgument, "4-bit e2m1");
  for (float g : {0.f, -1.f, INFINITY, std::numeric_limits<float>::quiet_NaN()})
    expect(fp4(Format::kNvfp4, g), Shape{1, 1, 32}, kvq::ErrorKind::kInvalidArgument,
           "tensor scale must be finite and > 0");
  c = fp4(Format::kNvfp4);
  c.outliers = 2;
  expect(c, Shape{1, 1, 32}, kvq::ErrorKind::kInvalidArgument, "outliers");
}

TEST(Fp4Quant, TokenRangeDequantize) {
  const Shape s{6, 2, 64};
  auto data = kvq_test::kv_data(s, 11, true);
  for (Format f : {Format::kNvfp4, Format::kMxfp4}) {
    const auto q = kvq::quantize(fp4(f), KVView<const float>(data.data(), s));
    std::vector<float> all(data.size()), part(static_cast<size_t>(3 * 2 * 64));
    kvq::dequantize(q, KVView<float>(all.data(), s));
    kvq::QuantWorkspace ws;
    kvq::dequantize_tokens(kvq::view_of(q), 2, KVView<float>(part.data(), Shape{3, 2, 64}), ws);
    for (size_t i = 0; i < part.size(); ++i) ASSERT_EQ(part[i], all[2 * 2 * 64 + i]);
  }
}

}  // namespace
