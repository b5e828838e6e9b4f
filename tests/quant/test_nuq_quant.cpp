// KVQ_TEST_SCALAR_TOO
// Tests of quant/nuq_quant.hpp against reference/nuq_ref.hpp (identical bytes), round trips,
// the uncalibrated-config error and the accountant.
#include "kvq/quant/nuq_quant.hpp"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "kvq/accounting/accountant.hpp"
#include "kvq/quant/quantize.hpp"
#include "kvq/reference/nuq_ref.hpp"
#include "test_util.hpp"

namespace {

kvq::QuantConfig nuq_cfg(int bits, kvq::Axis axis, int64_t group) {
  kvq::QuantConfig c;
  c.format = kvq::Format::kNuq;
  c.bits = bits;
  c.axis = axis;
  c.group = group;
  // A non-uniform codebook: denser near the middle.
  const int n = 1 << bits;
  for (int i = 0; i < n; ++i) {
    const double u = (i + 0.5) / n * 2.0 - 1.0;  // (-1, 1)
    c.nuq_levels[static_cast<std::size_t>(i)] = static_cast<float>(0.5 + 0.5 * u * std::fabs(u));
  }
  c.nuq_ready = true;
  return c;
}

// The quantizer's bytes (codes, scales, zeros) against the oracle's.
void expect_matches_oracle(const kvq::QuantConfig& cfg, const kvq::KVView<const float>& xv) {
  const kvq::QTensor ref = kvq::reference::quantize_nuq(cfg, xv);
  const kvq::QTensor fast = kvq::quantize(cfg, xv);
  EXPECT_EQ(fast.codes, ref.codes);
  EXPECT_EQ(fast.scales.raw(), ref.scales.raw());
  EXPECT_EQ(fast.zeros.raw(), ref.zeros.raw());
}

// Quantizing x (shape s) under cfg throws `kind` with `what` in its message.
void expect_error(const kvq::QuantConfig& cfg, const std::vector<float>& x, const kvq::Shape& s,
                  kvq::ErrorKind kind, const std::string& what) {
  try {
    kvq::quantize(cfg, kvq::KVView<const float>(x.data(), s));
    ADD_FAILURE() << "no throw, expected: " << what;
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.kind(), kind);
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
  }
}

struct Case {
  int bits;
  kvq::Axis axis;
  int64_t group;
};

class NuqQuant : public ::testing::TestWithParam<Case> {};

TEST_P(NuqQuant, MatchesOracleAndRoundTrips) {
  const Case cs = GetParam();
  const kvq::Shape s{32, 2, 64};
  const auto x = kvq_test::kv_data(s, 5, true);
  const kvq::QuantConfig cfg = nuq_cfg(cs.bits, cs.axis, cs.group);
  const kvq::KVView<const float> xv(x.data(), s);
  const kvq::QTensor fast = kvq::quantize(cfg, xv);
  const kvq::QTensor ref = kvq::reference::quantize_nuq(cfg, xv);
  EXPECT_EQ(fast.codes, ref.codes);
  EXPECT_EQ(fast.scales, ref.scales);
  EXPECT_EQ(fast.zeros, ref.zeros);
  EXPECT_EQ(fast.bytes(), kvq::account(cfg, s).total());
  std::vector<float> a(x.size()), b(x.size());
  kvq::dequantize(fast, kvq::KVView<float>(a.data(), s));
  kvq::reference::dequantize_nuq(ref, kvq::KVView<float>(b.data(), s));
  EXPECT_EQ(a, b);
  // With the uniform grid i / (2^b - 1) as its codebook, nuq is the asymmetric int format up to
  // the rounding of the stored scale: same error within 5%.
  kvq::QuantConfig grid = cfg;
  const int n = 1 << cs.bits;
  for (int i = 0; i < n; ++i) grid.nuq_levels[static_cast<std::size_t>(i)] = float(i) / float(n - 1);
  kvq::QuantConfig ic = kvq_test::int_cfg(cs.bits, false, cs.axis, cs.group);
  std::vector<float> g(x.size()), iq(x.size());
  kvq::dequantize(kvq::quantize(grid, xv), kvq::KVView<float>(g.data(), s));
  kvq::dequantize(kvq::quantize(ic, xv), kvq::KVView<float>(iq.data(), s));
  EXPECT_LE(kvq_test::rel_mse(x, g), 1.05 * kvq_test::rel_mse(x, iq) + 1e-9);
  // Token-range decode equals the slice of the whole decode.
  std::vector<float> part(static_cast<std::size_t>(8 * 2 * 64));
  kvq::QuantWorkspace ws;
  kvq::dequantize_tokens(kvq::view_of(fast), 16, kvq::KVView<float>(part.data(), {8, 2, 64}), ws);
  EXPECT_TRUE(std::equal(part.begin(), part.end(), a.begin() + 16 * 2 * 64));
}

INSTANTIATE_TEST_SUITE_P(All, NuqQuant,
                         ::testing::Values(Case{2, kvq::Axis::kToken, 32},
                                           Case{3, kvq::Axis::kToken, 64},
                                           Case{4, kvq::Axis::kToken, 16},
                                           Case{2, kvq::Axis::kChannel, 32},
                                           Case{3, kvq::Axis::kChannel, 16},
                                           Case{4, kvq::Axis::kChannel, 8},
                                           Case{3, kvq::Axis::kHead, 0},
                                           Case{3, kvq::Axis::kTensor, 8}));

TEST(NuqQuant, ConstantGroupsRoundTripExactly) {
  const kvq::Shape s{4, 1, 32};
  std::vector<float> x(static_cast<std::size_t>(s.numel()), 1.5f);
  const auto cfg = nuq_cfg(3, kvq::Axis::kToken, 32);
  std::vector<float> y(x.size());
  kvq::dequantize(kvq::quantize(cfg, kvq::KVView<const float>(x.data(), s)),
                  kvq::KVView<float>(y.data(), s));
  EXPECT_EQ(x, y);
}

TEST(NuqQuant, NeedsCalibration) {
  auto cfg = nuq_cfg(3, kvq::Axis::kToken, 32);
  cfg.nuq_ready = false;
  const kvq::Shape s{2, 1, 32};
  std::vector<float> x(static_cast<std::size_t>(s.numel()), 1.f);
  expect_error(cfg, x, s, kvq::ErrorKind::kInvalidArgument, "calibrat");
  cfg = nuq_cfg(3, kvq::Axis::kToken, 32);
  cfg.nuq_levels[3] = cfg.nuq_levels[2];  // not ascending
  EXPECT_THROW(kvq::quantize(cfg, kvq::KVView<const float>(x.data(), s)), kvq::Error);
  cfg = nuq_cfg(3, kvq::Axis::kToken, 32);
  cfg.bits = 5;
  EXPECT_THROW(kvq::account(cfg, s), kvq::Error);
}

TEST(NuqQuant, EffectiveBitsLikeAsymmetricInt) {
  const kvq::Shape s{32, 4, 128};
  EXPECT_DOUBLE_EQ(kvq::effective_bits(nuq_cfg(3, kvq::Axis::kChannel, 32), s), 4.0);
  EXPECT_DOUBLE_EQ(kvq::effective_bits(nuq_cfg(2, kvq::Axis::kToken, 32), s), 3.0);
  EXPECT_EQ(kvq::nuq_codebook_bytes(3), 32u);
}


// The per-token row path (AVX2: codes packed 64 at a time, a ChunkWriter tail when head_dim is
// not a multiple of 64) against the oracle: every bit width, f16/f32 metadata, f32/f16/strided
// input, group 8..head_dim; errors as the grouped driver reports them.
TEST(NuqQuant, TokenRowsMatchOracle) {
  for (int bits : {2, 3, 4})
    for (int64_t D : {64, 136})
      for (int64_t group : {8, 0})
        for (kvq::MetaDType meta : {kvq::MetaDType::kF16, kvq::MetaDType::kF32}) {
          kvq::QuantConfig cfg = nuq_cfg(bits, kvq::Axis::kToken, group);
          cfg.meta = meta;
          const kvq::Shape s{12, 3, D};
          auto x = kvq_test::kv_data(s, 11, true);
          for (std::size_t i = 0; i < x.size(); i += 23) x[i] = 0.5f;  // ties with thresholds' inputs
          SCOPED_TRACE(cfg.name() + " " + s.str());
          const kvq::KVView<const float> xv(x.data(), s);
          expect_matches_oracle(cfg, xv);
          const kvq::QTensor ref = kvq::reference::quantize_nuq(cfg, xv);
          std::vector<kvq::f16> xh(x.size());
          kvq::convert(x.data(), xh.data(), x.size());
          const kvq::KVView<const kvq::f16> hv(xh.data(), s);
          EXPECT_EQ(kvq::quantize(cfg, hv).codes, kvq::reference::quantize_nuq(cfg, hv).codes);
          std::vector<float> hnd(x.size());
          for (int64_t t = 0; t < s.tokens; ++t)
            for (int64_t h = 0; h < s.heads; ++h)
              for (int64_t d = 0; d < D; ++d)
                hnd[static_cast<std::size_t>((h * s.tokens + t) * D + d)] =
                    x[static_cast<std::size_t>((t * s.heads + h) * D + d)];
          const kvq::KVView<const float> sv(hnd.data(), s, kvq::Strides{D, s.tokens * D, 1});
          EXPECT_EQ(kvq::quantize(cfg, sv).codes, ref.codes);
        }
  const kvq::Shape s{4, 2, 64};
  auto x = kvq_test::kv_data(s, 2, false);
  x[(2 * 2 + 1) * 64 + 9] = INFINITY;
  expect_error(nuq_cfg(3, kvq::Axis::kToken, 32), x, s, kvq::ErrorKind::kNonFinite, "token=2, head=1, channel=9");
  x[(2 * 2 + 1) * 64 + 9] = 1.f;
  x[(1 * 2 + 0) * 64 + 40] = -1e6f;  // group 3 of vector 2: zero point beyond fp16
  expect_error(nuq_cfg(3, kvq::Axis::kToken, 32), x, s, kvq::ErrorKind::kOutOfRange, "group 5");
}

// The per-token rows with groups the vectorized parameters handle 8 at a time: head_dims of
// exactly 8 and of more than 8 groups (a second, partial batch), groups of 32/64/128 (zero and
// inverse scale hoisted per group) and 8/24 (per 8 channels); rows with constant groups (scale
// 0), subnormal ranges (an infinite inverse becomes 0), huge offsets and exact zeros of both
// signs. Bytes equal the oracle's; an error in a later batch does not hide an earlier group's.
TEST(NuqQuant, TokenRowBatchesAndEdgeGroupsMatchOracle) {
  const std::pair<int64_t, int64_t> dims[] = {{256, 32}, {320, 32}, {128, 128}, {384, 64},
                                               {96, 8},   {192, 24}, {72, 8},  {88, 8}};
  for (int bits : {2, 3, 4})
    for (const auto& [D, group] : dims)
      for (kvq::MetaDType meta : {kvq::MetaDType::kF16, kvq::MetaDType::kF32}) {
        kvq::QuantConfig cfg = nuq_cfg(bits, kvq::Axis::kToken, group);
        cfg.meta = meta;
        const kvq::Shape s{5, 3, D};
        auto x = kvq_test::kv_data(s, static_cast<uint32_t>(D + bits), true);
        for (int64_t d = 0; d < group; ++d) {
          x[static_cast<std::size_t>(1 * D + d)] = -0.75f;                           // constant
          x[static_cast<std::size_t>(4 * D + D - group + d)] = (d % 3 - 1) * 1e-41f;  // subnormal
          x[static_cast<std::size_t>(7 * D + d)] = 3000.f + (d % 5) * 0.25f;         // offset
          x[static_cast<std::size_t>(9 * D + d)] = d % 2 ? -0.f : 0.f;                // zeros
        }
        SCOPED_TRACE(cfg.name() + " " + s.str());
        expect_matches_oracle(cfg, kvq::KVView<const float>(x.data(), s));
      }
  // fp16 zero point overflow in group 1 of vector 0 and an inf in group 9 (second batch) of the
  // same vector: the overflow is reported, as the grouped driver reports it.
  const kvq::Shape s{2, 1, 320};
  auto x = kvq_test::kv_data(s, 3, false);
  x[40] = -1e6f;
  x[9 * 32 + 3] = INFINITY;
  expect_error(nuq_cfg(3, kvq::Axis::kToken, 32), x, s, kvq::ErrorKind::kOutOfRange, "group 1 ");
  x[40] = 1.f;  // now the inf, in the second batch, is the first error
  expect_error(nuq_cfg(3, kvq::Axis::kToken, 32), x, s, kvq::ErrorKind::kNonFinite, "channel=291");
}

}  // namespace
