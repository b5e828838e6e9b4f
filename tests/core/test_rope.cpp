// Tests for kvq/core/rope.hpp: llama2.c's adjacent-pair RoPE and the rotate_half variant.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "kvq/core/rope.hpp"
#include "kvq/eval/llama2c.hpp"
#include "test_util.hpp"

namespace {

TEST(Rope, AdjacentPairsMatchTheModelsRope) {
  const int H = 3, D = 8;
  const auto x = kvq_test::kv_data(kvq::Shape{1, H, D}, 5, true);
  for (int pos : {0, 1, 7, 100, 511}) {
    std::vector<float> a = x, b = x;
    kvq::apply_rope_pairs(a.data(), 1, H, D, pos);
    std::vector<float> cs(D / 2), sn(D / 2);
    for (int i = 0; i < D / 2; ++i) {  // llama2c.hpp computes its tables this way
      const double ang = pos * std::pow(10000.0, -static_cast<double>(2 * i) / D);
      cs[i] = static_cast<float>(std::cos(ang));
      sn[i] = static_cast<float>(std::sin(ang));
    }
    kvq::eval::detail::rope(b.data(), H, D, cs.data(), sn.data());
    for (size_t i = 0; i < a.size(); ++i)
      ASSERT_NEAR(a[i], b[i], 1e-6f * (1 + std::fabs(b[i]))) << "pos " << pos << " i " << i;
  }
}

TEST(Rope, HalfPairsRotateIWithIPlusHalf) {
  const int D = 6;
  std::vector<float> x = {1, 2, 3, 4, 5, 6};
  kvq::RopeConfig rc;
  rc.style = kvq::RopeStyle::kHalf;
  kvq::apply_rope_pairs(x.data(), 1, 1, D, 3, rc);
  const float in[6] = {1, 2, 3, 4, 5, 6};
  for (int i = 0; i < D / 2; ++i) {
    const double ang = 3 * std::pow(10000.0, -static_cast<double>(2 * i) / D);
    const float c = static_cast<float>(std::cos(ang)), s = static_cast<float>(std::sin(ang));
    EXPECT_NEAR(x[i], in[i] * c - in[i + 3] * s, 1e-6) << i;
    EXPECT_NEAR(x[i + 3], in[i] * s + in[i + 3] * c, 1e-6) << i;
  }
}

TEST(Rope, PositionZeroIsIdentityAndNormsArePreserved) {
  const int T = 5, H = 2, D = 16;
  const auto x = kvq_test::kv_data(kvq::Shape{T, H, D}, 9, false);
  for (auto style : {kvq::RopeStyle::kAdjacent, kvq::RopeStyle::kHalf}) {
    kvq::RopeConfig rc;
    rc.style = style;
    std::vector<float> y = x;
    kvq::apply_rope_pairs(y.data(), 1, H, D, 0, rc);  // position 0: cos 1, sin 0
    for (int i = 0; i < H * D; ++i) EXPECT_EQ(y[i], x[i]);
    y = x;
    kvq::apply_rope_pairs(y.data(), T, H, D, 40, rc);
    for (int r = 0; r < T * H; ++r) {
      double n0 = 0, n1 = 0;
      for (int d = 0; d < D; ++d) {
        n0 += static_cast<double>(x[r * D + d]) * x[r * D + d];
        n1 += static_cast<double>(y[r * D + d]) * y[r * D + d];
      }
      EXPECT_NEAR(n1, n0, 1e-5 * n0) << r;
    }
  }
  std::vector<float> odd(7, 1.f);
  EXPECT_THROW(kvq::apply_rope_pairs(odd.data(), 1, 1, 7, 1), kvq::Error);
}

}  // namespace
