// Tests for cache/kv_cache.hpp: the flush rule, sinks, skipped layers, packed storage against
// the accountant, truncation, and bad input leaving the cache unchanged.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kvq/accounting/accountant.hpp"
#include "kvq/cache/kv_cache.hpp"
#include "kvq/policy/spec.hpp"
#include "kvq/quant/quantize.hpp"
#include "test_util.hpp"

namespace {

using kvq::ErrorKind;
using kvq::KVCache;
using kvq::KVView;
using kvq::parse_policy;
using kvq::Policy;
using kvq::Shape;

/// [tokens, heads, head_dim] data: Gaussian with key-style outlier channels, or a structured
/// pattern (smooth waves, constant tokens, a ramp) that stresses zero-range groups.
std::vector<float> make_data(int64_t tokens, int heads, int head_dim, uint32_t seed,
                             bool structured) {
  const Shape s{tokens, heads, head_dim};
  if (!structured) return kvq_test::kv_data(s, seed, true);
  std::vector<float> v(static_cast<std::size_t>(s.numel()));
  std::size_t i = 0;
  for (int64_t t = 0; t < tokens; ++t)
    for (int h = 0; h < heads; ++h)
      for (int d = 0; d < head_dim; ++d, ++i) {
        if ((t + seed) % 7 == 3) {
          v[i] = 0.25f * static_cast<float>(h + 1);  // a constant token
        } else if (d % 8 == 0) {
          v[i] = 0.01f * static_cast<float>(t) - 1.0f;  // a ramp over tokens
        } else {
          v[i] = std::sin(0.05f * static_cast<float>(t * (h + 1)) + 0.3f * static_cast<float>(d)) *
                 (1.0f + static_cast<float>(d % 4));
        }
      }
  return v;
}

KVView<const float> view(const std::vector<float>& v, int64_t first, int64_t count, int heads,
                         int head_dim) {
  return KVView<const float>::nhd(v.data() + first * heads * head_dim, count, heads, head_dim);
}

/// Every byte the cache stores for a layer, in token order (to compare caches exactly).
std::vector<uint8_t> layer_bytes(const KVCache& c, int layer) {
  std::vector<uint8_t> out;
  auto put = [&](const void* p, std::size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    out.insert(out.end(), b, b + n);
  };
  auto put_q = [&](const kvq::PackedView& q) {  // every array of a packed view
    const kvq::PackedSizes n = kvq::packed_sizes(q.config, q.shape);
    put(&q.shape, sizeof q.shape);
    put(q.codes, n.codes);
    put(q.scales, n.scales);
    put(q.zeros, n.zeros);
    put(q.norms, n.norms);
    put(q.qjl_signs, n.qjl_signs);
    put(q.qjl_norms, n.qjl_norms);
  };
  c.for_each_segment(layer, [&](const kvq::CacheSegment& s) {
    const int64_t tag[3] = {static_cast<int64_t>(s.kind), s.begin, s.end};
    put(tag, sizeof tag);
    if (s.packed()) {
      put_q(s.key_view);
      put_q(s.value_view);
    } else {
      put(s.key_rows.data(), static_cast<std::size_t>(s.key_rows.numel()) * 4);
      put(s.value_rows.data(), static_cast<std::size_t>(s.value_rows.numel()) * 4);
    }
  });
  return out;
}

std::vector<std::vector<uint8_t>> cache_bytes(const KVCache& c) {
  std::vector<std::vector<uint8_t>> all;
  for (int l = 0; l < c.n_layers(); ++l) all.push_back(layer_bytes(c, l));
  return all;
}

/// read() of the whole layer as (keys, values).
std::pair<std::vector<float>, std::vector<float>> read_all(const KVCache& c, int layer) {
  const int64_t n = c.tokens(layer);
  std::vector<float> k(static_cast<std::size_t>(n * c.kv_heads() * c.head_dim()));
  std::vector<float> v(k.size());
  c.read(layer, 0, n, KVView<float>::nhd(k.data(), n, c.kv_heads(), c.head_dim()),
         KVView<float>::nhd(v.data(), n, c.kv_heads(), c.head_dim()));
  return {k, v};
}

/// What read() must return for `data` ([n, H, D]) appended to `layer` of `c`, computed
/// independently: sinks and residual exact, packed blocks quantize()d and dequantize()d on
/// their own, with the split given by the closed form of the flush rule.
std::vector<float> oracle(const KVCache& c, int layer, const std::vector<float>& data, int64_t n,
                          bool keys) {
  const int H = c.kv_heads(), D = c.head_dim();
  const int64_t row = int64_t{H} * D;
  const int64_t s = std::min<int64_t>(n, c.policy().sinks);
  const int64_t B = c.block_tokens(layer), R = c.policy().residual;
  const int64_t P = B * (std::max<int64_t>(0, n - s - R) / B);
  std::vector<float> out(data.begin(), data.begin() + n * row);
  const kvq::QuantConfig cfg = keys ? c.key_config(layer) : c.value_config(layer);
  for (int64_t b = s; b < s + P; b += B) {
    const kvq::QTensor q = kvq::quantize(cfg, view(data, b, B, H, D));
    kvq::dequantize(q, KVView<float>::nhd(out.data() + b * row, B, H, D));
  }
  return out;
}

void append_range(KVCache& c, int layer, const std::vector<float>& k, const std::vector<float>& v,
                  int64_t first, int64_t count) {
  c.append(layer, view(k, first, count, c.kv_heads(), c.head_dim()),
           view(v, first, count, c.kv_heads(), c.head_dim()));
}

// ---------------------------------------------------------------------------------------------

TEST(KVCacheBlocks, BlockSizeIsLcmOfGroupExtentsRoundedUpTo16) {
  auto block = [](const char* spec) {
    return KVCache(parse_policy(spec), 1, 2, 64).block_tokens(0);
  };
  EXPECT_EQ(block("kivi2"), 32);
  EXPECT_EQ(block("kivi4-flip"), 32);
  EXPECT_EQ(block("f32"), 16);
  EXPECT_EQ(block("k=int4,v=int8"), 16);  // per-token both: 1 -> 16
  EXPECT_EQ(block("k=int4/channel/g24,v=int4/channel/g16"), 48);
  EXPECT_EQ(block("k=int4/channel/g5,v=int4"), 20);
  EXPECT_EQ(block("k=int4/head/g64,v=int4/tensor/g8"), 64);
  // Key/value configs of the blocks are the policy's (group 0 would become 32 tokens).
  KVCache c(parse_policy("k=int4/channel/g24,v=sint8/token/g16"), 1, 2, 64);
  EXPECT_TRUE(kvq::same_config(c.key_config(0), kvq::int_config(4, kvq::Axis::kChannel, 24)));
  EXPECT_TRUE(kvq::same_config(c.value_config(0), kvq::int_config(8, kvq::Axis::kToken, 16, true)));
  // The streaming config resolves fp8's "all tokens" group to kStreamGroupTokens.
  const kvq::QuantConfig fp8 = kvq::detail::streaming_config(parse_policy("fp8").key);
  EXPECT_EQ(fp8.group, kvq::kStreamGroupTokens);
  EXPECT_EQ(kvq::detail::stream_block_tokens(fp8, parse_policy("k8v4").value), 32);
  EXPECT_EQ(
      kvq::detail::stream_block_tokens(parse_policy("turbo4").key, parse_policy("turbo4").value),
      16);
}

struct FlushCase {
  const char* spec;
  int sinks;
};

class KVCacheFlush : public ::testing::TestWithParam<FlushCase> {};

// The split sinks / packed / residual follows the documented rule exactly after every append,
// whatever the chunking, and read() equals the independent oracle bit for bit.
TEST_P(KVCacheFlush, SplitFollowsTheRuleAndReadMatchesTheOracle) {
  Policy p = parse_policy(GetParam().spec);
  p.sinks = GetParam().sinks;
  const int H = 2, D = 32, n_total = 211;
  const auto kd = make_data(n_total, H, D, 11, false);
  const auto vd = make_data(n_total, H, D, 12, false);
  KVCache one(p, 1, H, D), chunked(p, 1, H, D);
  const int64_t B = one.block_tokens(0), R = p.residual, S = p.sinks;
  std::mt19937 rng(5);
  int64_t chunked_n = 0;
  for (int64_t n = 1; n <= n_total; ++n) {
    append_range(one, 0, kd, vd, n - 1, 1);
    const int64_t s = std::min(n, S);
    const int64_t P = B * (std::max<int64_t>(0, n - s - R) / B);
    ASSERT_EQ(one.tokens(0), n);
    ASSERT_EQ(one.sink_tokens(0), s);
    ASSERT_EQ(one.packed_tokens(0), P) << "n=" << n;
    ASSERT_EQ(one.residual_tokens(0), n - s - P);
    if (n - s >= R) {
      ASSERT_GE(one.residual_tokens(0), R);
      ASSERT_LE(one.residual_tokens(0), R + B - 1);
    }
    // The same tokens appended in random chunks give identical bytes whenever counts meet.
    while (chunked_n < n) {
      const int64_t m = std::min<int64_t>(n_total - chunked_n, 1 + rng() % 70);
      append_range(chunked, 0, kd, vd, chunked_n, m);
      chunked_n += m;
    }
    if (chunked_n == n) {
      ASSERT_EQ(layer_bytes(chunked, 0), layer_bytes(one, 0)) << "n=" << n;
    }
  }
  const auto [k, v] = read_all(one, 0);
  EXPECT_EQ(k, oracle(one, 0, kd, n_total, true));
  EXPECT_EQ(v, oracle(one, 0, vd, n_total, false));
  // Sinks and the residual window hold the appended values exactly.
  const int64_t row = H * D;
  for (int64_t i = 0; i < S * row; ++i) ASSERT_EQ(k[i], kd[i]);
  for (int64_t i = (n_total - one.residual_tokens(0)) * row; i < n_total * row; ++i)
    ASSERT_EQ(v[i], vd[i]);
  // Partial reads agree with the full read.
  for (auto [a, b] : {std::pair<int64_t, int64_t>{0, 0}, {3, 50}, {17, 18}, {40, 211}, {0, 211}}) {
    std::vector<float> kk((b - a) * row), vv((b - a) * row);
    one.read(0, a, b, KVView<float>::nhd(kk.data(), b - a, H, D),
             KVView<float>::nhd(vv.data(), b - a, H, D));
    EXPECT_TRUE(std::equal(kk.begin(), kk.end(), k.begin() + a * row)) << a << ".." << b;
    EXPECT_TRUE(std::equal(vv.begin(), vv.end(), v.begin() + a * row)) << a << ".." << b;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Rules, KVCacheFlush,
    ::testing::Values(FlushCase{"kivi2", 0}, FlushCase{"kivi2", 3},
                      FlushCase{"kivi4,residual=0", 0}, FlushCase{"kivi4,residual=1", 5},
                      FlushCase{"kivi2-flip,residual=7", 0},
                      FlushCase{"k=int4/channel/g24,v=int3/channel/g16,residual=5", 2},
                      FlushCase{"k=sint8,v=int2/head/g16,residual=40", 4},
                      FlushCase{"k=int8/tensor/g8,v=f16", 1}, FlushCase{"f32,residual=3", 0},
                      FlushCase{"k=bf16,v=int4/token/g8,residual=16", 16}),
    [](const auto& info) { return "case" + std::to_string(info.index); });

// Every preset stores and returns random and structured data with bounded error, and its bytes
// equal the accountant's figure.
struct PresetBound {
  const char* preset;
  double max_rel_mse;  // over all tokens, keys and values, Gaussian data with outliers
};

class KVCachePresets : public ::testing::TestWithParam<PresetBound> {};

TEST_P(KVCachePresets, RoundTripHasBoundedErrorAndBytesMatchTheAccountant) {
  const Policy p = parse_policy(GetParam().preset);
  for (int D : {128, 8}) {
    const int H = 2, L = 2;
    for (bool structured : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "head_dim " << D << (structured ? " structured" : ""));
      const int n = 150;
      KVCache c(p, L, H, D);
      std::vector<std::vector<float>> ks, vs;
      for (int l = 0; l < L; ++l) {
        ks.push_back(make_data(n, H, D, 100 + l, structured));
        vs.push_back(make_data(n, H, D, 200 + l, structured));
        append_range(c, l, ks[l], vs[l], 0, 61);                              // prefill
        for (int t = 61; t < n; ++t) append_range(c, l, ks[l], vs[l], t, 1);  // decode
      }
      const kvq::MemoryReport m = c.memory_report();
      ASSERT_EQ(m.layers.size(), static_cast<std::size_t>(L));
      for (int l = 0; l < L; ++l) {
        const auto [k, v] = read_all(c, l);
        EXPECT_EQ(k, oracle(c, l, ks[l], n, true));
        EXPECT_EQ(v, oracle(c, l, vs[l], n, false));
        const double err = std::max(kvq_test::rel_mse(ks[l], k), kvq_test::rel_mse(vs[l], v));
        EXPECT_LE(err, GetParam().max_rel_mse) << "layer " << l;
        if (l == 0 && !structured)
          std::printf("  %-10s head_dim %3d rel MSE %.3g\n", GetParam().preset, D, err);

        // Bytes: the report equals the accountant per block and the real vector sizes.
        const kvq::LayerMemory& lm = m.layers[static_cast<std::size_t>(l)];
        const Shape block{c.block_tokens(l), H, D};
        kvq::ByteBreakdown acc_k, acc_v, real_k, real_v;
        std::size_t sinks = 0, residual = 0, blocks = 0;
        c.for_each_segment(l, [&](const kvq::CacheSegment& s) {
          if (s.packed()) {
            ++blocks;
            EXPECT_EQ(s.key_view.shape, block);
            EXPECT_EQ(s.value_view.shape, block);
            acc_k += kvq::account(c.key_config(l), block);
            acc_v += kvq::account(c.value_config(l), block);
            // Real bytes: the arrays the page views point at, plus the page's padding.
            const kvq::PackedSizes sk = kvq::packed_sizes(s.key_view.config, s.key_view.shape);
            const kvq::PackedSizes sv = kvq::packed_sizes(s.value_view.config, s.value_view.shape);
            real_k.codes += sk.codes;
            real_k.scales += sk.scales;
            real_k.zeros += sk.zeros;
            real_k.norms += sk.norms;
            real_k.residual += sk.qjl_signs + sk.qjl_norms;
            real_v.codes += sv.codes;
            real_v.scales += sv.scales;
            real_v.zeros += sv.zeros;
            real_v.norms += sv.norms;
            real_v.residual += sv.qjl_signs + sv.qjl_norms;
          } else {
            const std::size_t bytes = static_cast<std::size_t>(s.key_rows.numel()) * 4;
            (s.kind == kvq::CacheSegment::Kind::kSinks ? sinks : residual) += bytes;
          }
        });
        // Pages: accountant + alignment padding (its own kind), and pages x page bytes.
        kvq::ByteBreakdown kdata = lm.key.packed, vdata = lm.value.packed;
        kdata.padding = vdata.padding = 0;
        EXPECT_EQ(kdata, acc_k);
        EXPECT_EQ(vdata, acc_v);
        EXPECT_EQ(kdata, real_k);
        EXPECT_EQ(vdata, real_v);
        EXPECT_EQ(lm.key.packed.total() + lm.value.packed.total(),
                  blocks * c.page_layout(l).bytes);
        EXPECT_EQ(lm.key.packed.padding + lm.value.packed.padding,
                  blocks * c.page_layout(l).padding());
        EXPECT_EQ(lm.key.sinks, sinks);
        EXPECT_EQ(lm.key.residual, residual);
        EXPECT_EQ(lm.value.residual, residual);
        EXPECT_EQ(static_cast<std::size_t>(lm.blocks), blocks);
        EXPECT_EQ(lm.key.residual, static_cast<std::size_t>(c.residual_tokens(l) * H * D * 4));
        EXPECT_EQ(lm.total(), lm.key.total() + lm.value.total());
      }
      // Bookkeeping is bounded: free page slots (a chunk adds at most half the capacity, at
      // least one page) and the page table, the unused capacity of the four f32 windows (never
      // above the most they can hold: R + B - 1 tokens for the residual, S for the sinks) and
      // of the two rollback buffers (B tokens), and a fixed part.
      std::size_t bound = 4096 + L * 1024;
      for (const auto& lm : m.layers) {
        bound += (static_cast<std::size_t>(lm.blocks) / 2 + 1) * lm.page_bytes +
                 48 * static_cast<std::size_t>(lm.blocks + 2);
        bound += static_cast<std::size_t>(2 * lm.block_tokens * H * D) * sizeof(float);
        const int64_t window = 2 * (p.residual + lm.block_tokens - 1) + 2 * p.sinks;
        bound += static_cast<std::size_t>(window * H * D) * sizeof(float);
      }
      EXPECT_LE(m.overhead, bound);
      EXPECT_EQ(m.elements(), 2LL * L * n * H * D);
      EXPECT_NEAR(m.effective_bits(), 8.0 * m.total() / m.elements(), 1e-12);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(All, KVCachePresets,
                         ::testing::Values(PresetBound{"f32", 0.0}, PresetBound{"f16", 1e-6},
                                           PresetBound{"fp8", 2e-3}, PresetBound{"k8v4", 2e-2},
                                           PresetBound{"kivi2", 0.25}, PresetBound{"kivi4", 2e-2},
                                           PresetBound{"kivi2-flip", 0.4},
                                           PresetBound{"kivi4-flip", 3e-2},
                                           PresetBound{"turbo3", 5e-2},
                                           PresetBound{"turbo4", 1.5e-2}),
                         [](const auto& info) {
                           std::string s = info.param.preset;
                           std::replace(s.begin(), s.end(), '-', '_');
                           return s;
                         });

TEST(KVCacheLayers, SkipOnFiveLayersLeavesExactlyLayers034Unquantized) {
  const Policy p = parse_policy("kivi4,skip=1:2,residual=0");
  const int H = 2, D = 16, n = 64;
  KVCache c(p, 5, H, D);
  std::vector<int> raw;
  for (int l = 0; l < 5; ++l) {
    const auto k = make_data(n, H, D, 7 + l, false), v = make_data(n, H, D, 70 + l, false);
    append_range(c, l, k, v, 0, n);
    const auto [rk, rv] = read_all(c, l);
    const bool exact = rk == k && rv == v;
    EXPECT_EQ(c.skipped(l), exact) << l;
    if (c.skipped(l)) {
      raw.push_back(l);
      EXPECT_EQ(c.key_config(l).format, kvq::Format::kF32);
      EXPECT_EQ(c.value_config(l).format, kvq::Format::kF32);
    } else {
      EXPECT_EQ(c.key_config(l).format, kvq::Format::kInt);
    }
  }
  EXPECT_EQ(raw, (std::vector<int>{0, 3, 4}));
  // skipas: skipped layers use that format instead; overrides win over skip.
  KVCache d(parse_policy("kivi4,skip=1,skipas=f16,k@0=int8/token/g16"), 3, H, D);
  EXPECT_EQ(d.key_config(0).bits, 8);
  EXPECT_FALSE(d.skipped(0));
  EXPECT_EQ(d.value_config(0).bits, 4);
  EXPECT_TRUE(d.skipped(2));
  EXPECT_EQ(d.key_config(2).format, kvq::Format::kF16);
  EXPECT_EQ(d.key_config(1).bits, 4);
}

TEST(KVCacheSinks, SinksStayExactAndAcceptWhatQuantizedTokensCannot) {
  const int H = 1, D = 16;
  KVCache c(parse_policy("kivi2,residual=0,sinks=4"), 1, H, D);
  auto kd = make_data(100, H, D, 3, false);
  auto vd = make_data(100, H, D, 4, false);
  kd[2 * D + 5] = 1e6f;  // token 2 is a sink: f32, so values beyond fp16 are fine there
  append_range(c, 0, kd, vd, 0, 100);
  EXPECT_EQ(c.sink_tokens(0), 4);
  const auto [k, v] = read_all(c, 0);
  EXPECT_TRUE(std::equal(k.begin(), k.begin() + 4 * D, kd.begin()));
  EXPECT_TRUE(std::equal(v.begin(), v.begin() + 4 * D, vd.begin()));
  EXPECT_NE(k, kd);  // the rest was quantized
  // The same value at a quantized position is rejected (it would overflow fp16 metadata).
  std::vector<float> big(D, 0.5f), small(D, 0.5f);
  big[9] = 1e6f;
  try {
    c.append(0, KVView<const float>::nhd(big.data(), 1, H, D),
             KVView<const float>::nhd(small.data(), 1, H, D));
    FAIL();
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kOutOfRange);
    EXPECT_NE(std::string(e.what()).find("(position 100), head 0, channel 9"), std::string::npos)
        << e.what();
  }
  // f32 metadata lifts the limit.
  KVCache f(parse_policy("k=int2/channel/g32/f32meta,v=int2/f32meta"), 1, H, D);
  f.append(0, KVView<const float>::nhd(big.data(), 1, H, D),
           KVView<const float>::nhd(small.data(), 1, H, D));
}

TEST(KVCacheInput, F16Bf16AndStridedViewsStoreTheSameAsTheirFloatValues) {
  const Policy p = parse_policy("kivi4,residual=8,sinks=2");
  const int H = 3, D = 16, n = 90;
  const auto kd = make_data(n, H, D, 1, false), vd = make_data(n, H, D, 2, false);
  // Round to f16 first so that the float and f16 inputs carry the same values.
  std::vector<kvq::f16> kh(kd.size()), vh(vd.size());
  std::vector<float> kf(kd.size()), vf(vd.size());
  for (std::size_t i = 0; i < kd.size(); ++i) {
    kh[i] = kvq::f16(kd[i]);
    vh[i] = kvq::f16(vd[i]);
    kf[i] = kh[i].to_float();
    vf[i] = vh[i].to_float();
  }
  KVCache a(p, 1, H, D), b(p, 1, H, D), c(p, 1, H, D);
  append_range(a, 0, kf, vf, 0, n);
  b.append(0, KVView<const kvq::f16>::nhd(kh.data(), 50, H, D),
           KVView<const kvq::f16>::nhd(vh.data(), 50, H, D));
  b.append(0, KVView<const kvq::f16>::nhd(kh.data() + 50 * H * D, 40, H, D),
           KVView<const kvq::f16>::nhd(vh.data() + 50 * H * D, 40, H, D));
  EXPECT_EQ(cache_bytes(a), cache_bytes(b));
  // HND layout (heads outermost) through strided views.
  std::vector<float> kt(kf.size()), vt(vf.size());
  for (int t = 0; t < n; ++t)
    for (int h = 0; h < H; ++h)
      for (int d = 0; d < D; ++d) {
        kt[(h * n + t) * D + d] = kf[(t * H + h) * D + d];
        vt[(h * n + t) * D + d] = vf[(t * H + h) * D + d];
      }
  c.append(0, KVView<const float>::hnd(kt.data(), H, n, D),
           KVView<const float>::hnd(vt.data(), H, n, D));
  EXPECT_EQ(cache_bytes(a), cache_bytes(c));
  // bf16 input.
  std::vector<kvq::bf16> kb(kd.size()), vb(vd.size());
  for (std::size_t i = 0; i < kd.size(); ++i) {
    kb[i] = kvq::bf16(kd[i]);
    vb[i] = kvq::bf16(vd[i]);
  }
  KVCache e(p, 1, H, D);
  e.append(0, KVView<const kvq::bf16>::nhd(kb.data(), n, H, D),
           KVView<const kvq::bf16>::nhd(vb.data(), n, H, D));
  EXPECT_EQ(e.tokens(0), n);
  // Non-const views convert implicitly.
  KVCache g(p, 1, H, D);
  g.append(0, KVView<float>::nhd(kf.data(), n, H, D), KVView<float>::nhd(vf.data(), n, H, D));
  EXPECT_EQ(cache_bytes(a), cache_bytes(g));
}

TEST(KVCacheSegments, SegmentsTileTheTokensInOrder) {
  KVCache c(parse_policy("kivi2,sinks=3"), 2, 2, 16);
  const auto kd = make_data(140, 2, 16, 9, false);
  append_range(c, 1, kd, kd, 0, 140);
  int64_t next = 0;
  int packed = 0;
  c.for_each_segment(1, [&](const kvq::CacheSegment& s) {
    EXPECT_EQ(s.begin, next);
    EXPECT_GT(s.end, s.begin);
    next = s.end;
    if (s.packed()) {
      ++packed;
      EXPECT_EQ(s.tokens(), 32);
      EXPECT_EQ(s.key_view.shape, (Shape{32, 2, 16}));
      EXPECT_EQ(s.value_view.shape, (Shape{32, 2, 16}));
    } else {
      EXPECT_EQ(s.key_rows.shape(), (Shape{s.tokens(), 2, 16}));
      EXPECT_TRUE(s.key_rows.is_contiguous_nhd());
    }
  });
  EXPECT_EQ(next, 140);
  EXPECT_EQ(packed, 3);  // 137 after the sinks: 3 blocks of 32, 41 in the residual
  int none = 0;
  c.for_each_segment(0, [&](const kvq::CacheSegment&) { ++none; });
  EXPECT_EQ(none, 0);
}

// Truncation: exact cuts reproduce the bytes of a cache that never saw the dropped tokens;
// cuts inside a packed block keep the values attention saw.
TEST(KVCacheTruncate, ExactCutsThenAppendGiveTheSameBytesAsNeverHavingAppended) {
  const int H = 2, D = 16;
  for (const char* spec :
       {"kivi2,sinks=3", "kivi4,residual=0", "k=int4,v=int4/channel/g16,residual=5",
        "turbo4,sinks=1", "fp8,residual=4"}) {
    const Policy p = parse_policy(spec);
    SCOPED_TRACE(spec);
    const auto kx = make_data(200, H, D, 21, false), vx = make_data(200, H, D, 22, false);
    const auto ky = make_data(200, H, D, 23, false), vy = make_data(200, H, D, 24, false);
    int exact_cuts = 0;
    for (int64_t total : {60, 97, 130}) {
      KVCache probe(p, 1, H, D);
      append_range(probe, 0, kx, vx, 0, total);
      for (int64_t n = 0; n <= total; ++n) {
        if (!probe.truncate_is_exact(0, n)) continue;
        ++exact_cuts;
        // A: the first n tokens of X, junk up to `total`, truncate back to n, then 60 of Y.
        KVCache a(p, 1, H, D);
        append_range(a, 0, kx, vx, 0, total);
        a.truncate(0, n);
        EXPECT_EQ(a.tokens(0), n);
        append_range(a, 0, ky, vy, 0, 60);
        // B: never saw X[n, total).
        KVCache b(p, 1, H, D);
        append_range(b, 0, kx, vx, 0, n);
        append_range(b, 0, ky, vy, 0, 60);
        ASSERT_EQ(layer_bytes(a, 0), layer_bytes(b, 0)) << "total " << total << " cut " << n;
        // Re-appending the dropped tokens themselves restores the original bytes.
        KVCache r(p, 1, H, D);
        append_range(r, 0, kx, vx, 0, total);
        r.truncate(0, n);
        append_range(r, 0, kx, vx, n, total - n);
        ASSERT_EQ(layer_bytes(r, 0), layer_bytes(probe, 0)) << "total " << total << " cut " << n;
      }
    }
    EXPECT_GT(exact_cuts, 30);
  }
}

TEST(KVCacheTruncate, CutInsideAPackedBlockKeepsTheDequantizedValues) {
  const int H = 2, D = 16;
  const Policy p = parse_policy("kivi4,residual=0,sinks=2");
  const auto kd = make_data(100, H, D, 31, false), vd = make_data(100, H, D, 32, false);
  KVCache c(p, 1, H, D);
  append_range(c, 0, kd, vd, 0, 100);  // sinks 2, packed 96 (3 blocks of 32), residual 2
  ASSERT_EQ(c.packed_tokens(0), 96);
  EXPECT_TRUE(c.truncate_is_exact(0, 2));
  EXPECT_TRUE(c.truncate_is_exact(0, 34));
  EXPECT_TRUE(c.truncate_is_exact(0, 99));
  EXPECT_FALSE(c.truncate_is_exact(0, 50));
  const auto [k0, v0] = read_all(c, 0);
  c.truncate(0, 50);
  EXPECT_EQ(c.tokens(0), 50);
  EXPECT_EQ(c.packed_tokens(0), 32);
  EXPECT_EQ(c.residual_tokens(0), 16);
  const auto [k1, v1] = read_all(c, 0);
  const int64_t row = H * D;
  EXPECT_TRUE(std::equal(k1.begin(), k1.end(), k0.begin()));
  EXPECT_TRUE(std::equal(v1.begin(), v1.end(), v0.begin()));
  EXPECT_EQ(k1.size(), static_cast<std::size_t>(50 * row));
  // Appending continues normally: the block refills and is packed again.
  append_range(c, 0, kd, vd, 50, 16);
  EXPECT_EQ(c.packed_tokens(0), 64);
  EXPECT_EQ(c.residual_tokens(0), 0);
  // Truncating into the sinks drops everything after them.
  c.truncate(0, 1);
  EXPECT_EQ(c.sink_tokens(0), 1);
  EXPECT_EQ(c.packed_tokens(0), 0);
  const auto [k2, v2] = read_all(c, 0);
  EXPECT_TRUE(std::equal(k2.begin(), k2.end(), kd.begin()));
  // Whole-cache truncate cuts every layer.
  KVCache m(p, 3, H, D);
  for (int l = 0; l < 3; ++l) append_range(m, l, kd, vd, 0, 80 + l);
  m.truncate(40);
  for (int l = 0; l < 3; ++l) EXPECT_EQ(m.tokens(l), 40);
  m.truncate(0);
  EXPECT_EQ(m.memory_report().total(), 0u);
}

// ---------------------------------------------------------------------------------------------
// Bad input: a clear kvq::Error and the cache exactly as before.

class KVCacheBadInput : public ::testing::Test {
 protected:
  static constexpr int kH = 2, kD = 16;
  void SetUp() override {
    kd_ = make_data(300, kH, kD, 41, false);
    vd_ = make_data(300, kH, kD, 42, false);
    for (int l = 0; l < 2; ++l) append_range(cache_, l, kd_, vd_, 0, 70 + l);
    before_ = cache_bytes(cache_);
    report_before_ = cache_.memory_report();
    read_before_ = read_all(cache_, 0);
  }
  void expect_unchanged() const {
    EXPECT_EQ(cache_bytes(cache_), before_);
    const kvq::MemoryReport m = cache_.memory_report();
    ASSERT_EQ(m.layers.size(), report_before_.layers.size());
    for (std::size_t l = 0; l < m.layers.size(); ++l) {
      EXPECT_EQ(m.layers[l].key, report_before_.layers[l].key);
      EXPECT_EQ(m.layers[l].value, report_before_.layers[l].value);
      EXPECT_EQ(m.layers[l].tokens, report_before_.layers[l].tokens);
    }
    EXPECT_EQ(m.overhead, report_before_.overhead);
    EXPECT_EQ(read_all(cache_, 0), read_before_);
  }
  template <class F>
  void expect_error(ErrorKind kind, const std::string& needle, F&& f) {
    try {
      f();
      ADD_FAILURE() << "no error; expected: " << needle;
    } catch (const kvq::Error& e) {
      EXPECT_EQ(e.kind(), kind) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
          << "message: " << e.what() << "\nexpected to contain: " << needle;
    }
    expect_unchanged();
  }
  KVView<const float> kv(const std::vector<float>& d, int64_t first, int64_t n, int heads = kH,
                         int dim = kD) {
    return KVView<const float>::nhd(d.data() + first * kH * kD, n, heads, dim);
  }

  KVCache cache_{parse_policy("kivi2,sinks=2,residual=8"), 2, kH, kD, 128};
  std::vector<float> kd_, vd_;
  std::vector<std::vector<uint8_t>> before_;
  kvq::MemoryReport report_before_;
  std::pair<std::vector<float>, std::vector<float>> read_before_;
};

TEST_F(KVCacheBadInput, ShapeMismatches) {
  std::vector<float> wide(40 * 3 * kD, 0.5f);
  expect_error(ErrorKind::kShapeMismatch, "keys have shape [tokens=4, heads=3, head_dim=16]", [&] {
    cache_.append(0, KVView<const float>::nhd(wide.data(), 4, 3, kD), kv(vd_, 0, 4));
  });
  expect_error(ErrorKind::kShapeMismatch, "values have shape", [&] {
    cache_.append(0, kv(kd_, 0, 4), KVView<const float>::nhd(wide.data(), 4, kH, 8));
  });
  expect_error(ErrorKind::kShapeMismatch, "got 5 key tokens but 4 value tokens",
               [&] { cache_.append(1, kv(kd_, 0, 5), kv(vd_, 0, 4)); });
}

TEST_F(KVCacheBadInput, MissingLayers) {
  expect_error(ErrorKind::kInvalidArgument, "layer 2 does not exist (the cache has 2 layers)",
               [&] { cache_.append(2, kv(kd_, 0, 1), kv(vd_, 0, 1)); });
  expect_error(ErrorKind::kInvalidArgument, "layer -1 does not exist",
               [&] { cache_.append(-1, kv(kd_, 0, 1), kv(vd_, 0, 1)); });
  expect_error(ErrorKind::kInvalidArgument, "does not exist", [&] { cache_.tokens(7); });
}

TEST_F(KVCacheBadInput, NonFiniteValuesAreNamed) {
  // NaN in the last token of a chunk that would flush two blocks: nothing may be committed.
  std::vector<float> k(kd_.begin() + 70 * kH * kD, kd_.begin() + 120 * kH * kD);
  k[(49 * kH + 1) * kD + 13] = std::numeric_limits<float>::quiet_NaN();
  expect_error(ErrorKind::kNonFinite,
               "layer 0 key token 49 of the chunk (position 119), head 1, channel 13 is nan",
               [&] { cache_.append(0, kv(k, 0, 50), kv(vd_, 70, 50)); });
  std::vector<float> v(vd_.begin(), vd_.begin() + 3 * kH * kD);
  v[(1 * kH + 0) * kD + 2] = -std::numeric_limits<float>::infinity();
  expect_error(ErrorKind::kNonFinite,
               "layer 1 value token 1 of the chunk (position 72), head 0, channel 2 is -inf",
               [&] { cache_.append(1, kv(kd_, 0, 3), kv(v, 0, 3)); });
}

TEST_F(KVCacheBadInput, ValuesBeyondTheFormatRange) {
  std::vector<float> k(kd_.begin(), kd_.begin() + 40 * kH * kD);
  k[(39 * kH) * kD] = 70000.f;
  expect_error(ErrorKind::kOutOfRange, "beyond the fp16 range",
               [&] { cache_.append(0, kv(k, 0, 40), kv(vd_, 0, 40)); });
}

TEST_F(KVCacheBadInput, TruncatePastTheEndAndMaxTokens) {
  expect_error(ErrorKind::kOutOfRange, "cannot keep 71 tokens of layer 0, which holds 70",
               [&] { cache_.truncate(0, 71); });
  expect_error(ErrorKind::kOutOfRange, "cannot keep -1 tokens", [&] { cache_.truncate(0, -1); });
  // Whole-cache truncate: layer 0 holds 70, so keeping 71 fails for it and nothing changes.
  expect_error(ErrorKind::kOutOfRange, "cannot keep 71 tokens of layer 0",
               [&] { cache_.truncate(71); });
  expect_error(ErrorKind::kOutOfRange, "would exceed max_tokens=128",
               [&] { cache_.append(0, kv(kd_, 0, 59), kv(vd_, 0, 59)); });
  expect_error(ErrorKind::kOutOfRange, "range [60, 80) is outside the 70 tokens", [&] {
    std::vector<float> o(20 * kH * kD);
    cache_.read(0, 60, 80, KVView<float>::nhd(o.data(), 20, kH, kD),
                KVView<float>::nhd(o.data(), 20, kH, kD));
  });
  cache_.append(0, kv(kd_, 0, 58), kv(vd_, 0, 58));  // exactly max_tokens is fine
  EXPECT_EQ(cache_.tokens(0), 128);
}

TEST(KVCacheConstruction, BadGeometryAndPoliciesAreRejectedUpFront) {
  auto expect_error = [](ErrorKind kind, const std::string& needle, auto&& f) {
    try {
      f();
      ADD_FAILURE() << "no error; expected: " << needle;
    } catch (const kvq::Error& e) {
      EXPECT_EQ(e.kind(), kind) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error(ErrorKind::kShapeMismatch, "groups 32 channels, which does not divide head_dim 80",
               [] { KVCache(parse_policy("kivi2"), 2, 2, 80); });
  expect_error(ErrorKind::kShapeMismatch, "layer 0 key format int4/token/g32",
               [] { KVCache(parse_policy("kivi4-flip"), 1, 2, 48); });
  KVCache(parse_policy("k=int4/token/g16,v=int4/token/g16"), 1, 2, 80);  // 16 divides 80
  KVCache(parse_policy("kivi2"), 1, 2, 8);  // g32 > head_dim 8: one group per head
  expect_error(ErrorKind::kInvalidArgument, "n_layers, n_kv_heads and head_dim must be > 0",
               [] { KVCache(parse_policy("f32"), 0, 2, 8); });
  expect_error(ErrorKind::kInvalidArgument, "max_tokens >= 0",
               [] { KVCache(parse_policy("f32"), 1, 2, 8, -5); });
  expect_error(ErrorKind::kInvalidArgument, "overrides layer 4 but the model has 4 layers",
               [] { KVCache(parse_policy("kivi2,k@4=f16"), 4, 2, 8); });
  Policy bad = parse_policy("kivi2");
  bad.key.bits = 5;
  expect_error(ErrorKind::kInvalidArgument, "integer formats support 2, 3, 4 or 8 bits",
               [&] { KVCache(bad, 1, 2, 8); });
  expect_error(ErrorKind::kParse, "unknown format 'int5'",
               [] { KVCache(parse_policy("k=int5,v=f16"), 1, 2, 8); });
}

// FP4 layers stream like any token-axis format: blocks of the 16-token minimum, reads equal
// quantize()/dequantize() of each block, bytes equal the accountant; head_dim must hold whole
// FP4 blocks; values beyond fp16's range are accepted (no fp16 metadata: e2m1 saturates).
TEST(KVCacheFp4, StreamsRefusesPartialBlocksAndKeepsNoFp16Limit) {
  const Policy p = parse_policy("k=nvfp4,v=mxfp4,sinks=2,residual=8");
  const int H = 2, D = 64, n = 100;
  KVCache c(p, 1, H, D);
  EXPECT_EQ(c.block_tokens(0), 16);
  const auto kd = make_data(n, H, D, 31, false), vd = make_data(n, H, D, 32, false);
  append_range(c, 0, kd, vd, 0, 37);
  for (int t = 37; t < n; ++t) append_range(c, 0, kd, vd, t, 1);
  const auto [k, v] = read_all(c, 0);
  EXPECT_EQ(k, oracle(c, 0, kd, n, true));
  EXPECT_EQ(v, oracle(c, 0, vd, n, false));
  // e2m1 with a scale per 16 / 32: relative MSE about 1e-2 on Gaussian data with outliers.
  EXPECT_LT(kvq_test::rel_mse(kd, k), 0.03);
  EXPECT_LT(kvq_test::rel_mse(vd, v), 0.03);
  const kvq::LayerMemory& lm = c.memory_report().layers[0];
  const Shape block{16, H, D};
  const std::size_t blocks = static_cast<std::size_t>((n - 2 - 8) / 16);
  EXPECT_EQ(lm.key.packed.codes, blocks * kvq::account(c.key_config(0), block).codes);
  EXPECT_EQ(lm.key.packed.scales, blocks * 16u * H * D / 16);
  EXPECT_EQ(lm.value.packed.scales, blocks * 16u * H * D / 32);

  auto expect_error = [](ErrorKind kind, const std::string& needle, auto&& f) {
    try {
      f();
      ADD_FAILURE() << "no error; expected: " << needle;
    } catch (const kvq::Error& e) {
      EXPECT_EQ(e.kind(), kind) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  KVCache(parse_policy("k=nvfp4,v=nvfp4"), 1, 2, 48);  // 16 divides 48
  expect_error(ErrorKind::kShapeMismatch, "mxfp4 groups 32 channels, which does not divide head_dim 48",
               [] { KVCache(parse_policy("k=f16,v=mxfp4"), 1, 2, 48); });
  expect_error(ErrorKind::kShapeMismatch, "nvfp4 needs head_dim to be a multiple of its block of 16",
               [] { KVCache(parse_policy("k=nvfp4,v=f16"), 1, 2, 8); });

  KVCache big(parse_policy("k=nvfp4,v=mxfp4"), 1, H, D);
  std::vector<float> kb(kd.begin(), kd.begin() + 16 * H * D), vb(vd.begin(), vd.begin() + 16 * H * D);
  kb[5] = 70000.f;
  vb[5] = -70000.f;
  append_range(big, 0, kb, vb, 0, 16);
  const auto [kr, vr] = read_all(big, 0);
  EXPECT_EQ(kr[5], 2688.f);    // NVFP4 with tensor scale 1: 6 x e4m3's 448
  EXPECT_EQ(vr[5], -65536.f);  // MXFP4: 2^(floor(log2 70000) - 2) = 2^14, times e2m1 4
}

TEST(KVCacheMisc, ClearAndUnboundedCapacity) {
  KVCache c(parse_policy("kivi4,sinks=2"), 2, 1, 8);
  const auto kd = make_data(1000, 1, 8, 1, false);
  append_range(c, 0, kd, kd, 0, 1000);
  append_range(c, 1, kd, kd, 0, 10);
  EXPECT_EQ(c.tokens(0), 1000);
  EXPECT_GT(c.memory_report().total(), 0u);
  c.clear();
  EXPECT_EQ(c.tokens(0), 0);
  EXPECT_EQ(c.tokens(1), 0);
  EXPECT_EQ(c.memory_report().total(), 0u);
  append_range(c, 0, kd, kd, 0, 5);  // sinks refill after clear
  EXPECT_EQ(c.sink_tokens(0), 2);
  // An empty chunk is a no-op.
  c.append(1, KVView<const float>::nhd(kd.data(), 0, 1, 8),
           KVView<const float>::nhd(kd.data(), 0, 1, 8));
  EXPECT_EQ(c.tokens(1), 0);
}

}  // namespace
