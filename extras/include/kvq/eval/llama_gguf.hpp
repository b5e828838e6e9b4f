#pragma once
/// \file llama_gguf.hpp
/// Llama-family models read from GGUF files (llama.cpp's format), with the KV cache held by a
/// pluggable KVBackend exactly like the llama2.c model (eval/llama2c.hpp): every policy, the
/// simulated backend and pre-RoPE keys work unchanged on a real head_dim-64..128 model.
///
/// Architectures: "llama" (RMSNorm, RoPE on adjacent pairs — llama.cpp's NORM rope, because its
/// converter permutes the Q/K rows of Hugging Face checkpoints so that adjacent pairs are the
/// rotated ones —, GQA, SwiGLU, tied or separate output) and "qwen2" (the same with Q/K/V
/// biases and NEOX rope on (i, i + head_dim/2) pairs) and "gemma3" (Gemma 3: per-head RMSNorm of
/// queries and keys before RoPE, RMSNorm of the attention and feed-forward outputs before each
/// residual add, GELU(tanh)-gated feed-forward, embeddings scaled by sqrt(n_embd), NEOX rope,
/// query scale 1/sqrt(query_pre_attn_scalar or head_dim), sliding-window ("local") layers with
/// their own rope base and every `pattern`-th layer global, tied output; the stored norm weights
/// already include Gemma's +1, as llama.cpp's converter writes them). Anything else is refused
/// by name, as are features not implemented here (partial rotary dims, rope scaling, Llama-3.1
/// rope_freqs, logit soft-capping).
///
/// Weights are dequantized once to f32 at load (io/gguf.hpp), so the forward pass is plain f32
/// and its result depends only on the GGUF's stored values. A whole sequence is processed per
/// call (prefill-style): each layer's matrix products run over all its tokens through Eigen,
/// split by output rows over the machine's cores (std::thread), and the attention of each
/// token goes through the backend in order (append then attend, position by position, per
/// layer — the KVBackend contract).
// GCC 12 reports false -Wuninitialized / -Wmaybe-uninitialized inside its AVX-512 intrinsic
// headers when Eigen's GEMM kernels are instantiated with -march=native; silence them for this
// header only.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <Eigen/Core>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "kvq/core/error.hpp"
#include "kvq/core/rope.hpp"
#include "kvq/eval/bpe_tokenizer.hpp"
#include "kvq/eval/kv_backend.hpp"
#include "kvq/eval/llama2c.hpp"
#include "kvq/eval/metrics.hpp"
#include "kvq/io/gguf.hpp"

namespace kvq::eval {

/// Hyperparameters read from GGUF metadata (and tensor shapes).
struct LlamaGgufConfig {
  std::string arch;       ///< general.architecture ("llama", "qwen2" or "gemma3")
  std::string name;       ///< general.name (may be empty)
  int n_layers = 0;
  int dim = 0;            ///< embedding_length
  int hidden_dim = 0;     ///< feed_forward_length
  int n_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int vocab_size = 0;
  int context_length = 0;
  double rope_theta = 10000.0;
  RopeStyle rope_style = RopeStyle::kAdjacent;
  float rms_eps = 1e-5f;
  bool tied_output = false;  ///< no output.weight: logits use token_embd
  bool qkv_bias = false;
  // Gemma 3 (all off / neutral for llama and qwen2):
  bool qk_norm = false;        ///< per-head RMSNorm of q and k (attn_q_norm / attn_k_norm)
  bool post_norms = false;     ///< post_attention_norm / post_ffw_norm before the residual adds
  bool gelu = false;           ///< GELU(tanh)(gate) * up instead of SiLU(gate) * up
  float embed_scale = 1.0f;    ///< token embeddings multiplied by this (sqrt(n_embd) for Gemma)
  /// Multiplies the queries after RoPE so that the backend's 1/sqrt(head_dim) score scale
  /// becomes the model's (1 unless query_pre_attn_scalar differs from head_dim).
  float q_scale = 1.0f;
  int sliding_window = 0;      ///< tokens a sliding-window layer sees (0: no such layers)
  double rope_theta_swa = 0.0; ///< rope base of the sliding-window layers
  std::vector<char> layer_sliding;  ///< [n_layers] 1 for a sliding-window (local) layer

  int q_dim() const { return n_heads * head_dim; }
  int kv_dim() const { return n_kv_heads * head_dim; }
  /// RoPE of the global layers (every layer of a model without sliding windows).
  RopeConfig rope() const { return RopeConfig{rope_theta, rope_style}; }
  bool sliding(int layer) const {
    return !layer_sliding.empty() && layer_sliding[static_cast<size_t>(layer)] != 0;
  }
  /// The window of `layer` (0: global attention).
  int window(int layer) const { return sliding(layer) ? sliding_window : 0; }
  /// RoPE of `layer` (the sliding-window layers of Gemma 3 use their own base).
  RopeConfig rope(int layer) const {
    return RopeConfig{sliding(layer) ? rope_theta_swa : rope_theta, rope_style};
  }
  /// rope(layer) of every layer.
  std::vector<RopeConfig> layer_ropes() const {
    std::vector<RopeConfig> r;
    for (int l = 0; l < n_layers; ++l) r.push_back(rope(l));
    return r;
  }
};

namespace detail {

/// Threads used for the matrix products: the machine's cores (at least 1).
inline int gguf_threads() {
  const unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(std::min(n, 64u));
}

/// y[n, out] = x[n, in] * w[out, in]^T (all row-major), output columns split over threads.
/// Each thread computes whole columns with Eigen's single-threaded GEMM, so the result does not
/// depend on the thread count.
inline void matmul_rows(const float* x, int n, int in, const float* w, int out, float* y,
                        int threads) {
  using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using Stride = Eigen::OuterStride<>;
  const Eigen::Map<const RowMat> X(x, n, in);
  auto run = [&](int o0, int o1) {
    if (o1 <= o0) return;
    const Eigen::Map<const RowMat> W(w + static_cast<size_t>(o0) * in, o1 - o0, in);
    Eigen::Map<RowMat, 0, Stride> Y(y + o0, n, o1 - o0, Stride(out));
    Y.noalias() = X * W.transpose();
  };
  const double work = static_cast<double>(n) * in * out;
  int t = threads;
  if (work < 4e6) t = 1;  // not worth a thread
  t = std::min(t, std::max(1, out / 16));
  if (t <= 1) {
    run(0, out);
    return;
  }
  // Column chunks of a multiple of 16 so each thread's block stays vector-aligned in width.
  const int chunk = ((out + t - 1) / t + 15) / 16 * 16;
  std::vector<std::thread> pool;
  for (int i = 1; i < t; ++i) {
    const int o0 = std::min(out, i * chunk), o1 = std::min(out, (i + 1) * chunk);
    if (o0 < o1) pool.emplace_back(run, o0, o1);
  }
  run(0, std::min(out, chunk));
  for (auto& th : pool) th.join();
}

/// llama.cpp's RMSNorm: y = w * x / sqrt(mean(x^2) + eps) (sum of squares in double).
inline void rmsnorm_row(float* y, const float* x, const float* w, int n, float eps) {
  double ss = 0.0;
  for (int i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float scale = static_cast<float>(1.0 / std::sqrt(ss / n + static_cast<double>(eps)));
  for (int i = 0; i < n; ++i) y[i] = w[i] * (x[i] * scale);
}

/// GELU, tanh approximation (ggml_gelu, Gemma's hidden_activation "gelu_pytorch_tanh").
inline float gelu_tanh(float x) {
  constexpr float kSqrt2OverPi = 0.7978845608028654f;
  return 0.5f * x * (1.0f + std::tanh(kSqrt2OverPi * x * (1.0f + 0.044715f * x * x)));
}

}  // namespace detail

/// A Llama-family GGUF model, weights in f32.
class LlamaGgufModel {
 public:
  /// Loads `path`. max_tokens is the longest sequence a backend must hold (kv_geometry());
  /// it is clamped to the model's context length.
  explicit LlamaGgufModel(const std::string& path, int max_tokens = 512)
      : LlamaGgufModel(io::GgufFile::open(path), max_tokens) {}

  LlamaGgufModel(const io::GgufFile& f, int max_tokens = 512) : source_(f.source()) {
    load(f);
    KVQ_REQUIRE(max_tokens > 0, kInvalidArgument, "LlamaGgufModel: max_tokens must be > 0, got ",
                max_tokens);
    max_tokens_ = std::min(max_tokens, cfg_.context_length);
    threads_ = detail::gguf_threads();
  }

  const LlamaGgufConfig& config() const { return cfg_; }
  const std::string& source() const { return source_; }
  int max_tokens() const { return max_tokens_; }
  /// Threads for the matrix products (default: the machine's cores).
  void set_threads(int n) { threads_ = std::max(1, n); }
  int threads() const { return threads_; }

  KVGeometry kv_geometry() const {
    return KVGeometry{cfg_.n_layers, cfg_.n_kv_heads, cfg_.head_dim, max_tokens_};
  }
  /// RoPE of the global layers; rope(layer) / layer_ropes() for models whose sliding-window
  /// layers use another base (Gemma 3).
  RopeConfig rope() const { return cfg_.rope(); }
  RopeConfig rope(int layer) const { return cfg_.rope(layer); }
  std::vector<RopeConfig> layer_ropes() const { return cfg_.layer_ropes(); }

  /// Runs tokens[0..n) at positions pos0 .. pos0 + n - 1 (the backend must hold exactly pos0
  /// tokens in every layer: a kv.reset() before pos0 = 0) and writes n rows of vocab_size
  /// logits (row-major) into `logits` (nullptr: skip the output layer, e.g. to only fill the
  /// cache).
  void forward(const int* tokens, int n, int pos0, KVBackend& kv, float* logits) {
    forward_impl(tokens, n, pos0, kv, logits, false);
  }

  /// forward() that writes only the last token's row of logits (vocab_size floats): a
  /// prompt's prefill before generation.
  void forward_last(const int* tokens, int n, int pos0, KVBackend& kv, float* logits) {
    forward_impl(tokens, n, pos0, kv, logits, true);
  }

  /// forward() into a fresh [n, vocab] vector.
  std::vector<float> forward(const std::vector<int>& tokens, int pos0, KVBackend& kv) {
    std::vector<float> logits(tokens.size() * static_cast<size_t>(cfg_.vocab_size));
    forward(tokens.data(), static_cast<int>(tokens.size()), pos0, kv, logits.data());
    return logits;
  }

 private:
  void forward_impl(const int* tokens, int n, int pos0, KVBackend& kv, float* logits,
                    bool last_only) {
    const LlamaGgufConfig& c = cfg_;
    KVQ_REQUIRE(n > 0, kInvalidArgument, "LlamaGgufModel::forward: no tokens");
    KVQ_REQUIRE(pos0 >= 0 && n <= max_tokens_ - pos0, kInvalidArgument,
                "LlamaGgufModel::forward: positions [", pos0, ", ", int64_t{pos0} + n,
                ") exceed max_tokens ", max_tokens_);
    for (int t = 0; t < n; ++t) {
      KVQ_REQUIRE(tokens[t] >= 0 && tokens[t] < c.vocab_size, kInvalidArgument,
                  "LlamaGgufModel::forward: token ", tokens[t], " at index ", t,
                  " out of range [0, ", c.vocab_size, ")");
    }
    const int dim = c.dim, qd = c.q_dim(), kvd = c.kv_dim(), hd = c.head_dim, hid = c.hidden_dim;
    const auto N = static_cast<size_t>(n);
    x_.resize(N * dim);
    xn_.resize(N * dim);
    q_.resize(N * qd);
    k_.resize(N * kvd);
    kp_.resize(N * kvd);
    v_.resize(N * kvd);
    att_.resize(N * qd);
    g_.resize(N * hid);
    u_.resize(N * hid);
    for (int t = 0; t < n; ++t) {
      std::copy_n(tok_emb_.data() + static_cast<size_t>(tokens[t]) * dim, dim,
                  x_.data() + static_cast<size_t>(t) * dim);
    }
    if (c.embed_scale != 1.0f) {
      for (float& e : x_) e *= c.embed_scale;
    }
    for (int l = 0; l < c.n_layers; ++l) {
      const Layer& L = layers_[static_cast<size_t>(l)];
      for (int t = 0; t < n; ++t) {
        detail::rmsnorm_row(xn_.data() + t * size_t(dim), x_.data() + t * size_t(dim),
                            L.attn_norm.data(), dim, c.rms_eps);
      }
      detail::matmul_rows(xn_.data(), n, dim, L.wq.data(), qd, q_.data(), threads_);
      detail::matmul_rows(xn_.data(), n, dim, L.wk.data(), kvd, kp_.data(), threads_);
      detail::matmul_rows(xn_.data(), n, dim, L.wv.data(), kvd, v_.data(), threads_);
      if (c.qkv_bias) {
        add_bias(q_.data(), n, L.bq);
        add_bias(kp_.data(), n, L.bk);
        add_bias(v_.data(), n, L.bv);
      }
      if (c.qk_norm) {  // per head, in place (pre-RoPE keys are the normed ones)
        for (int r = 0; r < n * c.n_heads; ++r) {
          float* h = q_.data() + static_cast<size_t>(r) * hd;
          detail::rmsnorm_row(h, h, L.q_norm.data(), hd, c.rms_eps);
        }
        for (int r = 0; r < n * c.n_kv_heads; ++r) {
          float* h = kp_.data() + static_cast<size_t>(r) * hd;
          detail::rmsnorm_row(h, h, L.k_norm.data(), hd, c.rms_eps);
        }
      }
      k_ = kp_;
      const RopeConfig rope = c.rope(l);
      apply_rope_pairs(q_.data(), n, c.n_heads, hd, pos0, rope);
      apply_rope_pairs(k_.data(), n, c.n_kv_heads, hd, pos0, rope);
      if (c.q_scale != 1.0f) {
        for (size_t i = 0; i < N * qd; ++i) q_[i] *= c.q_scale;
      }
      const int window = c.window(l);
      if (n > 1 && kv.chunked()) {  // an engine's prefill: the whole chunk, then its queries
        kv.append_chunk(l, pos0, n, kp_.data(), k_.data(), v_.data());
        kv.attend_chunk(l, pos0, n, q_.data(), c.n_heads, att_.data(), window);
      } else {
        for (int t = 0; t < n; ++t) {
          const size_t ko = t * size_t(kvd);
          kv.append(l, pos0 + t, kp_.data() + ko, k_.data() + ko, v_.data() + ko);
          if (window > 0) {
            kv.attend_window(l, pos0 + t, q_.data() + t * size_t(qd), c.n_heads,
                             att_.data() + t * size_t(qd), window);
          } else {
            kv.attend(l, pos0 + t, q_.data() + t * size_t(qd), c.n_heads, att_.data() + t * size_t(qd));
          }
        }
      }
      detail::matmul_rows(att_.data(), n, qd, L.wo.data(), dim, xn_.data(), threads_);
      if (c.post_norms) post_norm(n, L.post_attn_norm);
      for (size_t i = 0; i < N * dim; ++i) x_[i] += xn_[i];

      for (int t = 0; t < n; ++t) {
        detail::rmsnorm_row(xn_.data() + t * size_t(dim), x_.data() + t * size_t(dim),
                            L.ffn_norm.data(), dim, c.rms_eps);
      }
      detail::matmul_rows(xn_.data(), n, dim, L.w_gate.data(), hid, g_.data(), threads_);
      detail::matmul_rows(xn_.data(), n, dim, L.w_up.data(), hid, u_.data(), threads_);
      if (c.gelu) {
        for (size_t i = 0; i < N * hid; ++i) g_[i] = detail::gelu_tanh(g_[i]) * u_[i];
      } else {
        for (size_t i = 0; i < N * hid; ++i) {
          const float a = g_[i];
          g_[i] = a / (1.0f + std::exp(-a)) * u_[i];  // SiLU(gate) * up
        }
      }
      detail::matmul_rows(g_.data(), n, hid, L.w_down.data(), dim, xn_.data(), threads_);
      if (c.post_norms) post_norm(n, L.post_ffn_norm);
      for (size_t i = 0; i < N * dim; ++i) x_[i] += xn_[i];
    }
    if (logits == nullptr) return;
    const int first = last_only ? n - 1 : 0;
    for (int t = first; t < n; ++t) {
      detail::rmsnorm_row(xn_.data() + t * size_t(dim), x_.data() + t * size_t(dim),
                          out_norm_.data(), dim, c.rms_eps);
    }
    const float* wout = c.tied_output ? tok_emb_.data() : output_.data();
    detail::matmul_rows(xn_.data() + first * size_t(dim), n - first, dim, wout, c.vocab_size,
                        logits, threads_);
  }

  struct Layer {
    std::vector<float> attn_norm, wq, wk, wv, wo, ffn_norm, w_gate, w_up, w_down, bq, bk, bv;
    std::vector<float> q_norm, k_norm, post_attn_norm, post_ffn_norm;  // Gemma 3
  };

  /// xn_ rows = RMSNorm(xn_ rows) * w (Gemma's norms of the attention / feed-forward outputs).
  void post_norm(int n, const std::vector<float>& w) {
    const int dim = cfg_.dim;
    for (int t = 0; t < n; ++t) {
      float* r = xn_.data() + static_cast<size_t>(t) * dim;
      detail::rmsnorm_row(r, r, w.data(), dim, cfg_.rms_eps);
    }
  }

  static void add_bias(float* x, int n, const std::vector<float>& b) {
    const size_t w = b.size();
    for (int t = 0; t < n; ++t)
      for (size_t i = 0; i < w; ++i) x[t * w + i] += b[i];
  }

  std::vector<float> tensor(const io::GgufFile& f, const std::string& name,
                            std::vector<int64_t> ne) const {
    std::vector<float> w = f.dequantize_tensor(name, ne);
    for (size_t i = 0; i < w.size(); ++i) {
      KVQ_REQUIRE(std::isfinite(w[i]), kIo, source_, ": tensor '", name, "' value ", i, " is ",
                  w[i], " after dequantization");
    }
    return w;
  }

  void load(const io::GgufFile& f) {
    LlamaGgufConfig& c = cfg_;
    c.arch = f.get_string("general.architecture");
    KVQ_REQUIRE(c.arch == "llama" || c.arch == "qwen2" || c.arch == "gemma3", kUnsupported,
                source_, ": architecture '", c.arch,
                "' is not implemented (implemented: llama, qwen2, gemma3)");
    c.name = f.get_string_or("general.name", "");
    const std::string a = c.arch + ".";
    c.n_layers = static_cast<int>(f.get_int(a + "block_count", 1, 4096));
    c.dim = static_cast<int>(f.get_int(a + "embedding_length", 1, 1 << 17));
    c.hidden_dim = static_cast<int>(f.get_int(a + "feed_forward_length", 1, 1 << 20));
    c.n_heads = static_cast<int>(f.get_int(a + "attention.head_count", 1, 1 << 12));
    c.n_kv_heads = static_cast<int>(
        f.get_int_or(a + "attention.head_count_kv", c.n_heads, 1, c.n_heads));
    KVQ_REQUIRE(c.n_heads % c.n_kv_heads == 0, kIo, source_, ": head_count ", c.n_heads,
                " is not a multiple of head_count_kv ", c.n_kv_heads);
    KVQ_REQUIRE(c.dim % c.n_heads == 0 || f.has(a + "attention.key_length"), kIo, source_,
                ": embedding_length ", c.dim, " is not a multiple of head_count ", c.n_heads);
    c.head_dim = static_cast<int>(f.get_int_or(a + "attention.key_length", c.dim / c.n_heads, 2, 1 << 12));
    const int64_t vlen = f.get_int_or(a + "attention.value_length", c.head_dim, 1, 1 << 12);
    KVQ_REQUIRE(vlen == c.head_dim, kUnsupported, source_, ": key_length ", c.head_dim,
                " != value_length ", vlen, " is not implemented");
    KVQ_REQUIRE(c.head_dim % 2 == 0, kIo, source_, ": head_dim ", c.head_dim, " is odd (RoPE pairs)");
    c.context_length = static_cast<int>(f.get_int_or(a + "context_length", 2048, 1, 1 << 24));
    const int64_t rope_dims = f.get_int_or(a + "rope.dimension_count", c.head_dim, 1, 1 << 12);
    KVQ_REQUIRE(rope_dims == c.head_dim, kUnsupported, source_, ": rope.dimension_count ",
                rope_dims, " != head_dim ", c.head_dim, " (partial rotary) is not implemented");
    c.rope_theta = f.get_float_or(a + "rope.freq_base", 10000.0);
    KVQ_REQUIRE(c.rope_theta > 1.0, kIo, source_, ": rope.freq_base ", c.rope_theta, " must be > 1");
    const std::string scaling = f.get_string_or(a + "rope.scaling.type", "none");
    const double factor = f.get_float_or(a + "rope.scaling.factor", 1.0);
    KVQ_REQUIRE((scaling == "none" || scaling == "linear") && (factor == 1.0 || factor == 0.0),
                kUnsupported, source_, ": rope scaling '", scaling, "' (factor ", factor,
                ") is not implemented");
    KVQ_REQUIRE(f.find_tensor("rope_freqs.weight") == nullptr, kUnsupported, source_,
                ": rope_freqs.weight (Llama-3.1 style rope frequency factors) is not implemented");
    c.rms_eps = static_cast<float>(f.get_float_or(a + "attention.layer_norm_rms_epsilon", 1e-5));
    KVQ_REQUIRE(c.rms_eps >= 0.0f && c.rms_eps < 1.0f, kIo, source_,
                ": attention.layer_norm_rms_epsilon ", c.rms_eps, " is outside [0, 1)");
    c.rope_style = c.arch == "llama" ? RopeStyle::kAdjacent : RopeStyle::kHalf;
    c.qkv_bias = c.arch == "qwen2";
    if (c.arch == "gemma3") load_gemma3(f, a);

    const io::GgufTensorInfo& emb = f.tensor("token_embd.weight");
    KVQ_REQUIRE(emb.ne.size() == 2 && emb.ne[0] == c.dim && emb.ne[1] >= 1 && emb.ne[1] <= (1 << 22),
                kIo, source_, ": token_embd.weight has extents ", io::detail::shape_str(emb.ne),
                ", expected [", c.dim, ", vocab]");
    c.vocab_size = static_cast<int>(emb.ne[1]);
    const int64_t D = c.dim, V = c.vocab_size, H = c.hidden_dim, Q = c.q_dim(), KV = c.kv_dim();
    tok_emb_ = tensor(f, "token_embd.weight", {D, V});
    out_norm_ = tensor(f, "output_norm.weight", {D});
    c.tied_output = f.find_tensor("output.weight") == nullptr;
    if (!c.tied_output) output_ = tensor(f, "output.weight", {D, V});
    layers_.resize(static_cast<size_t>(c.n_layers));
    for (int l = 0; l < c.n_layers; ++l) {
      const std::string p = "blk." + std::to_string(l) + ".";
      Layer& L = layers_[static_cast<size_t>(l)];
      L.attn_norm = tensor(f, p + "attn_norm.weight", {D});
      L.wq = tensor(f, p + "attn_q.weight", {D, Q});
      L.wk = tensor(f, p + "attn_k.weight", {D, KV});
      L.wv = tensor(f, p + "attn_v.weight", {D, KV});
      L.wo = tensor(f, p + "attn_output.weight", {Q, D});
      L.ffn_norm = tensor(f, p + "ffn_norm.weight", {D});
      L.w_gate = tensor(f, p + "ffn_gate.weight", {D, H});
      L.w_up = tensor(f, p + "ffn_up.weight", {D, H});
      L.w_down = tensor(f, p + "ffn_down.weight", {H, D});
      if (c.qk_norm) {
        L.q_norm = tensor(f, p + "attn_q_norm.weight", {c.head_dim});
        L.k_norm = tensor(f, p + "attn_k_norm.weight", {c.head_dim});
      }
      if (c.post_norms) {
        L.post_attn_norm = tensor(f, p + "post_attention_norm.weight", {D});
        L.post_ffn_norm = tensor(f, p + "post_ffw_norm.weight", {D});
      }
      if (c.qkv_bias) {
        L.bq = tensor(f, p + "attn_q.bias", {Q});
        L.bk = tensor(f, p + "attn_k.bias", {KV});
        L.bv = tensor(f, p + "attn_v.bias", {KV});
      }
    }
  }

  /// Gemma 3's hyper-parameters (after the common ones), with llama.cpp's defaults for the keys
  /// its converter may leave out: local layers' rope base 10000, every 6th layer global, query
  /// scale 1/sqrt(head_dim).
  void load_gemma3(const io::GgufFile& f, const std::string& a) {
    LlamaGgufConfig& c = cfg_;
    c.qk_norm = c.post_norms = c.gelu = true;
    c.embed_scale = std::sqrt(static_cast<float>(c.dim));
    for (const char* k : {"final_logit_softcapping", "attn_logit_softcapping"}) {
      const double cap = f.get_float_or(a + k, 0.0);
      KVQ_REQUIRE(cap == 0.0, kUnsupported, source_, ": ", a, k, " = ", cap,
                  " (logit soft-capping) is not implemented");
    }
    const double scalar = f.get_float_or(a + "attention.query_pre_attn_scalar", c.head_dim);
    KVQ_REQUIRE(scalar > 0.0, kIo, source_, ": attention.query_pre_attn_scalar ", scalar,
                " must be > 0");
    c.q_scale = static_cast<float>(std::sqrt(static_cast<double>(c.head_dim) / scalar));
    c.sliding_window = static_cast<int>(f.get_int_or(a + "attention.sliding_window", 0, 0, 1 << 24));
    c.rope_theta_swa = f.get_float_or(a + "rope.freq_base_swa", 10000.0);
    KVQ_REQUIRE(c.rope_theta_swa > 1.0, kIo, source_, ": rope.freq_base_swa ", c.rope_theta_swa,
                " must be > 1");
    c.layer_sliding.assign(static_cast<size_t>(c.n_layers), 0);
    if (c.sliding_window > 0) {
      const std::string pk = a + "attention.sliding_window_pattern";
      const io::GgufValue* pv = f.find(pk);
      if (pv != nullptr && pv->type == io::GgufValueType::kArray) {  // one bool per layer
        const std::vector<int64_t> v = f.get_ints(pk);
        KVQ_REQUIRE(static_cast<int>(v.size()) == c.n_layers, kIo, source_, ": ", pk, " has ",
                    v.size(), " entries for ", c.n_layers, " layers");
        for (int l = 0; l < c.n_layers; ++l) c.layer_sliding[static_cast<size_t>(l)] = v[static_cast<size_t>(l)] != 0;
      } else {  // every `period`-th layer global (llama.cpp's set_swa_pattern)
        const int period = static_cast<int>(f.get_int_or(pk, 6, 1, 1 << 12));
        for (int l = 0; l < c.n_layers; ++l)
          c.layer_sliding[static_cast<size_t>(l)] = period > 1 && l % period < period - 1;
      }
    }
  }

  std::string source_;
  LlamaGgufConfig cfg_;
  int max_tokens_ = 0;
  int threads_ = 1;
  std::vector<float> tok_emb_, out_norm_, output_;
  std::vector<Layer> layers_;
  // Scratch, [tokens, width] row-major.
  std::vector<float> x_, xn_, q_, k_, kp_, v_, att_, g_, u_;
};

// =============================================================================================
// Evaluation (shared/docs/reference.md's SmolLM2 protocol)
// =============================================================================================

/// Default cap on tokens per evaluated line (reference.md's protocol).
inline constexpr int kGgufEvalMaxTokens = 512;

/// Lines of a text file with a trailing '\r' removed (the reference protocol for GGUF models
/// reads lines as text; tinystories-dev.txt is CRLF, and keeping the '\r' would add one token
/// per line: 2164 predictions instead of reference.md's 2156).
inline std::vector<std::string> read_text_lines_stripped(const std::string& path) {
  std::vector<std::string> lines = read_text_lines(path);
  for (auto& l : lines) {
    if (!l.empty() && l.back() == '\r') l.pop_back();
  }
  return lines;
}

/// Perplexity of a GGUF model with attention served by `backend` over the non-empty `lines`:
/// each is one sequence, tokenized without BOS (unless the tokenizer's add_bos_token says
/// otherwise), cut to options.max_seq_len tokens (0: 512, clamped to the model's max_tokens);
/// positions 1..n-1 are predicted. KL against options.reference / reference_trace as in
/// llama2c.hpp's evaluate_text (same options and result types).
/// `tokenizer`: BpeTokenizer, SpmTokenizer or GgufTokenizer (eval/gguf_tokenizer.hpp; a
/// Gemma GGUF says add_bos_token, so its lines start with BOS and the 512 include it).
template <class Tokenizer>
EvalResult evaluate_text(LlamaGgufModel& model, const Tokenizer& tokenizer, KVBackend& backend,
                         const std::vector<std::string>& lines, const EvalOptions& options = {}) {
  using Clock = std::chrono::steady_clock;
  const auto seconds_since = [](Clock::time_point t0) {
    return std::chrono::duration<double>(Clock::now() - t0).count();
  };
  const auto call_start = Clock::now();
  const int vocab = model.config().vocab_size;
  detail::EvalScorer scorer(options, backend, vocab, tokenizer.vocab_size(), "tokens");
  EvalResult& r = scorer.result();
  const int cap = options.max_seq_len > 0 ? options.max_seq_len : kGgufEvalMaxTokens;
  const int max_len = std::min(cap, model.max_tokens());
  const auto nv = static_cast<size_t>(vocab);
  std::vector<float> logits, ref_logits;  // [n_in, vocab] of each run

  for (const std::string& line : lines) {
    if (line.empty()) continue;
    if (options.max_sequences > 0 && r.test.sequences >= options.max_sequences) break;
    std::vector<int> tokens = tokenizer.encode(line);
    if (static_cast<int>(tokens.size()) > max_len) tokens.resize(static_cast<size_t>(max_len));
    const int64_t seq = r.test.sequences;
    ++r.test.sequences;
    if (r.has_reference) ++r.reference.sequences;
    const int n_in = static_cast<int>(tokens.size()) - 1;  // the last token predicts nothing
    if (n_in <= 0) continue;
    logits.resize(static_cast<size_t>(n_in) * nv);
    backend.reset();
    auto t0 = Clock::now();
    model.forward(tokens.data(), n_in, 0, backend, logits.data());
    r.test.seconds += seconds_since(t0);
    r.test.forward_passes += n_in;
    if (options.reference) {
      options.reference->reset();
      ref_logits.resize(logits.size());
      t0 = Clock::now();
      model.forward(tokens.data(), n_in, 0, *options.reference, ref_logits.data());
      r.reference.seconds += seconds_since(t0);
      r.reference.forward_passes += n_in;
    }
    for (int pos = 0; pos < n_in; ++pos) {
      const size_t row = static_cast<size_t>(pos) * nv;
      const auto target = static_cast<size_t>(tokens[static_cast<size_t>(pos + 1)]);
      scorer.score(logits.data() + row, options.reference ? ref_logits.data() + row : nullptr,
                   target, seq, pos);
    }
  }
  EvalResult out = scorer.finish(lines.size(), "none with two or more tokens");
  out.seconds = seconds_since(call_start);
  return out;
}

}  // namespace kvq::eval

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
