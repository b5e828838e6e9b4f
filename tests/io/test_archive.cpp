// kvq archives (io/archive.hpp) and CRC-32C (io/crc32c.hpp): the CRC against known answers and
// the table oracle; round trips of caches under many policies (stored bytes, page bytes, f32
// rows, rollback rows, memory report, attention bit for bit, identical behaviour afterwards,
// identical re-saved bytes); streaming offload; partial loads (layers, token prefixes, token
// ranges); the memory-mapped reader; policy/shape mismatches; and corruption: every single-bit
// flip and every truncation of a small archive, 10^5 random multi-byte corruptions, reordered
// and duplicated records, wrong magic/version/endianness, hostile-but-resealed fields — each
// refused with an error naming the record. Case counts are printed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include "io/io_test_util.hpp"
#include "kvq/attention/attention.hpp"
#include "kvq/cache/kv_cache.hpp"
#include "kvq/io/archive.hpp"
#include "kvq/io/crc32c.hpp"
#include "kvq/policy/spec.hpp"
#include "kvq/io/calibration_file.hpp"
#include "test_util.hpp"

namespace {

namespace io = kvq::io;
using kvq::KVCache;
using kvq::KVView;
using kvq::Shape;
using Access = kvq::detail::KVCacheAccess;

// ---------------------------------------------------------------------------------------------
// CRC-32C

TEST(Crc32c, KnownAnswers) {
  const char* s = "123456789";
  EXPECT_EQ(io::crc32c_portable(s, 9), 0xE3069283u);
  EXPECT_EQ(io::crc32c(s, 9), 0xE3069283u);
  EXPECT_EQ(io::crc32c_hw(s, 9), 0xE3069283u);
  // RFC 3720 (iSCSI) B.4 vectors.
  std::vector<uint8_t> z(32, 0), f(32, 0xFF), inc(32), dec(32);
  for (int i = 0; i < 32; ++i) {
    inc[static_cast<std::size_t>(i)] = static_cast<uint8_t>(i);
    dec[static_cast<std::size_t>(i)] = static_cast<uint8_t>(31 - i);
  }
  EXPECT_EQ(io::crc32c_portable(z.data(), 32), 0x8A9136AAu);
  EXPECT_EQ(io::crc32c_portable(f.data(), 32), 0x62A8AB43u);
  EXPECT_EQ(io::crc32c_portable(inc.data(), 32), 0x46DD794Eu);
  EXPECT_EQ(io::crc32c_portable(dec.data(), 32), 0x113FDB5Cu);
  EXPECT_EQ(io::crc32c(z.data(), 32), 0x8A9136AAu);
  EXPECT_EQ(io::crc32c(inc.data(), 32), 0x46DD794Eu);
  EXPECT_EQ(io::crc32c_portable(s, 0), 0u);
  std::printf("crc32c implementation on this machine: %s\n", io::crc32c_impl());
}

// The fast path equals the table oracle for every length 0..700 at every start alignment, and
// piecewise checksums chain.
TEST(Crc32c, FastPathEqualsTableOracle) {
  std::mt19937 rng(7);
  std::vector<uint8_t> buf(800);
  for (auto& b : buf) b = static_cast<uint8_t>(rng());
  long cases = 0;
  for (std::size_t a = 0; a < 8; ++a)
    for (std::size_t n = 0; n <= 700; ++n, ++cases) {
      const uint32_t want = io::crc32c_portable(buf.data() + a, n);
      ASSERT_EQ(io::crc32c_hw(buf.data() + a, n), want) << "offset " << a << " length " << n;
      ASSERT_EQ(io::crc32c(buf.data() + a, n), want);
      const std::size_t cut = n / 3;
      ASSERT_EQ(io::crc32c(buf.data() + a + cut, n - cut, io::crc32c_portable(buf.data() + a, cut)), want);
    }
  std::printf("crc32c: %ld (offset, length) cases, fast path (%s) == table\n", cases, io::crc32c_impl());
}

// ---------------------------------------------------------------------------------------------
// Helpers

/// Layer-by-layer equality of everything a cache stores.
void expect_same_state(const KVCache& a, const KVCache& b) {
  ASSERT_EQ(a.n_layers(), b.n_layers());
  ASSERT_EQ(a.kv_heads(), b.kv_heads());
  ASSERT_EQ(a.head_dim(), b.head_dim());
  ASSERT_TRUE(a.policy() == b.policy());
  EXPECT_EQ(a.options().exact_rollback, b.options().exact_rollback);
  EXPECT_EQ(a.max_tokens(), b.max_tokens());
  for (int l = 0; l < a.n_layers(); ++l) {
    SCOPED_TRACE("layer " + std::to_string(l));
    ASSERT_EQ(a.tokens(l), b.tokens(l));
    ASSERT_EQ(a.sink_tokens(l), b.sink_tokens(l));
    ASSERT_EQ(a.packed_tokens(l), b.packed_tokens(l));
    ASSERT_EQ(a.residual_tokens(l), b.residual_tokens(l));
    const kvq::PageTable ta = a.page_table(l), tb = b.page_table(l);
    ASSERT_EQ(ta.n_pages, tb.n_pages);
    ASSERT_EQ(ta.layout.bytes, tb.layout.bytes);
    for (int64_t j = 0; j < ta.n_pages; ++j)
      ASSERT_EQ(std::memcmp(ta.pages[j], tb.pages[j], ta.layout.bytes), 0) << "page " << j;
    std::vector<std::vector<float>> ra, rb;
    auto rows = [](const KVCache& c, int layer, std::vector<std::vector<float>>& out) {
      c.for_each_segment(layer, [&](const kvq::CacheSegment& s) {
        if (s.packed()) return;
        const std::size_t n = static_cast<std::size_t>(s.key_rows.numel());
        out.emplace_back(s.key_rows.data(), s.key_rows.data() + n);
        out.emplace_back(s.value_rows.data(), s.value_rows.data() + n);
      });
    };
    rows(a, l, ra);
    rows(b, l, rb);
    ASSERT_EQ(ra.size(), rb.size());
    for (std::size_t i = 0; i < ra.size(); ++i)
      ASSERT_EQ(std::memcmp(ra[i].data(), rb[i].data(), ra[i].size() * 4), 0) << "f32 rows " << i;
    ASSERT_EQ(Access::has_rollback(a, l), Access::has_rollback(b, l));
    if (Access::has_rollback(a, l)) {
      ASSERT_EQ(Access::roll_k(a, l), Access::roll_k(b, l));
      ASSERT_EQ(Access::roll_v(a, l), Access::roll_v(b, l));
    }
  }
  const auto ma = a.memory_report(), mb = b.memory_report();
  EXPECT_TRUE(ma.key_total() == mb.key_total());
  EXPECT_TRUE(ma.value_total() == mb.value_total());
}

/// Attention of `nq` random queries (GQA 2x) over every layer: bit-identical outputs.
void expect_same_attention(const KVCache& a, const KVCache& b, uint32_t seed,
                           const kvq::RopeConfig* rope = nullptr) {
  const int H = a.kv_heads() * 2, D = a.head_dim();
  for (int l = 0; l < a.n_layers(); ++l) {
    if (a.tokens(l) == 0) continue;
    const int64_t nq = std::min<int64_t>(4, a.tokens(l));
    const auto q = kvq_test::kv_data(Shape{nq, H, D}, seed + static_cast<uint32_t>(l), false);
    std::vector<float> oa(q.size()), ob(q.size());
    kvq::attend(a, l, KVView<const float>::nhd(q.data(), nq, H, D), KVView<float>::nhd(oa.data(), nq, H, D),
                true, rope);
    kvq::attend(b, l, KVView<const float>::nhd(q.data(), nq, H, D), KVView<float>::nhd(ob.data(), nq, H, D),
                true, rope);
    ASSERT_EQ(std::memcmp(oa.data(), ob.data(), oa.size() * 4), 0) << "attention differs, layer " << l;
  }
}

/// Appends `tokens` tokens to every layer in chunks of varying size (1..23).
void fill(KVCache& c, int64_t tokens, uint32_t seed) {
  const int H = c.kv_heads(), D = c.head_dim();
  for (int l = 0; l < c.n_layers(); ++l) {
    const auto k = kvq_test::kv_data(Shape{tokens, H, D}, seed + 17u * static_cast<uint32_t>(l), true);
    const auto v = kvq_test::kv_data(Shape{tokens, H, D}, seed + 17u * static_cast<uint32_t>(l) + 1, false);
    int64_t t = 0, step = 1;
    while (t < tokens) {
      const int64_t n = std::min<int64_t>(step, tokens - t);
      c.append(l, KVView<const float>::nhd(k.data() + t * H * D, n, H, D),
               KVView<const float>::nhd(v.data() + t * H * D, n, H, D));
      t += n;
      step = step % 23 + 5;
    }
  }
}

/// A calibrated nuq policy (codebooks learned by kvq::calibrate on random data).
kvq::Policy nuq_policy(int L, int H, int D) {
  kvq::CalibrationSet s;
  s.n_layers = L;
  s.kv_heads = H;
  s.head_dim = D;
  kvq::CalibrationSet::Sequence seq;
  seq.tokens = 96;
  for (int l = 0; l < L; ++l) {
    kvq::CalibrationSet::Layer cl;
    cl.k = kvq_test::kv_data(Shape{96, H, D}, 100u + static_cast<uint32_t>(l), true);
    cl.v = kvq_test::kv_data(Shape{96, H, D}, 200u + static_cast<uint32_t>(l), false);
    seq.layers.push_back(cl);
  }
  s.sequences.push_back(seq);
  kvq::CalibrationOptions o;
  o.max_iterations = 50;
  return kvq::calibrate(kvq::parse_policy("k=nuq3/channel/g32,v=nuq4/token/g32,residual=8,sinks=2"), s, o);
}

std::vector<uint8_t> slurp(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::vector<uint8_t>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

struct Case {
  std::string name;
  kvq::Policy policy;
  int64_t tokens;
};

std::vector<Case> round_trip_cases(int L, int H, int D) {
  std::vector<Case> c;
  for (const char* s :
       {"f16", "fp8", "k8v4", "kivi4", "turbo3", "kivi2,sinks=4,residual=16",
        "k8v4,sinks=3,residual=5,skip=1,skipas=fp8", "kivi2,k@1=f16,v@1=int8/token/g16",
        "k=int4/channel/g32/out2,v=int3/token/g16/out5%,residual=8",
        "k=lm3/qjl,v=lm2,residual=4,sinks=1", "k=e5m2/token/f32meta,v=sint4/head/g16/f32meta", "f32"})
    c.push_back({s, kvq::parse_policy(s), 150});
  kvq::Policy seeded = kvq::parse_policy("turbo4");
  seeded.key.seed = 12345;
  seeded.value.seed = 987654321987ull;
  seeded.key.fp8_margin = 0.75f;
  c.push_back({"turbo4 with custom seeds", seeded, 77});
  // FP4: e2m1 codes and byte block scales; NVFP4's tensor scale travels in the config record.
  c.push_back({"k=nvfp4,v=mxfp4,residual=8,sinks=2", kvq::parse_policy("k=nvfp4,v=mxfp4,residual=8,sinks=2"), 150});
  kvq::Policy fp4_scaled = kvq::parse_policy("k=mxfp4,v=nvfp4");
  fp4_scaled.value.fp4_tensor_scale = 0.0625f;
  c.push_back({"nvfp4 values with tensor scale 1/16", fp4_scaled, 99});
  c.push_back({"calibrated nuq (k nuq3 channel, v nuq4 token)", nuq_policy(L, H, D), 150});
  // Rotated int / fp8 / FP4 (/rot): the flag (config flag bit 3) and the seed travel.
  kvq::Policy rotated = kvq::parse_policy("k=sint4/channel/g16/rot,v=nvfp4/rot,residual=4,sinks=1,k@1=e4m3/head/rot");
  rotated.key.seed = 424242;
  c.push_back({"rotated sint4 / nvfp4 / e4m3, custom seed", rotated, 120});
  c.push_back({"kivi2 empty", kvq::parse_policy("kivi2,sinks=4"), 0});
  c.push_back({"kivi2 sinks only", kvq::parse_policy("kivi2,sinks=8"), 5});
  return c;
}

// ---------------------------------------------------------------------------------------------
// Round trips

TEST(Archive, RoundTripIsByteIdenticalWithIdenticalAttention) {
  kvq_test::TempDir dir;
  const int L = 3, H = 2, D = 32;
  int n = 0;
  for (const Case& tc : round_trip_cases(L, H, D)) {
    SCOPED_TRACE(tc.name);
    KVCache c(tc.policy, L, H, D, 0, kvq::KVCacheOptions{true});
    fill(c, tc.tokens, 11);
    const auto path = dir / ("c" + std::to_string(n++) + ".kvqa");
    const io::ArchiveSummary sum = kvq::save_archive(c, path);
    EXPECT_EQ(sum.bytes, std::filesystem::file_size(path));
    EXPECT_FALSE(std::filesystem::exists(path.string() + ".part"));
    const std::vector<uint8_t> bytes = io::save_archive_bytes(c);
    ASSERT_EQ(bytes, slurp(path)) << "file and memory archives differ";

    KVCache r = kvq::load_archive(path);
    expect_same_state(c, r);
    expect_same_attention(c, r, 5);
    EXPECT_EQ(io::verify_archive(path).file_crc, sum.file_crc);
    // Re-saving the loaded cache gives the same bytes (the writer is deterministic and the
    // reader restores everything the writer reads).
    EXPECT_EQ(io::save_archive_bytes(r), bytes);
    const io::ArchiveInfo info = io::verify_archive(path);
    EXPECT_EQ(info.spec, c.policy().spec());
    EXPECT_EQ(info.total_tokens(), tc.tokens * L);
    // The loaded cache behaves identically afterwards: more tokens, then a rollback.
    fill(c, 40, 99);
    fill(r, 40, 99);
    expect_same_state(c, r);
    for (int l = 0; l < L; ++l) {
      const int64_t cut = std::max<int64_t>(0, c.tokens(l) - 7);
      c.truncate(l, cut);
      r.truncate(l, cut);
    }
    expect_same_state(c, r);
    expect_same_attention(c, r, 6);
  }
  std::printf("round trip: %d policies x %d layers, byte-identical, attention bit-identical\n", n, L);
}

TEST(Archive, PreRopeKeysRoundTripWithRopeConfig) {
  const int L = 2, H = 2, D = 32;
  KVCache c(kvq::parse_policy("k=int2/channel/g32,v=int2/token/g32,residual=32"), L, H, D);
  fill(c, 140, 3);  // the keys stand for pre-RoPE keys; attention rotates them
  io::ArchiveOptions o;
  o.key_rope = kvq::RopeConfig{500000.0, kvq::RopeStyle::kHalf};
  o.note = "pre-RoPE keys from a test";
  const auto bytes = io::save_archive_bytes(c, o);
  io::ArchiveReader rd(bytes.data(), bytes.size(), "prerope.kvqa");
  ASSERT_TRUE(rd.info().key_rope.has_value());
  EXPECT_EQ(rd.info().key_rope->theta, 500000.0);
  EXPECT_EQ(rd.info().key_rope->style, kvq::RopeStyle::kHalf);
  EXPECT_EQ(rd.info().note, o.note);
  KVCache r = rd.load();
  expect_same_state(c, r);
  expect_same_attention(c, r, 8, &*rd.info().key_rope);
}

TEST(Archive, NoRollbackOptionAndMaxTokensRoundTrip) {
  kvq::KVCacheOptions o;
  o.exact_rollback = false;
  KVCache c(kvq::parse_policy("kivi4,sinks=2"), 2, 2, 32, 500, o);
  fill(c, 130, 4);
  const auto bytes = io::save_archive_bytes(c);
  KVCache r = io::load_archive_bytes(bytes.data(), bytes.size());
  EXPECT_FALSE(r.options().exact_rollback);
  EXPECT_EQ(r.max_tokens(), 500);
  expect_same_state(c, r);
}

// Without the rollback rows: the same tokens, pages and windows, no rollback rows, identical
// attention; per layer B x 2 x kv_heads x head_dim x 4 bytes (+ 128 of framing) smaller.
TEST(Archive, WithoutRollbackRows) {
  KVCache c(kvq::parse_policy("kivi2,sinks=4"), 2, 2, 32, 0, kvq::KVCacheOptions{true});
  fill(c, 130, 4);
  io::ArchiveOptions o;
  o.rollback_rows = false;
  const auto with = io::save_archive_bytes(c), without = io::save_archive_bytes(c, o);
  // per layer: record header + payload + its index entry in the footer
  EXPECT_EQ(with.size() - without.size(), 2u * (64 + 2 * 32 * 2 * 32 * 4 + 64));
  KVCache r = io::load_archive_bytes(without.data(), without.size());
  for (int l = 0; l < 2; ++l) {
    EXPECT_TRUE(Access::has_rollback(c, l));
    EXPECT_FALSE(Access::has_rollback(r, l));
  }
  expect_same_attention(c, r, 3);
  EXPECT_EQ(io::save_archive_bytes(r), without);  // everything else restored byte for byte
}

// Offload: pages stream out as the cache flushes them (decode one token at a time, the writer
// called after every step), the f32 regions at the end. The result loads equal to the cache.
TEST(Archive, StreamingWriterOffloadsPagesAsTheyAreFlushed) {
  kvq_test::TempDir dir;
  const int L = 2, H = 2, D = 32, T = 200;
  KVCache c(kvq::parse_policy("kivi2,sinks=4"), L, H, D, 0, kvq::KVCacheOptions{true});
  const auto path = dir / "stream.kvqa";
  std::size_t streamed = 0;
  {
    io::ArchiveWriter w(path, c);
    std::vector<std::vector<float>> k, v;
    for (int l = 0; l < L; ++l) {
      k.push_back(kvq_test::kv_data(Shape{T, H, D}, 40u + static_cast<uint32_t>(l), true));
      v.push_back(kvq_test::kv_data(Shape{T, H, D}, 50u + static_cast<uint32_t>(l), false));
    }
    for (int t = 0; t < T; ++t) {
      for (int l = 0; l < L; ++l)
        c.append(l, KVView<const float>::nhd(k[static_cast<std::size_t>(l)].data() + t * H * D, 1, H, D),
                 KVView<const float>::nhd(v[static_cast<std::size_t>(l)].data() + t * H * D, 1, H, D));
      streamed += w.append_pages(c);
    }
    EXPECT_FALSE(std::filesystem::exists(path)) << "the archive appears only when finished";
    EXPECT_TRUE(std::filesystem::exists(path.string() + ".part"));
    w.finish(c);
  }
  EXPECT_EQ(streamed, static_cast<std::size_t>(L * c.page_table(0).n_pages));
  KVCache r = kvq::load_archive(path);
  expect_same_state(c, r);
  expect_same_attention(c, r, 9);

  // A writer destroyed unfinished leaves nothing behind.
  const auto p2 = dir / "abandoned.kvqa";
  {
    io::ArchiveWriter w(p2, c);
    w.append_pages(c);
  }
  EXPECT_FALSE(std::filesystem::exists(p2));
  EXPECT_FALSE(std::filesystem::exists(p2.string() + ".part"));

  // Truncating the cache past archived pages is refused (the archive would hold stale pages).
  KVCache c2(kvq::parse_policy("kivi2"), 1, H, D);
  fill(c2, 100, 1);
  std::vector<uint8_t> out;
  io::ArchiveWriter w(out, c2);
  w.append_pages(c2);
  c2.truncate(10);
  EXPECT_THROW(w.append_pages(c2), kvq::Error);
  fill(c2, 90, 2);  // refilled to the same page count with other tokens
  try {
    w.finish(c2);
    ADD_FAILURE() << "finish accepted pages that changed after they were archived";
  } catch (const kvq::Error& e) {
    EXPECT_NE(std::string(e.what()).find("changed after it was archived"), std::string::npos) << e.what();
  }
  // Another cache than the one the writer was opened on is refused.
  KVCache other(kvq::parse_policy("kivi4"), 1, H, D);
  std::vector<uint8_t> out2;
  io::ArchiveWriter w2(out2, c2);
  EXPECT_THROW(w2.append_pages(other), kvq::Error);
}

// ---------------------------------------------------------------------------------------------
// Partial loads

TEST(Archive, LayerAndPrefixLoadsEqualTruncatedFullLoads) {
  const int L = 3, H = 2, D = 32;
  long cases = 0;
  for (const char* spec : {"kivi2,sinks=4,residual=16", "k8v4,residual=3", "turbo3,sinks=2"}) {
    SCOPED_TRACE(spec);
    KVCache c(kvq::parse_policy(spec), L, H, D);
    fill(c, 150, 21);
    c.truncate(2, 120);  // layers may differ in length
    const auto bytes = io::save_archive_bytes(c);
    io::ArchiveReader rd(bytes.data(), bytes.size());
    for (int layer = 0; layer < L; ++layer) {
      KVCache one = rd.load(io::ArchiveSelection{{layer}, -1});
      KVCache want = c;
      for (int l = 0; l < L; ++l)
        if (l != layer) want.truncate(l, 0);
      expect_same_state(want, one);
      ++cases;
    }
    for (int64_t n = 0; n <= 151; ++n) {
      KVCache pre = rd.load(io::ArchiveSelection{{}, n});
      KVCache want = c;
      for (int l = 0; l < L; ++l) want.truncate(l, std::min(n, want.tokens(l)));
      expect_same_state(want, pre);
      ++cases;
    }
    // Token ranges dequantized straight from the records equal KVCache::read.
    for (int64_t a : {0, 3, 4, 17, 36, 100})
      for (int64_t b : {a, a + 1, a + 33, int64_t{120}}) {
        if (b < a || b > 120) continue;
        std::vector<float> k1(static_cast<std::size_t>((b - a) * H * D)), v1(k1.size()), k2(k1.size()),
            v2(k1.size());
        c.read(2, a, b, KVView<float>::nhd(k1.data(), b - a, H, D), KVView<float>::nhd(v1.data(), b - a, H, D));
        rd.read(2, a, b, KVView<float>::nhd(k2.data(), b - a, H, D), KVView<float>::nhd(v2.data(), b - a, H, D));
        ASSERT_EQ(k1, k2);
        ASSERT_EQ(v1, v2);
        ++cases;
      }
  }
  std::printf("partial loads: %ld cases (layer selections, prefixes 0..151, token ranges)\n", cases);
}

// The mapped reader verifies everything at open and gives the kernels pages in place.
TEST(Archive, MappedArchiveGivesPagesInPlaceAndIdenticalAttention) {
  kvq_test::TempDir dir;
  const int L = 2, H = 2, D = 32;
  KVCache c(kvq::parse_policy("k8v4,sinks=4,residual=8"), L, H, D);
  fill(c, 170, 31);
  const auto path = dir / "m.kvqa";
  kvq::save_archive(c, path);
  io::MappedArchive m(path);
  for (int l = 0; l < L; ++l) {
    const kvq::PageTable t = m.page_table(l), tc = c.page_table(l);
    ASSERT_EQ(t.n_pages, tc.n_pages);
    for (int64_t j = 0; j < t.n_pages; ++j) {
      EXPECT_EQ(reinterpret_cast<std::uintptr_t>(t.pages[j]) % 64, 0u);
      EXPECT_GE(reinterpret_cast<const uint8_t*>(t.pages[j]), m.data());
      EXPECT_LT(reinterpret_cast<const uint8_t*>(t.pages[j]), m.data() + m.size());
      ASSERT_EQ(std::memcmp(t.pages[j], tc.pages[j], t.layout.bytes), 0);
    }
    std::vector<kvq::CacheSegment> segs;
    m.for_each_segment(l, [&](const kvq::CacheSegment& s) { segs.push_back(s); });
    const int Hq = 2 * H;
    const auto q = kvq_test::kv_data(Shape{3, Hq, D}, 77, false);
    std::vector<float> o1(q.size()), o2(q.size());
    kvq::AttentionWorkspace ws;
    kvq::attend_segments(segs.data(), segs.size(), H, D, KVView<const float>::nhd(q.data(), 3, Hq, D),
                         KVView<float>::nhd(o1.data(), 3, Hq, D), true, ws);
    kvq::attend(c, l, KVView<const float>::nhd(q.data(), 3, Hq, D), KVView<float>::nhd(o2.data(), 3, Hq, D));
    ASSERT_EQ(std::memcmp(o1.data(), o2.data(), o1.size() * 4), 0);
  }
  expect_same_state(c, m.load());
}

// ---------------------------------------------------------------------------------------------
// Mismatches and the strong guarantee

TEST(Archive, LoadIntoDifferentPolicyOrShapeIsAClearErrorAndChangesNothing) {
  const int L = 2, H = 2, D = 32;
  KVCache src(kvq::parse_policy("kivi2,sinks=4"), L, H, D);
  fill(src, 100, 1);
  const auto bytes = io::save_archive_bytes(src);
  io::ArchiveReader rd(bytes.data(), bytes.size(), "a.kvqa");
  auto refused = [&](KVCache& into, kvq::ErrorKind kind, const char* text) {
    const KVCache before = into;
    try {
      rd.load_into(into);
      ADD_FAILURE() << "accepted: " << text;
    } catch (const kvq::Error& e) {
      EXPECT_EQ(e.kind(), kind) << e.what();
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    }
    expect_same_state(before, into);
  };
  KVCache other_policy(kvq::parse_policy("kivi4,sinks=4"), L, H, D);
  fill(other_policy, 50, 2);
  refused(other_policy, kvq::ErrorKind::kInvalidArgument, "k=int4/channel/g32");
  KVCache other_heads(kvq::parse_policy("kivi2,sinks=4"), L, 4, D);
  refused(other_heads, kvq::ErrorKind::kShapeMismatch, "4 x 32");
  KVCache other_layers(kvq::parse_policy("kivi2,sinks=4"), 3, H, D);
  refused(other_layers, kvq::ErrorKind::kShapeMismatch, "3 layers");
  kvq::Policy seeded = kvq::parse_policy("turbo3");
  KVCache t1(seeded, L, H, D);
  fill(t1, 40, 3);
  const auto tb = io::save_archive_bytes(t1);
  seeded.key.seed = 7;
  KVCache t2(seeded, L, H, D);
  const KVCache t2_before = t2;
  try {
    io::ArchiveReader(tb.data(), tb.size()).load_into(t2);
    ADD_FAILURE() << "a different rotation seed was accepted";
  } catch (const kvq::Error& e) {
    EXPECT_NE(std::string(e.what()).find("seed"), std::string::npos) << e.what();
  }
  expect_same_state(t2_before, t2);
  KVCache small_max(kvq::parse_policy("kivi2,sinks=4"), L, H, D, 64);
  refused(small_max, kvq::ErrorKind::kOutOfRange, "max_tokens=64");
  // A compatible cache with other contents is replaced wholesale.
  KVCache same(kvq::parse_policy("kivi2,sinks=4"), L, H, D);
  fill(same, 33, 4);
  rd.load_into(same);
  expect_same_state(src, same);
}

// A load that fails in its last record leaves the target exactly as it was (and load() returns
// nothing): no half-built cache is ever visible.
TEST(Archive, FailedLoadLeavesNoHalfBuiltCache) {
  const int L = 3, H = 2, D = 32;
  KVCache src(kvq::parse_policy("kivi2,sinks=4"), L, H, D);
  fill(src, 150, 1);
  auto bytes = io::save_archive_bytes(src);
  io::ArchiveReader good(bytes.data(), bytes.size());
  const io::ArchiveRecord last = good.info().records.back();
  bytes[static_cast<std::size_t>(last.payload_offset() + last.payload_bytes / 2)] ^= 0x10;
  io::ArchiveReader rd(bytes.data(), bytes.size(), "bad.kvqa");  // structure is intact
  KVCache into(kvq::parse_policy("kivi2,sinks=4"), L, H, D);
  fill(into, 70, 9);
  const KVCache before = into;
  try {
    rd.load_into(into);
    ADD_FAILURE() << "corrupted last record accepted";
  } catch (const kvq::Error& e) {
    EXPECT_NE(std::string(e.what()).find(last.name()), std::string::npos) << e.what();
  }
  expect_same_state(before, into);
  EXPECT_THROW(rd.load(), kvq::Error);
  // A partial load that does not touch the damaged record still works; one that does fails.
  const int other = last.layer == 0 ? 1 : 0;
  EXPECT_NO_THROW(rd.load(io::ArchiveSelection{{other}, -1}));
  EXPECT_THROW(rd.load(io::ArchiveSelection{{last.layer}, -1}), kvq::Error);
}

// ---------------------------------------------------------------------------------------------
// Corruption

/// A small archive with every record kind: 2 layers (the second overridden to Lloyd-Max),
/// sinks, one page, residual and rollback rows each.
std::vector<uint8_t> small_archive() {
  KVCache c(kvq::parse_policy("kivi2,sinks=2,residual=4,k@1=lm3,v@1=int4/token/g8"), 2, 1, 8, 0, kvq::KVCacheOptions{true});
  fill(c, 39, 5);
  return io::save_archive_bytes(c);
}

/// What region of the archive offset `off` is in, and the text an error there must contain.
std::string expected_name(const io::ArchiveInfo& info, uint64_t off) {
  if (off < info.header_bytes) return "header";
  for (const io::ArchiveRecord& r : info.records)
    if (off >= r.offset && off < r.offset + r.extent()) return r.name();
  if (off < info.footer_offset + info.footer_bytes) return "footer";
  return "trailer";
}

/// Verifies an image; returns the error text ("" when accepted).
std::string verify_error(const std::vector<uint8_t>& img, kvq::ErrorKind* kind = nullptr) {
  try {
    io::ArchiveReader r(img.data(), img.size(), "x.kvqa");
    r.verify();
    return "";
  } catch (const kvq::Error& e) {
    if (kind) *kind = e.kind();
    return e.what();
  }
}

TEST(ArchiveCorruption, EverySingleBitFlipIsDetectedAndNamed) {
  const std::vector<uint8_t> good = small_archive();
  ASSERT_EQ(verify_error(good), "");
  io::ArchiveReader rd(good.data(), good.size());
  const io::ArchiveInfo& info = rd.info();
  long flips = 0, detected = 0, named = 0;
  std::vector<uint8_t> img = good;
  for (std::size_t i = 0; i < img.size(); ++i)
    for (int bit = 0; bit < 8; ++bit) {
      img[i] ^= static_cast<uint8_t>(1u << bit);
      kvq::ErrorKind kind{};
      const std::string e = verify_error(img, &kind);
      ++flips;
      if (!e.empty()) ++detected;
      else ADD_FAILURE() << "flip of bit " << bit << " of byte " << i << " not detected";
      const std::string want = expected_name(info, i);
      if (e.find(want) != std::string::npos) ++named;
      else if (!e.empty() && named + 20 > flips) ADD_FAILURE() << "byte " << i << ": error does not name '" << want << "': " << e;
      img[i] ^= static_cast<uint8_t>(1u << bit);
    }
  std::printf("single-bit flips: %ld of a %zu-byte archive (%zu records), %ld detected, %ld named the "
              "damaged record or section\n",
              flips, good.size(), info.records.size(), detected, named);
  EXPECT_EQ(detected, flips);
  EXPECT_EQ(named, flips);
}

TEST(ArchiveCorruption, EveryTruncationIsDetectedAndSaysWhereTheFileEnds) {
  const std::vector<uint8_t> good = small_archive();
  io::ArchiveReader rd(good.data(), good.size());
  const io::ArchiveInfo& info = rd.info();
  long cuts = 0, detected = 0, named = 0;
  for (std::size_t n = 0; n < good.size(); ++n) {
    const std::vector<uint8_t> img(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(n));
    const std::string e = verify_error(img);
    ++cuts;
    if (e.empty()) {
      ADD_FAILURE() << "truncation to " << n << " bytes accepted";
      continue;
    }
    ++detected;
    // Past the header the message names the record the file ends in (or right after).
    bool ok = e.find("truncated") != std::string::npos;
    for (const io::ArchiveRecord& r : info.records) {
      if (n < r.offset || n >= r.offset + r.extent()) continue;
      const std::string in = "record #" + std::to_string(r.seq) + " (", at = "offset " + std::to_string(r.offset);
      const bool inside = e.find(in) != std::string::npos && e.find(at) != std::string::npos;
      const bool right_after = n == r.offset && e.find("right after") != std::string::npos &&
                               (r.seq == 0 ? e.find("the header") != std::string::npos
                                           : e.find(info.records[r.seq - 1].name()) != std::string::npos);
      ok = ok && (inside || right_after);
    }
    if (ok) ++named;
    else if (named + 20 > cuts) ADD_FAILURE() << "truncation to " << n << ": " << e;
  }
  std::printf("truncations: %ld (every length 0..%zu), %ld detected, %ld said where the file ends\n", cuts,
              good.size() - 1, detected, named);
  EXPECT_EQ(detected, cuts);
  EXPECT_EQ(named, cuts);
  // Bytes appended after the trailer are refused too.
  std::vector<uint8_t> longer = good;
  longer.push_back(0);
  EXPECT_NE(verify_error(longer), "");
}

TEST(ArchiveCorruption, RandomMultiByteCorruptionIsDetected) {
  const std::vector<uint8_t> good = small_archive();
  std::mt19937_64 rng(2024);
  const long kTrials = 100000;
  long detected = 0;
  std::vector<uint8_t> img;
  for (long t = 0; t < kTrials; ++t) {
    img = good;
    const int mode = static_cast<int>(rng() % 3);
    if (mode == 0) {  // 2..16 random bytes set to random values
      const int n = 2 + static_cast<int>(rng() % 15);
      for (int i = 0; i < n; ++i) img[rng() % img.size()] = static_cast<uint8_t>(rng());
    } else if (mode == 1) {  // a burst of 2..64 random bytes
      const std::size_t len = 2 + rng() % 63, at = rng() % (img.size() - len);
      for (std::size_t i = 0; i < len; ++i) img[at + i] = static_cast<uint8_t>(rng());
    } else {  // a block of 8..256 bytes copied from elsewhere in the file
      const std::size_t len = 8 + rng() % 249, from = rng() % (img.size() - len),
                        to = rng() % (img.size() - len);
      std::memmove(img.data() + to, good.data() + from, len);
    }
    if (img == good) img[rng() % img.size()] ^= 0xFF;
    if (!verify_error(img).empty()) ++detected;
    else ADD_FAILURE() << "trial " << t << " (mode " << mode << ") not detected";
  }
  std::printf("random multi-byte corruptions: %ld trials, %ld detected\n", kTrials, detected);
  EXPECT_EQ(detected, kTrials);
}

/// Swaps the bytes of records a and b (same extent).
void swap_records(std::vector<uint8_t>& img, const io::ArchiveRecord& a, const io::ArchiveRecord& b) {
  ASSERT_EQ(a.extent(), b.extent());
  std::swap_ranges(img.begin() + static_cast<std::ptrdiff_t>(a.offset),
                   img.begin() + static_cast<std::ptrdiff_t>(a.offset + a.extent()),
                   img.begin() + static_cast<std::ptrdiff_t>(b.offset));
}

TEST(ArchiveCorruption, ReorderedAndDuplicatedRecordsAreNamed) {
  KVCache c(kvq::parse_policy("kivi2,sinks=4"), 2, 2, 32, 0, kvq::KVCacheOptions{true});
  fill(c, 150, 1);
  const auto good = io::save_archive_bytes(c);
  io::ArchiveReader rd(good.data(), good.size());
  const auto& recs = rd.info().records;
  // Two pages of layer 0 (same size) swapped, and two whole layers' first pages swapped.
  std::vector<std::pair<std::size_t, std::size_t>> pairs;
  for (std::size_t i = 0; i < recs.size(); ++i)
    for (std::size_t j = i + 1; j < recs.size(); ++j)
      if (recs[i].extent() == recs[j].extent()) pairs.emplace_back(i, j);
  ASSERT_GE(pairs.size(), 3u);
  long cases = 0;
  for (const auto& [i, j] : pairs) {
    std::vector<uint8_t> img = good;
    swap_records(img, recs[i], recs[j]);
    std::string e = verify_error(img);
    EXPECT_NE(e.find("reordered"), std::string::npos) << e;
    EXPECT_NE(e.find(recs[i].name()), std::string::npos) << e;
    // Duplicated: record j's bytes over record i.
    img = good;
    std::copy(good.begin() + static_cast<std::ptrdiff_t>(recs[j].offset),
              good.begin() + static_cast<std::ptrdiff_t>(recs[j].offset + recs[j].extent()),
              img.begin() + static_cast<std::ptrdiff_t>(recs[i].offset));
    e = verify_error(img);
    EXPECT_NE(e.find("duplicated"), std::string::npos) << e;
    EXPECT_NE(e.find(recs[i].name()), std::string::npos) << e;
    cases += 2;
  }
  // A hostile writer that also rewrites the sequence numbers, the index and every checksum:
  // the duplicate is still found (the index lists one page twice, another not at all).
  {
    std::vector<uint8_t> img = good;
    const io::ArchiveRecord& a = recs[0];
    const io::ArchiveRecord& b = recs[1];
    ASSERT_EQ(a.kind, io::RecordKind::kPage);
    ASSERT_EQ(b.kind, io::RecordKind::kPage);
    std::copy(good.begin() + static_cast<std::ptrdiff_t>(a.offset),
              good.begin() + static_cast<std::ptrdiff_t>(a.offset + a.extent()),
              img.begin() + static_cast<std::ptrdiff_t>(b.offset));
    io::detail::put_u64(img.data() + b.offset + 8, b.seq);  // its own sequence number
    const uint64_t e1 = rd.info().footer_offset + io::kArchiveFooterFixedBytes + b.seq * io::kArchiveIndexEntryBytes;
    io::detail::put_i64(img.data() + e1 + 24, a.index);
    io::detail::put_i64(img.data() + e1 + 32, a.begin);
    io::detail::put_i64(img.data() + e1 + 40, a.end);
    io::detail::reseal_archive(img);
    const std::string e = verify_error(img);
    EXPECT_NE(e.find("duplicated record"), std::string::npos) << e;
    ++cases;
  }
  std::printf("reordered/duplicated records: %ld cases, all refused naming the record\n", cases);
}

TEST(ArchiveCorruption, WrongMagicVersionEndiannessAndHostileFields) {
  const std::vector<uint8_t> good = small_archive();
  io::ArchiveReader rd(good.data(), good.size());
  const io::ArchiveInfo& info = rd.info();
  struct Edit {
    const char* what;
    std::function<void(std::vector<uint8_t>&)> edit;
    kvq::ErrorKind kind;
    const char* text;
  };
  const uint64_t F = info.footer_offset, lay0 = F + io::kArchiveFooterFixedBytes +
                                                info.records.size() * io::kArchiveIndexEntryBytes;
  io::ArchiveRecord resid;
  for (const auto& r : info.records)
    if (r.kind == io::RecordKind::kResidual && r.layer == 0) resid = r;
  const std::vector<Edit> edits = {
      {"magic", [](auto& b) { b[1] = 'X'; }, kvq::ErrorKind::kIo, "not a kvq archive"},
      {"version 2", [](auto& b) { io::detail::put_u32(b.data() + 8, 2); }, kvq::ErrorKind::kUnsupported,
       "format version 2"},
      {"big-endian marker", [](auto& b) { io::detail::put_u32(b.data() + 12, 0x0D0C0B0Au); },
       kvq::ErrorKind::kUnsupported, "big-endian"},
      {"bad marker", [](auto& b) { io::detail::put_u32(b.data() + 12, 0x12345678u); }, kvq::ErrorKind::kIo,
       "endianness marker"},
      {"n_layers 3", [](auto& b) { io::detail::put_i32(b.data() + 24, 3); }, kvq::ErrorKind::kIo, "header"},
      {"head_dim 16", [](auto& b) { io::detail::put_i32(b.data() + 32, 16); }, kvq::ErrorKind::kIo,
       "stores pages of"},
      {"huge heads", [](auto& b) { io::detail::put_i32(b.data() + 28, 1 << 20); }, kvq::ErrorKind::kIo,
       "header"},
      {"sinks 3 in the policy", [](auto& b) { io::detail::put_i32(b.data() + 44, 3); }, kvq::ErrorKind::kIo,
       "policy spec"},
      {"unknown format code", [](auto& b) { b[96 + 1] = 10; }, kvq::ErrorKind::kIo, "unknown format code"},
      {"key config int5", [](auto& b) { io::detail::put_i32(b.data() + 96 + 8, 5); }, kvq::ErrorKind::kIo,
       "invalid policy"},
      {"unknown config flag bit 4", [](auto& b) { b[96 + 4] |= 16; }, kvq::ErrorKind::kIo,
       "unknown flag bits"},
      {"rotation flag on the f32 skip config", [](auto& b) { b[96 + 2 * 128 + 4] |= 8; },
       kvq::ErrorKind::kIo, "rotation flag set on format f32"},
      {"residual count beyond R + B - 1",
       [&](auto& b) { io::detail::put_i64(b.data() + lay0 + 24, 40); }, kvq::ErrorKind::kIo,
       "not a state a cache can be in"},
      {"page count 2", [&](auto& b) { io::detail::put_i64(b.data() + lay0 + 16, 2); }, kvq::ErrorKind::kIo,
       "layer 0"},
      {"NaN in the residual",
       [&](auto& b) {
         io::detail::put_f32(b.data() + resid.payload_offset() + 8, std::numeric_limits<float>::quiet_NaN());
       },
       kvq::ErrorKind::kIo, "a cache holds finite values only"},
      {"1e6 in a residual key of an int layer (fp16 metadata)",
       [&](auto& b) { io::detail::put_f32(b.data() + resid.payload_offset() + 8, 1e6f); },
       kvq::ErrorKind::kIo, "fp16 range"},
  };
  long cases = 0;
  for (const Edit& ed : edits) {
    SCOPED_TRACE(ed.what);
    std::vector<uint8_t> img = good;
    ed.edit(img);
    io::detail::reseal_archive(img);
    kvq::ErrorKind kind{};
    const std::string e = verify_error(img, &kind);
    ASSERT_NE(e, "") << "accepted";
    EXPECT_EQ(kind, ed.kind) << e;
    EXPECT_NE(e.find(ed.text), std::string::npos) << e;
    ++cases;
  }
  std::printf("hostile resealed fields: %ld cases refused\n", cases);
  // Resealing an unedited archive changes nothing (the helper the fuzzer uses is faithful).
  std::vector<uint8_t> same = good;
  io::detail::reseal_archive(same);
  EXPECT_EQ(same, good);
}

// Outlier positions are the one index inside a page: a hostile writer that resealed every CRC
// still cannot hand the attention kernels a channel outside head_dim.
TEST(ArchiveCorruption, OutlierPositionOutsideHeadDimIsRefused) {
  KVCache c(kvq::parse_policy("k=int4/channel/g8/out1,v=int4/token/g8/out2,residual=4"), 1, 2, 8);
  fill(c, 39, 7);
  const std::vector<uint8_t> good = io::save_archive_bytes(c);
  ASSERT_EQ(verify_error(good), "");
  io::ArchiveReader rd(good.data(), good.size());
  const io::ArchiveInfo& info = rd.info();
  const kvq::PageLayout& L = info.layers[0].layout;
  int pages = 0;
  for (const io::ArchiveRecord& r : info.records) {
    if (r.kind != io::RecordKind::kPage) continue;
    ++pages;
    for (int t = 0; t < 2; ++t) {
      const kvq::PageRegion& g = t == 0 ? L.k.outlier_pos : L.v.outlier_pos;
      ASSERT_GT(g.bytes, 0u);
      for (uint8_t bad : {uint8_t{8}, uint8_t{255}}) {
        std::vector<uint8_t> img = good;
        img[r.payload_offset() + g.offset + g.bytes - 1] = bad;  // the last vector's last outlier
        io::detail::reseal_archive(img);
        kvq::ErrorKind kind{};
        const std::string e = verify_error(img, &kind);
        EXPECT_EQ(kind, kvq::ErrorKind::kIo) << e;
        EXPECT_NE(e.find(std::string(t == 0 ? "key" : "value") + " outlier position " +
                         std::to_string(bad)), std::string::npos) << e;
        EXPECT_NE(e.find(r.name()), std::string::npos) << e;
        EXPECT_THROW(io::load_archive_bytes(img.data(), img.size()), kvq::Error);
      }
    }
  }
  EXPECT_GE(pages, 2);
  std::printf("outlier positions outside head_dim: %d pages x 2 tensors x 2 values refused\n", pages);
  // Position 7 (a channel) is fine once resealed: only the index is judged, not the choice.
  std::vector<uint8_t> img = good;
  for (const io::ArchiveRecord& r : info.records)
    if (r.kind == io::RecordKind::kPage) img[r.payload_offset() + L.k.outlier_pos.offset] = 7;
  io::detail::reseal_archive(img);
  EXPECT_EQ(verify_error(img), "");
}

// A vector listing one channel twice: the fused kernels would add two corrections where
// dequantize keeps one, so the page is refused however the CRCs were resealed.
TEST(ArchiveCorruption, DuplicateOutlierPositionIsRefused) {
  KVCache c(kvq::parse_policy("k=int4/channel/g8/out1,v=int4/token/g8/out2,residual=4"), 1, 2, 8);
  fill(c, 39, 7);
  const std::vector<uint8_t> good = io::save_archive_bytes(c);
  io::ArchiveReader rd(good.data(), good.size());
  const io::ArchiveInfo& info = rd.info();
  const kvq::PageRegion& g = info.layers[0].layout.v.outlier_pos;  // 2 one-byte positions / vector
  int pages = 0;
  for (const io::ArchiveRecord& r : info.records) {
    if (r.kind != io::RecordKind::kPage) continue;
    ++pages;
    std::vector<uint8_t> img = good;
    const std::size_t last = r.payload_offset() + g.offset + g.bytes - 1;
    ASSERT_NE(img[last], img[last - 1]);  // the quantizer wrote two distinct channels
    img[last] = img[last - 1];
    io::detail::reseal_archive(img);
    kvq::ErrorKind kind{};
    const std::string e = verify_error(img, &kind);
    EXPECT_EQ(kind, kvq::ErrorKind::kIo) << e;
    EXPECT_NE(e.find("value outlier position " + std::to_string(img[last]) + " appears twice in vector " +
                     std::to_string(g.bytes / 2 - 1)), std::string::npos) << e;
    EXPECT_NE(e.find(r.name()), std::string::npos) << e;
    EXPECT_THROW(io::load_archive_bytes(img.data(), img.size()), kvq::Error);
  }
  EXPECT_GE(pages, 2);
}

// Metadata a quantizer never writes from finite data (NaN/Inf fp16 or f32 scales, zero points,
// norms and outlier values; NVFP4 e4m3 NaN scales; MXFP4 E8M0 codes above 252) is refused in a
// resealed archive, naming the tensor and region; the largest legal MXFP4 code loads.
TEST(ArchiveCorruption, NonFiniteMetadataIsRefused) {
  struct Poke {
    const char* spec;
    bool key;
    const char* region;  // as the message names it
    std::vector<uint8_t> bytes;  // written at the region's first slot
    bool refused;
  };
  const std::vector<Poke> pokes = {
      {"k=int4/channel/g8,v=int4/token/g8/f32meta,residual=4", true, "scales", {0x00, 0x7E}, true},
      {"k=int4/channel/g8,v=int4/token/g8/f32meta,residual=4", true, "scales", {0x00, 0xFC}, true},
      {"k=int4/channel/g8,v=int4/token/g8/f32meta,residual=4", false, "scales", {0, 0, 0x80, 0x7F}, true},
      {"k=int4/channel/g8,v=int4/token/g8/f32meta,residual=4", false, "scales", {0, 0, 0xC0, 0xFF}, true},
      {"k=int4/channel/g8,v=int4/token/g8/out2,residual=4", false, "outlier values", {0x00, 0x7C}, true},
      {"k=lm3,v=lm2,residual=4", true, "norms", {0x01, 0x7C}, true},
      {"k=nvfp4,v=mxfp4,residual=4", true, "scales", {0x7F}, true},
      {"k=nvfp4,v=mxfp4,residual=4", true, "scales", {0xFF}, true},
      {"k=nvfp4,v=mxfp4,residual=4", false, "scales", {255}, true},
      {"k=nvfp4,v=mxfp4,residual=4", false, "scales", {253}, true},
      {"k=nvfp4,v=mxfp4,residual=4", false, "scales", {252}, false},
  };
  int refused = 0;
  for (const Poke& pk : pokes) {
    KVCache c(kvq::parse_policy(pk.spec), 1, 2, 32);
    fill(c, 80, 3);
    const std::vector<uint8_t> good = io::save_archive_bytes(c);
    ASSERT_EQ(verify_error(good), "") << pk.spec;
    io::ArchiveReader rd(good.data(), good.size());
    const io::ArchiveInfo& info = rd.info();
    const kvq::TensorRegions& R = pk.key ? info.layers[0].layout.k : info.layers[0].layout.v;
    const std::string region = pk.region;
    const kvq::PageRegion& g = region == "scales" ? R.scales : region == "norms" ? R.norms : R.outlier_values;
    ASSERT_GE(g.bytes, pk.bytes.size()) << pk.spec << " " << region;
    const io::ArchiveRecord* page = nullptr;
    for (const io::ArchiveRecord& r : info.records)
      if (r.kind == io::RecordKind::kPage) page = &r;
    ASSERT_NE(page, nullptr);
    std::vector<uint8_t> img = good;
    std::memcpy(img.data() + page->payload_offset() + g.offset, pk.bytes.data(), pk.bytes.size());
    io::detail::reseal_archive(img);
    kvq::ErrorKind kind{};
    const std::string e = verify_error(img, &kind);
    const std::string what = std::string(pk.key ? "key " : "value ") + region + " at page byte " +
                             std::to_string(g.offset);
    if (pk.refused) {
      ++refused;
      EXPECT_EQ(kind, kvq::ErrorKind::kIo) << pk.spec << " " << what << ": " << e;
      EXPECT_NE(e.find(what), std::string::npos) << pk.spec << ": " << e;
      EXPECT_NE(e.find(page->name()), std::string::npos) << e;
      EXPECT_THROW(io::load_archive_bytes(img.data(), img.size()), kvq::Error);
    } else {
      EXPECT_EQ(e, "") << pk.spec << " " << what;
      EXPECT_NO_THROW(io::load_archive_bytes(img.data(), img.size()));
    }
  }
  std::printf("non-finite page metadata: %d resealed archives refused\n", refused);
}

// The layout of QuantConfig, Policy and KVCacheOptions is what the archive's config records
// cover. A new field must be added to the format (and kArchiveVersion bumped): this fails first.
TEST(Archive, FormatCoversEveryConfigField) {
#if defined(__x86_64__) && defined(__linux__)
  EXPECT_EQ(sizeof(kvq::QuantConfig), 128u) << "QuantConfig changed: update io/archive.hpp's config record";
  // exact_rollback (stored in the header) + page_allocator (a run-time binding, never stored:
  // a loaded cache takes kvq's memory, or the pool of the cache load_into() fills).
  EXPECT_EQ(sizeof(kvq::KVCacheOptions), 16u) << "KVCacheOptions changed: update the archive header";
#endif
  kvq::Policy p = kvq::parse_policy("kivi2,sinks=3,residual=5,skip=1:2,skipas=fp8,k@2=lm3/qjl,v@2=f16");
  p.key.fp8_margin = 0.5f;
  p.overrides[2].first.seed = 99;
  KVCache c(p, 5, 2, 32);
  const auto b = io::save_archive_bytes(c);
  const io::ArchiveReader r(b.data(), b.size());
  EXPECT_TRUE(r.info().policy == p);
  EXPECT_EQ(r.info().policy.key.fp8_margin, 0.5f);
  EXPECT_EQ(r.info().policy.overrides.at(2).first.seed, 99u);
  // The rotation flag: stored, read back, and a rotating config differs from its plain twin.
  kvq::Policy q = kvq::parse_policy("k=int4/token/g16/rot,v=mxfp4/rot");
  q.value.seed = 5;
  KVCache cq(q, 1, 2, 32);
  const auto bq = io::save_archive_bytes(cq);
  const io::ArchiveReader rq(bq.data(), bq.size());
  EXPECT_TRUE(rq.info().policy == q);
  EXPECT_TRUE(rq.info().policy.key.rotate);
  EXPECT_TRUE(rq.info().policy.value.rotate);
  EXPECT_EQ(rq.info().policy.value.seed, 5u);
  // An archive written without the flag (bit clear) loads as the unrotated policy.
  KVCache cp(kvq::parse_policy("k=int4/token/g16,v=mxfp4"), 1, 2, 32);
  const auto bp = io::save_archive_bytes(cp);
  EXPECT_EQ(bp[96 + 4] & 8, 0);
  EXPECT_FALSE(io::ArchiveReader(bp.data(), bp.size()).info().policy.key.rotate);
  EXPECT_EQ(bq[96 + 4] & 8, 8);
}

}  // namespace
