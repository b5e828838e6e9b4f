#pragma once
/// \file codebook.hpp
/// Lloyd-Max scalar codebooks, computed at run time by Lloyd's algorithm (nothing typed in),
/// for the two coordinate distributions rotate-then-round quantizers meet:
///
/// - lloyd_max_sphere(d, b): one coordinate of a uniformly random unit vector in R^d, density
///   f(x) proportional to (1 - x^2)^((d-3)/2) on [-1, 1]. After a random rotation every
///   coordinate of a (normalized) head vector has exactly this law, so this is the codebook
///   that minimizes the expected squared error per coordinate. Values are in raw unit-vector
///   units (spread ~ 1/sqrt(d)); multiply by the stored norm to dequantize.
/// - lloyd_max_gaussian(b): the standard normal, the d -> infinity limit (scale it by
///   1/sqrt(d) for unit vectors; at d = 128 it costs at most 0.11% more distortion than the
///   exact sphere codebook (4 bits), at d = 8 up to 24%: computed in docs/rotation.md).
///
/// Both densities are symmetric and log-concave, for which the Lloyd-Max quantizer is unique
/// (Fleischer 1964, Trushkin 1982) and therefore symmetric: kvq solves for the 2^(b-1) positive
/// centroids and mirrors them. One Lloyd step sets every threshold to the midpoint of its two
/// centroids and every centroid to the conditional mean of its cell. Gaussian cell masses,
/// first and second moments are closed forms (erfc, pdf); for the sphere density the first
/// moment is a closed form and mass and second moment come from adaptive Gauss-Legendre
/// quadrature (absolute tolerance 1e-15 per panel, in units where the density peaks at 1).
/// Iteration stops when no centroid moves by more than 1e-13 (in units of the coordinate
/// standard deviation), which leaves the centroids accurate to ~1e-11; the result is rounded
/// to float. Each (d, b) is computed once per process, on first use, and cached (thread-safe).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "kvq/config.hpp"
#include "kvq/core/error.hpp"

namespace kvq {

/// Index of x in a sorted threshold list (2^bits - 1 ascending thresholds): the number of
/// thresholds t with x >= t, found by a branch-free binary search of `bits` steps. Ties go
/// up; NaN compares false everywhere and encodes to 0; -inf to 0, +inf to 2^bits - 1.
/// Written once for host and device (the codebook's arrays are plain floats).
KVQ_HOST_DEVICE uint8_t codebook_encode(const float* thresholds, int bits, float x) {
  int idx = 0;
  for (int step = 1 << (bits - 1); step > 0; step >>= 1) {
    idx += (x >= thresholds[idx + step - 1]) ? step : 0;
  }
  return static_cast<uint8_t>(idx);
}

/// A scalar quantizer with 2^bits levels. Encoding compares with the thresholds only:
/// thresholds[k] is the midpoint of centroids[k] and centroids[k + 1], so the nearest centroid
/// wins without computing any distance.
struct Codebook {
  int bits = 0;
  std::vector<float> centroids;   ///< [2^bits], ascending
  std::vector<float> thresholds;  ///< [2^bits - 1], ascending midpoints
  double mse = 0.0;  ///< expected squared error per coordinate under the codebook's density

  int levels() const { return 1 << bits; }

  /// Index of the centroid nearest to x (see codebook_encode for ties and non-finite x).
  uint8_t encode(float x) const { return codebook_encode(thresholds.data(), bits, x); }

  /// Centroid of an index; only the low `bits` bits of `index` are used, so any byte is safe.
  float decode(uint8_t index) const { return centroids[index & (levels() - 1)]; }

  /// encode() of n values (x: [n] -> idx: [n]); SIMD (AVX-512 or AVX2) for bits <= 4 when
  /// compiled in, with results identical to the scalar encode(), NaN and ties included.
  void encode(const float* x, uint8_t* idx, int64_t n) const;

  /// decode() of n indices (idx: [n] -> x: [n]); AVX-512 or AVX2 table lookup for bits <= 4.
  void decode(const uint8_t* idx, float* x, int64_t n) const;
};

namespace detail {

/// Convergence limit of Lloyd's iteration: largest centroid move, in units of the density's
/// standard deviation (z units, where both densities have variance ~1).
constexpr double kLloydTolerance = 1e-13;
constexpr int kLloydMaxIterations = 200000;
/// Absolute error allowed per quadrature panel, z units (the sphere density peaks at 1).
constexpr double kQuadTolerance = 1e-15;
constexpr int kQuadMaxDepth = 40;
constexpr int kGaussLegendreNodes = 12;

/// Nodes and weights of the n-point Gauss-Legendre rule on [-1, 1], computed (not tabulated) by
/// Newton's method on the Legendre polynomial from the three-term recurrence.
struct GaussLegendreRule {
  double x[kGaussLegendreNodes];
  double w[kGaussLegendreNodes];
  GaussLegendreRule() {
    const int n = kGaussLegendreNodes;
    const double pi = 3.14159265358979323846;
    for (int i = 0; i < n; ++i) {
      double z = std::cos(pi * (i + 0.75) / (n + 0.5));  // Tricomi's initial guess
      double dp = 0.0;
      for (int it = 0; it < 100; ++it) {
        double p0 = 1.0, p1 = z;  // P_0, P_1
        for (int k = 2; k <= n; ++k) {
          const double p2 = ((2.0 * k - 1.0) * z * p1 - (k - 1.0) * p0) / k;
          p0 = p1;
          p1 = p2;
        }
        dp = n * (z * p1 - p0) / (z * z - 1.0);  // P_n'(z)
        const double dz = p1 / dp;
        z -= dz;
        if (std::fabs(dz) < 1e-16) break;
      }
      x[i] = z;
      w[i] = 2.0 / ((1.0 - z * z) * dp * dp);
    }
  }
};

inline const GaussLegendreRule& gauss_legendre_rule() {
  static const GaussLegendreRule rule;
  return rule;
}

template <class F>
double gauss_legendre(const F& f, double a, double b) {
  const GaussLegendreRule& r = gauss_legendre_rule();
  const double half = 0.5 * (b - a), mid = 0.5 * (a + b);
  double s = 0.0;
  for (int i = 0; i < kGaussLegendreNodes; ++i) s += r.w[i] * f(mid + half * r.x[i]);
  return s * half;
}

template <class F>
double adaptive_gl(const F& f, double a, double b, double whole, int depth) {
  const double m = 0.5 * (a + b);
  const double left = gauss_legendre(f, a, m);
  const double right = gauss_legendre(f, m, b);
  if (depth >= kQuadMaxDepth || std::fabs(left + right - whole) <= kQuadTolerance) {
    return left + right;
  }
  return adaptive_gl(f, a, m, left, depth + 1) + adaptive_gl(f, m, b, right, depth + 1);
}

/// Integral of f over [a, b]: panels of width <= 1 first (so a decaying integrand is never
/// judged from a few far-apart nodes), then bisection until halves agree with the whole.
template <class F>
double integrate(const F& f, double a, double b) {
  if (!(b > a)) return 0.0;
  const int panels = std::max(1, static_cast<int>(std::ceil(b - a)));
  const double w = (b - a) / panels;
  double s = 0.0;
  for (int p = 0; p < panels; ++p) {
    const double lo = a + p * w, hi = (p + 1 == panels) ? b : a + (p + 1) * w;
    s += adaptive_gl(f, lo, hi, gauss_legendre(f, lo, hi), 0);
  }
  return s;
}

/// Mass, first and second moment of one cell [a, b] of a density.
struct CellMoments {
  double m0, m1, m2;
};

/// Standard normal restricted to [a, b], 0 <= a < b <= inf, normalized over the real line.
/// erfc keeps the tail masses accurate (no 1 - Phi cancellation).
inline CellMoments gaussian_cell(double a, double b) {
  const double inv_sqrt2 = 0.70710678118654752440;
  const double inv_sqrt_2pi = 0.39894228040143267794;
  const double pa = inv_sqrt_2pi * std::exp(-0.5 * a * a);
  const double pb = std::isinf(b) ? 0.0 : inv_sqrt_2pi * std::exp(-0.5 * b * b);
  const double bpb = std::isinf(b) ? 0.0 : b * pb;
  const double m0 = 0.5 * (std::erfc(a * inv_sqrt2) - std::erfc(b * inv_sqrt2));
  return {m0, pa - pb, m0 + a * pa - bpb};
}

/// One coordinate of a uniform unit vector in R^d, in z = x sqrt(d) units:
/// g(z) = (1 - z^2/d)^alpha, alpha = (d - 3)/2, on [0, sqrt(d)], unnormalized (g(0) = 1).
struct SphereCoordinateDensity {
  int d;
  double alpha;
  /// Beyond z = 40 the density is below exp(-200) times its peak for every d >= 4 (and the
  /// support ends at sqrt(3) for d = 3), so integration stops there.
  double upper;
  explicit SphereCoordinateDensity(int dim)
      : d(dim),
        alpha(0.5 * (dim - 3)),
        upper(std::min(std::sqrt(static_cast<double>(dim)), 40.0)) {}
  double g(double z) const {
    const double u = 1.0 - z * z / d;
    if (u <= 0.0) return 0.0;
    return alpha == 0.0 ? 1.0 : std::exp(alpha * std::log1p(-z * z / d));
  }
  /// Closed form of the first moment: d/dz (1 - z^2/d)^(alpha+1) = -(2(alpha+1)/d) z g(z).
  double first_moment(double a, double b) const {
    const double k = d / (2.0 * (alpha + 1.0));
    auto h = [&](double z) {
      const double u = 1.0 - z * z / d;
      return u <= 0.0 ? 0.0 : std::exp((alpha + 1.0) * std::log1p(-z * z / d));
    };
    return k * (h(a) - h(std::min(b, upper)));
  }
  CellMoments cell(double a, double b) const {
    b = std::min(b, upper);
    const double m0 = integrate([this](double z) { return g(z); }, a, b);
    const double m2 = integrate([this](double z) { return z * z * g(z); }, a, b);
    return {m0, first_moment(a, b), m2};
  }
};

/// Lloyd's algorithm on the positive half of a symmetric density, z units. `cell(a, b)`
/// returns the moments of [a, b]; `top` is the upper end of the support. `c` holds the initial
/// positive centroids (ascending) and receives the result; returns the MSE of the full
/// (mirrored) quantizer normalized by the density's total mass.
template <class CellFn>
double lloyd_half(const CellFn& cell, double top, std::vector<double>& c, int bits) {
  const int k = static_cast<int>(c.size());
  std::vector<double> t(k + 1);
  auto bounds = [&] {
    t[0] = 0.0;
    for (int i = 1; i < k; ++i) t[i] = 0.5 * (c[i - 1] + c[i]);
    t[k] = top;
  };
  int it = 0;
  for (; it < kLloydMaxIterations; ++it) {
    bounds();
    double moved = 0.0;
    for (int i = 0; i < k; ++i) {
      const CellMoments m = cell(t[i], t[i + 1]);
      const double next = m.m0 > 0.0 ? m.m1 / m.m0 : 0.5 * (t[i] + std::min(t[i + 1], 50.0));
      moved = std::max(moved, std::fabs(next - c[i]));
      c[i] = next;
    }
    if (moved < kLloydTolerance) break;
  }
  KVQ_REQUIRE(it < kLloydMaxIterations, kOutOfRange, "Lloyd-Max (", bits,
              " bits): no convergence after ", kLloydMaxIterations, " iterations");
  bounds();
  double mass = 0.0, err = 0.0;
  for (int i = 0; i < k; ++i) {
    const CellMoments m = cell(t[i], t[i + 1]);
    mass += m.m0;
    err += m.m2 - 2.0 * c[i] * m.m1 + c[i] * c[i] * m.m0;
  }
  return err / mass;
}

/// Mirrors positive centroids (z units) into a full codebook in output units (z * unit).
inline Codebook make_symmetric_codebook(int bits, const std::vector<double>& pos, double unit,
                                        double mse) {
  const int k = static_cast<int>(pos.size());
  Codebook cb;
  cb.bits = bits;
  cb.mse = mse;
  cb.centroids.resize(2 * k);
  for (int i = 0; i < k; ++i) {
    const float v = static_cast<float>(pos[i] * unit);
    cb.centroids[k + i] = v;
    cb.centroids[k - 1 - i] = -v;
  }
  cb.thresholds.resize(2 * k - 1);
  for (int i = 0; i + 1 < 2 * k; ++i) {  // midpoints of the stored floats: exact nearest rule
    cb.thresholds[i] = static_cast<float>(
        0.5 * (static_cast<double>(cb.centroids[i]) + static_cast<double>(cb.centroids[i + 1])));
  }
  cb.thresholds[k - 1] = 0.0f;
  return cb;
}

/// Largest supported width. Lloyd's iteration converges linearly and about 4x slower per extra
/// bit (measured: 751 iterations at 4 bits, 2735 at 5, 10089 at 6 for the Gaussian), and the
/// sphere's quadrature makes each iteration costly: 5 bits already takes ~0.5 s at d = 128.
constexpr int kMaxCodebookBits = 4;

inline void require_bits(int bits) {
  KVQ_REQUIRE(bits >= 1 && bits <= 8, kInvalidArgument, "Lloyd-Max codebook: bits must be in ",
              "[1, ", kMaxCodebookBits, "], got ", bits);
  KVQ_REQUIRE(bits <= kMaxCodebookBits, kUnsupported, "Lloyd-Max codebook: ", bits,
              " bits is not supported (at most ", kMaxCodebookBits,
              "; Lloyd's iteration would take seconds at this width)");
}

/// Positive Gaussian Lloyd-Max centroids (z units) for 2^bits levels, and its MSE.
inline std::pair<std::vector<double>, double> gaussian_positive(int bits) {
  const int k = 1 << (bits - 1);
  std::vector<double> c(k);
  for (int i = 0; i < k; ++i) c[i] = (i + 0.5) * 4.0 / k;  // spread over [0, 4]; Lloyd fixes it
  const double mse = lloyd_half(gaussian_cell, INFINITY, c, bits);
  return {c, mse};
}

}  // namespace detail

/// Computes (uncached) the Lloyd-Max codebook of N(0, 1) with 2^bits levels, bits in [1, 4].
inline Codebook compute_lloyd_max_gaussian(int bits) {
  detail::require_bits(bits);
  const auto pos_mse = detail::gaussian_positive(bits);
  return detail::make_symmetric_codebook(bits, pos_mse.first, 1.0, pos_mse.second);
}

/// Computes (uncached) the Lloyd-Max codebook of one coordinate of a uniform random unit vector
/// in R^dim (dim in [3, 65536], bits in [1, 4]), raw unit-vector units. Lloyd starts from the
/// Gaussian solution (the large-d limit), which is already close.
inline Codebook compute_lloyd_max_sphere(int dim, int bits) {
  detail::require_bits(bits);
  KVQ_REQUIRE(dim >= 3 && dim <= 65536, kInvalidArgument,
              "Lloyd-Max sphere codebook: dimension must be in [3, 65536], got ", dim);
  const detail::SphereCoordinateDensity dens(dim);
  std::vector<double> c = detail::gaussian_positive(bits).first;
  for (size_t i = 0; i < c.size(); ++i) {  // keep the start inside the support (small d)
    c[i] =
        std::min(c[i], dens.upper * (static_cast<double>(i) + 0.5) / static_cast<double>(c.size()));
  }
  const double mse_z = detail::lloyd_half([&dens](double a, double b) { return dens.cell(a, b); },
                                          dens.upper, c, bits);
  const double unit = 1.0 / std::sqrt(static_cast<double>(dim));
  return detail::make_symmetric_codebook(bits, c, unit, mse_z / dim);
}

namespace detail {
/// Process-wide cache: codebooks live until exit, so returned references stay valid. One mutex
/// serializes lookups and first computations (each takes well under a second, once).
template <class Make>
const Codebook& cached_codebook(int dim, int bits, const Make& make) {
  static std::mutex mu;
  static std::map<std::pair<int, int>, std::unique_ptr<const Codebook>> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto& slot = cache[{dim, bits}];
  if (!slot) slot = std::make_unique<const Codebook>(make());
  return *slot;
}
}  // namespace detail

/// Cached Lloyd-Max codebook of N(0, 1), 2^bits levels (bits in [1, 4]).
inline const Codebook& lloyd_max_gaussian(int bits) {
  detail::require_bits(bits);
  return detail::cached_codebook(0, bits, [bits] { return compute_lloyd_max_gaussian(bits); });
}

/// Cached Lloyd-Max codebook of one coordinate of a uniform random unit vector in R^dim
/// (dim in [3, 65536], bits in [1, 4]).
inline const Codebook& lloyd_max_sphere(int dim, int bits) {
  detail::require_bits(bits);
  KVQ_REQUIRE(dim >= 3 && dim <= 65536, kInvalidArgument,
              "Lloyd-Max sphere codebook: dimension must be in [3, 65536], got ", dim);
  return detail::cached_codebook(dim, bits,
                                 [dim, bits] { return compute_lloyd_max_sphere(dim, bits); });
}

inline void Codebook::encode(const float* x, uint8_t* idx, int64_t n) const {
  int64_t i = 0;
#if KVQ_HAS_AVX512
  if (bits <= 4) {
    // Binary search in registers: the (<= 15) thresholds sit in one zmm, padded with +inf
    // (never reached: the search only reads positions below 2^bits - 1).
    alignas(64) float thr[16];
    for (int k = 0; k < 16; ++k) thr[k] = k < levels() - 1 ? thresholds[k] : INFINITY;
    const __m512 tv = _mm512_load_ps(thr);
    for (; i + 16 <= n; i += 16) {
      const __m512 v = _mm512_loadu_ps(x + i);
      __m512i id = _mm512_setzero_si512();
      for (int step = 1 << (bits - 1); step > 0; step >>= 1) {
        const __m512 t =
            _mm512_permutexvar_ps(_mm512_add_epi32(id, _mm512_set1_epi32(step - 1)), tv);
        const __mmask16 ge = _mm512_cmp_ps_mask(v, t, _CMP_GE_OQ);
        id = _mm512_mask_add_epi32(id, ge, id, _mm512_set1_epi32(step));
      }
      _mm_storeu_si128(reinterpret_cast<__m128i*>(idx + i), _mm512_cvtepi32_epi8(id));
    }
  }
#elif KVQ_HAS_AVX2
  if (bits <= 4) {
    // Count of thresholds <= x: each compare yields -1 (all ones) where x >= t.
    const int nt = levels() - 1;
    for (; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      __m256i id = _mm256_setzero_si256();
      for (int k = 0; k < nt; ++k) {
        const __m256 ge = _mm256_cmp_ps(v, _mm256_set1_ps(thresholds[k]), _CMP_GE_OQ);
        id = _mm256_sub_epi32(id, _mm256_castps_si256(ge));
      }
      const __m128i w =
          _mm_packs_epi32(_mm256_castsi256_si128(id), _mm256_extracti128_si256(id, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(idx + i), _mm_packus_epi16(w, w));
    }
  }
#endif
  for (; i < n; ++i) idx[i] = codebook_encode(thresholds.data(), bits, x[i]);
}

inline void Codebook::decode(const uint8_t* idx, float* x, int64_t n) const {
  int64_t i = 0;
  const int mask = levels() - 1;
#if KVQ_HAS_AVX512
  if (bits <= 4) {
    alignas(64) float cen[16];
    for (int k = 0; k < 16; ++k) cen[k] = centroids[k & mask];
    const __m512 cv = _mm512_load_ps(cen);
    const __m512i mv = _mm512_set1_epi32(mask);
    for (; i + 16 <= n; i += 16) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(idx + i));
      const __m512i id = _mm512_and_si512(_mm512_cvtepu8_epi32(b), mv);
      _mm512_storeu_ps(x + i, _mm512_permutexvar_ps(id, cv));
    }
  }
#elif KVQ_HAS_AVX2
  if (bits <= 4) {
    // 16-entry table lookup as two 8-entry permutes (low 3 index bits) and a blend on bit 3.
    alignas(32) float cen[16];
    for (int k = 0; k < 16; ++k) cen[k] = centroids[k & mask];
    const __m256 lo = _mm256_load_ps(cen), hi = _mm256_load_ps(cen + 8);
    const __m256i mv = _mm256_set1_epi32(mask);
    for (; i + 8 <= n; i += 8) {
      const __m256i id = _mm256_and_si256(
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(idx + i))), mv);
      const __m256 upper = _mm256_castsi256_ps(_mm256_slli_epi32(id, 28));  // bit 3 -> sign
      _mm256_storeu_ps(x + i, _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, id),
                                               _mm256_permutevar8x32_ps(hi, id), upper));
    }
  }
#endif
  for (; i < n; ++i) x[i] = centroids[idx[i] & mask];
}

}  // namespace kvq
