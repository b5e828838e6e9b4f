// The paged KVCache (cache/kv_cache.hpp over cache/page_arena.hpp): no allocation per decode
// step once reserve()d, the page table an engine reads, pages an "engine" allocates and fills
// with the layout's functions equal the cache's byte for byte, memory_report() equals the
// bytes held, and the limits on blocks and pages are kvq errors.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

#include "kvq/cache/kv_cache.hpp"
#include "kvq/layout/page_layout.hpp"
#include "kvq/policy/spec.hpp"
#include "test_util.hpp"

// Counting global allocator (this test binary only), plain and aligned forms.
namespace {
std::size_t g_allocs = 0;
}
// GCC cannot see that the replaced operator new pairs with free below.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif
void* operator new(std::size_t n) {
  ++g_allocs;
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void* operator new(std::size_t n, std::align_val_t a) {
  ++g_allocs;
  const std::size_t al = static_cast<std::size_t>(a);
  if (void* p = std::aligned_alloc(al, (n + al - 1) / al * al)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }

namespace {

using kvq::KVCache;
using kvq::KVView;
using kvq::parse_policy;
using kvq::Shape;

const char* const kPolicies[] = {"f16",          "fp8",          "k8v4,sinks=4",
                                 "kivi2",        "kivi4,sinks=3", "turbo4",
                                 "k=lm3/qjl,v=lm4,residual=8", "k=int3/head/g16,v=sint8/tensor/g32"};

// After reserve(T), appending T tokens one at a time (a decode loop) allocates nothing: pages
// come from the arena, windows and staging were reserved, the quantizer workspace is grown.
TEST(PagedCache, DecodeAllocatesNothingOnceReserved) {
  const int H = 4, D = 64, T = 300, L = 2;
  for (const char* spec : kPolicies) {
    SCOPED_TRACE(spec);
    KVCache c(parse_policy(spec), L, H, D);
    const auto k = kvq_test::kv_data(Shape{T, H, D}, 1, true);
    const auto v = kvq_test::kv_data(Shape{T, H, D}, 2, false);
    c.reserve(T);
    const std::size_t before = g_allocs;
    for (int t = 0; t < T; ++t)
      for (int l = 0; l < L; ++l)
        c.append(l, KVView<const float>::nhd(k.data() + t * H * D, 1, H, D),
                 KVView<const float>::nhd(v.data() + t * H * D, 1, H, D));
    EXPECT_EQ(g_allocs, before) << "allocations during " << T << " decode steps";
    EXPECT_EQ(c.tokens(0), T);
    EXPECT_GT(c.packed_tokens(0), 0);
    // Without reserve the arena grows geometrically: quadrupling the tokens (about 3x more
    // pages) adds a handful of allocations (O(log n) chunks), not one per page.
    auto unreserved = [&](int tokens) {
      KVCache d(parse_policy(spec), 1, H, D);
      const std::size_t b2 = g_allocs;
      for (int t = 0; t < tokens; ++t)
        d.append(0, KVView<const float>::nhd(k.data() + (t % T) * H * D, 1, H, D),
                 KVView<const float>::nhd(v.data() + (t % T) * H * D, 1, H, D));
      return std::pair<std::size_t, int64_t>{g_allocs - b2, d.packed_tokens(0) / d.block_tokens(0)};
    };
    const auto [a1, p1] = unreserved(T);
    const auto [a4, p4] = unreserved(4 * T);
    EXPECT_GE(p4 - p1, 28);
    EXPECT_LE(a4 - a1, 16u) << a1 << " allocations for " << p1 << " pages, " << a4 << " for " << p4;
  }
}

// The page table and the segments describe the same pages; pages never move while the cache
// grows; memory_report() equals pages x page bytes + the f32 rows.
TEST(PagedCache, PageTableMatchesSegmentsAndPagesDoNotMove) {
  const int H = 2, D = 32;
  KVCache c(parse_policy("kivi2,sinks=5"), 1, H, D, 0, kvq::KVCacheOptions{true});
  const auto k = kvq_test::kv_data(Shape{400, H, D}, 3, true);
  const auto v = kvq_test::kv_data(Shape{400, H, D}, 4, false);
  c.append(0, KVView<const float>::nhd(k.data(), 100, H, D),
           KVView<const float>::nhd(v.data(), 100, H, D));
  const kvq::PageTable t0 = c.page_table(0);
  std::vector<const std::byte*> first(t0.pages, t0.pages + t0.n_pages);
  for (int i = 100; i < 400; ++i)
    c.append(0, KVView<const float>::nhd(k.data() + i * H * D, 1, H, D),
             KVView<const float>::nhd(v.data() + i * H * D, 1, H, D));
  const kvq::PageTable t = c.page_table(0);
  ASSERT_GE(t.n_pages, static_cast<int64_t>(first.size()));
  for (std::size_t i = 0; i < first.size(); ++i) EXPECT_EQ(t.pages[i], first[i]);
  EXPECT_EQ(t.first_token, 5);
  EXPECT_EQ(t.tokens, c.packed_tokens(0));
  EXPECT_EQ(t.n_pages * t.layout.page_tokens, t.tokens);
  int64_t j = 0;
  c.for_each_segment(0, [&](const kvq::CacheSegment& s) {
    if (!s.packed()) return;
    EXPECT_EQ(s.begin, t.first_token + j * t.layout.page_tokens);
    EXPECT_EQ(s.key_view.codes, t.key_view(j).codes);
    EXPECT_EQ(s.value_view.scales, t.value_view(j).scales);
    EXPECT_EQ(reinterpret_cast<const std::byte*>(s.key_view.codes), t.pages[j]);
    ++j;
  });
  EXPECT_EQ(j, t.n_pages);
  const kvq::MemoryReport m = c.memory_report();
  const kvq::LayerMemory& lm = m.layers[0];
  EXPECT_EQ(lm.key.packed.total() + lm.value.packed.total(),
            static_cast<std::size_t>(t.n_pages) * t.layout.bytes);
  EXPECT_EQ(lm.key.sinks, 5u * H * D * 4);
  EXPECT_EQ(lm.key.residual, static_cast<std::size_t>(c.residual_tokens(0) * H * D * 4));
  EXPECT_EQ(lm.key.rollback, static_cast<std::size_t>(t.layout.page_tokens * H * D * 4));
  EXPECT_EQ(lm.page_bytes, t.layout.bytes);
  EXPECT_GT(m.scratch, 0u);
}

// An engine allocates its own pages, fills them with quantize_page() from the same tokens, and
// gets the cache's page bytes, views and dequantized data.
TEST(PagedCache, EnginePagesEqualTheCachePages) {
  const int H = 4, D = 64, T = 200;
  for (const char* spec : kPolicies) {
    SCOPED_TRACE(spec);
    const kvq::Policy p = parse_policy(spec);
    KVCache c(p, 1, H, D);
    const auto k = kvq_test::kv_data(Shape{T, H, D}, 5, true);
    const auto v = kvq_test::kv_data(Shape{T, H, D}, 6, false);
    c.append(0, KVView<const float>::nhd(k.data(), 77, H, D),
             KVView<const float>::nhd(v.data(), 77, H, D));
    for (int i = 77; i < T; ++i)
      c.append(0, KVView<const float>::nhd(k.data() + i * H * D, 1, H, D),
               KVView<const float>::nhd(v.data() + i * H * D, 1, H, D));
    const kvq::PageTable t = c.page_table(0);
    ASSERT_GT(t.n_pages, 0);
    // The engine's side: its own layout (from the same configs), its own memory.
    const kvq::PageLayout L = kvq::make_page_layout(c.key_config(0), c.value_config(0),
                                                    c.block_tokens(0), H, D);
    EXPECT_EQ(L.bytes, t.layout.bytes);
    std::vector<std::byte*> pages;
    kvq::QuantWorkspace ws;
    for (int64_t j = 0; j < t.n_pages; ++j) {
      auto* page = static_cast<std::byte*>(::operator new(L.bytes, std::align_val_t(64)));
      std::memset(page, 0, L.bytes);
      const int64_t first = t.first_token + j * L.page_tokens;
      kvq::quantize_page(L, page, 0,
                         KVView<const float>::nhd(k.data() + first * H * D, L.page_tokens, H, D),
                         KVView<const float>::nhd(v.data() + first * H * D, L.page_tokens, H, D),
                         ws);
      pages.push_back(page);
    }
    for (int64_t j = 0; j < t.n_pages; ++j) {
      EXPECT_EQ(std::memcmp(pages[j], t.pages[j], L.bytes), 0) << "page " << j;
      const kvq::PackedView ev = L.key_view(pages[j]), cv = t.key_view(j);
      EXPECT_EQ(ev.shape, cv.shape);
      EXPECT_EQ(ev.codes - reinterpret_cast<const uint8_t*>(pages[j]),
                cv.codes - reinterpret_cast<const uint8_t*>(t.pages[j]));
      const int64_t n = L.page_tokens;
      std::vector<float> ek(n * H * D), ev2(ek.size()), ck(ek.size()), cv2(ek.size());
      kvq::dequantize_page(L, pages[j], n, 0, n, KVView<float>::nhd(ek.data(), n, H, D),
                           KVView<float>::nhd(ev2.data(), n, H, D), ws);
      const int64_t first = t.first_token + j * n;
      c.read(0, first, first + n, KVView<float>::nhd(ck.data(), n, H, D),
             KVView<float>::nhd(cv2.data(), n, H, D));
      EXPECT_EQ(ek, ck);
      EXPECT_EQ(ev2, cv2);
    }
    for (std::byte* page : pages) ::operator delete(page, std::align_val_t(64));
  }
}

// Blocks and pages have limits, reported as kvq errors at parse / construction time (the old
// cache took `k=int4/channel/g16777216` and zero-filled a 64 GiB block at the first flush).
TEST(PagedCache, BlockAndPageLimitsAreErrors) {
  auto error = [](auto&& f) -> std::string {
    try {
      f();
    } catch (const kvq::Error& e) {
      return std::string(kvq::to_string(e.kind())) + ": " + e.what();
    }
    return "no error";
  };
  const std::string big = error([] { parse_policy("k=int4/channel/g16777216,v=f16"); });
  EXPECT_NE(big.find("parse"), std::string::npos) << big;
  EXPECT_NE(big.find("4096 tokens per block"), std::string::npos) << big;
  // lcm of two acceptable groups beyond the limit.
  const std::string lcm = error([] { parse_policy("k=int4/channel/g4095,v=int4/head/g4094"); });
  EXPECT_NE(lcm.find("lcm"), std::string::npos) << lcm;
  // Hand-built policies get the same check from the cache.
  kvq::Policy p = parse_policy("kivi2");
  p.key.group = 1 << 24;
  const std::string hand = error([&] { KVCache(p, 1, 8, 128); });
  EXPECT_NE(hand.find("4096 tokens per block"), std::string::npos) << hand;
  // A page (and its f32 staging) beyond kMaxPageBytes: refused before allocating it.
  const std::size_t before = g_allocs;
  const std::string page = error([] { KVCache(parse_policy("f32"), 1, 1 << 16, 1 << 12); });
  EXPECT_NE(page.find("out of range"), std::string::npos) << page;
  EXPECT_LT(g_allocs - before, 100u);
  EXPECT_NO_THROW(parse_policy("k=int4/channel/g4096,v=int4/token/g32"));
}

}  // namespace
