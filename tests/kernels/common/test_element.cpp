// format/element.hpp: the host/device element functions the CUDA kernels run, compared
// bit for bit with the CPU code they restate (uniform_params, Fp8Codec::params, nuq_params and
// NuqCodec, round_meta,
// load_meta/store_meta, pack_bits/unpack_bits, fp8 bulk encode/decode with a scale,
// Codebook::encode, Rotation signs), over random and adversarial inputs. Compiled by the host
// compiler here; tests/cuda compiles the same functions with nvcc.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kvq/format/element.hpp"
#include "kvq/kvq.hpp"

namespace {

using kvq::elem::ElementStatus;
using kvq::elem::GroupParams;

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

/// Group ranges: random spans of several magnitudes plus the edge cases of the formulas.
std::vector<std::pair<float, float>> ranges() {
  std::vector<std::pair<float, float>> r = {
      {0.f, 0.f},       {-0.f, 0.f},     {0.f, -0.f},       {1.f, 1.f},      {-3.f, -3.f},
      {-1.f, 1.f},      {-2.f, 1.f},     {-1.f, 2.f},       {1e-30f, 2e-30f}, {-1e-40f, 1e-40f},
      {-65504.f, 65504.f}, {-70000.f, 1.f}, {1.f, 70000.f},  {-1e30f, 1e30f}, {5.f, 5.0000005f},
      {-6e-8f, 6e-8f},  {0.f, 1e-7f},    {-448.f, 448.f},   {-57344.f, 0.f}, {-1e-38f, 3e-39f}};
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::uniform_int_distribution<int> e(-30, 20);
  for (int i = 0; i < 4000; ++i) {
    float a = std::ldexp(u(rng), e(rng)), b = std::ldexp(u(rng), e(rng));
    if (a > b) std::swap(a, b);
    r.push_back({a, b});
  }
  return r;
}

TEST(Element, IntParamsEqualUniformParams) {
  for (int bits : {2, 3, 4, 8})
    for (bool sym : {false, true})
      for (kvq::MetaDType meta : {kvq::MetaDType::kF16, kvq::MetaDType::kF32})
        for (auto [lo, hi] : ranges()) {
          SCOPED_TRACE(testing::Message() << "bits " << bits << " sym " << sym << " meta "
                                          << kvq::to_string(meta) << " [" << lo << ", " << hi << "]");
          GroupParams g;
          const ElementStatus s =
              kvq::elem::int_params(lo, hi, bits, sym, meta == kvq::MetaDType::kF16, &g);
          try {
            const kvq::UniformParams p = kvq::uniform_params(lo, hi, bits, sym, meta, 0);
            ASSERT_EQ(s, ElementStatus::kOk);
            EXPECT_EQ(bits_of(g.scale), bits_of(p.scale));
            EXPECT_EQ(bits_of(g.zero), bits_of(p.zero));
            EXPECT_EQ(bits_of(g.inv), bits_of(p.inv));
            EXPECT_EQ(bits_of(kvq::elem::int_inv(p.scale)), bits_of(p.inv));
          } catch (const kvq::Error& e) {
            EXPECT_EQ(e.kind(), kvq::ErrorKind::kOutOfRange);
            EXPECT_TRUE(s == ElementStatus::kZeroOverflow || s == ElementStatus::kScaleOverflow);
          }
        }
}

TEST(Element, NuqParamsCodesAndValuesEqualTheCpuCodec) {
  for (kvq::MetaDType meta : {kvq::MetaDType::kF16, kvq::MetaDType::kF32})
    for (auto [lo, hi] : ranges()) {
      SCOPED_TRACE(testing::Message() << kvq::to_string(meta) << " [" << lo << ", " << hi << "]");
      GroupParams g;
      const ElementStatus s = kvq::elem::nuq_params(lo, hi, meta == kvq::MetaDType::kF16, &g);
      try {
        const kvq::UniformParams p = kvq::detail::nuq_params(lo, hi, meta, 0);
        ASSERT_EQ(s, ElementStatus::kOk);
        EXPECT_EQ(bits_of(g.scale), bits_of(p.scale));
        EXPECT_EQ(bits_of(g.zero), bits_of(p.zero));
        EXPECT_EQ(bits_of(g.inv), bits_of(p.inv));
      } catch (const kvq::Error& e) {
        EXPECT_EQ(e.kind(), kvq::ErrorKind::kOutOfRange);
        EXPECT_TRUE(s == ElementStatus::kZeroOverflow || s == ElementStatus::kScaleOverflow);
      }
    }
  // Codes and values against NuqCodec (its SIMD bulk encode and scalar decode), per width.
  std::mt19937 rng(11);
  std::normal_distribution<float> n(0.f, 1.f);
  for (int bits : {2, 3, 4}) {
    kvq::QuantConfig c;
    c.format = kvq::Format::kNuq;
    c.bits = bits;
    const int L = 1 << bits;
    for (int i = 0; i < L; ++i)
      c.nuq_levels[static_cast<std::size_t>(i)] =
          static_cast<float>(i * i) / static_cast<float>((L - 1) * (L - 1)) - 0.01f;
    c.nuq_ready = true;
    const kvq::detail::NuqCodec codec(c);
    std::vector<float> x(1027);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = n(rng) * 0.4f + 0.3f;
    x[0] = 0.f;
    x[1] = -0.f;
    x[2] = 1e30f;
    x[3] = -1e30f;
    x[4] = codec.thr[1] * 2.0f - 1.0f;  // exactly on a threshold: u = thr[1] (ties go up)
    for (auto [z, sc] : {std::pair<float, float>{-1.f, 2.f}, {0.125f, 0.5f}, {-3e-5f, 7e-5f},
                         {0.f, 0.f}}) {
      const float inv = kvq::elem::int_inv(sc);
      std::vector<uint8_t> codes(x.size());
      codec.encode(x.data(), static_cast<int64_t>(x.size()), z, inv, codes.data());
      std::vector<float> back(x.size());
      codec.decode(codes.data(), static_cast<int64_t>(x.size()), sc, z, back.data());
      for (std::size_t i = 0; i < x.size(); ++i) {
        ASSERT_EQ(kvq::elem::nuq_encode(codec.thr, bits, x[i], z, inv), codes[i])
            << "bits " << bits << " x " << x[i] << " zero " << z << " scale " << sc;
        ASSERT_EQ(bits_of(kvq::elem::nuq_decode(codec.lv, bits, codes[i], sc, z)), bits_of(back[i]));
      }
    }
  }
}

TEST(Element, Fp8ParamsEqualTheCpuCodec) {
  for (kvq::Format f : {kvq::Format::kE4M3, kvq::Format::kE5M2})
    for (float margin : {1.f, 1.25f, 0.5f})
      for (kvq::MetaDType meta : {kvq::MetaDType::kF16, kvq::MetaDType::kF32}) {
        kvq::QuantConfig c;
        c.format = f;
        c.bits = 8;
        c.fp8_margin = margin;
        c.meta = meta;
        const kvq::detail::Fp8Codec codec(c);
        for (auto [lo, hi] : ranges()) {
          SCOPED_TRACE(testing::Message() << kvq::to_string(f) << " margin " << margin << " ["
                                          << lo << ", " << hi << "]");
          GroupParams g;
          const ElementStatus s = kvq::elem::fp8_params(lo, hi, f == kvq::Format::kE5M2, margin,
                                                        meta == kvq::MetaDType::kF16, &g);
          try {
            const kvq::UniformParams p = codec.params(lo, hi, 0);
            ASSERT_EQ(s, ElementStatus::kOk);
            EXPECT_EQ(bits_of(g.scale), bits_of(p.scale));
            EXPECT_EQ(bits_of(g.inv), bits_of(p.inv));
          } catch (const kvq::Error& e) {
            EXPECT_EQ(e.kind(), kvq::ErrorKind::kOutOfRange);
            EXPECT_EQ(s, ElementStatus::kScaleOverflow);
          }
          const float amax = std::max(-lo, hi) + 0.0f;
          EXPECT_EQ(bits_of(kvq::elem::fp8_compute_scale(f == kvq::Format::kE5M2, amax, margin)),
                    bits_of(kvq::fp8::compute_scale(codec.kind, amax, margin)));
        }
      }
}

TEST(Element, Fp8ScaledCodesEqualTheBulkCpuPaths) {
  std::mt19937 rng(3);
  std::normal_distribution<float> n(0.f, 1.f);
  std::vector<float> x(4096);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = n(rng) * std::ldexp(1.f, static_cast<int>(i % 40) - 20);
  x[0] = 0.f;
  x[1] = -0.f;
  x[2] = 1e30f;  // saturates
  for (auto kind : {kvq::fp8::Fp8Kind::kE4M3, kvq::fp8::Fp8Kind::kE5M2})
    for (float scale : {1.f, 0.0123f, 3.5e-5f, 117.f}) {
      const float inv = 1.0f / scale;
      std::vector<uint8_t> c(x.size());
      std::vector<float> d(x.size());
      kvq::fp8::encode(kind, x.data(), c.data(), x.size(), inv, true);
      kvq::fp8::decode(kind, c.data(), d.data(), c.size(), scale);
      const bool e5 = kind == kvq::fp8::Fp8Kind::kE5M2;
      for (std::size_t i = 0; i < x.size(); ++i) {
        ASSERT_EQ(kvq::elem::fp8_encode_scaled(e5, x[i], inv), c[i]) << i;
        ASSERT_EQ(bits_of(kvq::elem::fp8_decode_scaled(e5, c[i], scale)), bits_of(d[i])) << i;
      }
    }
}

TEST(Element, MetaRoundTripEqualsTheCpu) {
  std::mt19937 rng(5);
  std::vector<float> v = {0.f, -0.f, 65504.f, 65520.f, 1e-8f, 6e-8f, -3.f, 1e30f,
                          std::numeric_limits<float>::infinity()};
  for (int i = 0; i < 2000; ++i) v.push_back(std::ldexp(static_cast<float>(rng()) / 4e9f, static_cast<int>(rng() % 60) - 30));
  for (kvq::MetaDType m : {kvq::MetaDType::kF16, kvq::MetaDType::kF32}) {
    const bool f16 = m == kvq::MetaDType::kF16;
    std::vector<uint8_t> a(v.size() * 4), b(v.size() * 4);
    for (std::size_t i = 0; i < v.size(); ++i) {
      EXPECT_EQ(bits_of(kvq::elem::round_meta(f16, v[i])), bits_of(kvq::round_meta(m, v[i])));
      const float sa = kvq::elem::store_meta(a.data(), f16, i, v[i]);
      const float sb = kvq::detail::store_meta(b.data(), m, i, v[i]);
      EXPECT_EQ(bits_of(sa), bits_of(sb));
    }
    EXPECT_EQ(a, b);
    for (std::size_t i = 0; i < v.size(); ++i)
      EXPECT_EQ(bits_of(kvq::elem::load_meta(a.data(), f16, i)),
                bits_of(kvq::detail::load_meta(b.data(), m, i)));
  }
}

TEST(Element, CodesAndPackedBytesEqualBitpack) {
  std::mt19937 rng(9);
  for (int bits = 1; bits <= 8; ++bits)
    for (std::size_t n : {1u, 7u, 8u, 9u, 64u, 129u, 1000u}) {
      std::vector<uint8_t> codes(n);
      for (auto& c : codes) c = static_cast<uint8_t>(rng() & ((1u << bits) - 1u));
      std::vector<uint8_t> packed(kvq::packed_bytes(n, bits), 0);
      kvq::pack_bits(codes.data(), n, bits, packed.data());
      for (std::size_t j = 0; j < packed.size(); ++j)
        ASSERT_EQ(kvq::elem::packed_byte(codes.data(), n, bits, j), packed[j])
            << "bits " << bits << " n " << n << " byte " << j;
      for (std::size_t i = 0; i < n; ++i)
        ASSERT_EQ(kvq::elem::get_code(packed.data(), i, bits), codes[i]) << bits << " " << i;
    }
}

TEST(Element, LloydMaxEncodeAndSignsEqualTheCpu) {
  for (int bits = 1; bits <= 4; ++bits) {
    const kvq::Codebook& cb = kvq::lloyd_max_sphere(128, bits);
    std::vector<float> x = {0.f, -0.f, 1.f, -1.f, NAN, INFINITY, -INFINITY};
    for (float t : cb.thresholds) x.insert(x.end(), {t, std::nextafter(t, 2.f), std::nextafter(t, -2.f)});
    std::mt19937 rng(bits);
    std::normal_distribution<float> n(0.f, 0.09f);
    for (int i = 0; i < 2000; ++i) x.push_back(n(rng));
    std::vector<uint8_t> c(x.size());
    cb.encode(x.data(), c.data(), static_cast<int64_t>(x.size()));
    for (std::size_t i = 0; i < x.size(); ++i)
      EXPECT_EQ(kvq::elem::lm_encode(cb.thresholds.data(), bits, x[i]), c[i]) << x[i];
  }
  const kvq::Rotation r = kvq::Rotation::hadamard(256, 0x6b7671u);
  uint32_t mask[8] = {};
  for (int i = 0; i < 256; ++i)
    if (r.signs()[static_cast<std::size_t>(i)] < 0.f) mask[i >> 5] |= 1u << (i & 31);
  for (int i = 0; i < 256; ++i) EXPECT_EQ(kvq::elem::sign_of(mask, i), r.signs()[static_cast<std::size_t>(i)]);
}

}  // namespace
