// The accountant: known effective bits (llama.cpp block formats, KIVI) and, for every
// configuration, accountant bytes == bytes the packed block actually holds.
#include <gtest/gtest.h>

#include <vector>

#include "kvq/accounting/accountant.hpp"
#include "kvq/quant/quantize.hpp"
#include "test_util.hpp"

namespace {

using kvq::Axis;
using kvq::Format;
using kvq::QuantConfig;
using kvq::Shape;

using kvq_test::int_cfg;

TEST(Accountant, KnownValues) {
  const Shape s{64, 8, 128};
  EXPECT_DOUBLE_EQ(kvq::effective_bits(int_cfg(2, false, Axis::kToken, 32), s), 3.0);
  EXPECT_DOUBLE_EQ(kvq::effective_bits(int_cfg(2, false, Axis::kChannel, 32), s), 3.0);
  EXPECT_DOUBLE_EQ(kvq::effective_bits(int_cfg(4, true, Axis::kToken, 32), s), 4.5);   // q4_0
  EXPECT_DOUBLE_EQ(kvq::effective_bits(int_cfg(8, true, Axis::kToken, 32), s), 8.5);   // q8_0
  EXPECT_DOUBLE_EQ(kvq::effective_bits(int_cfg(4, false, Axis::kToken, 32), s), 5.0);  // q4_1
  EXPECT_DOUBLE_EQ(kvq::effective_bits(int_cfg(4, false, Axis::kToken, 32, kvq::MetaDType::kF32), s),
                   6.0);
  // vLLM k8v4 values: 4-bit per token (head_dim 128) with fp16 scale and zero: 68 bytes/head/token
  const auto b = kvq::account(int_cfg(4, false, Axis::kToken, 0), Shape{1, 1, 128});
  EXPECT_EQ(b.total(), 68u);
  EXPECT_EQ(b.codes, 64u);
  EXPECT_EQ(b.scales, 2u);
  EXPECT_EQ(b.zeros, 2u);
  // 3-bit codes are packed densely: 3 bits/value + metadata
  EXPECT_DOUBLE_EQ(kvq::effective_bits(int_cfg(3, false, Axis::kToken, 32), s), 4.0);
  QuantConfig f16;
  f16.format = Format::kF16;
  EXPECT_DOUBLE_EQ(kvq::effective_bits(f16, s), 16.0);
}

TEST(Accountant, BreakdownSumsToTotal) {
  const auto b = kvq::account(int_cfg(2, false, Axis::kChannel, 32), Shape{64, 8, 128});
  EXPECT_EQ(b.codes, 64u * 8 * 128 * 2 / 8);
  EXPECT_EQ(b.scales, 2u * 8 * 128 * 2);
  EXPECT_EQ(b.zeros, b.scales);
  EXPECT_EQ(b.total(), b.codes + b.scales + b.zeros);
}

// Every configuration the suite builds: accountant == real bytes of the packed block.
TEST(Accountant, MatchesPackedBytesForEveryConfig) {
  int checked = 0;
  for (Shape s : {Shape{64, 4, 128}, Shape{96, 2, 80}, Shape{32, 3, 8}, Shape{7, 1, 24}}) {
    auto data = kvq_test::kv_data(s, 2, true);
    kvq::KVView<const float> x(data.data(), s);
    for (Format f : {Format::kF32, Format::kF16, Format::kBF16}) {
      QuantConfig c;
      c.format = f;
      EXPECT_EQ(kvq::quantize(c, x).bytes(), kvq::account(c, s).total());
      ++checked;
    }
    for (Format f : {Format::kE4M3, Format::kE5M2})
      for (Axis a : {Axis::kToken, Axis::kHead, Axis::kTensor})
        for (auto meta : {kvq::MetaDType::kF16, kvq::MetaDType::kF32}) {
          QuantConfig c;
          c.format = f;
          c.bits = 8;
          c.axis = a;
          c.meta = meta;
          ASSERT_EQ(kvq::quantize(c, x).breakdown(), kvq::account(c, s)) << c.name();
          ++checked;
        }
    for (int bits : {2, 3, 4, 8})
      for (bool sym : {false, true})
        for (Axis a : {Axis::kToken, Axis::kChannel, Axis::kHead, Axis::kTensor})
          for (int64_t g : {0, 8, 16, 32})
            for (auto meta : {kvq::MetaDType::kF16, kvq::MetaDType::kF32}) {
              const auto c = int_cfg(bits, sym, a, g, meta);
              const int64_t extent = a == Axis::kToken ? s.head_dim : s.tokens;
              if (g > 0 && g < extent && extent % g != 0) {
                EXPECT_THROW(kvq::account(c, s), kvq::Error);
                EXPECT_THROW(kvq::quantize(c, x), kvq::Error);
                continue;
              }
              const auto q = kvq::quantize(c, x);
              ASSERT_EQ(q.breakdown(), kvq::account(c, s)) << c.name() << " " << s.str();
              ++checked;
            }
  }
  EXPECT_GT(checked, 300);
}

}  // namespace
