// KVCache::fork(): prefix sharing with reference-counted pages. Every expected value comes from
// caches built independently (fed their tokens alone, never forked): a fork and its source each
// hold the page bytes, f32 windows and memory figures of such a cache and attend bit for bit
// like it, whatever the other does afterwards (append, truncate with and without exact
// rollback, release_before, clear, destruction). On an engine's pool every page is allocated
// and released exactly once, and an exhausted pool changes neither cache.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <memory>
#include <new>
#include <set>
#include <stdexcept>
#include <thread>
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

constexpr int kLayers = 2, kH = 2, kD = 64, kQH = 4;

const char* const kPolicies[] = {
    "kivi4",
    "k8v4",
    "turbo4",
    "f16",
    "kivi2,residual=32,sinks=4",
    "k=int3/channel/g32/out1%,v=int4/token/g32/out2",
};

/// Token data [n, kH, kD]: keys with outlier channels, values plain.
struct Tokens {
  std::vector<float> k, v;
  int64_t n = 0;
  Tokens(int64_t tokens, uint32_t seed)
      : k(kvq_test::kv_data(Shape{tokens, kH, kD}, seed, true)),
        v(kvq_test::kv_data(Shape{tokens, kH, kD}, seed + 1000, false)),
        n(tokens) {}
  Tokens() = default;
  /// This sequence's first `a` tokens followed by `b`'s tokens [from, to).
  Tokens then(int64_t a, const Tokens& b, int64_t from, int64_t to) const {
    Tokens t;
    const int64_t row = kH * kD;
    t.k.assign(k.begin(), k.begin() + a * row);
    t.v.assign(v.begin(), v.begin() + a * row);
    t.k.insert(t.k.end(), b.k.begin() + from * row, b.k.begin() + to * row);
    t.v.insert(t.v.end(), b.v.begin() + from * row, b.v.begin() + to * row);
    t.n = a + to - from;
    return t;
  }
};

/// Appends tokens [from, to) of `x` to every layer in chunks of `chunk`.
void feed(KVCache& c, const Tokens& x, int64_t from, int64_t to, int chunk) {
  for (int64_t t = from; t < to; t += chunk) {
    const int64_t n = std::min<int64_t>(chunk, to - t);
    for (int l = 0; l < c.n_layers(); ++l)
      c.append(l, KVView<const float>::nhd(x.k.data() + t * kH * kD, n, kH, kD),
               KVView<const float>::nhd(x.v.data() + t * kH * kD, n, kH, kD));
  }
}

/// A cache fed tokens [0, n) of `x` alone (the independent expectation).
std::unique_ptr<KVCache> built_alone(const kvq::Policy& p, const Tokens& x, int64_t n,
                                     kvq::KVCacheOptions o = {}) {
  auto c = std::make_unique<KVCache>(p, kLayers, kH, kD, 0, o);
  feed(*c, x, 0, n, 64);
  return c;
}

/// `got` holds what `want` holds: token split, page bytes, f32 rows (read()), byte figures, and
/// attention (causal block of queries and attend_one) bit for bit.
/// With `rollback` false the rollback originals are left out of the byte figures (a rollback
/// that unflushes a page drops the originals of the page before it, which a cache fed only
/// the kept tokens would still hold).
void expect_same(const KVCache& got, const KVCache& want, const char* what, bool rollback = true) {
  SCOPED_TRACE(what);
  const kvq::MemoryReport mg = got.memory_report(), mw = want.memory_report();
  for (int l = 0; l < kLayers; ++l) {
    SCOPED_TRACE(::testing::Message() << "layer " << l);
    ASSERT_EQ(got.tokens(l), want.tokens(l));
    ASSERT_EQ(got.sink_tokens(l), want.sink_tokens(l));
    ASSERT_EQ(got.packed_tokens(l), want.packed_tokens(l));
    ASSERT_EQ(got.residual_tokens(l), want.residual_tokens(l));
    ASSERT_EQ(got.released_tokens(l), want.released_tokens(l));
    const kvq::PageTable a = got.page_table(l), b = want.page_table(l);
    ASSERT_EQ(a.n_pages, b.n_pages);
    ASSERT_EQ(a.first_token, b.first_token);
    for (int64_t j = 0; j < a.n_pages; ++j)
      ASSERT_EQ(std::memcmp(a.pages[j], b.pages[j], a.layout.bytes), 0) << "page " << j;
    kvq::StreamBytes gk = mg.layers[l].key, gv = mg.layers[l].value;
    kvq::StreamBytes wk = mw.layers[l].key, wv = mw.layers[l].value;
    if (!rollback) gk.rollback = gv.rollback = wk.rollback = wv.rollback = 0;
    EXPECT_TRUE(gk == wk);
    EXPECT_TRUE(gv == wv);
    // Every row held, through read() (f32 rows exactly, packed rows decoded).
    const int64_t n = got.tokens(l), first = got.released_tokens(l) > 0 ? a.first_token : 0;
    if (got.released_tokens(l) == 0 && n > 0) {
      std::vector<float> k1(static_cast<size_t>(n * kH * kD)), v1(k1.size()), k2(k1.size()),
          v2(k1.size());
      got.read(l, first, n, KVView<float>::nhd(k1.data(), n, kH, kD),
               KVView<float>::nhd(v1.data(), n, kH, kD));
      want.read(l, first, n, KVView<float>::nhd(k2.data(), n, kH, kD),
                KVView<float>::nhd(v2.data(), n, kH, kD));
      EXPECT_EQ(std::memcmp(k1.data(), k2.data(), k1.size() * sizeof(float)), 0);
      EXPECT_EQ(std::memcmp(v1.data(), v2.data(), v1.size() * sizeof(float)), 0);
    }
    if (n == 0) continue;
    kvq::AttentionWorkspace ws;
    kvq::AttentionOptions opt;
    // (released pages: one query whose window starts at the first page held)
    if (got.released_tokens(l) > 0) opt.window = static_cast<int>(n - a.first_token);
    const int64_t nq = got.released_tokens(l) > 0 ? 1 : std::min<int64_t>(5, n);
    const auto q = kvq_test::kv_data(Shape{nq, kQH, kD}, 77 + static_cast<uint32_t>(l), false);
    std::vector<float> o1(q.size()), o2(q.size());
    kvq::attend(got, l, KVView<const float>::nhd(q.data(), nq, kQH, kD),
                KVView<float>::nhd(o1.data(), nq, kQH, kD), true, ws, nullptr, opt);
    kvq::attend(want, l, KVView<const float>::nhd(q.data(), nq, kQH, kD),
                KVView<float>::nhd(o2.data(), nq, kQH, kD), true, ws, nullptr, opt);
    EXPECT_EQ(std::memcmp(o1.data(), o2.data(), o1.size() * sizeof(float)), 0) << "attend";
    kvq::attend_one(got, l, q.data(), kQH, o1.data(), ws, nullptr, opt);
    kvq::attend_one(want, l, q.data(), kQH, o2.data(), ws, nullptr, opt);
    EXPECT_EQ(std::memcmp(o1.data(), o2.data(), kQH * kD * sizeof(float)), 0) << "attend_one";
  }
  if (rollback) {
    EXPECT_EQ(mg.total(), mw.total());
  }
}

/// Fork points of a policy: right after a flush (the packed region ends on a page boundary and
/// the residual holds exactly R tokens) and mid-block (the residual holds a partial block).
std::vector<int64_t> fork_points(const KVCache& c) {
  const int64_t s = c.policy().sinks, R = c.policy().residual, B = c.block_tokens(0);
  return {s + R + 3 * B, s + R + 3 * B + B / 2 + 3};
}

TEST(Fork, ForkedSequencesEqualCachesBuiltAlone) {
  for (const char* spec : kPolicies) {
    for (bool exact : {false, true}) {
      const kvq::Policy p = parse_policy(spec);
      kvq::KVCacheOptions o;
      o.exact_rollback = exact;
      const KVCache probe(p, kLayers, kH, kD);
      for (int64_t P : fork_points(probe)) {
        SCOPED_TRACE(::testing::Message() << spec << " exact_rollback " << exact << " P " << P);
        const int64_t n1 = 70, n2 = 45;
        const Tokens x1(P + n1, 1);  // P + S1
        const Tokens s2(n2, 2);
        const Tokens x2 = x1.then(P, s2, 0, n2);  // P + S2
        KVCache a(p, kLayers, kH, kD, 0, o);
        feed(a, x1, 0, P, 7);
        KVCache f = a.fork();
        // Right after the fork: the same pages (by address), nothing copied.
        for (int l = 0; l < kLayers; ++l) {
          const kvq::PageTable ta = a.page_table(l), tf = f.page_table(l);
          ASSERT_EQ(ta.n_pages, tf.n_pages);
          ASSERT_GT(ta.n_pages, 0);
          for (int64_t j = 0; j < ta.n_pages; ++j) EXPECT_EQ(ta.pages[j], tf.pages[j]);
        }
        expect_same(f, *built_alone(p, x1, P, o), "fork at P");
        feed(a, x1, P, P + n1, 1);  // decode S1 token by token
        feed(f, x2, P, P + n2, 9);
        expect_same(a, *built_alone(p, x1, P + n1, o), "source after S1");
        expect_same(f, *built_alone(p, x2, P + n2, o), "fork after S2");
        // A fork of the fork, and the copy constructor (a deep copy shares nothing).
        KVCache g = f.fork();
        KVCache d(f);
        for (int l = 0; l < kLayers; ++l)
          if (d.page_table(l).n_pages > 0) {
            EXPECT_NE(d.page_table(l).pages[0], f.page_table(l).pages[0]);
          }
        EXPECT_EQ(d.memory_report().shared(), 0u);
        expect_same(g, *built_alone(p, x2, P + n2, o), "fork of the fork");
        expect_same(d, *built_alone(p, x2, P + n2, o), "deep copy");
      }
    }
  }
}

// Speculative decoding on one fork: exact rollback turned on for that fork only; drafts of
// k <= B tokens, truncated back to the accepted ones, leave it as a cache fed only those.
TEST(Fork, ExactRollbackOnOneFork) {
  for (const char* spec : {"kivi4", "turbo4", "kivi2,residual=32,sinks=4"}) {
    SCOPED_TRACE(spec);
    const kvq::Policy p = parse_policy(spec);
    const KVCache probe(p, kLayers, kH, kD);
    const int64_t B = probe.block_tokens(0);
    const int64_t P = p.sinks + p.residual + 2 * B + 5;
    const Tokens x(P, 30);
    const Tokens drafts(40 * 6, 31);
    KVCache a(p, kLayers, kH, kD);
    feed(a, x, 0, P, 64);
    KVCache f = a.fork();
    f.set_exact_rollback(true);
    EXPECT_TRUE(f.options().exact_rollback);
    EXPECT_FALSE(a.options().exact_rollback);
    Tokens kept = x.then(P, drafts, 0, 0);
    for (int step = 0; step < 40; ++step) {
      const int64_t k = 1 + step % 6, keep = (step * 7) % (k + 1), n = f.tokens(0);
      feed(f, drafts, 6 * step, 6 * step + k, static_cast<int>(k));
      for (int l = 0; l < kLayers; ++l) ASSERT_TRUE(f.truncate_is_exact(l, n + keep));
      f.truncate(n + keep);
      kept = kept.then(kept.n, drafts, 6 * step, 6 * step + keep);
    }
    kvq::KVCacheOptions on;
    on.exact_rollback = true;
    expect_same(f, *built_alone(p, kept, kept.n, on), "speculative fork", /*rollback=*/false);
    expect_same(a, *built_alone(p, x, P), "source untouched");
    f.set_exact_rollback(false);
    for (const auto& l : f.memory_report().layers) EXPECT_EQ(l.key.rollback + l.value.rollback, 0u);
    expect_same(f, *built_alone(p, kept, kept.n), "rollback off again");
  }
}

// fork(n): the first n tokens, exact where truncate(n) is.
TEST(Fork, ForkAtAnEarlierPrefix) {
  for (const char* spec :
       {"turbo4", "f16", "k8v4,residual=0", "kivi4", "kivi2,residual=32,sinks=4"}) {
    const kvq::Policy p = parse_policy(spec);
    kvq::KVCacheOptions o;
    o.exact_rollback = true;
    const KVCache probe(p, kLayers, kH, kD);
    const int64_t s = p.sinks, R = p.residual, B = probe.block_tokens(0);
    const Tokens x(s + R + 6 * B, 3);
    const Tokens s2(40, 4);
    // (n, tokens the source holds): a page boundary far back (exact when R = 0), and a point at
    // most B tokens back (exact through the rollback originals).
    // (n, tokens the source holds, exact rollback)
    struct Case {
      int64_t n, held;
      bool exact;
    };
    std::vector<Case> cases = {{s + R + 4 * B - B / 2 + 1, s + R + 4 * B, true},
                               {s + R + 3 * B + 5, s + R + 3 * B + 5 + B, true}};
    if (R == 0) cases.push_back({s + 2 * B, s + 5 * B + 7, false});
    for (const Case& c : cases) {
      const int64_t n = c.n, held = c.held;
      o.exact_rollback = c.exact;
      SCOPED_TRACE(::testing::Message() << spec << " fork(" << n << ") of " << held);
      KVCache a(p, kLayers, kH, kD, 0, o);
      feed(a, x, 0, held, 5);
      for (int l = 0; l < kLayers; ++l) ASSERT_TRUE(a.truncate_is_exact(l, n));
      KVCache f = a.fork(n);
      expect_same(f, *built_alone(p, x, n, o), "fork(n)", /*rollback=*/false);
      expect_same(a, *built_alone(p, x, held, o), "source untouched");
      const Tokens y = x.then(n, s2, 0, s2.n);
      feed(f, y, n, y.n, 1);
      expect_same(f, *built_alone(p, y, y.n, o), "fork(n) + S2");
      expect_same(a, *built_alone(p, x, held, o), "source untouched after S2");
    }
    KVCache a(p, kLayers, kH, kD, 0, o);
    feed(a, x, 0, 10, 10);
    EXPECT_THROW((void)a.fork(11), kvq::Error);
    EXPECT_THROW((void)a.fork(-1), kvq::Error);
  }
}

// Truncation on either side after a fork: back into shared pages (unflushed from the rollback
// originals, or cut inside an older page and re-rounded) without touching the other cache.
TEST(Fork, TruncateAfterFork) {
  for (const char* spec : kPolicies) {
    for (bool exact : {false, true}) {
      SCOPED_TRACE(::testing::Message() << spec << " exact_rollback " << exact);
      const kvq::Policy p = parse_policy(spec);
      kvq::KVCacheOptions o;
      o.exact_rollback = exact;
      const KVCache probe(p, kLayers, kH, kD);
      const int64_t s = p.sinks, R = p.residual, B = probe.block_tokens(0);
      const int64_t P = s + R + 4 * B + 3;
      const Tokens x(P + B, 5);  // P then B draft tokens
      const Tokens s2(30, 6);
      const Tokens y = x.then(P, s2, 0, s2.n);
      // Speculative rollback on the source: k <= B drafts, then back to P.
      {
        KVCache a(p, kLayers, kH, kD, 0, o);
        feed(a, x, 0, P, 11);
        KVCache f = a.fork();
        feed(a, x, P, P + B, B);
        a.truncate(P);
        auto want = built_alone(p, x, P + B, o);
        want->truncate(P);  // the same rollback on a cache never forked
        expect_same(a, *want, "source rolled back");
        if (exact) expect_same(a, *built_alone(p, x, P, o), "exact rollback = never fed", false);
        expect_same(f, *built_alone(p, x, P, o), "fork untouched");
        feed(a, y, P, y.n, 1);
        feed(*want, y, P, y.n, 1);
        expect_same(a, *want, "source after S2");
        feed(f, y, P, y.n, 4);
        expect_same(f, *built_alone(p, y, y.n, o), "fork after S2");
      }
      // Cut strictly inside an older shared page (re-rounded into the residual) on the fork,
      // then a cut to the sinks and a clear on the source.
      {
        KVCache a(p, kLayers, kH, kD, 0, o);
        feed(a, x, 0, P, 64);
        KVCache f = a.fork();
        const int64_t cut = s + B + B / 2 + 1;
        f.truncate(cut);
        auto want = built_alone(p, x, P, o);
        want->truncate(cut);
        expect_same(f, *want, "fork cut inside a shared page");
        expect_same(a, *built_alone(p, x, P, o), "source untouched by the cut");
        feed(f, y, cut, cut + 40, 3);
        feed(*want, y, cut, cut + 40, 3);
        expect_same(f, *want, "fork refilled");
        expect_same(a, *built_alone(p, x, P, o), "source untouched by the refill");
        a.truncate(s);
        a.release_unused_pages();
        expect_same(f, *want, "fork untouched by the source's cut to the sinks");
        a.clear();
        feed(a, y, 0, y.n, 13);
        expect_same(a, *built_alone(p, y, y.n, o), "source refilled after clear");
        expect_same(f, *want, "fork untouched by the source's clear and refill");
      }
    }
  }
}

TEST(Fork, ReleaseBeforeAfterFork) {
  for (const char* spec : {"kivi4", "turbo4", "kivi2,residual=32,sinks=4"}) {
    SCOPED_TRACE(spec);
    const kvq::Policy p = parse_policy(spec);
    const KVCache probe(p, kLayers, kH, kD);
    const int64_t s = p.sinks, R = p.residual, B = probe.block_tokens(0);
    const int64_t P = s + R + 5 * B + 2;
    const Tokens x(P + 3 * B, 7);
    const Tokens s2(2 * B, 8);
    const Tokens y = x.then(P, s2, 0, s2.n);
    KVCache a(p, kLayers, kH, kD);
    feed(a, x, 0, P, 16);
    KVCache f = a.fork();
    const int64_t pos = s + 3 * B + 1;
    auto want = built_alone(p, x, P);
    for (int l = 0; l < kLayers; ++l) {
      EXPECT_EQ(a.release_before(l, pos), 3);
      EXPECT_EQ(want->release_before(l, pos), 3);
    }
    expect_same(a, *want, "source released");
    expect_same(f, *built_alone(p, x, P), "fork untouched by the release");
    // The source's next flushes reuse only its own free slots (the shared ones were dropped).
    feed(a, x, P, P + 3 * B, 1);
    feed(*want, x, P, P + 3 * B, 1);
    expect_same(a, *want, "source after more tokens");
    feed(f, y, P, y.n, 1);
    expect_same(f, *built_alone(p, y, y.n), "fork after S2");
    // The fork releases too; the source keeps its pages.
    for (int l = 0; l < kLayers; ++l) f.release_before(l, P);
    expect_same(a, *want, "source untouched by the fork's release");
  }
}

TEST(Fork, SourceDestroyedBeforeFork) {
  for (const char* spec : kPolicies) {
    SCOPED_TRACE(spec);
    const kvq::Policy p = parse_policy(spec);
    const Tokens x(300, 9);
    const Tokens s2(50, 10);
    const Tokens y = x.then(200, s2, 0, s2.n);
    auto a = std::make_unique<KVCache>(p, kLayers, kH, kD);
    feed(*a, x, 0, 200, 32);
    std::unique_ptr<KVCache> f = std::make_unique<KVCache>(a->fork());
    std::unique_ptr<KVCache> g = std::make_unique<KVCache>(f->fork(150));
    a.reset();
    expect_same(*f, *built_alone(p, x, 200), "fork after the source died");
    EXPECT_EQ(f->memory_report().shared() > 0, g->packed_tokens(0) > 0);
    feed(*f, y, 200, y.n, 1);
    expect_same(*f, *built_alone(p, y, y.n), "fork after S2");
    f.reset();
    EXPECT_EQ(g->memory_report().shared(), 0u);
    auto want = built_alone(p, x, 200);
    want->truncate(150);
    expect_same(*g, *want, "fork of the fork after both died");
  }
}

// memory_report(): each cache counts the pages it holds; shared() the part another cache also
// holds; unique_total() each page once.
TEST(Fork, MemoryReportCountsSharedPages) {
  const kvq::Policy p = parse_policy("kivi2,residual=32,sinks=4");
  const Tokens x(400, 11);
  KVCache a(p, kLayers, kH, kD);
  feed(a, x, 0, 300, 64);
  const kvq::MemoryReport before = a.memory_report();
  EXPECT_EQ(before.shared(), 0u);
  KVCache f = a.fork();
  const kvq::MemoryReport ma = a.memory_report(), mf = f.memory_report();
  std::size_t pages_bytes = 0;
  for (const auto& l : ma.layers) {
    EXPECT_EQ(l.shared_blocks, l.blocks);
    pages_bytes += static_cast<std::size_t>(l.blocks) * l.page_bytes;
  }
  EXPECT_EQ(ma.total(), before.total());
  EXPECT_EQ(mf.total(), before.total());
  EXPECT_EQ(ma.shared(), pages_bytes);
  EXPECT_EQ(mf.shared(), pages_bytes);
  EXPECT_NE(ma.str().find("shared with a fork"), std::string::npos);
  EXPECT_EQ(before.str().find("shared with a fork"), std::string::npos);
  EXPECT_EQ(kvq::unique_total({&a, &f}), 2 * before.total() - pages_bytes);
  EXPECT_EQ(kvq::unique_total({&a, &a}), before.total());
  // The source grows: its new pages are its own; the prefix pages stay shared.
  feed(a, x, 300, 400, 1);
  const kvq::MemoryReport ma2 = a.memory_report();
  EXPECT_EQ(ma2.shared(), pages_bytes);
  EXPECT_EQ(kvq::unique_total({&a, &f}), ma2.total() + mf.total() - pages_bytes);
  // Counted independently: distinct page addresses over both caches.
  std::set<const std::byte*> distinct;
  std::size_t page_total = 0, rows = 0;
  for (const KVCache* c : {&a, &f}) {
    const kvq::MemoryReport m = c->memory_report();
    rows += m.total();
    for (int l = 0; l < kLayers; ++l) {
      const kvq::PageTable t = c->page_table(l);
      rows -= static_cast<std::size_t>(t.n_pages) * t.layout.bytes;
      for (int64_t j = 0; j < t.n_pages; ++j)
        if (distinct.insert(t.pages[j]).second) page_total += t.layout.bytes;
    }
  }
  EXPECT_EQ(kvq::unique_total({&a, &f}), rows + page_total);
  // The fork cut below the prefix: fewer shared pages on both sides.
  f.truncate(4 + 32 * 3);
  EXPECT_EQ(a.memory_report().shared(), f.memory_report().shared());
  EXPECT_LT(a.memory_report().shared(), pages_bytes);
}

/// A fixed pool of pages with a free list that counts every allocate and release and flags a
/// release of a page that is not out (double release, foreign page).
class CountingPool final : public kvq::PageAllocator {
 public:
  CountingPool(std::size_t pages, std::size_t page_bytes) : page_bytes_(page_bytes), n_(pages) {
    buf_.reset(static_cast<std::byte*>(::operator new(pages* page_bytes, std::align_val_t(64))));
    std::memset(buf_.get(), 0xCD, pages * page_bytes);
    for (std::size_t i = pages; i-- > 0;) free_.push_back(buf_.get() + i * page_bytes);
  }
  std::byte* allocate(std::size_t bytes) override {
    if (bytes > page_bytes_) throw std::invalid_argument("pool: page too large");
    if (free_.empty()) throw std::runtime_error("pool: exhausted");
    std::byte* p = free_.back();
    free_.pop_back();
    out_.insert(p);
    ++allocations_;
    return p;
  }
  void release(std::byte* p, std::size_t) noexcept override {
    ++releases_;
    if (out_.erase(p) != 1) bad_release_ = true;
    free_.push_back(p);
  }
  std::size_t in_use() const { return out_.size(); }
  bool out(const std::byte* p) const { return out_.count(const_cast<std::byte*>(p)) == 1; }
  std::size_t allocations() const { return allocations_; }
  std::size_t releases() const { return releases_; }
  bool bad_release() const { return bad_release_; }

 private:
  struct Free {
    void operator()(std::byte* p) const { ::operator delete(p, std::align_val_t(64)); }
  };
  std::size_t page_bytes_, n_;
  std::unique_ptr<std::byte, Free> buf_;
  std::vector<std::byte*> free_;
  std::set<std::byte*> out_;
  std::size_t allocations_ = 0, releases_ = 0;
  bool bad_release_ = false;
};

/// Every page any of `caches` holds is out of the pool (allocated, not yet released).
void expect_pages_out(const CountingPool& pool, const std::vector<const KVCache*>& caches) {
  for (const KVCache* c : caches)
    for (int l = 0; l < kLayers; ++l) {
      const kvq::PageTable t = c->page_table(l);
      for (int64_t j = 0; j < t.n_pages; ++j) EXPECT_TRUE(pool.out(t.pages[j]));
    }
}

TEST(Fork, EnginePoolReleasesEveryPageOnce) {
  for (const char* spec : {"kivi4", "k8v4,sinks=4", "kivi2,residual=32,sinks=4"}) {
    SCOPED_TRACE(spec);
    const kvq::Policy p = parse_policy(spec);
    const std::size_t page = KVCache(p, kLayers, kH, kD).page_layout(0).bytes;
    CountingPool pool(512, page);
    kvq::KVCacheOptions o;
    o.page_allocator = &pool;
    o.exact_rollback = true;
    const Tokens x(400, 12);
    const Tokens s1(120, 13), s2(90, 14);
    const Tokens y1 = x.then(200, s1, 0, s1.n), y2 = x.then(200, s2, 0, s2.n);
    kvq::KVCacheOptions own = o;  // the same cache on kvq's memory
    own.page_allocator = nullptr;
    {
      auto a = std::make_unique<KVCache>(p, kLayers, kH, kD, 0, o);
      feed(*a, x, 0, 200, 25);
      const std::size_t after_prefix = pool.allocations();
      auto f1 = std::make_unique<KVCache>(a->fork());
      auto f2 = std::make_unique<KVCache>(a->fork());
      EXPECT_EQ(pool.allocations(), after_prefix);  // a fork takes no page from the pool
      auto g = std::make_unique<KVCache>(f1->fork(150));
      feed(*f1, y1, 200, y1.n, 1);
      feed(*f2, y2, 200, y2.n, 7);
      feed(*a, x, 200, 260, 3);
      a->truncate(230);  // rollback into its own newest page
      for (int l = 0; l < kLayers; ++l) f2->release_before(l, 120);
      f2->release_unused_pages();
      expect_pages_out(pool, {a.get(), f1.get(), f2.get(), g.get()});
      expect_same(*f1, *built_alone(p, y1, y1.n, own), "f1 on the pool");
      g->clear();
      g->release_unused_pages();
      expect_pages_out(pool, {a.get(), f1.get(), f2.get()});
      expect_same(*f1, *built_alone(p, y1, y1.n, own), "f1 after g cleared");
      // Destroy in a mixed order: the source first.
      a.reset();
      expect_pages_out(pool, {f1.get(), f2.get(), g.get()});
      f2.reset();
      expect_same(*f1, *built_alone(p, y1, y1.n, own), "f1 after the others died");
      f1.reset();
      EXPECT_EQ(pool.in_use(), 0u) << "g holds no tokens and gave its slots back";
    }
    EXPECT_EQ(pool.in_use(), 0u);
    EXPECT_EQ(pool.allocations(), pool.releases());
    EXPECT_FALSE(pool.bad_release());
  }
}

/// What a cache holds, for before/after comparisons: page addresses and bytes, f32 rows and
/// the memory figures.
struct Snapshot {
  std::vector<const std::byte*> ptrs;
  std::vector<std::vector<std::byte>> bytes;
  std::vector<float> rows;
  std::size_t total = 0;
  std::vector<int64_t> counts;
  explicit Snapshot(const KVCache& c) {
    for (int l = 0; l < kLayers; ++l) {
      const kvq::PageTable t = c.page_table(l);
      for (int64_t j = 0; j < t.n_pages; ++j) {
        ptrs.push_back(t.pages[j]);
        bytes.emplace_back(t.pages[j], t.pages[j] + t.layout.bytes);
      }
      const int64_t n = c.tokens(l);
      std::vector<float> k(static_cast<size_t>(n * kH * kD)), v(k.size());
      c.read(l, 0, n, KVView<float>::nhd(k.data(), n, kH, kD),
             KVView<float>::nhd(v.data(), n, kH, kD));
      rows.insert(rows.end(), k.begin(), k.end());
      rows.insert(rows.end(), v.begin(), v.end());
      counts.insert(counts.end(),
                    {c.tokens(l), c.sink_tokens(l), c.packed_tokens(l), c.residual_tokens(l)});
    }
    total = c.memory_report().total();
  }
  bool operator==(const Snapshot& o) const {
    return ptrs == o.ptrs && bytes == o.bytes && rows == o.rows && total == o.total &&
           counts == o.counts;
  }
};

// The pool runs dry: a fork still succeeds (it needs no page), and an append that needs a page
// on either side throws with both caches unchanged.
TEST(Fork, ExhaustedPoolLeavesBothCachesUnchanged) {
  for (const char* spec : {"kivi4", "turbo4", "kivi2,residual=32,sinks=4"}) {
    SCOPED_TRACE(spec);
    const kvq::Policy p = parse_policy(spec);
    const KVCache probe(p, kLayers, kH, kD);
    const int64_t s = p.sinks, R = p.residual, B = probe.block_tokens(0);
    const std::size_t page = probe.page_layout(0).bytes;
    const int64_t P = s + R + 4 * B + B - 1;  // one token short of the next flush
    CountingPool pool(static_cast<std::size_t>(kLayers * 4), page);
    kvq::KVCacheOptions o;
    o.page_allocator = &pool;
    o.exact_rollback = true;
    const Tokens x(P + 2 * B, 15);
    KVCache a(p, kLayers, kH, kD, 0, o);
    for (int l = 0; l < kLayers; ++l) {  // exactly the pages of the prefix, nothing spare
      a.append(l, KVView<const float>::nhd(x.k.data(), P, kH, kD),
               KVView<const float>::nhd(x.v.data(), P, kH, kD));
      ASSERT_EQ(a.page_table(l).n_pages, 4);
    }
    ASSERT_EQ(pool.in_use(), static_cast<std::size_t>(kLayers * 4));
    KVCache f = a.fork();
    const Snapshot sa(a), sf(f);
    for (KVCache* c : {&a, &f}) {
      EXPECT_THROW(feed(*c, x, P, P + 1, 1), std::runtime_error);
      EXPECT_TRUE(Snapshot(a) == sa);
      EXPECT_TRUE(Snapshot(f) == sf);
    }
    // Truncating the fork into a shared page frees nothing in the pool (the source holds it)...
    const int64_t cut = s + R + 2 * B + 3, refill = s + R + 4 * B;
    f.truncate(cut);
    f.release_unused_pages();
    const auto fork_pages = static_cast<std::size_t>(f.page_table(0).n_pages);
    EXPECT_EQ(pool.in_use(), static_cast<std::size_t>(kLayers * 4));
    EXPECT_TRUE(Snapshot(a) == sa);
    // ... and its refill needs pages the pool does not have: it throws, changing neither.
    const Snapshot sf2(f);
    EXPECT_THROW(feed(f, x, cut, P + 2, 64), std::runtime_error);
    EXPECT_TRUE(Snapshot(a) == sa);
    EXPECT_TRUE(Snapshot(f) == sf2);
    // The source's cut to the sinks and a page given back lets the fork go on.
    a.truncate(0);
    a.release_unused_pages();
    EXPECT_EQ(pool.in_use(), kLayers * fork_pages);  // the fork's pages only
    feed(f, x, cut, refill, 64);
    kvq::KVCacheOptions own = o;
    own.page_allocator = nullptr;
    auto want = built_alone(p, x, P, own);
    want->truncate(cut);
    feed(*want, x, cut, refill, 64);
    expect_same(f, *want, "fork refilled once the pool had pages");
  }
}

// Forks of one family written and destroyed concurrently on different threads (kvq's own
// memory): each ends as a cache built alone.
TEST(Fork, ForksWrittenConcurrently) {
  const kvq::Policy p = parse_policy("kivi4");
  const Tokens x(160, 16);
  auto a = std::make_unique<KVCache>(p, kLayers, kH, kD);
  feed(*a, x, 0, 160, 32);
  constexpr int kForks = 4;
  std::vector<Tokens> tails, full;
  std::vector<std::unique_ptr<KVCache>> forks;
  for (int i = 0; i < kForks; ++i) {
    tails.emplace_back(100, 20 + i);
    full.push_back(x.then(160, tails.back(), 0, 100));
    forks.push_back(std::make_unique<KVCache>(a->fork()));
  }
  std::vector<std::unique_ptr<KVCache>> scratch;
  for (int i = 0; i < kForks; ++i) scratch.push_back(std::make_unique<KVCache>(a->fork()));
  std::vector<std::thread> th;
  for (int i = 0; i < kForks; ++i)
    th.emplace_back([&, i] {
      for (int rep = 0; rep < 3; ++rep) {
        feed(*forks[i], full[i], 160, 260, 1);
        forks[i]->truncate(100 + 10 * i);  // back into shared pages
        feed(*forks[i], full[i], 100 + 10 * i, 160, 16);
      }
      feed(*forks[i], full[i], 160, 260, 1);
      scratch[i].reset();  // destroyed while the others run
    });
  a.reset();
  for (auto& t : th) t.join();
  for (int i = 0; i < kForks; ++i) {
    // (the truncations cut inside older pages; rebuild the same history alone)
    auto alone = std::make_unique<KVCache>(p, kLayers, kH, kD);
    feed(*alone, x, 0, 160, 32);
    for (int rep = 0; rep < 3; ++rep) {
      feed(*alone, full[i], 160, 260, 1);
      alone->truncate(100 + 10 * i);
      feed(*alone, full[i], 100 + 10 * i, 160, 16);
    }
    feed(*alone, full[i], 160, 260, 1);
    expect_same(*forks[i], *alone, "concurrent fork");
  }
}

}  // namespace
