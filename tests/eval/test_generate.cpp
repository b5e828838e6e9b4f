// Text generation (eval/generate.hpp, what kvq_generate runs): the sampler (greedy = argmax,
// seeded sampling reproducible, top-k 1 = greedy); and on the real models (SmolLM2, Gemma 3,
// each skipped when absent outside CI) greedy generation with an f32 cache, prefilled as one
// chunk through the batched attention, picks at every step the argmax of the forward pass that
// kvq_perplexity evaluates (the whole sequence through Fp32Backend), and is deterministic.
#include "kvq/eval/generate.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "gemma3_data.hpp"
#include "kvq/eval/cache_backend.hpp"
#include "kvq/eval/gguf_tokenizer.hpp"
#include "kvq/policy/spec.hpp"
#include "smollm2_data.hpp"

namespace {

using kvq::eval::GenerateOptions;

TEST(Sampler, GreedyIsArgmaxLowestIdOnTies) {
  const std::vector<float> x = {0.5f, 2.0f, -1.0f, 2.0f};
  GenerateOptions o;
  uint64_t s = 1;
  std::vector<int> idx;
  std::vector<double> p;
  EXPECT_EQ(kvq::eval::detail::sample(x.data(), 4, o, s, idx, p), 1);
  o.temperature = 0.7f;
  o.top_k = 1;
  EXPECT_EQ(kvq::eval::detail::sample(x.data(), 4, o, s, idx, p), 1);
}

TEST(Sampler, SeededSamplingIsReproducibleAndFollowsTheDistribution) {
  const std::vector<float> x = {0.0f, std::log(3.0f), -30.0f};  // p = 1/4, 3/4, ~0
  GenerateOptions o;
  o.temperature = 1.0f;
  o.top_k = 0;
  std::vector<int> idx;
  std::vector<double> p;
  auto draw = [&](uint64_t seed, int n) {
    uint64_t s = seed;
    std::vector<int> out;
    for (int i = 0; i < n; ++i) out.push_back(kvq::eval::detail::sample(x.data(), 3, o, s, idx, p));
    return out;
  };
  EXPECT_EQ(draw(5, 50), draw(5, 50));
  EXPECT_NE(draw(5, 50), draw(6, 50));
  const auto many = draw(11, 20000);
  const double ones = static_cast<double>(std::count(many.begin(), many.end(), 1)) / many.size();
  EXPECT_NEAR(ones, 0.75, 0.02);
  EXPECT_EQ(std::count(many.begin(), many.end(), 2), 0);
  o.top_k = 1;  // only the most likely token
  const auto top1 = draw(3, 100);
  EXPECT_EQ(std::count(top1.begin(), top1.end(), 1), 100);
}

/// Greedy generation with an f32 cache (chunked prefill, as kvq_generate runs it) against the
/// argmax of the whole sequence's forward through Fp32Backend.
void check_greedy_matches_forward(const std::string& path, const std::string& prompt, int n_gen) {
  const auto f = kvq::io::GgufFile::open(path);
  const auto tok = kvq::eval::GgufTokenizer::from_gguf(f);
  const std::vector<int> ids = tok.encode(prompt);
  kvq::eval::LlamaGgufModel model(f, static_cast<int>(ids.size()) + n_gen);
  kvq::CacheBackend kv(kvq::parse_policy("f32"), model.kv_geometry(), false, model.rope());
  kv.set_chunked(true);
  GenerateOptions o;
  o.max_tokens = n_gen;
  o.stop_at_end = false;
  const auto r = kvq::eval::generate(model, kv, ids, o, [&](int id) { return tok.is_end(id); });
  ASSERT_EQ(static_cast<int>(r.tokens.size()), n_gen);
  EXPECT_EQ(r.prompt_tokens, static_cast<int>(ids.size()));
  // Deterministic: a second run gives the same tokens.
  const auto r2 = kvq::eval::generate(model, kv, ids, o, [&](int id) { return tok.is_end(id); });
  EXPECT_EQ(r2.tokens, r.tokens);
  // The perplexity tool's forward: the whole sequence at once through Fp32Backend.
  std::vector<int> seq = ids;
  seq.insert(seq.end(), r.tokens.begin(), r.tokens.end() - 1);
  kvq::eval::Fp32Backend ref(model.kv_geometry());
  ref.reset();
  const auto lg = model.forward(seq, 0, ref);
  const int V = model.config().vocab_size;
  for (int i = 0; i < n_gen; ++i) {
    const float* row = lg.data() + static_cast<size_t>(ids.size() - 1 + i) * V;
    const int want = static_cast<int>(std::max_element(row, row + V) - row);
    EXPECT_EQ(r.tokens[static_cast<size_t>(i)], want) << "generated token " << i;
  }
  const std::string text = tok.decode(r.tokens);
  EXPECT_FALSE(text.empty());
  std::printf("%s%s\n", prompt.c_str(), text.c_str());
}

TEST(GenerateSmolLM2, GreedyF32MatchesTheForwardPass) {
  KVQ_REQUIRE_SMOLLM2();
  check_greedy_matches_forward(kvq_test::smollm2_gguf_path(), "Once upon a time", 24);
}

TEST(GenerateGemma3, GreedyF32MatchesTheForwardPass) {
  KVQ_REQUIRE_GEMMA3();
  check_greedy_matches_forward(kvq_test::gemma3_gguf_path(), "Once upon a time", 24);
}

TEST(GenerateGemma3, QuantizedCacheStaysClose) {
  // kivi4 through the chunked cache: the first generated tokens are those of the f32 cache
  // (the cache is quantized but the story starts the same).
  KVQ_REQUIRE_GEMMA3();
  const auto f = kvq::io::GgufFile::open(kvq_test::gemma3_gguf_path());
  const auto tok = kvq::eval::GgufTokenizer::from_gguf(f);
  const std::vector<int> ids = tok.encode("The little dog");
  kvq::eval::LlamaGgufModel model(f, static_cast<int>(ids.size()) + 8);
  GenerateOptions o;
  o.max_tokens = 8;
  o.stop_at_end = false;
  std::vector<std::vector<int>> outs;
  for (const char* spec : {"f32", "kivi4"}) {
    kvq::CacheBackend kv(kvq::parse_policy(spec), model.kv_geometry(), false, model.rope());
    kv.set_chunked(true);
    outs.push_back(kvq::eval::generate(model, kv, ids, o, {}).tokens);
    EXPECT_GT(kv.cache().memory_report().total(), 0u);
  }
  EXPECT_EQ(std::vector<int>(outs[0].begin(), outs[0].begin() + 3),
            std::vector<int>(outs[1].begin(), outs[1].begin() + 3));
}

}  // namespace
