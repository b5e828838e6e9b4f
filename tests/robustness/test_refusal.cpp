// The strong guarantee (issue 13, item 4): input a format cannot hold is refused with
// kvq::Error before anything changes. For every policy, each kind of bad append is tried on a
// cache that already holds sinks, packed blocks and a residual window; afterwards the cache's
// memory_report() and read() of every layer are exactly what they were, and a valid append
// still gives a cache byte-identical to a twin that never saw the refused calls. quantize()
// into an existing QTensor keeps that tensor untouched on a refusal. Public API only.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "kvq/cache/kv_cache.hpp"
#include "kvq/core/half.hpp"
#include "kvq/policy/spec.hpp"
#include "kvq/quant/quantize.hpp"
#include "robustness/robustness_util.hpp"

namespace {

constexpr int kLayers = 3, kHeads = 2, kDim = 64, kMaxTokens = 120;

/// Everything observable about a cache: per layer its token split, and the K/V it reads back
/// (bit patterns), plus the memory report's table and totals.
struct Snapshot {
  std::vector<int64_t> tokens, sinks, packed, residual;
  std::vector<std::vector<float>> k, v;
  std::string report;
  std::size_t total = 0;
  bool operator==(const Snapshot& o) const {
    auto same_bits = [](const std::vector<std::vector<float>>& a,
                        const std::vector<std::vector<float>>& b) {
      if (a.size() != b.size()) return false;
      for (size_t i = 0; i < a.size(); ++i) {
        if (a[i].size() != b[i].size()) return false;
        if (!a[i].empty() && std::memcmp(a[i].data(), b[i].data(), a[i].size() * 4) != 0)
          return false;
      }
      return true;
    };
    return tokens == o.tokens && sinks == o.sinks && packed == o.packed && residual == o.residual &&
           same_bits(k, o.k) && same_bits(v, o.v) && report == o.report && total == o.total;
  }
};

Snapshot snap(const kvq::KVCache& c) {
  Snapshot s;
  for (int l = 0; l < c.n_layers(); ++l) {
    const int64_t T = c.tokens(l);
    s.tokens.push_back(T);
    s.sinks.push_back(c.sink_tokens(l));
    s.packed.push_back(c.packed_tokens(l));
    s.residual.push_back(c.residual_tokens(l));
    std::vector<float> k(static_cast<size_t>(T * kHeads * kDim)), v(k.size());
    if (T > 0) {
      c.read(l, 0, T, kvq::KVView<float>::nhd(k.data(), T, kHeads, kDim),
             kvq::KVView<float>::nhd(v.data(), T, kHeads, kDim));
    }
    s.k.push_back(std::move(k));
    s.v.push_back(std::move(v));
  }
  // The report's stored bytes by layer and kind; not `overhead` (bookkeeping: vector capacity,
  // which a refused call may legitimately grow, e.g. a scratch block that was quantized into
  // before the refusal).
  const kvq::MemoryReport r = c.memory_report();
  for (const kvq::LayerMemory& lm : r.layers) {
    s.report += kvq::detail::cat(lm.layer, ":", lm.tokens, "/", lm.sink_tokens, "/",
                                 lm.packed_tokens, "/", lm.residual_tokens, "/", lm.blocks, "/",
                                 lm.key.total(), "/", lm.value.total(), "/", lm.key.packed.total(),
                                 "/", lm.value.packed.total(), ";");
  }
  s.total = r.total();
  return s;
}

void append_all(kvq::KVCache& c, const std::vector<float>& k, const std::vector<float>& v,
                int64_t n) {
  for (int l = 0; l < c.n_layers(); ++l) {
    c.append(l, kvq::KVView<const float>::nhd(k.data(), n, kHeads, kDim),
             kvq::KVView<const float>::nhd(v.data(), n, kHeads, kDim));
  }
}

bool needs_f16_range(const kvq::QuantConfig& c) {
  return c.format == kvq::Format::kF16 || (!c.is_raw() && c.meta == kvq::MetaDType::kF16);
}

/// One refusal: a name and the call that must throw.
struct Refusal {
  std::string name;
  std::function<void(kvq::KVCache&)> call;
};

TEST(Refusal, RefusedAppendsLeaveEveryPolicysCacheUnchanged) {
  const kvq::Shape prefill{70, kHeads, kDim};
  const std::vector<float> k0 = kvq_robust::normal(prefill, 1), v0 = kvq_robust::normal(prefill, 2);
  const int64_t n = 20;  // chunk of the refused appends (large enough to flush a block)
  const std::vector<float> good_k = kvq_robust::normal({n, kHeads, kDim}, 3);
  const std::vector<float> good_v = kvq_robust::normal({n, kHeads, kDim}, 4);
  int cases = 0;
  for (const std::string& spec : kvq_robust::all_policies()) {
    const kvq::Policy policy = kvq_robust::usable_policy(spec);
    kvq::KVCache cache(policy, kLayers, kHeads, kDim, kMaxTokens);
    kvq::KVCache twin(policy, kLayers, kHeads, kDim, kMaxTokens);
    append_all(cache, k0, v0, prefill.tokens);
    append_all(twin, k0, v0, prefill.tokens);
    const Snapshot before = snap(cache);
    ASSERT_TRUE(before == snap(twin));

    // A chunk equal to the good one except for one element (token t, head h, channel d).
    auto with = [&](const std::vector<float>& base, int64_t t, int64_t h, int64_t d, float x) {
      std::vector<float> b = base;
      b[static_cast<size_t>((t * kHeads + h) * kDim + d)] = x;
      return b;
    };
    auto chunk = [&](int layer, const std::vector<float>& k, const std::vector<float>& v) {
      return [=](kvq::KVCache& c) {
        c.append(layer, kvq::KVView<const float>::nhd(k.data(), n, kHeads, kDim),
                 kvq::KVView<const float>::nhd(v.data(), n, kHeads, kDim));
      };
    };
    const float nan = std::numeric_limits<float>::quiet_NaN();
    const float inf = std::numeric_limits<float>::infinity();
    std::vector<Refusal> refusals = {
        {"NaN key in the last token", chunk(0, with(good_k, n - 1, 1, 63, nan), good_v)},
        {"+Inf value in the first token", chunk(1, good_k, with(good_v, 0, 0, 0, inf))},
        {"-Inf key mid-chunk", chunk(2, with(good_k, 9, 1, 17, -inf), good_v)},
        {"k and v token counts differ",
         [&](kvq::KVCache& c) {
           c.append(0, kvq::KVView<const float>::nhd(good_k.data(), n, kHeads, kDim),
                    kvq::KVView<const float>::nhd(good_v.data(), n - 1, kHeads, kDim));
         }},
        {"wrong head_dim",
         [&](kvq::KVCache& c) {
           c.append(0, kvq::KVView<const float>::nhd(good_k.data(), n, kHeads, kDim / 2),
                    kvq::KVView<const float>::nhd(good_v.data(), n, kHeads, kDim / 2));
         }},
        {"wrong kv_heads",
         [&](kvq::KVCache& c) {
           c.append(1, kvq::KVView<const float>::nhd(good_k.data(), n / 2, kHeads * 2, kDim),
                    kvq::KVView<const float>::nhd(good_v.data(), n / 2, kHeads * 2, kDim));
         }},
        {"layer -1", chunk(-1, good_k, good_v)},
        {"layer n_layers", chunk(kLayers, good_k, good_v)},
        {"more than max_tokens",
         [&](kvq::KVCache& c) {
           std::vector<float> big = kvq_robust::normal({kMaxTokens, kHeads, kDim}, 9);
           const int64_t m = kMaxTokens - prefill.tokens + 1;
           c.append(0, kvq::KVView<const float>::nhd(big.data(), m, kHeads, kDim),
                    kvq::KVView<const float>::nhd(big.data(), m, kHeads, kDim));
         }},
        {"NaN in an f16 input view",
         [&](kvq::KVCache& c) {
           std::vector<kvq::f16> hk(good_k.size()), hv(good_v.size());
           for (size_t i = 0; i < hk.size(); ++i) hk[i] = kvq::f16(good_k[i]);
           for (size_t i = 0; i < hv.size(); ++i) hv[i] = kvq::f16(good_v[i]);
           hv[77] = kvq::f16(nan);
           c.append(2, kvq::KVView<const kvq::f16>::nhd(hk.data(), n, kHeads, kDim),
                    kvq::KVView<const kvq::f16>::nhd(hv.data(), n, kHeads, kDim));
         }},
        {"Inf in a bf16 input view",
         [&](kvq::KVCache& c) {
           std::vector<kvq::bf16> bk(good_k.size()), bv(good_v.size());
           for (size_t i = 0; i < bk.size(); ++i) bk[i] = kvq::bf16(good_k[i]);
           for (size_t i = 0; i < bv.size(); ++i) bv[i] = kvq::bf16(good_v[i]);
           bk[5] = kvq::bf16(inf);
           c.append(0, kvq::KVView<const kvq::bf16>::nhd(bk.data(), n, kHeads, kDim),
                    kvq::KVView<const kvq::bf16>::nhd(bv.data(), n, kHeads, kDim));
         }},
    };
    // Range refusals, for the layers whose formats need them (documented in kv_cache.hpp).
    for (int l = 0; l < kLayers; ++l) {
      if (needs_f16_range(cache.key_config(l))) {
        refusals.push_back({"key 70000 beyond fp16, layer " + std::to_string(l),
                            chunk(l, with(good_k, n - 1, 0, 5, 70000.f), good_v)});
      }
      if (needs_f16_range(cache.value_config(l))) {
        refusals.push_back({"value -1e30 beyond fp16, layer " + std::to_string(l),
                            chunk(l, good_k, with(good_v, 3, 1, 40, -1e30f))});
      }
      if (cache.value_config(l).format == kvq::Format::kNuq &&
          cache.value_config(l).meta == kvq::MetaDType::kF16) {
        // Every value fits fp16 but one group spans 120000 > 65504, nuq's fp16 scale (max -
        // min); the cache may only find out when the block is quantized, and must still
        // refuse the whole append unchanged.
        std::vector<float> v = good_v;
        for (int64_t t = 0; t < n; ++t) {
          v[static_cast<size_t>((t * kHeads) * kDim)] = 60000.f;
          v[static_cast<size_t>((t * kHeads) * kDim + 1)] = -60000.f;
        }
        refusals.push_back(
            {"nuq value group spanning 120000 (fp16 scale), layer " + std::to_string(l),
             chunk(l, good_k, v)});
      }
      const kvq::QuantConfig& kc = cache.key_config(l);
      if (kc.format == kvq::Format::kLloydMax && kc.meta == kvq::MetaDType::kF16) {
        // Every element fits fp16, but the row norm (9000 * sqrt(64) = 72000) does not.
        std::vector<float> k = good_k;
        for (int64_t d = 0; d < kDim; ++d)
          k[static_cast<size_t>((12 * kHeads + 1) * kDim + d)] = 9000.f;
        refusals.push_back(
            {"Lloyd-Max key norm 72000 > 65504, layer " + std::to_string(l), chunk(l, k, good_v)});
      }
    }
    for (const Refusal& r : refusals) {
      ++cases;
      EXPECT_THROW(r.call(cache), kvq::Error) << spec << ": " << r.name;
      EXPECT_TRUE(snap(cache) == before) << spec << ": '" << r.name << "' changed the cache";
    }
    // Still usable, and identical to the twin that never saw a refused call.
    append_all(cache, good_k, good_v, n);
    append_all(twin, good_k, good_v, n);
    EXPECT_TRUE(snap(cache) == snap(twin)) << spec << ": refused calls left a trace";
  }
  std::printf(
      "[robustness] refusals: %d refused appends over %zu policies, each checked unchanged\n",
      cases, kvq_robust::all_policies().size());
}

TEST(Refusal, RefusedQuantizeLeavesTheOutputTensorUntouched) {
  const kvq::Shape s{32, 2, 64};
  const std::vector<float> good = kvq_robust::normal(s, 11);
  int cases = 0;
  for (const std::string& term : kvq_robust::all_terms()) {
    const kvq::QuantConfig cfg = kvq_robust::usable_term(term);
    kvq::QTensor q;
    kvq::quantize(cfg, kvq::KVView<const float>::nhd(good.data(), s.tokens, s.heads, s.head_dim),
                  q);
    const kvq::QTensor before = q;
    std::vector<std::vector<float>> bad = {good, good};
    bad[0][1000] = std::numeric_limits<float>::quiet_NaN();
    bad[1][s.numel() - 1] = -std::numeric_limits<float>::infinity();
    if (needs_f16_range(cfg)) {
      bad.push_back(good);
      bad.back()[7] = 1e30f;  // overflows every fp16 scale, zero point, norm and value
    }
    for (const auto& x : bad) {
      ++cases;
      EXPECT_THROW(
          kvq::quantize(cfg, kvq::KVView<const float>::nhd(x.data(), s.tokens, s.heads, s.head_dim),
                        q),
          kvq::Error)
          << term;
      EXPECT_EQ(q.codes, before.codes) << term;
      EXPECT_TRUE(q.scales == before.scales && q.zeros == before.zeros && q.norms == before.norms &&
                  q.qjl_signs == before.qjl_signs && q.qjl_norms == before.qjl_norms)
          << term;
      EXPECT_TRUE(q.shape == before.shape && kvq::same_config(q.config, before.config)) << term;
    }
  }
  std::printf("[robustness] refused quantize(): %d cases over %zu configs\n", cases,
              kvq_robust::all_terms().size());
}

}  // namespace
