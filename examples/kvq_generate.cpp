// kvq_generate: text generation from a GGUF model with its KV cache in kvq.
//
//   kvq_generate [--model M] [--policy SPEC] [--max-tokens N] [--temperature T] [--top-k K]
//                [--seed S] [--prerope] [--threads N] [--ids] "prompt"
//
// M: a GGUF file, or `smollm2` / `gemma3` for the ones fetched by ./kvq.sh model NAME (default
// smollm2). The prompt is tokenized as the file's metadata says (BOS first for Gemma), run as
// one prefill chunk through the cache (all its keys and values appended, then one causal
// attention for all its queries, as an engine's prefill does), then each new token is sampled,
// appended and attended (decode), its text streamed to stdout as it comes. At the end (stderr
// unless --ids) the prefill and decode speeds in tokens/s and the cache's bytes and effective
// bits next to what an f16 cache of the same tokens would take. Greedy (temperature 0, the
// default) is deterministic; with an f32 cache it picks the argmax of the same forward pass
// that kvq_perplexity evaluates (tests/eval/test_generate.cpp).
// --ids also prints the prompt's and the generated token ids (one line each) after the text.
// Exit codes: 0 success, 1 kvq error (bad model file, bad policy), 2 usage error.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "eval_model.hpp"
#include "kvq/eval/cache_backend.hpp"
#include "kvq/eval/generate.hpp"
#include "kvq/eval/gguf_tokenizer.hpp"
#include "kvq/eval/llama_gguf.hpp"
#include "kvq/io/gguf.hpp"
#include "kvq/policy/spec.hpp"

namespace {

void usage() {
  std::fprintf(stderr,
               "usage: kvq_generate [--model M] [--policy SPEC] [--max-tokens N] [--temperature T]\n"
               "  [--top-k K] [--seed S] [--prerope] [--threads N] [--ids] \"prompt\"\n"
               "--model: a GGUF file, or 'smollm2' / 'gemma3' for the GGUFs fetched by\n"
               "  ./kvq.sh model NAME (default smollm2)\n"
               "--policy: the KV cache policy (docs/policy.md; default f16)\n"
               "--max-tokens: tokens to generate at most (default 128; stops at the end token)\n"
               "--temperature: 0 = greedy (default); else sampling from the top-k (default 40)\n"
               "--seed: sampling seed (default 1)\n"
               "--prerope: keys cached before RoPE, rotated after dequantization (KVQuant)\n"
               "--threads: threads of the matrix products (default: all cores)\n"
               "--ids: also print the prompt's and the generated token ids\n");
}

[[noreturn]] void usage_error(const std::string& msg) {
  std::fprintf(stderr, "kvq_generate: %s\n", msg.c_str());
  usage();
  std::exit(2);
}

long parse_int(const std::string& flag, const char* v, long lo, long hi) {
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (!end || *end || x < lo || x > hi) {
    usage_error(flag + " needs an integer in [" + std::to_string(lo) + ", " +
                std::to_string(hi) + "], got '" + v + "'");
  }
  return x;
}

std::string ids_line(const std::vector<int>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? " " : "") + std::to_string(ids[i]);
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_arg = "smollm2", policy_arg = "f16", prompt;
  bool have_prompt = false, prerope = false, print_ids = false;
  int threads = 0;
  kvq::eval::GenerateOptions opt;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) usage_error(a + " needs a value");
      return argv[++i];
    };
    if (a == "--model") {
      model_arg = next();
    } else if (a == "--policy") {
      policy_arg = next();
    } else if (a == "--max-tokens") {
      opt.max_tokens = static_cast<int>(parse_int(a, next(), 0, 1 << 20));
    } else if (a == "--temperature") {
      const char* v = next();
      char* end = nullptr;
      const double t = std::strtod(v, &end);
      if (!end || *end || !(t >= 0.0 && t <= 100.0)) {
        usage_error(std::string("--temperature needs a number in [0, 100], got '") + v + "'");
      }
      opt.temperature = static_cast<float>(t);
    } else if (a == "--top-k") {
      opt.top_k = static_cast<int>(parse_int(a, next(), 0, 1 << 24));
    } else if (a == "--seed") {
      opt.seed = static_cast<uint64_t>(parse_int(a, next(), 0, 0x7FFFFFFF));
    } else if (a == "--threads") {
      threads = static_cast<int>(parse_int(a, next(), 1, 1024));
    } else if (a == "--prerope") {
      prerope = true;
    } else if (a == "--ids") {
      print_ids = true;
    } else if (a == "-h" || a == "--help") {
      usage();
      return 0;
    } else if (a.size() > 1 && a[0] == '-' && a[1] == '-') {
      usage_error("unknown argument '" + a + "'");
    } else if (have_prompt) {
      usage_error("one prompt only (quote it), got a second: '" + a + "'");
    } else {
      prompt = a;
      have_prompt = true;
    }
  }
  if (!have_prompt || prompt.empty()) usage_error("no prompt given");
  try {
    const kvq::Policy policy = kvq::parse_policy(policy_arg);
    const std::string path = kvq_tools::resolve_model(model_arg);
    KVQ_REQUIRE(kvq::io::GgufFile::is_gguf_file(path), kIo, "'", path,
                "' is not a GGUF file (kvq_generate runs GGUF models)");
    const auto f = kvq::io::GgufFile::open(path);
    const auto tok = kvq::eval::GgufTokenizer::from_gguf(f);
    const std::vector<int> ids = tok.encode(prompt);
    KVQ_REQUIRE(!ids.empty(), kInvalidArgument, "the prompt has no tokens");
    const int need = static_cast<int>(ids.size()) + std::max(0, opt.max_tokens - 1);
    kvq::eval::LlamaGgufModel model(f, need);
    if (threads > 0) model.set_threads(threads);
    const auto& c = model.config();
    if (model.max_tokens() < need) {
      opt.max_tokens = model.max_tokens() - static_cast<int>(ids.size()) + 1;
      KVQ_REQUIRE(opt.max_tokens > 0, kInvalidArgument, "the prompt (", ids.size(),
                  " tokens) fills the model's context of ", c.context_length);
      std::fprintf(stderr, "kvq_generate: --max-tokens cut to %d (context %d)\n", opt.max_tokens,
                   c.context_length);
    }
    // k@local / k@global terms become per-layer overrides for this model's layer kinds.
    const kvq::Policy bound = policy.bind_layer_kinds(c.layer_sliding, c.n_layers);
    kvq::CacheBackend kv(bound, model.kv_geometry(), prerope, model.rope());
    if (!c.layer_sliding.empty()) kv.set_layer_ropes(model.layer_ropes());
    kv.set_chunked(true);
    std::fprintf(stderr, "kvq_generate: %s (%s, %d layers, %d/%d heads of %d), cache %s%s\n",
                 path.c_str(), c.arch.c_str(), c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim,
                 policy.spec().c_str(), prerope ? " (keys before RoPE)" : "");
    std::fputs(prompt.c_str(), stdout);
    std::fflush(stdout);
    const auto r = kvq::eval::generate(
        model, kv, ids, opt, [&](int id) { return tok.is_end(id); },
        [&](int id) {
          if (tok.is_end(id)) return;
          const std::string piece = tok.piece_bytes(id);
          std::fwrite(piece.data(), 1, piece.size(), stdout);
          std::fflush(stdout);
        });
    std::fputs("\n", stdout);
    std::fflush(stdout);  // the text ends before the statistics (stderr) begin
    const auto m = kv.cache().memory_report();
    const double f16_bytes = 2.0 * static_cast<double>(m.elements());
    FILE* stats = print_ids ? stdout : stderr;
    if (print_ids) {
      std::fprintf(stdout, "prompt ids: %s\n", ids_line(ids).c_str());
      std::fprintf(stdout, "generated ids: %s\n", ids_line(r.tokens).c_str());
    }
    std::fprintf(stats,
                 "prefill: %d tokens in %.3f s (%.1f tokens/s); decode: %d tokens in %.3f s "
                 "(%.2f tokens/s)%s\n",
                 r.prompt_tokens, r.prefill_seconds, r.prefill_tokens_per_second(),
                 r.decode_steps(), r.decode_seconds, r.decode_tokens_per_second(),
                 r.stopped_at_end ? "; stopped at the end token" : "");
    int64_t released = 0;  // token slots the sliding-window layers gave back
    for (const auto& lm : m.layers) released += lm.released_tokens;
    std::fprintf(stats,
                 "KV cache (%s): %zu bytes for %lld tokens, %.2f bits/value; an f16 cache: "
                 "%.0f bytes (%.2fx the bytes of this one)\n",
                 policy.spec().c_str(), m.total(), static_cast<long long>(kv.cache().tokens(0)),
                 m.effective_bits(), f16_bytes, m.compression_vs_f16());
    if (released > 0) {
      std::fprintf(stats,
                   "sliding-window layers released the pages of %lld layer-tokens older than "
                   "their window (both caches above count only what is held)\n",
                   static_cast<long long>(released));
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvq_generate: %s\n", e.what());
    return 1;
  }
  return 0;
}
