// KVCache over an engine's page pool (KVCacheOptions::page_allocator): several sequences share
// one fixed pool; each holds page bytes identical to a KVCache on kvq's own memory and attends
// identically; an exhausted pool makes append throw with the cache unchanged; copies take pages
// from the pool; every page goes back (clear + release_unused_pages, destruction).
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <new>
#include <set>
#include <stdexcept>
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

/// A fixed pool of equal pages carved from one buffer, with a free list; it checks every page
/// it gets back (owned, not free already, right size) and counts what is out.
class Pool final : public kvq::PageAllocator {
 public:
  Pool(std::size_t pages, std::size_t page_bytes) : page_bytes_(page_bytes), n_(pages) {
    buf_.reset(static_cast<std::byte*>(::operator new(pages * page_bytes, std::align_val_t(64))));
    std::memset(buf_.get(), 0xAB, pages * page_bytes);  // garbage: kvq must zero what it uses
    for (std::size_t i = pages; i-- > 0;) free_.push_back(buf_.get() + i * page_bytes);
  }
  std::byte* allocate(std::size_t bytes) override {
    if (bytes > page_bytes_) throw std::invalid_argument("pool: page too large");
    if (free_.empty()) throw std::runtime_error("pool: exhausted");
    std::byte* p = free_.back();
    free_.pop_back();
    out_.insert(p);
    return p;
  }
  void release(std::byte* p, std::size_t) noexcept override {
    if (out_.erase(p) != 1) bad_release_ = true;
    free_.push_back(p);
  }
  std::size_t in_use() const { return out_.size(); }
  std::size_t free_pages() const { return free_.size(); }
  bool bad_release() const { return bad_release_; }
  bool owns(const std::byte* p) const { return p >= buf_.get() && p < buf_.get() + n_ * page_bytes_; }

 private:
  struct Free {
    void operator()(std::byte* p) const { ::operator delete(p, std::align_val_t(64)); }
  };
  std::size_t page_bytes_, n_;
  std::unique_ptr<std::byte, Free> buf_;
  std::vector<std::byte*> free_;
  std::set<std::byte*> out_;
  bool bad_release_ = false;
};

void feed(KVCache& c, const std::vector<float>& k, const std::vector<float>& v, int64_t from,
          int64_t to, int chunk) {
  const int H = c.kv_heads(), D = c.head_dim();
  for (int64_t t = from; t < to; t += chunk) {
    const int64_t n = std::min<int64_t>(chunk, to - t);
    for (int l = 0; l < c.n_layers(); ++l)
      c.append(l, KVView<const float>::nhd(k.data() + t * H * D, n, H, D),
               KVView<const float>::nhd(v.data() + t * H * D, n, H, D));
  }
}

void expect_same_pages(const KVCache& a, const KVCache& b) {
  for (int l = 0; l < a.n_layers(); ++l) {
    const kvq::PageTable ta = a.page_table(l), tb = b.page_table(l);
    ASSERT_EQ(ta.n_pages, tb.n_pages);
    ASSERT_EQ(ta.layout.bytes, tb.layout.bytes);
    for (int64_t j = 0; j < ta.n_pages; ++j)
      EXPECT_EQ(std::memcmp(ta.pages[j], tb.pages[j], ta.layout.bytes), 0) << "layer " << l << " page " << j;
  }
}

TEST(EnginePool, SequencesOnOnePoolEqualOwnMemoryCaches) {
  const int L = 2, H = 2, D = 64, QH = 4;
  for (const char* spec : {"kivi4", "k8v4,sinks=4", "turbo3", "kivi2,residual=32"}) {
    SCOPED_TRACE(spec);
    const kvq::Policy p = parse_policy(spec);
    const std::size_t page = KVCache(p, L, H, D).page_layout(0).bytes;
    Pool pool(256, page);
    kvq::KVCacheOptions o;
    o.page_allocator = &pool;
    const int64_t lens[] = {300, 77, 250};
    std::vector<std::unique_ptr<KVCache>> seqs, own;
    std::vector<std::vector<float>> ks, vs;
    for (int s = 0; s < 3; ++s) {
      ks.push_back(kvq_test::kv_data(Shape{lens[s], H, D}, 10 + s, true));
      vs.push_back(kvq_test::kv_data(Shape{lens[s], H, D}, 20 + s, false));
      seqs.push_back(std::make_unique<KVCache>(p, L, H, D, 0, o));
      own.push_back(std::make_unique<KVCache>(p, L, H, D));
    }
    // Interleaved growth, as an engine's step loop does; different chunking per copy.
    for (int64_t t = 0; t < 300; t += 25)
      for (int s = 0; s < 3; ++s)
        if (t < lens[s]) feed(*seqs[s], ks[s], vs[s], t, std::min<int64_t>(t + 25, lens[s]), 7);
    std::size_t pages = 0;
    for (int s = 0; s < 3; ++s) {
      feed(*own[s], ks[s], vs[s], 0, lens[s], 64);
      expect_same_pages(*seqs[s], *own[s]);
      for (int l = 0; l < L; ++l) {
        const kvq::PageTable t = seqs[s]->page_table(l);
        for (int64_t j = 0; j < t.n_pages; ++j) EXPECT_TRUE(pool.owns(t.pages[j]));
        pages += static_cast<std::size_t>(t.n_pages);
      }
      // Attention over the pool's pages equals attention over the own-memory cache.
      const auto q = kvq_test::kv_data(Shape{1, QH, D}, 99, false);
      std::vector<float> a(static_cast<size_t>(QH * D)), b(a.size());
      kvq::AttentionWorkspace ws;
      for (int l = 0; l < L; ++l) {
        kvq::attend_one(*seqs[s], l, q.data(), QH, a.data(), ws);
        kvq::attend_one(*own[s], l, q.data(), QH, b.data(), ws);
        EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0);
      }
    }
    EXPECT_GE(pool.in_use(), pages);  // (the growth policy may hold spare slots)
    // A copy takes its pages from the pool too.
    {
      const std::size_t before = pool.in_use();
      KVCache copy(*seqs[0]);
      expect_same_pages(copy, *own[0]);
      EXPECT_GT(pool.in_use(), before);
    }
    // clear() + release_unused_pages() gives a sequence's pages back; the others keep theirs.
    seqs[1]->clear();
    seqs[1]->release_unused_pages();
    expect_same_pages(*seqs[0], *own[0]);
    seqs.clear();
    EXPECT_EQ(pool.in_use(), 0u);
    EXPECT_EQ(pool.free_pages(), 256u);
    EXPECT_FALSE(pool.bad_release());
  }
}

TEST(EnginePool, ExhaustedPoolLeavesTheCacheUnchanged) {
  const int H = 2, D = 32;
  const kvq::Policy p = parse_policy("kivi4,residual=0");
  const std::size_t page = KVCache(p, 1, H, D).page_layout(0).bytes;
  Pool pool(3, page);  // room for 3 pages of 32 tokens
  kvq::KVCacheOptions o;
  o.page_allocator = &pool;
  KVCache c(p, 1, H, D, 0, o);
  const auto k = kvq_test::kv_data(Shape{200, H, D}, 1, true);
  const auto v = kvq_test::kv_data(Shape{200, H, D}, 2, false);
  feed(c, k, v, 0, 80, 80);  // 2 pages + 16 f32 tokens
  KVCache reference(p, 1, H, D);
  feed(reference, k, v, 0, 80, 80);
  EXPECT_THROW(feed(c, k, v, 80, 200, 120), std::runtime_error);  // needs 3 more pages
  EXPECT_EQ(c.tokens(0), 80);
  expect_same_pages(c, reference);
  EXPECT_FALSE(pool.bad_release());
}

TEST(EnginePool, BadAllocatorPagesAreRefused) {
  struct Misaligned final : kvq::PageAllocator {
    std::vector<std::byte> buf = std::vector<std::byte>(1 << 16);
    int released = 0;
    std::byte* allocate(std::size_t) override {
      auto* p = buf.data();
      while (reinterpret_cast<std::uintptr_t>(p) % 64 != 1) ++p;
      return p;
    }
    void release(std::byte*, std::size_t) noexcept override { ++released; }
  } bad;
  kvq::KVCacheOptions o;
  o.page_allocator = &bad;
  KVCache c(parse_policy("kivi4,residual=0"), 1, 2, 32, 0, o);
  const auto k = kvq_test::kv_data(Shape{64, 2, 32}, 1, true);
  try {
    feed(c, k, k, 0, 64, 64);
    FAIL() << "a misaligned page was accepted";
  } catch (const kvq::Error& e) {
    EXPECT_NE(std::string(e.what()).find("not aligned"), std::string::npos) << e.what();
  }
  EXPECT_EQ(c.tokens(0), 0);
}

}  // namespace
