// Tests for kvq/eval/simulated_backend.hpp: every key/value scale group quantized as soon as it
// is complete, checked against quantize/dequantize of the same tokens, and against the
// reference axis table of stories260K (shared/docs/reference.md).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kvq/eval/simulated_backend.hpp"
#include "kvq/eval/llama2c.hpp"
#include "kvq/policy/spec.hpp"
#include "kvq/quant/quantize.hpp"
#include "stories_data.hpp"

namespace {

using kvq::KVView;
using kvq::Shape;

constexpr int kLayers = 2, kHeads = 2, kDim = 16, kMax = 200;

std::vector<float> random_rows(int tokens, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.f, 1.f);
  std::vector<float> x(static_cast<size_t>(tokens) * kHeads * kDim);
  for (float& v : x) v = n(rng);
  return x;
}

/// Appends `tokens` rows (same data for K and V) to every layer.
void feed(kvq::SimulatedBackend& be, const std::vector<float>& k, const std::vector<float>& v,
          int tokens) {
  const size_t row = static_cast<size_t>(kHeads) * kDim;
  for (int t = 0; t < tokens; ++t)
    for (int l = 0; l < kLayers; ++l)
      be.append(l, t, k.data() + t * row, k.data() + t * row, v.data() + t * row);
}

/// quantize -> dequantize of tokens [first, first + n) of x under cfg.
std::vector<float> roundtrip(const kvq::QuantConfig& cfg, const std::vector<float>& x, int first,
                             int n) {
  const Shape s{n, kHeads, kDim};
  const auto q = kvq::quantize(cfg, KVView<const float>(x.data() + first * kHeads * kDim, s));
  std::vector<float> out(static_cast<size_t>(s.numel()));
  kvq::dequantize(q, KVView<float>(out.data(), s));
  return out;
}

void expect_rows(const KVView<const float>& got, int first, const std::vector<float>& want,
                 const char* what) {
  const int n = static_cast<int>(want.size() / (kHeads * kDim));
  for (int t = 0; t < n; ++t)
    for (int h = 0; h < kHeads; ++h)
      for (int d = 0; d < kDim; ++d) {
        const float w = want[(static_cast<size_t>(t) * kHeads + h) * kDim + d];
        const float g = got.at(first + t, h, d);
        ASSERT_EQ(std::memcmp(&g, &w, 4), 0) << what << " token " << first + t << " head " << h
                                             << " dim " << d << ": " << g << " vs " << w;
      }
}

TEST(SimulatedBackend, KeysPerGroupValuesPerTokenTrailingGroupExact) {
  const kvq::Policy p = kvq::parse_policy("k=int2/channel/g32,v=int2/token/g8,residual=0");
  kvq::SimulatedBackend be(p, {kLayers, kHeads, kDim, kMax});
  const int n = 75;  // two complete key groups and 11 trailing tokens
  const auto k = random_rows(n, 1), v = random_rows(n, 2);
  feed(be, k, v, n);
  for (int l = 0; l < kLayers; ++l) {
    const auto keys = be.storage().keys(l);
    const auto vals = be.storage().values(l);
    ASSERT_EQ(keys.tokens(), n);
    expect_rows(keys, 0, roundtrip(p.key, k, 0, 32), "key group 0");
    expect_rows(keys, 32, roundtrip(p.key, k, 32, 32), "key group 1");
    expect_rows(keys, 64, std::vector<float>(k.begin() + 64 * kHeads * kDim, k.end()),
                "trailing keys (f32)");
    for (int t = 0; t < n; ++t) expect_rows(vals, t, roundtrip(p.value, v, t, 1), "value token");
  }
  // Bytes: the packed groups' real bytes plus f32 for the trailing keys.
  const std::size_t per_layer = 2 * kvq::quantize(p.key, KVView<const float>(k.data(), {32, kHeads, kDim})).bytes() +
                                11u * kHeads * kDim * 4u +
                                static_cast<std::size_t>(n) *
                                    kvq::quantize(p.value, KVView<const float>(v.data(), {1, kHeads, kDim})).bytes();
  EXPECT_EQ(be.bytes(), kLayers * per_layer);
  EXPECT_EQ(be.elements(), static_cast<std::size_t>(2 * kLayers * n * kHeads * kDim));
}

TEST(SimulatedBackend, ResidualAndSinksFollowTheCacheRule) {
  // sinks=4: tokens 0..3 stay f32; residual=8: the group [s, s + 16) is quantized once the layer
  // holds s + 16 + 8 tokens.
  const kvq::Policy p = kvq::parse_policy("k=int4/channel/g16,v=int4/token/g8,residual=8,sinks=4");
  kvq::SimulatedBackend be(p, {kLayers, kHeads, kDim, kMax});
  const int n = 4 + 16 + 8 + 7;  // one key group quantized, the next not yet
  const auto k = random_rows(n, 3), v = random_rows(n, 4);
  feed(be, k, v, n);
  const auto keys = be.storage().keys(1);
  const auto vals = be.storage().values(1);
  const size_t row = static_cast<size_t>(kHeads) * kDim;
  expect_rows(keys, 0, std::vector<float>(k.begin(), k.begin() + 4 * row), "sink keys");
  expect_rows(vals, 0, std::vector<float>(v.begin(), v.begin() + 4 * row), "sink values");
  expect_rows(keys, 4, roundtrip(p.key, k, 4, 16), "key group");
  expect_rows(keys, 20, std::vector<float>(k.begin() + 20 * row, k.end()), "residual keys");
  // values: one token per group, quantized once it is 8 tokens old: tokens 4 .. n - 9
  for (int t = 4; t <= n - 9; ++t) expect_rows(vals, t, roundtrip(p.value, v, t, 1), "value");
  expect_rows(vals, n - 8, std::vector<float>(v.begin() + (n - 8) * row, v.end()),
              "residual values");
}

TEST(SimulatedBackend, SkippedLayersStayExactAndResetClears) {
  const kvq::Policy p = kvq::parse_policy("kivi2,residual=0,skip=1:0");
  kvq::SimulatedBackend be(p, {kLayers, kHeads, kDim, kMax});
  const auto k = random_rows(40, 5), v = random_rows(40, 6);
  feed(be, k, v, 40);
  expect_rows(be.storage().keys(0), 0, k, "skipped layer keys");
  expect_rows(be.storage().values(0), 0, v, "skipped layer values");
  be.reset();
  EXPECT_EQ(be.storage().tokens(0), 0);
  EXPECT_EQ(be.bytes(), 0u);
  feed(be, k, v, 40);  // appends from position 0 again
  expect_rows(be.storage().keys(1), 0, roundtrip(p.key, k, 0, 32), "key group after reset");
}

TEST(SimulatedBackend, PreRopeKeysAreQuantizedThenRotated) {
  // Appended pre-RoPE keys kp, post-RoPE keys k = RoPE(kp); a complete key group must hold
  // RoPE(dequantize(quantize(kp))) at its positions, and the trailing group the model's k.
  const kvq::Policy p = kvq::parse_policy("k=int2/channel/g32,v=int4/token/g16,residual=0");
  kvq::SimulatedOptions o;
  o.prerope_keys = true;
  kvq::SimulatedBackend be(p, {1, kHeads, kDim, kMax}, o);
  const int n = 40;
  const auto kp = random_rows(n, 7), v = random_rows(n, 8);
  auto rope = [](std::vector<float> x, int first) {  // llama2.c RoPE, theta 10000
    for (size_t t = 0; t < x.size() / (kHeads * kDim); ++t)
      for (int h = 0; h < kHeads; ++h)
        for (int i = 0; i < kDim / 2; ++i) {
          const double a = static_cast<double>(first + static_cast<int>(t)) *
                           std::pow(10000.0, -static_cast<double>(2 * i) / kDim);
          const float c = static_cast<float>(std::cos(a)), sn = static_cast<float>(std::sin(a));
          float* r = x.data() + (t * kHeads + h) * kDim;
          const float x0 = r[2 * i], x1 = r[2 * i + 1];
          r[2 * i] = x0 * c - x1 * sn;
          r[2 * i + 1] = x0 * sn + x1 * c;
        }
    return x;
  };
  const auto k = rope(kp, 0);
  const size_t row = static_cast<size_t>(kHeads) * kDim;
  for (int t = 0; t < n; ++t)
    be.append(0, t, kp.data() + t * row, k.data() + t * row, v.data() + t * row);
  const auto keys = be.storage().keys(0);
  const auto want = rope(roundtrip(p.key, kp, 0, 32), 0);
  for (int t = 0; t < 32; ++t)
    for (int h = 0; h < kHeads; ++h)
      for (int d = 0; d < kDim; ++d)
        ASSERT_NEAR(keys.at(t, h, d), want[(static_cast<size_t>(t) * kHeads + h) * kDim + d], 1e-5f)
            << t << " " << h << " " << d;
  expect_rows(keys, 32, std::vector<float>(k.begin() + 32 * row, k.end()), "trailing keys");
  kvq::SimulatedOptions odd;
  odd.prerope_keys = true;
  EXPECT_THROW(kvq::SimulatedBackend(p, {1, 1, 7, 8}, odd), kvq::Error);
}

TEST(SimulatedBackend, BadInputIsRejected) {
  EXPECT_THROW(kvq::SimulatedBackend(kvq::parse_policy("kivi2"), {0, kHeads, kDim, kMax}),
               kvq::Error);
  kvq::SimulatedBackend be(kvq::parse_policy("kivi2"), {kLayers, kHeads, kDim, 4});
  std::vector<float> row(static_cast<size_t>(kHeads) * kDim, 1.f);
  EXPECT_THROW(be.append(2, 0, row.data(), row.data(), row.data()), kvq::Error);  // no layer 2
  EXPECT_THROW(be.append(0, 1, row.data(), row.data(), row.data()), kvq::Error);  // skips pos 0
  for (int t = 0; t < 4; ++t) be.append(0, t, row.data(), row.data(), row.data());
  EXPECT_THROW(be.append(0, 4, row.data(), row.data(), row.data()), kvq::Error);  // full
  row[3] = NAN;
  kvq::SimulatedBackend be2(kvq::parse_policy("k=int4/token/g8,v=int4/token/g8"), {1, kHeads, kDim, 8});
  EXPECT_THROW(be2.append(0, 0, row.data(), row.data(), row.data()), kvq::Error);  // NaN named
}

// The axis table of shared/docs/reference.md (stories260K, tinystories-dev.txt, 4258 tokens,
// fp32 metadata, keys over 32 tokens per channel with the incomplete trailing group in fp32,
// values over the 8 channels of a head per token) comes out of the simulated backend.
TEST(SimulatedBackend, ReproducesTheReferenceAxisTable) {
  KVQ_REQUIRE_STORIES();
  kvq::eval::Llama2cModel model(kvq_test::model_path());
  const kvq::eval::Tokenizer tok(kvq_test::tokenizer_path(), model.config().vocab_size);
  const auto lines = kvq::eval::read_text_lines(kvq_test::text_path());
  auto ppl = [&](const std::string& spec) {
    kvq::SimulatedBackend be(kvq::parse_policy(spec), model.kv_geometry());
    const auto r = kvq::eval::evaluate_text(model, tok, be, lines, {});
    EXPECT_EQ(r.test.tokens, 4258);
    return r.test.perplexity();
  };
  // The README promises every cell within 0.06% of the reference notes; that is the bound here,
  // for all five cells, in every build (release, scalar and sanitizer builds alike).
  constexpr double kRelTol = 6e-4;
  struct Cell {
    const char* spec;
    double reference;
  };
  const Cell cells[] = {
      {"f32", 5.3930},
      {"k=int4/channel/g32/f32meta,v=int4/token/g8/f32meta,residual=0", 5.3917},
      {"k=int4/token/g8/f32meta,v=int4/channel/g32/f32meta,residual=0", 7.7058},
      {"k=int2/channel/g32/f32meta,v=int2/token/g8/f32meta,residual=0", 7.1751},
      {"k=int2/token/g8/f32meta,v=int2/channel/g32/f32meta,residual=0", 67.84},
  };
  for (const Cell& c : cells) {
    const double p = ppl(c.spec);
    EXPECT_NEAR(p, c.reference, kRelTol * c.reference) << c.spec;
    RecordProperty(c.spec, std::to_string(p));
  }
}

// KVQuant's point on the real model: per-channel key groups formed before RoPE lose far less
// than after it (RoPE rotates channel pairs by position, mixing an outlier channel with its
// partner differently in every token of a group); per-token keys gain nothing from it.
TEST(SimulatedBackend, PreRopeKeyQuantizationHelpsPerChannelKeys) {
  KVQ_REQUIRE_STORIES();
  kvq::eval::Llama2cModel model(kvq_test::model_path());
  const kvq::eval::Tokenizer tok(kvq_test::tokenizer_path(), model.config().vocab_size);
  auto lines = kvq::eval::read_text_lines(kvq_test::text_path());
  kvq::eval::EvalOptions opt;
  opt.max_sequences = KVQ_TEST_SANITIZED ? 2 : 0;
  auto ppl = [&](const std::string& spec, bool prerope) {
    kvq::SimulatedOptions o;
    o.prerope_keys = prerope;
    kvq::SimulatedBackend be(kvq::parse_policy(spec), model.kv_geometry(), o);
    return kvq::eval::evaluate_text(model, tok, be, lines, opt).test.perplexity();
  };
  const double f32 = ppl("f32", false);
  EXPECT_NEAR(ppl("f32", true), f32, 1e-4 * f32);  // RoPE recomputed as the model does
  const std::string ch = "k=int2/channel/g32,v=int2/token/g8,residual=0";
  const double post = ppl(ch, false), pre = ppl(ch, true);
  RecordProperty("int2_channel_postrope", std::to_string(post));
  RecordProperty("int2_channel_prerope", std::to_string(pre));
  EXPECT_LT(pre - f32, 0.5 * (post - f32)) << "pre-RoPE " << pre << " post-RoPE " << post;
}

}  // namespace
