// Tests for layout/page_layout.hpp: regions aligned and disjoint, page bytes == accountant +
// padding, the documented preset pages (docs/layout.md), quantize_page() of any granule-aligned
// token range writes exactly the bytes quantize() gives, views and token-range reads of a page
// equal the QTensor path, and bad layouts / ranges are errors. KVQ_TEST_SCALAR_TOO
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "kvq/accounting/accountant.hpp"
#include "kvq/layout/page_layout.hpp"
#include "kvq/policy/spec.hpp"
#include "kvq/quant/quantize.hpp"
#include "test_util.hpp"

namespace {

using kvq::Axis;
using kvq::Format;
using kvq::KVView;
using kvq::PageLayout;
using kvq::QuantConfig;
using kvq::Shape;

// Sizes that are fixed by the formats (docs/layout.md), checked at compile time.
static_assert(kvq::kPageAlign == 64 && kvq::page_align(0) == 0 && kvq::page_align(1) == 64 &&
              kvq::page_align(64) == 64 && kvq::page_align(65) == 128);
static_assert(kvq::packed_bytes(32 * 8 * 128, 2) == 8192, "kivi2 K/V codes of a 32-token page");
static_assert(kvq::packed_bytes(32 * 8 * 128, 4) == 16384, "int4 codes of a 32-token page");
static_assert(kvq::packed_bytes(16 * 8 * 128, 3) == 6144, "lm3 codes of a 16-token page");
static_assert(kvq::packed_bytes(16 * 8 * 128, 1) == 2048, "QJL signs of a 16-token page");

/// Every (key, value) pair of formats to lay out: each stored format as keys, paired with a
/// different value format so both halves of the page are exercised.
std::vector<std::pair<QuantConfig, QuantConfig>> pairs() {
  std::vector<QuantConfig> v;
  for (Format f : {Format::kF32, Format::kF16, Format::kBF16}) v.push_back(kvq::raw_config(f));
  for (int bits : {2, 3, 4, 8})
    for (bool sym : {false, true})
      for (Axis a : {Axis::kToken, Axis::kChannel, Axis::kHead, Axis::kTensor}) {
        QuantConfig c = kvq::int_config(bits, a, a == Axis::kToken ? 16 : 8, sym);
        if (bits == 3) c.meta = kvq::MetaDType::kF32;
        v.push_back(c);
      }
  for (Format f : {Format::kE4M3, Format::kE5M2})
    for (Axis a : {Axis::kToken, Axis::kHead, Axis::kTensor})
      v.push_back(kvq::fp8_config(f, a, a == Axis::kToken ? 0 : 16));
  for (int b = 1; b <= 4; ++b)
    for (bool qjl : {false, true}) v.push_back(kvq::lm_config(b, qjl));
  v.push_back(kvq::fp4_config(Format::kNvfp4));
  v.push_back(kvq::fp4_config(Format::kMxfp4));
  v.push_back(kvq::fp4_config(Format::kNvfp4, 0.125f));
  std::vector<std::pair<QuantConfig, QuantConfig>> out;
  for (std::size_t i = 0; i < v.size(); ++i) {
    QuantConfig val = v[(i * 7 + 3) % v.size()];
    val.qjl = false;
    out.emplace_back(v[i], val);
  }
  return out;
}

TEST(PageLayout, RegionsAlignedDisjointAndPageBytesEqualAccountantPlusPadding) {
  for (const auto& [k, v] : pairs())
    for (int64_t H : {1, 3, 8})
      for (int64_t D : {8, 64, 128}) {
        // FP4 blocks need head_dim a multiple of 16 / 32 (refused otherwise: BadLayouts...).
        if (D % 32 != 0 && (kvq::is_fp4(k.format) || kvq::is_fp4(v.format))) continue;
        const int64_t P = 32;
        const PageLayout L = kvq::make_page_layout(k, v, P, H, D);
        SCOPED_TRACE(k.name() + " / " + v.name() + " H=" + std::to_string(H) +
                     " D=" + std::to_string(D));
        EXPECT_EQ(L.bytes % kvq::kPageAlign, 0u);
        const Shape s{P, H, D};
        kvq::ByteBreakdown acc = kvq::account(k, s);
        acc += kvq::account(v, s);
        kvq::ByteBreakdown b = L.breakdown();
        EXPECT_EQ(b.total(), L.bytes);
        EXPECT_EQ(b.padding, L.bytes - acc.total());
        b.padding = 0;
        EXPECT_EQ(b, acc);
        EXPECT_EQ(L.data, acc.total());
        std::size_t end = 0;
        for (const kvq::TensorRegions* r : {&L.k, &L.v})
          for (const kvq::PageRegion* g :
               {&r->codes, &r->scales, &r->zeros, &r->norms, &r->qjl_signs, &r->qjl_norms}) {
            if (g->bytes == 0) continue;
            EXPECT_EQ(g->offset % kvq::kPageAlign, 0u);
            EXPECT_GE(g->offset, end);  // in order, no overlap
            end = g->offset + g->bytes;
          }
        EXPECT_LE(end, L.bytes);
        EXPECT_LT(L.bytes - end, kvq::kPageAlign);
        EXPECT_LE(L.padding(), 11 * (kvq::kPageAlign - 1) + kvq::kPageAlign - 1);
      }
}

// The preset pages docs/layout.md tabulates (8 KV heads x 128, B from the cache's block rule).
TEST(PageLayout, DocumentedPresetPages) {
  struct Row {
    const char* preset;
    int64_t B;
    std::size_t bytes, padding, value_offset;
  };
  for (const Row& r : {Row{"f16", 16, 65536, 0, 32768}, Row{"fp8", 32, 65664, 96, 32832},
                       Row{"k8v4", 32, 53312, 48, 32832}, Row{"kivi2", 32, 24576, 0, 12288},
                       Row{"kivi4", 32, 40960, 0, 20480}, Row{"turbo3", 16, 12800, 0, 6400},
                       Row{"turbo4", 16, 16896, 0, 8448},
                       // FP4 (token-axis blocks: B = the 16-token minimum). nvfp4: 16 x 8 x 128
                       // / 2 = 8192 code bytes + 16 x 8 x 8 = 1024 e4m3 scales = 9216 per
                       // tensor; mxfp4: 8192 + 16 x 8 x 4 = 512 e8m0 scales = 8704.
                       Row{"k=nvfp4,v=nvfp4", 16, 18432, 0, 9216},
                       Row{"k=mxfp4,v=mxfp4", 16, 17408, 0, 8704},
                       // e4m3/head streams 32-token blocks (as k8v4): K 32832 bytes (48 of
                       // them padding), V 32 x 8 x 128 / 2 + 32 x 8 x 8 = 18432.
                       Row{"k=e4m3/head,v=nvfp4", 32, 51264, 48, 32832}}) {
    const kvq::Policy p = kvq::parse_policy(r.preset);
    const QuantConfig k = kvq::detail::streaming_config(p.key);
    const QuantConfig v = kvq::detail::streaming_config(p.value);
    ASSERT_EQ(kvq::detail::stream_block_tokens(k, v), r.B) << r.preset;
    const PageLayout L = kvq::make_page_layout(k, v, r.B, 8, 128);
    EXPECT_EQ(L.bytes, r.bytes) << r.preset;
    EXPECT_EQ(L.padding(), r.padding) << r.preset;
    EXPECT_EQ(L.v.codes.offset, r.value_offset) << r.preset;
  }
}

/// A page of garbage, so every byte quantize_page owns must be written by it.
std::vector<std::byte> garbage_page(const PageLayout& L) {
  return std::vector<std::byte>(L.bytes + 64, std::byte{0x5A});
}
std::byte* aligned(std::vector<std::byte>& v) {
  auto p = reinterpret_cast<std::uintptr_t>(v.data());
  return v.data() + ((64 - p % 64) % 64);
}

bool region_equals(const std::byte* page, const kvq::PageRegion& g, std::size_t off,
                   const std::vector<uint8_t>& want) {
  if (want.empty()) return true;
  return std::memcmp(page + g.offset + off, want.data(), want.size()) == 0;
}

// quantize_page() of granule-aligned token ranges writes exactly quantize()'s bytes of those
// tokens at their place, and reading any token range back equals the QTensor path.
TEST(PageLayout, QuantizePageRangesEqualQuantizeAndReadsEqualTheQTensorPath) {
  const int64_t P = 32, H = 2, D = 64;
  const Shape s{P, H, D};
  const auto kd = kvq_test::kv_data(s, 1, true), vd = kvq_test::kv_data(s, 2, false);
  const KVView<const float> kx(kd.data(), s), vx(vd.data(), s);
  int checked = 0;
  for (const auto& [k, v] : pairs()) {
    const PageLayout L = kvq::make_page_layout(k, v, P, H, D);
    SCOPED_TRACE(k.name() + " / " + v.name() + " granule " + std::to_string(L.granule));
    auto mem = garbage_page(L);
    std::byte* page = aligned(mem);
    kvq::QuantWorkspace ws;
    // Fill the page in two or more granule-aligned ranges.
    const int64_t step = L.granule < P ? std::max<int64_t>(L.granule, P / 4 / L.granule * L.granule) : P;
    for (int64_t t0 = 0; t0 < P; t0 += step) {
      const int64_t n = std::min(step, P - t0);
      kvq::quantize_page(L, page, t0, kx.slice_tokens(t0, n), vx.slice_tokens(t0, n), ws);
    }
    const kvq::QTensor qk = kvq::quantize(k, kx), qv = kvq::quantize(v, vx);
    for (const auto& [q, r] : {std::pair{&qk, &L.k}, std::pair{&qv, &L.v}}) {
      EXPECT_TRUE(region_equals(page, r->codes, 0, q->codes));
      EXPECT_TRUE(region_equals(page, r->scales, 0, q->scales.raw()));
      EXPECT_TRUE(region_equals(page, r->zeros, 0, q->zeros.raw()));
      EXPECT_TRUE(region_equals(page, r->norms, 0, q->norms.raw()));
      EXPECT_TRUE(region_equals(page, r->qjl_signs, 0, q->qjl_signs));
      EXPECT_TRUE(region_equals(page, r->qjl_norms, 0, q->qjl_norms.raw()));
    }
    // Views of the page dequantize like the QTensors; any token range too.
    std::vector<float> wk(kd.size()), wv(vd.size()), gk(kd.size()), gv(vd.size());
    kvq::dequantize(qk, KVView<float>(wk.data(), s));
    kvq::dequantize(qv, KVView<float>(wv.data(), s));
    kvq::dequantize(L.key_view(page), KVView<float>(gk.data(), s));
    kvq::dequantize(L.value_view(page), KVView<float>(gv.data(), s));
    EXPECT_EQ(gk, wk);
    EXPECT_EQ(gv, wv);
    for (auto [a, b] : {std::pair<int64_t, int64_t>{0, 1}, {3, 29}, {17, 32}, {31, 32}}) {
      std::vector<float> rk((b - a) * H * D), rv(rk.size());
      kvq::dequantize_page(L, page, P, a, b, KVView<float>::nhd(rk.data(), b - a, H, D),
                           KVView<float>::nhd(rv.data(), b - a, H, D), ws);
      EXPECT_TRUE(std::equal(rk.begin(), rk.end(), wk.begin() + a * H * D)) << a << ".." << b;
      EXPECT_TRUE(std::equal(rv.begin(), rv.end(), wv.begin() + a * H * D)) << a << ".." << b;
    }
    // A partially filled page (its first granule-aligned tokens) views as a shorter tensor.
    if (L.granule < P) {
      const int64_t f = L.granule * ((P / 2) / L.granule > 0 ? (P / 2) / L.granule : 1);
      const kvq::QTensor hk = kvq::quantize(k, kx.slice_tokens(0, f));
      std::vector<float> a(static_cast<std::size_t>(f * H * D)), b2(a.size());
      kvq::dequantize(hk, KVView<float>::nhd(a.data(), f, H, D));
      kvq::dequantize(L.key_view(page, f), KVView<float>::nhd(b2.data(), f, H, D));
      EXPECT_EQ(a, b2);
    }
    ++checked;
  }
  EXPECT_EQ(checked, 3 + 32 + 6 + 8 + 3);
}

TEST(PageLayout, BadLayoutsAndRangesAreErrors) {
  const QuantConfig i4c = kvq::int_config(4, Axis::kChannel, 32);
  const QuantConfig f16 = kvq::raw_config(Format::kF16);
  auto kind = [](auto&& f) {
    try {
      f();
    } catch (const kvq::Error& e) {
      return e.kind();
    }
    return kvq::ErrorKind::kIo;  // stands for "no throw" (no layout call does I/O)
  };
  // A 32-token channel group does not divide a 48-token page.
  EXPECT_EQ(kind([&] { kvq::make_page_layout(i4c, f16, 48, 8, 128); }),
            kvq::ErrorKind::kShapeMismatch);
  EXPECT_EQ(kind([&] { kvq::make_page_layout(i4c, f16, 0, 8, 128); }),
            kvq::ErrorKind::kInvalidArgument);
  // 2^24 tokens x 8 x 128 f32 would be a 64 GiB page: refused before any allocation.
  EXPECT_EQ(kind([&] { kvq::make_page_layout(kvq::raw_config(Format::kF32), f16, 1 << 24, 8, 128); }),
            kvq::ErrorKind::kOutOfRange);
  QuantConfig bad = kvq::int_config(4, Axis::kToken, 32);
  bad.bits = 5;
  EXPECT_EQ(kind([&] { kvq::make_page_layout(bad, f16, 32, 8, 128); }),
            kvq::ErrorKind::kInvalidArgument);
  // FP4 blocks must tile head_dim: nvfp4 on head_dim 24, mxfp4 on 48, refused naming it.
  for (const auto& [c, D] : {std::pair{kvq::fp4_config(Format::kNvfp4), int64_t{24}},
                             std::pair{kvq::fp4_config(Format::kMxfp4), int64_t{48}}}) {
    try {
      kvq::make_page_layout(f16, c, 32, 8, D);
      ADD_FAILURE() << c.name() << " laid out on head_dim " << D;
    } catch (const kvq::Error& e) {
      EXPECT_EQ(e.kind(), kvq::ErrorKind::kShapeMismatch);
      EXPECT_NE(std::string(e.what()).find("needs head_dim to be a multiple of its block"),
                std::string::npos)
          << e.what();
    }
  }
  // Ranges must be granule-aligned and inside the page.
  const PageLayout L = kvq::make_page_layout(i4c, f16, 64, 2, 16);
  EXPECT_EQ(L.granule, 32);
  std::vector<std::byte> mem(L.bytes + 64);
  std::byte* page = aligned(mem);
  std::vector<float> x(16 * 2 * 16, 1.f);
  kvq::QuantWorkspace ws;
  const auto v16 = KVView<const float>::nhd(x.data(), 16, 2, 16);
  EXPECT_EQ(kind([&] { kvq::quantize_page(L, page, 0, v16, v16, ws); }),
            kvq::ErrorKind::kInvalidArgument);
  EXPECT_EQ(kind([&] { L.key_view(page, 16); }), kvq::ErrorKind::kInvalidArgument);
  EXPECT_EQ(kind([&] { L.key_span(page, 64, 32); }), kvq::ErrorKind::kInvalidArgument);
  EXPECT_NO_THROW(L.key_view(page, 32));
}

}  // namespace
