// FP8 e4m3fn / e5m2: scalar and bulk conversions against the reference oracle and against
// CUDA's own host conversions (cuda_fp8.h, header only; skipped where it is not installed).
// KVQ_TEST_SCALAR_TOO
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kvq/core/error.hpp"
#include "kvq/core/half.hpp"
#include "kvq/format/fp8.hpp"
#include "kvq/simd/fp8_cpu.hpp"
#include "kvq/reference/fp8_ref.hpp"

#if defined(__has_include)
#if __has_include(<cuda_fp8.h>)
#include <cuda_fp8.h>
#define KVQ_TEST_CUDA_FP8 1
#endif
#endif
#ifndef KVQ_TEST_CUDA_FP8
#define KVQ_TEST_CUDA_FP8 0
#if defined(KVQ_HAVE_CUDA_FP8_H)
#error "KVQ_HAVE_CUDA_FP8_H is set but <cuda_fp8.h> is not on the include path"
#endif
#endif

#define KVQ_SKIP_WITHOUT_CUDA_FP8()                                                          \
  do {                                                                                       \
    if (!KVQ_TEST_CUDA_FP8) GTEST_SKIP() << "cuda_fp8.h not found; CUDA comparison skipped"; \
  } while (0)

namespace {

using kvq::f16;
using kvq::fp8::Fp8Kind;

constexpr Fp8Kind kKinds[] = {Fp8Kind::kE4M3, Fp8Kind::kE5M2};

uint32_t bits(float f) { return kvq::detail::f32_bits(f); }
float from_bits(uint32_t u) { return kvq::detail::bits_f32(u); }

/// CUDA's float -> fp8 (host code path of cuda_fp8.hpp).
uint8_t cuda_encode(Fp8Kind k, float x, bool saturate) {
#if KVQ_TEST_CUDA_FP8
  return __nv_cvt_float_to_fp8(x, saturate ? __NV_SATFINITE : __NV_NOSAT,
                               k == Fp8Kind::kE4M3 ? __NV_E4M3 : __NV_E5M2);
#else
  (void)k, (void)x, (void)saturate;
  return 0;
#endif
}

/// CUDA's fp16 -> fp8.
uint8_t cuda_encode_half(Fp8Kind k, uint16_t h, bool saturate) {
#if KVQ_TEST_CUDA_FP8
  __half_raw r;
  r.x = h;
  return __nv_cvt_halfraw_to_fp8(r, saturate ? __NV_SATFINITE : __NV_NOSAT,
                                 k == Fp8Kind::kE4M3 ? __NV_E4M3 : __NV_E5M2);
#else
  (void)k, (void)h, (void)saturate;
  return 0;
#endif
}

/// CUDA's fp8 -> fp16 bits.
uint16_t cuda_decode_half(Fp8Kind k, uint8_t c) {
#if KVQ_TEST_CUDA_FP8
  return __nv_cvt_fp8_to_halfraw(c, k == Fp8Kind::kE4M3 ? __NV_E4M3 : __NV_E5M2).x;
#else
  (void)k, (void)c;
  return 0;
#endif
}

/// CUDA's fp8 -> float (the __nv_fp8_* classes' conversion operator).
float cuda_decode_float(Fp8Kind k, uint8_t c) {
#if KVQ_TEST_CUDA_FP8
  if (k == Fp8Kind::kE4M3) {
    __nv_fp8_e4m3 v;
    v.__x = c;
    return static_cast<float>(v);
  }
  __nv_fp8_e5m2 v;
  v.__x = c;
  return static_cast<float>(v);
#else
  (void)k, (void)c;
  return 0.f;
#endif
}

std::string name(Fp8Kind k, bool sat) {
  return std::string(kvq::fp8::to_string(k)) + (sat ? "/satfinite" : "/nosat");
}

std::string hex(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}

// ---------------------------------------------------------------------------------------------
// Format facts

TEST(Fp8, MaxFinite) {
  EXPECT_EQ(kvq::fp8::max_finite(Fp8Kind::kE4M3), 448.f);
  EXPECT_EQ(kvq::fp8::max_finite(Fp8Kind::kE5M2), 57344.f);
  EXPECT_EQ(kvq::fp8::decode_e4m3(0x7E), 448.f);
  EXPECT_EQ(kvq::fp8::decode_e5m2(0x7B), 57344.f);
  EXPECT_EQ(kvq::fp8::decode_e5m2(0x7C), std::numeric_limits<float>::infinity());
  EXPECT_EQ(kvq::fp8::decode_e5m2(0xFC), -std::numeric_limits<float>::infinity());
  EXPECT_EQ(kvq::fp8::decode_e4m3(0x01), std::ldexp(1.f, -9));
  EXPECT_EQ(kvq::fp8::decode_e5m2(0x01), std::ldexp(1.f, -16));
}

// ---------------------------------------------------------------------------------------------
// All 256 decodes

TEST(Fp8Decode, All256VsReference) {
  for (Fp8Kind k : kKinds) {
    for (int c = 0; c < 256; ++c) {
      const double want = kvq::reference::fp8_value(k, static_cast<uint8_t>(c));
      const float got = kvq::fp8::decode(k, static_cast<uint8_t>(c));
      if (std::isnan(want)) {
        EXPECT_EQ(bits(got), 0x7fffffffu) << kvq::fp8::to_string(k) << " code " << c;
      } else {
        EXPECT_EQ(static_cast<double>(got), want) << kvq::fp8::to_string(k) << " code " << c;
        EXPECT_EQ(std::signbit(got), c >= 128) << kvq::fp8::to_string(k) << " code " << c;
      }
    }
  }
}

TEST(Fp8Decode, All256VsCuda) {
  KVQ_SKIP_WITHOUT_CUDA_FP8();
  for (Fp8Kind k : kKinds) {
    for (int c = 0; c < 256; ++c) {
      const uint8_t u = static_cast<uint8_t>(c);
      const float got = kvq::fp8::decode(k, u);
      EXPECT_EQ(bits(got), bits(cuda_decode_float(k, u))) << kvq::fp8::to_string(k) << " " << c;
      EXPECT_EQ(kvq::float_to_half_bits(got), cuda_decode_half(k, u))
          << kvq::fp8::to_string(k) << " " << c;
    }
  }
}

TEST(Fp8Decode, EncodeOfDecodeIsIdentity) {
  for (Fp8Kind k : kKinds) {
    for (int c = 0; c < 256; ++c) {
      const uint8_t u = static_cast<uint8_t>(c);
      const float v = kvq::fp8::decode(k, u);
      if (std::isnan(v)) continue;
      if (std::isinf(v)) {
        EXPECT_EQ(kvq::fp8::encode(k, v, false), u);
        continue;
      }
      EXPECT_EQ(kvq::fp8::encode(k, v, true), u) << kvq::fp8::to_string(k) << " " << c;
      EXPECT_EQ(kvq::fp8::encode(k, v, false), u) << kvq::fp8::to_string(k) << " " << c;
    }
  }
}

TEST(Fp8Decode, BulkAll256WithScales) {
  std::vector<uint8_t> codes(256);
  for (int c = 0; c < 256; ++c) codes[c] = static_cast<uint8_t>(c);
  // includes a scale whose * 2^8 overflows (the e4m3 SIMD fold falls back), subnormal scales,
  // zero, negative and infinite scales
  // clang-format off
  const float scales[] = {1.f, 0.5f, 3.f, -1.25f, 1e-3f, 7.3e-41f, 1e-45f, 0.f, -0.f, 1e30f, 3e38f,
                          2.5e36f, std::numeric_limits<float>::infinity()};
  // clang-format on
  for (Fp8Kind k : kKinds) {
    for (float s : scales) {
      std::vector<float> out(256);
      std::vector<f16> out16(256);
      kvq::fp8::decode(k, codes.data(), out.data(), 256, s);
      kvq::fp8::decode(k, codes.data(), out16.data(), 256, s);
      for (int c = 0; c < 256; ++c) {
        const float want = kvq::fp8::decode(k, codes[c]) * s;
        const std::string where = std::string(kvq::fp8::to_string(k)) + " code " +
                                  std::to_string(c) + " scale " + std::to_string(s);
        if (std::isnan(want)) {
          EXPECT_TRUE(std::isnan(out[c])) << where;
          EXPECT_TRUE(std::isnan(kvq::half_bits_to_float(out16[c].bits))) << where;
          if (std::isnan(kvq::fp8::decode(k, codes[c]))) {
            EXPECT_EQ(bits(out[c]), 0x7fffffffu) << where;
            EXPECT_EQ(out16[c].bits, 0x7fffu) << where;
          }
        } else {
          EXPECT_EQ(bits(out[c]), bits(want)) << where;
          EXPECT_EQ(out16[c].bits, kvq::float_to_half_bits(want)) << where;
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Named edge cases (docs/reference.md, FP8 section)

TEST(Fp8Edge, E4M3_464RoundsTo448BothModes) {
  EXPECT_EQ(kvq::fp8::encode_e4m3(464.f, true), 0x7E);
  EXPECT_EQ(kvq::fp8::encode_e4m3(464.f, false), 0x7E);
  EXPECT_EQ(kvq::fp8::encode_e4m3(-464.f, true), 0xFE);
  EXPECT_EQ(kvq::fp8::encode_e4m3(-464.f, false), 0xFE);
}

TEST(Fp8Edge, E4M3_JustAbove464Overflows) {
  const float above = std::nextafter(464.f, 1000.f);
  EXPECT_EQ(kvq::fp8::encode_e4m3(above, true), 0x7E);
  EXPECT_EQ(kvq::fp8::encode_e4m3(above, false), 0x7F);
  EXPECT_EQ(kvq::fp8::encode_e4m3(-above, false), 0xFF);
}

TEST(Fp8Edge, E4M3_SaturatingOverflowAndInfToMax) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(kvq::fp8::encode_e4m3(1e6f, true), 0x7E);
  EXPECT_EQ(kvq::fp8::encode_e4m3(-1e6f, true), 0xFE);
  EXPECT_EQ(kvq::fp8::encode_e4m3(inf, true), 0x7E);
  EXPECT_EQ(kvq::fp8::encode_e4m3(-inf, true), 0xFE);
  EXPECT_EQ(kvq::fp8::encode_e4m3(std::numeric_limits<float>::max(), true), 0x7E);
}

TEST(Fp8Edge, E4M3_NonSaturatingOverflowAndInfToNaN) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(kvq::fp8::encode_e4m3(480.f, false), 0x7F);
  EXPECT_EQ(kvq::fp8::encode_e4m3(1e6f, false), 0x7F);
  EXPECT_EQ(kvq::fp8::encode_e4m3(-1e6f, false), 0xFF);
  EXPECT_EQ(kvq::fp8::encode_e4m3(inf, false), 0x7F);
  EXPECT_EQ(kvq::fp8::encode_e4m3(-inf, false), 0xFF);
}

TEST(Fp8Edge, NaNEitherSignTo7F) {
  const float qnan = std::numeric_limits<float>::quiet_NaN();
  const float snan = std::numeric_limits<float>::signaling_NaN();
  for (Fp8Kind k : kKinds) {
    for (bool sat : {true, false}) {
      EXPECT_EQ(kvq::fp8::encode(k, qnan, sat), 0x7F) << name(k, sat);
      EXPECT_EQ(kvq::fp8::encode(k, -qnan, sat), 0x7F) << name(k, sat);
      EXPECT_EQ(kvq::fp8::encode(k, snan, sat), 0x7F) << name(k, sat);
      EXPECT_EQ(kvq::fp8::encode(k, from_bits(0xffffffffu), sat), 0x7F) << name(k, sat);
      EXPECT_EQ(kvq::fp8::encode(k, from_bits(0xff800001u), sat), 0x7F) << name(k, sat);
    }
  }
}

TEST(Fp8Edge, NegativeZeroTo80) {
  for (Fp8Kind k : kKinds) {
    EXPECT_EQ(kvq::fp8::encode(k, -0.f, true), 0x80);
    EXPECT_EQ(kvq::fp8::encode(k, 0.f, true), 0x00);
    // tiny negatives flush to -0 with the sign kept, as CUDA does
    EXPECT_EQ(kvq::fp8::encode(k, -1e-30f, false), 0x80);
    EXPECT_EQ(kvq::fp8::encode(k, -std::numeric_limits<float>::denorm_min(), true), 0x80);
  }
}

TEST(Fp8Edge, E4M3_Subnormals) {
  EXPECT_EQ(kvq::fp8::encode_e4m3(std::ldexp(1.f, -9)), 0x01);       // smallest subnormal
  EXPECT_EQ(kvq::fp8::encode_e4m3(std::ldexp(1.f, -10)), 0x00);      // tie -> even (0)
  EXPECT_EQ(kvq::fp8::encode_e4m3(3 * std::ldexp(1.f, -10)), 0x02);  // tie -> even (2)
  EXPECT_EQ(kvq::fp8::encode_e4m3(5 * std::ldexp(1.f, -10)), 0x02);  // tie -> even (2)
  EXPECT_EQ(kvq::fp8::encode_e4m3(std::nextafter(std::ldexp(1.f, -10), 1.f)), 0x01);
  EXPECT_EQ(kvq::fp8::encode_e4m3(-std::ldexp(1.f, -9)), 0x81);
  EXPECT_EQ(kvq::fp8::encode_e4m3(7 * std::ldexp(1.f, -9)), 0x07);    // largest subnormal
  EXPECT_EQ(kvq::fp8::encode_e4m3(15 * std::ldexp(1.f, -10)), 0x08);  // tie -> min normal
  EXPECT_EQ(kvq::fp8::encode_e4m3(std::ldexp(1.f, -6)), 0x08);        // smallest normal
}

TEST(Fp8Edge, E5M2_Subnormals) {
  EXPECT_EQ(kvq::fp8::encode_e5m2(std::ldexp(1.f, -16)), 0x01);
  EXPECT_EQ(kvq::fp8::encode_e5m2(std::ldexp(1.f, -17)), 0x00);
  EXPECT_EQ(kvq::fp8::encode_e5m2(3 * std::ldexp(1.f, -17)), 0x02);
  EXPECT_EQ(kvq::fp8::encode_e5m2(3 * std::ldexp(1.f, -16)), 0x03);
  EXPECT_EQ(kvq::fp8::encode_e5m2(7 * std::ldexp(1.f, -17)), 0x04);  // tie -> min normal
  EXPECT_EQ(kvq::fp8::encode_e5m2(std::ldexp(1.f, -14)), 0x04);
}

TEST(Fp8Edge, E5M2_NonSaturatingAtAndAbove61440IsInf) {
  EXPECT_EQ(kvq::fp8::encode_e5m2(61440.f, false), 0x7C);
  EXPECT_EQ(kvq::fp8::encode_e5m2(-61440.f, false), 0xFC);
  EXPECT_EQ(kvq::fp8::encode_e5m2(1e9f, false), 0x7C);
  EXPECT_EQ(kvq::fp8::encode_e5m2(std::numeric_limits<float>::infinity(), false), 0x7C);
  EXPECT_EQ(kvq::fp8::encode_e5m2(-std::numeric_limits<float>::infinity(), false), 0xFC);
  EXPECT_EQ(kvq::fp8::encode_e5m2(std::nextafter(61440.f, 0.f), false), 0x7B);
}

TEST(Fp8Edge, E5M2_SaturatingOverflowAndInfToMax) {
  EXPECT_EQ(kvq::fp8::encode_e5m2(61440.f, true), 0x7B);
  EXPECT_EQ(kvq::fp8::encode_e5m2(-1e9f, true), 0xFB);
  EXPECT_EQ(kvq::fp8::encode_e5m2(std::numeric_limits<float>::infinity(), true), 0x7B);
  EXPECT_EQ(kvq::fp8::encode_e5m2(-std::numeric_limits<float>::infinity(), true), 0xFB);
}

TEST(Fp8Edge, RoundToNearestEvenInNormalRange) {
  // e4m3 around 1: step 1/8. 1 + 1/16 is a tie -> 1 (even); 1 + 3/16 -> 1.25 (even).
  EXPECT_EQ(kvq::fp8::encode_e4m3(1.0625f), kvq::fp8::encode_e4m3(1.f));
  EXPECT_EQ(kvq::fp8::decode_e4m3(kvq::fp8::encode_e4m3(1.1875f)), 1.25f);
  EXPECT_EQ(kvq::fp8::decode_e4m3(kvq::fp8::encode_e4m3(std::nextafter(1.0625f, 2.f))), 1.125f);
  // e5m2 around 1: step 1/4.
  EXPECT_EQ(kvq::fp8::decode_e5m2(kvq::fp8::encode_e5m2(1.125f)), 1.f);
  EXPECT_EQ(kvq::fp8::decode_e5m2(kvq::fp8::encode_e5m2(1.375f)), 1.5f);
  // carry into the exponent: 1.9375 (tie between 1.875 and 2) -> 2 (even)
  EXPECT_EQ(kvq::fp8::decode_e4m3(kvq::fp8::encode_e4m3(1.9375f)), 2.f);
}

TEST(Fp8Edge, BulkPathsAgreeOnEdgeValues) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // clang-format off
  std::vector<float> v = {464.f,  -464.f, 480.f, 481.f, 1e6f, -1e6f, inf, -inf, nan, -nan,
                          -0.f,   0.f,    61440.f, -61440.f, 57344.f, 65536.f, 65535.f,
                          std::ldexp(1.f, -9), std::ldexp(1.f, -10), 3 * std::ldexp(1.f, -10),
                          std::ldexp(1.f, -16), std::ldexp(1.f, -17), 3 * std::ldexp(1.f, -17),
                          7 * std::ldexp(1.f, -17), 15 * std::ldexp(1.f, -10),
                          std::numeric_limits<float>::denorm_min(),
                          -std::numeric_limits<float>::denorm_min(),
                          std::numeric_limits<float>::max(), from_bits(0xff800001u),
                          from_bits(0x7fffffffu), 1.0625f, 1.9375f};
  // clang-format on
  std::vector<f16> h(v.size());
  for (size_t i = 0; i < v.size(); ++i) h[i] = f16(v[i]);
  for (Fp8Kind k : kKinds) {
    for (bool sat : {true, false}) {
      std::vector<uint8_t> got(v.size()), got16(v.size());
      kvq::fp8::encode(k, v.data(), got.data(), v.size(), 1.f, sat);
      kvq::fp8::encode(k, h.data(), got16.data(), h.size(), 1.f, sat);
      for (size_t i = 0; i < v.size(); ++i) {
        EXPECT_EQ(got[i], kvq::fp8::encode(k, v[i], sat)) << name(k, sat) << " x=" << v[i];
        EXPECT_EQ(got[i], kvq::reference::fp8_encode(k, v[i], sat)) << name(k, sat) << v[i];
        EXPECT_EQ(got16[i], kvq::fp8::encode(k, kvq::half_bits_to_float(h[i].bits), sat))
            << name(k, sat) << " h=" << h[i].bits;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Every fp16 input (the f16 bulk path, the scalar path, the oracle and CUDA)

TEST(Fp8Encode, AllHalfInputsScalarVsReference) {
  for (Fp8Kind k : kKinds) {
    for (bool sat : {true, false}) {
      int bad = 0;
      for (uint32_t u = 0; u < 65536 && bad < 10; ++u) {
        const float x = kvq::half_bits_to_float(static_cast<uint16_t>(u));
        const uint8_t want = kvq::reference::fp8_encode(k, x, sat);
        const uint8_t got = kvq::fp8::encode(k, x, sat);
        if (got != want) {
          ++bad;
          ADD_FAILURE() << name(k, sat) << " half " << hex(u) << ": got " << int(got)
                        << " reference " << int(want);
        }
      }
    }
  }
}

TEST(Fp8Encode, AllHalfInputsBulkVsScalar) {
  std::vector<f16> h(65536);
  std::vector<float> f(65536);
  for (uint32_t u = 0; u < 65536; ++u) {
    h[u].bits = static_cast<uint16_t>(u);
    f[u] = kvq::half_bits_to_float(static_cast<uint16_t>(u));
  }
  std::vector<uint8_t> got16(65536), got32(65536);
  for (Fp8Kind k : kKinds) {
    for (bool sat : {true, false}) {
      for (float inv : {1.f, 0.3f, 1024.f}) {
        kvq::fp8::encode(k, h.data(), got16.data(), h.size(), inv, sat);
        kvq::fp8::encode(k, f.data(), got32.data(), f.size(), inv, sat);
        int bad = 0;
        for (uint32_t u = 0; u < 65536 && bad < 10; ++u) {
          const uint8_t want = kvq::fp8::encode(k, f[u] * inv, sat);
          if (got16[u] != want || got32[u] != want) {
            ++bad;
            ADD_FAILURE() << name(k, sat) << " inv_scale " << inv << " half " << hex(u)
                          << ": f16 path " << int(got16[u]) << ", f32 path " << int(got32[u])
                          << ", scalar " << int(want);
          }
        }
      }
    }
  }
}

TEST(Fp8Encode, AllHalfInputsVsCuda) {
  KVQ_SKIP_WITHOUT_CUDA_FP8();
  std::vector<f16> h(65536);
  for (uint32_t u = 0; u < 65536; ++u) h[u].bits = static_cast<uint16_t>(u);
  std::vector<uint8_t> got(65536);
  for (Fp8Kind k : kKinds) {
    for (bool sat : {true, false}) {
      kvq::fp8::encode(k, h.data(), got.data(), h.size(), 1.f, sat);
      int bad = 0;
      for (uint32_t u = 0; u < 65536 && bad < 10; ++u) {
        const uint8_t want = cuda_encode_half(k, static_cast<uint16_t>(u), sat);
        const uint8_t scalar = kvq::fp8::encode(k, kvq::half_bits_to_float(h[u].bits), sat);
        if (got[u] != want || scalar != want) {
          ++bad;
          ADD_FAILURE() << name(k, sat) << " half " << hex(u) << ": bulk " << int(got[u])
                        << ", scalar " << int(scalar) << ", CUDA " << int(want);
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// A strided sample of all float bit patterns (the exhaustive test does all 2^32)

/// Every 4099th bit pattern (about 1M), so every exponent and many mantissas are hit.
std::vector<float> strided_floats() {
  std::vector<float> v;
  for (uint64_t u = 0; u <= 0xffffffffull; u += 4099) v.push_back(from_bits(uint32_t(u)));
  return v;
}

TEST(Fp8Encode, StridedFloatPatternsVsCuda) {
  KVQ_SKIP_WITHOUT_CUDA_FP8();
  const std::vector<float> v = strided_floats();
  std::vector<uint8_t> got(v.size());
  for (Fp8Kind k : kKinds) {
    for (bool sat : {true, false}) {
      kvq::fp8::encode(k, v.data(), got.data(), v.size(), 1.f, sat);
      int bad = 0;
      for (size_t i = 0; i < v.size() && bad < 10; ++i) {
        const uint8_t want = cuda_encode(k, v[i], sat);
        const uint8_t scalar = kvq::fp8::encode(k, v[i], sat);
        if (got[i] != want || scalar != want) {
          ++bad;
          ADD_FAILURE() << name(k, sat) << " x " << hex(bits(v[i])) << ": bulk " << int(got[i])
                        << ", scalar " << int(scalar) << ", CUDA " << int(want);
        }
      }
    }
  }
}

TEST(Fp8Encode, StridedFloatPatternsVsReference) {
  const std::vector<float> v = strided_floats();
  for (Fp8Kind k : kKinds) {
    for (bool sat : {true, false}) {
      int bad = 0;
      for (size_t i = 0; i < v.size() && bad < 10; i += 3) {
        const uint8_t want = kvq::reference::fp8_encode(k, v[i], sat);
        const uint8_t got = kvq::fp8::encode(k, v[i], sat);
        if (got != want) {
          ++bad;
          ADD_FAILURE() << name(k, sat) << " x " << hex(bits(v[i])) << ": got " << int(got)
                        << ", reference " << int(want);
        }
      }
    }
  }
}

/// Values next to every rounding boundary (midpoints between neighbouring codes, +-1 ulp), in
/// every binade including subnormals: where an off-by-one in the rounding would show.
TEST(Fp8Encode, MidpointNeighboursVsReferenceAndCuda) {
  for (Fp8Kind k : kKinds) {
    const int top = k == Fp8Kind::kE4M3 ? 0x7e : 0x7b;
    std::vector<float> v;
    for (int c = 0; c <= top; ++c) {
      const double lo = kvq::reference::fp8_value(k, static_cast<uint8_t>(c));
      const double hi = c < top ? kvq::reference::fp8_value(k, static_cast<uint8_t>(c + 1))
                                : (k == Fp8Kind::kE4M3 ? 480.0 : 65536.0);
      const float mid = static_cast<float>((lo + hi) / 2);  // exact
      for (float m : {mid, std::nextafter(mid, 0.f), std::nextafter(mid, 1e30f),
                      static_cast<float>(lo), static_cast<float>(hi)}) {
        v.push_back(m);
        v.push_back(-m);
      }
    }
    std::vector<uint8_t> got(v.size());
    for (bool sat : {true, false}) {
      kvq::fp8::encode(k, v.data(), got.data(), v.size(), 1.f, sat);
      for (size_t i = 0; i < v.size(); ++i) {
        const uint8_t want = kvq::reference::fp8_encode(k, v[i], sat);
        EXPECT_EQ(kvq::fp8::encode(k, v[i], sat), want) << name(k, sat) << " x=" << v[i];
        EXPECT_EQ(got[i], want) << name(k, sat) << " x=" << v[i];
        if (KVQ_TEST_CUDA_FP8) {
          EXPECT_EQ(cuda_encode(k, v[i], sat), want) << name(k, sat) << " x=" << v[i];
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Bulk vs scalar on random data with scales, every length 0..100 (SIMD tails)

std::vector<float> random_kv(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_int_distribution<int> pick(0, 19);
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) {
    float x = nd(rng) * std::ldexp(1.f, pick(rng) - 10);  // spread over 20 binades
    if (pick(rng) == 0) x *= 1e4f;                        // some overflow after scaling
    v[i] = x;
  }
  return v;
}

TEST(Fp8Bulk, EncodeEveryLengthWithScalesMatchesScalar) {
  const std::vector<float> base = random_kv(128, 7);
  std::vector<f16> base16(base.size());
  for (size_t i = 0; i < base.size(); ++i) base16[i] = f16(base[i]);
  for (Fp8Kind k : kKinds) {
    for (bool sat : {true, false}) {
      for (float inv : {1.f, 0.731f, 37.f, 1.f / 3.f}) {
        for (size_t n = 0; n <= 100; ++n) {
          for (size_t off : {size_t{0}, size_t{3}}) {  // unaligned starts too
            const float* src = base.data() + off;
            const f16* src16 = base16.data() + off;
            std::vector<uint8_t> got(n + 1, 0xAB), got16(n + 1, 0xAB);
            kvq::fp8::encode(k, src, got.data(), n, inv, sat);
            kvq::fp8::encode(k, src16, got16.data(), n, inv, sat);
            for (size_t i = 0; i < n; ++i) {
              ASSERT_EQ(got[i], kvq::fp8::encode(k, src[i] * inv, sat))
                  << name(k, sat) << " n=" << n << " i=" << i << " inv=" << inv;
              const float h = kvq::half_bits_to_float(src16[i].bits);
              ASSERT_EQ(got16[i], kvq::fp8::encode(k, h * inv, sat))
                  << name(k, sat) << " f16 n=" << n << " i=" << i << " inv=" << inv;
            }
            ASSERT_EQ(got[n], 0xAB) << "wrote past the end, n=" << n;
            ASSERT_EQ(got16[n], 0xAB) << "wrote past the end, n=" << n;
          }
        }
      }
    }
  }
}

TEST(Fp8Bulk, DecodeEveryLengthWithScalesMatchesScalar) {
  std::mt19937 rng(11);
  std::vector<uint8_t> codes(128);
  for (auto& c : codes) c = static_cast<uint8_t>(rng());
  codes[5] = 0x7F;  // NaN in both formats
  codes[9] = 0xFC;  // e5m2 -inf
  for (Fp8Kind k : kKinds) {
    for (float s : {1.f, 0.0123f, -2.5f, 1e-40f}) {
      for (size_t n = 0; n <= 100; ++n) {
        for (size_t off : {size_t{0}, size_t{1}}) {
          const uint8_t* src = codes.data() + off;
          std::vector<float> got(n + 1, -7.f);
          std::vector<f16> got16(n + 1, f16::from_bits(0x1234));
          kvq::fp8::decode(k, src, got.data(), n, s);
          kvq::fp8::decode(k, src, got16.data(), n, s);
          for (size_t i = 0; i < n; ++i) {
            const float want = kvq::fp8::decode(k, src[i]) * s;
            ASSERT_EQ(bits(got[i]), bits(want))
                << kvq::fp8::to_string(k) << " n=" << n << " i=" << i;
            ASSERT_EQ(got16[i].bits, kvq::float_to_half_bits(want))
                << kvq::fp8::to_string(k) << " n=" << n << " i=" << i;
          }
          ASSERT_EQ(got[n], -7.f) << "wrote past the end, n=" << n;
          ASSERT_EQ(got16[n].bits, 0x1234) << "wrote past the end, n=" << n;
        }
      }
    }
  }
}

/// Outputs of 4 MiB and more take the streaming-store path (64-byte-aligned body after a scalar
/// head, prefetching); misaligned destinations exercise the head.
TEST(Fp8Bulk, LargeSpansMatchScalar) {
  const size_t n = (size_t{1} << 22) + 37;  // 4 Mi codes, 16 MiB of float out
  const std::vector<float> x = random_kv(n + 8, 5);
  std::vector<f16> h(n + 8);
  for (size_t i = 0; i < h.size(); ++i) h[i] = f16(x[i]);
  std::vector<uint8_t> codes(n + 8), codes16(n + 8);
  std::vector<float> back(n + 8);
  std::vector<f16> back16(n + 8);
  for (Fp8Kind k : kKinds) {
    for (size_t off : {size_t{0}, size_t{5}}) {
      const float inv = 0.37f, s = 2.7f;
      kvq::fp8::encode(k, x.data() + off, codes.data() + off, n, inv);
      kvq::fp8::encode(k, h.data() + off, codes16.data() + off, n, inv, false);
      kvq::fp8::decode(k, codes.data() + off, back.data() + off, n, s);
      kvq::fp8::decode(k, codes.data() + off, back16.data() + off, n, s);
      for (size_t i = off; i < off + n; ++i) {
        ASSERT_EQ(codes[i], kvq::fp8::encode(k, x[i] * inv, true)) << "i=" << i;
        const float hf = kvq::half_bits_to_float(h[i].bits);
        ASSERT_EQ(codes16[i], kvq::fp8::encode(k, hf * inv, false)) << "i=" << i;
        const float want = kvq::fp8::decode(k, codes[i]) * s;
        ASSERT_EQ(bits(back[i]), bits(want)) << "i=" << i;
        ASSERT_EQ(back16[i].bits, kvq::float_to_half_bits(want)) << "i=" << i;
      }
    }
  }
}

TEST(Fp8Bulk, RoundTripWithComputedScaleStaysWithinHalfStep) {
  const std::vector<float> x = random_kv(4096, 3);
  float amax = 0.f;
  for (float v : x) amax = std::max(amax, std::fabs(v));
  for (Fp8Kind k : kKinds) {
    const float scale = kvq::fp8::compute_scale(k, amax);
    std::vector<uint8_t> codes(x.size());
    std::vector<float> back(x.size());
    kvq::fp8::encode(k, x.data(), codes.data(), x.size(), 1.f / scale);
    kvq::fp8::decode(k, codes.data(), back.data(), x.size(), scale);
    const double rel = k == Fp8Kind::kE4M3 ? 1.0 / 16 : 1.0 / 8;  // half a mantissa step
    const double abs_floor =
        scale * (k == Fp8Kind::kE4M3 ? std::ldexp(1.0, -10) : std::ldexp(1.0, -17));
    for (size_t i = 0; i < x.size(); ++i) {
      ASSERT_LE(std::fabs(double(back[i]) - x[i]), (rel * std::fabs(x[i]) + abs_floor) * 1.001)
          << kvq::fp8::to_string(k) << " i=" << i << " x=" << x[i];
    }
  }
}

// ---------------------------------------------------------------------------------------------
// compute_scale

TEST(Fp8Scale, AmaxMapsToMaxFinite) {
  EXPECT_EQ(kvq::fp8::compute_scale(Fp8Kind::kE4M3, 448.f), 1.f);
  EXPECT_EQ(kvq::fp8::compute_scale(Fp8Kind::kE5M2, 57344.f), 1.f);
  EXPECT_EQ(kvq::fp8::compute_scale(Fp8Kind::kE4M3, 896.f, 0.5f), 1.f);
  EXPECT_FLOAT_EQ(kvq::fp8::compute_scale(Fp8Kind::kE4M3, 3.5f), 3.5f / 448.f);
  EXPECT_FLOAT_EQ(kvq::fp8::compute_scale(Fp8Kind::kE5M2, 3.5f, 2.f), 7.f / 57344.f);
  for (Fp8Kind k : kKinds) {
    for (float amax : {1e-3f, 0.7f, 12.f, 3e5f}) {
      const float s = kvq::fp8::compute_scale(k, amax);
      // amax itself encodes to the largest finite code (no saturation needed)
      EXPECT_EQ(kvq::fp8::encode(k, amax * (1.f / s), false) & 0x7f,
                k == Fp8Kind::kE4M3 ? 0x7e : 0x7b)
          << kvq::fp8::to_string(k) << " amax " << amax;
    }
  }
}

TEST(Fp8Scale, ZeroAmaxGivesOneAndExactZeros) {
  for (Fp8Kind k : kKinds) {
    EXPECT_EQ(kvq::fp8::compute_scale(k, 0.f), 1.f);
    EXPECT_EQ(kvq::fp8::compute_scale(k, -0.f), 1.f);
    const float s = kvq::fp8::compute_scale(k, 0.f);
    std::vector<float> z(70, 0.f), back(70, 1.f);
    std::vector<uint8_t> c(70, 0xAB);
    kvq::fp8::encode(k, z.data(), c.data(), z.size(), 1.f / s);
    kvq::fp8::decode(k, c.data(), back.data(), c.size(), s);
    for (size_t i = 0; i < z.size(); ++i) {
      EXPECT_EQ(c[i], 0);
      EXPECT_EQ(bits(back[i]), 0u);
    }
  }
}

TEST(Fp8Scale, NonFiniteAmaxThrowsNamingTheValue) {
  for (Fp8Kind k : kKinds) {
    for (float bad :
         {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
          std::numeric_limits<float>::quiet_NaN()}) {
      try {
        kvq::fp8::compute_scale(k, bad);
        FAIL() << "no throw for amax " << bad;
      } catch (const kvq::Error& e) {
        EXPECT_EQ(e.kind(), kvq::ErrorKind::kNonFinite);
        const std::string msg = e.what();
        EXPECT_NE(msg.find("amax"), std::string::npos) << msg;
        EXPECT_TRUE(msg.find("inf") != std::string::npos || msg.find("nan") != std::string::npos)
            << msg;
      }
    }
  }
}

TEST(Fp8Scale, BadArgumentsThrow) {
  for (Fp8Kind k : kKinds) {
    EXPECT_THROW(kvq::fp8::compute_scale(k, -1.f), kvq::Error);
    EXPECT_THROW(kvq::fp8::compute_scale(k, 1.f, 0.f), kvq::Error);
    EXPECT_THROW(kvq::fp8::compute_scale(k, 1.f, -2.f), kvq::Error);
    EXPECT_THROW(kvq::fp8::compute_scale(k, 1.f, std::numeric_limits<float>::quiet_NaN()),
                 kvq::Error);
    EXPECT_THROW(kvq::fp8::compute_scale(k, 1.f, std::numeric_limits<float>::infinity()),
                 kvq::Error);
    try {
      kvq::fp8::compute_scale(k, -1.f);
    } catch (const kvq::Error& e) {
      EXPECT_EQ(e.kind(), kvq::ErrorKind::kInvalidArgument);
    }
  }
}

TEST(Fp8Scale, ExtremeFiniteAmaxGivesFiniteScaleAndInverse) {
  const float tiny = std::numeric_limits<float>::denorm_min();
  const float huge = std::numeric_limits<float>::max();
  for (Fp8Kind k : kKinds) {
    for (float amax : {tiny, 1e-40f, std::numeric_limits<float>::min(), huge}) {
      for (float margin : {1.f, 1e-30f, 1e30f}) {
        const float s = kvq::fp8::compute_scale(k, amax, margin);
        EXPECT_TRUE(std::isfinite(s) && s > 0.f) << amax << " " << margin;
        EXPECT_TRUE(std::isfinite(1.f / s)) << amax << " " << margin;
        EXPECT_GE(s, std::numeric_limits<float>::min());
        // encoding amax never gives NaN
        const uint8_t c = kvq::fp8::encode(k, amax * (1.f / s), true);
        EXPECT_FALSE(std::isnan(kvq::fp8::decode(k, c))) << amax << " " << margin;
      }
    }
  }
}

}  // namespace
