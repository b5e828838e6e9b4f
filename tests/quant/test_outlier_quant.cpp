// KVQ_TEST_SCALAR_TOO
// Tests of quant/outlier_quant.hpp (dense-and-sparse) against reference/outlier_ref.hpp:
// identical bytes for int, fp8 and nuq on every axis, exact outliers, fp16 range errors, the
// accountant, token-range decodes; the row isolation (AVX2 and scalar) against the oracle's
// split bit for bit (ties, signed zeros, fully selected groups), the fused token-axis path and
// the slab path for token-spanning axes against the oracle, and the whole-tensor error order.
#include "kvq/quant/outlier_quant.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <iterator>
#include <random>
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


// Rows that stress the selection: few distinct values (score ties), zeros of both signs as
// group bounds, constant groups, groups whose every entry is selected; and, for the float
// filter of the SIMD path (geometry/outliers.hpp), continuous values, a large mean against a
// small spread, and spreads whose reciprocal float cannot hold (those rows take its exact path).
std::vector<float> tricky_row(int64_t D, int64_t gc, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> r(static_cast<std::size_t>(D));
  const int mode = static_cast<int>(seed % 8);
  for (int64_t d = 0; d < D; ++d) {
    const int u = static_cast<int>(rng() % 7);
    switch (mode) {
      case 0: r[d] = static_cast<float>(u) - 3.f; break;  // many ties
      case 1: r[d] = (u % 2 ? -0.f : 0.f) + (u == 6 ? 2.5f : 0.f) - (u == 5 ? 1.f : 0.f); break;
      case 2: r[d] = (d / gc) % 2 == 0 ? 1.25f : std::ldexp(static_cast<float>(u) - 3.f, -3); break;
      case 4: r[d] = normal(rng); break;
      case 5: r[d] = 1000.f + 1e-3f * normal(rng); break;
      case 6: r[d] = 1e-38f * normal(rng); break;  // 1 / sd above 1e30
      case 7: r[d] = 1e36f * normal(rng); break;   // 1 / sd below 1e-30
      default: r[d] = static_cast<float>(static_cast<int>(rng() % 2001) - 1000) / 37.f; break;
    }
  }
  if (mode == 3) r[static_cast<std::size_t>(rng() % D)] = 300.f;
  return r;
}

bool same_bits(const float* a, const float* b, std::size_t n) {
  return std::memcmp(a, b, n * sizeof(float)) == 0;
}

TEST(OutlierRow, PathsMatchOracleBitForBit) {
  int cases = 0;
  for (int64_t D : {8, 16, 24, 64, 128, 136, 512, 640})
    for (int64_t gc : {4, 8, 16, 24, 32, 64, 128})
      for (int64_t k : {1, 2, 3, 4, 8, 9, 16}) {
        if (D % gc != 0 || k > D) continue;
        for (uint32_t seed = 0; seed < 16; ++seed) {
          const std::vector<float> r = tricky_row(D, gc, seed * 31u + static_cast<uint32_t>(D + k));
          const auto ref = kvq::reference::split_outliers(
              kvq::Axis::kToken, gc, k, kvq::KVView<const float>(r.data(), {1, 1, D}));
          const int64_t nc = D / gc;
          for (int path = 0; path < 2; ++path) {
            std::vector<float> dense(r.size()), vals(static_cast<std::size_t>(k)), lo(nc), hi(nc);
            std::vector<int32_t> sel(static_cast<std::size_t>(k));
            kvq::OutlierScratch sc;
            const bool ok =
                path == 0 ? kvq::isolate_row(r.data(), D, gc, k, dense.data(), sel.data(),
                                             vals.data(), lo.data(), hi.data(), sc)
                          : kvq::detail::isolate_row_scalar(r.data(), D, gc, k, dense.data(),
                                                            sel.data(), vals.data(), lo.data(),
                                                            hi.data(), sc);
            ASSERT_TRUE(ok);
            SCOPED_TRACE(::testing::Message() << "D=" << D << " gc=" << gc << " k=" << k
                                              << " seed=" << seed << " path=" << path);
            EXPECT_EQ(sel, ref.sel);
            EXPECT_TRUE(same_bits(vals.data(), ref.vals.data(), vals.size()));
            EXPECT_TRUE(same_bits(dense.data(), ref.dense.data(), dense.size()));
            // lo/hi: the dense part's range per group (bit for bit: signed zeros included).
            for (int64_t b = 0; b < nc; ++b) {
              float l = INFINITY, h = -INFINITY;
              for (int64_t d = b * gc; d < (b + 1) * gc; ++d) {
                bool selected = false;
                for (int32_t j : ref.sel) selected |= j == d;
                if (selected) continue;
                l = std::min(l, r[static_cast<std::size_t>(d)]);
                h = std::max(h, r[static_cast<std::size_t>(d)]);
              }
              if (!(l <= h)) l = h = ref.dense[static_cast<std::size_t>(b * gc)];
              EXPECT_TRUE(same_bits(&lo[b], &l, 1)) << b << ": " << lo[b] << " vs " << l;
              EXPECT_TRUE(same_bits(&hi[b], &h, 1)) << b << ": " << hi[b] << " vs " << h;
            }
            ++cases;
          }
        }
      }
  EXPECT_GT(cases, 500);
  // Non-finite rows are refused by both paths.
  std::vector<float> bad(64, 1.f), d(64), v(2), lo(2), hi(2);
  std::vector<int32_t> sel(2);
  kvq::OutlierScratch sc;
  bad[40] = INFINITY;
  EXPECT_FALSE(kvq::isolate_row(bad.data(), 64, 32, 2, d.data(), sel.data(), v.data(), lo.data(),
                                hi.data(), sc));
  bad[40] = NAN;
  EXPECT_FALSE(kvq::detail::isolate_row_scalar(bad.data(), 64, 32, 2, d.data(), sel.data(),
                                               v.data(), lo.data(), hi.data(), sc));
}

// Rows where the row path's float filter (geometry/outliers.hpp) must fall back to exact scores
// or where a score's rounding matters: exact ties everywhere, values a few ulps apart, repeated
// extremes, top scores sharing one box side, and extremes far above a negative mean (there a
// score's rounding error exceeds the extreme's own ulp). 1500 rows against the oracle.
// Rows of TiesAndUlpNeighboursMatchOracle (seed picks the mode); modes 5 to 7 put a mean of
// a few hundred to a few thousand standard deviations under near-tied extremes, where the float
// statistics of isolate_rows_lean are off by more than the extremes' gaps (mode 7: the groups'
// extremes a few ulps apart, so its error bound E decides; without it the filter picks wrong).
std::vector<float> ulp_row(uint32_t seed, int64_t D) {
  std::mt19937 rng(seed);
  std::vector<float> r(static_cast<std::size_t>(D));
  const int mode = static_cast<int>((seed / 4) % 8);
  for (int64_t d = 0; d < D; ++d) {
    const int u = static_cast<int>(rng() % 7);
    switch (mode) {
      case 0: r[d] = static_cast<float>(u) - 3.f; break;  // exact ties everywhere
      case 1: r[d] = std::ldexp(1.f + static_cast<float>(rng() % 5) * 0x1p-23f, u % 3); break;
      case 2: r[d] = (u == 0 ? 5.f : 0.f) + 0x1p-20f * static_cast<float>(rng() % 3); break;
      case 3: r[d] = 0.37f * static_cast<float>(u * u) - 1.1f; break;  // tied extremes
      case 5: r[d] = 300.f + 0.5f * static_cast<float>(u) + (u == 6 ? 0x1p-15f * static_cast<float>(rng() % 4) : 0.f); break;
      case 6: r[d] = -2000.f + 0.25f * static_cast<float>(u % 3) + (u == 6 ? 3.f + 0x1p-13f * static_cast<float>(rng() % 3) : 0.f); break;
      case 7: {  // every group one continuous pattern at its own offset, extremes ulps apart
        const int64_t j = d % 32;
        const float pat = 0.37f * static_cast<float>((j * 7919 + static_cast<int64_t>(seed)) % 97) / 97.f;
        r[d] = 1000.f + 37.f * static_cast<float>(d / 32) + 3.1f * pat +
               (j == 5 ? 6.f + 0x1p-14f * static_cast<float>(rng() % 5) : 0.f);
        break;
      }
      default:  // extremes far above a negative mean: a score's rounding exceeds their ulp
        r[d] = u < 5 ? -1.f - 0x1p-10f * static_cast<float>(u) : 1e-3f * static_cast<float>(u - 4);
    }
  }
  return r;
}

TEST(OutlierRow, TiesAndUlpNeighboursMatchOracle) {
  int cases = 0;
  for (uint32_t seed = 0; seed < 1500; ++seed) {
    const int64_t D = seed % 3 == 0 ? 64 : 128, gc = seed % 5 == 0 ? 64 : 32;
    const int64_t k = 1 + static_cast<int64_t>(seed % 4);
    const std::vector<float> r = ulp_row(seed, D);
    const auto ref = kvq::reference::split_outliers(
        kvq::Axis::kToken, gc, k, kvq::KVView<const float>(r.data(), {1, 1, D}));
    const int64_t nc = D / gc;
    std::vector<float> dense(r.size()), vals(static_cast<std::size_t>(k)), lo(nc), hi(nc);
    std::vector<int32_t> sel(static_cast<std::size_t>(k));
    kvq::OutlierScratch sc;
    ASSERT_TRUE(kvq::isolate_row(r.data(), D, gc, k, dense.data(), sel.data(), vals.data(),
                                 lo.data(), hi.data(), sc));
    SCOPED_TRACE(::testing::Message() << "seed=" << seed << " D=" << D << " gc=" << gc << " k=" << k);
    ASSERT_EQ(sel, ref.sel);
    ASSERT_TRUE(same_bits(dense.data(), ref.dense.data(), dense.size()));
    ++cases;
  }
  EXPECT_EQ(cases, 1500);
}

// A dense format of the fused-path tests: format, bits, symmetric, metadata type.
struct DenseFmt {
  kvq::Format f;
  int bits;
  bool sym;
  kvq::MetaDType meta;
};

#if KVQ_HAS_AVX2
// float_at_most (the filters' threshold rounding) is std::nextafter's step down, bit for bit.
TEST(OutlierRow, FloatAtMostMatchesNextafter) {
  std::mt19937_64 rng(7);
  std::vector<double> xs = {0.0, -0.0, 1e-320, -1e-320, 1e-46, -1e-46, 3.5e38, -3.5e38, 1e300,
                            -1e300, 1.0, -1.0, static_cast<double>(FLT_MAX), 0x1p-149, -0x1p-149};
  for (int i = 0; i < 20000; ++i) {
    const double f = std::ldexp(static_cast<double>(rng() >> 11) * 0x1p-53, static_cast<int>(rng() % 260) - 130);
    xs.push_back(i % 2 ? f : -f);
    const auto g = static_cast<float>(xs.back());  // a float itself and its neighbourhood
    xs.push_back(static_cast<double>(g));
    xs.push_back(static_cast<double>(g) * (1.0 + 0x1p-40));
  }
  for (const double x : xs) {
    auto ref = static_cast<float>(x);
    if (static_cast<double>(ref) > x) ref = std::nextafter(ref, -INFINITY);
    const float got = kvq::detail::float_at_most(x);
    ASSERT_TRUE(same_bits(&got, &ref, 1)) << x << ": " << got << " vs " << ref;
    ASSERT_LE(static_cast<double>(got), x);
  }
}

// One row through the fused quantizer's lean entry point (isolate_rows_lean_rt, nr = 1). When
// that succeeds, the row also goes through the multi-row calls (2, 3 and 4 rows: for head_dim
// 64, 128 and 256 the four-row instance with the group count fixed at compile time, fewer rows
// padded; pairs at run time otherwise) in several slots, next to its reverse: every slot
// holding the row must give the single row's outputs, every slot holding the reverse the same.
bool lean_row(const float* r, int64_t D, int64_t gc, int64_t k, int32_t* sel, float* vals,
              float* lo, float* hi, kvq::OutlierScratch& sc, bool* ok) {
  const bool ran = kvq::detail::isolate_rows_lean_rt(1, &r, D, gc, k, sel, vals, lo, hi, 0, sc, ok);
  if (!ran || !*ok) return ran;
  const std::vector<float> rev(std::make_reverse_iterator(r + D), std::make_reverse_iterator(r));
  const int64_t nc = D / gc;
  const auto uk = static_cast<std::size_t>(k), unc = static_cast<std::size_t>(nc);
  const std::vector<std::vector<int>> layouts = {{0, 1}, {1, 0}, {1, 0, 1}, {1, 0, 1, 0}};  // 0: r
  for (const auto& lay : layouts) {
    const int nr = static_cast<int>(lay.size());
    const auto unr = static_cast<std::size_t>(nr);
    const float* rows[4];
    for (int i = 0; i < nr; ++i) rows[i] = lay[static_cast<std::size_t>(i)] == 0 ? r : rev.data();
    std::vector<int32_t> sel2(unr * uk, -1);
    std::vector<float> vals2(unr * uk), lo2(unr * unc), hi2(unr * unc);
    bool ok2[4] = {false, false, false, false};
    EXPECT_TRUE(kvq::detail::isolate_rows_lean_rt(nr, rows, D, gc, k, sel2.data(), vals2.data(),
                                                  lo2.data(), hi2.data(), nc, sc, ok2));
    int first_rev = -1;
    for (int i = 0; i < nr; ++i) {
      SCOPED_TRACE(::testing::Message() << "rows " << nr << " slot " << i);
      EXPECT_TRUE(ok2[i]);
      const auto ui = static_cast<std::size_t>(i);
      if (lay[ui] == 0) {
        EXPECT_TRUE(std::equal(sel, sel + k, sel2.begin() + static_cast<std::ptrdiff_t>(ui * uk)));
        EXPECT_TRUE(same_bits(vals, vals2.data() + ui * uk, uk));
        EXPECT_TRUE(same_bits(lo, lo2.data() + ui * unc, unc));
        EXPECT_TRUE(same_bits(hi, hi2.data() + ui * unc, unc));
      } else if (first_rev < 0) {
        first_rev = i;
      } else {
        const auto uf = static_cast<std::size_t>(first_rev);
        EXPECT_TRUE(std::equal(sel2.begin() + static_cast<std::ptrdiff_t>(uf * uk),
                               sel2.begin() + static_cast<std::ptrdiff_t>(uf * uk + uk),
                               sel2.begin() + static_cast<std::ptrdiff_t>(ui * uk)));
        EXPECT_TRUE(same_bits(vals2.data() + uf * uk, vals2.data() + ui * uk, uk));
        EXPECT_TRUE(same_bits(lo2.data() + uf * unc, lo2.data() + ui * unc, unc));
        EXPECT_TRUE(same_bits(hi2.data() + uf * unc, hi2.data() + ui * unc, unc));
      }
    }
  }
  return ran;
}

// The lean row isolation of the fused quantizer (isolate_rows_lean: group 32, 64 or 128, k <= 4,
// no dense row) gives the oracle's selection, outlier values and dense ranges bit for bit, on
// the tricky rows (ties, signed zeros as bounds, constant groups, 1 / sd float cannot hold) and
// on continuous rows (its common case, no exact score computed).
TEST(OutlierRow, LeanIsolationMatchesOracle) {
  int cases = 0, lean = 0;
  for (int64_t D : {32, 64, 128, 256, 512})
    for (int64_t gc : {32, 64, 128})
      for (int64_t k = 1; k <= 4; ++k) {
        if (D % gc != 0) continue;
        for (uint32_t seed = 0; seed < 32; ++seed) {
          std::vector<float> r = tricky_row(D, gc, seed * 131u + static_cast<uint32_t>(D + gc + k));
          std::mt19937 rng(seed);
          if (seed >= 16 && seed < 24) {  // continuous rows, planted outliers, some in one group
            std::normal_distribution<float> nd(0.f, 1.f);
            for (float& v : r) v = nd(rng);
            for (int64_t j = 0; j < k + 1; ++j)
              r[static_cast<std::size_t>((rng() % 3 == 0 ? 5 : rng()) % D)] *= 9.f;
          } else if (seed >= 24) {  // zeros of both signs as the bounds, k clear outliers
            const float sgn = seed % 2 ? 1.f : -1.f;
            for (int64_t d = 0; d < D; ++d)
              r[static_cast<std::size_t>(d)] =
                  rng() % 3 ? (rng() % 2 ? 0.f : -0.f) : sgn * (0.25f + 0.01f * static_cast<float>(rng() % 9));
            for (int64_t j = 0; j < k; ++j) r[static_cast<std::size_t>((17 * j + seed) % D)] = sgn * (40.f + j);
          }
          const auto ref = kvq::reference::split_outliers(
              kvq::Axis::kToken, gc, k, kvq::KVView<const float>(r.data(), {1, 1, D}));
          const int64_t nc = D / gc;
          std::vector<float> vals(static_cast<std::size_t>(k)), lo(nc), hi(nc);
          std::vector<int32_t> sel(static_cast<std::size_t>(k));
          kvq::OutlierScratch sc;
          bool ok = false;
          ASSERT_TRUE(lean_row(r.data(), D, gc, k, sel.data(), vals.data(), lo.data(), hi.data(), sc, &ok));
          ASSERT_TRUE(ok);
          SCOPED_TRACE(::testing::Message() << "D=" << D << " gc=" << gc << " k=" << k
                                            << " seed=" << seed);
          EXPECT_EQ(sel, ref.sel);
          EXPECT_TRUE(same_bits(vals.data(), ref.vals.data(), vals.size()));
          for (int64_t b = 0; b < nc; ++b) {
            float l = INFINITY, h = -INFINITY;
            for (int64_t d = b * gc; d < (b + 1) * gc; ++d)
              if (std::find(ref.sel.begin(), ref.sel.end(), d) == ref.sel.end()) {
                l = std::min(l, r[static_cast<std::size_t>(d)]);
                h = std::max(h, r[static_cast<std::size_t>(d)]);
              }
            EXPECT_TRUE(same_bits(&lo[b], &l, 1)) << b << ": " << lo[b] << " vs " << l;
            EXPECT_TRUE(same_bits(&hi[b], &h, 1)) << b << ": " << hi[b] << " vs " << h;
          }
          ++cases;
          lean += seed >= 16;
        }
      }
  EXPECT_GT(cases, 1000);
  EXPECT_GT(lean, 300);
  // The near-tie rows of TiesAndUlpNeighboursMatchOracle, selection and ranges.
  for (uint32_t seed = 0; seed < 2100; ++seed) {
    const int64_t D = seed % 3 == 0 ? 64 : 128, gc = seed % 5 == 0 ? 64 : 32;
    const int64_t k = 1 + static_cast<int64_t>(seed % 4);
    const std::vector<float> r = ulp_row(seed, D);
    const auto ref = kvq::reference::split_outliers(
        kvq::Axis::kToken, gc, k, kvq::KVView<const float>(r.data(), {1, 1, D}));
    std::vector<float> vals(static_cast<std::size_t>(k)), lo(D / gc), hi(D / gc);
    std::vector<int32_t> sel(static_cast<std::size_t>(k));
    kvq::OutlierScratch sc;
    bool ok = false;
    ASSERT_TRUE(lean_row(r.data(), D, gc, k, sel.data(), vals.data(), lo.data(), hi.data(), sc, &ok));
    ASSERT_TRUE(ok);
    SCOPED_TRACE(::testing::Message() << "ulp row seed=" << seed << " D=" << D << " gc=" << gc);
    ASSERT_EQ(sel, ref.sel);
    for (int64_t b = 0; b < D / gc; ++b) {
      float l = INFINITY, h = -INFINITY;
      for (int64_t d = b * gc; d < (b + 1) * gc; ++d)
        if (std::find(ref.sel.begin(), ref.sel.end(), d) == ref.sel.end()) {
          l = std::min(l, r[static_cast<std::size_t>(d)]);
          h = std::max(h, r[static_cast<std::size_t>(d)]);
        }
      ASSERT_TRUE(same_bits(&lo[b], &l, 1) && same_bits(&hi[b], &h, 1)) << b;
    }
  }
  // Not instantiated: other groups, k > 4; non-finite rows refused.
  std::vector<float> row(128, 1.f), v(5), lo(4), hi(4);
  std::vector<int32_t> sel(5);
  kvq::OutlierScratch sc;
  bool ok = true;
  EXPECT_FALSE(lean_row(row.data(), 128, 16, 2, sel.data(), v.data(), lo.data(), hi.data(), sc, &ok));
  EXPECT_FALSE(lean_row(row.data(), 128, 32, 5, sel.data(), v.data(), lo.data(), hi.data(), sc, &ok));
  row[77] = NAN;
  EXPECT_TRUE(lean_row(row.data(), 128, 32, 2, sel.data(), v.data(), lo.data(), hi.data(), sc, &ok));
  EXPECT_FALSE(ok);
}

#if KVQ_HAS_F16C
// lean_quad (four vectors per call) declines, for the caller's per-vector steps to report,
// every block where one vector is not finite or holds an outlier fp16 cannot store, whichever
// of the four it is; a block without either is encoded.
TEST(OutlierQuant, LeanQuadDeclinesBadBlocks) {
  const kvq::Shape s{4, 1, 64};
  const auto cfg = make(kvq::Format::kInt, 3, kvq::Axis::kToken, 32, 1);
  const kvq::detail::IntCodec codec(cfg);
  const auto fn = kvq::detail::lean_quad_for<kvq::detail::IntCodec>(64, 32, 1);
  ASSERT_NE(fn, nullptr);
  kvq::OutlierScratch sc;
  for (int bad = -1; bad < 3; ++bad)
    for (int p = 0; p < 4; ++p) {
      std::vector<float> x = kvq_test::kv_data(s, 5, false);
      const float v[] = {NAN, INFINITY, -1e6f};
      if (bad >= 0) x[static_cast<std::size_t>(p * 64 + 17)] = v[bad];
      std::vector<uint8_t> codes(4 * 24), scales(4 * 2 * 2), zeros(4 * 2 * 2), ov(4 * 2), op(4);
      const float* rows[4] = {&x[0], &x[64], &x[128], &x[192]};
      const kvq::detail::LeanQuadOut o{codes.data(), scales.data(), zeros.data(), ov.data(), op.data()};
      EXPECT_EQ(fn(codec, 3, rows, o, sc), bad < 0) << bad << " in vector " << p;
      if (bad < 0) {  // the oracle's bytes
        const kvq::QTensor ref = kvq::reference::quantize_with_outliers(cfg, kvq::KVView<const float>(x.data(), s));
        EXPECT_EQ(codes, ref.codes);
        EXPECT_EQ(scales, ref.scales.raw());
        EXPECT_EQ(zeros, ref.zeros.raw());
        EXPECT_EQ(ov, ref.outlier_values);
        EXPECT_EQ(op, ref.outlier_pos);
      }
    }
}
#endif

// The fused lean path's bytes (codes clamped to the dense ranges in code space, no dense row)
// against the oracle: int 2/3/4/8 bits symmetric and not, nuq 2/3/4, fp16 and f32 metadata,
// groups 32/64/128, k 1..4, continuous data with planted outliers and coarse data with ties;
// head_dim 64, 128 and 256 (four vectors per lean_quad call: 15 vectors = three calls and
// three vectors through the per-vector steps) and 96 (per-vector steps only).
TEST(OutlierQuant, LeanFusedPathMatchesOracle) {
  const DenseFmt fmts[] = {{kvq::Format::kInt, 2, false, kvq::MetaDType::kF16},
                    {kvq::Format::kInt, 3, false, kvq::MetaDType::kF16},
                    {kvq::Format::kInt, 3, true, kvq::MetaDType::kF16},
                    {kvq::Format::kInt, 4, false, kvq::MetaDType::kF32},
                    {kvq::Format::kInt, 4, true, kvq::MetaDType::kF32},
                    {kvq::Format::kInt, 8, false, kvq::MetaDType::kF16},
                    {kvq::Format::kNuq, 2, false, kvq::MetaDType::kF16},
                    {kvq::Format::kNuq, 3, false, kvq::MetaDType::kF32},
                    {kvq::Format::kNuq, 4, false, kvq::MetaDType::kF16}};
  int cases = 0;
  for (const DenseFmt& f : fmts)
    for (int64_t gc : {32, 64, 128})
      for (int64_t D : {64, 96, 128, 256})
        for (int k = 1; k <= 4; ++k) {
          if (D % gc != 0) continue;
          const kvq::Shape s{5, 3, D};  // 15 vectors
          kvq::QuantConfig cfg = make(f.f, f.bits, kvq::Axis::kToken, gc, k);
          cfg.symmetric = f.sym;
          cfg.meta = f.meta;
          if (f.f == kvq::Format::kNuq) {  // thresholds just inside [0, 1]: the u clamp matters
            const int n = 1 << f.bits;
            for (int i = 0; i < n; ++i)
              cfg.nuq_levels[static_cast<std::size_t>(i)] =
                  i == 0       ? 0.f
                  : i == n - 1 ? 1.f
                  : i == 1     ? 4e-4f
                  : i == n - 2 ? 1.f - 4e-4f
                               : static_cast<float>(i) / static_cast<float>(n - 1);
          }
          SCOPED_TRACE(cfg.name() + " " + s.str());
          std::vector<float> x = kvq_test::kv_data(s, 11 + static_cast<uint32_t>(k), true);
          for (std::size_t i = 5; i < x.size(); i += 53) x[i] *= 25.f;  // selected, clamped
          for (std::size_t i = 0; i < x.size(); i += 61) x[i] = i % 122 ? 0.f : -0.f;
          // 0: as drawn; 1: coarse (ties); 2: a large offset against a small spread, where the
          // fp16 zero point's rounding moves a group's dense range off codes 0 / qmax, so a
          // clamped outlier's code differs from its unclamped one.
          for (int coarse = 0; coarse < 3; ++coarse) {
            std::vector<float> xc = x;
            if (coarse == 1)
              for (float& v : xc) v = std::round(std::fmod(v, 3.f));
            if (coarse == 2)
              for (float& v : xc) v = 300.f + 0.02f * v;
            const kvq::KVView<const float> xv(xc.data(), s);
            const kvq::QTensor ref = kvq::reference::quantize_with_outliers(cfg, xv);
            const kvq::QTensor q = kvq::quantize(cfg, xv);
            EXPECT_EQ(q.codes, ref.codes) << coarse;
            EXPECT_EQ(q.scales.raw(), ref.scales.raw()) << coarse;
            EXPECT_EQ(q.zeros.raw(), ref.zeros.raw()) << coarse;
            EXPECT_EQ(q.outlier_values, ref.outlier_values) << coarse;
            EXPECT_EQ(q.outlier_pos, ref.outlier_pos) << coarse;
            ++cases;
          }
        }
  EXPECT_EQ(cases, 9 * (4 + 3 + 2) * 4 * 3);
}
#endif

// The channel axis (boxes of G tokens of one channel; the AVX2 path's float filter with the
// channels' statistics) gives the oracle's selection and dense part bit for bit on the same
// kinds of rows, every token of a block drawn in the same mode.
TEST(OutlierChannel, MatchesOracleBitForBit) {
  int cases = 0;
  for (int64_t D : {8, 64, 128, 136})
    for (int64_t G : {4, 8, 32})
      for (int64_t k : {1, 2, 3, 4}) {
        if (k > D) continue;
        for (uint32_t seed = 0; seed < 8; ++seed) {
          const int64_t T = 2 * G, H = 2;
          std::vector<float> x;
          for (int64_t v = 0; v < T * H; ++v) {
            // the mode (seed % 8 in tricky_row) is the same for every row of this tensor
            const std::vector<float> r =
                tricky_row(D, 8, seed + 8u * static_cast<uint32_t>(v + 1 + D + k));
            x.insert(x.end(), r.begin(), r.end());
          }
          const kvq::Shape s{T, H, D};
          const auto ref = kvq::reference::split_outliers(kvq::Axis::kChannel, G, k,
                                                          kvq::KVView<const float>(x.data(), s));
          std::vector<int32_t> sel(static_cast<std::size_t>(T * H * k));
          std::vector<float> vals(sel.size());
          kvq::OutlierScratch sc;
          kvq::isolate_outliers(s, kvq::Axis::kChannel, G, k, x.data(), sel.data(), vals.data(), sc);
          SCOPED_TRACE(::testing::Message() << "D=" << D << " G=" << G << " k=" << k
                                            << " seed=" << seed);
          EXPECT_EQ(sel, ref.sel);
          EXPECT_TRUE(same_bits(vals.data(), ref.vals.data(), vals.size()));
          EXPECT_TRUE(same_bits(x.data(), ref.dense.data(), x.size()));
          ++cases;
        }
      }
  EXPECT_GT(cases, 300);
}

// The fused token-axis path (every dense format, bits, symmetric/asymmetric, fp16/f32
// metadata, f32/f16/strided input) and the slab path of token-spanning axes give the oracle's
// bytes.
TEST(OutlierQuant, FusedAndSlabPathsMatchOracle) {
  const DenseFmt fmts[] = {{kvq::Format::kInt, 2, false, kvq::MetaDType::kF16},
                    {kvq::Format::kInt, 3, false, kvq::MetaDType::kF16},
                    {kvq::Format::kInt, 4, true, kvq::MetaDType::kF16},
                    {kvq::Format::kInt, 8, false, kvq::MetaDType::kF32},
                    {kvq::Format::kInt, 3, true, kvq::MetaDType::kF32},
                    {kvq::Format::kE4M3, 8, false, kvq::MetaDType::kF32},
                    {kvq::Format::kNuq, 3, false, kvq::MetaDType::kF16},
                    {kvq::Format::kNuq, 4, false, kvq::MetaDType::kF32}};
  struct G {
    kvq::Axis axis;
    int64_t group;
    kvq::Shape s;
    float pct;
    int out;
  };
  const G geos[] = {{kvq::Axis::kToken, 32, {40, 3, 128}, 1.f, 0},
                    {kvq::Axis::kToken, 16, {24, 2, 64}, 0.f, 3},
                    {kvq::Axis::kToken, 64, {8, 2, 64}, 0.f, 64},   // every entry an outlier
                    {kvq::Axis::kToken, 12, {8, 2, 36}, 0.f, 2},    // group not a multiple of 8
                    {kvq::Axis::kToken, 24, {8, 2, 96}, 0.f, 2},    // 8-multiple, not a power of 2
                    {kvq::Axis::kChannel, 32, {640, 2, 64}, 1.f, 0},  // several slabs
                    {kvq::Axis::kChannel, 16, {48, 2, 128}, 1.f, 0},  // k = 2
                    {kvq::Axis::kChannel, 8, {64, 3, 32}, 0.f, 4},    // k = 4
                    {kvq::Axis::kChannel, 4, {16, 1, 16}, 0.f, 16},   // every entry
                    {kvq::Axis::kHead, 16, {512, 4, 32}, 0.f, 2},
                    {kvq::Axis::kChannel, 1, {8200, 1, 5}, 0.f, 1}};  // slab alignment search
  for (const DenseFmt& f : fmts)
    for (const G& g : geos) {
      kvq::QuantConfig cfg = make(f.f, f.bits, g.axis, g.group, g.out, g.pct);
      cfg.symmetric = f.sym;
      cfg.meta = f.meta;
      if (f.f == kvq::Format::kE4M3 && g.axis == kvq::Axis::kChannel) continue;  // no per-channel fp8
      SCOPED_TRACE(cfg.name() + " " + g.s.str());
      std::vector<float> x = kvq_test::kv_data(g.s, 5, true);
      for (std::size_t i = 0; i < x.size(); i += 29) x[i] = i % 58 ? 0.f : -0.f;
      for (std::size_t i = 3; i < x.size(); i += 41) x[i] = 1.5f;  // ties
      const kvq::KVView<const float> xv(x.data(), g.s);
      const kvq::QTensor ref = kvq::reference::quantize_with_outliers(cfg, xv);
      auto expect_ref = [&](const kvq::QTensor& q, const char* what) {
        EXPECT_EQ(q.codes, ref.codes) << what;
        EXPECT_EQ(q.scales.raw(), ref.scales.raw()) << what;
        EXPECT_EQ(q.zeros.raw(), ref.zeros.raw()) << what;
        EXPECT_EQ(q.outlier_values, ref.outlier_values) << what;
        EXPECT_EQ(q.outlier_pos, ref.outlier_pos) << what;
      };
      expect_ref(kvq::quantize(cfg, xv), "f32");
      // Few distinct values: many exactly equal scores (ties broken by the lower channel).
      std::vector<float> xc(x.size());
      for (std::size_t i = 0; i < x.size(); ++i) xc[i] = std::round(std::fmod(x[i], 3.f));
      const kvq::KVView<const float> cv(xc.data(), g.s);
      const kvq::QTensor refc = kvq::reference::quantize_with_outliers(cfg, cv);
      const kvq::QTensor qc = kvq::quantize(cfg, cv);
      EXPECT_EQ(qc.codes, refc.codes) << "coarse";
      EXPECT_EQ(qc.scales.raw(), refc.scales.raw()) << "coarse";
      EXPECT_EQ(qc.outlier_values, refc.outlier_values) << "coarse";
      EXPECT_EQ(qc.outlier_pos, refc.outlier_pos) << "coarse";
      // f16 input: the oracle on the same f16 values.
      std::vector<kvq::f16> xh(x.size());
      kvq::convert(x.data(), xh.data(), x.size());
      const kvq::KVView<const kvq::f16> hv(xh.data(), g.s);
      const kvq::QTensor refh = kvq::reference::quantize_with_outliers(cfg, hv);
      const kvq::QTensor qh = kvq::quantize(cfg, hv);
      EXPECT_EQ(qh.codes, refh.codes);
      EXPECT_EQ(qh.outlier_values, refh.outlier_values);
      EXPECT_EQ(qh.outlier_pos, refh.outlier_pos);
      // Strided (HND) input.
      std::vector<float> hnd(x.size());
      const int64_t T = g.s.tokens, H = g.s.heads, D = g.s.head_dim;
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t d = 0; d < D; ++d)
            hnd[static_cast<std::size_t>((h * T + t) * D + d)] =
                x[static_cast<std::size_t>((t * H + h) * D + d)];
      const kvq::KVView<const float> sv(hnd.data(), g.s, kvq::Strides{D, T * D, 1});
      expect_ref(kvq::quantize(cfg, sv), "strided");
    }
}

// Errors are those of the whole-tensor order: a NaN anywhere is reported before an fp16 range
// error in an earlier vector, and a range error before a metadata overflow.
TEST(OutlierQuant, ErrorOrderOfTheWholeTensorPath) {
  const kvq::Shape s{16, 2, 64};
  auto at = [](int64_t t, int64_t h, int64_t d) { return static_cast<std::size_t>((t * 2 + h) * 64 + d); };
  for (kvq::Axis axis : {kvq::Axis::kToken, kvq::Axis::kChannel}) {
    SCOPED_TRACE(kvq::to_string(axis));
    const auto cfg = make(kvq::Format::kInt, 3, axis, axis == kvq::Axis::kToken ? 32 : 16, 1);
    auto expect_error = [&](const std::vector<float>& v, kvq::ErrorKind kind, const char* what) {
      try {
        kvq::quantize(cfg, kvq::KVView<const float>(v.data(), s));
        FAIL() << "no throw, expected " << what;
      } catch (const kvq::Error& e) {
        EXPECT_EQ(e.kind(), kind) << e.what();
        EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
      }
    };
    std::vector<float> x = kvq_test::kv_data(s, 3, false);
    x[at(0, 0, 5)] = 1e6f;  // vector 0: its outlier, which fp16 cannot store
    x[at(3, 1, 7)] = NAN;   // a later vector
    expect_error(x, kvq::ErrorKind::kNonFinite, "token=3, head=1, channel=7");
    x[at(3, 1, 7)] = 1.f;
    // A group below fp16's range that is not an outlier: the dense part's zero point overflows
    // fp16 metadata. Token axis: vector (9, 0) at -70000 except its outlier (-60000, which
    // fp16 holds); channel axis: channel 30 of head 0 at -70000 in every token (score 0).
    if (axis == kvq::Axis::kToken) {
      for (int64_t d = 0; d < 64; ++d) x[at(9, 0, d)] = -70000.f;
      x[at(9, 0, 20)] = -60000.f;
    } else {
      for (int64_t t = 0; t < 16; ++t) x[at(t, 0, 30)] = -70000.f;
    }
    expect_error(x, kvq::ErrorKind::kOutOfRange, "outlier (token=0, head=0, channel=5)");
    x[at(0, 0, 5)] = 1.f;
    expect_error(x, kvq::ErrorKind::kOutOfRange, "metadata");
    // Each error alone, inside a block of four vectors (the token axis' lean_quad calls).
    x = kvq_test::kv_data(s, 3, false);
    x[at(3, 0, 9)] = -1e6f;  // vector 6
    expect_error(x, kvq::ErrorKind::kOutOfRange, "outlier (token=3, head=0, channel=9)");
    x[at(3, 0, 9)] = 1.f;
    x[at(5, 1, 3)] = -INFINITY;  // vector 11
    expect_error(x, kvq::ErrorKind::kNonFinite, "token=5, head=1, channel=3");
  }
}

}  // namespace
