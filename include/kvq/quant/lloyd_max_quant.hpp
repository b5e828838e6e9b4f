#pragma once
/// \file lloyd_max_quant.hpp
/// Rotate-then-Lloyd-Max quantizer (TurboQuant-style), with an opt-in QJL residual.
///
/// Per vector x (one token of one head, head_dim = d):
///   n = ||x|| (stored as fp16 by default: its rounding error, 2^-11 relative, is three orders
///       of magnitude below the 4-bit codebook distortion; fp32 selectable),
///   u = R (x / n) with R the seeded randomized Hadamard rotation (geometry/rotation.hpp),
///   code_i = nearest centroid of the b-bit Lloyd-Max codebook for the coordinate density of
///       a random unit vector in R^d (format/codebook.hpp), packed densely.
/// Dequantize: x' = n * R^T c(code). The seed is stored once per tensor (8 bytes); codebooks
/// are derived from (d, b) and cost no bytes.
///
/// QJL (opt-in, cfg.qjl): with r = u - c(code) (rotated space), store rn = ||r|| and one sign
/// bit per coordinate of S r, where S is a seeded d x d standard Gaussian matrix. Since
/// E[S^T sign(S r)] = d sqrt(2/pi) r / ||r||, the correction rn sqrt(pi/2) / d S^T sign(S r) is
/// an unbiased estimate of r, so every inner product with the reconstruction is unbiased — at
/// the price of variance that a softmax turns into attention error (why vLLM dropped it).
/// lm<b>/qjl costs b + 1 bits per value plus two norms per vector.
///
/// Zero vectors: n = 0 reconstructs exactly to 0 (QJL included). Non-finite input:
/// kvq::Error(kNonFinite). fp16 norms: a norm that rounds to infinity (>= 65520) is
/// kvq::Error(kOutOfRange) (use f32 metadata); a norm at or below 2^-25 rounds to 0 and the vector
/// reconstructs to 0; below 2^-14 the norm is an fp16 subnormal and loses relative precision.
/// f32 norms cover every finite vector (sum of squares in double). docs/rotation.md.
#include <cmath>
#include <cstdint>
#include <memory>
#include <mutex>
#include <map>
#include <vector>

#include "kvq/core/bitpack.hpp"
#include "kvq/core/rows.hpp"
#include "kvq/format/codebook.hpp"
#include "kvq/geometry/rotation.hpp"
#include "kvq/kernels/cpu/uniform_cpu.hpp"
#include "kvq/quant/qtensor.hpp"

namespace kvq {

namespace detail {

/// Everything derived from (d, bits, seed): built once and cached (thread-safe).
struct LloydMaxContext {
  int dim;
  int bits;
  Rotation rotation;
  const Codebook* codebook;
  std::vector<float> qjl;  ///< S, [d, d] row-major, N(0, 1) entries (built with the context)

  LloydMaxContext(int d, int b, uint64_t seed)
      : dim(d), bits(b), rotation(Rotation::hadamard(d, seed)), codebook(&lloyd_max_sphere(d, b)) {
    Xoshiro256ss rng(seed ^ 0x51a9c0ffee123457ULL);
    qjl.resize(static_cast<std::size_t>(d) * static_cast<std::size_t>(d));
    for (auto& v : qjl) v = static_cast<float>(rng.normal());
  }
};

inline const LloydMaxContext& lloyd_max_context(int d, int bits, uint64_t seed) {
  static std::mutex mu;
  static std::map<std::tuple<int, int, uint64_t>, std::unique_ptr<LloydMaxContext>> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto& slot = cache[{d, bits, seed}];
  if (!slot) slot = std::make_unique<LloydMaxContext>(d, bits, seed);
  return *slot;
}

inline void check_lloyd_max(const QuantConfig& cfg, const Shape& s) {
  KVQ_REQUIRE(cfg.bits >= 1 && cfg.bits <= 4, kInvalidArgument,
              "Lloyd-Max codebooks have 1..4 bits, got ", cfg.bits);
  if (s.numel() == 0) return;
  KVQ_REQUIRE(s.head_dim <= 0x7fffffff && Rotation::hadamard_supported(static_cast<int>(s.head_dim)),
              kUnsupported, "rotate-then-Lloyd-Max needs a head_dim with a Hadamard rotation ",
              "(a power of two, or m * 2^k with 2^k >= 8, m odd, 1 < m <= 2^k); got head_dim ",
              s.head_dim, " in ", s.str());
}

/// sum a[i] * b[i] in double with eight interleaved partial sums (element i goes to sum i % 8),
/// combined in a fixed tree: one result for every build (scalar or vectorized, the compiler
/// vectorizes the lanes without reassociating), and no serial add-latency chain.
inline double dot_d(const float* a, const float* b, int64_t n) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) acc[k] += static_cast<double>(a[i + k]) * b[i + k];
  for (int k = 0; i < n; ++i, ++k) acc[k] += static_cast<double>(a[i]) * b[i];
  return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

inline double sum_sq_d(const float* a, int64_t n) { return dot_d(a, a, n); }

inline float dot_f(const float* a, const float* b, int64_t n) {
  return static_cast<float>(dot_d(a, b, n));
}

}  // namespace detail

/// Quantizes x with a Lloyd-Max config into q (storage reused).
template <class T>
void quantize_lloyd_max(const QuantConfig& cfg, const KVView<const T>& x, QTensor& q) {
  KVQ_REQUIRE(cfg.format == Format::kLloydMax, kInvalidArgument, "quantize_lloyd_max needs an lm config");
  const Shape s = x.shape();
  detail::check_lloyd_max(cfg, s);
  const auto n = static_cast<std::size_t>(s.numel());
  const auto vectors = static_cast<std::size_t>(s.tokens * s.heads);
  q.config = cfg;
  q.shape = s;
  q.codes.assign(packed_bytes(n, cfg.bits), 0);
  q.scales.reset(cfg.meta, 0);
  q.zeros.reset(cfg.meta, 0);
  q.norms.reset(cfg.meta, vectors);
  q.qjl_signs.assign(cfg.qjl ? packed_bytes(n, 1) : 0, 0);
  q.qjl_norms.reset(cfg.meta, cfg.qjl ? vectors : 0);
  q.has_seed = n > 0;
  if (n == 0) return;
  const int D = static_cast<int>(s.head_dim);
  const auto& ctx = detail::lloyd_max_context(D, cfg.bits, cfg.seed);
  std::vector<float> buf(static_cast<std::size_t>(D)), u(static_cast<std::size_t>(D)),
      r(static_cast<std::size_t>(D));
  std::vector<uint8_t> codes(static_cast<std::size_t>(D)), signs(static_cast<std::size_t>(D));
  std::size_t v = 0;
  for (int64_t t = 0; t < s.tokens; ++t) {
    for (int64_t h = 0; h < s.heads; ++h, ++v) {
      const float* row = detail::load_row(x, t, h, buf.data());
      float lo = INFINITY, hi = -INFINITY;
      if (!kernels::minmax(row, D, lo, hi)) detail::throw_non_finite_row(x, t, h, "quantize");
      // Sum of squares and root in double: a float sum would overflow for norms above ~1.8e19
      // that f32 metadata can hold.
      const float norm = q.norms.set(v, static_cast<float>(std::sqrt(detail::sum_sq_d(row, D))));
      KVQ_REQUIRE(std::isfinite(norm), kOutOfRange, "norm of vector (token=", t, ", head=", h,
                  ") overflows ", to_string(cfg.meta), " metadata",
                  cfg.meta == MetaDType::kF16 ? "; use f32 metadata" : "");
      const float inv = norm > 0.f ? 1.0f / norm : 0.f;
      if (std::isfinite(inv)) {
        for (int i = 0; i < D; ++i) u[static_cast<std::size_t>(i)] = row[i] * inv;
      } else {  // subnormal f32 norm: 1/norm overflows, so divide (rare, off the hot path)
        for (int i = 0; i < D; ++i)
          u[static_cast<std::size_t>(i)] =
              static_cast<float>(static_cast<double>(row[i]) / static_cast<double>(norm));
      }
      ctx.rotation.apply(u.data());
      ctx.codebook->encode(u.data(), codes.data(), D);
      kernels::pack_codes(codes.data(), static_cast<std::size_t>(D), cfg.bits, q.codes.data(),
                          v * static_cast<std::size_t>(D) * static_cast<std::size_t>(cfg.bits));
      if (cfg.qjl) {
        for (int i = 0; i < D; ++i)
          r[static_cast<std::size_t>(i)] =
              u[static_cast<std::size_t>(i)] - ctx.codebook->decode(codes[static_cast<std::size_t>(i)]);
        q.qjl_norms.set(v, static_cast<float>(std::sqrt(
                               static_cast<double>(detail::dot_f(r.data(), r.data(), D)))));
        for (int i = 0; i < D; ++i)
          signs[static_cast<std::size_t>(i)] =
              detail::dot_f(ctx.qjl.data() + static_cast<std::size_t>(i) * D, r.data(), D) >= 0.f;
        pack_bits(signs.data(), static_cast<std::size_t>(D), 1, q.qjl_signs.data(),
                  v * static_cast<std::size_t>(D));
      }
    }
  }
}

/// Decodes vector v of q in the rotated space (codebook values, plus the QJL correction when
/// present), unscaled by the norm: the rotated unit vector estimate.
inline void lloyd_max_rotated(const QTensor& q, const detail::LloydMaxContext& ctx, std::size_t v,
                              float* out, uint8_t* code_buf) {
  const int D = ctx.dim;
  kernels::unpack_codes(q.codes.data(), static_cast<std::size_t>(D), q.config.bits, code_buf,
                        v * static_cast<std::size_t>(D) * static_cast<std::size_t>(q.config.bits));
  ctx.codebook->decode(code_buf, out, D);
  if (q.config.qjl) {
    unpack_bits(q.qjl_signs.data(), static_cast<std::size_t>(D), 1, code_buf,
                v * static_cast<std::size_t>(D));
    const float c = q.qjl_norms.get(v) * static_cast<float>(std::sqrt(M_PI / 2.0) / D);
    for (int j = 0; j < D; ++j) {
      const float sj = code_buf[j] ? c : -c;
      const float* srow = ctx.qjl.data() + static_cast<std::size_t>(j) * D;
      for (int i = 0; i < D; ++i) out[i] += sj * srow[i];
    }
  }
}

template <class T>
void dequantize_lloyd_max(const QTensor& q, const KVView<T>& out) {
  const Shape s = q.shape;
  if (s.numel() == 0) return;
  const int D = static_cast<int>(s.head_dim);
  const auto& ctx = detail::lloyd_max_context(D, q.config.bits, q.config.seed);
  std::vector<float> buf(static_cast<std::size_t>(D));
  std::vector<uint8_t> code_buf(static_cast<std::size_t>(D));
  std::size_t v = 0;
  for (int64_t t = 0; t < s.tokens; ++t)
    for (int64_t h = 0; h < s.heads; ++h, ++v) {
      lloyd_max_rotated(q, ctx, v, buf.data(), code_buf.data());
      ctx.rotation.apply_inverse(buf.data());
      const float norm = q.norms.get(v);
      for (int i = 0; i < D; ++i) buf[static_cast<std::size_t>(i)] *= norm;
      detail::store_row(out, t, h, buf.data());
    }
}

/// Attention scores without rotating keys back: q.k = (R q).(R k), so the query is rotated
/// once and dotted with the decoded codes of every key. q is [heads_q, head_dim] (query head h
/// reads key head h / (heads_q / heads)); scores is [heads_q, tokens], scaled by `scale`.
inline void lloyd_max_scores(const QTensor& k, const float* q, int heads_q, float scale,
                             float* scores) {
  const Shape s = k.shape;
  KVQ_REQUIRE(k.config.format == Format::kLloydMax, kInvalidArgument,
              "lloyd_max_scores needs Lloyd-Max keys");
  KVQ_REQUIRE(s.heads > 0 && heads_q % s.heads == 0, kShapeMismatch, "query heads ", heads_q,
              " are not a multiple of key heads ", s.heads);
  if (s.numel() == 0) return;
  const int D = static_cast<int>(s.head_dim);
  const auto& ctx = detail::lloyd_max_context(D, k.config.bits, k.config.seed);
  std::vector<float> qr(static_cast<std::size_t>(heads_q) * D), kr(static_cast<std::size_t>(D));
  std::vector<uint8_t> code_buf(static_cast<std::size_t>(D));
  std::copy(q, q + qr.size(), qr.begin());
  ctx.rotation.apply_batch(qr.data(), heads_q);
  const int64_t group = heads_q / s.heads;
  for (int64_t t = 0; t < s.tokens; ++t)
    for (int64_t h = 0; h < s.heads; ++h) {
      const auto v = static_cast<std::size_t>(t * s.heads + h);
      lloyd_max_rotated(k, ctx, v, kr.data(), code_buf.data());
      const float norm = k.norms.get(v);
      for (int64_t g = 0; g < group; ++g) {
        const int64_t hq = h * group + g;
        scores[hq * s.tokens + t] =
            scale * norm * detail::dot_f(qr.data() + hq * D, kr.data(), D);
      }
    }
}

}  // namespace kvq
