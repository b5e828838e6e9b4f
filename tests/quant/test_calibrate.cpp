// Tests of quant/calibrate.hpp (kvq::calibrate, calibration files) and of the spec grammar's
// nuq<b> and out<N> / out<P>% terms (policy/spec.hpp).
#include "kvq/io/calibration_file.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "kvq/quant/quantize.hpp"
#include "kvq/reference/rotation_ref.hpp"
#include "test_util.hpp"

namespace {

kvq::CalibrationSet synthetic_set(int layers, int64_t tokens, bool queries, uint32_t seed) {
  kvq::CalibrationSet s;
  s.n_layers = layers;
  s.kv_heads = 2;
  s.q_heads = queries ? 4 : 0;
  s.head_dim = 16;
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  kvq::CalibrationSet::Sequence seq;
  seq.tokens = tokens;
  for (int l = 0; l < layers; ++l) {
    kvq::CalibrationSet::Layer L;
    const auto n = static_cast<std::size_t>(tokens * s.kv_heads * s.head_dim);
    for (std::size_t i = 0; i < n; ++i) {
      L.k.push_back(nd(rng) * (i % 16 == 3 ? 6.f : 1.f));
      L.v.push_back(nd(rng) * nd(rng));  // heavy-tailed
    }
    L.k_attn = L.k;
    if (queries)
      for (int64_t i = 0; i < tokens * s.q_heads * s.head_dim; ++i) L.q.push_back(nd(rng));
    seq.layers.push_back(std::move(L));
  }
  s.sequences.push_back(std::move(seq));
  return s;
}

TEST(Spec, NuqAndOutlierTerms) {
  const kvq::Policy p =
      kvq::parse_policy("k=int3/channel/g32/out1%,v=nuq3/token/g16/out2,residual=32");
  EXPECT_EQ(p.key.format, kvq::Format::kInt);
  EXPECT_FLOAT_EQ(p.key.outlier_pct, 1.f);
  EXPECT_EQ(p.value.format, kvq::Format::kNuq);
  EXPECT_EQ(p.value.bits, 3);
  EXPECT_EQ(p.value.outliers, 2);
  EXPECT_EQ(p.value.group, 16);
  EXPECT_FALSE(p.value.nuq_ready);
  EXPECT_EQ(p.spec(),
            "k=int3/channel/g32/out1%,v=nuq3/token/g16/out2,residual=32,sinks=0,skip=0:0");
  EXPECT_EQ(kvq::parse_policy(p.spec()), p);
  EXPECT_EQ(kvq::parse_policy("k=nuq2,v=nuq4/channel/g64/out0.5%").value.outlier_pct, 0.5f);
  EXPECT_EQ(kvq::parse_policy("k=e4m3/head/out3,v=f16").key.outliers, 3);
  for (const char* bad : {"k=nuq5", "k=nuq1", "k=lm3/out1", "k=f16/out1", "k=int3/out0",
                          "k=int3/out1/out2", "k=int3/out%", "k=int3/out101%", "k=int3/out1.%",
                          "k=int3/outx", "k=int3/out-1", "k=int3/out0%", "k=nuq3/rot"}) {
    EXPECT_THROW(kvq::parse_policy(bad), kvq::Error) << bad;
  }
}

TEST(Calibrate, UncalibratedSpecIsAClearError) {
  const kvq::Policy p = kvq::parse_policy("k=nuq3/channel/g32,v=int4");
  EXPECT_TRUE(kvq::needs_calibration(p, 4));
  try {
    kvq::check_calibrated(p, 4);
    FAIL();
  } catch (const kvq::Error& e) {
    EXPECT_NE(std::string(e.what()).find("layer 0 keys"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(kvq::needs_calibration(kvq::parse_policy("kivi2"), 4));
}

TEST(Calibrate, LearnsDeterministicCodebooksThatBeatTheGrid) {
  const auto data = synthetic_set(2, 128, true, 1);
  const kvq::Policy p = kvq::parse_policy("k=nuq3/channel/g32/out1,v=nuq2/token/g16");
  const kvq::Policy a = kvq::calibrate(p, data);
  const kvq::Policy b = kvq::calibrate(p, data);
  EXPECT_EQ(a, b);
  // Every layer's key (nuq3: 8 levels) and value (nuq2: 4 levels) codebook: calibrated, the
  // spec's normalization kept, strictly ascending inside the normalized range [0, 1], with
  // the extreme levels near the ends (every group contributes its min at u = 0 and its max at
  // u = 1); and learned per layer (the two layers' data differ, so do their codebooks).
  for (int l = 0; l < 2; ++l) {
    const kvq::QuantConfig k = a.key_for(l, 2), v = a.value_for(l, 2);
    ASSERT_TRUE(k.nuq_ready && v.nuq_ready);
    EXPECT_EQ(k.outliers, 1);
    EXPECT_EQ(k.bits, 3);
    EXPECT_EQ(v.bits, 2);
    EXPECT_EQ(k.axis, kvq::Axis::kChannel);
    EXPECT_EQ(v.group, 16);
    for (const auto* c : {&k, &v}) {
      const int n = 1 << c->bits;
      EXPECT_GE(c->nuq_levels[0], 0.f);
      EXPECT_LT(c->nuq_levels[0], 0.2f);
      EXPECT_GT(c->nuq_levels[static_cast<std::size_t>(n - 1)], 0.8f);
      EXPECT_LE(c->nuq_levels[static_cast<std::size_t>(n - 1)], 1.f);
      for (int i = 1; i < n; ++i)
        EXPECT_GT(c->nuq_levels[static_cast<std::size_t>(i)],
                  c->nuq_levels[static_cast<std::size_t>(i - 1)]);
    }
  }
  EXPECT_NE(a.key_for(0, 2).nuq_levels, a.key_for(1, 2).nuq_levels);
  EXPECT_NE(a.value_for(0, 2).nuq_levels, a.value_for(1, 2).nuq_levels);
  // On its own calibration data the learned 2-bit value codebook beats the uniform grid.
  const kvq::QuantConfig vc = a.value_for(0, 2);
  kvq::QuantConfig grid = vc;
  for (int i = 0; i < 4; ++i) grid.nuq_levels[static_cast<std::size_t>(i)] = i / 3.f;
  const auto& x = data.sequences[0].layers[0].v;
  const kvq::Shape s{128, 2, 16};
  auto err = [&](const kvq::QuantConfig& c) {
    std::vector<float> y(x.size());
    kvq::dequantize(kvq::quantize(c, kvq::KVView<const float>(x.data(), s)),
                    kvq::KVView<float>(y.data(), s));
    return kvq_test::rel_mse(x, y);
  };
  EXPECT_LT(err(vc), err(grid));
  // Uniform weights give a different (still valid) codebook on the keys.
  kvq::CalibrationOptions uo;
  uo.weights = kvq::CalibrationWeights::kUniform;
  const kvq::Policy u = kvq::calibrate(p, data, uo);
  EXPECT_NE(u.key_for(0, 2).nuq_levels, a.key_for(0, 2).nuq_levels);
  // Non-nuq policies come back unchanged; too few tokens is an error.
  EXPECT_EQ(kvq::calibrate(kvq::parse_policy("kivi2"), data), kvq::parse_policy("kivi2"));
  EXPECT_THROW(kvq::calibrate(kvq::parse_policy("k=nuq3/channel/g32,v=f16"),
                              synthetic_set(1, 20, false, 2)),
               kvq::Error);
}

TEST(Calibrate, FileRoundTrip) {
  const auto data = synthetic_set(3, 64, false, 3);
  const kvq::Policy p = kvq::calibrate(
      kvq::parse_policy("k=nuq4/channel/g32/out1%,v=nuq3,skip=1:0,sinks=0"), data);
  const std::string text = kvq::calibration_json(p, 3, "synthetic");
  const kvq::CalibrationFile f = kvq::parse_calibration(text, "mem");
  EXPECT_EQ(f.n_layers, 3);
  EXPECT_EQ(f.policy, p);
  for (int l = 0; l < 3; ++l) {
    EXPECT_EQ(f.policy.key_for(l, 3).nuq_levels, p.key_for(l, 3).nuq_levels);
    EXPECT_EQ(f.policy.value_for(l, 3).nuq_ready, p.value_for(l, 3).nuq_ready);
  }
  const auto path = std::filesystem::temp_directory_path() / "kvq_test_calibration.json";
  kvq::save_calibration(path, p, 3);
  EXPECT_EQ(kvq::load_calibration(path).policy, p);
  std::filesystem::remove(path);
  EXPECT_THROW(kvq::load_calibration(path), kvq::Error);
}

TEST(Calibrate, BadFilesRejectedClearly) {
  const auto data = synthetic_set(2, 64, false, 4);
  const kvq::Policy p = kvq::calibrate(kvq::parse_policy("k=nuq2/channel/g32,v=int4"), data);
  const std::string good = kvq::calibration_json(p, 2);
  // The untouched file parses back to the same policy and codebooks (exact: 9 digits).
  const kvq::CalibrationFile f = kvq::parse_calibration(good, "good");
  ASSERT_EQ(f.n_layers, 2);
  EXPECT_EQ(f.policy, p);
  for (int l = 0; l < 2; ++l) {
    EXPECT_TRUE(f.policy.key_for(l, 2).nuq_ready);
    EXPECT_EQ(f.policy.key_for(l, 2).nuq_levels, p.key_for(l, 2).nuq_levels);
    EXPECT_EQ(f.policy.value_for(l, 2).format, kvq::Format::kInt);
  }
  auto expect_bad = [&](std::string text, const std::string& needle) {
    try {
      kvq::parse_calibration(text, "bad.json");
      ADD_FAILURE() << "accepted: " << text;
    } catch (const kvq::Error& e) {
      EXPECT_EQ(e.kind(), kvq::ErrorKind::kParse) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  auto replace = [&](const std::string& from, const std::string& to) {
    std::string t = good;
    const auto pos = t.find(from);
    EXPECT_NE(pos, std::string::npos) << from;
    return t.replace(pos, from.size(), to);
  };
  expect_bad("[]", "not a JSON object");
  expect_bad("{", "bad.json");
  expect_bad(replace("kvq-calibration", "other"), "format");
  expect_bad(replace("\"version\": 1", "\"version\": 2"), "version");
  expect_bad(replace("\"n_layers\": 2", "\"n_layers\": 0"), "n_layers");
  expect_bad(replace("\"n_layers\": 2", "\"n_layers\": 1"), "layer must be");
  expect_bad(replace("\"spec\": \"k=", "\"spec\": \"k=bogus"), "spec");
  expect_bad(replace("\"bits\": 2", "\"bits\": 3"), "bits must be 2");
  expect_bad(replace("\"tensor\": \"k\"", "\"tensor\": \"v\""), "not a nuq format");
  expect_bad(replace("\"levels\": [", "\"levels\": [0.5, "), "levels must be an array of 4");
  expect_bad(replace("\"levels\": [", "\"levels\": [\"x\", "), "levels");
  expect_bad(replace("\"codebooks\": [", "\"codebooks\": 3, \"x\": ["), "codebooks");
  expect_bad(replace("\"tensor\": \"k\"", "\"tensor\": \"q\""), "tensor");
  // Non-ascending levels: swap the first two numbers of the first codebook.
  {
    std::string t = good;
    const auto a = t.find("\"levels\": [") + 11;
    const auto c1 = t.find(',', a);
    const auto c2 = t.find(',', c1 + 1);
    const std::string x = t.substr(a, c1 - a), y = t.substr(c1 + 2, c2 - c1 - 2);
    t.replace(a, c2 - a, y + ", " + x);
    expect_bad(t, "ascending");
  }
  // A missing codebook (the second layer's keys).
  {
    std::string t = good;
    const auto b = t.find(",\n    {\"layer\": 1");
    ASSERT_NE(b, std::string::npos);
    t.erase(b, t.find('}', b) + 1 - b);
    expect_bad(t, "incomplete");
  }
  // A duplicate.
  {
    std::string t = good;
    const auto a = t.find("{\"layer\": 0");
    const std::string entry = t.substr(a, t.find('}', a) + 1 - a);
    t.insert(a, entry + ",\n    ");
    expect_bad(t, "duplicates");
  }
}

TEST(Calibrate, FromKvDumpNeedsPreRopeKeysWhenAsked) {
  kvq::io::KVDump d;
  const auto data = synthetic_set(1, 64, true, 5);
  kvq::io::KVDump::Layer L;
  const auto& c = data.sequences[0].layers[0];
  L.k = kvq::io::Array::from_float(c.k, {64, 2, 16}, kvq::DType::kF32);
  L.v = kvq::io::Array::from_float(c.v, {64, 2, 16}, kvq::DType::kF32);
  L.q = kvq::io::Array::from_float(c.q, {64, 4, 16}, kvq::DType::kF32);
  d.layers.push_back(L);
  const kvq::Policy p = kvq::parse_policy("k=nuq3/channel/g32,v=nuq3");
  EXPECT_THROW(kvq::calibrate(p, d, true), kvq::Error);
  const kvq::Policy a = kvq::calibrate(p, d, false);
  EXPECT_EQ(a, kvq::calibrate(p, data));
}

// NVFP4 tensor scales: kvq::calibrate sets, for every NVFP4 (layer, K/V) left at the default
// scale 1, amax / (6 x 448) of that layer's data after the sinks (computed here by a plain
// loop); a scale given in code is kept; the option turns it off; calibration files carry the
// scales and apply_calibration restores them; calibrated scales lower the error of small data.
TEST(Calibrate, Nvfp4TensorScalesFromTheData) {
  auto data = synthetic_set(2, 64, false, 7);
  const int sinks = 4;
  auto amax_of = [&](int l, bool key) {
    const auto& L = data.sequences[0].layers[static_cast<std::size_t>(l)];
    const std::vector<float>& x = key ? L.k : L.v;
    float a = 0.f;
    for (std::size_t i = static_cast<std::size_t>(sinks * 2 * 16); i < x.size(); ++i)
      a = std::max(a, std::fabs(x[i]));
    return a;
  };
  const kvq::Policy bare = kvq::parse_policy("k=nvfp4,v=nvfp4,sinks=4");
  EXPECT_FALSE(kvq::needs_calibration(bare, 2));
  EXPECT_TRUE(kvq::calibrates(bare, 2));
  const kvq::Policy cal = kvq::calibrate(bare, data);
  for (int l = 0; l < 2; ++l) {
    EXPECT_EQ(cal.key_for(l, 2).fp4_tensor_scale, amax_of(l, true) / 2688.0f) << l;
    EXPECT_EQ(cal.value_for(l, 2).fp4_tensor_scale, amax_of(l, false) / 2688.0f) << l;
  }
  EXPECT_NE(cal.key_for(0, 2).fp4_tensor_scale, cal.key_for(1, 2).fp4_tensor_scale);
  EXPECT_FALSE(kvq::calibrates(cal, 2));
  EXPECT_EQ(kvq::calibrate(cal, data), cal);  // idempotent
  kvq::CalibrationOptions off;
  off.nvfp4_tensor_scale = false;
  EXPECT_EQ(kvq::calibrate(bare, data, off), bare);
  kvq::Policy given = bare;
  given.key.fp4_tensor_scale = 0.5f;
  const kvq::Policy kept = kvq::calibrate(given, data);
  EXPECT_EQ(kept.key_for(1, 2).fp4_tensor_scale, 0.5f);
  EXPECT_EQ(kept.value_for(1, 2).fp4_tensor_scale, amax_of(1, false) / 2688.0f);
  // With nuq in the same policy: both calibrated.
  const kvq::Policy mixed = kvq::calibrate(kvq::parse_policy("k=nuq3/channel/g32,v=nvfp4"), data);
  EXPECT_TRUE(mixed.key_for(0, 2).nuq_ready);
  EXPECT_EQ(mixed.value_for(1, 2).fp4_tensor_scale, amax_of(1, false) / 2688.0f);
  // The calibration file carries the scales; applying it restores them.
  const std::string text = kvq::calibration_json(cal, 2, "synthetic");
  EXPECT_NE(text.find("\"tensor_scales\""), std::string::npos);
  const kvq::CalibrationFile f = kvq::parse_calibration(text, "mem");
  EXPECT_EQ(f.policy, cal);
  EXPECT_EQ(kvq::apply_calibration(bare, f, 2), cal);
  EXPECT_EQ(kvq::apply_calibration(kvq::parse_policy("k=int4,v=int4"), f, 2),
            kvq::parse_policy("k=int4,v=int4"));
  const kvq::CalibrationFile fm = kvq::parse_calibration(kvq::calibration_json(mixed, 2), "mem");
  EXPECT_EQ(fm.policy, mixed);
  // Bad tensor_scales entries are refused naming the entry.
  auto refused = [&](const std::string& bad_text, const std::string& needle) {
    try {
      kvq::parse_calibration(bad_text, "bad");
      ADD_FAILURE() << "accepted: " << needle;
    } catch (const kvq::Error& e) {
      EXPECT_EQ(e.kind(), kvq::ErrorKind::kParse);
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  const std::string head = text.substr(0, text.find("\"tensor_scales\""));
  refused(head + "\"tensor_scales\": [{\"layer\": 0, \"tensor\": \"k\", \"scale\": -1}]}",
          "tensor_scales[0].scale must be a positive normal float");
  refused(head + "\"tensor_scales\": [{\"layer\": 0, \"tensor\": \"k\", \"scale\": 0.1}, "
                 "{\"layer\": 0, \"tensor\": \"k\", \"scale\": 0.2}]}",
          "tensor_scales[1] duplicates layer 0 k");
  refused(head + "\"tensor_scales\": [{\"layer\": 2, \"tensor\": \"v\", \"scale\": 0.1}]}",
          "tensor_scales[0].layer must be an integer in [0, 2)");
  // Rotated NVFP4 (/rot): the scale of the rotated vectors (rotated here by the reference).
  {
    const kvq::Policy rp = kvq::calibrate(kvq::parse_policy("k=nvfp4/rot,v=nvfp4,sinks=4"), data);
    const kvq::QuantConfig rk = rp.key_for(1, 2);
    ASSERT_TRUE(rk.rotate);
    const kvq::Rotation r = kvq::Rotation::hadamard(16, rk.seed);
    const float* s2 = r.signs2().empty() ? nullptr : r.signs2().data();
    const int32_t* perm = r.permutation().empty() ? nullptr : r.permutation().data();
    std::vector<float> k = data.sequences[0].layers[1].k;
    float a = 0.f;
    for (int64_t v = sinks * 2; v < 64 * 2; ++v) {
      kvq::reference::hadamard_rotation_ref(k.data() + v * 16, 16, r.block(), r.signs().data(),
                                            perm, s2);
      for (int d = 0; d < 16; ++d) a = std::max(a, std::fabs(k[static_cast<std::size_t>(v * 16 + d)]));
    }
    EXPECT_NEAR(rk.fp4_tensor_scale, a / 2688.0f, 1e-6f * a / 2688.0f);
    EXPECT_NE(rk.fp4_tensor_scale, amax_of(1, true) / 2688.0f);
    EXPECT_EQ(rp.value_for(1, 2).fp4_tensor_scale, amax_of(1, false) / 2688.0f);
  }
  // Small data: the default scale leaves e4m3 block scales subnormal; the calibrated one does
  // not, and the error falls.
  for (auto& seq : data.sequences)
    for (auto& L : seq.layers)
      for (float& x : L.v) x *= 0.004f;
  const kvq::Policy small = kvq::calibrate(bare, data);
  const auto& L0 = data.sequences[0].layers[0];
  const kvq::KVView<const float> v(L0.v.data(), kvq::Shape{64, 2, 16});
  auto mse = [&](const kvq::QuantConfig& c) {
    std::vector<float> out(L0.v.size());
    kvq::dequantize(kvq::quantize(c, v), kvq::KVView<float>(out.data(), v.shape()));
    double e = 0;
    for (std::size_t i = 0; i < out.size(); ++i) e += (out[i] - L0.v[i]) * (out[i] - L0.v[i]);
    return e;
  };
  EXPECT_LT(mse(small.value_for(0, 2)), 0.5 * mse(bare.value_for(0, 2)));
}

}  // namespace

#include "kvq/policy/policy.hpp"

namespace {

TEST(PolicyTags, NuqAndOutliersMatchTheirSpecs) {
  using P = kvq::KVPolicy<kvq::OutliersPercent<kvq::Nuq<3, kvq::PerChannel, 32>, 1>,
                          kvq::Outliers<kvq::Int<3, kvq::PerToken, 32>, 2>, kvq::Residual<32>>;
  EXPECT_EQ(P::policy(),
            kvq::parse_policy("k=nuq3/channel/g32/out1%,v=int3/token/g32/out2,residual=32"));
  using Q = kvq::KVPolicy<kvq::Outliers<kvq::Fp8E4M3<>, 1>, kvq::Nuq<2>>;
  EXPECT_EQ(Q::policy(), kvq::parse_policy("k=e4m3/head/out1,v=nuq2/token/g32"));
  using H = kvq::KVPolicy<kvq::Int<4>, kvq::OutliersPercent<kvq::SInt<4>, 1, 2>>;
  EXPECT_FLOAT_EQ(H::policy().value.outlier_pct, 0.5f);
}

}  // namespace

namespace {

TEST(Calibrate, ApplyCalibrationChecksTheNormalization) {
  const auto data = synthetic_set(2, 64, false, 6);
  const kvq::Policy cal = kvq::calibrate(kvq::parse_policy("k=nuq3/channel/g32,v=nuq2"), data);
  const kvq::CalibrationFile f = kvq::parse_calibration(kvq::calibration_json(cal, 2), "mem");
  const kvq::Policy same = kvq::apply_calibration(kvq::parse_policy("k=nuq3/channel/g32,v=nuq2"), f, 2);
  EXPECT_EQ(same, cal);
  // Only the nuq parts take codebooks; the rest of the policy is the caller's.
  const kvq::Policy mixed =
      kvq::apply_calibration(kvq::parse_policy("k=nuq3/channel/g32,v=int4,residual=16"), f, 2);
  EXPECT_TRUE(mixed.key_for(1, 2).nuq_ready);
  EXPECT_EQ(mixed.key_for(1, 2).nuq_levels, cal.key_for(1, 2).nuq_levels);
  EXPECT_EQ(mixed.value_for(0, 2).format, kvq::Format::kInt);
  EXPECT_EQ(mixed.residual, 16);
  for (const char* other : {"k=nuq3/channel/g16,v=nuq2", "k=nuq4/channel/g32,v=nuq2",
                            "k=nuq3/channel/g32/out1,v=nuq2", "k=nuq3/channel/g32,v=nuq2/channel"}) {
    EXPECT_THROW(kvq::apply_calibration(kvq::parse_policy(other), f, 2), kvq::Error) << other;
  }
  EXPECT_THROW(kvq::apply_calibration(kvq::parse_policy("k=nuq3/channel/g32,v=nuq2"), f, 3),
               kvq::Error);
}

}  // namespace
