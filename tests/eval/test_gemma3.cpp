// Gemma 3 in the GGUF runner (eval/llama_gguf.hpp, arch "gemma3").
//  - Tiny random gemma3 models built in memory against a plain double-precision forward written
//    here from the definitions (embedding scale, QK-norm, NEOX RoPE with a base per layer kind,
//    query scale, sliding-window mask, post-attention / post-FFN norms, GELU(tanh) gate, tied
//    output), through Fp32Backend and through the streaming cache (token by token and chunked,
//    windowed by the fused kernel); metadata (window pattern as an array or a period, defaults)
//    and refusals by name.
//  - Gemma 3 270M (`./kvq.sh model gemma3`) against tests/eval/gemma3_reference.py (a numpy
//    forward of the same file, no kvq code): dequantized tensors of every type in the file,
//    logits of a short prompt, the last logits of a 600-token sequence (the sliding window cuts
//    the local layers there; without it the logits move by up to 10), and the perplexity of the
//    first two dev lines.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "gemma3_data.hpp"
#include "io/gguf_test_util.hpp"
#include "kvq/eval/cache_backend.hpp"
#include "kvq/eval/gguf_tokenizer.hpp"
#include "kvq/eval/llama_gguf.hpp"
#include "kvq/policy/spec.hpp"

namespace {

using kvq::eval::LlamaGgufModel;
using kvq_test::GgufBuilder;

// ---------------------------------------------------------------------------------------------
// Tiny models
// ---------------------------------------------------------------------------------------------

struct Tiny {
  int layers = 3, dim = 16, heads = 4, kv_heads = 1, head_dim = 8, hidden = 24, vocab = 13;
  int window = 3;
  double theta = 1000.0, theta_swa = 50.0;
  int pattern_period = 3;            // every 3rd layer global (layer 2)
  std::vector<int> pattern_array;    // when set, written as the per-layer array instead
  double query_pre_attn_scalar = 0;  // 0: key absent
  double softcap = 0;                // final_logit_softcapping when > 0
};

struct Weights {
  std::vector<float> emb, out_norm;
  struct L {
    std::vector<float> an, wq, wk, wv, wo, qn, kn, pan, fn, wg, wu, wd, pfn;
  };
  std::vector<L> layers;
};

std::vector<float> rnd(std::mt19937& g, size_t n, float scale, float offset = 0.0f) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = offset + d(g);
  return v;
}

std::vector<uint8_t> build(const Tiny& c, Weights* w, uint32_t seed = 7) {
  std::mt19937 g(seed);
  const auto D = static_cast<uint64_t>(c.dim), V = static_cast<uint64_t>(c.vocab),
             H = static_cast<uint64_t>(c.hidden), Q = static_cast<uint64_t>(c.heads * c.head_dim),
             KV = static_cast<uint64_t>(c.kv_heads * c.head_dim), HD = static_cast<uint64_t>(c.head_dim);
  GgufBuilder b;
  b.str("general.architecture", "gemma3");
  const std::string a = "gemma3.";
  b.u32(a + "block_count", static_cast<uint32_t>(c.layers));
  b.u32(a + "embedding_length", static_cast<uint32_t>(c.dim));
  b.u32(a + "feed_forward_length", static_cast<uint32_t>(c.hidden));
  b.u32(a + "attention.head_count", static_cast<uint32_t>(c.heads));
  b.u32(a + "attention.head_count_kv", static_cast<uint32_t>(c.kv_heads));
  b.u32(a + "attention.key_length", static_cast<uint32_t>(c.head_dim));
  b.u32(a + "attention.value_length", static_cast<uint32_t>(c.head_dim));
  b.u32(a + "context_length", 64);
  b.f32(a + "rope.freq_base", static_cast<float>(c.theta));
  b.f32(a + "rope.freq_base_swa", static_cast<float>(c.theta_swa));
  b.f32(a + "attention.layer_norm_rms_epsilon", 1e-6f);
  b.u32(a + "attention.sliding_window", static_cast<uint32_t>(c.window));
  if (!c.pattern_array.empty()) {
    b.i32s(a + "attention.sliding_window_pattern",
           std::vector<int32_t>(c.pattern_array.begin(), c.pattern_array.end()));
  } else {
    b.u32(a + "attention.sliding_window_pattern", static_cast<uint32_t>(c.pattern_period));
  }
  if (c.query_pre_attn_scalar > 0)
    b.f32(a + "attention.query_pre_attn_scalar", static_cast<float>(c.query_pre_attn_scalar));
  if (c.softcap > 0) b.f32(a + "final_logit_softcapping", static_cast<float>(c.softcap));
  w->emb = rnd(g, V * D, 0.3f);
  b.tensor_f32("token_embd.weight", {D, V}, w->emb);
  w->out_norm = rnd(g, D, 0.1f, 1.0f);
  b.tensor_f32("output_norm.weight", {D}, w->out_norm);
  for (int l = 0; l < c.layers; ++l) {
    Weights::L L;
    const std::string p = "blk." + std::to_string(l) + ".";
    const float s = 1.0f / std::sqrt(static_cast<float>(c.dim));
    L.an = rnd(g, D, 0.1f, 1.0f);
    L.wq = rnd(g, Q * D, s);
    L.wk = rnd(g, KV * D, s);
    L.wv = rnd(g, KV * D, s);
    L.wo = rnd(g, D * Q, 1.0f / std::sqrt(static_cast<float>(Q)));
    L.qn = rnd(g, HD, 0.2f, 1.0f);
    L.kn = rnd(g, HD, 0.2f, 1.0f);
    L.pan = rnd(g, D, 0.1f, 0.5f);
    L.fn = rnd(g, D, 0.1f, 1.0f);
    L.wg = rnd(g, H * D, s);
    L.wu = rnd(g, H * D, s);
    L.wd = rnd(g, D * H, 1.0f / std::sqrt(static_cast<float>(c.hidden)));
    L.pfn = rnd(g, D, 0.1f, 0.5f);
    b.tensor_f32(p + "attn_norm.weight", {D}, L.an);
    b.tensor_f32(p + "attn_q.weight", {D, Q}, L.wq);
    b.tensor_f32(p + "attn_k.weight", {D, KV}, L.wk);
    b.tensor_f32(p + "attn_v.weight", {D, KV}, L.wv);
    b.tensor_f32(p + "attn_output.weight", {Q, D}, L.wo);
    b.tensor_f32(p + "attn_q_norm.weight", {HD}, L.qn);
    b.tensor_f32(p + "attn_k_norm.weight", {HD}, L.kn);
    b.tensor_f32(p + "post_attention_norm.weight", {D}, L.pan);
    b.tensor_f32(p + "ffn_norm.weight", {D}, L.fn);
    b.tensor_f32(p + "ffn_gate.weight", {D, H}, L.wg);
    b.tensor_f32(p + "ffn_up.weight", {D, H}, L.wu);
    b.tensor_f32(p + "ffn_down.weight", {H, D}, L.wd);
    b.tensor_f32(p + "post_ffw_norm.weight", {D}, L.pfn);
    w->layers.push_back(std::move(L));
  }
  return b.build();
}

/// The reference forward, from the definitions, in double. sliding[l]: layer l is local.
std::vector<double> reference_logits(const Tiny& c, const Weights& w, const std::vector<int>& ids,
                                     const std::vector<bool>& sliding) {
  const int n = static_cast<int>(ids.size()), d = c.dim, hd = c.head_dim;
  const int qd = c.heads * hd, kvd = c.kv_heads * hd, group = c.heads / c.kv_heads;
  using Vec = std::vector<double>;
  auto matvec = [](const std::vector<float>& W, const Vec& x, int out) {
    Vec y(static_cast<size_t>(out), 0.0);
    const size_t in = x.size();
    for (int o = 0; o < out; ++o)
      for (size_t i = 0; i < in; ++i) y[static_cast<size_t>(o)] += W[o * in + i] * x[i];
    return y;
  };
  auto rms = [](const double* x, int m, const std::vector<float>& g, double* y) {
    double ss = 0;
    for (int i = 0; i < m; ++i) ss += x[i] * x[i];
    const double s = 1.0 / std::sqrt(ss / m + 1e-6);
    for (int i = 0; i < m; ++i) y[i] = x[i] * s * g[static_cast<size_t>(i)];
  };
  auto rmsv = [&](const Vec& x, const std::vector<float>& g) {
    Vec y(x.size());
    rms(x.data(), static_cast<int>(x.size()), g, y.data());
    return y;
  };
  auto rope = [&](Vec& v, int heads, int pos, double theta) {  // NEOX: (i, i + hd/2)
    for (int h = 0; h < heads; ++h)
      for (int i = 0; i < hd / 2; ++i) {
        const double ang = pos * std::pow(theta, -2.0 * i / hd);
        const double a = v[h * hd + i], b = v[h * hd + i + hd / 2];
        v[h * hd + i] = a * std::cos(ang) - b * std::sin(ang);
        v[h * hd + i + hd / 2] = a * std::sin(ang) + b * std::cos(ang);
      }
  };
  const double qscale =
      1.0 / std::sqrt(c.query_pre_attn_scalar > 0 ? c.query_pre_attn_scalar : double(hd));
  std::vector<Vec> x(static_cast<size_t>(n));
  for (int t = 0; t < n; ++t) {
    x[t].assign(w.emb.begin() + ids[t] * d, w.emb.begin() + (ids[t] + 1) * d);
    for (double& e : x[t]) e *= std::sqrt(static_cast<double>(d));
  }
  for (size_t l = 0; l < w.layers.size(); ++l) {
    const auto& L = w.layers[l];
    const double theta = sliding[l] ? c.theta_swa : c.theta;
    std::vector<Vec> q(n), k(n), v(n);
    for (int t = 0; t < n; ++t) {
      const auto xn = rmsv(x[t], L.an);
      q[t] = matvec(L.wq, xn, qd);
      k[t] = matvec(L.wk, xn, kvd);
      v[t] = matvec(L.wv, xn, kvd);
      for (int h = 0; h < c.heads; ++h) rms(&q[t][h * hd], hd, L.qn, &q[t][h * hd]);
      for (int h = 0; h < c.kv_heads; ++h) rms(&k[t][h * hd], hd, L.kn, &k[t][h * hd]);
      rope(q[t], c.heads, t, theta);
      rope(k[t], c.kv_heads, t, theta);
    }
    for (int t = 0; t < n; ++t) {
      Vec att(static_cast<size_t>(qd), 0.0);
      const int first = sliding[l] ? std::max(0, t - c.window + 1) : 0;
      for (int h = 0; h < c.heads; ++h) {
        const int kh = h / group;
        Vec s(static_cast<size_t>(t + 1), 0.0);
        double mx = -1e300;
        for (int u = first; u <= t; ++u) {
          double dot = 0;
          for (int j = 0; j < hd; ++j) dot += q[t][h * hd + j] * k[u][kh * hd + j];
          s[u] = dot * qscale;
          mx = std::max(mx, s[u]);
        }
        double sum = 0;
        for (int u = first; u <= t; ++u) sum += (s[u] = std::exp(s[u] - mx));
        for (int u = first; u <= t; ++u)
          for (int j = 0; j < hd; ++j) att[h * hd + j] += s[u] / sum * v[u][kh * hd + j];
      }
      const auto o = rmsv(matvec(L.wo, att, d), L.pan);
      for (int i = 0; i < d; ++i) x[t][i] += o[i];
      const auto xn = rmsv(x[t], L.fn);
      auto gt = matvec(L.wg, xn, c.hidden);
      const auto up = matvec(L.wu, xn, c.hidden);
      for (int i = 0; i < c.hidden; ++i) {
        const double a = gt[i];
        gt[i] = 0.5 * a * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (a + 0.044715 * a * a * a))) * up[i];
      }
      const auto dn = rmsv(matvec(L.wd, gt, d), L.pfn);
      for (int i = 0; i < d; ++i) x[t][i] += dn[i];
    }
  }
  std::vector<double> logits;
  for (int t = 0; t < n; ++t) {
    const auto l = matvec(w.emb, rmsv(x[t], w.out_norm), c.vocab);  // tied
    logits.insert(logits.end(), l.begin(), l.end());
  }
  return logits;
}

LlamaGgufModel load(const std::vector<uint8_t>& bytes) {
  return LlamaGgufModel(kvq::io::GgufFile::parse(bytes.data(), bytes.size(), "tiny"), 64);
}

double max_rel_err(const std::vector<float>& got, const std::vector<double>& want) {
  double err = 0, ref = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    err = std::max(err, std::abs(got[i] - want[i]));
    ref = std::max(ref, std::abs(want[i]));
  }
  return err / ref;
}

const std::vector<int> kIds = {3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 12, 0};

TEST(Gemma3Tiny, ConfigFromMetadata) {
  Tiny c;
  Weights w;
  auto m = load(build(c, &w));
  const auto& cfg = m.config();
  EXPECT_EQ(cfg.arch, "gemma3");
  EXPECT_TRUE(cfg.qk_norm && cfg.post_norms && cfg.gelu && cfg.tied_output);
  EXPECT_FLOAT_EQ(cfg.embed_scale, 4.0f);
  EXPECT_EQ(cfg.head_dim, 8);
  EXPECT_EQ(cfg.rope_style, kvq::RopeStyle::kHalf);
  EXPECT_EQ(cfg.sliding_window, 3);
  EXPECT_EQ(cfg.window(0), 3);
  EXPECT_EQ(cfg.window(1), 3);
  EXPECT_EQ(cfg.window(2), 0);  // every 3rd layer global
  EXPECT_EQ(m.rope(0).theta, 50.0);
  EXPECT_EQ(m.rope(2).theta, 1000.0);
  EXPECT_FLOAT_EQ(cfg.q_scale, 1.0f);
  c.pattern_array = {0, 1, 0};  // the per-layer array form: only layer 1 local
  c.query_pre_attn_scalar = 32;
  auto m2 = load(build(c, &w));
  EXPECT_EQ(m2.config().window(0), 0);
  EXPECT_EQ(m2.config().window(1), 3);
  EXPECT_EQ(m2.config().window(2), 0);
  EXPECT_FLOAT_EQ(m2.config().q_scale, 0.5f);  // sqrt(8 / 32)
}

void expect_matches(const Tiny& c) {
  Weights w;
  const auto bytes = build(c, &w);
  auto m = load(bytes);
  std::vector<bool> sliding;
  for (int l = 0; l < c.layers; ++l) sliding.push_back(m.config().sliding(l));
  const auto want = reference_logits(c, w, kIds, sliding);
  // Fp32Backend, one call and two chunks.
  kvq::eval::Fp32Backend f32(m.kv_geometry());
  f32.reset();
  EXPECT_LT(max_rel_err(m.forward(kIds, 0, f32), want), 2e-5);
  f32.reset();
  const std::vector<int> a(kIds.begin(), kIds.begin() + 9), b(kIds.begin() + 9, kIds.end());
  auto la = m.forward(a, 0, f32);
  const auto lb = m.forward(b, 9, f32);
  la.insert(la.end(), lb.begin(), lb.end());
  EXPECT_LT(max_rel_err(la, want), 2e-5);
  // The streaming cache (f32 policy): token by token, chunked (batched causal attention with
  // the kernel's window), and with keys stored before RoPE (a rope base per layer).
  for (int mode = 0; mode < 3; ++mode) {
    kvq::CacheBackend cb(kvq::parse_policy("f32"), m.kv_geometry(), mode == 2, m.rope());
    cb.set_layer_ropes(m.layer_ropes());
    cb.set_chunked(mode == 1);
    cb.reset();
    EXPECT_LT(max_rel_err(m.forward(kIds, 0, cb), want), 2e-5) << "mode " << mode;
  }
}

TEST(Gemma3Tiny, MatchesReferenceForward) { expect_matches(Tiny{}); }

TEST(Gemma3Tiny, MatchesReferenceWithQueryScalarAndMha) {
  Tiny c;
  c.kv_heads = 2;
  c.heads = 2;
  c.head_dim = 16;
  c.query_pre_attn_scalar = 24;
  c.window = 5;
  c.pattern_array = {1, 0, 1};
  expect_matches(c);
}

TEST(Gemma3Tiny, WindowChangesTheResult) {
  // The same weights with a window longer than the sequence: the late logits differ, so the
  // tests above do exercise the mask.
  Tiny c;
  Weights w;
  auto m = load(build(c, &w));
  Tiny wide = c;
  wide.window = 64;
  Weights w2;
  auto m2 = load(build(wide, &w2));
  kvq::eval::Fp32Backend f1(m.kv_geometry()), f2(m2.kv_geometry());
  f1.reset();
  f2.reset();
  const auto a = m.forward(kIds, 0, f1), b = m2.forward(kIds, 0, f2);
  double diff = 0;
  for (size_t i = a.size() - 13; i < a.size(); ++i) diff = std::max(diff, double(std::abs(a[i] - b[i])));
  EXPECT_GT(diff, 1e-3);
}

TEST(Gemma3Tiny, RefusesWhatIsNotImplemented) {
  Tiny c;
  c.softcap = 30.0;
  Weights w;
  const auto bytes = build(c, &w);
  try {
    load(bytes);
    FAIL() << "soft-capping was accepted";
  } catch (const kvq::Error& e) {
    EXPECT_NE(std::string(e.what()).find("final_logit_softcapping"), std::string::npos) << e.what();
  }
  c.softcap = 0;
  c.pattern_array = {1, 0};  // 2 entries for 3 layers
  const auto bytes2 = build(c, &w);
  EXPECT_THROW(load(bytes2), kvq::Error);
}

TEST(KVBackendWindow, DefaultRefusesPositionsTheWindowCuts) {
  struct Plain final : kvq::eval::KVBackend {
    void reset() override {}
    void append(int, int, const float*, const float*, const float*) override {}
    void attend(int, int, const float*, int, float*) override { ++calls; }
    int calls = 0;
  } p;
  float q = 0, o = 0;
  p.attend_window(0, 3, &q, 1, &o, 4);  // position 3 < window 4: plain attention
  EXPECT_EQ(p.calls, 1);
  EXPECT_THROW(p.attend_window(0, 4, &q, 1, &o, 4), kvq::Error);
  EXPECT_FALSE(p.chunked());
}

// ---------------------------------------------------------------------------------------------
// Gemma 3 270M against gemma3_reference.py
// ---------------------------------------------------------------------------------------------

class Gemma3Model : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!kvq_test::missing_gemma3().empty()) return;
    file_ = new kvq::io::GgufFile(kvq::io::GgufFile::open(kvq_test::gemma3_gguf_path()));
    model_ = new LlamaGgufModel(*file_, 640);
  }
  static void TearDownTestSuite() {
    delete model_;
    delete file_;
    model_ = nullptr;
    file_ = nullptr;
  }
  void SetUp() override { KVQ_REQUIRE_GEMMA3(); }
  static kvq::io::GgufFile* file_;
  static LlamaGgufModel* model_;
};
kvq::io::GgufFile* Gemma3Model::file_ = nullptr;
LlamaGgufModel* Gemma3Model::model_ = nullptr;

TEST_F(Gemma3Model, ConfigIsReferenceMd) {
  const auto& c = model_->config();
  EXPECT_EQ(c.arch, "gemma3");
  EXPECT_EQ(c.n_layers, 18);
  EXPECT_EQ(c.dim, 640);
  EXPECT_EQ(c.hidden_dim, 2048);
  EXPECT_EQ(c.n_heads, 4);
  EXPECT_EQ(c.n_kv_heads, 1);
  EXPECT_EQ(c.head_dim, 256);
  EXPECT_EQ(c.vocab_size, 262144);
  EXPECT_EQ(c.sliding_window, 512);
  EXPECT_EQ(c.rope_theta, 1e6);
  EXPECT_EQ(c.rope_theta_swa, 1e4);
  EXPECT_FLOAT_EQ(c.q_scale, 1.0f);
  EXPECT_NEAR(c.rms_eps, 1e-6f, 1e-12f);
  EXPECT_TRUE(c.tied_output);
  for (int l = 0; l < 18; ++l) EXPECT_EQ(c.window(l), l % 6 == 5 ? 0 : 512) << "layer " << l;
}

TEST_F(Gemma3Model, DequantizedTensorsMatchTheGgufPackage) {
  struct Want {
    const char* name;
    const char* type;
    std::vector<float> first8;
    double sum4096;
  };
  // First 8 values and the sum of the first 4096 of each tensor, as the gguf package
  // (gguf.quants.dequantize) decodes them.
  const std::vector<Want> want = {
      {"token_embd.weight", "Q8_0", {-0.007244110107421875f, 0.042860984802246094f, -0.034409523010253906f, -0.02112865447998047f, -0.012073516845703125f, 0.0289764404296875f, 0.00482940673828125f, -0.03199481964111328f}, 0.784426332},
      {"blk.0.attn_q.weight", "Q5_0", {-0.0037841796875f, 0.007568359375f, -0.01513671875f, -0.00567626953125f, 0.0113525390625f, 0.00946044921875f, 0.0f, -0.00946044921875f}, 0.289985657},
      {"blk.0.attn_output.weight", "Q4_K", {-0.015705108642578125f, 0.04966926574707031f, -0.03749656677246094f, 0.06056499481201172f, -0.004809379577636719f, 0.038773536682128906f, -0.015705108642578125f, 0.0278778076171875f}, -1.06122833},
      {"blk.0.ffn_down.weight", "Q6_K", {0.0052117109298706055f, 0.02171546220779419f, -0.02518993616104126f, 0.013897895812988281f, 0.026927173137664795f, -0.015635132789611816f, 0.010423421859741211f, -0.0017372369766235352f}, 0.822962642},
      {"blk.3.ffn_down.weight", "Q4_K", {-0.008058428764343262f, 0.006654024124145508f, -0.003154277801513672f, 0.006654024124145508f, -0.008058428764343262f, 0.001749873161315918f, -0.008058428764343262f, -0.03257918357849121f}, -0.0187501311},
      {"blk.0.attn_v.weight", "Q8_0", {0.0060882568359375f, -0.03957366943359375f, -0.03145599365234375f, -0.05682373046875f, -0.0426177978515625f, 0.0547943115234375f, -0.07001495361328125f, -0.04769134521484375f}, 4.71454501},
  };
  for (const Want& x : want) {
    const auto& info = file_->tensor(x.name);
    EXPECT_STREQ(info.type_name(), x.type) << x.name;
    const std::vector<float> v = file_->dequantize_tensor(x.name);
    for (int i = 0; i < 8; ++i) EXPECT_FLOAT_EQ(v[static_cast<size_t>(i)], x.first8[static_cast<size_t>(i)]) << x.name << " [" << i << "]";
    double s = 0;
    for (int i = 0; i < 4096; ++i) s += v[static_cast<size_t>(i)];
    EXPECT_NEAR(s, x.sum4096, 1e-6 * (1 + std::abs(x.sum4096))) << x.name;
  }
}

struct Top {
  std::vector<int> ids;
  std::vector<double> vals;
  double lse;
};

double logsumexp(const float* x, int n) {
  double mx = x[0];
  for (int i = 1; i < n; ++i) mx = std::max(mx, double(x[i]));
  double s = 0;
  for (int i = 0; i < n; ++i) s += std::exp(double(x[i]) - mx);
  return mx + std::log(s);
}

void expect_row(const float* row, int vocab, const Top& t, double tol, const std::string& what) {
  for (size_t i = 0; i < t.ids.size(); ++i) {
    EXPECT_NEAR(row[t.ids[i]], t.vals[i], tol) << what << " token " << t.ids[i];
  }
  // The reference's argmax is kvq's (its top two differ by more than the tolerance).
  EXPECT_EQ(std::max_element(row, row + vocab) - row, t.ids[0]) << what;
  EXPECT_NEAR(logsumexp(row, vocab), t.lse, tol) << what;
}

TEST_F(Gemma3Model, ShortPromptLogits) {
  const auto tok = kvq::eval::GgufTokenizer::from_gguf(*file_);
  const std::vector<int> ids = tok.encode("Once upon a time, there was a little girl");
  ASSERT_EQ(ids, (std::vector<int>{2, 14946, 3324, 496, 990, 236764, 993, 691, 496, 2268, 3953}));
  const std::vector<Top> want = {
      {{184, 198, 255999}, {14.52182, 14.36583, 14.20354}, 17.01304},
      {{611, 506, 1570}, {22.98957, 22.33180, 22.29026}, 24.45577},
      {{496, 990, 506}, {23.84090, 19.02262, 18.30412}, 23.85932},
      {{990, 38735, 107}, {23.50473, 17.83493, 16.88457}, 23.52989},
      {{236764, 528, 993}, {22.90086, 21.19259, 20.69773}, 23.39491},
      {{993, 496, 528}, {24.02075, 23.57534, 23.56297}, 25.55003},
      {{691, 964, 11742}, {29.40759, 27.83977, 27.58577}, 29.75600},
      {{496, 614, 886}, {27.76918, 25.29383, 24.55400}, 27.95435},
      {{2268, 880, 1944}, {20.09473, 20.03622, 20.02620}, 22.86612},
      {{3953, 6938, 5148}, {18.29839, 16.93819, 16.48206}, 19.25179},
      {{7489, 1015, 528}, {24.46099, 24.09271, 22.85742}, 25.44422},
  };
  const int V = model_->config().vocab_size;
  kvq::eval::Fp32Backend kv(model_->kv_geometry());
  kv.reset();
  const auto lg = model_->forward(ids, 0, kv);
  for (size_t p = 0; p < ids.size(); ++p) {
    expect_row(lg.data() + p * V, V, want[p], 2e-3, "position " + std::to_string(p));
  }
}

TEST_F(Gemma3Model, SlidingWindowAt600Tokens) {
  // 600 tokens (BOS + the 4th dev line): at the last position the 15 local layers see only
  // their last 512 tokens. The reference's logits there with the window, and without it.
  const auto tok = kvq::eval::GgufTokenizer::from_gguf(*file_);
  const auto lines = kvq::eval::read_text_lines_stripped(kvq_test::smollm2_text_path());
  std::vector<std::string> nonempty;
  for (const auto& l : lines)
    if (!l.empty()) nonempty.push_back(l);
  ASSERT_GE(nonempty.size(), 4u);
  std::vector<int> ids = tok.encode(nonempty[3]);
  ASSERT_GE(ids.size(), 600u);
  ids.resize(600);
  EXPECT_EQ(std::vector<int>(ids.begin(), ids.begin() + 10),
            (std::vector<int>{2, 23889, 532, 60708, 659, 1771, 580, 496, 2563, 7946}));
  EXPECT_EQ(std::vector<int>(ids.end() - 5, ids.end()), (std::vector<int>{2768, 4916, 532, 1385, 855}));
  const Top windowed = {{506, 657, 529}, {27.86829, 25.37218, 24.71116}, 28.09383};
  // Without the window (every layer global) the reference gives top {506, 236761, 531} at
  // {20.60882, 20.22775, 20.20795}, logsumexp 22.14928: far from the windowed row.
  const int V = model_->config().vocab_size;
  std::vector<float> last(static_cast<size_t>(V));
  for (int chunked = 0; chunked < 2; ++chunked) {
    kvq::CacheBackend kv(kvq::parse_policy("f32"), model_->kv_geometry(), false, model_->rope());
    kv.set_chunked(chunked == 1);
    kv.reset();
    model_->forward(ids.data(), 599, 0, kv, nullptr);
    model_->forward(ids.data() + 599, 1, 599, kv, last.data());
    expect_row(last.data(), V, windowed, 5e-3, chunked ? "chunked cache" : "cache");
    // The local layers released the pages no later query sees (those wholly before position
    // 599 - 512 + 2 = 89); the global ones hold everything.
    for (int l = 0; l < 18; ++l) {
      const int64_t B = kv.cache().block_tokens(l);
      EXPECT_EQ(kv.cache().released_tokens(l), l % 6 == 5 ? 0 : 89 / B * B) << "layer " << l;
      EXPECT_EQ(kv.cache().tokens(l), 600);
    }
  }
  {  // without the release the logits are the same
    kvq::CacheBackend kv(kvq::parse_policy("f32"), model_->kv_geometry(), false, model_->rope());
    kv.set_release_window(false);
    kv.reset();
    model_->forward(ids.data(), 599, 0, kv, nullptr);
    model_->forward(ids.data() + 599, 1, 599, kv, last.data());
    expect_row(last.data(), V, windowed, 5e-3, "cache without release");
    EXPECT_EQ(kv.cache().released_tokens(0), 0);
  }
  kvq::eval::Fp32Backend f32(model_->kv_geometry());
  f32.reset();
  model_->forward_last(ids.data(), 600, 0, f32, last.data());
  expect_row(last.data(), V, windowed, 5e-3, "Fp32Backend");
}

TEST_F(Gemma3Model, PerplexityOfTheFirstTwoDevLines) {
  // The reference's running perplexity after the first two lines (376 predictions); over the
  // whole text it gives 8.573449 (docs/models.md, shared/docs/reference.md).
  const auto tok = kvq::eval::GgufTokenizer::from_gguf(*file_);
  const auto lines = kvq::eval::read_text_lines_stripped(kvq_test::smollm2_text_path());
  kvq::eval::Fp32Backend kv(model_->kv_geometry());
  kvq::eval::EvalOptions opt;
  opt.max_sequences = 2;
  const auto r = kvq::eval::evaluate_text(*model_, tok, kv, lines, opt);
  EXPECT_EQ(r.test.tokens, 376);
  EXPECT_NEAR(r.test.perplexity(), 6.986234327532645, 6.986 * 2e-5);
}

}  // namespace
