#pragma once
// The real model behind the tools (kvq_perplexity, kvq_compare, kvq_make_dump): a llama2.c
// checkpoint with its tokenizer file, or a GGUF file (detected by its magic bytes) carrying
// its own tokenizer. One interface so every tool takes either, each with its own evaluation
// protocol:
//   llama2.c: BOS + line (the '\r' of a CRLF line kept), cut at the model's seq_len;
//   GGUF:     the line without '\r', BOS only if the GGUF says add_bos_token, cut at 512 tokens
//             (shared/docs/reference.md's SmolLM2 protocol).
// `--model smollm2` / `--model gemma3` name the GGUFs fetched by `./kvq.sh model NAME`.
#include <algorithm>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "kvq/core/rope.hpp"
#include "kvq/eval/gguf_tokenizer.hpp"
#include "kvq/eval/kv_backend.hpp"
#include "kvq/eval/llama2c.hpp"
#include "kvq/eval/llama_gguf.hpp"
#include "kvq/io/gguf.hpp"
#include "kvq/policy/spec.hpp"

namespace kvq_tools {

/// Where `./kvq.sh model` keeps models: $KVQ_MODEL_DIR, else ~/.cache/kvq/models.
inline std::string model_dir() {
  if (const char* d = std::getenv("KVQ_MODEL_DIR")) {
    if (*d) return d;
  }
  const char* home = std::getenv("HOME");
  return std::string(home && *home ? home : ".") + "/.cache/kvq/models";
}

/// The file name of SmolLM2 in the model cache.
inline std::string smollm2_path() { return model_dir() + "/SmolLM2-135M-Instruct.Q4_1.gguf"; }

/// The file name of Gemma 3 270M in the model cache.
inline std::string gemma3_path() { return model_dir() + "/gemma-3-270m-q4_k_m.gguf"; }

/// `--model` argument -> path: "smollm2" and "gemma3" name the cached GGUFs (`./kvq.sh model
/// NAME`), anything else is a path.
inline std::string resolve_model(const std::string& arg) {
  if (arg == "smollm2" || arg == "gemma3") {
    const std::string p = arg == "smollm2" ? smollm2_path() : gemma3_path();
    KVQ_REQUIRE(kvq::io::GgufFile::is_gguf_file(p), kIo, "model '", arg, "': '", p,
                "' not found; fetch it with ./kvq.sh model ", arg);
    return p;
  }
  return arg;
}

/// Records every layer's queries while an Fp32Backend holds K and V (pre- and post-RoPE).
class RecordingBackend final : public kvq::eval::KVBackend {
 public:
  explicit RecordingBackend(const kvq::eval::KVGeometry& g)
      : inner_(g), q_(static_cast<size_t>(g.n_layers)) {}
  void reset() override {
    inner_.reset();
    for (auto& q : q_) q.clear();
  }
  void append(int layer, int pos, const float* kp, const float* k, const float* v) override {
    inner_.append(layer, pos, kp, k, v);
  }
  void attend(int layer, int pos, const float* q, int n_heads, float* out) override {
    const int d = inner_.geometry().head_dim;
    auto& dst = q_[static_cast<size_t>(layer)];
    dst.insert(dst.end(), q, q + static_cast<size_t>(n_heads) * d);
    n_heads_ = n_heads;
    inner_.attend(layer, pos, q, n_heads, out);
  }
  void attend_window(int layer, int pos, const float* q, int n_heads, float* out,
                     int window) override {
    const int d = inner_.geometry().head_dim;
    auto& dst = q_[static_cast<size_t>(layer)];
    dst.insert(dst.end(), q, q + static_cast<size_t>(n_heads) * d);
    n_heads_ = n_heads;
    inner_.attend_window(layer, pos, q, n_heads, out, window);
  }
  const kvq::eval::Fp32Backend& inner() const { return inner_; }
  /// Queries of `layer`, [tokens, n_heads, head_dim] post-RoPE.
  const std::vector<float>& queries(int layer) const { return q_[static_cast<size_t>(layer)]; }
  int n_heads() const { return n_heads_; }

 private:
  kvq::eval::Fp32Backend inner_;
  std::vector<std::vector<float>> q_;
  int n_heads_ = 0;
};

/// A llama2.c or GGUF model with its tokenizer.
class EvalModel {
 public:
  /// `tok_path` is used by llama2.c models only (a GGUF carries its tokenizer).
  /// `gguf_max_tokens`: the longest sequence a GGUF model will run (clamped to its context
  /// length; the evaluation protocol needs 512).
  EvalModel(const std::string& model_arg, const std::string& tok_path,
            int gguf_max_tokens = kvq::eval::kGgufEvalMaxTokens)
      : path_(resolve_model(model_arg)) {
    if (kvq::io::GgufFile::is_gguf_file(path_)) {
      const auto f = kvq::io::GgufFile::open(path_);
      gguf_ = std::make_unique<kvq::eval::LlamaGgufModel>(f, gguf_max_tokens);
      bpe_ = std::make_unique<kvq::eval::GgufTokenizer>(kvq::eval::GgufTokenizer::from_gguf(f));
    } else {
      l2c_ = std::make_unique<kvq::eval::Llama2cModel>(path_);
      tok_ = std::make_unique<kvq::eval::Tokenizer>(tok_path, l2c_->config().vocab_size);
    }
  }
  bool is_gguf() const { return gguf_ != nullptr; }
  /// Threads of a GGUF model's matrix products (llama2.c models run on one thread).
  void set_threads(int n) {
    if (gguf_) gguf_->set_threads(n);
  }
  const std::string& path() const { return path_; }
  kvq::eval::KVGeometry kv_geometry() const {
    return gguf_ ? gguf_->kv_geometry() : l2c_->kv_geometry();
  }
  /// RoPE of the model's keys (for pre-RoPE key caches).
  kvq::RopeConfig rope() const { return gguf_ ? gguf_->rope() : kvq::RopeConfig{}; }
  /// `p` bound to this model's layer kinds (k@local / k@global terms become per-layer
  /// overrides; a llama2.c model has only global layers).
  kvq::Policy bind(const kvq::Policy& p) const {
    const int n = kv_geometry().n_layers;
    return p.bind_layer_kinds(gguf_ ? gguf_->config().layer_sliding : std::vector<char>{}, n);
  }
  /// Per-layer RoPE when the layers differ (Gemma 3's local and global layers), else empty.
  std::vector<kvq::RopeConfig> layer_ropes() const {
    if (!gguf_ || gguf_->config().layer_sliding.empty()) return {};
    return gguf_->layer_ropes();
  }
  int vocab_size() const {
    return gguf_ ? gguf_->config().vocab_size : l2c_->config().vocab_size;
  }
  /// One line of description for tool output.
  std::string describe() const {
    if (!gguf_) return "llama2.c model " + path_;
    const auto& c = gguf_->config();
    std::string swa;
    int n_swa = 0;
    for (int l = 0; l < c.n_layers; ++l) n_swa += c.sliding(l) ? 1 : 0;
    if (n_swa > 0) {
      swa = kvq::detail::cat(", sliding window ", c.sliding_window, " on ", n_swa, " of ",
                             c.n_layers, " layers (rope theta ", c.rope_theta_swa, ")");
    }
    return kvq::detail::cat("GGUF model ", path_, " (", c.arch, ", ", c.n_layers, " layers, ",
                            c.n_heads, "/", c.n_kv_heads, " heads of ", c.head_dim,
                            ", rope theta ", c.rope_theta, swa, ")");
  }
  /// The text's lines under the model's protocol.
  std::vector<std::string> read_lines(const std::string& path) const {
    return gguf_ ? kvq::eval::read_text_lines_stripped(path) : kvq::eval::read_text_lines(path);
  }
  /// Token ids of one line under the model's protocol, cut to the evaluation length.
  std::vector<int> encode_line(const std::string& line, int max_len = 0) const {
    std::vector<int> ids = gguf_ ? bpe_->encode(line) : tok_->encode(line, true);
    int cap = gguf_ ? kvq::eval::kGgufEvalMaxTokens : l2c_->config().seq_len;
    if (max_len > 0) cap = std::min(cap, max_len);
    cap = std::min(cap, kv_geometry().max_tokens);
    if (static_cast<int>(ids.size()) > cap) ids.resize(static_cast<size_t>(cap));
    return ids;
  }
  /// Runs `ids` from position 0 through `kv` (after kv.reset()); logits discarded.
  void run(const std::vector<int>& ids, kvq::eval::KVBackend& kv) {
    kv.reset();
    if (ids.empty()) return;
    if (gguf_) {
      gguf_->forward(ids.data(), static_cast<int>(ids.size()), 0, kv, nullptr);
      return;
    }
    std::vector<float> logits(static_cast<size_t>(vocab_size()));
    for (size_t p = 0; p < ids.size(); ++p) l2c_->forward(ids[p], static_cast<int>(p), kv, logits.data());
  }
  /// Runs ids[0..n) at positions pos0.. through `kv` (which holds exactly pos0 tokens) and
  /// writes the last token's logits into `last_logits` (vocab_size floats; nullptr: none).
  void forward(const int* ids, int n, int pos0, kvq::eval::KVBackend& kv, float* last_logits) {
    if (n <= 0) return;
    if (gguf_) {
      if (n > 1) gguf_->forward(ids, n - 1, pos0, kv, nullptr);
      std::vector<float> tmp;
      float* out = last_logits;
      if (!out) {
        tmp.resize(static_cast<size_t>(vocab_size()));
        out = tmp.data();
      }
      gguf_->forward(ids + n - 1, 1, pos0 + n - 1, kv, out);
      return;
    }
    std::vector<float> logits(static_cast<size_t>(vocab_size()));
    for (int i = 0; i < n; ++i) l2c_->forward(ids[i], pos0 + i, kv, logits.data());
    if (last_logits) std::copy(logits.begin(), logits.end(), last_logits);
  }
  /// Token ids of a text (the model's tokenizer; llama2.c: with BOS), no length cut.
  std::vector<int> encode(const std::string& text) const {
    return gguf_ ? bpe_->encode(text) : tok_->encode(text, true);
  }
  /// Longest sequence the model runs.
  int max_tokens() const { return kv_geometry().max_tokens; }

  kvq::eval::EvalResult evaluate(kvq::eval::KVBackend& kv, const std::vector<std::string>& lines,
                                 const kvq::eval::EvalOptions& opt) {
    return gguf_ ? kvq::eval::evaluate_text(*gguf_, *bpe_, kv, lines, opt)
                 : kvq::eval::evaluate_text(*l2c_, *tok_, kv, lines, opt);
  }

 private:
  std::string path_;
  std::unique_ptr<kvq::eval::Llama2cModel> l2c_;
  std::unique_ptr<kvq::eval::Tokenizer> tok_;
  std::unique_ptr<kvq::eval::LlamaGgufModel> gguf_;
  std::unique_ptr<kvq::eval::GgufTokenizer> bpe_;
};

}  // namespace kvq_tools
