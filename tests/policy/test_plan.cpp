// The budget planner's allocation (policy/plan.hpp): the dynamic program against an exhaustive
// enumeration of every choice, the granularity ties, the policy it emits (spec round trip,
// storage bits recomputed from the policy and measured in a real KVCache), and its errors.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kvq/cache/kv_cache.hpp"
#include "kvq/io/calibration_file.hpp"
#include "kvq/policy/plan.hpp"
#include "kvq/policy/spec.hpp"

namespace {

using kvq::PlanGranularity;

kvq::PlanCandidate cand(const std::string& spec) {
  const kvq::Policy p = kvq::parse_policy(spec);
  return {spec, p.key, p.value, {}};
}

/// Exhaustive search: every assignment of candidates to the groups of `g`, the least damage
/// with summed bits <= budget * slots (bits chosen as multiples of 1/64, so the sums are exact
/// in double), ties to fewer bits. Returns {damage, bits}; damage is +inf when none fits.
std::pair<double, double> brute_force(const kvq::PlanProblem& p, double budget, PlanGranularity g) {
  const int L = p.n_layers, nc = static_cast<int>(p.candidates.size());
  auto slot_of_group = [&](int s) -> int {
    if (g == PlanGranularity::kModel) return s % 2;
    if (g == PlanGranularity::kLayer) return s / 2;
    return s;
  };
  const int groups = g == PlanGranularity::kModel ? 2 : g == PlanGranularity::kLayer ? L : 2 * L;
  std::vector<int> a(static_cast<size_t>(groups), 0);
  double best = std::numeric_limits<double>::infinity(), best_bits = 0;
  while (true) {
    double d = 0, b = 0;
    for (int s = 0; s < 2 * L; ++s) {
      const int c = a[static_cast<size_t>(slot_of_group(s))];
      d += p.damage[static_cast<size_t>(s)][static_cast<size_t>(c)];
      b += p.bits[static_cast<size_t>(s)][static_cast<size_t>(c)];
    }
    if (b <= budget * 2 * L && (d < best || (d == best && b < best_bits))) {
      best = d;
      best_bits = b;
    }
    int i = 0;
    while (i < groups && ++a[static_cast<size_t>(i)] == nc) a[static_cast<size_t>(i++)] = 0;
    if (i == groups) break;
  }
  return {best, best_bits / (2 * L)};
}

kvq::PlanProblem random_problem(std::mt19937& rng, int layers, int nc) {
  kvq::PlanProblem p;
  p.n_layers = layers;
  const char* specs[] = {"k=int2/channel/g32,v=int2/token/g32", "k=int4/channel/g32,v=int4/token/g32",
                         "k=f16,v=f16", "k=e4m3/head,v=e4m3/head", "k=lm3/rot,v=lm3/rot"};
  for (int c = 0; c < nc; ++c) p.candidates.push_back(cand(specs[c % 5]));
  std::uniform_int_distribution<int> sixty_fourths(2 * 64, 16 * 64);
  std::uniform_real_distribution<double> dm(0.0, 10.0);
  for (int s = 0; s < 2 * layers; ++s) {
    std::vector<double> d, b;
    for (int c = 0; c < nc; ++c) {
      b.push_back(sixty_fourths(rng) / 64.0);
      d.push_back(dm(rng));
    }
    p.damage.push_back(d);
    p.bits.push_back(b);
  }
  return p;
}

TEST(Plan, DynamicProgramEqualsExhaustiveSearch) {
  std::mt19937 rng(7);
  int checked = 0, infeasible = 0;
  for (int trial = 0; trial < 60; ++trial) {
    const int layers = 1 + trial % 3, nc = 2 + trial % 3;
    const kvq::PlanProblem p = random_problem(rng, layers, nc);
    for (PlanGranularity g :
         {PlanGranularity::kModel, PlanGranularity::kLayer, PlanGranularity::kLayerKV}) {
      for (double budget : {2.5, 4.0, 6.25, 9.0}) {
        const auto [want, want_bits] = brute_force(p, budget, g);
        if (!std::isfinite(want)) {
          EXPECT_THROW(kvq::plan_allocate(p, budget, g), kvq::Error);
          ++infeasible;
          continue;
        }
        const kvq::PlanChoice r = kvq::plan_allocate(p, budget, g);
        EXPECT_NEAR(r.damage, want, 1e-9) << "trial " << trial << " budget " << budget;
        EXPECT_NEAR(r.mean_bits, want_bits, 1e-12) << "trial " << trial << " budget " << budget;
        EXPECT_LE(r.mean_bits, budget + 1e-12);
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 200);
  EXPECT_GT(infeasible, 0);  // the refusal path was exercised too
}

TEST(Plan, GranularityTiesSlots) {
  std::mt19937 rng(11);
  const kvq::PlanProblem p = random_problem(rng, 4, 4);
  const auto m = kvq::plan_allocate(p, 8.0, PlanGranularity::kModel);
  for (int l = 1; l < 4; ++l) {
    EXPECT_EQ(m.choice[2 * l], m.choice[0]);
    EXPECT_EQ(m.choice[2 * l + 1], m.choice[1]);
  }
  const auto y = kvq::plan_allocate(p, 8.0, PlanGranularity::kLayer);
  for (int l = 0; l < 4; ++l) EXPECT_EQ(y.choice[2 * l], y.choice[2 * l + 1]);
  // Finer granularity never does worse at the same budget.
  const auto kv = kvq::plan_allocate(p, 8.0, PlanGranularity::kLayerKV);
  EXPECT_LE(kv.damage, y.damage + 1e-12);
  EXPECT_LE(y.damage, m.damage + 1e-12);
}

// Hand-computed storage bits (fp16 scale and zero per group of 32, codes packed): int4 32x4 + 32
// bits per group = 5 bits; int2 = 3; int3 = 4; sint4 (scale only) = 4.5; f16 = 16; f32 = 32.
TEST(Plan, StorageBitsByHand) {
  EXPECT_DOUBLE_EQ(kvq::storage_bits(kvq::parse_quant_config("int4/channel/g32"), 3, 64), 5.0);
  EXPECT_DOUBLE_EQ(kvq::storage_bits(kvq::parse_quant_config("int4/token/g32"), 3, 64), 5.0);
  EXPECT_DOUBLE_EQ(kvq::storage_bits(kvq::parse_quant_config("int2/token/g32"), 3, 64), 3.0);
  EXPECT_DOUBLE_EQ(kvq::storage_bits(kvq::parse_quant_config("int3/channel/g32"), 3, 64), 4.0);
  EXPECT_DOUBLE_EQ(kvq::storage_bits(kvq::parse_quant_config("sint4/token/g32"), 3, 64), 4.5);
  EXPECT_DOUBLE_EQ(kvq::storage_bits(kvq::parse_quant_config("f16"), 3, 64), 16.0);
  EXPECT_DOUBLE_EQ(kvq::storage_bits(kvq::parse_quant_config("f32"), 1, 8), 32.0);
  // nuq: codes plus fp16 scale and zero per group, as int; the per-layer codebook is not in it.
  EXPECT_DOUBLE_EQ(kvq::storage_bits(kvq::parse_quant_config("nuq3/token/g32"), 3, 64), 4.0);
  EXPECT_DOUBLE_EQ(kvq::storage_bits(kvq::parse_quant_config("nuq2/channel/g32"), 3, 64), 3.0);
  // 1% of 64 channels: one outlier per (token, head) vector, an fp16 value and a 1-byte
  // position: 24 bits per 64 values.
  EXPECT_DOUBLE_EQ(kvq::storage_bits(kvq::parse_quant_config("nuq3/token/g32/out1%"), 3, 64),
                   4.0 + 24.0 / 64.0);
}

TEST(Plan, PolicyRoundTripsAndCostsWhatThePlanSays) {
  kvq::PlanProblem p;
  p.n_layers = 5;
  const int H = 2, D = 32;
  for (const char* s : {"k=int2/channel/g32,v=int2/token/g32", "k=int4/channel/g32,v=int4/token/g32",
                        "k=lm3/rot,v=lm3/rot", "k=e4m3/head,v=e4m3/head", "k=f16,v=f16"})
    p.candidates.push_back(cand(s));
  std::mt19937 rng(3);
  std::uniform_real_distribution<double> dm(0.0, 1.0);
  for (int s = 0; s < p.slots(); ++s) {
    std::vector<double> b, d;
    for (const auto& c : p.candidates) {
      const double bits = kvq::storage_bits(s % 2 ? c.value : c.key, H, D);
      b.push_back(bits);
      d.push_back(dm(rng) * std::exp2(-bits));  // more bits, less damage
    }
    p.bits.push_back(b);
    p.damage.push_back(d);
  }
  for (double budget : {3.0, 3.5, 4.25, 6.0, 12.0}) {
    const kvq::PlanChoice r = kvq::plan_allocate(p, budget, PlanGranularity::kLayerKV);
    const kvq::Policy pol = kvq::plan_policy(p, r);
    // The spec parses back to the same policy.
    const std::string spec = pol.spec();
    EXPECT_EQ(kvq::parse_policy(spec), pol) << spec;
    // Every slot stores what the plan chose.
    for (int l = 0; l < p.n_layers; ++l) {
      EXPECT_TRUE(kvq::same_config(pol.key_for(l, p.n_layers),
                                   p.candidates[static_cast<size_t>(r.choice[2 * l])].key));
      EXPECT_TRUE(kvq::same_config(pol.value_for(l, p.n_layers),
                                   p.candidates[static_cast<size_t>(r.choice[2 * l + 1])].value));
    }
    const double bits = kvq::policy_storage_bits(pol, p.n_layers, H, D);
    EXPECT_NEAR(bits, r.mean_bits, 1e-12);
    EXPECT_LE(bits, budget + 1e-12);

    // Measured: a KVCache holding whole blocks of every layer stores exactly these bits in its
    // pages (padding aside), and its bytes come from the cache, not from the accountant call
    // above.
    kvq::KVCache cache(pol, p.n_layers, H, D, 1024, kvq::KVCacheOptions{false});
    const int T = 256;  // a multiple of every block size here (16, 32)
    std::vector<float> k(static_cast<size_t>(T) * H * D), v(k.size());
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (auto& x : k) x = nd(rng);
    for (auto& x : v) x = nd(rng);
    for (int l = 0; l < p.n_layers; ++l)
      cache.append(l, kvq::KVView<const float>::nhd(k.data(), T, H, D),
                   kvq::KVView<const float>::nhd(v.data(), T, H, D));
    const kvq::MemoryReport m = cache.memory_report();
    double stored = 0;
    for (const auto& lm : m.layers) {
      ASSERT_EQ(lm.residual_tokens, 0);
      stored += static_cast<double>(lm.key.total() - lm.key.packed.padding);
      stored += static_cast<double>(lm.value.total() - lm.value.packed.padding);
    }
    const double measured = 8.0 * stored / static_cast<double>(m.elements());
    EXPECT_NEAR(measured, r.mean_bits, 0.01) << spec;
  }
}

TEST(Plan, Errors) {
  std::mt19937 rng(5);
  kvq::PlanProblem p = random_problem(rng, 2, 3);
  try {
    kvq::plan_allocate(p, 1.0, PlanGranularity::kLayerKV);
    FAIL() << "a budget below the cheapest choice must be refused";
  } catch (const kvq::Error& e) {
    EXPECT_NE(std::string(e.what()).find("below the cheapest"), std::string::npos) << e.what();
  }
  EXPECT_THROW(kvq::plan_allocate(p, -3.0, PlanGranularity::kLayerKV), kvq::Error);
  EXPECT_THROW(kvq::plan_allocate(p, std::nan(""), PlanGranularity::kLayerKV), kvq::Error);
  p.damage[1][0] = std::nan("");
  try {
    kvq::plan_allocate(p, 8.0, PlanGranularity::kLayerKV);
    FAIL() << "a NaN damage must be refused";
  } catch (const kvq::Error& e) {
    EXPECT_NE(std::string(e.what()).find("slot 1"), std::string::npos) << e.what();
  }
  try {
    kvq::parse_granularity("head");
    FAIL();
  } catch (const kvq::Error& e) {
    EXPECT_NE(std::string(e.what()).find("'head'"), std::string::npos) << e.what();
  }
  EXPECT_THROW(kvq::parse_granularity("layers"), kvq::Error);
  EXPECT_EQ(kvq::parse_granularity("layer-kv"), PlanGranularity::kLayerKV);
}

// nuq candidates: calibrate_plan_candidates learns each layer's codebooks; the planned policy
// stores exactly what kvq::calibrate learns for that policy on the same data (computed here
// from the plan's uncalibrated spec), the spec plus a calibration file restore it, and a cache
// under it stores the planned bits.
TEST(Plan, NuqCandidatesCarryPerLayerCodebooks) {
  const int L = 3, H = 2, D = 32, T = 96;
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  kvq::CalibrationSet data;
  data.n_layers = L;
  data.kv_heads = H;
  data.head_dim = D;
  kvq::CalibrationSet::Sequence seq;
  seq.tokens = T;
  for (int l = 0; l < L; ++l) {
    kvq::CalibrationSet::Layer cl;
    cl.k.resize(static_cast<size_t>(T * H * D));
    cl.v.resize(cl.k.size());
    for (size_t i = 0; i < cl.k.size(); ++i) {
      cl.k[i] = nd(rng) * (1.0f + static_cast<float>(l)) * (i % D == 3 ? 8.0f : 1.0f);
      cl.v[i] = nd(rng) * (i % 7 == 0 ? 3.0f : 0.5f);
    }
    seq.layers.push_back(cl);
  }
  data.sequences.push_back(seq);

  kvq::PlanProblem p;
  p.n_layers = L;
  p.candidates = kvq::parse_plan_candidates(
      "int2=k=int2/channel/g32,v=int2/token/g32;nuq3=k=nuq3/channel/g32,v=nuq3/token/g32;"
      "nuq2o=k=nuq2/channel/g32/out1%,v=int2/token/g32;f16=k=f16,v=f16");
  kvq::calibrate_plan_candidates(p.candidates, data);
  EXPECT_TRUE(p.candidates[0].per_layer.empty() && p.candidates[3].per_layer.empty());
  ASSERT_EQ(p.candidates[1].per_layer.size(), static_cast<size_t>(L));
  for (int l = 0; l < L; ++l) {
    EXPECT_TRUE(p.candidates[1].key_at(l).nuq_ready && p.candidates[1].value_at(l).nuq_ready);
    EXPECT_TRUE(p.candidates[2].key_at(l).nuq_ready);
    EXPECT_EQ(p.candidates[2].value_at(l).format, kvq::Format::kInt);
  }
  EXPECT_NE(p.candidates[1].key_at(0).nuq_levels, p.candidates[1].key_at(2).nuq_levels);
  // A choice that mixes them: layer 0 nuq3 keys / int2 values, layer 1 nuq2o / nuq3,
  // layer 2 int2 / f16.
  kvq::PlanChoice r;
  r.choice = {1, 0, 2, 1, 0, 3};
  const kvq::Policy pol = kvq::plan_policy(p, r);
  EXPECT_NO_THROW(kvq::check_calibrated(pol, L));
  EXPECT_TRUE(kvq::needs_calibration(pol, L));
  // Independent: calibrate the plan's own spec (no codebooks) on the same data.
  const kvq::Policy bare = kvq::parse_policy(pol.spec());
  EXPECT_THROW(kvq::check_calibrated(bare, L), kvq::Error);
  const kvq::Policy cal = kvq::calibrate(bare, data);
  for (int l = 0; l < L; ++l) {
    EXPECT_TRUE(kvq::same_config(pol.key_for(l, L), cal.key_for(l, L))) << "layer " << l;
    EXPECT_TRUE(kvq::same_config(pol.value_for(l, L), cal.value_for(l, L))) << "layer " << l;
  }
  EXPECT_TRUE(kvq::same_config(pol.key_for(2, L), p.candidates[0].key));
  EXPECT_EQ(pol.value_for(2, L).format, kvq::Format::kF16);
  // Spec + calibration file restore it (what kvq_plan --save-calibration and --calibrate do).
  const kvq::CalibrationFile f = kvq::parse_calibration(kvq::calibration_json(pol, L), "plan");
  const kvq::Policy back = kvq::apply_calibration(bare, f, L);
  for (int l = 0; l < L; ++l) {
    EXPECT_TRUE(kvq::same_config(back.key_for(l, L), pol.key_for(l, L)));
    EXPECT_TRUE(kvq::same_config(back.value_for(l, L), pol.value_for(l, L)));
  }
  // The bits the plan promises for this choice are what a cache of whole blocks stores.
  double want = 0;
  for (int l = 0; l < L; ++l)
    want += kvq::storage_bits(p.candidates[static_cast<size_t>(r.choice[2 * l])].key, H, D) +
            kvq::storage_bits(p.candidates[static_cast<size_t>(r.choice[2 * l + 1])].value, H, D);
  want /= 2.0 * L;
  EXPECT_NEAR(kvq::policy_storage_bits(pol, L, H, D), want, 1e-12);
  kvq::KVCache cache(pol, L, H, D, 1024, kvq::KVCacheOptions{false});
  std::vector<float> k(static_cast<size_t>(128) * H * D), v(k.size());
  for (auto& x : k) x = nd(rng);
  for (auto& x : v) x = nd(rng);
  for (int l = 0; l < L; ++l)
    cache.append(l, kvq::KVView<const float>::nhd(k.data(), 128, H, D),
                 kvq::KVView<const float>::nhd(v.data(), 128, H, D));
  const kvq::MemoryReport m = cache.memory_report();
  double stored = 0;
  for (const auto& lm : m.layers) {
    ASSERT_EQ(lm.residual_tokens, 0);
    stored += static_cast<double>(lm.key.packed.total() - lm.key.packed.padding);
    stored += static_cast<double>(lm.value.packed.total() - lm.value.packed.padding);
  }
  EXPECT_NEAR(8.0 * stored / static_cast<double>(m.elements()), want, 0.01);
}

}  // namespace

namespace {

TEST(Plan, CandidateLists) {
  const auto d = kvq::default_plan_candidates();
  ASSERT_EQ(d.size(), 15u);
  EXPECT_EQ(d[0].name, "int2");
  EXPECT_EQ(kvq::config_spec(d[0].key), "int2/channel/g32");
  EXPECT_EQ(kvq::config_spec(d[0].value), "int2/token/g32");
  EXPECT_EQ(d[5].name, "nuq3");
  EXPECT_TRUE(d[5].needs_codebooks() && !d[0].needs_codebooks());
  EXPECT_EQ(kvq::config_spec(d[8].key), "nuq3/channel/g32/out1%");
  EXPECT_EQ(d[14].name, "f16");
  const auto c = kvq::parse_plan_candidates(" kivi4 ; mine=k=int3/channel/g32,v=lm3/rot;");
  ASSERT_EQ(c.size(), 2u);
  EXPECT_EQ(c[0].name, "kivi4");
  EXPECT_EQ(kvq::config_spec(c[0].key), "int4/channel/g32");
  EXPECT_EQ(c[1].name, "mine");
  EXPECT_EQ(kvq::config_spec(c[1].value), "lm3/rot");
  auto refused = [](const std::string& list, const std::string& needle) {
    try {
      kvq::parse_plan_candidates(list);
      ADD_FAILURE() << list << " was accepted";
    } catch (const kvq::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  refused("kivi4;k=int5/token,v=f16", "'k=int5/token,v=f16'");
  refused("a=kivi4;a=kivi2", "'a' appears twice");
  refused("kivi4,skip=2", "no skip");
  refused(" ; ", "empty");
}

}  // namespace
