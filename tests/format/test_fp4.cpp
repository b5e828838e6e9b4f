// FP4 formats (format/fp4.hpp): e2m1 and e8m0 bit for bit against CUDA's host conversions
// (cuda_fp4.h / cuda_fp8.h, when the toolkit is installed) and against the independent scalar
// oracle (reference/fp4_ref.hpp), over a stated sweep of float32 inputs (every sign and
// exponent, the top 12 mantissa bits, and low-bit patterns that sit on and next to every
// rounding boundary); the NVFP4 and MXFP4 block rules against the oracle over random,
// adversarial and hand-decoded blocks. tests/format/test_fp4_exhaustive.cpp covers all 2^32
// inputs.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "kvq/core/half.hpp"
#include "kvq/format/fp4.hpp"
#include "kvq/reference/fp4_ref.hpp"

#if defined(KVQ_HAVE_CUDA_FP8_H) && defined(__has_include)
#if __has_include(<cuda_fp4.h>)
#include <cuda_fp4.h>
#include <cuda_fp8.h>
#define KVQ_TEST_CUDA_FP4 1
#endif
#endif
#ifndef KVQ_TEST_CUDA_FP4
#define KVQ_TEST_CUDA_FP4 0
#endif

namespace {

using kvq::detail::bits_f32;
using kvq::detail::f32_bits;

/// The sweep: for every sign and exponent, 4096 mantissas (the top 12 bits) with low bits
/// 0, 1, and all-ones, plus every mantissa near the e2m1 rounding boundaries (+-2 around each
/// of the midpoints in its exponent).
std::vector<uint32_t> sweep() {
  std::vector<uint32_t> v;
  for (uint32_t se = 0; se < 512; ++se)
    for (uint32_t hi = 0; hi < 4096; ++hi)
      for (uint32_t lo : {0u, 1u, 0x7ffu})
        v.push_back((se << 23) | (hi << 11) | lo);
  for (double mid : {0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 1.0, 0.5, 4.0})
    for (double sg : {1.0, -1.0}) {
      const uint32_t b = f32_bits(static_cast<float>(sg * mid));
      for (int d = -2; d <= 2; ++d) v.push_back(b + static_cast<uint32_t>(d));
    }
  return v;
}

TEST(Fp4, E2M1MatchesTheOracleOverTheSweep) {
  uint64_t bad = 0;
  for (uint32_t u : sweep()) {
    const float x = bits_f32(u);
    const uint8_t got = kvq::fp4::encode_e2m1(x), want = kvq::reference::e2m1_encode(x);
    if (got != want && ++bad <= 5) ADD_FAILURE() << std::hex << "x=0x" << u << " got 0x" << int(got) << " oracle 0x" << int(want);
  }
  EXPECT_EQ(bad, 0u);
}

TEST(Fp4, E2M1NamedValues) {
  struct Case {
    float x;
    uint8_t code;
  };
  // Hand-decoded: magnitudes 0 0.5 1 1.5 2 3 4 6 are codes 0..7; ties go to the even code.
  const Case cases[] = {{0.f, 0x0},   {-0.f, 0x8},  {0.25f, 0x0}, {0.2500001f, 0x1}, {-0.25f, 0x8},
                        {0.5f, 0x1},  {0.75f, 0x2}, {1.25f, 0x2}, {1.75f, 0x4},      {2.5f, 0x4},
                        {3.5f, 0x6},  {5.f, 0x6},   {5.0001f, 0x7}, {6.f, 0x7},      {7.f, 0x7},
                        {-7.f, 0xf},  {1e30f, 0x7}, {-3.f, 0xd},  {-1e-30f, 0x8},
                        {std::numeric_limits<float>::infinity(), 0x7},
                        {-std::numeric_limits<float>::infinity(), 0xf},
                        {std::numeric_limits<float>::quiet_NaN(), 0x7},
                        {-std::numeric_limits<float>::quiet_NaN(), 0x7}};
  for (const Case& c : cases) EXPECT_EQ(int(kvq::fp4::encode_e2m1(c.x)), int(c.code)) << c.x;
  const float values[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
  for (int i = 0; i < 16; ++i) {
    const float v = kvq::fp4::decode_e2m1(static_cast<uint8_t>(i));
    EXPECT_EQ(f32_bits(v), f32_bits(i < 8 ? values[i] : -values[i - 8])) << i;
    EXPECT_EQ(static_cast<double>(v), kvq::reference::e2m1_value(static_cast<uint8_t>(i)));
    EXPECT_EQ(kvq::fp4::encode_e2m1(v), i) << "round trip of code " << i;
  }
}

TEST(Fp4, E8M0MatchesTheOracle) {
  for (uint32_t u : sweep()) {
    const float x = bits_f32(u & 0x7fffffffu);
    EXPECT_EQ(kvq::fp4::e8m0_floor(x), kvq::reference::e8m0_floor_ref(x)) << std::hex << u;
  }
  for (int c = 0; c < 256; ++c) {
    const double want = kvq::reference::e8m0_value(static_cast<uint8_t>(c));
    const float got = kvq::fp4::decode_e8m0(static_cast<uint8_t>(c));
    if (c == 255) {
      EXPECT_TRUE(std::isnan(got));
    } else {
      EXPECT_EQ(static_cast<double>(got), want) << c;
      if (c > 0) {
        EXPECT_EQ(kvq::fp4::mx_inverse_scale(static_cast<uint8_t>(c)), static_cast<float>(1.0 / want)) << c;
      }
    }
  }
  EXPECT_EQ(kvq::fp4::mx_inverse_scale(0), std::ldexp(1.f, 127));
}

#if KVQ_TEST_CUDA_FP4
TEST(Fp4, E2M1MatchesCudaOverTheSweep) {
  uint64_t bad = 0;
  for (uint32_t u : sweep()) {
    const float x = bits_f32(u);
    const uint8_t want = __nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest);
    if (kvq::fp4::encode_e2m1(x) != want && ++bad <= 5) ADD_FAILURE() << std::hex << "x=0x" << u;
  }
  EXPECT_EQ(bad, 0u);
  for (int c = 0; c < 16; ++c) {
    const __half_raw h = __nv_cvt_fp4_to_halfraw(static_cast<__nv_fp4_storage_t>(c), __NV_E2M1);
    EXPECT_EQ(f32_bits(kvq::fp4::decode_e2m1(static_cast<uint8_t>(c))),
              f32_bits(kvq::half_bits_to_float(h.x))) << c;
  }
}

TEST(Fp4, E8M0MatchesCuda) {
  for (uint32_t u : sweep()) {
    const float x = bits_f32(u & 0x7fffffffu);
    EXPECT_EQ(kvq::fp4::e8m0_floor(x), __nv_cvt_float_to_e8m0(x, __NV_SATFINITE, cudaRoundZero)) << std::hex << u;
  }
  for (int c = 0; c < 255; ++c) {
    const __nv_bfloat16_raw b = __nv_cvt_e8m0_to_bf16raw(static_cast<__nv_fp8_storage_t>(c));
    EXPECT_EQ(f32_bits(kvq::fp4::decode_e8m0(static_cast<uint8_t>(c))), uint32_t{b.x} << 16) << c;
  }
}
#else
TEST(Fp4, E2M1MatchesCudaOverTheSweep) { GTEST_SKIP() << "cuda_fp4.h not found"; }
TEST(Fp4, E8M0MatchesCuda) { GTEST_SKIP() << "cuda_fp8.h not found"; }
#endif

/// Blocks: gaussian at several magnitudes, a zero block, a block with one huge value, values
/// exactly on e2m1 midpoints of the scale, subnormal-range values, and mixed signs.
std::vector<float> block_data(uint32_t seed, std::size_t n) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> x(n);
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t b = (i / 32) % 8;
    switch (b) {
      case 0: x[i] = nd(rng); break;
      case 1: x[i] = 0.f; break;
      case 2: x[i] = (i % 32 == 5) ? 1e4f : nd(rng) * 1e-2f; break;
      case 3: x[i] = static_cast<float>((i % 7) - 3) * 0.25f; break;  // midpoints
      case 4: x[i] = nd(rng) * 1e-39f; break;                          // subnormal floats
      case 5: x[i] = nd(rng) * 3e4f; break;
      case 6: x[i] = (i % 2 ? -1.f : 1.f) * 448.f * 6.f; break;        // the e4m3 x e2m1 top
      default: x[i] = nd(rng) * 1e-6f; break;
    }
  }
  return x;
}

TEST(Fp4, MxBlocksMatchTheOracle) {
  const std::vector<float> x = block_data(7, 32 * 64);
  for (std::size_t block : {32u, 16u}) {
    const auto want = kvq::reference::mxfp4_ref(x.data(), x.size(), block);
    for (std::size_t b0 = 0, bi = 0; b0 < x.size(); b0 += block, ++bi) {
      float amax = 0.f;
      for (std::size_t i = b0; i < b0 + block; ++i) amax = std::fmax(amax, std::fabs(x[i]));
      const uint8_t sc = kvq::fp4::mx_scale_code(amax);
      ASSERT_EQ(sc, want.scales[bi]) << "block " << bi;
      for (std::size_t i = b0; i < b0 + block; ++i) {
        const uint8_t c = kvq::fp4::mx_encode(x[i], sc);
        ASSERT_EQ(c, want.codes[i]) << i << " x=" << x[i];
        ASSERT_EQ(f32_bits(kvq::fp4::mx_decode(c, sc)), f32_bits(want.values[i])) << i;
      }
    }
  }
  // Hand-decoded: amax 5 -> floor(log2 5) = 2 -> X = 2^0 (code 127); 7 -> 6 (saturates).
  EXPECT_EQ(kvq::fp4::mx_scale_code(5.f), 127);
  EXPECT_EQ(kvq::fp4::mx_encode(7.f, 127), 0x7);
  EXPECT_EQ(kvq::fp4::mx_scale_code(0.f), 0);
  EXPECT_EQ(kvq::fp4::mx_scale_code(0.3f), 123);  // floor(log2 0.3) = -2 -> -4
}

TEST(Fp4, NvBlocksMatchTheOracle) {
  const std::vector<float> x = block_data(8, 32 * 64);
  for (float g : {1.f, 0.5f, 3e-3f, 1.7e-7f, 25.f}) {
    const auto want = kvq::reference::nvfp4_ref(x.data(), x.size(), 16, g);
    for (std::size_t b0 = 0, bi = 0; b0 < x.size(); b0 += 16, ++bi) {
      float amax = 0.f;
      for (std::size_t i = b0; i < b0 + 16; ++i) amax = std::fmax(amax, std::fabs(x[i]));
      const uint8_t sc = kvq::fp4::nv_scale_code(amax, g);
      ASSERT_EQ(sc, want.scales[bi]) << "block " << bi << " g " << g;
      const float es = kvq::fp4::nv_element_scale(sc, g);
      for (std::size_t i = b0; i < b0 + 16; ++i) {
        const uint8_t c = kvq::fp4::nv_encode(x[i], es);
        ASSERT_EQ(c, want.codes[i]) << i << " x=" << x[i] << " g " << g;
        ASSERT_EQ(f32_bits(kvq::fp4::nv_decode(c, es)), f32_bits(want.values[i])) << i;
      }
    }
  }
  // Hand-decoded: amax 6, g 1 -> scale e4m3(1) = 0x38, element scale 1; 3.2 -> 3 (code 5).
  EXPECT_EQ(kvq::fp4::nv_scale_code(6.f, 1.f), 0x38);
  EXPECT_EQ(kvq::fp4::nv_encode(3.2f, kvq::fp4::nv_element_scale(0x38, 1.f)), 0x5);
  // A whole tensor's scale puts its amax on the largest block scale (448 = 0x7E).
  const float g = kvq::fp4::nv_tensor_scale_from_amax(100.f);
  EXPECT_EQ(kvq::fp4::nv_scale_code(100.f, g), 0x7E);
  EXPECT_EQ(kvq::fp4::nv_tensor_scale_from_amax(0.f), 1.f);
}

}  // namespace
