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
/// Dequantize: x' = n * R^T c(code). The seed is part of the config (one per layer config, not
/// stored per block, so it costs no bytes per tensor); codebooks are derived from (d, b) and
/// cost no bytes either.
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
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <mutex>
#include <map>
#include <tuple>
#include <vector>

#include "kvq/core/bitpack.hpp"
#include "kvq/core/rows.hpp"
#include "kvq/format/codebook.hpp"
#include "kvq/geometry/rotation.hpp"
#include "kvq/simd/uniform_cpu.hpp"
#include "kvq/quant/packed_view.hpp"
#include "kvq/quant/qtensor.hpp"

namespace kvq {

namespace detail {

/// Largest head_dim a QJL config may use: its sign matrix S is head_dim x head_dim floats
/// (64 MiB at this cap), built once per (head_dim, bits, seed) and kept for the process.
inline constexpr int64_t kMaxQjlHeadDim = 4096;
/// Bounds of the process-wide context registry below, so that hostile input (archives or specs
/// naming ever new seeds) cannot grow it without limit: at most this many distinct
/// (head_dim, bits, seed) contexts, and at most this many bytes of QJL matrices in all.
inline constexpr std::size_t kMaxLloydMaxContexts = 4096;
inline constexpr uint64_t kMaxQjlRegistryBytes = uint64_t{1} << 30;

/// Bytes a context of head_dim d holds (rotation signs, norms; the codebook is shared per
/// (d, bits)), without and with its QJL matrix: what a reader adds to its memory bound.
inline uint64_t lloyd_max_context_bytes(int64_t d, bool qjl) {
  const auto ud = static_cast<uint64_t>(d);
  return 512 + 16 * ud + (qjl ? 4 * ud * ud : 0);
}

/// Everything derived from (d, bits, seed): built once per process and never freed, so a
/// pointer to it stays valid (kernels may cache it per layer config). The QJL matrix is built
/// on first use (qjl_matrix()), so a context of a non-QJL config costs O(d) bytes.
struct LloydMaxContext {
  int dim;
  int bits;
  uint64_t seed;
  Rotation rotation;
  const Codebook* codebook;

  LloydMaxContext(int d, int b, uint64_t s)
      : dim(d), bits(b), seed(s), rotation(Rotation::hadamard(d, s)),
        codebook(&lloyd_max_sphere(d, b)) {}
  bool is(int d, int b, uint64_t s) const { return dim == d && bits == b && seed == s; }

  /// S, [d, d] row-major, N(0, 1) entries drawn from the seed; built (thread-safely) on the
  /// first call. Throws kUnsupported beyond kMaxQjlHeadDim and kOutOfRange when the registry's
  /// QJL budget (kMaxQjlRegistryBytes) is spent.
  const float* qjl_matrix() const;

 private:
  mutable std::once_flag qjl_once_;
  mutable std::vector<float> qjl_;
};

/// The process-wide registry of contexts. Lookups of a context that exists are lock-free: the
/// first kSlots contexts are published in an array of atomic pointers that readers scan; the
/// mutex is taken only to build a new context (once per (d, bits, seed)) and, beyond kSlots
/// distinct configs, to find the rest in the map.
struct LloydMaxRegistry {
  static constexpr int kSlots = 64;
  std::mutex mu;  ///< guards `all` and publication into `slots`
  std::map<std::tuple<int, int, uint64_t>, std::unique_ptr<LloydMaxContext>> all;
  std::array<std::atomic<const LloydMaxContext*>, kSlots> slots{};
  std::atomic<uint64_t> qjl_bytes{0};  ///< bytes of QJL matrices built so far
};
inline LloydMaxRegistry& lloyd_max_registry() {
  static LloydMaxRegistry r;
  return r;
}

/// Contexts and QJL bytes the registry holds (tests check the bounds hold on hostile input).
struct LloydMaxRegistryStats {
  std::size_t contexts = 0;
  uint64_t qjl_bytes = 0;
};
inline LloydMaxRegistryStats lloyd_max_registry_stats() {
  LloydMaxRegistry& r = lloyd_max_registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return {r.all.size(), r.qjl_bytes.load()};
}

inline const float* LloydMaxContext::qjl_matrix() const {
  std::call_once(qjl_once_, [this] {
    KVQ_REQUIRE(dim <= kMaxQjlHeadDim, kUnsupported, "QJL needs a head_dim x head_dim sign matrix; "
                "head_dim ", dim, " exceeds kvq's QJL limit of ", kMaxQjlHeadDim);
    const uint64_t bytes = 4 * static_cast<uint64_t>(dim) * static_cast<uint64_t>(dim);
    LloydMaxRegistry& r = lloyd_max_registry();
    uint64_t have = r.qjl_bytes.load();
    do {
      KVQ_REQUIRE(have + bytes <= kMaxQjlRegistryBytes, kOutOfRange,
                  "QJL matrix for head_dim ", dim, ", seed ", seed, " (", bytes,
                  " bytes): the process already holds ", have, " bytes of QJL matrices, and kvq's "
                  "limit is ", kMaxQjlRegistryBytes, " (distinct seeds each build one)");
    } while (!r.qjl_bytes.compare_exchange_weak(have, have + bytes));
    std::vector<float> m(static_cast<std::size_t>(bytes / 4));
    Xoshiro256ss rng(seed ^ 0x51a9c0ffee123457ULL);
    for (auto& v : m) v = static_cast<float>(rng.normal());
    qjl_ = std::move(m);
  });
  return qjl_.data();
}

inline const LloydMaxContext& lloyd_max_context(int d, int bits, uint64_t seed) {
  LloydMaxRegistry& r = lloyd_max_registry();
  for (const auto& slot : r.slots) {  // lock-free fast path
    const LloydMaxContext* c = slot.load(std::memory_order_acquire);
    if (c == nullptr) break;
    if (c->is(d, bits, seed)) return *c;
  }
  std::lock_guard<std::mutex> lock(r.mu);
  const auto key = std::make_tuple(d, bits, seed);
  auto it = r.all.find(key);
  if (it == r.all.end()) {
    KVQ_REQUIRE(r.all.size() < kMaxLloydMaxContexts, kOutOfRange, "rotate-then-Lloyd-Max context (head_dim ",
                d, ", ", bits, " bits, seed ", seed, "): the process already holds ", r.all.size(),
                " distinct contexts, kvq's limit (each distinct seed builds one)");
    it = r.all.emplace(key, std::make_unique<LloydMaxContext>(d, bits, seed)).first;
    for (auto& slot : r.slots) {  // publish (writers hold the mutex)
      if (slot.load(std::memory_order_relaxed) == nullptr) {
        slot.store(it->second.get(), std::memory_order_release);
        break;
      }
    }
  }
  return *it->second;
}

inline void check_lloyd_max(const QuantConfig& cfg, const Shape& s) {
  KVQ_REQUIRE(cfg.bits >= 1 && cfg.bits <= 4, kInvalidArgument,
              "Lloyd-Max codebooks have 1..4 bits, got ", cfg.bits);
  if (s.numel() == 0) return;
  // The codebook is that of one coordinate of a random unit vector in R^head_dim, which has a
  // density only from 3 dimensions on (format/codebook.hpp).
  KVQ_REQUIRE(s.head_dim >= 3, kUnsupported,
              "rotate-then-Lloyd-Max needs head_dim >= 3 (its codebook is that of a coordinate of "
              "a random unit vector in R^head_dim); got head_dim ", s.head_dim, " in ", s.str());
  KVQ_REQUIRE(s.head_dim <= 0x7fffffff && Rotation::hadamard_supported(static_cast<int>(s.head_dim)),
              kUnsupported, "rotate-then-Lloyd-Max needs a head_dim with a Hadamard rotation ",
              "(a power of two, or m * 2^k with 2^k >= 8, m odd, 1 < m <= 2^k); got head_dim ",
              s.head_dim, " in ", s.str());
  KVQ_REQUIRE(!cfg.qjl || s.head_dim <= kMaxQjlHeadDim, kUnsupported, "QJL needs a head_dim x ",
              "head_dim sign matrix; head_dim ", s.head_dim, " exceeds kvq's QJL limit of ",
              kMaxQjlHeadDim, " in ", s.str());
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

/// Quantizes x with a Lloyd-Max config into caller memory `q` (sized by packed_sizes). On a
/// throw the span's contents are unspecified.
template <class T>
void quantize_lloyd_max(const QuantConfig& cfg, const KVView<const T>& x, const PackedSpan& q,
                        QuantWorkspace& ws) {
  KVQ_REQUIRE(cfg.format == Format::kLloydMax, kInvalidArgument, "quantize_lloyd_max needs an lm config");
  const Shape s = x.shape();
  detail::check_lloyd_max(cfg, s);
  const auto n = static_cast<std::size_t>(s.numel());
  if (n == 0) return;
  q.codes[packed_bytes(n, cfg.bits) - 1] = 0;  // unused trailing bits are zero
  if (cfg.qjl) q.qjl_signs[packed_bytes(n, 1) - 1] = 0;
  const int D = static_cast<int>(s.head_dim);
  const auto& ctx = detail::lloyd_max_context(D, cfg.bits, cfg.seed);
  const auto ud = static_cast<std::size_t>(D);
  const float* S = cfg.qjl ? ctx.qjl_matrix() : nullptr;  // built (or refused) before any write
  float* buf = QuantWorkspace::at_least(ws.buf, ud);
  float* u = QuantWorkspace::at_least(ws.u, ud);
  float* r = QuantWorkspace::at_least(ws.r, ud);
  uint8_t* codes = QuantWorkspace::at_least(ws.codes, ud);
  uint8_t* signs = QuantWorkspace::at_least(ws.signs, ud);
  std::size_t v = 0;
  for (int64_t t = 0; t < s.tokens; ++t) {
    for (int64_t h = 0; h < s.heads; ++h, ++v) {
      const float* row = detail::load_row(x, t, h, buf);
      float lo = INFINITY, hi = -INFINITY;
      if (!kernels::minmax(row, D, lo, hi)) detail::throw_non_finite_row(x, t, h, "quantize");
      // Sum of squares and root in double: a float sum would overflow for norms above ~1.8e19
      // that f32 metadata can hold.
      const float norm = detail::store_meta(q.norms, cfg.meta, v,
                                            static_cast<float>(std::sqrt(detail::sum_sq_d(row, D))));
      KVQ_REQUIRE(std::isfinite(norm), kOutOfRange, "norm of vector (token=", t, ", head=", h,
                  ") overflows ", to_string(cfg.meta), " metadata",
                  cfg.meta == MetaDType::kF16 ? "; use f32 metadata" : "");
      const float inv = norm > 0.f ? 1.0f / norm : 0.f;
      if (std::isfinite(inv)) {
        for (int i = 0; i < D; ++i) u[i] = row[i] * inv;
      } else {  // subnormal f32 norm: 1/norm overflows, so divide (rare, off the hot path)
        for (int i = 0; i < D; ++i)
          u[i] = static_cast<float>(static_cast<double>(row[i]) / static_cast<double>(norm));
      }
      ctx.rotation.apply(u);
      ctx.codebook->encode(u, codes, D);
      kernels::pack_codes(codes, ud, cfg.bits, q.codes, v * ud * static_cast<std::size_t>(cfg.bits));
      if (cfg.qjl) {
        for (int i = 0; i < D; ++i) r[i] = u[i] - ctx.codebook->decode(codes[i]);
        detail::store_meta(q.qjl_norms, cfg.meta, v,
                           static_cast<float>(std::sqrt(static_cast<double>(detail::dot_f(r, r, D)))));
        for (int i = 0; i < D; ++i)
          signs[i] = detail::dot_f(S + static_cast<std::size_t>(i) * ud, r, D) >= 0.f;
        pack_bits(signs, ud, 1, q.qjl_signs, v * ud);
      }
    }
  }
}

/// Decodes vector v of q in the rotated space (codebook values, plus the QJL correction when
/// present), unscaled by the norm: the rotated unit vector estimate.
inline void lloyd_max_rotated(const PackedView& q, const detail::LloydMaxContext& ctx,
                              std::size_t v, float* out, uint8_t* code_buf) {
  const int D = ctx.dim;
  kernels::unpack_codes(q.codes, static_cast<std::size_t>(D), q.config.bits, code_buf,
                        v * static_cast<std::size_t>(D) * static_cast<std::size_t>(q.config.bits));
  ctx.codebook->decode(code_buf, out, D);
  if (q.config.qjl) {
    unpack_bits(q.qjl_signs, static_cast<std::size_t>(D), 1, code_buf,
                v * static_cast<std::size_t>(D));
    const float c = q.qjl_norm(v) * static_cast<float>(std::sqrt(M_PI / 2.0) / D);
    const float* S = ctx.qjl_matrix();
    for (int j = 0; j < D; ++j) {
      const float sj = code_buf[j] ? c : -c;
      const float* srow = S + static_cast<std::size_t>(j) * D;
      for (int i = 0; i < D; ++i) out[i] += sj * srow[i];
    }
  }
}
inline void lloyd_max_rotated(const QTensor& q, const detail::LloydMaxContext& ctx, std::size_t v,
                              float* out, uint8_t* code_buf) {
  lloyd_max_rotated(view_of(q), ctx, v, out, code_buf);
}

/// Reconstructs tokens [t0, t0 + out.tokens()) of Lloyd-Max data into `out`.
template <class T>
void dequantize_lloyd_max(const PackedView& q, int64_t t0, const KVView<T>& out,
                          QuantWorkspace& ws) {
  KVQ_REQUIRE(q.config.format == Format::kLloydMax, kInvalidArgument,
              "dequantize_lloyd_max needs Lloyd-Max data");
  const Shape s = q.shape;
  if (out.numel() == 0) return;
  const int D = static_cast<int>(s.head_dim);
  const auto& ctx = detail::lloyd_max_context(D, q.config.bits, q.config.seed);
  float* buf = QuantWorkspace::at_least(ws.buf, static_cast<std::size_t>(D));
  uint8_t* code_buf = QuantWorkspace::at_least(ws.codes, static_cast<std::size_t>(D));
  for (int64_t t = t0; t < t0 + out.tokens(); ++t)
    for (int64_t h = 0; h < s.heads; ++h) {
      const auto v = static_cast<std::size_t>(t * s.heads + h);
      lloyd_max_rotated(q, ctx, v, buf, code_buf);
      ctx.rotation.apply_inverse(buf);
      const float norm = q.norm(v);
      for (int i = 0; i < D; ++i) buf[i] *= norm;
      detail::store_row(out, t - t0, h, buf);
    }
}

/// Attention scores without rotating keys back: q.k = (R q).(R k), so the query is rotated
/// once and dotted with the decoded codes of every key. q is [heads_q, head_dim] (query head h
/// reads key head h / (heads_q / heads)); scores is [heads_q, tokens], scaled by `scale`.
inline void lloyd_max_scores(const PackedView& k, const float* q, int heads_q, float scale,
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
      const float norm = k.norm(v);
      for (int64_t g = 0; g < group; ++g) {
        const int64_t hq = h * group + g;
        scores[hq * s.tokens + t] =
            scale * norm * detail::dot_f(qr.data() + hq * D, kr.data(), D);
      }
    }
}

inline void lloyd_max_scores(const QTensor& k, const float* q, int heads_q, float scale,
                             float* scores) {
  lloyd_max_scores(view_of(k), q, heads_q, scale, scores);
}

}  // namespace kvq
