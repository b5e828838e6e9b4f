// The accountant: known effective bits (llama.cpp block formats, KIVI) and, for every
// configuration, accountant bytes == bytes the packed block actually holds.
#include <gtest/gtest.h>

#include <vector>

#include "kvq/accounting/accountant.hpp"
#include "kvq/policy/spec.hpp"
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
  // FP4: e2m1 + one e4m3 byte per 16 (NVFP4) / one e8m0 byte per 32 (MXFP4); NVFP4's fp32
  // tensor scale is per-layer metadata (4 bytes once per layer and K/V).
  EXPECT_DOUBLE_EQ(kvq::effective_bits(kvq::fp4_config(Format::kNvfp4), s), 4.5);
  EXPECT_DOUBLE_EQ(kvq::effective_bits(kvq::fp4_config(Format::kMxfp4), s), 4.25);
  EXPECT_EQ(kvq::layer_metadata_bytes(kvq::fp4_config(Format::kNvfp4)), 4u);
  EXPECT_EQ(kvq::layer_metadata_bytes(kvq::fp4_config(Format::kMxfp4)), 0u);
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

// An independent check (issue 15 item 3): a second formula, written here from bits, group, axis,
// metadata type and shape alone (no group_box, no packed_bytes, no packed_sizes), against the
// bytes of the buffers quantize() really fills, over every format, axis, group (including
// groups that do not divide the extent: then both must throw) and shape.
namespace {

struct Expect {
  bool ok = true;
  std::size_t codes = 0, scales = 0, zeros = 0, norms = 0, qjl = 0;
};

Expect independent_bytes(const QuantConfig& c, int64_t T, int64_t H, int64_t D) {
  Expect e;
  const std::size_t n = static_cast<std::size_t>(T * H * D);
  const std::size_t vecs = static_cast<std::size_t>(T * H);
  const std::size_t m = c.meta == kvq::MetaDType::kF16 ? 2 : 4;
  auto ceil8 = [](std::size_t bits) { return bits / 8 + (bits % 8 != 0 ? 1 : 0); };
  // Groups along one extent: 0 or >= extent means one group; otherwise it must divide.
  auto groups_along = [&](int64_t extent, int64_t& count) {
    if (extent == 0) {
      count = 0;
      return true;
    }
    const int64_t g = (c.group == 0 || c.group >= extent) ? extent : c.group;
    if (extent % g != 0) return false;
    count = extent / g;
    return true;
  };
  switch (c.format) {
    case Format::kF32: e.codes = 4 * n; return e;
    case Format::kF16:
    case Format::kBF16: e.codes = 2 * n; return e;
    case Format::kLloydMax:
      e.codes = ceil8(n * static_cast<std::size_t>(c.bits));
      e.norms = vecs * m;
      if (c.qjl) e.qjl = ceil8(n) + vecs * m;
      return e;
    case Format::kNvfp4:
    case Format::kMxfp4: {  // 4-bit e2m1 codes, one scale byte per block of 16 / 32 channels
      const int64_t blk = c.format == Format::kNvfp4 ? 16 : 32;
      e.ok = D % blk == 0;
      e.codes = n / 2;
      e.scales = n / static_cast<std::size_t>(blk);
      return e;
    }
    default: break;
  }
  int64_t boxes = 0, k = 0;
  switch (c.axis) {
    case Axis::kToken:  // groups of channels inside one (token, head)
      e.ok = groups_along(D, k);
      boxes = T * H * k;
      break;
    case Axis::kChannel:  // groups of tokens of one (head, channel)
      e.ok = groups_along(T, k);
      boxes = k * H * D;
      break;
    case Axis::kHead:  // groups of tokens of one whole head
      e.ok = groups_along(T, k);
      boxes = k * H;
      break;
    case Axis::kTensor:  // groups of tokens of the whole tensor
      e.ok = groups_along(T, k);
      boxes = k;
      break;
  }
  if (n == 0) boxes = 0;
  const bool is_int = c.format == Format::kInt;
  e.codes = is_int ? ceil8(n * static_cast<std::size_t>(c.bits)) : n;
  e.scales = static_cast<std::size_t>(boxes) * m;
  e.zeros = is_int && !c.symmetric ? static_cast<std::size_t>(boxes) * m : 0;
  return e;
}

TEST(Accountant, IndependentFormulaEqualsTheBytesQuantizeFills) {
  int checked = 0, throws = 0;
  const int64_t shapes[][3] = {{1, 1, 8}, {7, 3, 24}, {32, 2, 64}, {48, 1, 128}, {5, 4, 96},
                               {0, 2, 16}, {96, 2, 32}};
  for (const auto& sh : shapes) {
    const Shape s{sh[0], sh[1], sh[2]};
    const auto data = kvq_test::kv_data(s, 4, true);
    const kvq::KVView<const float> x(data.data(), s);
    std::vector<QuantConfig> cfgs;
    for (Format f : {Format::kF32, Format::kF16, Format::kBF16}) cfgs.push_back(kvq::raw_config(f));
    for (auto meta : {kvq::MetaDType::kF16, kvq::MetaDType::kF32}) {
      for (int64_t g : {0, 1, 3, 8, 16, 32, 48, 64, 200}) {
        for (Axis a : {Axis::kToken, Axis::kChannel, Axis::kHead, Axis::kTensor}) {
          for (int bits : {2, 3, 4, 8})
            for (bool sym : {false, true}) cfgs.push_back(int_cfg(bits, sym, a, g, meta));
          if (a != Axis::kChannel)
            for (Format f : {Format::kE4M3, Format::kE5M2}) {
              QuantConfig c = kvq::fp8_config(f, a, g);
              c.meta = meta;
              cfgs.push_back(c);
            }
        }
      }
      for (Format f : {Format::kNvfp4, Format::kMxfp4}) cfgs.push_back(kvq::fp4_config(f));
      if (s.head_dim != 24)  // Lloyd-Max needs a Hadamard size
        for (int b = 1; b <= 4; ++b)
          for (bool qjl : {false, true}) {
            QuantConfig c = kvq::lm_config(b, qjl);
            c.meta = meta;
            cfgs.push_back(c);
          }
    }
    for (const QuantConfig& c : cfgs) {
      SCOPED_TRACE(c.name() + " " + s.str());
      const Expect e = independent_bytes(c, s.tokens, s.heads, s.head_dim);
      if (!e.ok) {
        EXPECT_THROW(kvq::account(c, s), kvq::Error);
        EXPECT_THROW(kvq::quantize(c, x), kvq::Error);
        ++throws;
        continue;
      }
      const kvq::QTensor q = kvq::quantize(c, x);
      EXPECT_EQ(q.codes.size(), e.codes);
      EXPECT_EQ(q.scales.raw().size(), e.scales);
      EXPECT_EQ(q.zeros.raw().size(), e.zeros);
      EXPECT_EQ(q.norms.raw().size(), e.norms);
      EXPECT_EQ(q.qjl_signs.size() + q.qjl_norms.raw().size(), e.qjl);
      const kvq::ByteBreakdown b = kvq::account(c, s);
      EXPECT_EQ(b.total(), e.codes + e.scales + e.zeros + e.norms + e.qjl);  // bytes held
      EXPECT_EQ(q.bytes(), b.total());
      ++checked;
    }
  }
  EXPECT_GT(checked, 1500);
  EXPECT_GT(throws, 100);
}

// account() rejects bit widths a format does not store (it used to return a number for int5 and
// wrap size_t for negative bits).
TEST(Accountant, RejectsUnsupportedBitWidths) {
  for (int bits : {-8, -1, 0, 1, 5, 6, 7, 9, 16, 64}) {
    EXPECT_THROW(kvq::account(int_cfg(bits, false, Axis::kToken, 32), Shape{4, 2, 64}), kvq::Error)
        << bits;
  }
  for (int bits : {-1, 0, 5, 8}) {
    QuantConfig c = kvq::lm_config(4);
    c.bits = bits;
    EXPECT_THROW(kvq::account(c, Shape{4, 2, 64}), kvq::Error) << bits;
  }
  // Shapes whose byte count overflows size_t are errors, not wrapped numbers.
  EXPECT_THROW(kvq::account(int_cfg(4, false, Axis::kToken, 32),
                            Shape{int64_t{1} << 40, int64_t{1} << 20, 128}),
               kvq::Error);
}

}  // namespace
