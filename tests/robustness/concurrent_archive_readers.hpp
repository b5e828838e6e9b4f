#pragma once
// Concurrent archive readers (docs/archive.md: "several threads may read one ArchiveReader at
// once"), included by test_concurrency.cpp (positioned reads, mmap) and by
// test_concurrency_portable_io.cpp (KVQ_ARCHIVE_POSIX=0: one std::ifstream per reader, files
// read into memory). Both run under ThreadSanitizer in `./kvq.sh test`.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include "kvq/io/archive.hpp"
#include "kvq/policy/spec.hpp"
#include "robustness/robustness_util.hpp"

namespace kvq_concurrent_io {

/// Everything a reader returns: read() of both layers' whole sequences, then the same read from
/// a load()ed cache, then the restored cache's memory total.
inline std::vector<float> archive_view(const kvq::io::ArchiveReader& r) {
  std::vector<float> all;
  const kvq::io::ArchiveInfo& in = r.info();
  for (int l = 0; l < in.n_layers; ++l) {
    const int64_t T = in.layers[static_cast<std::size_t>(l)].tokens;
    std::vector<float> k(static_cast<std::size_t>(T * in.kv_heads * in.head_dim)), v(k.size());
    r.read(l, 0, T, kvq::KVView<float>::nhd(k.data(), T, in.kv_heads, in.head_dim),
           kvq::KVView<float>::nhd(v.data(), T, in.kv_heads, in.head_dim));
    all.insert(all.end(), k.begin(), k.end());
    all.insert(all.end(), v.begin(), v.end());
  }
  r.verify();
  const kvq::KVCache c = r.load();
  all.push_back(static_cast<float>(c.memory_report().total()));
  return all;
}

/// Writes an archive of a 2-layer cache to a file unique to this process and `tag`.
inline std::filesystem::path write_archive(const std::string& spec, const std::string& tag) {
  kvq::KVCache c(kvq::parse_policy(spec), 2, 2, 32);
  const kvq::Shape s{90, 2, 32};
  const std::vector<float> k = kvq_robust::normal(s, 41), v = kvq_robust::normal(s, 42);
  for (int l = 0; l < 2; ++l)
    c.append(l, kvq::KVView<const float>::nhd(k.data(), s.tokens, 2, 32),
             kvq::KVView<const float>::nhd(v.data(), s.tokens, 2, 32));
  const auto path = std::filesystem::temp_directory_path() /
                    ("kvq_concurrent_" + tag + "_" + std::to_string(::getpid()) + ".kvqa");
  kvq::io::save_archive(c, path);
  return path;
}

/// `threads` threads released together: half share one ArchiveReader of the file, the others
/// open their own (file and in-memory MappedArchive); all must see the single-threaded bytes.
inline void check_concurrent_readers(const std::string& tag, int threads) {
  for (const char* spec : {"kivi2,sinks=4", "k=lm3/qjl,v=int4/channel/g16,residual=8", "k8v4"}) {
    const auto path = write_archive(spec, tag);
    const kvq::io::ArchiveReader shared(path);
    const std::vector<float> expect = archive_view(shared);
    const kvq::io::MappedArchive mapped0(path);
    std::vector<std::vector<float>> got(static_cast<std::size_t>(threads));
    std::vector<std::size_t> mapped_tokens(static_cast<std::size_t>(threads), 0);
    std::atomic<int> ready{0};
    std::vector<std::thread> ts;
    for (int i = 0; i < threads; ++i)
      ts.emplace_back([&, i] {
        ready.fetch_add(1);
        while (ready.load() < threads) std::this_thread::yield();
        if (i % 2 == 0) {
          got[static_cast<std::size_t>(i)] = archive_view(shared);
        } else {
          const kvq::io::ArchiveReader own(path);
          got[static_cast<std::size_t>(i)] = archive_view(own);
        }
        const kvq::io::MappedArchive m(path);
        std::size_t n = 0;
        for (int l = 0; l < m.info().n_layers; ++l)
          m.for_each_segment(l, [&](const kvq::CacheSegment& seg) { n += static_cast<std::size_t>(seg.tokens()); });
        mapped_tokens[static_cast<std::size_t>(i)] = n;
      });
    for (auto& t : ts) t.join();
    std::size_t want_tokens = 0;
    for (int l = 0; l < mapped0.info().n_layers; ++l)
      mapped0.for_each_segment(l, [&](const kvq::CacheSegment& seg) { want_tokens += static_cast<std::size_t>(seg.tokens()); });
    EXPECT_EQ(want_tokens, 180u) << spec;
    for (int i = 0; i < threads; ++i) {
      const auto& g = got[static_cast<std::size_t>(i)];
      EXPECT_TRUE(g.size() == expect.size() &&
                  std::memcmp(g.data(), expect.data(), g.size() * sizeof(float)) == 0)
          << spec << " thread " << i;
      EXPECT_EQ(mapped_tokens[static_cast<std::size_t>(i)], want_tokens) << spec << " thread " << i;
    }
    std::filesystem::remove(path);
  }
}

}  // namespace kvq_concurrent_io
