// fp16 / bf16 conversions: exhaustive over all 65536 half values both ways; scalar vs bulk
// (F16C/AVX-512) vs an independent arithmetic oracle. KVQ_TEST_SCALAR_TOO
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kvq/core/half.hpp"

namespace {

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Independent oracle: value of a half computed with ldexp.
double half_value(uint16_t h) {
  const int e = (h >> 10) & 31, m = h & 1023;
  const double sign = (h & 0x8000) ? -1.0 : 1.0;
  if (e == 0) return sign * std::ldexp(m, -24);
  if (e == 31) return m ? std::numeric_limits<double>::quiet_NaN()
                        : sign * std::numeric_limits<double>::infinity();
  return sign * std::ldexp(1024 + m, e - 25);
}

TEST(Half, AllHalvesToFloatExact) {
  std::vector<kvq::f16> h(65536);
  std::vector<float> bulk(65536);
  for (uint32_t i = 0; i < 65536; ++i) h[i].bits = static_cast<uint16_t>(i);
  kvq::convert(h.data(), bulk.data(), h.size());
  for (uint32_t i = 0; i < 65536; ++i) {
    const float s = kvq::half_bits_to_float(static_cast<uint16_t>(i));
    const double ref = half_value(static_cast<uint16_t>(i));
    if (std::isnan(ref)) {
      ASSERT_TRUE(std::isnan(s)) << i;
      // quiet NaN with the payload kept
      ASSERT_EQ(bits_of(s), (i & 0x8000u) << 16 | 0x7fc00000u | ((i & 0x3ffu) << 13)) << i;
    } else {
      ASSERT_EQ(static_cast<double>(s), ref) << i;
      ASSERT_EQ(std::signbit(s), (i & 0x8000) != 0) << i;
    }
    ASSERT_EQ(bits_of(bulk[i]), bits_of(s)) << "bulk vs scalar at half 0x" << std::hex << i;
  }
}

TEST(Half, AllHalvesRoundTrip) {
  for (uint32_t i = 0; i < 65536; ++i) {
    const float f = kvq::half_bits_to_float(static_cast<uint16_t>(i));
    const uint16_t back = kvq::float_to_half_bits(f);
    if (std::isnan(f)) {
      ASSERT_EQ(back, static_cast<uint16_t>(i | 0x200)) << i;  // quieted
    } else {
      ASSERT_EQ(back, i) << i;
    }
  }
}

// Float -> half rounding: every midpoint between consecutive halves, and the points just
// beside them, checked against the tie-to-even rule computed in double.
TEST(Half, MidpointsRoundToNearestEven) {
  for (uint32_t i = 0; i < 0x7c00; ++i) {
    const double a = half_value(static_cast<uint16_t>(i));
    const double b = (i + 1 == 0x7c00) ? 65536.0 : half_value(static_cast<uint16_t>(i + 1));
    const float mid = static_cast<float>((a + b) / 2);  // exact in float
    const uint16_t expect_mid = (i & 1) ? static_cast<uint16_t>(i + 1) : static_cast<uint16_t>(i);
    ASSERT_EQ(kvq::float_to_half_bits(mid), expect_mid) << i;
    ASSERT_EQ(kvq::float_to_half_bits(-mid), expect_mid | 0x8000) << i;
    ASSERT_EQ(kvq::float_to_half_bits(std::nextafter(mid, 0.f)), i) << i;
    ASSERT_EQ(kvq::float_to_half_bits(std::nextafter(mid, 1e9f)), i + 1) << i;
  }
}

TEST(Half, BulkMatchesScalarOnRandomFloats) {
  std::mt19937 rng(7);
  std::vector<float> x(100003);
  for (auto& v : x) v = float_of(rng());  // every bit pattern class, incl. NaN/inf/subnormal
  std::vector<kvq::f16> h(x.size());
  std::vector<kvq::bf16> b(x.size());
  kvq::convert(x.data(), h.data(), x.size());
  kvq::convert(x.data(), b.data(), x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(h[i].bits, kvq::float_to_half_bits(x[i])) << std::hex << bits_of(x[i]);
    ASSERT_EQ(b[i].bits, kvq::float_to_bf16_bits(x[i])) << std::hex << bits_of(x[i]);
  }
}

TEST(Half, EdgeCases) {
  EXPECT_EQ(kvq::float_to_half_bits(65504.f), 0x7bff);
  EXPECT_EQ(kvq::float_to_half_bits(65519.99f), 0x7bff);
  EXPECT_EQ(kvq::float_to_half_bits(65520.f), 0x7c00);
  EXPECT_EQ(kvq::float_to_half_bits(-1e9f), 0xfc00);
  EXPECT_EQ(kvq::float_to_half_bits(-0.f), 0x8000);
  EXPECT_EQ(kvq::float_to_half_bits(std::ldexp(1.f, -24)), 0x0001);
  EXPECT_EQ(kvq::float_to_half_bits(std::ldexp(1.f, -25)), 0x0000);  // tie to even
  EXPECT_EQ(kvq::float_to_half_bits(std::ldexp(3.f, -25)), 0x0002);  // tie to even (up)
  EXPECT_EQ(kvq::float_to_half_bits(std::numeric_limits<float>::infinity()), 0x7c00);
}

TEST(BF16, AllBf16ToFloatAndBack) {
  std::vector<kvq::bf16> b(65536);
  std::vector<float> f(65536);
  for (uint32_t i = 0; i < 65536; ++i) b[i].bits = static_cast<uint16_t>(i);
  kvq::convert(b.data(), f.data(), b.size());
  for (uint32_t i = 0; i < 65536; ++i) {
    ASSERT_EQ(bits_of(f[i]), i << 16) << i;
    ASSERT_EQ(bits_of(kvq::bf16_bits_to_float(static_cast<uint16_t>(i))), i << 16);
    const uint16_t back = kvq::float_to_bf16_bits(f[i]);
    if (std::isnan(f[i])) {
      ASSERT_EQ(back, static_cast<uint16_t>(i | 0x40)) << i;
    } else {
      ASSERT_EQ(back, i) << i;
    }
  }
}

TEST(BF16, RoundsToNearestEvenIncludingSubnormals) {
  // 1 + 2^-8 is the midpoint between 1 and 1 + 2^-7: ties to even (1.0).
  EXPECT_EQ(kvq::float_to_bf16_bits(1.0f + std::ldexp(1.f, -8)), 0x3f80);
  EXPECT_EQ(kvq::float_to_bf16_bits(1.0f + 3 * std::ldexp(1.f, -8)), 0x3f82);
  EXPECT_EQ(kvq::float_to_bf16_bits(float_of(0x00018000u)), 0x0002);  // subnormal tie up
  EXPECT_EQ(kvq::float_to_bf16_bits(float_of(0x00008000u)), 0x0000);  // subnormal tie down
  EXPECT_EQ(kvq::float_to_bf16_bits(float_of(0x7f7fffffu)), 0x7f80);   // overflow to inf
}

}  // namespace

namespace {
TEST(Half, ScalarFastPathsMatch) {
  for (uint32_t i = 0; i < 65536; ++i) {
    const float a = kvq::half_bits_to_float(static_cast<uint16_t>(i));
    const float b = kvq::half_bits_to_float_fast(static_cast<uint16_t>(i));
    ASSERT_EQ(bits_of(a), bits_of(b)) << i;
  }
  std::mt19937 rng(3);
  for (int i = 0; i < 200000; ++i) {
    const float f = float_of(rng());
    ASSERT_EQ(kvq::float_to_half_bits(f), kvq::float_to_half_bits_fast(f)) << std::hex << bits_of(f);
  }
}
}  // namespace
