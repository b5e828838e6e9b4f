// Tests for kvq/eval/llama2c.hpp and kvq/eval/kv_backend.hpp: the stories260K model end to end
// (perplexity, greedy text), the tokenizer, the Fp32Backend against the double attention
// oracle, and rejection of truncated or hostile model and tokenizer files.
#include "kvq/eval/llama2c.hpp"

#include <gtest/gtest.h>

#include "stories_data.hpp"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include "kvq/eval/kv_backend.hpp"
#include "kvq/eval/metrics.hpp"

namespace kvq::eval {
namespace {

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

using kvq_test::model_path;
using kvq_test::text_path;
using kvq_test::tokenizer_path;

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVQ_TEST_HAS_ASAN 1
#endif
#endif
#ifndef KVQ_TEST_HAS_ASAN
#define KVQ_TEST_HAS_ASAN 0
#endif

/// The real model and tokenizer, loaded once per process.
struct Stories {
  Llama2cModel model{model_path()};
  Tokenizer tok{tokenizer_path(), 512};
  std::vector<std::string> lines = read_text_lines(text_path());
};
Stories& stories() {
  static Stories s;
  return s;
}

std::vector<unsigned char> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<unsigned char>(std::istreambuf_iterator<char>(in), {});
}

/// A temporary file that is removed when the test ends.
class TempFile {
 public:
  explicit TempFile(const std::string& tag) {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = ::testing::TempDir() + "kvq_" + info->test_suite_name() + "_" + info->name() + "_" +
            tag + ".bin";
  }
  ~TempFile() { std::remove(path_.c_str()); }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  const std::string& write(const std::vector<unsigned char>& bytes) {
    std::ofstream out(path_, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(bytes.data()),
              static_cast<std::streamsize>(bytes.size()));
    return path_;
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

void put_i32(std::vector<unsigned char>* b, int32_t v) {
  unsigned char x[4];
  std::memcpy(x, &v, 4);
  b->insert(b->end(), x, x + 4);
}
void put_f32(std::vector<unsigned char>* b, float v) {
  unsigned char x[4];
  std::memcpy(x, &v, 4);
  b->insert(b->end(), x, x + 4);
}
void set_i32(std::vector<unsigned char>* b, size_t offset, int32_t v) {
  std::memcpy(b->data() + offset, &v, 4);
}

/// Expects fn() to throw kvq::Error of `kind` whose message contains every one of `parts`.
template <class F>
void expect_error(ErrorKind kind, const std::vector<std::string>& parts, F&& fn) {
  try {
    fn();
    ADD_FAILURE() << "expected kvq::Error(" << to_string(kind) << ")";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    const std::string msg = e.what();
    for (const std::string& p : parts) {
      EXPECT_NE(msg.find(p), std::string::npos) << "message lacks '" << p << "': " << msg;
    }
  }
}

/// A small random llama2.c checkpoint (legacy layout) for parser tests that need no data.
struct SynthModel {
  int dim = 16, hidden = 24, layers = 2, heads = 4, kv_heads = 2, vocab = 300, seq_len = 32;
  bool shared = true;
  float classifier_scale = 1.0f;  // unshared: classifier = scale * token embedding

  std::vector<unsigned char> bytes(uint32_t seed = 1) const {
    const int hd = dim / heads;
    const int kv_dim = kv_heads * hd;
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, 0.3f);
    std::vector<unsigned char> b;
    for (int v : {dim, hidden, layers, heads, kv_heads, shared ? vocab : -vocab, seq_len}) {
      put_i32(&b, v);
    }
    std::vector<float> emb(static_cast<size_t>(vocab) * dim);
    for (float& x : emb) x = nd(rng);
    for (float x : emb) put_f32(&b, x);
    const size_t rest = static_cast<size_t>(layers) * dim                 // rms_att
                        + static_cast<size_t>(layers) * dim * dim         // wq
                        + 2 * static_cast<size_t>(layers) * kv_dim * dim  // wk, wv
                        + static_cast<size_t>(layers) * dim * dim         // wo
                        + static_cast<size_t>(layers) * dim               // rms_ffn
                        + 3 * static_cast<size_t>(layers) * hidden * dim  // w1, w2, w3
                        + static_cast<size_t>(dim)                        // rms_final
                        + static_cast<size_t>(seq_len) * hd;              // freq_cis
    for (size_t i = 0; i < rest; ++i) put_f32(&b, nd(rng) + 0.5f);
    if (!shared) {
      for (float x : emb) put_f32(&b, classifier_scale * x);
    }
    return b;
  }
};

/// A synthetic tokenizer: <unk>, <s>, </s>, the 256 byte pieces, then `extra` pieces.
std::vector<unsigned char> synth_tokenizer(const std::vector<std::pair<std::string, float>>& extra,
                                           int32_t max_len = 8) {
  std::vector<unsigned char> b;
  put_i32(&b, max_len);
  auto piece = [&](const std::string& s, float score) {
    put_f32(&b, score);
    put_i32(&b, static_cast<int32_t>(s.size()));
    b.insert(b.end(), s.begin(), s.end());
  };
  piece("<unk>", 0);
  piece("\n<s>\n", 0);
  piece("\n</s>\n", 0);
  for (int i = 0; i < 256; ++i) {
    char buf[8];
    std::snprintf(buf, sizeof(buf), "<0x%02X>", i);
    piece(buf, 0);
  }
  for (const auto& [s, score] : extra) piece(s, score);
  return b;
}

/// run.c's tokenizer merge loop written the slow way (rescan all pairs after every merge,
/// strict '>' so the leftmost best pair wins), as an oracle for the heap-based Tokenizer.
std::vector<int> naive_encode(const Tokenizer& tok, const std::string& text) {
  std::unordered_map<std::string, int> lookup;
  for (int id = Tokenizer::kMinVocab; id < tok.vocab_size(); ++id)
    lookup.emplace(tok.piece(id), id);
  std::vector<int> ids;
  auto add = [&](const std::string& s) {
    auto it = lookup.find(s);
    if (it != lookup.end()) {
      ids.push_back(it->second);
    } else {
      for (unsigned char c : s) ids.push_back(c + Tokenizer::kByteOffset);
    }
  };
  if (text.empty()) return ids;
  add(" ");
  size_t i = 0;
  while (i < text.size()) {
    size_t j = i + 1;
    while (j < text.size() && j - i < 4 && (static_cast<unsigned char>(text[j]) & 0xC0) == 0x80)
      ++j;
    add(text.substr(i, j - i));
    i = j;
  }
  while (true) {
    float best = -1e10f;
    int best_i = -1, best_id = -1;
    for (size_t k = 0; k + 1 < ids.size(); ++k) {
      auto it = lookup.find(tok.piece(ids[k]) + tok.piece(ids[k + 1]));
      if (it != lookup.end() && tok.score(it->second) > best) {
        best = tok.score(it->second);
        best_i = static_cast<int>(k);
        best_id = it->second;
      }
    }
    if (best_i < 0) break;
    ids[static_cast<size_t>(best_i)] = best_id;
    ids.erase(ids.begin() + best_i + 1);
  }
  return ids;
}

// ---------------------------------------------------------------------------------------------
// stories260K end to end
// ---------------------------------------------------------------------------------------------

TEST(Stories260K, HeaderAndGeometry) {
  KVQ_REQUIRE_STORIES();
  const Llama2cConfig& c = stories().model.config();
  EXPECT_EQ(c.dim, 64);
  EXPECT_EQ(c.hidden_dim, 172);
  EXPECT_EQ(c.n_layers, 5);
  EXPECT_EQ(c.n_heads, 8);
  EXPECT_EQ(c.n_kv_heads, 4);
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.seq_len, 512);
  EXPECT_TRUE(c.shared_classifier);
  EXPECT_EQ(c.head_dim(), 8);
  const KVGeometry g = stories().model.kv_geometry();
  EXPECT_EQ(g.n_layers, 5);
  EXPECT_EQ(g.n_kv_heads, 4);
  EXPECT_EQ(g.head_dim, 8);
  EXPECT_EQ(g.max_tokens, 512);
  EXPECT_EQ(stories().tok.vocab_size(), 512);
}

TEST(Stories260K, PerplexityMatchesReference) {
  KVQ_REQUIRE_STORIES();
  Stories& s = stories();
  Fp32Backend kv(s.model.kv_geometry());
  const std::clock_t cpu0 = std::clock();
  const EvalResult r = evaluate_text(s.model, s.tok, kv, s.lines);
  const double cpu_s = static_cast<double>(std::clock() - cpu0) / CLOCKS_PER_SEC;
  std::printf(
      "stories260K fp32: %lld predictions over %lld sequences, perplexity %.4f, "
      "%.3f s wall (forward %.3f s), %.3f s CPU\n",
      static_cast<long long>(r.test.tokens), static_cast<long long>(r.test.sequences),
      r.test.perplexity(), r.seconds, r.test.seconds, cpu_s);
  EXPECT_EQ(r.test.tokens, 4258);
  EXPECT_EQ(r.test.sequences, 9);
  EXPECT_EQ(r.test.forward_passes, 4258);
  EXPECT_NEAR(r.test.perplexity(), 5.3930, 5.3930 * 1e-3);
  EXPECT_NEAR(r.test.mean_nll(), std::log(r.test.perplexity()), 1e-12);
  EXPECT_FALSE(r.has_reference);
  // Speed is only meaningful in an optimized, uninstrumented build (a fraction of a second on
  // an idle core). CPU time rather than wall time, so that a machine shared with other jobs
  // does not make the test flaky.
#if defined(__OPTIMIZE__) && !defined(__SANITIZE_ADDRESS__) && !KVQ_TEST_HAS_ASAN
  EXPECT_LT(cpu_s, 10.0) << "one evaluation of the dev text must take well under 10 s";
#endif
}

TEST(Stories260K, GreedyDecodingGivesTheReadmeText) {
  KVQ_REQUIRE_STORIES();
  Stories& s = stories();
  Fp32Backend kv(s.model.kv_geometry());
  const std::vector<int> out = generate_greedy(s.model, kv, {Tokenizer::kBos}, 40);
  const std::string text = s.tok.decode(out);
  const std::string want =
      "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
      "park.";
  EXPECT_EQ(text.substr(0, want.size()), want) << "generated: " << text;
}

TEST(Stories260K, RopeRotatesAdjacentPairs) {
  // Post-RoPE keys must be the pre-RoPE keys with each pair (2i, 2i+1) rotated by
  // pos * 10000^(-2i/head_dim): llama2.c's convention, which the greedy text also confirms.
  KVQ_REQUIRE_STORIES();
  Stories& s = stories();
  Fp32Backend kv(s.model.kv_geometry());
  const std::vector<int> toks = s.tok.encode("Once upon a time there was a cat.", true);
  for (int p = 0; p < static_cast<int>(toks.size()); ++p) s.model.forward(toks[p], p, kv);
  for (int layer : {0, 4}) {
    const KVView<const float> k = kv.keys(layer);
    const KVView<const float> kp = kv.keys_prerope(layer);
    ASSERT_EQ(k.tokens(), static_cast<int64_t>(toks.size()));
    for (int64_t t = 0; t < k.tokens(); ++t) {
      for (int64_t h = 0; h < k.heads(); ++h) {
        for (int64_t i = 0; i < k.head_dim() / 2; ++i) {
          const double ang =
              static_cast<double>(t) * std::pow(10000.0, -2.0 * static_cast<double>(i) / 8.0);
          const double a = kp.at(t, h, 2 * i), b = kp.at(t, h, 2 * i + 1);
          EXPECT_NEAR(k.at(t, h, 2 * i), a * std::cos(ang) - b * std::sin(ang), 1e-5);
          EXPECT_NEAR(k.at(t, h, 2 * i + 1), a * std::sin(ang) + b * std::cos(ang), 1e-5);
        }
      }
    }
  }
}

/// A backend that stores K and V rounded to 4 mantissa bits, to give the KL path something
/// to measure. It drives an inner Fp32Backend, as a quantized cache would.
class RoundingBackend final : public KVBackend {
 public:
  explicit RoundingBackend(const KVGeometry& g) : inner_(g), width_(g.n_kv_heads * g.head_dim) {}
  void reset() override { inner_.reset(); }
  void append(int layer, int pos, const float* kp, const float* k, const float* v) override {
    kr_.assign(k, k + width_);
    vr_.assign(v, v + width_);
    for (float& x : kr_) x = round4(x);
    for (float& x : vr_) x = round4(x);
    inner_.append(layer, pos, kp, kr_.data(), vr_.data());
  }
  void attend(int layer, int pos, const float* q, int n_heads, float* out) override {
    inner_.attend(layer, pos, q, n_heads, out);
  }

 private:
  static float round4(float x) {
    int e = 0;
    const float m = std::frexp(x, &e);
    return std::ldexp(std::round(m * 32.0f) / 32.0f, e);
  }
  Fp32Backend inner_;
  int width_;
  std::vector<float> kr_, vr_;
};

TEST(Stories260K, LockstepAgainstItselfHasZeroKl) {
  KVQ_REQUIRE_STORIES();
  Stories& s = stories();
  Fp32Backend kv(s.model.kv_geometry());
  Fp32Backend ref(s.model.kv_geometry());
  EvalOptions o;
  o.reference = &ref;
  o.max_sequences = 2;
  o.max_seq_len = 128;
  const EvalResult r = evaluate_text(s.model, s.tok, kv, s.lines, o);
  EXPECT_TRUE(r.has_reference);
  EXPECT_EQ(r.mean_kl, 0.0);
  EXPECT_EQ(r.max_kl, 0.0);
  EXPECT_EQ(r.test.sequences, 2);
  EXPECT_EQ(r.reference.tokens, r.test.tokens);
  EXPECT_EQ(r.reference.forward_passes, r.test.forward_passes);
  EXPECT_EQ(r.reference.total_nll, r.test.total_nll);
}

TEST(Stories260K, LockstepAndTraceGiveTheSameKl) {
  KVQ_REQUIRE_STORIES();
  Stories& s = stories();
  const KVGeometry g = s.model.kv_geometry();
  Fp32Backend ref(g);
  RoundingBackend test(g);

  EvalOptions rec;
  rec.max_sequences = 3;
  rec.max_seq_len = 128;
  LogitTrace trace;
  rec.record_trace = &trace;
  const EvalResult base = evaluate_text(s.model, s.tok, ref, s.lines, rec);
  EXPECT_EQ(trace.vocab_size, 512);
  EXPECT_EQ(trace.predictions(), base.test.tokens);

  EvalOptions lock;
  lock.max_sequences = 3;
  lock.max_seq_len = 128;
  lock.reference = &ref;
  const EvalResult a = evaluate_text(s.model, s.tok, test, s.lines, lock);

  EvalOptions replay;
  replay.max_sequences = 3;
  replay.max_seq_len = 128;
  replay.reference_trace = &trace;
  const EvalResult b = evaluate_text(s.model, s.tok, test, s.lines, replay);

  std::printf("4-mantissa-bit KV: ppl %.4f vs %.4f, mean KL %.3g, max KL %.3g\n",
              a.test.perplexity(), a.reference.perplexity(), a.mean_kl, a.max_kl);
  EXPECT_GT(a.mean_kl, 0.0);
  EXPECT_LT(a.mean_kl, 0.05);
  EXPECT_GE(a.max_kl, a.mean_kl);
  EXPECT_NE(a.test.total_nll, a.reference.total_nll);
  EXPECT_EQ(a.reference.total_nll, base.test.total_nll);
  EXPECT_EQ(a.mean_kl, b.mean_kl);
  EXPECT_EQ(a.max_kl, b.max_kl);
  EXPECT_EQ(a.test.total_nll, b.test.total_nll);
  EXPECT_EQ(b.reference.total_nll, base.test.total_nll);
  EXPECT_EQ(b.reference.seconds, 0.0);  // nothing ran for a replayed reference

  // A trace recorded on other text is rejected, not silently misaligned.
  EvalOptions wrong;
  wrong.max_sequences = 4;
  wrong.max_seq_len = 128;
  wrong.reference_trace = &trace;
  expect_error(ErrorKind::kInvalidArgument, {"trace"},
               [&] { evaluate_text(s.model, s.tok, test, s.lines, wrong); });
  wrong.max_sequences = 2;
  expect_error(ErrorKind::kInvalidArgument, {"trace"},
               [&] { evaluate_text(s.model, s.tok, test, s.lines, wrong); });
}

TEST(Stories260K, EvaluationOptionsAndRules) {
  KVQ_REQUIRE_STORIES();
  Stories& s = stories();
  Fp32Backend kv(s.model.kv_geometry());
  EvalOptions o;
  o.max_seq_len = 16;  // every dev line is longer than 15 tokens
  const EvalResult r = evaluate_text(s.model, s.tok, kv, s.lines, o);
  EXPECT_EQ(r.test.tokens, 9 * 15);
  EXPECT_EQ(r.test.sequences, 9);

  // Empty lines are not sequences; a one-word line of n tokens gives n - 1 predictions.
  const std::vector<std::string> lines = {"", "Once upon a time", ""};
  const EvalResult one = evaluate_text(s.model, s.tok, kv, lines);
  EXPECT_EQ(one.test.sequences, 1);
  EXPECT_EQ(one.test.tokens,
            static_cast<int64_t>(s.tok.encode("Once upon a time", true).size()) - 1);

  expect_error(ErrorKind::kInvalidArgument, {"no predictions"}, [&] {
    evaluate_text(s.model, s.tok, kv, std::vector<std::string>{"", ""});
  });
  EvalOptions same;
  same.reference = &kv;
  expect_error(ErrorKind::kInvalidArgument, {"reference"},
               [&] { evaluate_text(s.model, s.tok, kv, lines, same); });
  Fp32Backend ref(s.model.kv_geometry());
  LogitTrace trace;
  EvalOptions both;
  both.reference = &ref;
  both.reference_trace = &trace;
  expect_error(ErrorKind::kInvalidArgument, {"not both"},
               [&] { evaluate_text(s.model, s.tok, kv, lines, both); });
  EvalOptions aliased;
  aliased.reference_trace = &trace;
  aliased.record_trace = &trace;
  expect_error(ErrorKind::kInvalidArgument, {"same object"},
               [&] { evaluate_text(s.model, s.tok, kv, lines, aliased); });
}

TEST(Stories260K, ForwardRejectsBadTokenAndPosition) {
  KVQ_REQUIRE_STORIES();
  Stories& s = stories();
  Fp32Backend kv(s.model.kv_geometry());
  expect_error(ErrorKind::kInvalidArgument, {"token 512"}, [&] { s.model.forward(512, 0, kv); });
  expect_error(ErrorKind::kInvalidArgument, {"token -1"}, [&] { s.model.forward(-1, 0, kv); });
  expect_error(ErrorKind::kInvalidArgument, {"position 512"}, [&] { s.model.forward(1, 512, kv); });
  // Positions must follow the cache: skipping one is caught by the backend.
  kv.reset();
  s.model.forward(1, 0, kv);
  expect_error(ErrorKind::kInvalidArgument, {"next position must be 1"},
               [&] { s.model.forward(1, 2, kv); });
}

TEST(Stories260K, SeparateClassifierIsRead) {
  // The same checkpoint rewritten with vocab_size = -512 and the classifier appended (a copy
  // of the embedding) must give bit-identical logits; with a doubled classifier, doubled ones.
  KVQ_REQUIRE_STORIES();
  Stories& s = stories();
  std::vector<unsigned char> b = read_bytes(model_path());
  ASSERT_EQ(b.size(), 1056540u);
  set_i32(&b, 20, -512);
  const size_t emb_bytes = 512 * 64 * 4;
  std::vector<unsigned char> twice = b;
  const std::vector<unsigned char> emb(b.begin() + 28,
                                       b.begin() + 28 + static_cast<std::ptrdiff_t>(emb_bytes));
  b.insert(b.end(), emb.begin(), emb.end());
  for (size_t i = 0; i < 512 * 64; ++i) {
    float x;
    std::memcpy(&x, b.data() + 28 + 4 * i, 4);
    put_f32(&twice, 2.0f * x);
  }
  TempFile f1("same"), f2("twice");
  Llama2cModel m1(f1.write(b));
  Llama2cModel m2(f2.write(twice));
  EXPECT_FALSE(m1.config().shared_classifier);
  EXPECT_EQ(m1.config().vocab_size, 512);
  Fp32Backend k0(s.model.kv_geometry()), k1(s.model.kv_geometry()), k2(s.model.kv_geometry());
  const std::vector<int> toks = {1, 403, 407, 261};
  for (int p = 0; p < 4; ++p) {
    const std::vector<float> a = s.model.forward(toks[p], p, k0);
    const std::vector<float> c = m1.forward(toks[p], p, k1);
    const std::vector<float> d = m2.forward(toks[p], p, k2);
    for (size_t i = 0; i < a.size(); ++i) {
      ASSERT_EQ(a[i], c[i]) << "pos " << p << " logit " << i;
      ASSERT_EQ(2.0f * a[i], d[i]) << "pos " << p << " logit " << i;
    }
  }
}

TEST(Stories260K, TruncatedRealModelNamesSizes) {
  KVQ_REQUIRE_STORIES();
  std::vector<unsigned char> b = read_bytes(model_path());
  b.pop_back();
  TempFile f("trunc");
  const std::string& p = f.write(b);
  expect_error(ErrorKind::kIo, {p, "1056539", "1056540", "truncated"}, [&] { Llama2cModel m(p); });
  b.push_back(0);
  b.push_back(0);
  f.write(b);
  expect_error(ErrorKind::kIo, {"1056541", "1056540", "trailing"}, [&] { Llama2cModel m(p); });
}

// ---------------------------------------------------------------------------------------------
// Tokenizer
// ---------------------------------------------------------------------------------------------

TEST(Tokenizer, RoundTripOnRealVocabulary) {
  KVQ_REQUIRE_STORIES();
  const Tokenizer& tok = stories().tok;
  const std::vector<std::string> texts = {
      "Hello world",
      "Once upon a time, there was a little girl named Lily.",
      "na\xC3\xAFve caf\xC3\xA9 \xE2\x98\x95 \xF0\x9F\x98\x80",  // naïve café ☕ 😀
      "tab\tand  double  spaces",
      "line\nbreak\r\n",
      " leading space",
      "trailing space ",
      "\x80\xFF stray bytes",
      "",
      std::string("nul\0byte", 8)};
  for (const std::string& t : texts) {
    const std::vector<int> ids = tok.encode(t, true);
    ASSERT_FALSE(ids.empty());
    EXPECT_EQ(ids[0], Tokenizer::kBos);
    EXPECT_EQ(tok.decode(ids), t) << "text: " << t;
    EXPECT_EQ(tok.decode(tok.encode(t, false)), t) << "text: " << t;
    const std::vector<int> with_eos = tok.encode(t, true, true);
    EXPECT_EQ(with_eos.back(), Tokenizer::kEos);
    EXPECT_EQ(tok.decode(with_eos), t);
  }
  EXPECT_EQ(tok.encode("", true), std::vector<int>{Tokenizer::kBos});
  EXPECT_TRUE(tok.encode("", false).empty());
}

TEST(Tokenizer, KnownPiecesAndByteFallback) {
  KVQ_REQUIRE_STORIES();
  const Tokenizer& tok = stories().tok;
  EXPECT_EQ(tok.max_token_length(), 7);
  EXPECT_EQ(tok.piece(Tokenizer::kBos), "\n<s>\n");
  EXPECT_EQ(tok.piece(3 + 0x41), "<0x41>");
  // "\r" has no piece: it falls back to its byte (0x0D + 3).
  const std::vector<int> cr = tok.encode("\r", false);
  ASSERT_EQ(cr.size(), 2u);
  EXPECT_EQ(tok.piece(cr[0]), " ");  // the dummy prefix
  EXPECT_EQ(cr[1], 0x0D + 3);
  // Piece text after BOS drops the dummy-prefix space; elsewhere it is kept.
  const std::vector<int> ids = tok.encode("Once", true);
  ASSERT_GE(ids.size(), 2u);
  EXPECT_EQ(tok.piece(ids[1]).substr(0, 1), " ");
  EXPECT_EQ(tok.decode(Tokenizer::kBos, ids[1]), tok.piece(ids[1]).substr(1));
  EXPECT_EQ(tok.decode(ids[1], ids[1]), tok.piece(ids[1]));
  EXPECT_EQ(tok.decode(5, 3 + 0xFF), std::string(1, '\xFF'));
  expect_error(ErrorKind::kInvalidArgument, {"512"}, [&] { tok.decode(1, 512); });
  // A literal byte-piece spelling stays literal text.
  EXPECT_EQ(tok.decode(tok.encode("<0x41>", true)), "<0x41>");
}

TEST(Tokenizer, HeapMergeMatchesRunCMergeLoop) {
  KVQ_REQUIRE_STORIES();
  const Tokenizer& tok = stories().tok;
  for (const std::string& line : stories().lines) {
    ASSERT_EQ(tok.encode(line, false), naive_encode(tok, line));
  }
  std::mt19937 rng(3);
  const std::vector<std::string> alphabet = {"a", "e", "t",  "h",        " ",  "  ", "the", "ing",
                                             ".", ",", "\n", "\xC3\xA9", "Th", "o",  "n",   "s"};
  for (int i = 0; i < 300; ++i) {
    std::string t;
    const int len = static_cast<int>(rng() % 40);
    for (int j = 0; j < len; ++j) t += alphabet[rng() % alphabet.size()];
    ASSERT_EQ(tok.encode(t, false), naive_encode(tok, t)) << "text: '" << t << "'";
  }
}

TEST(Tokenizer, MergeOrderOnSyntheticVocabulary) {
  // Pieces: " " "a" "b" "ab"(-1) " a"(-2) " ab"(-0.5) "ba"(-1).
  TempFile f("tok");
  const Tokenizer tok(f.write(synth_tokenizer(
      {{" ", 0}, {"a", 0}, {"b", 0}, {"ab", -1}, {" a", -2}, {" ab", -0.5f}, {"ba", -1}})));
  EXPECT_EQ(tok.vocab_size(), 259 + 7);
  const int sp = 259, a = 260, ab = 262, sp_a = 263, sp_ab = 264;
  // "ab": " a"(-2) vs "ab"(-1): "ab" first, then " ab".
  EXPECT_EQ(tok.encode("ab", false), (std::vector<int>{sp_ab}));
  // "aab": "ab" first, then " a"; " aab" does not exist.
  EXPECT_EQ(tok.encode("aab", false), (std::vector<int>{sp_a, ab}));
  // "aba": "ab" and "ba" tie at -1: the leftmost wins, then " ab".
  EXPECT_EQ(tok.encode("aba", false), (std::vector<int>{sp_ab, a}));
  // Byte fallback for what has no piece: 'c' and the two bytes of "é".
  EXPECT_EQ(tok.encode("c\xC3\xA9", false), (std::vector<int>{sp, 3 + 'c', 3 + 0xC3, 3 + 0xA9}));
  EXPECT_EQ(tok.decode(tok.encode("c\xC3\xA9 aba", true)), "c\xC3\xA9 aba");
}

TEST(Tokenizer, RejectsTruncatedAndHostileFiles) {
  const std::vector<unsigned char> good = synth_tokenizer({{" ", 0}, {"ab", -1}});
  TempFile f("tok");
  {
    const Tokenizer ok(f.write(good));
    EXPECT_EQ(ok.vocab_size(), 261);
    const Tokenizer exact(f.path(), 261);
    EXPECT_EQ(exact.vocab_size(), 261);
  }
  // Missing file.
  expect_error(ErrorKind::kIo, {"/nonexistent/tok.bin"},
               [&] { Tokenizer t("/nonexistent/tok.bin"); });
  // Truncated everywhere: inside max_token_length, a score/length pair, the piece bytes.
  for (size_t cut : {size_t{0}, size_t{3}, size_t{6}, size_t{100}, good.size() - 1}) {
    std::vector<unsigned char> b(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(cut));
    const std::string& p = f.write(b);
    expect_error(ErrorKind::kIo, {p, "truncated"}, [&] { Tokenizer t(p, 261); });
  }
  // More pieces requested than the file holds.
  expect_error(ErrorKind::kIo, {"truncated", "token 261"},
               [&] { Tokenizer t(f.write(good), 262); });
  // Fewer requested than present: trailing bytes.
  expect_error(ErrorKind::kIo, {"trailing"}, [&] { Tokenizer t(f.write(good), 260); });
  // Absurd and negative lengths (the first piece's length is at byte offset 8).
  for (int32_t len : {int32_t{1} << 30, -1, 9}) {
    std::vector<unsigned char> b = good;
    set_i32(&b, 8, len);
    const std::string& p = f.write(b);
    expect_error(ErrorKind::kIo, {p, "length " + std::to_string(len), "byte offset 8"},
                 [&] { Tokenizer t(p); });
  }
  // Bad max_token_length.
  for (int32_t m : {0, -5, int32_t{1} << 30}) {
    std::vector<unsigned char> b = good;
    set_i32(&b, 0, m);
    expect_error(ErrorKind::kIo, {"max_token_length"}, [&] { Tokenizer t(f.write(b)); });
  }
  // Non-finite score.
  {
    std::vector<unsigned char> b = good;
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::memcpy(b.data() + 4, &nan, 4);
    expect_error(ErrorKind::kIo, {"non-finite score"}, [&] { Tokenizer t(f.write(b)); });
  }
  // No byte-fallback table: too few pieces, or a byte piece out of place.
  {
    std::vector<unsigned char> b;
    put_i32(&b, 8);
    for (const char* s : {"<unk>", "a", "b"}) {
      put_f32(&b, 0);
      put_i32(&b, static_cast<int32_t>(std::strlen(s)));
      b.insert(b.end(), s, s + std::strlen(s));
    }
    expect_error(ErrorKind::kIo, {"byte-fallback"}, [&] { Tokenizer t(f.write(b)); });
    std::vector<unsigned char> c = good;
    // Piece 3 ("<0x00>") starts at 4 + 3 pieces; rename it "<0x01>".
    const size_t off = 4 + (8 + 5) + (8 + 5) + (8 + 6) + 8;
    ASSERT_EQ(std::string(c.begin() + off, c.begin() + off + 6), "<0x00>");
    c[off + 5 - 1] = '1';
    expect_error(ErrorKind::kIo, {"piece 3", "<0x00>"}, [&] { Tokenizer t(f.write(c)); });
  }
}

// ---------------------------------------------------------------------------------------------
// Model file validation (synthetic checkpoints; no shared data needed)
// ---------------------------------------------------------------------------------------------

TEST(Llama2cModel, LoadsSyntheticAndRunsFiniteForward) {
  SynthModel sm;
  TempFile f("model");
  Llama2cModel m(f.write(sm.bytes()));
  EXPECT_EQ(m.config().dim, 16);
  EXPECT_EQ(m.config().head_dim(), 4);
  EXPECT_EQ(m.config().kv_dim(), 8);
  Fp32Backend kv(m.kv_geometry());
  for (int p = 0; p < 32; ++p) {
    const std::vector<float> l = m.forward(p * 7 % 300, p, kv);
    ASSERT_EQ(l.size(), 300u);
    for (float x : l) ASSERT_TRUE(std::isfinite(x));
  }
  EXPECT_EQ(kv.tokens(0), 32);
  expect_error(ErrorKind::kInvalidArgument, {"position 32"}, [&] { m.forward(0, 32, kv); });
}

TEST(Llama2cModel, SeparateClassifierOnSyntheticModel) {
  SynthModel shared;
  SynthModel twice = shared;
  twice.shared = false;
  twice.classifier_scale = 2.0f;
  TempFile f1("a"), f2("b");
  Llama2cModel a(f1.write(shared.bytes()));
  Llama2cModel b(f2.write(twice.bytes()));
  EXPECT_TRUE(a.config().shared_classifier);
  EXPECT_FALSE(b.config().shared_classifier);
  Fp32Backend ka(a.kv_geometry()), kb(b.kv_geometry());
  for (int p = 0; p < 5; ++p) {
    const std::vector<float> la = a.forward(p + 10, p, ka);
    const std::vector<float> lb = b.forward(p + 10, p, kb);
    for (size_t i = 0; i < la.size(); ++i) ASSERT_EQ(2.0f * la[i], lb[i]);
  }
}

TEST(Llama2cModel, RejectsTruncatedPaddedAndHostileFiles) {
  SynthModel sm;
  const std::vector<unsigned char> good = sm.bytes();
  TempFile f("model");
  const std::string& p = f.path();
  const std::string want = std::to_string(good.size());

  expect_error(ErrorKind::kIo, {"/nonexistent/model.bin"},
               [&] { Llama2cModel m("/nonexistent/model.bin"); });
  // Shorter than the header.
  f.write(std::vector<unsigned char>(good.begin(), good.begin() + 20));
  expect_error(ErrorKind::kIo, {p, "20 bytes", "header"}, [&] { Llama2cModel m(p); });
  // Truncated body, one missing byte and one missing classifier.
  for (size_t drop : {size_t{1}, size_t{4}, good.size() / 2}) {
    f.write(
        std::vector<unsigned char>(good.begin(), good.end() - static_cast<std::ptrdiff_t>(drop)));
    expect_error(ErrorKind::kIo, {p, std::to_string(good.size() - drop), want, "truncated"},
                 [&] { Llama2cModel m(p); });
  }
  {
    std::vector<unsigned char> b = good;
    set_i32(&b, 20, -sm.vocab);  // claims a separate classifier the file does not have
    f.write(b);
    expect_error(ErrorKind::kIo, {"vocab_size=-300", "truncated"}, [&] { Llama2cModel m(p); });
  }
  // Padded.
  {
    std::vector<unsigned char> b = good;
    b.push_back(0);
    f.write(b);
    expect_error(ErrorKind::kIo, {"trailing"}, [&] { Llama2cModel m(p); });
  }
  // Header fields: (byte offset, value, message part).
  struct Bad {
    size_t offset;
    int32_t value;
    const char* part;
  };
  const std::vector<Bad> bads = {
      {0, 0, "dim = 0"},
      {0, -16, "dim = -16"},
      {0, std::numeric_limits<int32_t>::max(), "dim = 2147483647"},
      {4, 0, "hidden_dim"},
      {4, std::numeric_limits<int32_t>::max(), "hidden_dim"},
      {8, 100000, "n_layers"},
      {12, 0, "n_heads"},
      {12, 3, "not divisible by n_heads"},
      {12, 16, "odd"},  // head_dim 1
      {16, 0, "n_kv_heads"},
      {16, 3, "not a multiple of n_kv_heads"},
      {16, 8, "not a multiple of n_kv_heads"},  // more kv heads than heads
      {20, 0, "vocab_size"},
      {20, std::numeric_limits<int32_t>::min(), "vocab_size"},
      {24, 0, "seq_len"},
      {24, -1, "seq_len"},
      {24, std::numeric_limits<int32_t>::max(), "seq_len"},
  };
  for (const Bad& bad : bads) {
    std::vector<unsigned char> b = good;
    set_i32(&b, bad.offset, bad.value);
    f.write(b);
    expect_error(ErrorKind::kIo, {p, bad.part}, [&] { Llama2cModel m(p); });
  }
  // Header that is plausible field by field but implies a different size.
  {
    std::vector<unsigned char> b = good;
    set_i32(&b, 24, 64);  // seq_len 32 -> 64 grows the RoPE tables by 32 * 4 floats
    f.write(b);
    expect_error(ErrorKind::kIo, {want, std::to_string(good.size() + 32 * 4 * 4)},
                 [&] { Llama2cModel m(p); });
  }
  // A NaN weight is reported with its byte offset.
  {
    std::vector<unsigned char> b = good;
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::memcpy(b.data() + 28 + 4 * 5, &nan, 4);
    f.write(b);
    expect_error(ErrorKind::kIo, {"non-finite weight", "byte offset 48"},
                 [&] { Llama2cModel m(p); });
  }
}

// ---------------------------------------------------------------------------------------------
// Fp32Backend
// ---------------------------------------------------------------------------------------------

TEST(Fp32Backend, MatchesDoubleAttentionOracle) {
  // head_dim 8 (the vector path) and 12 (vector + tail); token counts around multiples of 8.
  for (int head_dim : {8, 12, 2}) {
    const KVGeometry g{2, 2, head_dim, 40};
    Fp32Backend kv(g);
    std::mt19937 rng(static_cast<uint32_t>(head_dim));
    std::normal_distribution<float> nd(0.0f, 1.0f);
    const int n_heads = 6;
    const int width = g.n_kv_heads * head_dim;
    std::vector<float> k(static_cast<size_t>(width)), kp(k.size()), v(k.size());
    std::vector<float> q(static_cast<size_t>(n_heads * head_dim));
    std::vector<float> out(q.size());
    for (int pos = 0; pos < 40; ++pos) {
      for (int layer = 0; layer < 2; ++layer) {
        for (size_t i = 0; i < k.size(); ++i) {
          k[i] = 2.0f * nd(rng);
          kp[i] = nd(rng);
          v[i] = nd(rng);
        }
        for (float& x : q) x = nd(rng);
        kv.append(layer, pos, kp.data(), k.data(), v.data());
        kv.attend(layer, pos, q.data(), n_heads, out.data());
        const std::vector<double> want =
            attention_output(q.data(), n_heads, kv.keys(layer), kv.values(layer));
        for (size_t i = 0; i < out.size(); ++i) {
          ASSERT_NEAR(out[i], want[i], 2e-5) << "head_dim " << head_dim << " pos " << pos;
        }
        // The views return exactly what was appended.
        for (int h = 0; h < g.n_kv_heads; ++h) {
          for (int d = 0; d < head_dim; ++d) {
            const size_t i = static_cast<size_t>(h * head_dim + d);
            ASSERT_EQ(kv.keys(layer).at(pos, h, d), k[i]);
            ASSERT_EQ(kv.keys_prerope(layer).at(pos, h, d), kp[i]);
            ASSERT_EQ(kv.values(layer).at(pos, h, d), v[i]);
          }
        }
      }
    }
  }
}

TEST(Fp32Backend, SoftmaxSurvivesHugeScoreGaps) {
  // One key aligned with the query by a huge margin: all weight on it, no NaN from exp.
  Fp32Backend kv(KVGeometry{1, 1, 2, 8});
  const std::vector<float> zero = {0, 0};
  const std::vector<float> big = {1000, 0};
  const std::vector<float> q = {100, 0};
  const std::vector<float> v0 = {1, 1};
  const std::vector<float> v1 = {5, -5};
  std::vector<float> out(2);
  kv.append(0, 0, zero.data(), zero.data(), v0.data());
  kv.append(0, 1, big.data(), big.data(), v1.data());
  kv.attend(0, 1, q.data(), 1, out.data());
  EXPECT_EQ(out[0], 5.0f);
  EXPECT_EQ(out[1], -5.0f);
}

TEST(Fp32Backend, ExpMatchesLibm) {
  float worst = 0.0f;
  double worst_rel = 0.0;
  for (float x = 0.0f; x > -87.3f; x -= 0.00137f) {
    const double want = std::exp(static_cast<double>(x));
    const double rel = std::fabs(detail::exp_nonpositive(x) - want) / want;
    if (rel > worst_rel) {
      worst_rel = rel;
      worst = x;
    }
  }
  EXPECT_LT(worst_rel, 1.5 * 5.96e-8) << "at x = " << worst;  // 1.5 ulp
  EXPECT_EQ(detail::exp_nonpositive(0.0f), 1.0f);
  EXPECT_EQ(detail::exp_nonpositive(-INFINITY), 0.0f);
  EXPECT_EQ(detail::exp_nonpositive(-100.0f), 0.0f);
}

TEST(Fp32Backend, RejectsOutOfOrderUse) {
  Fp32Backend kv(KVGeometry{2, 1, 2, 2});
  const std::vector<float> x = {1, 2};
  std::vector<float> out(4);
  expect_error(ErrorKind::kInvalidArgument, {"layer 2"},
               [&] { kv.append(2, 0, x.data(), x.data(), x.data()); });
  expect_error(ErrorKind::kInvalidArgument, {"holds 0 tokens"},
               [&] { kv.attend(0, 0, x.data(), 1, out.data()); });
  expect_error(ErrorKind::kInvalidArgument, {"next position must be 0"},
               [&] { kv.append(0, 1, x.data(), x.data(), x.data()); });
  kv.append(0, 0, x.data(), x.data(), x.data());
  kv.append(0, 1, x.data(), x.data(), x.data());
  expect_error(ErrorKind::kOutOfRange, {"full"},
               [&] { kv.append(0, 2, x.data(), x.data(), x.data()); });
  expect_error(ErrorKind::kInvalidArgument, {"position 0"},
               [&] { kv.attend(0, 0, x.data(), 1, out.data()); });
  EXPECT_EQ(kv.tokens(0), 2);
  EXPECT_EQ(kv.tokens(1), 0);
  kv.reset();
  EXPECT_EQ(kv.tokens(0), 0);
  EXPECT_EQ(kv.keys(0).tokens(), 0);
  expect_error(ErrorKind::kInvalidArgument, {"positive"}, [&] {
    Fp32Backend bad(KVGeometry{1, 0, 8, 8});
  });
}

}  // namespace
}  // namespace kvq::eval
