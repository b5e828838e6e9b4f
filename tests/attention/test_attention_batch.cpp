// kvq::attend_batch (attention/attention.hpp): B sequences over one page pool, FlashInfer-style
// (page ids, page and query indptr arrays, tokens per sequence, f32 sink and tail rows). Each
// sequence's rows equal attend_pages over its own pages bit for bit, with and without options;
// options indexed by the global query row match the double-precision oracle; 1, 2 and 3
// threads (std::threads or a caller's parallel-for) give bit-identical results; an empty
// sequence yields zeros; bad tables throw naming the problem and write nothing.
// KVQ_TEST_SCALAR_TOO: also built with KVQ_NO_SIMD.
#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kvq/attention/attention.hpp"
#include "kvq/cache/kv_cache.hpp"
#include "kvq/policy/spec.hpp"
#include "kvq/reference/attention_ref.hpp"
#include "test_util.hpp"

namespace {

using kvq::AttentionOptions;
using kvq::KVCache;
using kvq::KVView;

constexpr double kTol = 2e-5;
constexpr int64_t kH = 2, kD = 64, kNh = 8;

/// One sequence: its cache (absent when empty), page table and f32 rows.
struct Seq {
  std::unique_ptr<KVCache> cache;
  int64_t T = 0, nq = 0;
  kvq::PageTable pt;
  KVView<const float> sk, sv, tk, tv;
};

/// B sequences of the given lengths and query counts, their pages copied into one pool in a
/// shuffled order.
struct Batch {
  std::vector<Seq> seqs;
  std::vector<std::byte> arena;
  std::byte* pool = nullptr;
  int64_t pool_pages = 0;
  std::vector<int64_t> page_indptr{0}, tokens, query_indptr{0};
  std::vector<int32_t> page_ids;
  std::vector<KVView<const float>> sk, sv, tk, tv;
  std::vector<float> q;
  kvq::PagedKVBatch b;

  Batch(const std::string& spec, const std::vector<int64_t>& lens, const std::vector<int64_t>& nqs) {
    const KVView<const float> none(nullptr, kvq::Shape{0, kH, kD});
    kvq::PageLayout layout;
    int64_t total_pages = 0;
    for (std::size_t s = 0; s < lens.size(); ++s) {
      Seq q;
      q.T = lens[s];
      q.nq = nqs[s];
      q.sk = q.sv = q.tk = q.tv = none;
      if (q.T > 0) {
        q.cache = std::make_unique<KVCache>(kvq::parse_policy(spec), 1, static_cast<int>(kH),
                                            static_cast<int>(kD));
        const auto kd = kvq_test::kv_data({q.T, kH, kD}, 100 + static_cast<uint32_t>(s), true);
        const auto vd = kvq_test::kv_data({q.T, kH, kD}, 200 + static_cast<uint32_t>(s), false);
        const int64_t pre = std::min<int64_t>(40, q.T);
        q.cache->append(0, KVView<const float>::nhd(kd.data(), pre, kH, kD),
                        KVView<const float>::nhd(vd.data(), pre, kH, kD));
        for (int64_t t = pre; t < q.T; ++t)
          q.cache->append(0, KVView<const float>::nhd(kd.data() + t * kH * kD, 1, kH, kD),
                          KVView<const float>::nhd(vd.data() + t * kH * kD, 1, kH, kD));
        q.pt = q.cache->page_table(0);
        layout = q.pt.layout;
        total_pages += q.pt.n_pages;
        q.cache->for_each_segment(0, [&](const kvq::CacheSegment& g) {
          if (g.kind == kvq::CacheSegment::Kind::kSinks) {
            q.sk = g.key_rows;
            q.sv = g.value_rows;
          } else if (g.kind == kvq::CacheSegment::Kind::kResidual) {
            q.tk = g.key_rows;
            q.tv = g.value_rows;
          }
        });
      }
      seqs.push_back(std::move(q));
    }
    // The pool: every page at a shuffled slot, plus two unused slots.
    pool_pages = total_pages + 2;
    const std::size_t pb = layout.bytes;
    arena.resize(pb * static_cast<std::size_t>(pool_pages) + 64);
    pool = arena.data() + (64 - reinterpret_cast<std::uintptr_t>(arena.data()) % 64) % 64;
    std::vector<int32_t> slots(static_cast<std::size_t>(pool_pages));
    for (std::size_t i = 0; i < slots.size(); ++i) slots[i] = static_cast<int32_t>(i);
    std::shuffle(slots.begin(), slots.end(), std::mt19937(5));
    std::size_t next = 0;
    for (Seq& s : seqs) {
      for (int64_t i = 0; s.cache && i < s.pt.n_pages; ++i) {
        const int32_t id = slots[next++];
        std::memcpy(pool + static_cast<std::size_t>(id) * pb, s.pt.pages[i], pb);
        page_ids.push_back(id);
      }
      page_indptr.push_back(static_cast<int64_t>(page_ids.size()));
      tokens.push_back(s.cache ? s.pt.tokens : 0);
      query_indptr.push_back(query_indptr.back() + s.nq);
      sk.push_back(s.sk);
      sv.push_back(s.sv);
      tk.push_back(s.tk);
      tv.push_back(s.tv);
    }
    q = kvq_test::kv_data({query_indptr.back(), kNh, kD}, 77, false);
    b.layout = layout;
    b.pool = pool;
    b.pool_pages = pool_pages;
    b.batch = static_cast<int64_t>(seqs.size());
    b.page_indptr = page_indptr.data();
    b.page_ids = page_ids.data();
    b.tokens = tokens.data();
    b.query_indptr = query_indptr.data();
    b.sink_k = sk.data();
    b.sink_v = sv.data();
    b.tail_k = tk.data();
    b.tail_v = tv.data();
  }

  int64_t rows() const { return query_indptr.back(); }
  KVView<const float> qv() const { return KVView<const float>::nhd(q.data(), rows(), kNh, kD); }

  std::vector<float> run(const AttentionOptions& opt, bool causal = true) const {
    std::vector<float> out(q.size(), 42.f);
    kvq::BatchAttentionWorkspace ws;
    kvq::attend_batch(b, qv(), KVView<float>::nhd(out.data(), rows(), kNh, kD), causal, ws,
                      nullptr, opt);
    return out;
  }
};

const std::vector<int64_t> kLens = {300, 0, 1000, 37, 1, 129};
const std::vector<int64_t> kNqs = {1, 3, 1, 5, 1, 17};

// ---- each sequence's rows equal attend_pages over its own page table (which equals attend
// over the cache: test_fused_attention), with and without options.
TEST(AttentionBatch, EqualsPerSequenceAttendPages) {
  for (const char* spec : {"f16", "k8v4", "kivi4", "k=lm4/qjl,v=lm3,sinks=4",
                           "k=e4m3/token,v=int4/token/g32,sinks=2,residual=16"}) {
    Batch bt(spec, kLens, kNqs);
    std::vector<float> sinks(kNh);
    for (int64_t h = 0; h < kNh; ++h) sinks[static_cast<std::size_t>(h)] = 0.25f * static_cast<float>(h);
    for (int variant = 0; variant < 2; ++variant) {
      AttentionOptions opt;
      opt.split_tokens = 256;
      if (variant == 1) {
        opt.softcap = 1.5f;
        opt.window = 200;
        opt.sinks = sinks.data();
        opt.scale = 0.1f;
      }
      const auto got = bt.run(opt);
      for (std::size_t s = 0; s < bt.seqs.size(); ++s) {
        const Seq& sq = bt.seqs[s];
        if (sq.T == 0 || sq.nq == 0) continue;
        const int64_t q0 = bt.query_indptr[s];
        std::vector<float> want(static_cast<std::size_t>(sq.nq * kNh * kD));
        kvq::AttentionWorkspace ws;
        kvq::attend_pages(sq.pt, sq.sk, sq.sv, sq.tk, sq.tv,
                          KVView<const float>::nhd(bt.q.data() + q0 * kNh * kD, sq.nq, kNh, kD),
                          KVView<float>::nhd(want.data(), sq.nq, kNh, kD), true, ws, nullptr,
                          opt);
        ASSERT_EQ(0, std::memcmp(want.data(), got.data() + q0 * kNh * kD,
                                 want.size() * sizeof(float)))
            << spec << " sequence " << s << " variant " << variant;
      }
    }
  }
}

// ---- options indexed by the global query row (positions, a tree mask callback, mask bits)
// against the oracle, sequence by sequence.
TEST(AttentionBatch, GlobalRowOptionsMatchTheOracle) {
  Batch bt("kivi4", kLens, kNqs);
  const int64_t rows = bt.rows();
  std::vector<int64_t> pos(static_cast<std::size_t>(rows));
  std::vector<int64_t> seq_of(static_cast<std::size_t>(rows));
  for (std::size_t s = 0; s < bt.seqs.size(); ++s)
    for (int64_t r = bt.query_indptr[s]; r < bt.query_indptr[s + 1]; ++r) {
      seq_of[static_cast<std::size_t>(r)] = static_cast<int64_t>(s);
      const int64_t T = bt.seqs[s].T;
      pos[static_cast<std::size_t>(r)] = T > 0 ? (r * 37) % T : 0;
    }
  const int64_t words = (1000 + 63) / 64;
  std::vector<uint64_t> bits(static_cast<std::size_t>(rows * words));
  std::mt19937 g(3);
  for (auto& w : bits) w = (static_cast<uint64_t>(g()) << 32) | g();
  for (int c = 0; c < 3; ++c) {
    AttentionOptions opt;
    opt.split_tokens = 128;
    opt.threads = 2;
    if (c == 0) opt.positions = pos.data();
    if (c == 1) {
      opt.mask_bits = bits.data();
      opt.mask_words = words;
    }
    if (c == 2)  // draft tokens of a verification tree: the prefix and even-offset rows
      opt.mask_fn = [&](int64_t r, int64_t t) {
        const std::size_t s = static_cast<std::size_t>(seq_of[static_cast<std::size_t>(r)]);
        const int64_t base = bt.seqs[s].T - bt.seqs[s].nq;
        return t < base || t - base <= r - bt.query_indptr[s];
      };
    // each row's log-sum-exp, by global row; the oracle writes its own at the same rows
    std::vector<float> lse(static_cast<std::size_t>(rows * kNh), 3.f), lse_ref(lse.size(), -3.f);
    opt.lse = lse.data();
    const auto got = bt.run(opt);
    AttentionOptions ropt = opt;
    ropt.lse = lse_ref.data();
    for (std::size_t s = 0; s < bt.seqs.size(); ++s) {
      const Seq& sq = bt.seqs[s];
      const int64_t q0 = bt.query_indptr[s];
      if (sq.T == 0) {
        for (int64_t k = q0 * kNh * kD; k < (q0 + sq.nq) * kNh * kD; ++k)
          ASSERT_EQ(got[static_cast<std::size_t>(k)], 0.f);
        for (int64_t k = q0 * kNh; k < (q0 + sq.nq) * kNh; ++k)
          ASSERT_EQ(lse[static_cast<std::size_t>(k)], -std::numeric_limits<float>::infinity())
              << "empty sequence " << s;
        continue;
      }
      std::vector<float> want(static_cast<std::size_t>(sq.nq * kNh * kD));
      kvq::reference::RefAttentionWorkspace rws;
      kvq::reference::attend_ref_segments(
          [&](auto&& fn) { sq.cache->for_each_segment(0, fn); }, sq.T, kH, kD,
          KVView<const float>::nhd(bt.q.data() + q0 * kNh * kD, sq.nq, kNh, kD),
          KVView<float>::nhd(want.data(), sq.nq, kNh, kD), true, rws, nullptr, 0, ropt, q0);
      for (int64_t k = q0 * kNh; k < (q0 + sq.nq) * kNh; ++k) {
        const float a = lse[static_cast<std::size_t>(k)], b = lse_ref[static_cast<std::size_t>(k)];
        if (std::isinf(b)) {
          ASSERT_EQ(a, b) << "case " << c << " sequence " << s << " row " << k;
        } else {
          ASSERT_NEAR(a, b, 1e-4 * (1.0 + std::fabs(b))) << "case " << c << " sequence " << s << " row " << k;
        }
      }
      for (int64_t i = 0; i < sq.nq; ++i)
        for (int64_t h = 0; h < kNh; ++h) {
          double mx = 1e-30, err = 0;
          for (int64_t d = 0; d < kD; ++d) {
            const std::size_t k = static_cast<std::size_t>((i * kNh + h) * kD + d);
            mx = std::max(mx, std::fabs(static_cast<double>(want[k])));
            err = std::max(err, std::fabs(static_cast<double>(got[q0 * kNh * kD + k]) - want[k]));
          }
          ASSERT_LE(err / mx, kTol) << "case " << c << " sequence " << s << " query " << i;
        }
    }
  }
}

// ---- 1, 2 and 3 threads (std::threads, then a caller's parallel-for): bit-identical.
TEST(AttentionBatch, ThreadCountDoesNotChangeTheResult) {
  for (const char* spec : {"k8v4", "f16"}) {
    Batch bt(spec, {700, 0, 2000, 64, 300}, {1, 1, 4, 1, 20});
    std::vector<float> first;
    for (int mode = 0; mode < 2; ++mode)
      for (int threads : {1, 2, 3}) {
        AttentionOptions opt;
        opt.threads = threads;
        opt.split_tokens = 128;
        int calls = 0;
        if (mode == 1)
          opt.parallel_for = [&calls](int64_t n, const std::function<void(int64_t)>& body) {
            ++calls;
            std::vector<std::thread> th;
            for (int64_t k = 0; k < n; ++k) th.emplace_back(body, k);
            for (auto& t : th) t.join();
          };
        const auto out = bt.run(opt);
        if (first.empty()) {
          first = out;
        } else {
          ASSERT_EQ(0, std::memcmp(first.data(), out.data(), out.size() * sizeof(float)))
              << spec << " threads=" << threads << " mode=" << mode;
        }
        if (mode == 1 && threads > 1) {
          EXPECT_EQ(calls, 1);
        }
      }
  }
}

// ---- empty sequences (and a batch of only empty ones, and an empty batch): zeros, no error.
TEST(AttentionBatch, EmptySequencesYieldZeros) {
  Batch bt("kivi4", {0, 50, 0}, {2, 1, 1});
  const auto out = bt.run({});
  for (int64_t k = 0; k < 2 * kNh * kD; ++k) ASSERT_EQ(out[static_cast<std::size_t>(k)], 0.f);
  for (int64_t k = 3 * kNh * kD; k < 4 * kNh * kD; ++k)
    ASSERT_EQ(out[static_cast<std::size_t>(k)], 0.f);
  bool nonzero = false;
  for (int64_t k = 2 * kNh * kD; k < 3 * kNh * kD; ++k)
    nonzero = nonzero || out[static_cast<std::size_t>(k)] != 0.f;
  EXPECT_TRUE(nonzero);
  Batch none("kivi4", {0, 0}, {1, 0});
  none.b.layout = bt.b.layout;
  const auto z = none.run({});
  for (float x : z) ASSERT_EQ(x, 0.f);
  kvq::PagedKVBatch empty;
  empty.layout = bt.b.layout;
  kvq::BatchAttentionWorkspace ws;
  std::vector<float> q0, o0;
  EXPECT_NO_THROW(kvq::attend_batch(empty, KVView<const float>(nullptr, kvq::Shape{0, kNh, kD}),
                                    KVView<float>(nullptr, kvq::Shape{0, kNh, kD}), true, ws));
}

// ---- bad tables throw naming the problem and write nothing.
TEST(AttentionBatch, BadTablesThrowNamingTheProblem) {
  Batch bt("k8v4", {300, 40, 100}, {1, 1, 2});
  auto expect = [&](const kvq::PagedKVBatch& b, const std::string& word) {
    std::vector<float> out(bt.q.size(), 42.f);
    kvq::BatchAttentionWorkspace ws;
    std::string msg;
    try {
      kvq::attend_batch(b, bt.qv(), KVView<float>::nhd(out.data(), bt.rows(), kNh, kD), true, ws);
    } catch (const kvq::Error& e) {
      msg = e.what();
    }
    EXPECT_NE(msg.find(word), std::string::npos)
        << "expected an error naming '" << word << "', got '" << msg << "'";
    for (float x : out) ASSERT_EQ(x, 42.f);
  };
  {
    auto ip = bt.page_indptr;
    std::swap(ip[1], ip[2]);
    kvq::PagedKVBatch b = bt.b;
    b.page_indptr = ip.data();
    expect(b, "page_indptr is not monotone");
  }
  {
    auto ids = bt.page_ids;
    ids[3] = static_cast<int32_t>(bt.pool_pages);
    kvq::PagedKVBatch b = bt.b;
    b.page_ids = ids.data();
    expect(b, "page id " + std::to_string(bt.pool_pages) + " (page_ids[3]");
    ids[3] = -1;
    expect(b, "outside the pool");
  }
  {
    auto tk = bt.tokens;
    tk[1] += 10 * bt.b.layout.page_tokens;
    kvq::PagedKVBatch b = bt.b;
    b.tokens = tk.data();
    expect(b, "sequence 1 holds");
  }
  {
    auto qi = bt.query_indptr;
    qi[3] -= 1;
    kvq::PagedKVBatch b = bt.b;
    b.query_indptr = qi.data();
    expect(b, "query indptr[3]");
    qi = bt.query_indptr;
    std::swap(qi[1], qi[2]);
    qi[1] = 3;
    b.query_indptr = qi.data();
    expect(b, "query indptr is not monotone");
  }
  {
    auto ip = bt.page_indptr;
    ip[0] = 1;
    kvq::PagedKVBatch b = bt.b;
    b.page_indptr = ip.data();
    expect(b, "page_indptr[0] must be 0");
  }
}

// ---- CacheBatch: several KVCaches gathered into one batch. Each sequence's rows equal attend()
// over its own cache bit for bit (attend reads the cache's segments, not a page table), for
// decode and for several query rows, with an empty cache among them; the batch follows the
// caches as they grow; caches laid out differently, a null cache, a wrong query list and a
// missing layer are refused naming the sequence, and the previous batch stays usable.
TEST(AttentionBatch, CacheBatchEqualsAttendPerCache) {
  const std::vector<int64_t> lens = {300, 0, 77, 129};
  for (const std::string spec : {"kivi4,sinks=3", "k8v4", "k=lm3,v=int4/token/g32,residual=16"}) {
    std::vector<std::unique_ptr<KVCache>> cs;
    std::vector<const KVCache*> ptrs;
    for (std::size_t s = 0; s < lens.size(); ++s) {
      cs.push_back(std::make_unique<KVCache>(kvq::parse_policy(spec), 2, static_cast<int>(kH),
                                             static_cast<int>(kD)));
      for (int layer = 0; layer < 2; ++layer) {
        if (lens[s] == 0) continue;
        const auto kd = kvq_test::kv_data({lens[s], kH, kD}, 300 + static_cast<uint32_t>(s + 7 * layer), true);
        const auto vd = kvq_test::kv_data({lens[s], kH, kD}, 400 + static_cast<uint32_t>(s + 7 * layer), false);
        cs.back()->append(layer, KVView<const float>::nhd(kd.data(), lens[s], kH, kD),
                          KVView<const float>::nhd(vd.data(), lens[s], kH, kD));
      }
      ptrs.push_back(cs.back().get());
    }
    kvq::CacheBatch cb;
    kvq::BatchAttentionWorkspace bws;
    kvq::AttentionWorkspace ws;
    for (const std::vector<int64_t>& nq : {std::vector<int64_t>{1, 1, 1, 1}, std::vector<int64_t>{3, 0, 1, 5}}) {
      const int64_t rows = nq[0] + nq[1] + nq[2] + nq[3];
      std::vector<float> q = kvq_test::kv_data({rows, kNh, kD}, 77, false);
      for (int layer = 0; layer < 2; ++layer) {
        const kvq::PagedKVBatch& b = cb.gather(ptrs, layer, nq);
        ASSERT_EQ(cb.total_queries(), rows);
        std::vector<float> out(q.size(), 42.f);
        kvq::attend_batch(b, KVView<const float>::nhd(q.data(), rows, kNh, kD),
                          KVView<float>::nhd(out.data(), rows, kNh, kD), true, bws);
        int64_t r0 = 0;
        for (std::size_t s = 0; s < lens.size(); ++s) {
          const std::size_t n = static_cast<std::size_t>(nq[s] * kNh * kD);
          const std::size_t at = static_cast<std::size_t>(r0 * kNh * kD);
          if (lens[s] == 0) {
            for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(out[at + i], 0.f) << spec;
          } else if (nq[s] > 0) {
            std::vector<float> want(n);
            kvq::attend(*ptrs[s], layer, KVView<const float>::nhd(q.data() + at, nq[s], kNh, kD),
                        KVView<float>::nhd(want.data(), nq[s], kNh, kD), true, ws);
            for (std::size_t i = 0; i < n; ++i)
              ASSERT_EQ(out[at + i], want[i]) << spec << " layer " << layer << " sequence " << s << " at " << i;
          }
          r0 += nq[s];
        }
      }
    }
    // One more decode token in every cache: a new gather follows the new pages and rows.
    for (std::size_t s = 0; s < lens.size(); ++s) {
      const auto kd = kvq_test::kv_data({1, kH, kD}, 500 + static_cast<uint32_t>(s), true);
      const auto vd = kvq_test::kv_data({1, kH, kD}, 600 + static_cast<uint32_t>(s), false);
      cs[s]->append(0, KVView<const float>::nhd(kd.data(), 1, kH, kD), KVView<const float>::nhd(vd.data(), 1, kH, kD));
    }
    const kvq::PagedKVBatch& b = cb.gather(ptrs, 0);
    std::vector<float> q = kvq_test::kv_data({4, kNh, kD}, 78, false), out(q.size());
    kvq::attend_batch(b, KVView<const float>::nhd(q.data(), 4, kNh, kD), KVView<float>::nhd(out.data(), 4, kNh, kD),
                      true, bws);
    for (std::size_t s = 0; s < lens.size(); ++s) {
      std::vector<float> want(static_cast<std::size_t>(kNh * kD));
      kvq::attend_one(*ptrs[s], 0, q.data() + s * want.size(), kNh, want.data(), ws);
      for (std::size_t i = 0; i < want.size(); ++i)
        ASSERT_EQ(out[s * want.size() + i], want[i]) << spec << " after a decode token, sequence " << s;
    }
  }
  // Refusals, naming the sequence; the previous batch stays in place.
  KVCache a(kvq::parse_policy("kivi4"), 1, static_cast<int>(kH), static_cast<int>(kD));
  KVCache k8(kvq::parse_policy("k8v4"), 1, static_cast<int>(kH), static_cast<int>(kD));
  KVCache other_heads(kvq::parse_policy("kivi4"), 1, 4, static_cast<int>(kD));
  kvq::CacheBatch cb;
  cb.gather({&a, &a}, 0);
  auto refused = [&](const std::vector<const KVCache*>& cs, int layer, const std::vector<int64_t>& nq,
                     const std::string& word) {
    std::string msg;
    try {
      cb.gather(cs, layer, nq);
    } catch (const kvq::Error& e) {
      msg = e.what();
    }
    EXPECT_NE(msg.find(word), std::string::npos) << "expected '" << word << "', got '" << msg << "'";
    EXPECT_EQ(cb.batch().batch, 2);
    EXPECT_EQ(cb.total_queries(), 2);
  };
  refused({&a, &k8}, 0, {1, 1}, "sequence 1 (k=e4m3");
  refused({&a, &a, &other_heads}, 0, {1, 1, 1}, "layer 0 of sequence 2");
  refused({&a, nullptr}, 0, {1, 1}, "cache of sequence 1 is null");
  refused({&a, &a}, 0, {1}, "2 caches but 1 query counts");
  refused({&a, &a}, 0, {1, -2}, "sequence 1 has -2 query rows");
  refused({&a, &a}, 1, {1, 1}, "layer 1 does not exist in the cache of sequence 0");
}

}  // namespace
