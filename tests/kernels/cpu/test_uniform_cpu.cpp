// simd/uniform_cpu.hpp called directly, against the scalar formulas of
// reference/uniform_ref.hpp (std::fma, fmin/fmax clamp, std::nearbyint) and format/uniform.hpp's
// uniform_params: every length 0..70 and longer ones (SIMD bodies of 8/16/32 plus scalar tails),
// a non-finite value at every position, rounding ties, zero-range and subnormal-scale groups,
// fp16 metadata overflow, and the whole-row per-token kernel for every group count it accepts.
// The SIMD level is the one this build compiles (kvq::simd_level()); KVQ_TEST_SCALAR_TOO builds
// the same file with KVQ_NO_SIMD, so the scalar fallbacks are held to the same oracles.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kvq/core/bitpack.hpp"
#include "kvq/core/half.hpp"
#include "kvq/format/uniform.hpp"
#include "kvq/simd/uniform_cpu.hpp"
#include "kvq/quant/packed_view.hpp"

namespace {

namespace kk = kvq::kernels;
using kvq::MetaDType;

uint32_t fbits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

/// reference/uniform_ref.hpp's code formula, written out.
uint8_t ref_encode(float x, float z, float inv, float off, float qmax) {
  float v = std::fma(x - z, inv, off);
  v = std::fmin(std::fmax(v, 0.f), qmax);
  return static_cast<uint8_t>(std::nearbyint(v));
}
float ref_decode(uint8_t c, float s, float z, float off) {
  return std::fma(static_cast<float>(c) - off, s, z);
}

const int kLengths[] = {0,  1,  2,  3,  5,  7,  8,  9,  15, 16, 17, 23, 24, 25, 31, 32, 33,
                        39, 40, 47, 48, 63, 64, 65, 70, 96, 127, 128, 129, 200, 255, 1000};

std::vector<float> random_values(int n, uint32_t seed, float spread = 3.f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, spread);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) {
    v[static_cast<std::size_t>(i)] = nd(rng);
    if (i % 11 == 5) v[static_cast<std::size_t>(i)] = 0.f;
    if (i % 13 == 7) v[static_cast<std::size_t>(i)] = -0.f;
  }
  return v;
}

const float kNonFinite[] = {std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity()};

TEST(UniformCpu, MinmaxEqualsScalarForEveryLength) {
  for (int n : kLengths) {
    const auto x = random_values(n, 100 + static_cast<uint32_t>(n));
    for (float start : {std::numeric_limits<float>::infinity(), -0.25f}) {
      float lo = start, hi = -start, rlo = start, rhi = -start;
      for (float v : x) {
        rlo = std::fmin(rlo, v);
        rhi = std::fmax(rhi, v);
      }
      ASSERT_TRUE(kk::minmax(x.data(), n, lo, hi)) << "n=" << n;
      // == (not bits): which zero a group's minimum keeps is not part of the contract; the
      // parameters canonicalize it (uniform_params adds +0).
      ASSERT_EQ(lo, rlo) << "n=" << n;
      ASSERT_EQ(hi, rhi) << "n=" << n;
    }
  }
}

TEST(UniformCpu, MinmaxFlagsNonFiniteAtEveryPosition) {
  for (int n : kLengths) {
    if (n == 0 || n > 129) continue;
    for (int p = 0; p < n; ++p)
      for (float bad : kNonFinite) {
        auto x = random_values(n, 7);
        x[static_cast<std::size_t>(p)] = bad;
        float lo = std::numeric_limits<float>::infinity(), hi = -lo;
        ASSERT_FALSE(kk::minmax(x.data(), n, lo, hi)) << "n=" << n << " p=" << p << " " << bad;
        std::vector<float> elo(x.size(), lo), ehi(x.size(), hi);
        ASSERT_FALSE(kk::minmax_elementwise(x.data(), elo.data(), ehi.data(), n))
            << "n=" << n << " p=" << p << " " << bad;
      }
  }
}

TEST(UniformCpu, MinmaxElementwiseEqualsScalar) {
  for (int n : kLengths) {
    const auto a = random_values(n, 1), b = random_values(n, 2);
    std::vector<float> lo(a), hi(a), rlo(a), rhi(a);
    ASSERT_TRUE(kk::minmax_elementwise(b.data(), lo.data(), hi.data(), n));
    for (int i = 0; i < n; ++i) {
      const auto k = static_cast<std::size_t>(i);
      ASSERT_EQ(lo[k], std::fmin(rlo[k], b[k])) << "n=" << n << " i=" << i;
      ASSERT_EQ(hi[k], std::fmax(rhi[k], b[k])) << "n=" << n << " i=" << i;
    }
  }
}

struct Fmt {
  int bits;
  bool symmetric;
};
const Fmt kFormats[] = {{2, false}, {3, false}, {4, false}, {8, false},
                        {2, true},  {3, true},  {4, true},  {8, true}};

TEST(UniformCpu, EncodeAndDecodeRunsEqualScalarFormulas) {
  for (const Fmt f : kFormats) {
    const kvq::UniformLevels lv = kvq::uniform_levels(f.bits, f.symmetric);
    for (MetaDType meta : {MetaDType::kF16, MetaDType::kF32}) {
      for (int n : kLengths) {
        const std::string what = "bits=" + std::to_string(f.bits) +
                                 (f.symmetric ? " sym" : " asym") + " meta=" +
                                 kvq::to_string(meta) + " n=" + std::to_string(n);
        const auto x = random_values(n, 300 + static_cast<uint32_t>(n) + f.bits);
        float lo = std::numeric_limits<float>::infinity(), hi = -lo;
        for (float v : x) lo = std::fmin(lo, v), hi = std::fmax(hi, v);
        if (n == 0) lo = hi = 0.f;
        const kvq::UniformParams p = kvq::uniform_params(lo, hi, f.bits, f.symmetric, meta, 0);
        // one (z, inv) for the run
        std::vector<uint8_t> c(static_cast<std::size_t>(n) + 1, 0xAB);
        kk::encode_run(x.data(), n, p.zero, p.inv, lv.off, lv.qmax, c.data());
        for (int i = 0; i < n; ++i)
          ASSERT_EQ(c[static_cast<std::size_t>(i)],
                    ref_encode(x[static_cast<std::size_t>(i)], p.zero, p.inv, lv.off, lv.qmax))
              << what << " i=" << i;
        ASSERT_EQ(c[static_cast<std::size_t>(n)], 0xAB) << what << ": wrote past the run";
        // per-element (z, inv): a different scale every 5 elements
        std::vector<float> zv(x.size()), iv(x.size()), sv(x.size());
        for (int i = 0; i < n; ++i) {
          const auto k = static_cast<std::size_t>(i);
          const float w = 1.f + static_cast<float>(i / 5) * 0.37f;
          const kvq::UniformParams q =
              kvq::uniform_params(lo * w, hi / w, f.bits, f.symmetric, meta, 0);
          zv[k] = q.zero;
          iv[k] = q.inv;
          sv[k] = q.scale;
        }
        std::vector<uint8_t> cv(static_cast<std::size_t>(n) + 1, 0xAB);
        kk::encode_run_vec(x.data(), zv.data(), iv.data(), n, lv.off, lv.qmax, cv.data());
        for (int i = 0; i < n; ++i) {
          const auto k = static_cast<std::size_t>(i);
          ASSERT_EQ(cv[k], ref_encode(x[k], zv[k], iv[k], lv.off, lv.qmax)) << what << " i=" << i;
        }
        ASSERT_EQ(cv[static_cast<std::size_t>(n)], 0xAB) << what << ": wrote past the run";
        // decode: f32 and straight to fp16, one and per-element parameters
        std::vector<float> y(static_cast<std::size_t>(n) + 1, -7.f), yv(y);
        std::vector<uint16_t> h(static_cast<std::size_t>(n) + 1, 0x5555), hv(h);
        kk::decode_run(c.data(), n, p.scale, p.zero, lv.off, y.data());
        kk::decode_run_vec(cv.data(), sv.data(), zv.data(), n, lv.off, yv.data());
        kk::decode_run_f16<false>(c.data(), n, &p.scale, &p.zero, lv.off, h.data());
        kk::decode_run_f16<true>(cv.data(), n, sv.data(), zv.data(), lv.off, hv.data());
        for (int i = 0; i < n; ++i) {
          const auto k = static_cast<std::size_t>(i);
          const float r = ref_decode(c[k], p.scale, p.zero, lv.off);
          const float rv = ref_decode(cv[k], sv[k], zv[k], lv.off);
          ASSERT_EQ(fbits(y[k]), fbits(r)) << what << " i=" << i;
          ASSERT_EQ(fbits(yv[k]), fbits(rv)) << what << " i=" << i;
          ASSERT_EQ(h[k], kvq::float_to_half_bits(r)) << what << " i=" << i;
          ASSERT_EQ(hv[k], kvq::float_to_half_bits(rv)) << what << " i=" << i;
        }
        ASSERT_EQ(fbits(y[static_cast<std::size_t>(n)]), fbits(-7.f)) << what;
        ASSERT_EQ(fbits(yv[static_cast<std::size_t>(n)]), fbits(-7.f)) << what;
        ASSERT_EQ(h[static_cast<std::size_t>(n)], 0x5555) << what;
        ASSERT_EQ(hv[static_cast<std::size_t>(n)], 0x5555) << what;
      }
    }
  }
}

TEST(UniformCpu, EncodeRoundsTiesToEvenAndClamps) {
  // z = 0, inv = 1: fma(x, 1, off) is exact, so x = k + 0.5 is an exact tie.
  for (const Fmt f : kFormats) {
    const kvq::UniformLevels lv = kvq::uniform_levels(f.bits, f.symmetric);
    std::vector<float> x;
    for (float k = -4.f; k <= lv.qmax + 4.f; k += 0.25f) x.push_back(k - lv.off);
    x.push_back(1e30f);
    x.push_back(-1e30f);
    const int n = static_cast<int>(x.size());
    std::vector<uint8_t> c(x.size());
    kk::encode_run(x.data(), n, 0.f, 1.f, lv.off, lv.qmax, c.data());
    for (int i = 0; i < n; ++i) {
      const auto k = static_cast<std::size_t>(i);
      ASSERT_EQ(c[k], ref_encode(x[k], 0.f, 1.f, lv.off, lv.qmax))
          << "bits=" << f.bits << " x=" << x[k];
    }
  }
}

#if KVQ_ROW_TOKEN_KERNEL
/// Scalar twin of quantize_row_token: per group uniform_params, metadata through store_meta,
/// codes by the reference formula.
struct RowOracle {
  std::vector<uint8_t> scales, zeros, codes;
};
RowOracle row_oracle(const std::vector<float>& row, int64_t gc, int bits, bool sym,
                     MetaDType meta) {
  const kvq::UniformLevels lv = kvq::uniform_levels(bits, sym);
  const auto D = static_cast<int64_t>(row.size());
  const auto ng = static_cast<std::size_t>(D / gc);
  const auto mb = static_cast<std::size_t>(kvq::meta_size(meta));
  RowOracle o{std::vector<uint8_t>(ng * mb), std::vector<uint8_t>(sym ? 0 : ng * mb),
              std::vector<uint8_t>(row.size())};
  for (std::size_t g = 0; g < ng; ++g) {
    float lo = std::numeric_limits<float>::infinity(), hi = -lo;
    for (int64_t k = 0; k < gc; ++k) {
      const float v = row[g * static_cast<std::size_t>(gc) + static_cast<std::size_t>(k)];
      lo = std::fmin(lo, v);
      hi = std::fmax(hi, v);
    }
    const kvq::UniformParams p = kvq::uniform_params(lo, hi, bits, sym, meta, 0);
    kvq::detail::store_meta(o.scales.data(), meta, g, p.scale);
    if (!sym) kvq::detail::store_meta(o.zeros.data(), meta, g, p.zero);
    for (int64_t k = 0; k < gc; ++k) {
      const std::size_t i = g * static_cast<std::size_t>(gc) + static_cast<std::size_t>(k);
      o.codes[i] = ref_encode(row[i], p.zero, p.inv, lv.off, lv.qmax);
    }
  }
  return o;
}

TEST(UniformCpu, RowTokenKernelEqualsPerGroupScalar) {
  const int64_t m = kk::kRowTokenGroupMultiple;
  for (int64_t gc : {m, 2 * m, 3 * m, 4 * m, 5 * m})
    for (int64_t ng = 1; ng <= kk::kRowTokenMaxGroups; ++ng)
      for (const Fmt f : kFormats)
        for (MetaDType meta : {MetaDType::kF16, MetaDType::kF32})
          for (int variant = 0; variant < 3; ++variant) {
            const int64_t D = gc * ng;
            auto row = random_values(static_cast<int>(D), static_cast<uint32_t>(D * 7 + f.bits));
            if (variant == 1) {  // zero-range groups: all equal (group 0 all zero)
              for (int64_t i = 0; i < D; ++i)
                row[static_cast<std::size_t>(i)] = static_cast<float>(i / gc) * 0.75f;
            } else if (variant == 2) {  // tiny ranges: subnormal f32 scales, fp16 underflow
              for (auto& v : row) v *= 1e-40f;
            }
            const std::string what = "gc=" + std::to_string(gc) + " ng=" + std::to_string(ng) +
                                     " bits=" + std::to_string(f.bits) + (f.symmetric ? " sym" : "") +
                                     " meta=" + kvq::to_string(meta) + " v" + std::to_string(variant);
            const RowOracle o = row_oracle(row, gc, f.bits, f.symmetric, meta);
            const kvq::UniformLevels lv = kvq::uniform_levels(f.bits, f.symmetric);
            const std::size_t mb = static_cast<std::size_t>(kvq::meta_size(meta));
            // one sentinel slot past the row's metadata and codes
            std::vector<uint8_t> sc(o.scales.size() + mb, 0xCD), zr(o.scales.size() + mb, 0xCD);
            std::vector<uint8_t> codes(row.size() + 8, 0xEE);
            ASSERT_TRUE(kk::quantize_row_token(row.data(), D, gc, f.bits, f.symmetric,
                                               meta == MetaDType::kF16, lv.off, lv.qmax, sc.data(),
                                               f.symmetric ? nullptr : zr.data(), codes.data()))
                << what;
            ASSERT_EQ(std::vector<uint8_t>(sc.begin(), sc.end() - static_cast<long>(mb)), o.scales)
                << what;
            for (std::size_t k = o.scales.size(); k < sc.size(); ++k) ASSERT_EQ(sc[k], 0xCD) << what;
            if (!f.symmetric) {
              ASSERT_EQ(std::vector<uint8_t>(zr.begin(), zr.end() - static_cast<long>(mb)), o.zeros)
                  << what;
              for (std::size_t k = o.zeros.size(); k < zr.size(); ++k) ASSERT_EQ(zr[k], 0xCD) << what;
            }
            ASSERT_EQ(std::vector<uint8_t>(codes.begin(), codes.begin() + D), o.codes) << what;
            for (std::size_t k = row.size(); k < codes.size(); ++k) ASSERT_EQ(codes[k], 0xEE) << what;
            if (f.bits == 4) {  // packed nibbles straight from the kernel
              std::vector<uint8_t> packed(row.size() / 2 + 4, 0x77), want(row.size() / 2, 0);
              kvq::pack_bits(o.codes.data(), row.size(), 4, want.data());
              ASSERT_TRUE(kk::quantize_row_token(row.data(), D, gc, 4, f.symmetric,
                                                 meta == MetaDType::kF16, lv.off, lv.qmax,
                                                 sc.data(), f.symmetric ? nullptr : zr.data(),
                                                 nullptr, packed.data()))
                  << what;
              ASSERT_EQ(std::vector<uint8_t>(packed.begin(), packed.begin() + D / 2), want) << what;
              for (std::size_t k = row.size() / 2; k < packed.size(); ++k)
                ASSERT_EQ(packed[k], 0x77) << what;
            }
          }
}

TEST(UniformCpu, RowTokenKernelRefusesWhatTheScalarPathRejects) {
  const int64_t gc = 2 * kk::kRowTokenGroupMultiple, D = gc * 3;
  const kvq::UniformLevels lv = kvq::uniform_levels(4, false);
  std::vector<uint8_t> sc(16, 0xCD), zr(16, 0xCD), codes(static_cast<std::size_t>(D));
  for (int64_t p = 0; p < D; ++p)
    for (float bad : kNonFinite) {
      auto row = random_values(static_cast<int>(D), 3);
      row[static_cast<std::size_t>(p)] = bad;
      ASSERT_FALSE(kk::quantize_row_token(row.data(), D, gc, 4, false, true, lv.off, lv.qmax,
                                          sc.data(), zr.data(), codes.data()))
          << "p=" << p << " " << bad;
    }
  for (uint8_t b : sc) ASSERT_EQ(b, 0xCD) << "metadata written on refusal";
  // A range beyond fp16: refused with fp16 metadata (zero point, then scale), fine with f32.
  for (bool sym : {false, true}) {
    auto row = random_values(static_cast<int>(D), 4);
    row[static_cast<std::size_t>(gc + 3)] = 1e6f;
    row[static_cast<std::size_t>(gc + 4)] = -1e6f;
    const kvq::UniformLevels l = kvq::uniform_levels(4, sym);
    EXPECT_FALSE(kk::quantize_row_token(row.data(), D, gc, 4, sym, true, l.off, l.qmax, sc.data(),
                                        sym ? nullptr : zr.data(), codes.data()));
    EXPECT_TRUE(kk::quantize_row_token(row.data(), D, gc, 4, sym, false, l.off, l.qmax, sc.data(),
                                       sym ? nullptr : zr.data(), codes.data()));
  }
}

TEST(UniformCpu, ParamsArrayEqualsUniformParams) {
  for (int n = 1; n <= 40; ++n)
    for (const Fmt f : kFormats)
      for (MetaDType meta : {MetaDType::kF16, MetaDType::kF32}) {
        auto lo = random_values(n, 50 + static_cast<uint32_t>(n), 2.f);
        std::vector<float> hi(lo.size());
        for (int i = 0; i < n; ++i) {
          const auto k = static_cast<std::size_t>(i);
          hi[k] = lo[k] + (i % 4 == 0 ? 0.f : std::fabs(lo[k]) + 0.5f * static_cast<float>(i));
          if (i % 7 == 3) lo[k] = hi[k] = -0.f;        // all-zero group
          if (i % 9 == 4) lo[k] *= 1e-41f, hi[k] *= 1e-41f;  // subnormal range
        }
        const std::size_t mb = static_cast<std::size_t>(kvq::meta_size(meta));
        std::vector<uint8_t> sc((lo.size() + 1) * mb, 0xCD), zr(sc);
        std::vector<float> zv(lo.size() + 1, 9.f), iv(lo.size() + 1, 9.f);
        ASSERT_TRUE(kk::uniform_params_array(lo.data(), hi.data(), n, f.bits, f.symmetric,
                                             meta == MetaDType::kF16,
                                             kvq::uniform_levels(f.bits, f.symmetric).qmax,
                                             sc.data(), f.symmetric ? nullptr : zr.data(),
                                             zv.data(), iv.data()));
        for (int i = 0; i < n; ++i) {
          const auto k = static_cast<std::size_t>(i);
          const kvq::UniformParams p = kvq::uniform_params(lo[k], hi[k], f.bits, f.symmetric, meta, i);
          const std::string what = "n=" + std::to_string(n) + " i=" + std::to_string(i) +
                                   " bits=" + std::to_string(f.bits) + (f.symmetric ? " sym" : "") +
                                   " meta=" + kvq::to_string(meta);
          ASSERT_EQ(fbits(kvq::detail::load_meta(sc.data(), meta, k)), fbits(p.scale)) << what;
          if (!f.symmetric) {
            ASSERT_EQ(fbits(kvq::detail::load_meta(zr.data(), meta, k)), fbits(p.zero)) << what;
          }
          ASSERT_EQ(fbits(zv[k]), fbits(p.zero)) << what;
          ASSERT_EQ(fbits(iv[k]), fbits(p.inv)) << what;
        }
        for (std::size_t k = static_cast<std::size_t>(n) * mb; k < sc.size(); ++k)
          ASSERT_EQ(sc[k], 0xCD) << "n=" << n << ": metadata written past the groups";
        ASSERT_EQ(zv[static_cast<std::size_t>(n)], 9.f);
        ASSERT_EQ(iv[static_cast<std::size_t>(n)], 9.f);
      }
}
#else
TEST(UniformCpu, RowTokenKernelNotCompiledIn) {
  GTEST_SKIP() << "no whole-row kernel at SIMD level " << kvq::simd_level();
}
#endif

}  // namespace
