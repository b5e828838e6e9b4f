// Grouped uniform integer quantization: the fast path equals the scalar reference byte for byte
// (codes, scales, zero points) and value for value (dequantized), over bits x symmetric x axis x
// group x head_dim x layout x dtype x metadata type; error bounds per bit width; bad input.
// KVQ_TEST_SCALAR_TOO
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "kvq/accounting/accountant.hpp"
#include "kvq/quant/quantize.hpp"
#include "kvq/reference/uniform_ref.hpp"
#include "test_util.hpp"

namespace {

using kvq::Axis;
using kvq::Format;
using kvq::KVView;
using kvq::QuantConfig;
using kvq::Shape;

using kvq_test::int_cfg;

void expect_same_bytes(const kvq::QTensor& a, const kvq::QTensor& b, const std::string& what) {
  ASSERT_EQ(a.codes, b.codes) << what;
  ASSERT_TRUE(a.scales == b.scales) << what;
  ASSERT_TRUE(a.zeros == b.zeros) << what;
}

uint32_t fbits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// (bits, symmetric, axis, group, head_dim)
using Param = std::tuple<int, bool, Axis, int, int>;
class UniformSweep : public ::testing::TestWithParam<Param> {};

template <class T>
void run_case(const QuantConfig& cfg, const Shape& s, kvq::Layout layout, uint32_t seed) {
  auto data = kvq_test::kv_data(s, seed, true);
  std::vector<T> stored(data.size());
  // lay the data out in the requested layout
  KVView<T> sv(stored.data(), s, layout);
  size_t i = 0;
  for (int64_t t = 0; t < s.tokens; ++t)
    for (int64_t h = 0; h < s.heads; ++h)
      for (int64_t d = 0; d < s.head_dim; ++d) sv.at(t, h, d) = kvq::from_float<T>(data[i++]);
  KVView<const T> x = sv;
  const std::string what = cfg.name() + " " + s.str() + (layout == kvq::Layout::kHND ? " HND" : " NHD") +
                           " " + kvq::to_string(kvq::dtype_of<T>::value);
  auto fast = kvq::quantize(cfg, x);
  auto ref = kvq::reference::quantize_uniform(cfg, x);
  expect_same_bytes(fast, ref, what);
  EXPECT_EQ(fast.bytes(), kvq::account(cfg, s).total()) << what;

  std::vector<float> y_fast(data.size()), y_ref(data.size());
  kvq::dequantize(fast, KVView<float>(y_fast.data(), s, layout));
  kvq::reference::dequantize_uniform(ref, KVView<float>(y_ref.data(), s, layout));
  for (size_t k = 0; k < y_fast.size(); ++k)
    ASSERT_EQ(fbits(y_fast[k]), fbits(y_ref[k])) << what << " element " << k;
  for (float v : y_fast) ASSERT_TRUE(std::isfinite(v)) << what;

  // Dequantizing into fp16 / bf16 outputs (contiguous rows, and a strided view that takes the
  // row-buffer path) gives the f32 reconstruction rounded to nearest even.
  auto check_narrow = [&](auto tag) {
    using U = decltype(tag);
    std::vector<U> z(data.size());
    kvq::dequantize(fast, KVView<U>(z.data(), s, layout));
    std::vector<U> zs(2 * data.size());
    const kvq::Strides st{2 * s.heads * s.head_dim, 2 * s.head_dim, 2};
    const KVView<U> strided(zs.data(), s, st);
    kvq::dequantize(fast, strided);
    const KVView<const float> yr(y_ref.data(), s, layout);
    const KVView<const U> zv(z.data(), s, layout);
    for (int64_t t = 0; t < s.tokens; ++t)
      for (int64_t h = 0; h < s.heads; ++h)
        for (int64_t d = 0; d < s.head_dim; ++d) {
          const U want = kvq::from_float<U>(yr.at(t, h, d));
          ASSERT_EQ(zv.at(t, h, d).bits, want.bits)
              << what << " -> " << kvq::to_string(kvq::dtype_of<U>::value) << " at " << t << ","
              << h << "," << d;
          ASSERT_EQ(strided.at(t, h, d).bits, want.bits) << what << " strided";
        }
  };
  check_narrow(kvq::f16{});
  check_narrow(kvq::bf16{});
}

TEST_P(UniformSweep, FastEqualsReference) {
  const auto [bits, sym, axis, group, head_dim] = GetParam();
  const Shape s{64, 3, head_dim};
  if (axis == Axis::kToken && group > 0 && head_dim % group != 0) {
    EXPECT_THROW(kvq::quantize(int_cfg(bits, sym, axis, group), KVView<const float>(nullptr, Shape{0, 3, head_dim})), kvq::Error);
    return;
  }
  for (auto meta : {kvq::MetaDType::kF16, kvq::MetaDType::kF32}) {
    const auto cfg = int_cfg(bits, sym, axis, group, meta);
    for (auto layout : {kvq::Layout::kNHD, kvq::Layout::kHND}) {
      run_case<float>(cfg, s, layout, 11);
      run_case<kvq::f16>(cfg, s, layout, 12);
      run_case<kvq::bf16>(cfg, s, layout, 13);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    All, UniformSweep,
    ::testing::Combine(::testing::Values(2, 3, 4, 8), ::testing::Bool(),
                       ::testing::Values(Axis::kToken, Axis::kChannel, Axis::kHead,
                                         Axis::kTensor),
                       ::testing::Values(0, 16, 32), ::testing::Values(32, 80, 128)),
    [](const auto& info) {
      return "b" + std::to_string(std::get<0>(info.param)) +
             (std::get<1>(info.param) ? "sym" : "asym") + "_" +
             kvq::to_string(std::get<2>(info.param)) + "_g" +
             std::to_string(std::get<3>(info.param)) + "_d" +
             std::to_string(std::get<4>(info.param));
    });

// Relative MSE ceilings per bit width for Gaussian data with group 32 (per-token groups).
TEST(Uniform, ErrorShrinksWithBits) {
  const Shape s{128, 4, 128};
  auto data = kvq_test::kv_data(s, 5, false);
  KVView<const float> x(data.data(), s);
  const double ceiling[9] = {0, 0, 0.2, 0.05, 0.012, 0, 0, 0, 6e-5};
  double prev = 1;
  for (int bits : {2, 3, 4, 8}) {
    auto cfg = int_cfg(bits, false, Axis::kToken, 32);
    auto q = kvq::quantize(cfg, x);
    std::vector<float> y(data.size());
    kvq::dequantize(q, KVView<float>(y.data(), s));
    const double e = kvq_test::rel_mse(data, y);
    EXPECT_LT(e, ceiling[bits]) << "bits " << bits;
    EXPECT_LT(e, prev);
    prev = e;
  }
}

// Keys with outlier channels: per-channel grouping beats per-token at equal bits.
TEST(Uniform, PerChannelWinsOnOutlierChannels) {
  const Shape s{256, 2, 64};
  auto data = kvq_test::kv_data(s, 9, true);
  KVView<const float> x(data.data(), s);
  std::vector<float> y(data.size());
  auto err = [&](Axis a) {
    auto q = kvq::quantize(int_cfg(2, false, a, 32), x);
    kvq::dequantize(q, KVView<float>(y.data(), s));
    return kvq_test::rel_mse(data, y);
  };
  EXPECT_LT(err(Axis::kChannel) * 1.5, err(Axis::kToken));
}

TEST(Uniform, ReconstructionWithinHalfStep) {
  const Shape s{32, 2, 64};
  auto data = kvq_test::kv_data(s, 3, false);
  KVView<const float> x(data.data(), s);
  auto cfg = int_cfg(4, false, Axis::kToken, 32, kvq::MetaDType::kF32);
  auto q = kvq::quantize(cfg, x);
  std::vector<float> y(data.size());
  kvq::dequantize(q, KVView<float>(y.data(), s));
  for (size_t i = 0; i < data.size(); ++i) {
    const float scale = q.scales.get(i / 32);
    EXPECT_LE(std::fabs(data[i] - y[i]), 0.5f * scale * 1.0001f + 1e-6f) << i;
  }
}

TEST(Uniform, ConstantGroupsReconstructExactly) {
  const Shape s{32, 1, 32};
  for (float c : {0.f, 1.5f, -3.25f, 1e-3f}) {
    std::vector<float> data(static_cast<size_t>(s.numel()), c);
    for (bool sym : {false, true})
      for (Axis a : {Axis::kToken, Axis::kChannel, Axis::kTensor}) {
        auto cfg = int_cfg(4, sym, a, 32, kvq::MetaDType::kF32);
        auto q = kvq::quantize(cfg, KVView<const float>(data.data(), s));
        std::vector<float> y(data.size());
        kvq::dequantize(q, KVView<float>(y.data(), s));
        for (float v : y) ASSERT_EQ(v, c) << cfg.name() << " c=" << c;
      }
  }
}

TEST(Uniform, NonFiniteInputIsRejectedWithLocation) {
  const Shape s{8, 2, 32};
  for (float bad : {std::numeric_limits<float>::quiet_NaN(),
                    std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    for (Axis a : {Axis::kToken, Axis::kChannel}) {
      std::vector<float> data(static_cast<size_t>(s.numel()), 1.f);
      data[(5 * 2 + 1) * 32 + 7] = bad;
      try {
        kvq::quantize(int_cfg(4, false, a, 8), KVView<const float>(data.data(), s));
        FAIL() << "accepted " << bad;
      } catch (const kvq::Error& e) {
        EXPECT_EQ(e.kind(), kvq::ErrorKind::kNonFinite);
        EXPECT_NE(std::string(e.what()).find("token=5, head=1, channel=7"), std::string::npos)
            << e.what();
      }
      EXPECT_THROW(kvq::reference::quantize_uniform(int_cfg(4, false, a, 8),
                                                    KVView<const float>(data.data(), s)),
                   kvq::Error);
    }
  }
}

TEST(Uniform, GroupMustDivideExtent) {
  const Shape s{40, 2, 64};
  std::vector<float> data(static_cast<size_t>(s.numel()), 1.f);
  KVView<const float> x(data.data(), s);
  try {
    kvq::quantize(int_cfg(4, false, Axis::kChannel, 32), x);
    FAIL();
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.kind(), kvq::ErrorKind::kShapeMismatch);
    EXPECT_NE(std::string(e.what()).find("does not divide the extent 40"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(kvq::quantize(int_cfg(4, false, Axis::kToken, 24), x), kvq::Error);
  EXPECT_THROW(kvq::quantize(int_cfg(4, false, Axis::kToken, -1), x), kvq::Error);
  EXPECT_THROW(kvq::quantize(int_cfg(5, false, Axis::kToken, 32), x), kvq::Error);
  EXPECT_THROW(kvq::quantize(int_cfg(1, false, Axis::kToken, 32), x), kvq::Error);
  // a group larger than the extent is clamped to the whole extent: the same tensor as a group
  // of exactly head_dim (64), bytes and reconstruction alike
  const auto xs = kvq_test::kv_data(s, 7, true);
  const KVView<const float> xv(xs.data(), s);
  const auto big = kvq::quantize(int_cfg(4, false, Axis::kToken, 256), xv);
  const auto whole = kvq::quantize(int_cfg(4, false, Axis::kToken, 64), xv);
  EXPECT_EQ(big.bytes(), whole.bytes());
  EXPECT_EQ(big.bytes(), kvq::account(int_cfg(4, false, Axis::kToken, 64), s).total());
  std::vector<float> a(xs.size()), b(xs.size());
  kvq::dequantize(big, KVView<float>(a.data(), s));
  kvq::dequantize(whole, KVView<float>(b.data(), s));
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0);
  EXPECT_LT(kvq_test::rel_mse(xs, a), 0.05);  // a real 4-bit reconstruction, not zeros
}

TEST(Uniform, EmptyTensors) {
  for (Shape s : {Shape{0, 2, 64}, Shape{4, 0, 64}, Shape{4, 2, 0}}) {
    KVView<const float> x(nullptr, s);
    auto cfg = int_cfg(4, false, Axis::kChannel, 32);
    auto q = kvq::quantize(cfg, x);
    EXPECT_EQ(q.bytes(), 0u);
    EXPECT_EQ(kvq::account(cfg, s).total(), 0u);
    EXPECT_EQ(kvq::effective_bits(cfg, s), 0.0);
    kvq::dequantize(q, KVView<float>(nullptr, s));
  }
}

TEST(Uniform, Fp16MetadataOverflowIsAnError) {
  const Shape s{4, 1, 32};
  std::vector<float> data(static_cast<size_t>(s.numel()), 1.f);
  data[3] = 1e6f;
  data[4] = -1e6f;
  KVView<const float> x(data.data(), s);
  try {
    kvq::quantize(int_cfg(4, false, Axis::kToken, 32), x);
    FAIL();
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.kind(), kvq::ErrorKind::kOutOfRange);
    EXPECT_NE(std::string(e.what()).find("use f32 metadata"), std::string::npos) << e.what();
  }
  auto q = kvq::quantize(int_cfg(4, false, Axis::kToken, 32, kvq::MetaDType::kF32), x);
  std::vector<float> y(data.size());
  kvq::dequantize(q, KVView<float>(y.data(), s));
  for (float v : y) EXPECT_TRUE(std::isfinite(v));
}

TEST(Uniform, HugeFiniteRangeNeverGivesNaN) {
  const Shape s{2, 1, 32};
  std::vector<float> data(static_cast<size_t>(s.numel()), 0.f);
  data[0] = 3e38f;
  data[1] = -3e38f;  // range overflows float: a clear error, not NaN
  KVView<const float> x(data.data(), s);
  EXPECT_THROW(kvq::quantize(int_cfg(8, false, Axis::kToken, 32, kvq::MetaDType::kF32), x),
               kvq::Error);
  data[1] = 1e38f;
  auto q = kvq::quantize(int_cfg(8, true, Axis::kToken, 32, kvq::MetaDType::kF32), x);
  std::vector<float> y(data.size());
  kvq::dequantize(q, KVView<float>(y.data(), s));
  for (float v : y) EXPECT_TRUE(std::isfinite(v));
}

TEST(Uniform, DequantizeShapeMismatchIsAnError) {
  const Shape s{4, 2, 32};
  std::vector<float> data(static_cast<size_t>(s.numel()), 1.f);
  auto q = kvq::quantize(int_cfg(4, false, Axis::kToken, 32), KVView<const float>(data.data(), s));
  std::vector<float> y(data.size());
  EXPECT_THROW(kvq::dequantize(q, KVView<float>(y.data(), Shape{2, 4, 32})), kvq::Error);
}

TEST(Uniform, RawFormatsRoundTrip) {
  const Shape s{7, 3, 24};
  auto data = kvq_test::kv_data(s, 1, true);
  for (Format f : {Format::kF32, Format::kF16, Format::kBF16}) {
    QuantConfig c;
    c.format = f;
    auto q = kvq::quantize(c, KVView<const float>(data.data(), s));
    EXPECT_EQ(q.bytes(), kvq::account(c, s).total());
    std::vector<float> y(data.size());
    kvq::dequantize(q, KVView<float>(y.data(), s));
    for (size_t i = 0; i < y.size(); ++i) {
      const float expect = f == Format::kF32   ? data[i]
                           : f == Format::kF16 ? kvq::half_bits_to_float(kvq::float_to_half_bits(data[i]))
                                               : kvq::bf16_bits_to_float(kvq::float_to_bf16_bits(data[i]));
      ASSERT_EQ(y[i], expect);
    }
  }
}

}  // namespace
