// Page layouts for engine-owned pages (policy/layout.hpp): the layout from a policy equals the
// one KVCache uses; page sizes that would split a scale group are refused naming both numbers
// (never a silently different quantizer); token-local formats take small pages at the cost
// computed by hand; and a default cache spends no memory on rollback rows.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "kvq/cache/kv_cache.hpp"
#include "kvq/policy/layout.hpp"
#include "kvq/policy/spec.hpp"
#include "test_util.hpp"

namespace {

using kvq::KVView;
using kvq::parse_policy;
using kvq::Shape;

TEST(EngineLayout, PolicyLayoutEqualsTheCacheLayout) {
  const int H = 4, D = 64, L = 3;
  for (const char* spec : {"f16", "fp8", "k8v4", "kivi2", "kivi4,sinks=3", "turbo4",
                           "k=int3/head/g16,v=sint8/tensor/g32", "kivi4,k@1=lm3,v@1=lm3",
                           "k=int4/channel/g64,v=int2/token/g32"}) {
    SCOPED_TRACE(spec);
    const kvq::Policy p = parse_policy(spec);
    kvq::KVCache c(p, L, H, D);
    for (int l = 0; l < L; ++l) {
      const int64_t P = kvq::cache_page_tokens(p, l, L);
      EXPECT_EQ(P, c.block_tokens(l));
      const kvq::PageLayout mine = kvq::make_page_layout(p, l, L, P, H, D);
      const kvq::PageLayout& theirs = c.page_layout(l);
      EXPECT_EQ(mine.bytes, theirs.bytes);
      EXPECT_EQ(mine.data, theirs.data);
      EXPECT_EQ(mine.granule, theirs.granule);
      EXPECT_EQ(mine.page_tokens, theirs.page_tokens);
      EXPECT_EQ(mine.k.codes.offset, theirs.k.codes.offset);
      EXPECT_EQ(mine.v.codes.offset, theirs.v.codes.offset);
      EXPECT_EQ(mine.v.scales.bytes, theirs.v.scales.bytes);
      EXPECT_TRUE(kvq::same_config(mine.key, theirs.key));
      EXPECT_TRUE(kvq::same_config(mine.value, theirs.value));
      // A multiple of the cache's page size is as good a page for an engine.
      const kvq::PageLayout twice = kvq::make_page_layout(p, l, L, 2 * P, H, D);
      EXPECT_EQ(twice.data, 2 * mine.data);
    }
  }
}

// vLLM's default page is 16 tokens; kivi4's keys and k8v4's fp8 key scales span 32-token groups.
TEST(EngineLayout, PagesThatSplitAGroupAreRefusedByName) {
  const int H = 8, D = 128;
  for (const char* spec : {"kivi4", "k8v4"}) {
    for (int64_t P : {8, 16, 48}) {
      SCOPED_TRACE(std::string(spec) + " page " + std::to_string(P));
      try {
        kvq::make_page_layout(parse_policy(spec), 0, 1, P, H, D);
        ADD_FAILURE() << "accepted";
      } catch (const kvq::Error& e) {
        EXPECT_EQ(e.kind(), kvq::ErrorKind::kShapeMismatch);
        const std::string w = e.what();
        EXPECT_NE(w.find("page_tokens " + std::to_string(P)), std::string::npos) << w;
        EXPECT_NE(w.find("token group of 32"), std::string::npos) << w;
        EXPECT_NE(w.find("key config"), std::string::npos) << w;
      }
    }
  }
  // The value side is named when it is the one that does not fit.
  try {
    kvq::make_page_layout(parse_policy("k=int4/token/g32,v=int4/channel/g64"), 0, 1, 32, H, D);
    ADD_FAILURE() << "accepted";
  } catch (const kvq::Error& e) {
    EXPECT_NE(std::string(e.what()).find("value config's token group of 64"), std::string::npos)
        << e.what();
  }
  // The configs' own function refuses the same (not only the policy overload).
  EXPECT_THROW(kvq::make_page_layout(kvq::parse_quant_config("int4/channel/g32"),
                                     kvq::parse_quant_config("f16"), 16, H, D),
               kvq::Error);
}

// Hand-computed: turbo4 stores 4-bit codes and one fp16 norm per (token, head); kivi4 stores
// 4-bit codes with an fp16 scale and zero per 32 values (5 bits per value).
TEST(EngineLayout, TokenLocalFormatsTakeSmallPagesAtTheirCost) {
  const int64_t H = 8, D = 128;
  for (int64_t P : {8, 16, 48}) {
    SCOPED_TRACE(P);
    const kvq::PageLayout t = kvq::make_page_layout(parse_policy("turbo4"), 0, 1, P, H, D);
    const std::size_t per_tensor = static_cast<std::size_t>(P * H * D / 2 + P * H * 2);
    EXPECT_EQ(t.data, 2 * per_tensor);
    EXPECT_EQ(t.bytes % 64, 0u);
    EXPECT_GE(t.bytes, t.data);
  }
  const kvq::PageLayout k = kvq::make_page_layout(parse_policy("kivi4"), 0, 1, 64, H, D);
  EXPECT_EQ(k.data, static_cast<std::size_t>(2 * 64 * H * D * 5 / 8));
}

// The default cache keeps no f32 rollback rows: int2 keys per channel and values per token with
// no window, on whole groups, cost exactly 3 bits per value (2 code bits + an fp16 scale and
// zero per 32 values).
TEST(EngineLayout, DefaultCacheStoresNoRollbackRows) {
  const int H = 2, D = 32, T = 256;
  kvq::KVCache c(parse_policy("k=int2/channel/g32,v=int2/token/g32"), 2, H, D);
  EXPECT_FALSE(c.options().exact_rollback);
  const auto k = kvq_test::kv_data(Shape{T, H, D}, 1, true);
  const auto v = kvq_test::kv_data(Shape{T, H, D}, 2, false);
  for (int l = 0; l < 2; ++l)
    c.append(l, KVView<const float>::nhd(k.data(), T, H, D), KVView<const float>::nhd(v.data(), T, H, D));
  const kvq::MemoryReport m = c.memory_report();
  EXPECT_EQ(m.key_total().rollback + m.value_total().rollback, 0u);
  EXPECT_EQ(m.total(), static_cast<std::size_t>(2 * 2 * T * H * D * 3 / 8));
  EXPECT_DOUBLE_EQ(m.effective_bits(), 3.0);
  // Opted in, the newest page's f32 originals are held: B = 32 rows of K and V per layer.
  kvq::KVCache r(parse_policy("k=int2/channel/g32,v=int2/token/g32"), 2, H, D, 0,
                 kvq::KVCacheOptions{true});
  for (int l = 0; l < 2; ++l)
    r.append(l, KVView<const float>::nhd(k.data(), T, H, D), KVView<const float>::nhd(v.data(), T, H, D));
  const kvq::MemoryReport mr = r.memory_report();
  EXPECT_EQ(mr.key_total().rollback + mr.value_total().rollback,
            static_cast<std::size_t>(2 * 2 * 32 * H * D * 4));
}

}  // namespace

namespace {

// quantize_page on an engine's page names the tensor, the page tokens and the first bad element;
// a null page is named as such.
TEST(EngineLayout, PageErrorsNameWhatIsWrong) {
  const int H = 2, D = 32, P = 32;
  const kvq::PageLayout L = kvq::make_page_layout(parse_policy("kivi4"), 0, 1, P, H, D);
  std::vector<std::byte> page(L.bytes + 64);
  std::byte* p = page.data();
  while (reinterpret_cast<std::uintptr_t>(p) % 64) ++p;
  auto k = kvq_test::kv_data(Shape{P, H, D}, 1, true);
  auto v = kvq_test::kv_data(Shape{P, H, D}, 2, false);
  v[(5 * H + 1) * D + 7] = std::nanf("");
  kvq::QuantWorkspace ws;
  auto message = [&](std::byte* where) {
    try {
      kvq::quantize_page(L, where, 0, KVView<const float>::nhd(k.data(), P, H, D),
                         KVView<const float>::nhd(v.data(), P, H, D), ws);
    } catch (const kvq::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const std::string m = message(p);
  for (const char* part : {"non-finite", "the values of page tokens [0, 32)", "page token 5",
                           "head 1", "channel 7"})
    EXPECT_NE(m.find(part), std::string::npos) << part << " not in: " << m;
  EXPECT_EQ(m.find("the keys"), std::string::npos) << m;
  const std::string n = message(nullptr);
  EXPECT_NE(n.find("page pointer is null"), std::string::npos) << n;
}

}  // namespace
