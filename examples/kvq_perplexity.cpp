// kvq_perplexity: perplexity and next-token KL of a real model (llama2.c checkpoint or GGUF file)
// whose KV cache is held in kvq's quantized cache under each policy.
//
//   kvq_perplexity --model M [--tokenizer T] --text F --policy SPEC[;SPEC...] [--json]
//                  [--max-seqs N] [--seq-len N] [--simulate] [--prerope]
//
// M is a llama2.c checkpoint (then T is its tokenizer file), a GGUF file (detected by its magic;
// it carries its tokenizer), or `smollm2` / `gemma3`: the GGUFs fetched by `./kvq.sh model NAME`.
//
// The cache is kvq's streaming KVCache (keys and values packed in shared blocks), or with
// --simulate the SimulatedBackend (eval/simulated_backend.hpp: every key and value scale group
// quantized as soon as it is complete, the rule of the reference axis table).
//
// Each non-empty line of F is one sequence; every next-token prediction is counted. llama2.c:
// BOS prepended, truncated to the model's seq_len. GGUF (shared/docs/reference.md's protocol):
// the line without its '\r', no BOS unless the file's add_bos_token says so, cut at 512 tokens. The unquantized (f32) run is computed once and its
// logits are the reference for the KL of every policy. Defaults: the stories260K model, its
// tokenizer and tinystories-dev.txt from ../shared/data/stories260K, policy f32.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "kvq/eval/cache_backend.hpp"
#include "kvq/eval/simulated_backend.hpp"
#include "calibration_source.hpp"
#include "eval_model.hpp"
#include "kvq/eval/llama2c.hpp"
#include "kvq/policy/spec.hpp"
#include "report.hpp"

namespace {

#ifndef KVQ_SHARED_DIR
#define KVQ_SHARED_DIR "../shared"
#endif

/// Wraps the cache backend (or the simulated-quantization backend) to measure the cache at the
/// end of every sequence (before reset): the peak bytes and the bytes-weighted effective bits
/// over all sequences.
class MeasuringBackend final : public kvq::eval::KVBackend {
 public:
  MeasuringBackend(kvq::Policy p, const kvq::eval::KVGeometry& g, bool simulate, bool prerope,
                   const kvq::RopeConfig& rope = {},
                   std::vector<kvq::RopeConfig> layer_ropes = {},
                   kvq::DotProduct dot = kvq::DotProduct::kExact) {
    if (simulate) {
      KVQ_REQUIRE(!prerope || rope.style == kvq::RopeStyle::kAdjacent, kUnsupported,
                  "--simulate --prerope supports adjacent-pair RoPE only (this model rotates "
                  "(i, i + head_dim/2) pairs); use the streaming cache");
      kvq::SimulatedOptions o;
      o.prerope_keys = prerope;
      o.rope_theta = rope.theta;
      sim_ = std::make_unique<kvq::SimulatedBackend>(std::move(p), g, o);
    } else {
      cache_ = std::make_unique<kvq::CacheBackend>(std::move(p), g, prerope, rope);
      cache_->set_layer_ropes(std::move(layer_ropes));
      cache_->set_dot(dot);
    }
  }
  void reset() override {
    measure();
    inner().reset();
  }
  void append(int layer, int pos, const float* kp, const float* k, const float* v) override {
    inner().append(layer, pos, kp, k, v);
  }
  void attend(int layer, int pos, const float* q, int n_heads, float* out) override {
    inner().attend(layer, pos, q, n_heads, out);
  }
  void attend_window(int layer, int pos, const float* q, int n_heads, float* out,
                     int window) override {
    inner().attend_window(layer, pos, q, n_heads, out, window);
  }
  void measure() {
    std::size_t bytes = 0, elements = 0;
    if (sim_) {
      bytes = sim_->bytes();
      elements = sim_->elements();
    } else {
      const auto r = cache_->cache().memory_report();
      bytes = r.total();
      elements = r.elements();
    }
    if (elements == 0) return;
    peak_bytes_ = std::max(peak_bytes_, bytes);
    sum_bytes_ += static_cast<double>(bytes);
    sum_elements_ += static_cast<double>(elements);
  }
  std::size_t peak_bytes() const { return peak_bytes_; }
  double effective_bits() const { return sum_elements_ > 0 ? 8.0 * sum_bytes_ / sum_elements_ : 0; }

 private:
  kvq::eval::KVBackend& inner() {
    return sim_ ? static_cast<kvq::eval::KVBackend&>(*sim_) : *cache_;
  }
  std::unique_ptr<kvq::CacheBackend> cache_;
  std::unique_ptr<kvq::SimulatedBackend> sim_;
  std::size_t peak_bytes_ = 0;
  double sum_bytes_ = 0, sum_elements_ = 0;
};

void usage() {
  std::fprintf(stderr,
               "usage: kvq_perplexity [--model M] [--tokenizer T] [--text F] "
               "[--policy SPEC[;SPEC...]] [--json] [--max-seqs N] [--seq-len N] [--simulate]\n"
               "  [--prerope] [--threads N] [--dot exact|int8] [--calibrate PATH]\n"
               "  [--save-calibration FILE]\n"
               "--model: a llama2.c checkpoint (with --tokenizer), a GGUF file (its own tokenizer;\n"
               "  lines without '\\r', no BOS unless the file says so, cut at 512 tokens), or\n"
               "  'smollm2' / 'gemma3' for the GGUFs fetched by ./kvq.sh model NAME\n"
               "--threads: threads of a GGUF model's matrix products (default: all cores)\n"
               "--simulate: quantize each key/value scale group as soon as it is complete (keys\n"
               "  and values independently; simulated quantization, the reference table's rule)\n"
               "  instead of the streaming cache's shared blocks\n"
               "%s"
               "--dot: the fused attention's dot products: exact fp32 (default) or the int8\n"
               "  path (kvq::DotProduct::kInt8: int8 queries x int key codes, uint8 weights x\n"
               "  4-bit value codes)\n"
               "--prerope: quantize keys before RoPE and apply RoPE after dequantization\n"
               "  (KVQuant), in the streaming cache or with --simulate\n"
               "defaults: %s/data/stories260K/{stories260K.bin,tok512.bin,tinystories-dev.txt}, "
               "policy f32\n",
               kvq_tools::CalibrationArgs::usage(true).c_str(), KVQ_SHARED_DIR);
}

int parse_count(const std::string& flag, const char* v) {
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (!end || *end || x < 0 || x > 1 << 24) {
    std::fprintf(stderr, "kvq_perplexity: %s needs a non-negative integer, got '%s'\n",
                 flag.c_str(), v);
    std::exit(2);
  }
  return static_cast<int>(x);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string base = std::string(KVQ_SHARED_DIR) + "/data/stories260K/";
  std::string model_path = base + "stories260K.bin", tok_path = base + "tok512.bin",
              text_path = base + "tinystories-dev.txt", policy_arg = "f32";
  bool json = false, simulate = false, prerope = false;
  kvq::DotProduct dot = kvq::DotProduct::kExact;
  int threads = 0;
  kvq_tools::CalibrationArgs calib;
  kvq::eval::EvalOptions opt;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "kvq_perplexity: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (calib.parse("kvq_perplexity", argc, argv, i)) continue;
    if (a == "--model") model_path = next();
    else if (a == "--tokenizer") tok_path = next();
    else if (a == "--text") text_path = next();
    else if (a == "--policy") policy_arg = next();
    else if (a == "--json") json = true;
    else if (a == "--simulate") simulate = true;
    else if (a == "--prerope") prerope = true;
    else if (a == "--max-seqs") opt.max_sequences = parse_count(a, next());
    else if (a == "--seq-len") opt.max_seq_len = parse_count(a, next());
    else if (a == "--threads") threads = parse_count(a, next());
    else if (a == "--dot") {
      const std::string d = next();
      if (d == "exact") {
        dot = kvq::DotProduct::kExact;
      } else if (d == "int8") {
        dot = kvq::DotProduct::kInt8;
      } else {
        std::fprintf(stderr, "kvq_perplexity: --dot takes exact or int8, got '%s'\n", d.c_str());
        return 2;
      }
    }
    else if (a == "-h" || a == "--help") {
      usage();
      return 0;
    } else {
      std::fprintf(stderr, "kvq_perplexity: unknown argument '%s'\n", a.c_str());
      usage();
      return 2;
    }
  }
  try {
    KVQ_REQUIRE(!(simulate && dot != kvq::DotProduct::kExact), kInvalidArgument,
                "--dot int8 measures the fused attention of the streaming cache; --simulate "
                "has none");
    auto policies = kvq::parse_policies(policy_arg);
    kvq_tools::EvalModel model(model_path, tok_path);
    if (threads > 0) model.set_threads(threads);
    const auto lines = model.read_lines(text_path);
    const auto geo = model.kv_geometry();

    // Reference: the unquantized cache, recorded once.
    kvq::eval::LogitTrace trace;
    kvq::eval::Fp32Backend ref(geo);
    kvq::eval::EvalOptions ropt = opt;
    ropt.record_trace = &trace;
    const auto r0 = model.evaluate(ref, lines, ropt);

    // nuq policies: codebooks from --calibrate (a spec that needs one without it is an error).
    std::vector<std::string> names;  // specs as given (a calibrated policy lists every layer)
    for (const kvq::Policy& p : policies) names.push_back(p.spec());
    for (kvq::Policy& p : policies) p = model.bind(p);  // k@local / k@global -> per layer
    const std::string calib_what = kvq_tools::calibrate_policies(
        policies, calib, geo.n_layers, &geo, prerope,
        [&](const std::string& path, kvq::eval::KVBackend& rec) {
          model.evaluate(rec, model.read_lines(path), opt);
        },
        "kvq_perplexity");

    std::vector<kvq_tools::Row> rows;
    for (std::size_t pi = 0; pi < policies.size(); ++pi) {
      const kvq::Policy& p = policies[pi];
      std::fprintf(stderr, "kvq_perplexity: %s ...\n", names[pi].c_str());
      MeasuringBackend be(p, geo, simulate, prerope, model.rope(), model.layer_ropes(), dot);
      kvq::eval::EvalOptions popt = opt;
      popt.reference_trace = &trace;
      const auto r = model.evaluate(be, lines, popt);
      be.measure();
      kvq_tools::Row row;
      row.text = {{"policy", names[pi]}};
      row.num = {{"perplexity", r.test.perplexity()},
                 {"kl", r.mean_kl},
                 {"max_kl", r.max_kl},
                 {"tokens", static_cast<double>(r.test.tokens)},
                 {"cache_bytes", static_cast<double>(be.peak_bytes())},
                 {"effective_bits", be.effective_bits()},
                 {"seconds", r.seconds}};
      rows.push_back(row);
    }
    const std::vector<std::pair<std::string, std::string>> meta = {
        {"tool", "kvq_perplexity"},
        {"model", model.path()},
        {"model_description", model.describe()},
        {"reference_seconds", kvq_tools::raw_json(kvq_tools::json_number(r0.test.seconds))},
        {"text", text_path},
        {"calibration", calib_what.empty() ? std::string("none") : calib_what},
        {"cache", std::string(simulate ? "simulated (each group quantized when complete)"
                                       : "streaming KVCache") +
                      (prerope ? ", keys quantized before RoPE" : "")},
        {"dot", dot == kvq::DotProduct::kInt8 ? "int8" : "exact"},
        {"reference_perplexity", kvq_tools::raw_json(kvq_tools::json_number(r0.test.perplexity()))},
        {"reference_tokens", kvq_tools::raw_json(std::to_string(r0.test.tokens))}};
    if (json) {
      std::fputs(kvq_tools::to_json(rows, meta).c_str(), stdout);
    } else {
      std::printf("%s, text %s: %lld tokens, f32 reference perplexity %.4f (forward %.1f s)\n",
                  model.describe().c_str(), text_path.c_str(),
                  static_cast<long long>(r0.test.tokens), r0.test.perplexity(), r0.test.seconds);
      std::printf("cache: %s%s\n", simulate ? "simulated quantization (each key/value group "
                                              "quantized as soon as it is complete)"
                                            : "kvq streaming KVCache",
                  prerope ? "; keys quantized before RoPE, RoPE applied after dequantization" : "");
      std::printf("cache_bytes = peak over sequences (largest sequence); effective_bits = "
                  "bits per cached K/V value over all sequences, metadata and f32 windows "
                  "included\n\n");
      kvq_tools::print_table(rows);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvq_perplexity: %s\n", e.what());
    return 1;
  }
  return 0;
}
