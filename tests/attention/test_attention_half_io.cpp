// f16 / bf16 queries and outputs of attend, attend_pages and attend_batch
// (attention/attention.hpp): each half-precision call must return the f32 call's output on the
// widened queries, rounded to nearest even, bit for bit. The expected values come from the f32
// call and a rounding written here (an exhaustive table of the 63,488 finite f16 values for
// f16; bf16 by integer arithmetic on the float bits), not from kvq's conversions. Also: strided
// outputs, options (lse, sinks), a NaN query refused with the output untouched, shape errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kvq/attention/attention.hpp"
#include "kvq/cache/kv_cache.hpp"
#include "kvq/policy/spec.hpp"
#include "test_util.hpp"

namespace {

using kvq::AttentionOptions;
using kvq::KVCache;
using kvq::KVView;

/// A half's value from its bits (IEEE binary16), decoded here.
double half_value(uint16_t h) {
  const int e = (h >> 10) & 31, m = h & 1023;
  const double mag = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
  return (h & 0x8000) ? -mag : mag;
}

/// Round-to-nearest-even into f16 bits by search over every finite half (|x| <= 65504 here).
uint16_t to_half_bits(float x) {
  static const std::vector<std::pair<double, uint16_t>> table = [] {
    std::vector<std::pair<double, uint16_t>> t;
    for (uint32_t b = 0; b < 0x7C00; ++b) t.emplace_back(half_value(static_cast<uint16_t>(b)), b);
    return t;  // ascending in value for non-negative halves
  }();
  const double a = std::fabs(static_cast<double>(x));
  auto it = std::lower_bound(table.begin(), table.end(), std::make_pair(a, uint16_t{0}));
  uint16_t best;
  if (it == table.end()) {
    best = table.back().second;
  } else if (it == table.begin() || it->first == a) {
    best = it->second;
  } else {
    const auto lo = std::prev(it);
    const double dl = a - lo->first, dh = it->first - a;
    best = dl < dh ? lo->second : dh < dl ? it->second : ((lo->second & 1) ? it->second : lo->second);
  }
  return static_cast<uint16_t>(best | (std::signbit(x) ? 0x8000 : 0));
}

/// Round-to-nearest-even into bf16 bits (finite x).
uint16_t to_bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint32_t lower = u & 0xFFFFu, keep = u >> 16;
  const uint32_t up = lower > 0x8000u || (lower == 0x8000u && (keep & 1u)) ? 1u : 0u;
  return static_cast<uint16_t>(keep + up);
}

template <class T>
uint16_t bits_of(T v) {
  return v.bits;
}
template <class T>
T from_bits(uint16_t b) {
  T v{};
  v.bits = b;
  return v;
}
template <class T>
uint16_t round_bits(float x) {
  return std::is_same_v<T, kvq::f16> ? to_half_bits(x) : to_bf16_bits(x);
}

KVCache filled(const std::string& spec, int64_t T, uint32_t seed) {
  KVCache c(kvq::parse_policy(spec), 1, 2, 64);
  const auto k = kvq_test::kv_data({T, 2, 64}, seed, true);
  const auto v = kvq_test::kv_data({T, 2, 64}, seed + 1, false);
  c.append(0, KVView<const float>::nhd(k.data(), T, 2, 64), KVView<const float>::nhd(v.data(), T, 2, 64));
  return c;
}

/// Queries in T (rounded from random floats) and the same values widened to f32.
template <class T>
void make_queries(int64_t nq, uint32_t seed, std::vector<T>* q16, std::vector<float>* q32) {
  const auto q = kvq_test::kv_data({nq, 8, 64}, seed, false);
  q16->resize(q.size());
  q32->resize(q.size());
  for (std::size_t i = 0; i < q.size(); ++i) {
    (*q16)[i] = from_bits<T>(round_bits<T>(q[i]));
    (*q32)[i] = static_cast<float>((*q16)[i]);
  }
}

template <class T>
void check_attend() {
  const int64_t nq = 5, nh = 8, D = 64;
  for (const char* spec : {"kivi4,sinks=3", "k8v4", "turbo4", "f16"}) {
    const KVCache c = filled(spec, 150, 3);
    std::vector<T> q16;
    std::vector<float> q32;
    make_queries<T>(nq, 7, &q16, &q32);
    std::vector<float> sinks(nh, 0.5f);
    for (int variant = 0; variant < 2; ++variant) {
      AttentionOptions opt;
      std::vector<float> lse(static_cast<std::size_t>(nq * nh)), lse16(lse.size());
      if (variant == 1) {
        opt.sinks = sinks.data();
        opt.window = 60;
        opt.threads = 2;
      }
      kvq::AttentionWorkspace ws;
      std::vector<float> want(q32.size());
      opt.lse = lse.data();
      kvq::attend(c, 0, KVView<const float>::nhd(q32.data(), nq, nh, D),
                  KVView<float>::nhd(want.data(), nq, nh, D), true, ws, nullptr, opt);
      // Strided output: [nq, nh, D] inside a buffer with a gap of 3 after each head row.
      const int64_t hs = D + 3;
      std::vector<T> buf(static_cast<std::size_t>(nq * nh * hs), from_bits<T>(0x7E00));
      KVView<T> out(buf.data(), kvq::Shape{nq, nh, D}, kvq::Strides{nh * hs, hs, 1});
      opt.lse = lse16.data();
      kvq::attend(c, 0, KVView<const T>::nhd(q16.data(), nq, nh, D), out, true, ws, nullptr, opt);
      for (int64_t i = 0; i < nq; ++i)
        for (int64_t h = 0; h < nh; ++h)
          for (int64_t d = 0; d < D; ++d)
            ASSERT_EQ(bits_of(out.at(i, h, d)), round_bits<T>(want[static_cast<std::size_t>((i * nh + h) * D + d)]))
                << spec << " variant " << variant << " at " << i << "," << h << "," << d;
      EXPECT_EQ(0, std::memcmp(lse.data(), lse16.data(), lse.size() * sizeof(float))) << spec;
      // the gaps are untouched
      for (int64_t i = 0; i < nq; ++i)
        for (int64_t h = 0; h < nh; ++h)
          for (int64_t g = D; g < hs; ++g)
            ASSERT_EQ(bits_of(buf[static_cast<std::size_t>((i * nh + h) * hs + g)]), 0x7E00);
    }
  }
}

TEST(AttentionHalfIo, AttendF16IsTheF32ResultRounded) { check_attend<kvq::f16>(); }
TEST(AttentionHalfIo, AttendBf16IsTheF32ResultRounded) { check_attend<kvq::bf16>(); }

template <class T>
void check_pages_and_batch() {
  const int64_t nh = 8, D = 64;
  const KVCache a = filled("kivi4,sinks=2", 200, 11), b = filled("kivi4,sinks=2", 90, 12);
  std::vector<T> q16;
  std::vector<float> q32;
  make_queries<T>(2, 9, &q16, &q32);  // one decode query per sequence
  const std::vector<const KVCache*> cs = {&a, &b};
  kvq::CacheBatch cb;  // one decode query per sequence
  const kvq::PagedKVBatch& pb = cb.gather(cs, 0);
  kvq::AttentionWorkspace ws;
  for (int s = 0; s < 2; ++s) {
    const kvq::PageTable pt = cs[static_cast<std::size_t>(s)]->page_table(0);
    const KVView<const float> &k0 = pb.sink_k[s], &v0 = pb.sink_v[s], &k1 = pb.tail_k[s],
                              &v1 = pb.tail_v[s];
    // attend_pages, one sequence
    std::vector<float> want(static_cast<std::size_t>(nh * D));
    kvq::attend_pages(pt, k0, v0, k1, v1, KVView<const float>::nhd(q32.data() + s * nh * D, 1, nh, D),
                      KVView<float>::nhd(want.data(), 1, nh, D), true, ws);
    std::vector<T> got(want.size());
    kvq::attend_pages(pt, k0, v0, k1, v1, KVView<const T>::nhd(q16.data() + s * nh * D, 1, nh, D),
                      KVView<T>::nhd(got.data(), 1, nh, D), true, ws);
    for (std::size_t i = 0; i < want.size(); ++i)
      ASSERT_EQ(bits_of(got[i]), round_bits<T>(want[i])) << "attend_pages sequence " << s << " at " << i;
  }
  kvq::BatchAttentionWorkspace bws;
  std::vector<float> want(q32.size());
  kvq::attend_batch(pb, KVView<const float>::nhd(q32.data(), 2, nh, D), KVView<float>::nhd(want.data(), 2, nh, D),
                    true, bws);
  std::vector<T> got(want.size());
  kvq::attend_batch(pb, KVView<const T>::nhd(q16.data(), 2, nh, D), KVView<T>::nhd(got.data(), 2, nh, D), true, bws);
  for (std::size_t i = 0; i < want.size(); ++i)
    ASSERT_EQ(bits_of(got[i]), round_bits<T>(want[i])) << "attend_batch at " << i;
}

TEST(AttentionHalfIo, PagesAndBatchF16) { check_pages_and_batch<kvq::f16>(); }
TEST(AttentionHalfIo, PagesAndBatchBf16) { check_pages_and_batch<kvq::bf16>(); }

TEST(AttentionHalfIo, BadInputThrowsAndWritesNothing) {
  const KVCache c = filled("k8v4", 100, 5);
  std::vector<kvq::f16> q16;
  std::vector<float> q32;
  make_queries<kvq::f16>(2, 4, &q16, &q32);
  q16[37] = from_bits<kvq::f16>(0x7E00);  // NaN
  std::vector<kvq::f16> out(q16.size(), from_bits<kvq::f16>(0x3C00));  // 1.0
  kvq::AttentionWorkspace ws;
  try {
    kvq::attend(c, 0, KVView<const kvq::f16>::nhd(q16.data(), 2, 8, 64),
                KVView<kvq::f16>::nhd(out.data(), 2, 8, 64), true, ws);
    FAIL() << "a NaN query was accepted";
  } catch (const kvq::Error& e) {
    EXPECT_NE(std::string(e.what()).find("finite"), std::string::npos) << e.what();
  }
  for (kvq::f16 x : out) ASSERT_EQ(bits_of(x), 0x3C00);
  // output shape differs from the queries': kShapeMismatch before anything is converted
  std::vector<kvq::f16> small(static_cast<std::size_t>(8 * 64));
  try {
    kvq::attend(c, 0, KVView<const kvq::f16>::nhd(q16.data(), 2, 8, 64),
                KVView<kvq::f16>::nhd(small.data(), 1, 8, 64), true, ws);
    FAIL() << "a mismatched output was accepted";
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.kind(), kvq::ErrorKind::kShapeMismatch);
    EXPECT_NE(std::string(e.what()).find("does not match the queries"), std::string::npos) << e.what();
  }
}

}  // namespace
