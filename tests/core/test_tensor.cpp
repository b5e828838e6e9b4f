// Tensor views: NHD/HND layouts, strides, dtypes, and the errors for bad shapes/strides.
#include <gtest/gtest.h>

#include <vector>

#include "kvq/core/rows.hpp"
#include "kvq/core/tensor.hpp"

namespace {

using kvq::KVView;
using kvq::Shape;

TEST(Tensor, NhdAndHndAddressTheSameLogicalElement) {
  const Shape s{5, 3, 4};
  std::vector<float> nhd(60), hnd(60);
  for (int t = 0; t < 5; ++t)
    for (int h = 0; h < 3; ++h)
      for (int d = 0; d < 4; ++d) {
        const float v = t * 100.f + h * 10.f + d;
        nhd[(t * 3 + h) * 4 + d] = v;
        hnd[(h * 5 + t) * 4 + d] = v;
      }
  auto a = KVView<float>::nhd(nhd.data(), 5, 3, 4);
  auto b = KVView<float>::hnd(hnd.data(), 3, 5, 4);
  EXPECT_TRUE(a.is_contiguous_nhd());
  EXPECT_FALSE(b.is_contiguous_nhd());
  for (int t = 0; t < 5; ++t)
    for (int h = 0; h < 3; ++h)
      for (int d = 0; d < 4; ++d) EXPECT_EQ(a.at(t, h, d), b.at(t, h, d));
  EXPECT_EQ(b.shape(), s);
  EXPECT_EQ(b.strides().head, 20);
}

TEST(Tensor, SliceTokens) {
  std::vector<kvq::f16> x(2 * 4 * 3 * 8);
  auto v = KVView<kvq::f16>::nhd(x.data(), 8, 3, 4);
  auto s = v.slice_tokens(2, 5);
  EXPECT_EQ(s.tokens(), 5);
  EXPECT_EQ(&s.at(0, 0, 0), &v.at(2, 0, 0));
  EXPECT_EQ(KVView<kvq::f16>::dtype(), kvq::DType::kF16);
  EXPECT_THROW(v.slice_tokens(6, 5), kvq::Error);
  EXPECT_THROW(v.slice_tokens(-1, 2), kvq::Error);
}

TEST(Tensor, PaddedStridesAreAccepted) {
  std::vector<kvq::bf16> x(10 * 2 * 16);
  KVView<kvq::bf16> v(x.data(), Shape{10, 2, 8}, kvq::Strides{32, 16, 1});  // padded rows
  EXPECT_FALSE(v.is_contiguous_nhd());
  EXPECT_TRUE(v.dim_contiguous());
  EXPECT_EQ(&v.at(1, 1, 3) - x.data(), 32 + 16 + 3);
}

TEST(Tensor, OverlappingStridesAreRejected) {
  std::vector<float> x(1000);
  try {
    KVView<float> v(x.data(), Shape{10, 2, 8}, kvq::Strides{8, 4, 1});
    FAIL() << "overlap not detected";
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.kind(), kvq::ErrorKind::kShapeMismatch);
    EXPECT_NE(std::string(e.what()).find("overlapping strides"), std::string::npos) << e.what();
  }
  EXPECT_THROW((KVView<float>(x.data(), Shape{10, 2, 8}, kvq::Strides{16, 0, 1})), kvq::Error);
}

TEST(Tensor, NegativeStridesAndExtentsAreRejected) {
  std::vector<float> x(1000);
  try {
    KVView<float> v(x.data() + 500, Shape{10, 2, 8}, kvq::Strides{-16, 8, 1});
    FAIL();
  } catch (const kvq::Error& e) {
    EXPECT_NE(std::string(e.what()).find("negative stride"), std::string::npos) << e.what();
  }
  EXPECT_THROW((KVView<float>(x.data(), Shape{-1, 2, 8}, kvq::Layout::kNHD)), kvq::Error);
  EXPECT_THROW((KVView<float>(nullptr, Shape{1, 2, 8}, kvq::Layout::kNHD)), kvq::Error);
}

TEST(Tensor, EmptyViewsAreValid) {
  KVView<const float> v(nullptr, Shape{0, 4, 8}, kvq::Layout::kNHD);
  EXPECT_TRUE(v.empty());
  EXPECT_EQ(v.numel(), 0);
}

TEST(Tensor, ErrorMessagesNameTheShape) {
  try {
    std::vector<float> x(8);
    KVView<float>(x.data(), Shape{2, 2, 2}, kvq::Strides{1, 1, 1});
    FAIL();
  } catch (const kvq::Error& e) {
    EXPECT_NE(std::string(e.what()).find("[tokens=2, heads=2, head_dim=2]"), std::string::npos)
        << e.what();
  }
}

}  // namespace

TEST(ToFloatNhd, CopiesAnyViewToContiguousFloats) {
  const kvq::Shape s{3, 2, 4};
  std::vector<kvq::f16> hnd(static_cast<size_t>(s.numel()));
  for (size_t i = 0; i < hnd.size(); ++i) hnd[i] = kvq::f16(0.25f * static_cast<float>(i) - 2.f);
  const kvq::KVView<const kvq::f16> v(hnd.data(), s, kvq::Layout::kHND);  // strided tokens
  const std::vector<float> out = kvq::to_float_nhd(v);
  ASSERT_EQ(out.size(), hnd.size());
  size_t i = 0;
  for (int64_t t = 0; t < s.tokens; ++t)
    for (int64_t h = 0; h < s.heads; ++h)
      for (int64_t d = 0; d < s.head_dim; ++d, ++i)
        EXPECT_EQ(out[i], kvq::to_float(v.at(t, h, d))) << t << " " << h << " " << d;
}
