// Exact rollback of the paged KVCache (issue 15 item 10): a speculative loop (append k draft
// tokens, truncate back, append the accepted ones) leaves the cache identical to one that only
// ever saw the accepted tokens — page bytes, f32 windows and attention outputs — for every
// k = 1..B, across the residual window, sinks and page boundaries.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "kvq/attention/attention.hpp"
#include "kvq/cache/kv_cache.hpp"
#include "kvq/policy/spec.hpp"
#include "test_util.hpp"

namespace {

using kvq::KVCache;
using kvq::KVView;
using kvq::parse_policy;
using kvq::Shape;

/// Every byte of a layer, in token order: segment kinds and ranges, page bytes, f32 rows.
std::vector<uint8_t> layer_bytes(const KVCache& c, int layer) {
  std::vector<uint8_t> out;
  auto put = [&](const void* p, std::size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    out.insert(out.end(), b, b + n);
  };
  const kvq::PageTable t = c.page_table(layer);
  for (int64_t j = 0; j < t.n_pages; ++j) put(t.pages[j], t.layout.bytes);
  c.for_each_segment(layer, [&](const kvq::CacheSegment& s) {
    const int64_t tag[3] = {static_cast<int64_t>(s.kind), s.begin, s.end};
    put(tag, sizeof tag);
    if (!s.packed()) {
      put(s.key_rows.data(), static_cast<std::size_t>(s.key_rows.numel()) * 4);
      put(s.value_rows.data(), static_cast<std::size_t>(s.value_rows.numel()) * 4);
    }
  });
  return out;
}

/// Causal attention of 3 queries at the newest positions (kvq::attend).
std::vector<float> attention(const KVCache& c, int layer, const std::vector<float>& q, int nq,
                             int n_heads) {
  std::vector<float> out(q.size());
  const int D = c.head_dim();
  kvq::attend(c, layer, KVView<const float>::nhd(q.data(), nq, n_heads, D),
              KVView<float>::nhd(out.data(), nq, n_heads, D), true);
  return out;
}

void append(KVCache& c, const std::vector<float>& k, const std::vector<float>& v, int64_t first,
            int64_t n) {
  const int H = c.kv_heads(), D = c.head_dim();
  for (int l = 0; l < c.n_layers(); ++l)
    c.append(l, KVView<const float>::nhd(k.data() + first * H * D, n, H, D),
             KVView<const float>::nhd(v.data() + first * H * D, n, H, D));
}

class SpeculativeRollback : public ::testing::TestWithParam<const char*> {};

TEST_P(SpeculativeRollback, EqualsACacheThatOnlySawTheAcceptedTokens) {
  const int H = 2, D = 32, NH = 4, L = 2;
  const kvq::Policy p = parse_policy(GetParam());
  const int64_t total = 420;
  const auto truth_k = kvq_test::kv_data(Shape{total, H, D}, 7, true);
  const auto truth_v = kvq_test::kv_data(Shape{total, H, D}, 8, false);
  const auto junk_k = kvq_test::kv_data(Shape{total, H, D}, 9, true);
  const auto junk_v = kvq_test::kv_data(Shape{total, H, D}, 10, false);
  const auto q = kvq_test::kv_data(Shape{3, NH, D}, 11, false);
  const kvq::KVCacheOptions exact{true};  // opt-in (off by default)
  KVCache spec(p, L, H, D, 0, exact), plain(p, L, H, D, 0, exact);
  const int64_t B = spec.block_tokens(0);
  std::mt19937 rng(12);
  int64_t n = 0, steps = 0, unpacked = 0;
  int64_t k_seen_max = 0;
  while (n + 2 * B + 2 < total) {
    // Draft k tokens (k = 1..B, every value seen), mostly junk: the target model rejects them.
    const int64_t k = 1 + (steps % B);
    k_seen_max = std::max(k_seen_max, k);
    const int64_t packed_before = spec.packed_tokens(0);
    append(spec, junk_k, junk_v, n, k);
    if (spec.packed_tokens(0) > packed_before) ++unpacked;  // the drafts flushed a page
    spec.truncate(n);
    // Accept a = 0..k tokens of the truth plus the target model's own next token.
    const int64_t a = std::uniform_int_distribution<int64_t>(0, k)(rng) + 1;
    append(spec, truth_k, truth_v, n, a);
    append(plain, truth_k, truth_v, n, a);
    n += a;
    for (int l = 0; l < L; ++l) {
      ASSERT_EQ(spec.tokens(l), n);
      ASSERT_EQ(layer_bytes(spec, l), layer_bytes(plain, l)) << "step " << steps << " n " << n;
      // Same bytes held, except that after unpacking a page the speculative cache no longer
      // keeps the previous page's originals (bounded memory); it never holds more.
      kvq::StreamBytes a = spec.memory_report().layers[l].key;
      kvq::StreamBytes b = plain.memory_report().layers[l].key;
      ASSERT_LE(a.rollback, b.rollback);
      a.rollback = b.rollback = 0;
      ASSERT_EQ(a, b);
    }
    if (n >= 3) {
      ASSERT_EQ(attention(spec, 1, q, 3, NH), attention(plain, 1, q, 3, NH));
    }
    ++steps;
  }
  EXPECT_EQ(k_seen_max, B);
  EXPECT_GT(unpacked, 3) << "drafts never crossed a flush";
  EXPECT_GT(spec.packed_tokens(0), 4 * B);
}

INSTANTIATE_TEST_SUITE_P(Policies, SpeculativeRollback,
                         ::testing::Values("kivi2", "kivi2,residual=0,sinks=4",
                                           "kivi4,residual=5,sinks=1", "fp8,residual=4",
                                           "turbo4,sinks=2", "k8v4,residual=40", "f16"));

// The issue's example: kivi2 with 70 tokens holds 32 packed + 38 f32; append 30 drafts (which
// flush a block) and truncate back to 70: again 32 packed + 38 f32, the same bytes as never
// having seen the drafts. With exact_rollback off, the old behaviour (64 packed + 6 f32).
TEST(Rollback, IssueExampleKivi2) {
  const int H = 2, D = 16;
  const auto k = kvq_test::kv_data(Shape{100, H, D}, 1, true);
  const auto v = kvq_test::kv_data(Shape{100, H, D}, 2, false);
  const kvq::KVCacheOptions exact{true};
  KVCache c(parse_policy("kivi2"), 1, H, D, 0, exact), never(parse_policy("kivi2"), 1, H, D, 0, exact);
  append(c, k, v, 0, 70);
  append(never, k, v, 0, 70);
  EXPECT_EQ(c.packed_tokens(0), 32);
  EXPECT_EQ(c.residual_tokens(0), 38);
  append(c, k, v, 70, 30);
  EXPECT_EQ(c.packed_tokens(0), 64);
  EXPECT_TRUE(c.truncate_is_exact(0, 70));
  c.truncate(70);
  EXPECT_EQ(c.packed_tokens(0), 32);
  EXPECT_EQ(c.residual_tokens(0), 38);
  EXPECT_EQ(layer_bytes(c, 0), layer_bytes(never, 0));

  KVCache old(parse_policy("kivi2"), 1, H, D, 0, kvq::KVCacheOptions{false});
  append(old, k, v, 0, 100);
  old.truncate(70);
  EXPECT_EQ(old.packed_tokens(0), 64);
  EXPECT_EQ(old.residual_tokens(0), 6);
  EXPECT_EQ(old.memory_report().layers[0].key.rollback, 0u);
}

// Rolling back into the newest page keeps its tokens exact (their originals), where an older
// page can only give back its dequantized values.
TEST(Rollback, CutInsideTheNewestPageIsExactOlderPagesAreReRounded) {
  const int H = 2, D = 16;
  const auto k = kvq_test::kv_data(Shape{200, H, D}, 3, true);
  const auto v = kvq_test::kv_data(Shape{200, H, D}, 4, false);
  KVCache c(parse_policy("kivi4,residual=0,sinks=2"), 1, H, D, 0, kvq::KVCacheOptions{true});
  append(c, k, v, 0, 100);  // sinks 2, pages [2,34) [34,66) [66,98), residual 2
  EXPECT_TRUE(c.truncate_is_exact(0, 80));   // inside the newest page
  EXPECT_FALSE(c.truncate_is_exact(0, 50));  // inside an older page
  KVCache a = c;
  a.truncate(80);
  EXPECT_EQ(a.packed_tokens(0), 64);
  EXPECT_EQ(a.residual_tokens(0), 14);
  std::vector<float> rk(14 * H * D), rv(rk.size());
  a.read(0, 66, 80, KVView<float>::nhd(rk.data(), 14, H, D), KVView<float>::nhd(rv.data(), 14, H, D));
  EXPECT_TRUE(std::equal(rk.begin(), rk.end(), k.begin() + 66 * H * D));  // the originals
  EXPECT_TRUE(std::equal(rv.begin(), rv.end(), v.begin() + 66 * H * D));
  KVCache never(parse_policy("kivi4,residual=0,sinks=2"), 1, H, D, 0, kvq::KVCacheOptions{true});
  append(never, k, v, 0, 80);
  EXPECT_EQ(layer_bytes(a, 0), layer_bytes(never, 0));
  // After that rollback the previous page's originals are gone: a cut inside it re-rounds.
  EXPECT_FALSE(a.truncate_is_exact(0, 50));
}

}  // namespace
