#pragma once
/// \file generate.hpp
/// Text generation from a GGUF model (eval/llama_gguf.hpp) whose KV cache is held by any
/// KVBackend: the prompt runs as one prefill call (a chunked backend, such as a CacheBackend
/// with set_chunked(true), appends it whole and attends all its queries at once, as an engine
/// does), then one token at a time is sampled, appended and attended (decode).
///
/// Sampling: temperature 0 is greedy (the lowest id among equal maxima), deterministic for a
/// given cache; otherwise softmax(logits / temperature) over the top_k most likely tokens (0:
/// all), with a 64-bit generator of its own seeded by `seed` so the same seed gives the same
/// text on every platform.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <numeric>
#include <vector>

#include "kvq/core/error.hpp"
#include "kvq/eval/kv_backend.hpp"
#include "kvq/eval/llama_gguf.hpp"

namespace kvq::eval {

struct GenerateOptions {
  int max_tokens = 128;       ///< tokens to generate at most
  float temperature = 0.0f;   ///< 0: greedy
  int top_k = 40;             ///< sampling: the k most likely tokens (0: all)
  uint64_t seed = 1;          ///< sampling generator seed
  bool stop_at_end = true;    ///< stop after an end token (EOS / EOT)
};

struct GenerateResult {
  std::vector<int> tokens;     ///< generated ids (the end token included when it stopped there)
  int prompt_tokens = 0;
  double prefill_seconds = 0;  ///< the prompt's forward pass
  double decode_seconds = 0;   ///< every later forward pass and the sampling
  bool stopped_at_end = false;
  double prefill_tokens_per_second() const {
    return prefill_seconds > 0 ? prompt_tokens / prefill_seconds : 0.0;
  }
  /// Decode steps (tokens generated after the first, which the prefill's logits give).
  int decode_steps() const { return std::max(0, static_cast<int>(tokens.size()) - 1); }
  double decode_tokens_per_second() const {
    return decode_seconds > 0 ? decode_steps() / decode_seconds : 0.0;
  }
};

namespace detail {

/// splitmix64: a small generator with the same output everywhere.
inline uint64_t splitmix64(uint64_t& s) {
  uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/// The id of the largest logit (the lowest such id).
inline int argmax(const float* x, int n) {
  int best = 0;
  for (int i = 1; i < n; ++i)
    if (x[i] > x[best]) best = i;
  return best;
}

/// One sampled id (see the file comment); `state` is the generator's.
inline int sample(const float* logits, int n, const GenerateOptions& o, uint64_t& state,
                  std::vector<int>& idx, std::vector<double>& p) {
  if (o.temperature <= 0.0f) return argmax(logits, n);
  const int k = o.top_k > 0 ? std::min(o.top_k, n) : n;
  idx.resize(static_cast<size_t>(n));
  std::iota(idx.begin(), idx.end(), 0);
  const auto more = [&](int a, int b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), more);
  p.resize(static_cast<size_t>(k));
  const double mx = logits[idx[0]];
  double sum = 0;
  for (int i = 0; i < k; ++i) {
    p[static_cast<size_t>(i)] = std::exp((logits[idx[static_cast<size_t>(i)]] - mx) / o.temperature);
    sum += p[static_cast<size_t>(i)];
  }
  const double u = static_cast<double>(splitmix64(state) >> 11) * 0x1.0p-53 * sum;
  double acc = 0;
  for (int i = 0; i < k; ++i) {
    acc += p[static_cast<size_t>(i)];
    if (u < acc) return idx[static_cast<size_t>(i)];
  }
  return idx[static_cast<size_t>(k - 1)];
}

}  // namespace detail

/// Generates after `prompt` (token ids, BOS included when the model wants one) with the cache in
/// `kv` (reset first). `on_token` is called with each generated id as soon as it is chosen;
/// `is_end(id)` says which ids end the text. The backend must hold prompt.size() +
/// options.max_tokens - 1 tokens (the model's max_tokens bounds the positions).
inline GenerateResult generate(LlamaGgufModel& model, KVBackend& kv, const std::vector<int>& prompt,
                               const GenerateOptions& options,
                               const std::function<bool(int)>& is_end,
                               const std::function<void(int)>& on_token = {}) {
  using Clock = std::chrono::steady_clock;
  KVQ_REQUIRE(!prompt.empty(), kInvalidArgument, "generate: empty prompt");
  KVQ_REQUIRE(options.max_tokens >= 0, kInvalidArgument, "generate: max_tokens must be >= 0");
  KVQ_REQUIRE(std::isfinite(options.temperature) && options.temperature >= 0.0f, kInvalidArgument,
              "generate: temperature must be finite and >= 0, got ", options.temperature);
  const int n0 = static_cast<int>(prompt.size());
  KVQ_REQUIRE(n0 + std::max(0, options.max_tokens - 1) <= model.max_tokens(), kInvalidArgument,
              "generate: ", n0, " prompt tokens + ", options.max_tokens,
              " generated exceed the model's max_tokens ", model.max_tokens());
  const int vocab = model.config().vocab_size;
  GenerateResult r;
  r.prompt_tokens = n0;
  std::vector<float> logits(static_cast<size_t>(vocab));
  std::vector<int> idx;
  std::vector<double> p;
  uint64_t state = options.seed;
  kv.reset();
  if (options.max_tokens == 0) return r;
  auto t0 = Clock::now();
  model.forward_last(prompt.data(), n0, 0, kv, logits.data());
  r.prefill_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  t0 = Clock::now();
  for (int i = 0;; ++i) {
    const int id = detail::sample(logits.data(), vocab, options, state, idx, p);
    r.tokens.push_back(id);
    if (on_token) on_token(id);
    if (options.stop_at_end && is_end && is_end(id)) {
      r.stopped_at_end = true;
      break;
    }
    if (i + 1 >= options.max_tokens) break;
    model.forward(&id, 1, n0 + i, kv, logits.data());
  }
  r.decode_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return r;
}

}  // namespace kvq::eval
