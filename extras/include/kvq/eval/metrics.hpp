#pragma once
/// \file metrics.hpp
/// Error metrics measured where a KV tensor is consumed.
///
/// The MSE of a stored tensor says little about what a model does with it: a key error that
/// lands along the query direction moves attention scores, a value error is averaged by the
/// softmax weights, and what finally matters is the next-token distribution. These functions
/// measure each of those stages so the comparison tools can report them side by side.
///
/// Conventions:
///  - every reduction accumulates in double, so a metric of a small error is not drowned in the
///    rounding of its own computation;
///  - "ref" is the unquantized tensor and "test" the one being judged; asymmetric metrics
///    (relative errors, KL) are normalised by / taken under the reference;
///  - relative error = sqrt(relative MSE), i.e. ||ref - test||_2 / ||ref||_2;
///  - NaN in an input propagates to the result of the plain error metrics (so a broken
///    quantizer cannot look perfect); the softmax family throws kNonFinite instead, because a
///    distribution over NaN logits has no meaning.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "kvq/core/error.hpp"
#include "kvq/core/tensor.hpp"

namespace kvq::eval {

namespace detail {

template <class T>
constexpr void check_real() {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "kvq::eval metrics take float or double data");
}

/// Applies f(ref_element, test_element) to every logical element of two same-shaped views.
template <class F>
void for_each_pair(const KVView<const float>& ref, const KVView<const float>& test, F&& f) {
  KVQ_REQUIRE(ref.shape() == test.shape(), kShapeMismatch, "metric over views of shape ",
              ref.shape().str(), " (ref) and ", test.shape().str(), " (test)");
  for (int64_t t = 0; t < ref.tokens(); ++t) {
    for (int64_t h = 0; h < ref.heads(); ++h) {
      for (int64_t d = 0; d < ref.head_dim(); ++d) f(ref.at(t, h, d), test.at(t, h, d));
    }
  }
}

/// The zero-denominator rule shared by every relative metric: 0/0 = 0 (both tensors are
/// exactly zero, so the test is exact), x/0 = +inf for x > 0 (any error is infinitely large
/// relative to nothing), NaN stays NaN.
inline double safe_ratio(double num, double den) {
  if (std::isnan(num) || std::isnan(den)) return std::numeric_limits<double>::quiet_NaN();
  if (den == 0.0) return num == 0.0 ? 0.0 : std::numeric_limits<double>::infinity();
  return num / den;
}

/// Max of x[0..n), after rejecting NaN and +inf (which would make the softmax meaningless)
/// and the all -inf case (an empty distribution).
template <class T>
double checked_max(const T* x, size_t n, const char* what) {
  KVQ_REQUIRE(n > 0, kInvalidArgument, what, " of an empty vector");
  double mx = -std::numeric_limits<double>::infinity();
  for (size_t i = 0; i < n; ++i) {
    const double v = static_cast<double>(x[i]);
    KVQ_REQUIRE(!std::isnan(v) && v != std::numeric_limits<double>::infinity(), kNonFinite, what,
                ": element ", i, " of ", n, " is ", v);
    mx = std::max(mx, v);
  }
  KVQ_REQUIRE(std::isfinite(mx), kNonFinite, what, ": all ", n, " elements are -inf");
  return mx;
}

/// Single-query attention scores for one query head: scale * q·k_t over all tokens of kv head
/// `kvh`, in double. out has k.tokens() entries.
inline void head_scores(const float* qh, const KVView<const float>& k, int64_t kvh, double scale,
                        double* out) {
  for (int64_t t = 0; t < k.tokens(); ++t) {
    double s = 0.0;
    for (int64_t d = 0; d < k.head_dim(); ++d) {
      s += static_cast<double>(qh[d]) * static_cast<double>(k.at(t, kvh, d));
    }
    out[t] = s * scale;
  }
}

inline void check_attention_args(const float* q, int n_heads, const KVView<const float>& k,
                                 const KVView<const float>* v) {
  KVQ_REQUIRE(q != nullptr, kInvalidArgument, "attention metric: null query pointer");
  KVQ_REQUIRE(k.heads() > 0 && k.head_dim() > 0, kShapeMismatch,
              "attention metric: keys have no heads or no channels: ", k.shape().str());
  KVQ_REQUIRE(k.tokens() > 0, kShapeMismatch,
              "attention metric: attention over zero tokens is undefined");
  KVQ_REQUIRE(n_heads > 0 && n_heads % k.heads() == 0, kInvalidArgument,
              "attention metric: n_heads=", n_heads,
              " is not a positive multiple of kv heads=", k.heads());
  if (v != nullptr) {
    KVQ_REQUIRE(v->shape() == k.shape(), kShapeMismatch, "attention metric: keys ", k.shape().str(),
                " and values ", v->shape().str(), " differ in shape");
  }
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// Element-wise tensor errors
// ---------------------------------------------------------------------------------------------

/// Relative MSE sum((ref-test)^2) / sum(ref^2): the error energy as a fraction of the signal
/// energy, so it is comparable across layers whose activations differ in scale.
/// Zero denominator: 0 when test is also exactly zero, +inf otherwise (see detail::safe_ratio).
template <class T>
double relative_mse(const T* ref, const T* test, size_t n) {
  detail::check_real<T>();
  double num = 0.0;
  double den = 0.0;
  for (size_t i = 0; i < n; ++i) {
    const double r = static_cast<double>(ref[i]);
    const double e = r - static_cast<double>(test[i]);
    num += e * e;
    den += r * r;
  }
  return detail::safe_ratio(num, den);
}

/// relative_mse over two [tokens, heads, head_dim] views of equal shape (any layouts).
inline double relative_mse(const KVView<const float>& ref, const KVView<const float>& test) {
  double num = 0.0;
  double den = 0.0;
  detail::for_each_pair(ref, test, [&](float r, float x) {
    const double e = static_cast<double>(r) - static_cast<double>(x);
    num += e * e;
    den += static_cast<double>(r) * static_cast<double>(r);
  });
  return detail::safe_ratio(num, den);
}

/// Relative L2 error ||ref - test|| / ||ref|| = sqrt(relative_mse); same zero rule.
template <class T>
double relative_error(const T* ref, const T* test, size_t n) {
  return std::sqrt(relative_mse(ref, test, n));
}

/// Largest |ref - test| (0 for n == 0); NaN if any difference is NaN, because std::max would
/// otherwise silently drop it.
template <class T>
double max_abs_error(const T* ref, const T* test, size_t n) {
  detail::check_real<T>();
  double m = 0.0;
  for (size_t i = 0; i < n; ++i) {
    const double e = std::fabs(static_cast<double>(ref[i]) - static_cast<double>(test[i]));
    if (std::isnan(e)) return e;
    m = std::max(m, e);
  }
  return m;
}

/// max_abs_error over two views of equal shape.
inline double max_abs_error(const KVView<const float>& ref, const KVView<const float>& test) {
  double m = 0.0;
  bool nan = false;
  detail::for_each_pair(ref, test, [&](float r, float x) {
    const double e = std::fabs(static_cast<double>(r) - static_cast<double>(x));
    if (std::isnan(e)) nan = true;
    m = std::max(m, e);
  });
  return nan ? std::numeric_limits<double>::quiet_NaN() : m;
}

/// Cosine similarity a·b / (|a| |b|). Zero rule: two zero vectors are identical (1); a zero
/// vector against a non-zero one shares no direction (0).
template <class T>
double cosine_similarity(const T* a, const T* b, size_t n) {
  detail::check_real<T>();
  double ab = 0.0;
  double aa = 0.0;
  double bb = 0.0;
  for (size_t i = 0; i < n; ++i) {
    const double x = static_cast<double>(a[i]);
    const double y = static_cast<double>(b[i]);
    ab += x * y;
    aa += x * x;
    bb += y * y;
  }
  if (std::isnan(ab) || std::isnan(aa) || std::isnan(bb)) {
    return std::numeric_limits<double>::quiet_NaN();
  }
  if (aa == 0.0 && bb == 0.0) return 1.0;
  if (aa == 0.0 || bb == 0.0) return 0.0;
  return ab / (std::sqrt(aa) * std::sqrt(bb));
}

// ---------------------------------------------------------------------------------------------
// Distributions
// ---------------------------------------------------------------------------------------------

/// Softmax of x[0..n) into out (double). The max is subtracted first so large logits cannot
/// overflow exp. Throws kNonFinite for NaN / +inf / all -inf input; -inf entries get p = 0.
template <class T>
void softmax(const T* x, size_t n, double* out) {
  detail::check_real<T>();
  const double mx = detail::checked_max(x, n, "softmax");
  double sum = 0.0;
  for (size_t i = 0; i < n; ++i) {
    out[i] = std::exp(static_cast<double>(x[i]) - mx);
    sum += out[i];
  }
  const double inv = 1.0 / sum;  // sum >= 1: the max element contributes exp(0)
  for (size_t i = 0; i < n; ++i) out[i] *= inv;
}

/// Log-softmax x_i - logsumexp(x) into out (double). Computed directly rather than as
/// log(softmax) so that tiny probabilities keep their precision (KL depends on them).
template <class T>
void log_softmax(const T* x, size_t n, double* out) {
  detail::check_real<T>();
  const double mx = detail::checked_max(x, n, "log_softmax");
  double sum = 0.0;
  for (size_t i = 0; i < n; ++i) sum += std::exp(static_cast<double>(x[i]) - mx);
  const double lse = mx + std::log(sum);
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<double>(x[i]) - lse;
}

template <class T>
std::vector<double> softmax(const std::vector<T>& x) {
  std::vector<double> out(x.size());
  softmax(x.data(), x.size(), out.data());
  return out;
}

template <class T>
std::vector<double> log_softmax(const std::vector<T>& x) {
  std::vector<double> out(x.size());
  log_softmax(x.data(), x.size(), out.data());
  return out;
}

/// KL(P || Q) = sum_i p_i (log p_i - log q_i) from log-probabilities (natural log, nats).
/// Terms with p_i = 0 contribute 0 (the limit), so a masked reference entry is fine; p_i > 0
/// where q_i = 0 gives +inf, which is the honest answer. Tiny negative results from rounding
/// are clamped to 0 because KL is non-negative by definition.
inline double kl_divergence_log_probs(const double* log_p, const double* log_q, size_t n) {
  double kl = 0.0;
  for (size_t i = 0; i < n; ++i) {
    const double p = std::exp(log_p[i]);
    if (p == 0.0) continue;
    kl += p * (log_p[i] - log_q[i]);
  }
  return kl < 0.0 ? 0.0 : kl;
}

/// KL(softmax(p_logits) || softmax(q_logits)) in nats, computed in double via log-softmax.
/// This is the accuracy check for a quantized cache: p = unquantized run, q = quantized run.
template <class T>
double kl_divergence_logits(const T* p_logits, const T* q_logits, size_t n) {
  std::vector<double> lp(n);
  std::vector<double> lq(n);
  log_softmax(p_logits, n, lp.data());
  log_softmax(q_logits, n, lq.data());
  return kl_divergence_log_probs(lp.data(), lq.data(), n);
}

// ---------------------------------------------------------------------------------------------
// Attention (single query over a [tokens, kv_heads, head_dim] cache, grouped-query)
// ---------------------------------------------------------------------------------------------
//
// q is [n_heads, head_dim]; query head h reads kv head h / (n_heads / kv_heads). Scores are
// q·k / sqrt(head_dim). Everything is computed in double so these functions double as the
// oracle the float attention paths are compared against.

/// Scaled scores, [n_heads, tokens] row-major.
inline std::vector<double> attention_scores(const float* q, int n_heads,
                                            const KVView<const float>& k) {
  detail::check_attention_args(q, n_heads, k, nullptr);
  const int64_t group = n_heads / k.heads();
  const double scale = 1.0 / std::sqrt(static_cast<double>(k.head_dim()));
  std::vector<double> s(static_cast<size_t>(n_heads * k.tokens()));
  for (int h = 0; h < n_heads; ++h) {
    detail::head_scores(q + h * k.head_dim(), k, h / group, scale,
                        s.data() + static_cast<size_t>(h * k.tokens()));
  }
  return s;
}

/// Attention weights softmax(scores) per head, [n_heads, tokens] row-major.
inline std::vector<double> attention_weights(const float* q, int n_heads,
                                             const KVView<const float>& k) {
  std::vector<double> s = attention_scores(q, n_heads, k);
  const size_t n = static_cast<size_t>(k.tokens());
  for (int h = 0; h < n_heads; ++h) softmax(s.data() + h * n, n, s.data() + h * n);
  return s;
}

/// Attention output sum_t w_t v_t per head, [n_heads, head_dim] row-major.
inline std::vector<double> attention_output(const float* q, int n_heads,
                                            const KVView<const float>& k,
                                            const KVView<const float>& v) {
  detail::check_attention_args(q, n_heads, k, &v);
  const std::vector<double> w = attention_weights(q, n_heads, k);
  const int64_t group = n_heads / k.heads();
  const int64_t hd = k.head_dim();
  const int64_t n = k.tokens();
  std::vector<double> out(static_cast<size_t>(n_heads * hd), 0.0);
  for (int h = 0; h < n_heads; ++h) {
    const int64_t kvh = h / group;
    for (int64_t t = 0; t < n; ++t) {
      const double wt = w[static_cast<size_t>(h * n + t)];
      for (int64_t d = 0; d < hd; ++d) {
        out[static_cast<size_t>(h * hd + d)] += wt * static_cast<double>(v.at(t, kvh, d));
      }
    }
  }
  return out;
}

/// Relative L2 error of the scaled scores of test keys against reference keys (all heads and
/// tokens pooled). The query is shared: only the cache is quantized.
inline double attention_score_error(const float* q, int n_heads, const KVView<const float>& k_ref,
                                    const KVView<const float>& k_test) {
  KVQ_REQUIRE(k_ref.shape() == k_test.shape(), kShapeMismatch, "attention_score_error: keys ",
              k_ref.shape().str(), " (ref) and ", k_test.shape().str(), " (test)");
  const std::vector<double> a = attention_scores(q, n_heads, k_ref);
  const std::vector<double> b = attention_scores(q, n_heads, k_test);
  return relative_error(a.data(), b.data(), a.size());
}

/// Mean over query heads of KL(w_ref || w_test) of the attention weights (nats). Weight KL,
/// unlike score error, ignores errors the softmax flattens (shifts shared by all tokens) and
/// magnifies errors on the tokens that carry the attention mass.
inline double attention_weight_kl(const float* q, int n_heads, const KVView<const float>& k_ref,
                                  const KVView<const float>& k_test) {
  KVQ_REQUIRE(k_ref.shape() == k_test.shape(), kShapeMismatch, "attention_weight_kl: keys ",
              k_ref.shape().str(), " (ref) and ", k_test.shape().str(), " (test)");
  const std::vector<double> a = attention_scores(q, n_heads, k_ref);
  const std::vector<double> b = attention_scores(q, n_heads, k_test);
  const size_t n = static_cast<size_t>(k_ref.tokens());
  std::vector<double> la(n);
  std::vector<double> lb(n);
  double sum = 0.0;
  for (int h = 0; h < n_heads; ++h) {
    log_softmax(a.data() + h * n, n, la.data());
    log_softmax(b.data() + h * n, n, lb.data());
    sum += kl_divergence_log_probs(la.data(), lb.data(), n);
  }
  return sum / n_heads;
}

/// Relative L2 error of the attention output [n_heads, head_dim] computed from the test K/V
/// against the output from the reference K/V: the error the next layer actually receives.
inline double attention_output_error(const float* q, int n_heads, const KVView<const float>& k_ref,
                                     const KVView<const float>& v_ref,
                                     const KVView<const float>& k_test,
                                     const KVView<const float>& v_test) {
  KVQ_REQUIRE(k_ref.shape() == k_test.shape(), kShapeMismatch, "attention_output_error: keys ",
              k_ref.shape().str(), " (ref) and ", k_test.shape().str(), " (test)");
  const std::vector<double> a = attention_output(q, n_heads, k_ref, v_ref);
  const std::vector<double> b = attention_output(q, n_heads, k_test, v_test);
  return relative_error(a.data(), b.data(), a.size());
}

/// All three attention-stage errors of one query at once.
struct AttentionErrors {
  double score_rel_error = 0.0;   ///< attention_score_error
  double weight_kl = 0.0;         ///< attention_weight_kl (nats, mean over heads)
  double output_rel_error = 0.0;  ///< attention_output_error
};

inline AttentionErrors attention_errors(const float* q, int n_heads,
                                        const KVView<const float>& k_ref,
                                        const KVView<const float>& v_ref,
                                        const KVView<const float>& k_test,
                                        const KVView<const float>& v_test) {
  AttentionErrors e;
  e.score_rel_error = attention_score_error(q, n_heads, k_ref, k_test);
  e.weight_kl = attention_weight_kl(q, n_heads, k_ref, k_test);
  e.output_rel_error = attention_output_error(q, n_heads, k_ref, v_ref, k_test, v_test);
  return e;
}

}  // namespace kvq::eval
