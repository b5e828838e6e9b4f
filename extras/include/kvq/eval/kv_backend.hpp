#pragma once
/// \file kv_backend.hpp
/// The seam between a model's forward pass and whatever holds its KV cache.
///
/// The evaluation layer runs a real model token by token; every layer hands its new key and
/// value rows to a KVBackend and asks it for the attention output. Swapping the backend is how
/// a quantized cache is measured against the unquantized one on exactly the same tokens, so
/// this header depends on nothing but core/ (a cache can implement it without seeing the
/// model).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kvq/core/error.hpp"
#include "kvq/core/tensor.hpp"

namespace kvq::eval {

/// Pluggable KV cache + attention for one sequence at a time.
///
/// Contract (what the model guarantees when it drives a backend):
///  - reset() is called before each sequence;
///  - for every position pos = 0, 1, 2, ... and every layer, append(layer, pos, ...) is called
///    once, then attend(layer, pos, ...) for the query of the same token; positions are never
///    skipped or repeated within a sequence;
///  - all row pointers are valid only for the duration of the call (copy what you keep).
class KVBackend {
 public:
  virtual ~KVBackend() = default;
  /// Start a new sequence (drop all tokens).
  virtual void reset() = 0;
  /// Append one token at position `pos` for `layer`. k_prerope, k (post-RoPE) and v are
  /// [n_kv_heads, head_dim] floats.
  virtual void append(int layer, int pos, const float* k_prerope, const float* k,
                      const float* v) = 0;
  /// Attention for one query token over all tokens appended so far to `layer`:
  /// q [n_heads, head_dim] (post-RoPE), out [n_heads, head_dim]. Scores scaled by
  /// 1/sqrt(head_dim), softmax, weighted sum of values; query head h uses kv head
  /// h / (n_heads / n_kv_heads).
  virtual void attend(int layer, int pos, const float* q, int n_heads, float* out) = 0;
  /// attend() restricted to a sliding window: the query at `pos` sees only the tokens at
  /// positions (pos - window, pos] (llama.cpp's standard SWA mask; Gemma's local layers).
  /// window <= 0 means no window. The default serves every position that the window does not
  /// yet cut (pos < window) through attend() and refuses the others by name; backends that
  /// hold a whole sequence (Fp32Backend, CacheBackend) override it.
  virtual void attend_window(int layer, int pos, const float* q, int n_heads, float* out,
                             int window) {
    KVQ_REQUIRE(window <= 0 || pos < window, kUnsupported, "KVBackend: this backend cannot "
                "restrict attention to a sliding window (layer ", layer, ", position ", pos,
                ", window ", window, ")");
    attend(layer, pos, q, n_heads, out);
  }
  /// True when the backend takes a whole chunk per layer the way an engine's prefill does:
  /// append_chunk() of all its tokens, then one attend_chunk() for all their queries (causal).
  /// The model uses it for calls of more than one token; false (the default) keeps the
  /// token-by-token contract above.
  virtual bool chunked() const { return false; }
  /// Appends n tokens at positions pos0 .. pos0 + n - 1: rows [n, n_kv_heads, head_dim].
  virtual void append_chunk(int layer, int pos0, int n, const float* k_prerope, const float* k,
                            const float* v) {
    (void)layer, (void)pos0, (void)n, (void)k_prerope, (void)k, (void)v;
    fail(ErrorKind::kUnsupported, "KVBackend: this backend does not take chunks");
  }
  /// Causal attention of the n newest positions' queries q [n, n_heads, head_dim] into out
  /// (same shape), each over the tokens up to its own position (the last `window` of them
  /// when window > 0).
  virtual void attend_chunk(int layer, int pos0, int n, const float* q, int n_heads, float* out,
                            int window) {
    (void)layer, (void)pos0, (void)n, (void)q, (void)n_heads, (void)out, (void)window;
    fail(ErrorKind::kUnsupported, "KVBackend: this backend does not take chunks");
  }
};

/// Dimensions a backend needs to size its storage; the model reports its own
/// (Llama2cModel::kv_geometry()).
struct KVGeometry {
  int n_layers = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int max_tokens = 0;  ///< longest sequence the backend must hold (the model's seq_len)
};

namespace detail {

/// Dot product with eight partial sums: breaks the add-latency chain so that -O2 code runs at
/// vector speed without -ffast-math (GCC turns the fixed-size inner loop into one vector
/// operation); the fixed reduction tree keeps the result deterministic.
inline float dot(const float* a, const float* b, int n) {
  float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  int j = 0;
  for (; j + 8 <= n; j += 8) {
    for (int u = 0; u < 8; ++u) acc[u] += a[j + u] * b[j + u];
  }
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; j < n; ++j) s += a[j] * b[j];
  return s;
}

/// out[t] = scale * sum_d q[d] kt[d, t] for t < n, with keys stored transposed
/// (kt [head_dim, ld], token-contiguous). Eight tokens are scored at once: each channel is one
/// broadcast-multiply-add over eight contiguous keys, and the sum over channels runs in order
/// d = 0, 1, ... exactly as run.c sums a dot product.
inline void scores_transposed(const float* q, const float* kt, int64_t ld, int n, int head_dim,
                              float scale, float* out) {
  int t0 = 0;
  for (; t0 + 8 <= n; t0 += 8) {
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    for (int d = 0; d < head_dim; ++d) {
      const float qd = q[d];
      const float* kd = kt + d * ld + t0;
      for (int u = 0; u < 8; ++u) acc[u] += qd * kd[u];
    }
    for (int u = 0; u < 8; ++u) out[t0 + u] = acc[u] * scale;
  }
  for (; t0 < n; ++t0) {
    float s = 0.0f;
    for (int d = 0; d < head_dim; ++d) s += q[d] * kt[d * ld + t0];
    out[t0] = s * scale;
  }
}

/// exp(x) for x <= 0, within 1.5 ulp of the correctly rounded float (checked by the tests),
/// written branch-free in plain float/int arithmetic so that GCC vectorizes it at -O2. The
/// softmax of a long context calls exp once per token and head, which with libm's scalar expf
/// was a third of a whole evaluation. Range reduction x = n ln2 + r (ln2 split in two so n ln2
/// is exact), a degree-7 polynomial for e^r on |r| <= ln2/2 (Cephes expf coefficients), then
/// 2^n through the exponent bits. Results below FLT_MIN (x < -87.33) are flushed to 0, which
/// changes no softmax weight that matters.
inline float exp_nonpositive(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f;  // few mantissa bits, so n * kLn2Hi is exact
  constexpr float kLn2Lo = -2.12194440e-4f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  constexpr float kMinArg = -87.33f;     // keeps n >= -126 (a normal 2^n)
  const float xc = std::max(x, kMinArg);
  const float t = xc * kLog2e + kRound;  // low mantissa bits of t hold n = round(x log2 e)
  const float n = t - kRound;
  const float r = (xc - n * kLn2Hi) - n * kLn2Lo;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  // Unsigned arithmetic: wraps instead of overflowing (undefined) for a NaN argument.
  uint32_t ti;
  std::memcpy(&ti, &t, sizeof(ti));
  const uint32_t bits = (ti - 0x4B400000u + 127u) << 23;  // biased exponent of 2^n
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return x < kMinArg ? 0.0f : p * two_n;
}

/// Max of x[0..n), n > 0, eight lanes at a time.
inline float max_of(const float* x, int n) {
  float m[8];
  for (int u = 0; u < 8; ++u) m[u] = x[0];
  int t = 0;
  for (; t + 8 <= n; t += 8) {
    for (int u = 0; u < 8; ++u) {
      const float v = x[t + u];
      m[u] = v > m[u] ? v : m[u];
    }
  }
  for (; t < n; ++t) m[0] = std::max(m[0], x[t]);
  float r = m[0];
  for (int u = 1; u < 8; ++u) r = std::max(r, m[u]);
  return r;
}

/// x[t] = exp(x[t] - mx) in place (all arguments <= 0 since mx is the max); returns the sum.
inline float exp_shifted_sum(float* x, int n, float mx) {
  float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  int t = 0;
  for (; t + 8 <= n; t += 8) {
    for (int u = 0; u < 8; ++u) {
      const float e = exp_nonpositive(x[t + u] - mx);
      x[t + u] = e;
      acc[u] += e;
    }
  }
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; t < n; ++t) {
    x[t] = exp_nonpositive(x[t] - mx);
    s += x[t];
  }
  return s;
}

/// out[d] = scale * sum_t w[t] rows[t, d] for rows [n, width]. Channels are done eight at a
/// time in local accumulators (two, for even and odd tokens, to halve the add-latency chain)
/// so the sum stays in registers instead of round-tripping through `out` for every token.
inline void weighted_rows(const float* w, const float* rows, int n, int width, float scale,
                          float* out) {
  for (int d0 = 0; d0 < width; d0 += 8) {
    const int cw = std::min(8, width - d0);
    float a0[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    float a1[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    const float* r = rows + d0;
    int t = 0;
    if (cw == 8) {
      for (; t + 2 <= n; t += 2, r += 2 * width) {
        const float w0 = w[t];
        const float w1 = w[t + 1];
        for (int u = 0; u < 8; ++u) a0[u] += w0 * r[u];
        for (int u = 0; u < 8; ++u) a1[u] += w1 * r[width + u];
      }
    }
    for (; t < n; ++t, r += width) {
      for (int u = 0; u < cw; ++u) a0[u] += w[t] * r[u];
    }
    for (int u = 0; u < cw; ++u) out[d0 + u] = (a0[u] + a1[u]) * scale;
  }
}

}  // namespace detail

/// The unquantized reference backend: keys and values kept exactly as float, attention computed
/// in float like llama2.c's run.c (scores summed over channels in order, max-subtracted
/// softmax; exp within 1.5 ulp of libm's), so its perplexity is the fp32 baseline every
/// quantized cache is compared with.
///
/// Storage is preallocated for max_tokens per layer. Keys are kept transposed,
/// [kv_heads, head_dim, max_tokens], so that scoring walks contiguous tokens eight at a time;
/// values and pre-RoPE keys are [kv_heads, max_tokens, head_dim]. All three are exposed as
/// strided [tokens, kv_heads, head_dim] views.
class Fp32Backend final : public KVBackend {
 public:
  explicit Fp32Backend(const KVGeometry& g) : g_(g) {
    KVQ_REQUIRE(g.n_layers > 0 && g.n_kv_heads > 0 && g.head_dim > 0 && g.max_tokens > 0,
                kInvalidArgument, "Fp32Backend: geometry must be positive (n_layers=", g.n_layers,
                ", n_kv_heads=", g.n_kv_heads, ", head_dim=", g.head_dim,
                ", max_tokens=", g.max_tokens, ")");
    const int64_t per_layer = int64_t{g.n_kv_heads} * int64_t{g.max_tokens} * int64_t{g.head_dim};
    KVQ_REQUIRE(per_layer <= (int64_t{1} << 34) / g.n_layers, kInvalidArgument,
                "Fp32Backend: geometry too large (", g.n_layers, " layers x ", per_layer,
                " floats)");
    const size_t total = static_cast<size_t>(per_layer) * static_cast<size_t>(g.n_layers);
    k_.assign(total, 0.0f);
    k_prerope_.assign(total, 0.0f);
    v_.assign(total, 0.0f);
    length_.assign(static_cast<size_t>(g.n_layers), 0);
  }

  const KVGeometry& geometry() const { return g_; }

  void reset() override { std::fill(length_.begin(), length_.end(), 0); }

  void append(int layer, int pos, const float* k_prerope, const float* k, const float* v) override {
    check_layer(layer);
    const int t = length_[static_cast<size_t>(layer)];
    KVQ_REQUIRE(pos == t, kInvalidArgument, "Fp32Backend::append: layer ", layer, " holds ", t,
                " tokens, so the next position must be ", t, ", got ", pos);
    KVQ_REQUIRE(t < g_.max_tokens, kOutOfRange, "Fp32Backend::append: layer ", layer,
                " is full (max_tokens=", g_.max_tokens, ")");
    const int hd = g_.head_dim;
    const int64_t ld = g_.max_tokens;
    for (int h = 0; h < g_.n_kv_heads; ++h) {
      const float* kh = k + static_cast<size_t>(h) * hd;
      float* kt = k_.data() + head_offset(layer, h) + t;  // column t of [head_dim, max_tokens]
      for (int d = 0; d < hd; ++d) kt[d * ld] = kh[d];
      const size_t row = head_offset(layer, h) + static_cast<size_t>(t) * hd;
      std::copy_n(k_prerope + static_cast<size_t>(h) * hd, hd, k_prerope_.data() + row);
      std::copy_n(v + static_cast<size_t>(h) * hd, hd, v_.data() + row);
    }
    length_[static_cast<size_t>(layer)] = t + 1;
  }

  void attend(int layer, int pos, const float* q, int n_heads, float* out) override {
    attend_window(layer, pos, q, n_heads, out, 0);
  }

  void attend_window(int layer, int pos, const float* q, int n_heads, float* out,
                     int window) override {
    check_layer(layer);
    const int held = length_[static_cast<size_t>(layer)];
    // The tokens the query sees: [first, held), the last `window` of them when windowed.
    const int first = window > 0 && held > window ? held - window : 0;
    const int n = held - first;
    KVQ_REQUIRE(held > 0 && pos == held - 1, kInvalidArgument, "Fp32Backend::attend: layer ", layer,
                " holds ", held, " tokens; a query at position ", pos,
                " must come right after appending its own token");
    KVQ_REQUIRE(n_heads > 0 && n_heads % g_.n_kv_heads == 0, kInvalidArgument,
                "Fp32Backend::attend: n_heads=", n_heads,
                " is not a multiple of n_kv_heads=", g_.n_kv_heads);
    const int hd = g_.head_dim;
    const int group = n_heads / g_.n_kv_heads;
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    scores_.resize(static_cast<size_t>(n));
    float* sc = scores_.data();  // [tokens] one head's scores, then exp(score - max)
    for (int h = 0; h < n_heads; ++h) {
      const int kvh = h / group;
      const float* kt = k_.data() + head_offset(layer, kvh) + first;  // [head_dim, max_tokens]
      const float* vh = v_.data() + head_offset(layer, kvh) + static_cast<size_t>(first) * hd;
      detail::scores_transposed(q + static_cast<size_t>(h) * hd, kt, g_.max_tokens, n, hd, scale,
                                sc);
      const float sum = detail::exp_shifted_sum(sc, n, detail::max_of(sc, n));
      detail::weighted_rows(sc, vh, n, hd, 1.0f / sum, out + static_cast<size_t>(h) * hd);
    }
  }

  /// Overwrites the post-RoPE keys of tokens [first, first + k.tokens()) of `layer` (tokens it
  /// already holds) with `k`, e.g. their quantized-then-dequantized values: simulated
  /// quantization on top of the exact attention code. Pre-RoPE keys are left as they were.
  void overwrite_keys(int layer, int first, const KVView<const float>& k) {
    check_overwrite(layer, first, k, "overwrite_keys");
    const int64_t ld = g_.max_tokens;
    for (int64_t t = 0; t < k.tokens(); ++t)
      for (int h = 0; h < g_.n_kv_heads; ++h) {
        float* kt = k_.data() + head_offset(layer, h) + first + t;
        for (int d = 0; d < g_.head_dim; ++d) kt[d * ld] = k.at(t, h, d);
      }
  }
  /// Overwrites the values of tokens [first, first + v.tokens()) of `layer`.
  void overwrite_values(int layer, int first, const KVView<const float>& v) {
    check_overwrite(layer, first, v, "overwrite_values");
    for (int64_t t = 0; t < v.tokens(); ++t)
      for (int h = 0; h < g_.n_kv_heads; ++h) {
        float* row = v_.data() + head_offset(layer, h) + static_cast<size_t>(first + t) * g_.head_dim;
        for (int d = 0; d < g_.head_dim; ++d) row[d] = v.at(t, h, d);
      }
  }

  /// Tokens currently held by `layer`.
  int tokens(int layer) const {
    check_layer(layer);
    return length_[static_cast<size_t>(layer)];
  }
  /// Post-RoPE keys of `layer` as a [tokens, kv_heads, head_dim] view (valid until the next
  /// append/reset); lets comparison tools quantize the exact tensors attention consumed.
  KVView<const float> keys(int layer) const {
    return view(k_, layer, Strides{1, int64_t{g_.max_tokens} * g_.head_dim, g_.max_tokens});
  }
  /// Pre-RoPE keys of `layer` (what a pre-RoPE per-channel key quantizer would see).
  KVView<const float> keys_prerope(int layer) const {
    return view(k_prerope_, layer, Strides{g_.head_dim, int64_t{g_.max_tokens} * g_.head_dim, 1});
  }
  /// Values of `layer` as a [tokens, kv_heads, head_dim] view.
  KVView<const float> values(int layer) const {
    return view(v_, layer, Strides{g_.head_dim, int64_t{g_.max_tokens} * g_.head_dim, 1});
  }

 private:
  void check_layer(int layer) const {
    KVQ_REQUIRE(layer >= 0 && layer < g_.n_layers, kInvalidArgument, "Fp32Backend: layer ", layer,
                " out of range [0, ", g_.n_layers, ")");
  }
  void check_overwrite(int layer, int first, const KVView<const float>& x, const char* what) const {
    check_layer(layer);
    const int n = length_[static_cast<size_t>(layer)];
    KVQ_REQUIRE(x.heads() == g_.n_kv_heads && x.head_dim() == g_.head_dim, kShapeMismatch,
                "Fp32Backend::", what, ": got ", x.shape().str(), ", layer ", layer, " has ",
                g_.n_kv_heads, " kv heads of ", g_.head_dim);
    KVQ_REQUIRE(first >= 0 && x.tokens() <= n - first, kOutOfRange, "Fp32Backend::", what,
                ": tokens [", first, ", ", first + x.tokens(), ") of layer ", layer, " but it holds ",
                n);
  }
  /// First float of (layer, kv_head) in any of the three buffers (each head owns a
  /// max_tokens * head_dim block).
  size_t head_offset(int layer, int kv_head) const {
    return (static_cast<size_t>(layer) * static_cast<size_t>(g_.n_kv_heads) +
            static_cast<size_t>(kv_head)) *
           static_cast<size_t>(g_.max_tokens) * static_cast<size_t>(g_.head_dim);
  }
  KVView<const float> view(const std::vector<float>& buf, int layer, const Strides& st) const {
    check_layer(layer);
    const Shape s{length_[static_cast<size_t>(layer)], g_.n_kv_heads, g_.head_dim};
    return KVView<const float>(buf.data() + head_offset(layer, 0), s, st);
  }

  KVGeometry g_;
  std::vector<float> k_;          // [layers, kv_heads, head_dim, max_tokens] post-RoPE
  std::vector<float> k_prerope_;  // [layers, kv_heads, max_tokens, head_dim]
  std::vector<float> v_;          // [layers, kv_heads, max_tokens, head_dim]
  std::vector<int> length_;       // [layers] tokens held
  std::vector<float> scores_;     // [tokens] scratch for one head
};

}  // namespace kvq::eval
