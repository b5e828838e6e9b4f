/// \file test_lloyd_max_registry.cpp
/// The process-wide rotate-then-Lloyd-Max context registry under hostile input: contexts of
/// non-QJL configs hold no QJL matrix; archives naming ever new seeds grow it by O(head_dim)
/// bytes each, never by a head_dim^2 matrix; readers count the contexts in their memory bound;
/// the registry refuses, by name, to grow past its context and QJL-byte limits.
/// Its own executable: it fills the registry to its limits, which later tests in the same
/// process could not survive.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "kvq/attention/attention.hpp"
#include "kvq/io/archive.hpp"
#include "kvq/quant/lloyd_max_quant.hpp"
#include "kvq/quant/quantize.hpp"

namespace {

using kvq::KVCache;
using kvq::detail::lloyd_max_registry_stats;

std::vector<float> rows(int64_t T, int64_t H, int64_t D, uint32_t seed) {
  std::vector<float> x(static_cast<std::size_t>(T * H * D));
  uint32_t s = seed * 2654435761u + 1;
  for (auto& v : x) {
    s = s * 1664525u + 1013904223u;
    v = static_cast<float>(static_cast<int32_t>(s >> 8) % 2001 - 1000) / 250.f;
  }
  return x;
}

// An archive of a one-layer cache with Lloyd-Max keys/values of the given seed.
std::vector<uint8_t> lm_archive(int64_t D, uint64_t seed, bool qjl) {
  kvq::Policy p = kvq::parse_policy(qjl ? "k=lm3/qjl,v=lm2" : "k=lm3,v=lm2");
  p.key.seed = seed;
  p.value.seed = seed + 1;
  KVCache c(p, 1, 1, D);
  const auto x = rows(20, 1, D, static_cast<uint32_t>(seed));
  c.append(0, kvq::KVView<const float>::nhd(x.data(), 20, 1, D),
           kvq::KVView<const float>::nhd(x.data(), 20, 1, D));
  return kvq::io::save_archive_bytes(c);
}

void attend_once(const KVCache& c, int64_t D) {
  const auto q = rows(1, 1, D, 7);
  std::vector<float> o(static_cast<std::size_t>(D));
  kvq::attend(c, 0, kvq::KVView<const float>::nhd(q.data(), 1, 1, D),
              kvq::KVView<float>::nhd(o.data(), 1, 1, D));
}

TEST(LloydMaxRegistry, ArchivesWithNewSeedsBuildNoQjlMatrixAndCountContexts) {
  const int64_t D = 2048;  // a QJL matrix here would be 16 MiB
  const auto before = lloyd_max_registry_stats();
  for (uint64_t seed = 100; seed < 116; ++seed) {
    const auto bytes = lm_archive(D, seed * 2, false);
    KVCache r = kvq::io::load_archive_bytes(bytes.data(), bytes.size());
    attend_once(r, D);
  }
  const auto after = lloyd_max_registry_stats();
  EXPECT_EQ(after.qjl_bytes, before.qjl_bytes) << "non-QJL contexts built a QJL matrix";
  // Two contexts per archive (keys lm3, values lm2, distinct seeds).
  EXPECT_EQ(after.contexts, before.contexts + 32);

  // A QJL config builds exactly one head_dim^2 matrix of floats, once.
  const auto q1 = lm_archive(D, 5000, true);
  KVCache r = kvq::io::load_archive_bytes(q1.data(), q1.size());
  attend_once(r, D);
  attend_once(r, D);
  EXPECT_EQ(lloyd_max_registry_stats().qjl_bytes, after.qjl_bytes + 4ull * D * D);
}

TEST(LloydMaxRegistry, ReaderCountsTheQjlMatrixInItsBound) {
  const int64_t D = 2048;
  const auto bytes = lm_archive(D, 777, true);
  kvq::io::ArchiveReadOptions o;
  o.max_cache_bytes = 8u << 20;  // enough for the cache, not for a 16 MiB QJL matrix
  try {
    kvq::io::ArchiveReader rd(bytes.data(), bytes.size(), "qjl.kvqa", o);
    FAIL() << "a reader under an 8 MiB bound accepted a 16 MiB QJL context";
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.kind(), kvq::ErrorKind::kIo);
    EXPECT_NE(std::string(e.what()).find("max_cache_bytes"), std::string::npos) << e.what();
  }
  // The same archive without QJL fits the same bound.
  const auto plain = lm_archive(D, 777, false);
  EXPECT_NO_THROW(kvq::io::ArchiveReader(plain.data(), plain.size(), "plain.kvqa", o));
}

TEST(LloydMaxRegistry, QjlHeadDimBeyondTheLimitIsRefusedByName) {
  const int64_t D = 2 * kvq::detail::kMaxQjlHeadDim;
  const auto x = rows(1, 1, D, 3);
  const kvq::QuantConfig cfg = kvq::parse_quant_config("lm2/qjl");
  try {
    (void)kvq::quantize(cfg, kvq::KVView<const float>::nhd(x.data(), 1, 1, D));
    FAIL() << "QJL at head_dim " << D << " accepted";
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.kind(), kvq::ErrorKind::kUnsupported);
    EXPECT_NE(std::string(e.what()).find("QJL limit"), std::string::npos) << e.what();
  }
}

// The QJL matrices of all contexts together stay under kMaxQjlRegistryBytes: at head_dim 4096
// (64 MiB each) new seeds are refused, by name, once the budget is spent; nothing was built for
// the refused one, and the matrices that exist still serve.
TEST(LloydMaxRegistry, RefusesQjlMatricesPastItsByteLimit) {
  const int64_t D = kvq::detail::kMaxQjlHeadDim;
  const uint64_t each = 4ull * D * D;
  uint64_t seed = 1u << 30;
  const kvq::detail::LloydMaxContext* last = nullptr;
  while (lloyd_max_registry_stats().qjl_bytes + each <= kvq::detail::kMaxQjlRegistryBytes) {
    last = &kvq::detail::lloyd_max_context(static_cast<int>(D), 1, seed++);
    ASSERT_NE(last->qjl_matrix(), nullptr);
  }
  const uint64_t full = lloyd_max_registry_stats().qjl_bytes;
  const auto& ctx = kvq::detail::lloyd_max_context(static_cast<int>(D), 1, seed);
  try {
    (void)ctx.qjl_matrix();
    FAIL() << "a QJL matrix was built past the registry's byte limit";
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.kind(), kvq::ErrorKind::kOutOfRange);
    EXPECT_NE(std::string(e.what()).find("bytes of QJL matrices"), std::string::npos) << e.what();
  }
  EXPECT_EQ(lloyd_max_registry_stats().qjl_bytes, full);
  ASSERT_NE(last, nullptr);
  EXPECT_NE(last->qjl_matrix(), nullptr);
}

// Runs last in this file (gtest keeps declaration order): it fills the registry.
TEST(LloydMaxRegistry, RefusesToGrowPastItsContextLimit) {
  const auto s0 = lloyd_max_registry_stats();
  ASSERT_LT(s0.contexts, kvq::detail::kMaxLloydMaxContexts);
  uint64_t seed = 1u << 20;
  for (std::size_t n = s0.contexts; n < kvq::detail::kMaxLloydMaxContexts; ++n)
    (void)kvq::detail::lloyd_max_context(8, 2, seed++);
  EXPECT_EQ(lloyd_max_registry_stats().contexts, kvq::detail::kMaxLloydMaxContexts);
  try {
    (void)kvq::detail::lloyd_max_context(8, 2, seed);
    FAIL() << "the registry grew past its limit";
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.kind(), kvq::ErrorKind::kOutOfRange);
    EXPECT_NE(std::string(e.what()).find("distinct contexts"), std::string::npos) << e.what();
  }
  // Contexts that exist are still served.
  EXPECT_EQ(kvq::detail::lloyd_max_context(8, 2, seed - 1).seed, seed - 1);
  EXPECT_EQ(lloyd_max_registry_stats().contexts, kvq::detail::kMaxLloydMaxContexts);
}

}  // namespace
