// The BPE tokenizer (eval/bpe_tokenizer.hpp) on one long word: n repeated letters under the
// merges a+a, aa+aa, aaaa+aaaa. Merging is O(n log n) per word (a heap of adjacent pairs); the
// former rescan was quadratic (3.9 s at n = 65536, 65 s at 262144 on a 2-core AMD EPYC VM).
#include <benchmark/benchmark.h>

#include <string>
#include <vector>

#include "kvq/eval/bpe_tokenizer.hpp"

static void BM_BpeLongWord(benchmark::State& state) {
  std::vector<std::string> tokens;
  const auto& b2c = kvq::eval::detail::byte_to_codepoint();
  for (int b = 0; b < 256; ++b) {
    std::string s;
    kvq::eval::detail::append_utf8(b2c[static_cast<size_t>(b)], &s);
    tokens.push_back(s);
  }
  for (const char* t : {"aa", "aaaa", "aaaaaaaa"}) tokens.emplace_back(t);
  const kvq::eval::BpeTokenizer tok(tokens, {}, {"a a", "aa aa", "aaaa aaaa"}, "gpt2", false, -1, -1);
  const std::string word(static_cast<size_t>(state.range(0)), 'a');
  for (auto _ : state) {
    std::vector<int> ids = tok.encode(word);
    benchmark::DoNotOptimize(ids.data());
  }
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations()) * state.range(0));
}
BENCHMARK(BM_BpeLongWord)->Arg(16384)->Arg(65536)->Arg(262144)->Unit(benchmark::kMillisecond);
