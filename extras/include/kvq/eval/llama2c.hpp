#pragma once
/// \file llama2c.hpp
/// A real model to measure KV quantization on: llama2.c checkpoints (legacy export format),
/// their tokenizer, a float forward pass whose attention goes through a pluggable KVBackend,
/// and a perplexity / KL evaluation over a text file.
///
/// Why a model at all: tensor-level errors (metrics.hpp) do not say how much a model suffers.
/// Perplexity and the KL divergence of the next-token distribution against the unquantized run
/// do, and stories260K (shipped under shared/data) is small enough to evaluate in well under a
/// second, so every quantization scheme can be checked end to end in the test suite.
///
/// File formats (little-endian) are described in shared/data/stories260K/README.md. The forward
/// pass follows llama2.c's run.c numerically (float math, RMSNorm eps 1e-5, RoPE theta 10000 on
/// adjacent pairs, SwiGLU); only the summation order inside dot products differs.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <queue>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kvq/core/endian.hpp"
#include "kvq/core/error.hpp"
#include "kvq/eval/kv_backend.hpp"
#include "kvq/eval/metrics.hpp"

namespace kvq::eval {

namespace detail {

/// Limits on header fields. They are far above any llama2.c model (Llama-2-7B: dim 4096,
/// hidden 11008, 32 layers, vocab 32000, seq_len 4096) and exist so that a hostile header
/// cannot make size arithmetic overflow or ask for absurd allocations before the file-size
/// check rejects it.
constexpr int64_t kMaxDim = int64_t{1} << 16;
constexpr int64_t kMaxHidden = int64_t{1} << 20;
constexpr int64_t kMaxLayers = 1024;
constexpr int64_t kMaxVocab = int64_t{1} << 22;
constexpr int64_t kMaxSeqLen = int64_t{1} << 22;
/// Tokenizer limits: longest piece and whole-file size we accept.
constexpr int64_t kMaxTokenBytes = int64_t{1} << 16;
constexpr int64_t kMaxTokenizerFileBytes = int64_t{1} << 30;

constexpr int kHeaderInts = 7;
constexpr int64_t kHeaderBytes = kHeaderInts * 4;

inline bool host_is_little_endian() { return endian::host_little_endian(); }

inline int32_t load_i32(const unsigned char* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline float load_f32(const unsigned char* p) {
  float v;
  std::memcpy(&v, p, 4);
  return v;
}

/// Opens `path` for binary reading and returns its size; kIo when it cannot be opened.
inline int64_t open_sized(std::ifstream& in, const std::string& path, const char* what) {
  KVQ_REQUIRE(host_is_little_endian(), kUnsupported, "llama2.c ", what,
              " files are little-endian; this host is big-endian");
  in.open(path, std::ios::binary);
  KVQ_REQUIRE(in.good(), kIo, "cannot open ", what, " file '", path, "'");
  in.seekg(0, std::ios::end);
  const std::streamoff size = in.tellg();
  KVQ_REQUIRE(size >= 0, kIo, "cannot determine the size of ", what, " file '", path, "'");
  in.seekg(0, std::ios::beg);
  return static_cast<int64_t>(size);
}

inline void read_exact(std::ifstream& in, void* dst, int64_t bytes, const std::string& path,
                       int64_t offset) {
  in.read(static_cast<char*>(dst), static_cast<std::streamsize>(bytes));
  KVQ_REQUIRE(in.gcount() == static_cast<std::streamsize>(bytes), kIo, "'", path,
              "': short read of ", bytes, " bytes at byte offset ", offset);
}

/// out[i] = sum_j w[i, j] x[j] for a row-major [rows, cols] matrix. Four rows at a time share
/// each load of x and give the CPU four independent add chains; each row is summed like
/// detail::dot (eight partial sums, fixed tree), so the result does not depend on the row
/// grouping.
inline void matvec(const float* w, const float* x, int rows, int cols, float* out) {
  const auto ld = static_cast<size_t>(cols);
  int i = 0;
  for (; i + 4 <= rows && cols % 8 == 0; i += 4) {
    const float* w0 = w + static_cast<size_t>(i) * ld;
    const float* w1 = w0 + ld;
    const float* w2 = w1 + ld;
    const float* w3 = w2 + ld;
    float a0[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    float a1[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    float a2[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    float a3[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    for (int j = 0; j < cols; j += 8) {
      for (int u = 0; u < 8; ++u) {
        const float xv = x[j + u];
        a0[u] += w0[j + u] * xv;
        a1[u] += w1[j + u] * xv;
        a2[u] += w2[j + u] * xv;
        a3[u] += w3[j + u] * xv;
      }
    }
    out[i] = ((a0[0] + a0[1]) + (a0[2] + a0[3])) + ((a0[4] + a0[5]) + (a0[6] + a0[7]));
    out[i + 1] = ((a1[0] + a1[1]) + (a1[2] + a1[3])) + ((a1[4] + a1[5]) + (a1[6] + a1[7]));
    out[i + 2] = ((a2[0] + a2[1]) + (a2[2] + a2[3])) + ((a2[4] + a2[5]) + (a2[6] + a2[7]));
    out[i + 3] = ((a3[0] + a3[1]) + (a3[2] + a3[3])) + ((a3[4] + a3[5]) + (a3[6] + a3[7]));
  }
  for (; i < rows; ++i) out[i] = dot(w + static_cast<size_t>(i) * ld, x, cols);
}

/// RMSNorm as in llama2.c: o = w * x / sqrt(mean(x^2) + 1e-5). `o` may alias `x`.
inline void rmsnorm(float* o, const float* x, const float* w, int n) {
  float ss = 0.0f;
  for (int i = 0; i < n; ++i) ss += x[i] * x[i];
  ss = ss / static_cast<float>(n) + 1e-5f;
  const float inv = 1.0f / std::sqrt(ss);
  for (int i = 0; i < n; ++i) o[i] = w[i] * (inv * x[i]);
}

/// Rotates adjacent pairs (x[2i], x[2i+1]) of each head by angle pos * theta^(-2i/head_dim),
/// given the cos/sin of those angles for this position ([head_dim/2] each).
inline void rope(float* x, int heads, int head_dim, const float* cs, const float* sn) {
  for (int h = 0; h < heads; ++h) {
    float* xh = x + static_cast<size_t>(h) * static_cast<size_t>(head_dim);
    for (int i = 0; i < head_dim / 2; ++i) {
      const float a = xh[2 * i];
      const float b = xh[2 * i + 1];
      xh[2 * i] = a * cs[i] - b * sn[i];
      xh[2 * i + 1] = a * sn[i] + b * cs[i];
    }
  }
}

}  // namespace detail

// =============================================================================================
// Model
// =============================================================================================

/// Hyperparameters from a llama2.c checkpoint header.
struct Llama2cConfig {
  int dim = 0;         ///< residual stream width
  int hidden_dim = 0;  ///< FFN width
  int n_layers = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int vocab_size = 0;  ///< always positive here; the sign in the file only selects the classifier
  int seq_len = 0;     ///< longest sequence the model was trained on (RoPE positions)
  bool shared_classifier = true;  ///< classifier = token embedding (positive vocab in file)

  int head_dim() const { return dim / n_heads; }
  int kv_dim() const { return n_kv_heads * head_dim(); }
};

/// A llama2.c "legacy" checkpoint loaded into memory, plus the scratch its forward pass needs.
///
/// The weights are immutable after loading; forward() writes internal scratch buffers, so use
/// one model object per thread (copies are cheap relative to loading and independent).
class Llama2cModel {
 public:
  /// Loads and validates `path`. Throws kvq::Error(kIo) naming the file when it is missing,
  /// when its header is implausible, or when its size differs from what the header implies
  /// (truncated or padded files are rejected, not half-loaded).
  explicit Llama2cModel(const std::string& path) : path_(path) {
    std::ifstream in;
    const int64_t file_size = detail::open_sized(in, path, "model");
    KVQ_REQUIRE(file_size >= detail::kHeaderBytes, kIo, "model file '", path,
                "' is truncated: ", file_size, " bytes, shorter than the ", detail::kHeaderBytes,
                "-byte header");
    unsigned char hdr[detail::kHeaderBytes];
    detail::read_exact(in, hdr, detail::kHeaderBytes, path, 0);
    int32_t h[detail::kHeaderInts];
    for (int i = 0; i < detail::kHeaderInts; ++i) h[i] = detail::load_i32(hdr + 4 * i);
    parse_header(h);

    const int64_t expected = plan_layout();
    KVQ_REQUIRE(file_size == expected, kIo, "model file '", path, "' has ", file_size,
                " bytes but its header (", header_str(), ") implies ", expected, " bytes",
                file_size < expected ? " (truncated)" : " (trailing data)");

    const int64_t n_floats = (file_size - detail::kHeaderBytes) / 4;
    data_.resize(static_cast<size_t>(n_floats));
    detail::read_exact(in, data_.data(), n_floats * 4, path, detail::kHeaderBytes);
    check_finite();
    init_rope();
    init_scratch();
  }

  const Llama2cConfig& config() const { return cfg_; }
  const std::string& path() const { return path_; }

  /// What a KVBackend must hold for this model.
  KVGeometry kv_geometry() const {
    return KVGeometry{cfg_.n_layers, cfg_.n_kv_heads, cfg_.head_dim(), cfg_.seq_len};
  }

  /// Runs token `token` at position `pos` and writes vocab_size logits. Keys and values of
  /// every layer are appended to `kv`, and attention is delegated to it, so the model itself
  /// keeps no cache: positions must be fed 0, 1, 2, ... after a kv.reset().
  void forward(int token, int pos, KVBackend& kv, float* logits) {
    const Llama2cConfig& c = cfg_;
    KVQ_REQUIRE(token >= 0 && token < c.vocab_size, kInvalidArgument, "forward: token ", token,
                " out of range [0, ", c.vocab_size, ")");
    KVQ_REQUIRE(pos >= 0 && pos < c.seq_len, kInvalidArgument, "forward: position ", pos,
                " out of range [0, ", c.seq_len, ")");
    const int dim = c.dim;
    const int hd = c.head_dim();
    const int kv_dim = c.kv_dim();
    const int hidden = c.hidden_dim;

    // RoPE angles for this position, shared by every head and layer.
    for (int i = 0; i < hd / 2; ++i) {
      const double a = static_cast<double>(pos) * inv_freq_[static_cast<size_t>(i)];
      cos_[static_cast<size_t>(i)] = static_cast<float>(std::cos(a));
      sin_[static_cast<size_t>(i)] = static_cast<float>(std::sin(a));
    }

    float* x = x_.data();      // [dim] residual stream
    float* xb = xb_.data();    // [dim] normed input / attention output
    float* xb2 = xb2_.data();  // [dim]
    float* q = q_.data();      // [n_heads, head_dim]
    float* k = k_.data();      // [n_kv_heads, head_dim]
    float* kp = kp_.data();    // [n_kv_heads, head_dim] pre-RoPE
    float* v = v_.data();      // [n_kv_heads, head_dim]
    float* hb = hb_.data();    // [hidden]
    float* hb2 = hb2_.data();  // [hidden]
    std::copy_n(w(off_.tok_emb) + static_cast<size_t>(token) * dim, dim, x);

    for (int l = 0; l < c.n_layers; ++l) {
      detail::rmsnorm(xb, x, w(off_.rms_att) + static_cast<size_t>(l) * dim, dim);
      detail::matvec(w(off_.wq) + static_cast<size_t>(l) * dim * dim, xb, dim, dim, q);
      detail::matvec(w(off_.wk) + static_cast<size_t>(l) * kv_dim * dim, xb, kv_dim, dim, kp);
      detail::matvec(w(off_.wv) + static_cast<size_t>(l) * kv_dim * dim, xb, kv_dim, dim, v);
      std::copy_n(kp, kv_dim, k);
      detail::rope(q, c.n_heads, hd, cos_.data(), sin_.data());
      detail::rope(k, c.n_kv_heads, hd, cos_.data(), sin_.data());
      kv.append(l, pos, kp, k, v);
      kv.attend(l, pos, q, c.n_heads, xb);
      detail::matvec(w(off_.wo) + static_cast<size_t>(l) * dim * dim, xb, dim, dim, xb2);
      for (int i = 0; i < dim; ++i) x[i] += xb2[i];

      detail::rmsnorm(xb, x, w(off_.rms_ffn) + static_cast<size_t>(l) * dim, dim);
      detail::matvec(w(off_.w1) + static_cast<size_t>(l) * hidden * dim, xb, hidden, dim, hb);
      detail::matvec(w(off_.w3) + static_cast<size_t>(l) * hidden * dim, xb, hidden, dim, hb2);
      for (int i = 0; i < hidden; ++i) {
        const float g = hb[i];
        hb[i] = g / (1.0f + std::exp(-g)) * hb2[i];  // SiLU(w1 x) * (w3 x)
      }
      detail::matvec(w(off_.w2) + static_cast<size_t>(l) * dim * hidden, hb, dim, hidden, xb);
      for (int i = 0; i < dim; ++i) x[i] += xb[i];
    }
    detail::rmsnorm(x, x, w(off_.rms_final), dim);
    detail::matvec(w(off_.wcls), x, c.vocab_size, dim, logits);
  }

  /// forward() into a fresh vector.
  std::vector<float> forward(int token, int pos, KVBackend& kv) {
    std::vector<float> logits(static_cast<size_t>(cfg_.vocab_size));
    forward(token, pos, kv, logits.data());
    return logits;
  }

 private:
  /// Offsets (in floats, into data_) of each weight tensor; offsets rather than pointers so the
  /// model stays copyable. Matrices are row-major [out, in].
  struct Offsets {
    size_t tok_emb = 0;    // [vocab, dim]
    size_t rms_att = 0;    // [layers, dim]
    size_t wq = 0;         // [layers, dim, dim]
    size_t wk = 0;         // [layers, kv_dim, dim]
    size_t wv = 0;         // [layers, kv_dim, dim]
    size_t wo = 0;         // [layers, dim, dim]
    size_t rms_ffn = 0;    // [layers, dim]
    size_t w1 = 0;         // [layers, hidden, dim]
    size_t w2 = 0;         // [layers, dim, hidden]
    size_t w3 = 0;         // [layers, hidden, dim]
    size_t rms_final = 0;  // [dim]
    size_t freq_cis = 0;   // [2, seq_len, head_dim/2], unused (RoPE is recomputed)
    size_t wcls = 0;       // [vocab, dim]; == tok_emb when shared
    size_t end = 0;
  };

  const float* w(size_t off) const { return data_.data() + off; }

  std::string header_str() const {
    return kvq::detail::cat("dim=", cfg_.dim, ", hidden_dim=", cfg_.hidden_dim,
                            ", n_layers=", cfg_.n_layers, ", n_heads=", cfg_.n_heads,
                            ", n_kv_heads=", cfg_.n_kv_heads,
                            ", vocab_size=", cfg_.shared_classifier ? "" : "-", cfg_.vocab_size,
                            ", seq_len=", cfg_.seq_len);
  }

  void parse_header(const int32_t* h) {
    const char* names[detail::kHeaderInts] = {"dim",        "hidden_dim", "n_layers", "n_heads",
                                              "n_kv_heads", "vocab_size", "seq_len"};
    const int64_t limits[detail::kHeaderInts] = {
        detail::kMaxDim, detail::kMaxHidden, detail::kMaxLayers, detail::kMaxDim,
        detail::kMaxDim, detail::kMaxVocab,  detail::kMaxSeqLen};
    for (int i = 0; i < detail::kHeaderInts; ++i) {
      // vocab_size may be negative (separate classifier); its magnitude is what is limited.
      const int64_t v = (i == 5) ? std::llabs(int64_t{h[i]}) : int64_t{h[i]};
      KVQ_REQUIRE(v > 0 && v <= limits[i], kIo, "model file '", path_, "': header field ", names[i],
                  " = ", h[i], " at byte offset ", 4 * i, " is outside [1, ", limits[i], "]");
    }
    cfg_.dim = h[0];
    cfg_.hidden_dim = h[1];
    cfg_.n_layers = h[2];
    cfg_.n_heads = h[3];
    cfg_.n_kv_heads = h[4];
    cfg_.shared_classifier = h[5] > 0;
    cfg_.vocab_size = h[5] > 0 ? h[5] : -h[5];
    cfg_.seq_len = h[6];
    KVQ_REQUIRE(cfg_.dim % cfg_.n_heads == 0, kIo, "model file '", path_, "': dim ", cfg_.dim,
                " is not divisible by n_heads ", cfg_.n_heads);
    KVQ_REQUIRE(cfg_.n_kv_heads <= cfg_.n_heads && cfg_.n_heads % cfg_.n_kv_heads == 0, kIo,
                "model file '", path_, "': n_heads ", cfg_.n_heads,
                " is not a multiple of n_kv_heads ", cfg_.n_kv_heads);
    KVQ_REQUIRE(cfg_.head_dim() % 2 == 0, kIo, "model file '", path_, "': head_dim ",
                cfg_.head_dim(), " (dim/n_heads) is odd; RoPE rotates pairs of channels");
  }

  /// Assigns every tensor its offset in the order of the legacy export and returns the file
  /// size the header implies. With the header limits every product fits easily in 63 bits
  /// (largest term: layers * hidden * dim <= 2^46 floats), so plain int64 math is exact.
  int64_t plan_layout() {
    const int64_t dim = cfg_.dim;
    const int64_t hidden = cfg_.hidden_dim;
    const int64_t layers = cfg_.n_layers;
    const int64_t vocab = cfg_.vocab_size;
    const int64_t kv_dim = cfg_.kv_dim();
    const int64_t hd = cfg_.head_dim();
    const int64_t seq = cfg_.seq_len;
    int64_t o = 0;
    auto take = [&o](size_t* field, int64_t n) {
      *field = static_cast<size_t>(o);
      o += n;
    };
    take(&off_.tok_emb, vocab * dim);
    take(&off_.rms_att, layers * dim);
    take(&off_.wq, layers * dim * dim);
    take(&off_.wk, layers * kv_dim * dim);
    take(&off_.wv, layers * kv_dim * dim);
    take(&off_.wo, layers * dim * dim);
    take(&off_.rms_ffn, layers * dim);
    take(&off_.w1, layers * hidden * dim);
    take(&off_.w2, layers * dim * hidden);
    take(&off_.w3, layers * hidden * dim);
    take(&off_.rms_final, dim);
    take(&off_.freq_cis, seq * hd);  // freq_cis_real + freq_cis_imag, [seq_len, hd/2] each
    if (cfg_.shared_classifier) {
      off_.wcls = off_.tok_emb;
    } else {
      take(&off_.wcls, vocab * dim);
    }
    off_.end = static_cast<size_t>(o);
    return detail::kHeaderBytes + 4 * o;
  }

  /// A NaN or Inf weight would silently turn every perplexity into NaN; name its location.
  void check_finite() const {
    const size_t rope_begin = off_.freq_cis;
    const size_t rope_end =
        off_.freq_cis + static_cast<size_t>(cfg_.seq_len) * static_cast<size_t>(cfg_.head_dim());
    for (size_t i = 0; i < data_.size(); ++i) {
      if (i == rope_begin) i = rope_end;  // the skipped RoPE tables are never read
      if (i >= data_.size()) break;
      KVQ_REQUIRE(std::isfinite(data_[i]), kIo, "model file '", path_, "': non-finite weight ",
                  data_[i], " at byte offset ", detail::kHeaderBytes + 4 * static_cast<int64_t>(i));
    }
  }

  void init_rope() {
    const int hd = cfg_.head_dim();
    inv_freq_.resize(static_cast<size_t>(hd / 2));
    for (int i = 0; i < hd / 2; ++i) {
      inv_freq_[static_cast<size_t>(i)] =
          std::pow(10000.0, -static_cast<double>(2 * i) / static_cast<double>(hd));
    }
    cos_.assign(static_cast<size_t>(hd / 2), 0.0f);
    sin_.assign(static_cast<size_t>(hd / 2), 0.0f);
  }

  void init_scratch() {
    const auto dim = static_cast<size_t>(cfg_.dim);
    const auto kv = static_cast<size_t>(cfg_.kv_dim());
    const auto hidden = static_cast<size_t>(cfg_.hidden_dim);
    x_.assign(dim, 0.0f);
    xb_.assign(dim, 0.0f);
    xb2_.assign(dim, 0.0f);
    q_.assign(dim, 0.0f);
    k_.assign(kv, 0.0f);
    kp_.assign(kv, 0.0f);
    v_.assign(kv, 0.0f);
    hb_.assign(hidden, 0.0f);
    hb2_.assign(hidden, 0.0f);
  }

  std::string path_;
  Llama2cConfig cfg_;
  Offsets off_;
  std::vector<float> data_;  // everything after the header, as stored
  std::vector<double> inv_freq_;
  std::vector<float> cos_, sin_;
  std::vector<float> x_, xb_, xb2_, q_, k_, kp_, v_, hb_, hb2_;
};

// =============================================================================================
// Tokenizer
// =============================================================================================

/// llama2.c tokenizer (tok*.bin): SentencePiece-style BPE with byte fallback.
///
/// Encoding follows run.c: optional BOS, a dummy-prefix space when the text is non-empty,
/// each UTF-8 code point looked up as a piece (else one "<0xNN>" piece per byte, id byte + 3),
/// then repeatedly merge the adjacent pair whose concatenation is the highest-scoring piece
/// (leftmost on ties). The merge loop uses a priority queue, which picks the same pair at every
/// step as run.c's quadratic rescan. Unlike run.c, control pieces (ids 0..2) and byte pieces
/// can never be produced by a merge or matched from text, as in SentencePiece; text containing
/// a literal "<0x41>" therefore stays literal.
class Tokenizer {
 public:
  static constexpr int kUnk = 0;
  static constexpr int kBos = 1;
  static constexpr int kEos = 2;
  static constexpr int kByteOffset = 3;  ///< byte b is token b + 3
  static constexpr int kMinVocab = kByteOffset + 256;

  /// Loads `path`. With vocab_size > 0 exactly that many pieces must be present (as llama2.c,
  /// which takes the count from the model) and trailing bytes are an error; with vocab_size <=
  /// 0 pieces are read until the end of the file. Throws kvq::Error(kIo) naming the file and
  /// byte offset for truncation, negative or absurd lengths, non-finite scores, and a missing
  /// byte-fallback table.
  explicit Tokenizer(const std::string& path, int vocab_size = 0) : path_(path) {
    std::ifstream in;
    const int64_t size = detail::open_sized(in, path, "tokenizer");
    KVQ_REQUIRE(size <= detail::kMaxTokenizerFileBytes, kIo, "tokenizer file '", path, "' is ",
                size, " bytes, more than the ", detail::kMaxTokenizerFileBytes, "-byte limit");
    std::vector<unsigned char> buf(static_cast<size_t>(size));
    if (size > 0) detail::read_exact(in, buf.data(), size, path, 0);
    parse(buf, vocab_size);
  }

  int vocab_size() const { return static_cast<int>(pieces_.size()); }
  int max_token_length() const { return max_token_length_; }
  const std::string& piece(int id) const {
    check_id(id);
    return pieces_[static_cast<size_t>(id)];
  }
  float score(int id) const {
    check_id(id);
    return scores_[static_cast<size_t>(id)];
  }

  /// Token ids of `text`, with BOS first when `bos` and EOS last when `eos`.
  std::vector<int> encode(const std::string& text, bool bos, bool eos = false) const {
    std::vector<int> ids;
    if (!text.empty()) {
      ids.reserve(text.size() + 1);
      push_piece_or_bytes(" ", &ids);  // dummy prefix: words are stored with a leading space
      const size_t n = text.size();
      size_t i = 0;
      while (i < n) {
        // One UTF-8 code point: a lead byte and up to three continuation bytes (a stray
        // continuation byte starts its own unit and falls back to bytes).
        size_t j = i + 1;
        while (j < n && j - i < 4 && (static_cast<unsigned char>(text[j]) & 0xC0) == 0x80) ++j;
        push_piece_or_bytes(text.substr(i, j - i), &ids);
        i = j;
      }
      merge(&ids);
    }
    if (bos) ids.insert(ids.begin(), kBos);
    if (eos) ids.push_back(kEos);
    return ids;
  }

  /// Text of `token` when it follows `prev` (run.c semantics): the dummy-prefix space is
  /// dropped right after BOS, byte pieces decode to their raw byte, other pieces (including
  /// the control pieces' own text) are returned as stored.
  std::string decode(int prev, int token) const {
    check_id(token);
    if (token >= kByteOffset && token < kByteOffset + 256) {
      return std::string(1, static_cast<char>(token - kByteOffset));
    }
    const std::string& p = pieces_[static_cast<size_t>(token)];
    if (prev == kBos && !p.empty() && p[0] == ' ') return p.substr(1);
    return p;
  }

  /// Text of a token sequence: BOS and EOS are skipped, and the sequence is decoded as if it
  /// followed a BOS, so decode(encode(s, bos)) == s for any s.
  std::string decode(const std::vector<int>& tokens) const {
    std::string out;
    int prev = kBos;
    for (int t : tokens) {
      if (t == kBos || t == kEos) {
        check_id(t);
        prev = t;
        continue;
      }
      out += decode(prev, t);
      prev = t;
    }
    return out;
  }

 private:
  void check_id(int id) const {
    KVQ_REQUIRE(id >= 0 && id < vocab_size(), kInvalidArgument, "token id ", id,
                " out of range [0, ", vocab_size(), ")");
  }

  void parse(const std::vector<unsigned char>& buf, int vocab_size) {
    const auto size = static_cast<int64_t>(buf.size());
    KVQ_REQUIRE(size >= 4, kIo, "tokenizer file '", path_, "' is truncated: ", size,
                " bytes, no room for the 4-byte max_token_length");
    max_token_length_ = detail::load_i32(buf.data());
    KVQ_REQUIRE(max_token_length_ > 0 && max_token_length_ <= detail::kMaxTokenBytes, kIo,
                "tokenizer file '", path_, "': max_token_length ", max_token_length_,
                " at byte offset 0 is outside [1, ", detail::kMaxTokenBytes, "]");
    KVQ_REQUIRE(vocab_size <= detail::kMaxVocab, kInvalidArgument, "tokenizer: vocab_size ",
                vocab_size, " exceeds ", detail::kMaxVocab);
    int64_t off = 4;
    while (vocab_size > 0 ? static_cast<int64_t>(pieces_.size()) < vocab_size : off < size) {
      const auto id = static_cast<int64_t>(pieces_.size());
      KVQ_REQUIRE(id < detail::kMaxVocab, kIo, "tokenizer file '", path_, "' has more than ",
                  detail::kMaxVocab, " pieces");
      KVQ_REQUIRE(size - off >= 8, kIo, "tokenizer file '", path_, "' is truncated: token ", id,
                  " needs an 8-byte score and length at byte offset ", off, " but the file has ",
                  size, " bytes");
      const float sc = detail::load_f32(buf.data() + off);
      const int32_t len = detail::load_i32(buf.data() + off + 4);
      KVQ_REQUIRE(std::isfinite(sc), kIo, "tokenizer file '", path_, "': token ", id,
                  " has non-finite score ", sc, " at byte offset ", off);
      KVQ_REQUIRE(len >= 0 && len <= max_token_length_, kIo, "tokenizer file '", path_, "': token ",
                  id, " has length ", len, " at byte offset ", off + 4,
                  ", outside [0, max_token_length=", max_token_length_, "]");
      off += 8;
      KVQ_REQUIRE(size - off >= len, kIo, "tokenizer file '", path_, "' is truncated: token ", id,
                  " needs ", len, " bytes at byte offset ", off, " but the file has ", size,
                  " bytes");
      pieces_.emplace_back(reinterpret_cast<const char*>(buf.data() + off),
                           static_cast<size_t>(len));
      scores_.push_back(sc);
      off += len;
    }
    KVQ_REQUIRE(off == size, kIo, "tokenizer file '", path_, "' has ", size - off,
                " trailing bytes after ", pieces_.size(), " pieces (byte offset ", off, ")");
    KVQ_REQUIRE(vocab_size_ok(), kIo, "tokenizer file '", path_, "' has ", pieces_.size(),
                " pieces; at least ", kMinVocab, " are needed for the byte-fallback table");
    for (int b = 0; b < 256; ++b) {
      char want[8];
      std::snprintf(want, sizeof(want), "<0x%02X>", b);
      KVQ_REQUIRE(pieces_[static_cast<size_t>(kByteOffset + b)] == want, kIo, "tokenizer file '",
                  path_, "': piece ", kByteOffset + b, " is '",
                  pieces_[static_cast<size_t>(kByteOffset + b)], "', expected the byte piece '",
                  want, "'");
    }
    lookup_.reserve(pieces_.size());
    for (size_t id = kMinVocab; id < pieces_.size(); ++id) {
      lookup_.emplace(pieces_[id], static_cast<int>(id));  // first of duplicates wins
    }
  }

  bool vocab_size_ok() const { return static_cast<int64_t>(pieces_.size()) >= kMinVocab; }

  void push_piece_or_bytes(const std::string& s, std::vector<int>* ids) const {
    const auto it = lookup_.find(s);
    if (it != lookup_.end()) {
      ids->push_back(it->second);
      return;
    }
    for (unsigned char ch : s) ids->push_back(kByteOffset + ch);
  }

  /// BPE merges with a max-heap of candidate pairs keyed by (score, leftmost). Symbols live in
  /// a doubly linked list; a symbol keeps the index of its first original unit, so list order
  /// equals index order and "leftmost" is "smallest index". Stale heap entries (a side already
  /// merged) are detected by per-symbol version counters and skipped.
  void merge(std::vector<int>* ids) const {
    struct Sym {
      int id;
      int prev;
      int next;
      uint32_t version;
    };
    struct Cand {
      float score;
      int left;
      int right;
      uint32_t left_version;
      uint32_t right_version;
      int merged;
    };
    struct Lower {
      bool operator()(const Cand& a, const Cand& b) const {
        if (a.score != b.score) return a.score < b.score;
        return a.left > b.left;
      }
    };
    // run.c starts its best-score search at -1e10, so pairs scoring at or below it never merge.
    constexpr float kMinMergeScore = -1e10f;

    const int n = static_cast<int>(ids->size());
    if (n < 2) return;
    std::vector<Sym> sym(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) {
      const int next = i + 1 < n ? i + 1 : -1;
      sym[static_cast<size_t>(i)] = Sym{(*ids)[static_cast<size_t>(i)], i - 1, next, 0};
    }
    std::priority_queue<Cand, std::vector<Cand>, Lower> heap;
    std::string cat;
    auto consider = [&](int l, int r) {
      if (l < 0 || r < 0) return;
      const Sym& a = sym[static_cast<size_t>(l)];
      const Sym& b = sym[static_cast<size_t>(r)];
      cat = pieces_[static_cast<size_t>(a.id)];
      cat += pieces_[static_cast<size_t>(b.id)];
      const auto it = lookup_.find(cat);
      if (it == lookup_.end()) return;
      const float sc = scores_[static_cast<size_t>(it->second)];
      if (!(sc > kMinMergeScore)) return;
      heap.push(Cand{sc, l, r, a.version, b.version, it->second});
    };
    for (int i = 0; i + 1 < n; ++i) consider(i, i + 1);
    while (!heap.empty()) {
      const Cand c = heap.top();
      heap.pop();
      Sym& a = sym[static_cast<size_t>(c.left)];
      Sym& b = sym[static_cast<size_t>(c.right)];
      if (a.id < 0 || b.id < 0 || a.next != c.right || a.version != c.left_version ||
          b.version != c.right_version) {
        continue;  // stale: one side was merged since this candidate was queued
      }
      a.id = c.merged;
      ++a.version;
      a.next = b.next;
      if (b.next >= 0) sym[static_cast<size_t>(b.next)].prev = c.left;
      b.id = -1;
      ++b.version;
      consider(a.prev, c.left);
      consider(c.left, a.next);
    }
    ids->clear();
    for (int i = 0; i >= 0; i = sym[static_cast<size_t>(i)].next) {
      ids->push_back(sym[static_cast<size_t>(i)].id);
    }
  }

  std::string path_;
  int max_token_length_ = 0;
  std::vector<std::string> pieces_;
  std::vector<float> scores_;
  std::unordered_map<std::string, int> lookup_;  // mergeable pieces -> id
};

// =============================================================================================
// Generation and evaluation
// =============================================================================================

/// Greedy (argmax) continuation of `prompt` (which should start with BOS). Stops after
/// `max_new_tokens` or when the model emits BOS or EOS (llama2.c's sequence delimiters), or at
/// the model's seq_len. Returns only the new tokens. Ties go to the lowest id.
inline std::vector<int> generate_greedy(Llama2cModel& model, KVBackend& kv,
                                        const std::vector<int>& prompt, int max_new_tokens) {
  KVQ_REQUIRE(!prompt.empty(), kInvalidArgument, "generate_greedy: empty prompt");
  const int vocab = model.config().vocab_size;
  const int seq_len = model.config().seq_len;
  std::vector<float> logits(static_cast<size_t>(vocab));
  std::vector<int> out;
  kv.reset();
  int token = prompt[0];
  for (int pos = 0; pos < seq_len; ++pos) {
    model.forward(token, pos, kv, logits.data());
    if (pos + 1 < static_cast<int>(prompt.size())) {
      token = prompt[static_cast<size_t>(pos + 1)];
      continue;
    }
    if (static_cast<int>(out.size()) >= max_new_tokens) break;
    const int next =
        static_cast<int>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    if (next == Tokenizer::kBos || next == Tokenizer::kEos) break;
    out.push_back(next);
    token = next;
  }
  return out;
}

/// Logits of every counted prediction of one evaluation, [predictions, vocab] row-major, in
/// evaluation order. Recording the float logits (not probabilities) lets a later evaluation
/// compute exactly the KL a lockstep run would, without re-running the reference.
struct LogitTrace {
  int vocab_size = 0;
  std::vector<float> logits;
  int64_t predictions() const {
    return vocab_size > 0 ? static_cast<int64_t>(logits.size()) / vocab_size : 0;
  }
};

struct EvalOptions {
  /// Tokens per sequence including BOS; longer lines are truncated. 0 = the model's seq_len
  /// (larger values are clamped to it).
  int max_seq_len = 0;
  /// Evaluate only the first this-many non-empty lines; 0 = all.
  int max_sequences = 0;
  /// Run this backend (normally an Fp32Backend) in lockstep on the same tokens and report the
  /// KL divergence of the test run's next-token distribution from it.
  KVBackend* reference = nullptr;
  /// Alternative to `reference`: logits recorded from an earlier run on the same lines and
  /// options (record_trace). Must not be combined with `reference`.
  const LogitTrace* reference_trace = nullptr;
  /// When set, the tested backend's logits are recorded here (replacing its contents).
  LogitTrace* record_trace = nullptr;
};

/// Counts of one run over the text.
struct RunStats {
  double total_nll = 0.0;  ///< sum of -log p(actual next token), nats
  int64_t tokens = 0;      ///< predictions counted: n - 1 for a sequence of n incl. BOS
  int64_t sequences = 0;   ///< lines evaluated
  int64_t forward_passes = 0;
  double seconds = 0.0;  ///< wall time spent in this run's forward passes (0 for a trace)

  double mean_nll() const {
    return tokens > 0 ? total_nll / static_cast<double>(tokens)
                      : std::numeric_limits<double>::quiet_NaN();
  }
  double perplexity() const { return std::exp(mean_nll()); }
};

struct EvalResult {
  RunStats test;               ///< the backend under evaluation
  bool has_reference = false;  ///< reference or reference_trace was given
  RunStats reference;          ///< the reference run on the same tokens
  double mean_kl = 0.0;        ///< mean over predictions of KL(p_ref || p_test), nats
  double max_kl = 0.0;         ///< largest per-prediction KL
  double seconds = 0.0;        ///< wall time of the whole call (tokenization included)
};

namespace detail {

/// The scoring shared by every model's evaluate_text: checks the options, then turns each
/// prediction's test logits (and the reference's, from a lockstep run or a recorded trace) into
/// NLL and KL, records the trace, and checks the totals at the end. Timing and forward passes
/// stay with the caller, which knows how its model runs.
class EvalScorer {
 public:
  /// `unit` names the tokenizer's entries in the vocab-mismatch error ("pieces", "tokens").
  EvalScorer(const EvalOptions& options, const KVBackend& backend, int vocab,
             int tokenizer_vocab, const char* unit)
      : options_(options), vocab_(vocab), nv_(static_cast<size_t>(vocab)) {
    KVQ_REQUIRE(tokenizer_vocab == vocab, kInvalidArgument, "evaluate_text: tokenizer has ",
                tokenizer_vocab, " ", unit, " but the model has vocab_size ", vocab);
    KVQ_REQUIRE(!(options.reference && options.reference_trace), kInvalidArgument,
                "evaluate_text: give either a reference backend or a reference trace, not both");
    KVQ_REQUIRE(options.reference != &backend || options.reference == nullptr, kInvalidArgument,
                "evaluate_text: the reference backend must be a different object than the "
                "tested one (they hold separate caches)");
    KVQ_REQUIRE(options.max_seq_len >= 0 && options.max_sequences >= 0, kInvalidArgument,
                "evaluate_text: max_seq_len and max_sequences must be >= 0");
    KVQ_REQUIRE(options.record_trace == nullptr ||
                    options.record_trace != options.reference_trace,
                kInvalidArgument,
                "evaluate_text: record_trace and reference_trace are the same "
                "object; recording would overwrite the reference");
    if (const LogitTrace* t = options.reference_trace) {
      KVQ_REQUIRE(t->vocab_size == vocab, kInvalidArgument,
                  "evaluate_text: reference trace has vocab_size ", t->vocab_size, ", the model ",
                  vocab);
    }
    if (options.record_trace) {
      options.record_trace->vocab_size = vocab;
      options.record_trace->logits.clear();
    }
    result_.has_reference = options.reference != nullptr || options.reference_trace != nullptr;
    lp_test_.resize(nv_);
    lp_ref_.resize(nv_);
  }

  EvalResult& result() { return result_; }
  bool has_reference() const { return result_.has_reference; }

  /// One prediction of sequence `seq` at position `pos`: `test` are the tested backend's
  /// logits, `ref_run` the reference backend's (nullptr when the reference is a trace).
  void score(const float* test, const float* ref_run, size_t target, int64_t seq, int pos) {
    check_finite(test, "test", seq, pos);
    log_softmax(test, nv_, lp_test_.data());
    result_.test.total_nll -= lp_test_[target];
    ++result_.test.tokens;
    if (options_.record_trace) {
      options_.record_trace->logits.insert(options_.record_trace->logits.end(), test, test + nv_);
    }
    if (!result_.has_reference) return;
    const float* ref = ref_run;
    if (!options_.reference) {
      const LogitTrace* t = options_.reference_trace;
      KVQ_REQUIRE(trace_row_ < t->predictions(), kInvalidArgument,
                  "evaluate_text: reference trace has only ", t->predictions(),
                  " predictions; it was recorded on different text or options");
      ref = t->logits.data() + trace_row_ * vocab_;
      ++trace_row_;
    }
    check_finite(ref, "reference", seq, pos);
    log_softmax(ref, nv_, lp_ref_.data());
    result_.reference.total_nll -= lp_ref_[target];
    ++result_.reference.tokens;
    const double kl = kl_divergence_log_probs(lp_ref_.data(), lp_test_.data(), nv_);
    kl_sum_ += kl;
    result_.max_kl = std::max(result_.max_kl, kl);
  }

  /// Checks that predictions were made (`none_what` says what the lines lacked) and that a
  /// reference trace was used up exactly; returns the result with the mean KL.
  EvalResult finish(size_t n_lines, const char* none_what) {
    KVQ_REQUIRE(result_.test.tokens > 0, kInvalidArgument,
                "evaluate_text: no predictions were made (", n_lines, " lines, ", none_what, ")");
    if (const LogitTrace* t = options_.reference_trace) {
      KVQ_REQUIRE(trace_row_ == t->predictions(), kInvalidArgument,
                  "evaluate_text: reference trace has ", t->predictions(),
                  " predictions but this evaluation made ", trace_row_,
                  "; it was recorded on different text or options");
    }
    if (result_.has_reference) {
      result_.mean_kl = kl_sum_ / static_cast<double>(result_.test.tokens);
    }
    return result_;
  }

 private:
  void check_finite(const float* l, const char* run, int64_t seq, int pos) const {
    for (size_t i = 0; i < nv_; ++i) {
      KVQ_REQUIRE(std::isfinite(l[i]), kNonFinite, "evaluate_text: ", run, " run, sequence ", seq,
                  ", position ", pos, ": logit ", i, " is ", l[i]);
    }
  }

  const EvalOptions& options_;
  int vocab_;
  size_t nv_;
  EvalResult result_;
  std::vector<double> lp_test_, lp_ref_;  // [vocab] log-softmax of each run
  double kl_sum_ = 0.0;
  int64_t trace_row_ = 0;
};

}  // namespace detail

/// Splits a text file into lines at '\n'. Nothing else is stripped: a '\r' of a CRLF file
/// stays part of its line and is tokenized (one byte-fallback token). That is how the reference
/// figures in shared/docs/reference.md were measured on tinystories-dev.txt (CRLF): 4258
/// predictions, perplexity 5.3930; stripping the '\r' gives 4253 predictions instead. Empty
/// lines are kept; evaluate_text skips them.
inline std::vector<std::string> read_text_lines(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  KVQ_REQUIRE(in.good(), kIo, "cannot open text file '", path, "'");
  std::vector<std::string> lines;
  std::string line;
  while (std::getline(in, line)) lines.push_back(line);
  KVQ_REQUIRE(!in.bad(), kIo, "error reading text file '", path, "'");
  return lines;
}

/// Perplexity of `model` with attention served by `backend`, over the non-empty `lines` (one
/// sequence each: BOS + tokens, truncated to max_seq_len, every next-token prediction
/// counted). With options.reference or options.reference_trace, also the mean KL divergence
/// KL(p_ref || p_test) per prediction, computed in double from log-softmax.
inline EvalResult evaluate_text(Llama2cModel& model, const Tokenizer& tokenizer, KVBackend& backend,
                                const std::vector<std::string>& lines,
                                const EvalOptions& options = {}) {
  using Clock = std::chrono::steady_clock;
  const auto seconds_since = [](Clock::time_point t0) {
    return std::chrono::duration<double>(Clock::now() - t0).count();
  };
  const auto call_start = Clock::now();
  const Llama2cConfig& cfg = model.config();
  const int vocab = cfg.vocab_size;
  detail::EvalScorer scorer(options, backend, vocab, tokenizer.vocab_size(), "pieces");
  EvalResult& r = scorer.result();
  const int max_len =
      options.max_seq_len > 0 ? std::min(options.max_seq_len, cfg.seq_len) : cfg.seq_len;
  const auto nv = static_cast<size_t>(vocab);
  std::vector<float> logits(nv);      // [vocab] test run
  std::vector<float> ref_logits(nv);  // [vocab] reference run

  for (const std::string& line : lines) {
    if (line.empty()) continue;
    if (options.max_sequences > 0 && r.test.sequences >= options.max_sequences) break;
    std::vector<int> tokens = tokenizer.encode(line, /*bos=*/true);
    if (static_cast<int>(tokens.size()) > max_len) tokens.resize(static_cast<size_t>(max_len));
    const int64_t seq = r.test.sequences;
    backend.reset();
    if (options.reference) options.reference->reset();
    for (int pos = 0; pos + 1 < static_cast<int>(tokens.size()); ++pos) {
      const int cur = tokens[static_cast<size_t>(pos)];
      const auto target = static_cast<size_t>(tokens[static_cast<size_t>(pos + 1)]);
      auto t0 = Clock::now();
      model.forward(cur, pos, backend, logits.data());
      r.test.seconds += seconds_since(t0);
      ++r.test.forward_passes;
      if (options.reference) {
        t0 = Clock::now();
        model.forward(cur, pos, *options.reference, ref_logits.data());
        r.reference.seconds += seconds_since(t0);
        ++r.reference.forward_passes;
      }
      scorer.score(logits.data(), options.reference ? ref_logits.data() : nullptr, target, seq,
                   pos);
    }
    ++r.test.sequences;
    if (r.has_reference) ++r.reference.sequences;
  }
  EvalResult out = scorer.finish(lines.size(), "none with text");
  out.seconds = seconds_since(call_start);
  return out;
}

}  // namespace kvq::eval
