// The thread-safety contract of kvq (docs/reliability.md, "Concurrency"), exercised with real
// threads. CI also builds this file alone under ThreadSanitizer (-DKVQ_TSAN=ON, `./kvq.sh
// test`), so a data race inside any call the contract allows fails the build's test run even
// when the results happen to come out right.
//
// Allowed concurrently (each thread's result must equal the single-threaded one, bit for bit):
//   - quantize() / dequantize() of distinct tensors, any configs, including Lloyd-Max configs
//     whose shared (head_dim, bits, seed) context is being built by another thread right now;
//   - dequantize() of one shared const QTensor;
//   - const calls on one KVCache (read, attend with one AttentionWorkspace per thread,
//     memory_report, for_each_segment, tokens) while no thread calls a non-const method;
//   - anything on distinct KVCache objects (append, truncate, attend, ...), forks of one cache
//     (KVCache::fork, sharing pages) included;
//   - parse_policy / spec() (pure functions);
//   - attention that itself runs on several threads (AttentionOptions::threads > 1, or a
//     caller's parallel_for), attend and attend_batch, from several outer threads at once;
//   - one kvq::WorkerPool shared by several callers (their runs are served one at a time), and
//     a WorkerPool run from inside one of its own bodies (inline);
//   - several threads reading one ArchiveReader, or each its own (concurrent_archive_readers.hpp;
//     test_concurrency_portable_io runs the same on the portable, non-POSIX file path).
// Not allowed (not tested: undefined behaviour): a non-const KVCache call (append, truncate,
// clear, reserve) concurrently with any other call on the same cache, even on another layer;
// sharing one AttentionWorkspace or one QTensor output between threads.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "kvq/attention/attention.hpp"
#include "kvq/attention/worker_pool.hpp"
#include "kvq/cache/kv_cache.hpp"
#include "kvq/policy/spec.hpp"
#include "kvq/quant/quantize.hpp"
#include "robustness/concurrent_archive_readers.hpp"
#include "robustness/robustness_util.hpp"

namespace {

constexpr int kThreads = 4;

/// Runs fn(thread_index) on kThreads threads released together (so their calls overlap).
template <class Fn>
void run_together(Fn fn) {
  std::atomic<int> ready{0};
  std::vector<std::thread> ts;
  for (int i = 0; i < kThreads; ++i) {
    ts.emplace_back([&, i] {
      ready.fetch_add(1);
      while (ready.load() < kThreads) std::this_thread::yield();
      fn(i);
    });
  }
  for (auto& t : ts) t.join();
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

std::vector<float> roundtrip(const kvq::QuantConfig& c, const std::vector<float>& x,
                             const kvq::Shape& s) {
  const kvq::QTensor q =
      kvq::quantize(c, kvq::KVView<const float>::nhd(x.data(), s.tokens, s.heads, s.head_dim));
  std::vector<float> y(x.size());
  kvq::dequantize(q, kvq::KVView<float>::nhd(y.data(), s.tokens, s.heads, s.head_dim));
  return y;
}

TEST(Concurrency, QuantizeAndDequantizeOfDistinctTensors) {
  // Every thread walks the configs in a different order, and the Lloyd-Max configs use seeds
  // no other test uses, so contexts are created while other threads look them up.
  std::vector<kvq::QuantConfig> cfgs;
  for (const char* t : {"int4/channel/g16", "sint3/token/g32", "int2/head/g8/f32meta", "e4m3/head",
                        "e5m2/token/g16", "f16", "bf16", "lm3", "lm2/qjl", "lm4/f32meta"})
    cfgs.push_back(kvq::parse_quant_config(t));
  for (uint64_t seed : {0x1234567ULL, 0x7654321ULL}) {
    kvq::QuantConfig c = kvq::parse_quant_config("lm3");
    c.seed = seed;
    cfgs.push_back(c);
  }
  const kvq::Shape s{32, 2, 64};
  std::vector<std::vector<float>> x(kThreads);
  for (int i = 0; i < kThreads; ++i) x[i] = kvq_robust::normal(s, 100 + i);
  std::vector<std::vector<std::vector<float>>> got(kThreads,
                                                   std::vector<std::vector<float>>(cfgs.size()));
  run_together([&](int i) {
    for (size_t j = 0; j < cfgs.size(); ++j) {
      const size_t r = (j + 3 * static_cast<size_t>(i)) % cfgs.size();  // a rotation ...
      const size_t k = i % 2 ? cfgs.size() - 1 - r : r;                 // ... or its reverse
      got[i][k] = roundtrip(cfgs[k], x[i], s);
    }
  });
  for (int i = 0; i < kThreads; ++i)
    for (size_t k = 0; k < cfgs.size(); ++k)
      EXPECT_TRUE(same_bits(got[i][k], roundtrip(cfgs[k], x[i], s)))
          << "thread " << i << " " << cfgs[k].name();
}

TEST(Concurrency, DequantizeOfOneSharedTensor) {
  const kvq::Shape s{32, 2, 64};
  const std::vector<float> x = kvq_robust::normal(s, 7);
  for (const char* t : {"int4/channel/g16", "e4m3/token", "lm4/qjl"}) {
    const kvq::QTensor q =
        kvq::quantize(kvq::parse_quant_config(t),
                      kvq::KVView<const float>::nhd(x.data(), s.tokens, s.heads, s.head_dim));
    std::vector<float> expect(x.size());
    kvq::dequantize(q, kvq::KVView<float>::nhd(expect.data(), s.tokens, s.heads, s.head_dim));
    std::vector<std::vector<float>> got(kThreads, std::vector<float>(x.size()));
    run_together([&](int i) {
      for (int rep = 0; rep < 3; ++rep)
        kvq::dequantize(q, kvq::KVView<float>::nhd(got[i].data(), s.tokens, s.heads, s.head_dim));
    });
    for (int i = 0; i < kThreads; ++i)
      EXPECT_TRUE(same_bits(got[i], expect)) << t << " thread " << i;
  }
}

/// A cache holding sinks, packed blocks and a residual window in each of its 2 layers.
kvq::KVCache filled_cache(const std::string& spec, uint32_t seed) {
  kvq::KVCache c(kvq::parse_policy(spec), 2, 2, 32);
  const kvq::Shape s{75, 2, 32};
  const std::vector<float> k = kvq_robust::normal(s, seed), v = kvq_robust::normal(s, seed + 1);
  for (int l = 0; l < 2; ++l) {
    c.append(l, kvq::KVView<const float>::nhd(k.data(), s.tokens, 2, 32),
             kvq::KVView<const float>::nhd(v.data(), s.tokens, 2, 32));
  }
  return c;
}

/// Everything a reader computes from a cache: read() of both layers and attention of 3 causal
/// queries (4 query heads: GQA) per layer.
std::vector<float> reader_view(const kvq::KVCache& c, kvq::AttentionWorkspace& ws) {
  std::vector<float> all;
  const std::vector<float> q = kvq_robust::normal({3, 4, 32}, 5);
  for (int l = 0; l < c.n_layers(); ++l) {
    const int64_t T = c.tokens(l);
    std::vector<float> k(static_cast<size_t>(T * 2 * 32)), v(k.size()), out(q.size());
    c.read(l, 0, T, kvq::KVView<float>::nhd(k.data(), T, 2, 32),
           kvq::KVView<float>::nhd(v.data(), T, 2, 32));
    kvq::attend(c, l, kvq::KVView<const float>::nhd(q.data(), 3, 4, 32),
                kvq::KVView<float>::nhd(out.data(), 3, 4, 32), true, ws);
    int64_t seg_tokens = 0;
    c.for_each_segment(l, [&](const kvq::CacheSegment& seg) { seg_tokens += seg.tokens(); });
    EXPECT_EQ(seg_tokens, T);
    all.insert(all.end(), k.begin(), k.end());
    all.insert(all.end(), v.begin(), v.end());
    all.insert(all.end(), out.begin(), out.end());
  }
  all.push_back(static_cast<float>(c.memory_report().total()));
  return all;
}

TEST(Concurrency, ConstCallsOnOneCacheWhileNothingAppends) {
  for (const char* spec :
       {"kivi2,sinks=4", "turbo3", "k8v4", "k=lm2/qjl,v=int4/channel/g16,residual=8"}) {
    const kvq::KVCache cache = filled_cache(spec, 11);
    kvq::AttentionWorkspace ws0;
    const std::vector<float> expect = reader_view(cache, ws0);
    std::vector<std::vector<float>> got(kThreads);
    run_together([&](int i) {
      kvq::AttentionWorkspace ws;  // one per thread, as the contract says
      for (int rep = 0; rep < 2; ++rep) got[i] = reader_view(cache, ws);
    });
    for (int i = 0; i < kThreads; ++i)
      EXPECT_TRUE(same_bits(got[i], expect)) << spec << " thread " << i;
  }
}

TEST(Concurrency, DistinctCachesAreIndependent) {
  const char* specs[kThreads] = {"kivi2", "turbo4", "fp8,sinks=2", "k=lm3/qjl,v=lm2,residual=0"};
  std::vector<std::vector<float>> got(kThreads);
  run_together([&](int i) {
    kvq::KVCache c = filled_cache(specs[i], 20 + i);
    c.truncate(50);  // a non-const call, on this thread's own cache
    const std::vector<float> more = kvq_robust::normal({9, 2, 32}, 30 + i);
    for (int l = 0; l < 2; ++l)
      c.append(l, kvq::KVView<const float>::nhd(more.data(), 9, 2, 32),
               kvq::KVView<const float>::nhd(more.data(), 9, 2, 32));
    kvq::AttentionWorkspace ws;
    got[i] = reader_view(c, ws);
  });
  for (int i = 0; i < kThreads; ++i) {
    kvq::KVCache c = filled_cache(specs[i], 20 + i);
    c.truncate(50);
    const std::vector<float> more = kvq_robust::normal({9, 2, 32}, 30 + i);
    for (int l = 0; l < 2; ++l)
      c.append(l, kvq::KVView<const float>::nhd(more.data(), 9, 2, 32),
               kvq::KVView<const float>::nhd(more.data(), 9, 2, 32));
    kvq::AttentionWorkspace ws;
    EXPECT_TRUE(same_bits(got[i], reader_view(c, ws))) << specs[i];
  }
}

// Forks of one cache (KVCache::fork: the pages shared, reference-counted) written on different
// threads (truncated back into shared pages, appended to, flushing into new pages), while each
// thread also reads one fork nobody writes and one thread destroys the source.
TEST(Concurrency, ForksOfOneCacheAreIndependent) {
  for (const char* spec : {"kivi2", "turbo4,sinks=2"}) {
    auto source = std::make_unique<kvq::KVCache>(filled_cache(spec, 40));
    const kvq::KVCache reader = source->fork();
    std::vector<kvq::KVCache> forks;
    for (int i = 0; i < kThreads; ++i) forks.push_back(source->fork());
    auto write = [](kvq::KVCache& c, int i) {
      c.truncate(20 + 5 * i);
      const std::vector<float> more = kvq_robust::normal({40, 2, 32}, 50 + i);
      for (int l = 0; l < 2; ++l)
        c.append(l, kvq::KVView<const float>::nhd(more.data(), 40, 2, 32),
                 kvq::KVView<const float>::nhd(more.data(), 40, 2, 32));
    };
    std::vector<std::vector<float>> got(kThreads), seen(kThreads);
    run_together([&](int i) {
      if (i == kThreads - 1) source.reset();
      kvq::AttentionWorkspace ws;
      seen[i] = reader_view(reader, ws);
      write(forks[static_cast<std::size_t>(i)], i);
      got[i] = reader_view(forks[static_cast<std::size_t>(i)], ws);
    });
    kvq::AttentionWorkspace ws;
    const std::vector<float> expect_seen = reader_view(filled_cache(spec, 40), ws);
    for (int i = 0; i < kThreads; ++i) {
      kvq::KVCache alone = filled_cache(spec, 40);  // never forked
      write(alone, i);
      EXPECT_TRUE(same_bits(got[i], reader_view(alone, ws))) << spec << " fork " << i;
      EXPECT_TRUE(same_bits(seen[i], expect_seen)) << spec << " reader on thread " << i;
    }
  }
}

/// Attention of 5 causal queries (4 query heads) over layer 0 of each cache in `cs`: attend on
/// each, then attend_batch over the caches of `bs` (one policy: their pages by pointer, sinks
/// and tails as rows).
std::vector<float> attention_view(const std::vector<const kvq::KVCache*>& cs,
                                  const std::vector<const kvq::KVCache*>& bs,
                                  const kvq::AttentionOptions& opt) {
  const int64_t nq = 5, nh = 4, D = 32;
  const std::vector<float> q = kvq_robust::normal({nq * static_cast<int64_t>(cs.size()), nh, D}, 9);
  std::vector<float> all;
  kvq::AttentionWorkspace ws;
  for (std::size_t i = 0; i < cs.size(); ++i) {
    std::vector<float> out(static_cast<std::size_t>(nq * nh * D));
    kvq::attend(*cs[i], 0, kvq::KVView<const float>::nhd(q.data() + i * out.size(), nq, nh, D),
                kvq::KVView<float>::nhd(out.data(), nq, nh, D), true, ws, nullptr, opt);
    all.insert(all.end(), out.begin(), out.end());
  }
  kvq::CacheBatch cb;  // bs's pages by pointer, sinks and tails as rows
  const kvq::PagedKVBatch& b = cb.gather(bs, 0, std::vector<int64_t>(bs.size(), nq));
  const int64_t rows = cb.total_queries();
  std::vector<float> out(static_cast<std::size_t>(rows * nh * D));
  kvq::BatchAttentionWorkspace bws;
  kvq::attend_batch(b, kvq::KVView<const float>::nhd(q.data(), rows, nh, D),
                    kvq::KVView<float>::nhd(out.data(), rows, nh, D), true, bws,
                    nullptr, opt);
  all.insert(all.end(), out.begin(), out.end());
  return all;
}

TEST(Concurrency, AttentionOnWorkerThreadsFromSeveralCallers) {
  const kvq::KVCache a = filled_cache("kivi2,sinks=4", 51), b = filled_cache("k8v4", 52),
                     c = filled_cache("k=lm3/qjl,v=int4/channel/g16,residual=8", 53);
  const kvq::KVCache a2 = filled_cache("kivi2,sinks=4", 54), a3 = filled_cache("kivi2,sinks=4", 55);
  const std::vector<const kvq::KVCache*> cs = {&a, &b, &c}, bs = {&a, &a2, &a3};
  kvq::AttentionOptions one;
  one.split_tokens = 16;  // several chunks per sequence: the merge runs
  const std::vector<float> expect = attention_view(cs, bs, one);
  std::vector<std::vector<float>> got(kThreads);
  run_together([&](int i) {
    kvq::AttentionOptions opt = one;
    if (i % 2 == 0) {
      opt.threads = 3;  // kvq's own std::threads
    } else {
      opt.threads = 2;  // the caller's parallel-for (an engine's pool)
      opt.parallel_for = [](int64_t n, const std::function<void(int64_t)>& body) {
        std::vector<std::thread> th;
        for (int64_t k = 0; k < n; ++k) th.emplace_back(body, k);
        for (auto& t : th) t.join();
      };
    }
    got[i] = attention_view(cs, bs, opt);
  });
  for (int i = 0; i < kThreads; ++i) EXPECT_TRUE(same_bits(got[i], expect)) << "caller " << i;
}

TEST(Concurrency, OneWorkerPoolSharedBySeveralCallers) {
  const kvq::KVCache a = filled_cache("kivi2,sinks=4", 61), b = filled_cache("k8v4", 62),
                     c = filled_cache("fp8", 63);
  const kvq::KVCache a2 = filled_cache("kivi2,sinks=4", 64), a3 = filled_cache("kivi2,sinks=4", 65);
  const std::vector<const kvq::KVCache*> cs = {&a, &b, &c}, bs = {&a, &a2, &a3};
  kvq::AttentionOptions one;
  one.split_tokens = 16;
  const std::vector<float> expect = attention_view(cs, bs, one);
  kvq::WorkerPool pool(3);
  std::vector<std::vector<float>> got(kThreads);
  run_together([&](int i) {
    kvq::AttentionOptions opt = one;
    pool.configure(opt);
    for (int rep = 0; rep < 3; ++rep) got[i] = attention_view(cs, bs, opt);
  });
  for (int i = 0; i < kThreads; ++i) EXPECT_TRUE(same_bits(got[i], expect)) << "caller " << i;
}

// WorkerPool::run's contract, checked with counters the pool does not see: every index runs
// exactly once, index 0 on the calling thread, never two bodies of one index at once; it
// returns only after every body has returned; a body's exception comes back from run() after
// the others finished, and the pool serves the next run; a nested run goes inline.
TEST(Concurrency, WorkerPoolRunsEveryIndexOnce) {
  for (int threads : {1, 2, 3, 5}) {
    kvq::WorkerPool pool(threads);
    EXPECT_EQ(pool.threads(), threads);
    for (int64_t n : {0, 1, 2, 3, 7, 64}) {
      for (int rep = 0; rep < 200; ++rep) {
        std::vector<std::atomic<int>> hits(static_cast<std::size_t>(n));
        for (auto& h : hits) h.store(0);
        std::thread::id zero;
        std::atomic<int> running{0};
        pool.run(n, [&](int64_t k) {
          running.fetch_add(1);
          if (k == 0) zero = std::this_thread::get_id();
          hits[static_cast<std::size_t>(k)].fetch_add(1);
          running.fetch_sub(1);
        });
        EXPECT_EQ(running.load(), 0);  // nothing still running after run() returned
        for (int64_t k = 0; k < n; ++k)
          ASSERT_EQ(hits[static_cast<std::size_t>(k)].load(), 1)
              << "threads " << threads << " n " << n << " index " << k;
        if (n > 0) {
          EXPECT_EQ(zero, std::this_thread::get_id());
        }
      }
    }
  }
}

TEST(Concurrency, WorkerPoolRethrowsAfterEveryBodyReturned) {
  kvq::WorkerPool pool(3);
  for (int rep = 0; rep < 50; ++rep) {
    std::atomic<int> finished{0};
    const int64_t bad = rep % 6;
    try {
      pool.run(6, [&](int64_t k) {
        if (k == bad) throw std::runtime_error("body " + std::to_string(k));
        std::this_thread::sleep_for(std::chrono::microseconds(200));
        finished.fetch_add(1);
      });
      FAIL() << "run() did not rethrow";
    } catch (const std::runtime_error& e) {
      EXPECT_EQ(std::string(e.what()), "body " + std::to_string(bad));
    }
    EXPECT_EQ(finished.load(), 5);  // the other five ran to the end before run() threw
  }
  std::atomic<int> after{0};
  pool.run(4, [&](int64_t) { after.fetch_add(1); });
  EXPECT_EQ(after.load(), 4);
}

TEST(Concurrency, WorkerPoolNestedRunGoesInline) {
  kvq::WorkerPool pool(2);
  std::atomic<int> inner{0};
  pool.run(2, [&](int64_t) {
    const auto me = std::this_thread::get_id();
    pool.run(3, [&](int64_t) {
      EXPECT_EQ(std::this_thread::get_id(), me);
      inner.fetch_add(1);
    });
  });
  EXPECT_EQ(inner.load(), 6);
  EXPECT_THROW(kvq::WorkerPool(0), kvq::Error);
  EXPECT_THROW(kvq::WorkerPool(1025), kvq::Error);
}

TEST(Concurrency, ArchiveReadersOnSeveralThreads) {
  kvq_concurrent_io::check_concurrent_readers("posix", kThreads);
}

TEST(Concurrency, PolicyParsingIsPure) {
  std::vector<std::string> specs;
  for (const std::string& p : kvq_robust::all_policies())
    specs.push_back(kvq::parse_policy(p).spec());
  std::vector<std::vector<std::string>> got(kThreads);
  run_together([&](int i) {
    for (const std::string& p : kvq_robust::all_policies())
      got[i].push_back(kvq::parse_policy(p).spec());
  });
  for (int i = 0; i < kThreads; ++i) EXPECT_EQ(got[i], specs);
}

}  // namespace
