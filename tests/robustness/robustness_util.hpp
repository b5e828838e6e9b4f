#pragma once
// Shared pieces of the robustness property tests: the configurations and policies swept, and
// the hostile-but-finite input classes (issue 13, item 4). Public API only (quantize /
// dequantize, KVCache, attend), so internal rewrites of quant/, cache/ and attention/ do not
// touch these tests.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kvq/core/tensor.hpp"
#include "kvq/policy/spec.hpp"
#include "kvq/quant/qtensor.hpp"

namespace kvq_robust {

/// Every quantizer term the spec grammar offers, on every axis it allows, with both metadata
/// types: the configurations each input class is pushed through.
inline std::vector<std::string> all_terms() {
  std::vector<std::string> t = {"f32", "f16", "bf16"};
  for (const char* f : {"int2", "int3", "int4", "int8", "sint2", "sint3", "sint4", "sint8"})
    for (const char* a : {"token/g16", "channel/g8", "head/g4", "tensor/g8", "token/g64"})
      for (const char* m : {"", "/f32meta"}) t.push_back(std::string(f) + "/" + a + m);
  for (const char* f : {"e4m3", "e5m2"})
    for (const char* a : {"token", "head", "tensor", "token/g16", "head/g8"})
      for (const char* m : {"", "/f32meta"}) t.push_back(std::string(f) + "/" + a + m);
  for (const char* f : {"lm1", "lm2", "lm3", "lm4", "lm2/qjl", "lm4/qjl"})
    for (const char* m : {"", "/f32meta"}) t.push_back(std::string(f) + m);
  for (const char* f : {"nuq2", "nuq3", "nuq4"})
    for (const char* a : {"token/g16", "channel/g8", "head/g4", "tensor/g8"})
      for (const char* m : {"", "/f32meta"}) t.push_back(std::string(f) + "/" + a + m);
  // Dense-and-sparse outliers (exact fp16 entries per vector) on every format that takes them.
  for (const char* f :
       {"int4/token/g16/out2", "sint2/channel/g8/out3", "int8/head/g4/out5%", "e4m3/token/out1",
        "e5m2/head/g8/out2/f32meta", "nuq3/token/g16/out2", "nuq2/channel/g8/out10%/f32meta"})
    t.push_back(f);
  return t;
}

/// A config as it is used: nuq configs get a calibrated codebook (ascending levels spanning
/// the normalized range; what kvq::calibrate would attach).
inline kvq::QuantConfig usable(kvq::QuantConfig c) {
  if (c.format == kvq::Format::kNuq && !c.nuq_ready) {
    c.nuq_ready = true;
    const int n = 1 << c.bits;
    for (int i = 0; i < n; ++i)
      c.nuq_levels[static_cast<std::size_t>(i)] = -1.f + 2.f * static_cast<float>(i) / (n - 1);
  }
  return c;
}
inline kvq::QuantConfig usable_term(const std::string& term) {
  return usable(kvq::parse_quant_config(term));
}
inline kvq::Policy usable_policy(const std::string& spec) {
  kvq::Policy p = kvq::parse_policy(spec);
  p.key = usable(p.key);
  p.value = usable(p.value);
  p.skip_config = usable(p.skip_config);
  for (auto& kv : p.overrides) {
    kv.second.first = usable(kv.second.first);
    kv.second.second = usable(kv.second.second);
  }
  return p;
}

/// Every preset plus policies that reach the options presets leave out (sinks, residual 0,
/// skipped layers, overrides, f32 metadata, e5m2, symmetric ints, QJL keys).
inline std::vector<std::string> all_policies() {
  std::vector<std::string> p;
  for (const kvq::Preset& pr : kvq::policy_presets()) p.push_back(pr.name);
  p.push_back("kivi2,residual=0,sinks=4");
  p.push_back("k=lm3/qjl,v=lm4,residual=0");
  p.push_back("k=e5m2/token/f32meta,v=int8/channel/g16/f32meta,residual=0");
  p.push_back("k=sint4/tensor/g16,v=int3/head/g16,residual=0,skip=1,skipas=fp8");
  p.push_back("k=lm2/f32meta,v=lm3/f32meta,residual=0,k@1=int4/channel/g16");
  p.push_back("k=bf16,v=sint2/token/g64,residual=0");
  p.push_back("k=nuq3/channel/g16/out2,v=nuq2/token/g16,residual=0");
  p.push_back("k=int4/channel/g16/out5%,v=e4m3/token/out1,residual=16,sinks=2");
  return p;
}

/// One class of finite input: name and generator (shape -> row-major [tokens, heads, dim]).
struct InputClass {
  std::string name;
  std::function<std::vector<float>(const kvq::Shape&, uint32_t)> make;
};

inline std::vector<float> normal(const kvq::Shape& s, uint32_t seed, float sigma = 1.f) {
  std::vector<float> v(static_cast<size_t>(s.numel()));
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, sigma);
  for (auto& x : v) x = nd(rng);
  return v;
}

/// The input classes of item 4. Values stay within +-65504 (what every format and metadata
/// type holds; the cache refuses beyond) unless the class is about exceeding it ("huge").
inline std::vector<InputClass> input_classes() {
  std::vector<InputClass> c;
  c.push_back(
      {"random normal", [](const kvq::Shape& s, uint32_t seed) { return normal(s, seed); }});
  c.push_back({"dynamic range 1e-30..6e4 (log-uniform magnitudes, random signs)",
               [](const kvq::Shape& s, uint32_t seed) {
                 std::vector<float> v(static_cast<size_t>(s.numel()));
                 std::mt19937 rng(seed);
                 std::uniform_real_distribution<float> e(-30.f, 4.78f);
                 for (auto& x : v) x = std::pow(10.f, e(rng)) * (rng() & 1 ? 1.f : -1.f);
                 return v;
               }});
  c.push_back({"f32 denormals", [](const kvq::Shape& s, uint32_t seed) {
                 auto v = normal(s, seed);
                 for (auto& x : v) x *= 1e-39f;  // below FLT_MIN = 1.18e-38
                 return v;
               }});
  c.push_back({"fp16 subnormal scale (1e-6)", [](const kvq::Shape& s, uint32_t seed) {
                 auto v = normal(s, seed);
                 for (auto& x : v) x *= 1e-6f;
                 return v;
               }});
  c.push_back({"smallest f32 denormal, alternating sign", [](const kvq::Shape& s, uint32_t) {
                 std::vector<float> v(static_cast<size_t>(s.numel()));
                 const float d = std::numeric_limits<float>::denorm_min();
                 for (size_t i = 0; i < v.size(); ++i) v[i] = i % 2 ? d : -d;
                 return v;
               }});
  c.push_back({"all zero", [](const kvq::Shape& s, uint32_t) {
                 return std::vector<float>(static_cast<size_t>(s.numel()), 0.f);
               }});
  c.push_back({"all equal (3.25)", [](const kvq::Shape& s, uint32_t) {
                 return std::vector<float>(static_cast<size_t>(s.numel()), 3.25f);
               }});
  c.push_back({"all equal (-65504)", [](const kvq::Shape& s, uint32_t) {
                 return std::vector<float>(static_cast<size_t>(s.numel()), -65504.f);
               }});
  c.push_back({"+-65504 alternating", [](const kvq::Shape& s, uint32_t) {
                 std::vector<float> v(static_cast<size_t>(s.numel()));
                 for (size_t i = 0; i < v.size(); ++i) v[i] = i % 2 ? 65504.f : -65504.f;
                 return v;
               }});
  c.push_back({"one +-60000 outlier per 8 values", [](const kvq::Shape& s, uint32_t seed) {
                 auto v = normal(s, seed);
                 std::mt19937 rng(seed + 1);
                 for (size_t i = 0; i < v.size(); i += 8)
                   v[i + rng() % 8] = rng() & 1 ? 6e4f : -6e4f;
                 return v;
               }});
  c.push_back({"zero vectors between normal ones", [](const kvq::Shape& s, uint32_t seed) {
                 auto v = normal(s, seed);
                 const auto D = static_cast<size_t>(s.head_dim);
                 for (size_t r = 0; r * D < v.size(); r += 2)
                   for (size_t d = 0; d < D; ++d) v[r * D + d] = 0.f;
                 return v;
               }});
  c.push_back({"one nonzero coordinate per vector", [](const kvq::Shape& s, uint32_t seed) {
                 std::vector<float> v(static_cast<size_t>(s.numel()), 0.f);
                 const auto D = static_cast<size_t>(s.head_dim);
                 for (size_t r = 0; r * D < v.size(); ++r) v[r * D + (r * 7 + seed) % D] = 1e4f;
                 return v;
               }});
  c.push_back({"huge: 1e30 magnitudes (beyond fp16)", [](const kvq::Shape& s, uint32_t seed) {
                 auto v = normal(s, seed);
                 for (auto& x : v) x *= 1e30f;
                 return v;
               }});
  c.push_back({"huge: +-FLT_MAX", [](const kvq::Shape& s, uint32_t) {
                 std::vector<float> v(static_cast<size_t>(s.numel()));
                 const float m = std::numeric_limits<float>::max();
                 for (size_t i = 0; i < v.size(); ++i) v[i] = i % 3 ? m : -m;
                 return v;
               }});
  return c;
}

inline bool all_finite(const std::vector<float>& v) {
  for (float x : v)
    if (!std::isfinite(x)) return false;
  return true;
}

inline float max_abs(const std::vector<float>& v) {
  float m = 0.f;
  for (float x : v) m = std::max(m, std::fabs(x));
  return m;
}

/// Largest L2 norm of a [*, head_dim] row.
inline double max_row_norm(const std::vector<float>& v, int64_t head_dim) {
  double m = 0;
  const auto D = static_cast<size_t>(head_dim);
  for (size_t r = 0; r * D < v.size(); ++r) {
    double s = 0;
    for (size_t d = 0; d < D; ++d) s += double(v[r * D + d]) * v[r * D + d];
    m = std::max(m, std::sqrt(s));
  }
  return m;
}

/// True when kvq documents that `c` stores `x`: within +-65504 for f16 values and fp16
/// metadata, and (Lloyd-Max with fp16 norms) no row norm above 65504. Such input must be
/// accepted; anything else may be refused with kvq::Error, never turned into NaN/Inf.
inline bool documented_holdable(const kvq::QuantConfig& c, const std::vector<float>& x,
                                int64_t head_dim) {
  const bool f16_range =
      c.format == kvq::Format::kF16 || (!c.is_raw() && c.meta == kvq::MetaDType::kF16);
  if (f16_range && max_abs(x) > 65504.f) return false;
  // nuq stores scale = max - min of a group (quant/nuq_quant.hpp): with fp16 metadata a group
  // whose values span more than 65504 cannot be stored even when every value fits fp16.
  if (c.format == kvq::Format::kNuq && c.meta == kvq::MetaDType::kF16) {
    const auto mm = std::minmax_element(x.begin(), x.end());
    if (!x.empty() && double(*mm.second) - double(*mm.first) > 65504.0) return false;
  }
  if (c.format == kvq::Format::kLloydMax && c.meta == kvq::MetaDType::kF16 &&
      max_row_norm(x, head_dim) > 65504.0)
    return false;
  // bf16 rounds values near FLT_MAX up to infinity (round to nearest even); f32 metadata of a
  // scale computed from an FLT_MAX-wide range overflows. Neither is documented as holdable.
  if (max_abs(x) > 1e30f) return false;
  return true;
}

}  // namespace kvq_robust
