// kvq_offload: why a quantized sequence is worth saving. Prefills a real model's sequence of N
// tokens into kvq's cache under a policy, saves the sequence (its checksummed archive), then
// measures two ways to the first new token:
//   recompute: prefill the N tokens again, then run the next token;
//   restore:   read the archive into an empty cache (every byte verified), then run the next
//              token;
// and checks that the restored sequence's next-token logits equal the never-saved one's bit
// for bit.
//
//   kvq_offload [--model M] [--tokenizer T] [--text F] [--policy SPEC] [--prefix N]
//               [--threads N] [--out FILE.kvqa]
//
// The prompt is the text's lines joined by spaces, repeated until N + 1 tokens (the model's
// tokenizer; cut to the model's context). --out keeps the archive on disk (default: a
// temporary file next to the working directory, removed at the end). Defaults: the stories260K
// model and text, policy kivi4, N = 200.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <unistd.h>

#include "eval_model.hpp"
#include "kvq/eval/cache_backend.hpp"
#include "kvq/io/archive.hpp"
#include "kvq/policy/spec.hpp"

namespace {

#ifndef KVQ_SHARED_DIR
#define KVQ_SHARED_DIR "../shared"
#endif

using Clock = std::chrono::steady_clock;
double secs(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

int parse_count(const std::string& flag, const char* v) {
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (!end || *end || x < 1 || x > 1 << 24) {
    std::fprintf(stderr, "kvq_offload: %s needs a positive integer, got '%s'\n", flag.c_str(), v);
    std::exit(2);
  }
  return static_cast<int>(x);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string base = std::string(KVQ_SHARED_DIR) + "/data/stories260K/";
  std::string model_path = base + "stories260K.bin", tok_path = base + "tok512.bin",
              text_path = base + "tinystories-dev.txt", policy_arg = "kivi4", out_path;
  int prefix = 200, threads = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "kvq_offload: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--model") model_path = next();
    else if (a == "--tokenizer") tok_path = next();
    else if (a == "--text") text_path = next();
    else if (a == "--policy") policy_arg = next();
    else if (a == "--prefix") prefix = parse_count(a, next());
    else if (a == "--threads") threads = parse_count(a, next());
    else if (a == "--out") out_path = next();
    else if (a == "-h" || a == "--help") {
      std::fprintf(stderr,
                   "usage: kvq_offload [--model M] [--tokenizer T] [--text F] [--policy SPEC]\n"
                   "                   [--prefix N] [--threads N] [--out FILE.kvqa]\n");
      return 0;
    } else {
      std::fprintf(stderr, "kvq_offload: unknown argument '%s'\n", a.c_str());
      return 2;
    }
  }
  const bool keep = !out_path.empty();
  if (!keep) out_path = "kvq_offload_" + std::to_string(::getpid()) + ".kvqa";
  int rc = 0;
  try {
    const kvq::Policy policy = kvq::parse_policy(policy_arg);
    kvq_tools::EvalModel model(model_path, tok_path, prefix + 1);
    if (threads > 0) model.set_threads(threads);
    const auto geo = model.kv_geometry();
    KVQ_REQUIRE(prefix + 1 <= model.max_tokens(), kInvalidArgument, "--prefix ", prefix,
                " leaves no room for the next token in the model's ", model.max_tokens(),
                " positions");
    std::string joined;
    for (const std::string& l : model.read_lines(text_path)) joined += (joined.empty() ? "" : " ") + l;
    KVQ_REQUIRE(!joined.empty(), kInvalidArgument, "'", text_path, "' has no text");
    std::vector<int> ids;
    while (static_cast<int>(ids.size()) < prefix + 1) {
      const std::vector<int> more = model.encode(joined);
      KVQ_REQUIRE(!more.empty(), kInvalidArgument, "the text encodes to no tokens");
      ids.insert(ids.end(), more.begin(), more.end());
    }
    ids.resize(static_cast<size_t>(prefix + 1));
    const int next_token = ids.back();
    const size_t V = static_cast<size_t>(model.vocab_size());

    // The original sequence: prefill N tokens (timed as "recompute"), save, then the next token.
    kvq::CacheBackend a(model.bind(policy), geo, false, model.rope());
    a.set_release_window(false);  // the archive holds the whole sequence
    a.reset();
    const auto t0 = Clock::now();
    model.forward(ids.data(), prefix, 0, a, nullptr);
    const auto t1 = Clock::now();
    const kvq::io::ArchiveSummary saved = kvq::io::save_archive(a.cache(), out_path);
    const auto t2 = Clock::now();
    std::vector<float> la(V), lb(V);
    model.forward(&next_token, 1, prefix, a, la.data());
    const auto t3 = Clock::now();

    // The restored sequence: an empty cache, the archive read into it, then the next token.
    kvq::CacheBackend b(model.bind(policy), geo, false, model.rope());
    b.set_release_window(false);
    b.reset();
    const auto t4 = Clock::now();
    kvq::io::load_archive(out_path, b.mutable_cache());
    const auto t5 = Clock::now();
    model.forward(&next_token, 1, prefix, b, lb.data());
    const auto t6 = Clock::now();

    const bool same = std::memcmp(la.data(), lb.data(), V * sizeof(float)) == 0;
    const double bytes = static_cast<double>(std::filesystem::file_size(out_path));
    const double recompute = secs(t0, t1) + secs(t2, t3), restore = secs(t4, t5) + secs(t5, t6);
    const auto rep = a.cache().memory_report();
    std::printf("%s; policy %s\n", model.describe().c_str(), policy.spec().c_str());
    std::printf("sequence: %d tokens prefilled, next token %d; cache %.3f MiB (%.2f bits/value), "
                "archive %.3f MiB (%s)\n",
                prefix, next_token, rep.total() / 1048576.0, rep.effective_bits(), bytes / 1048576.0,
                out_path.c_str());
    std::printf("save: %.3f s (%.2f GB/s)\n", secs(t1, t2), bytes / 1e9 / std::max(secs(t1, t2), 1e-9));
    std::printf("time to the first new token: recompute %.3f s (prefill %.3f s + next %.3f s), "
                "restore %.3f s (read %.3f s at %.2f GB/s + next %.3f s): %.1fx\n",
                recompute, secs(t0, t1), secs(t2, t3), restore, secs(t4, t5),
                bytes / 1e9 / std::max(secs(t4, t5), 1e-9), secs(t5, t6),
                recompute / std::max(restore, 1e-9));
    std::printf("next-token logits of the restored sequence: %s\n",
                same ? "identical to the never-saved sequence (bit for bit)" : "DIFFERENT");
    (void)saved;
    rc = same ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvq_offload: %s\n", e.what());
    rc = 1;
  }
  if (!keep) {
    std::error_code ec;
    std::filesystem::remove(out_path, ec);
  }
  return rc;
}
