#pragma once
/// \file nuq.hpp
/// Non-uniform quantization datatype (KVQuant's "nuq<b>"): 2^b levels learned per (layer, K or
/// V) by weighted k-means on calibration data, applied after the same per-group min/max
/// normalization as the asymmetric int formats.
///
///   u  = (x - zero) * inv          zero = min of the group (stored), inv = 1 / (max - zero)
///   c  = codebook_encode(thresholds, b, u)   nearest level, ties go up (format/codebook.hpp)
///   x' = fma(scale, level[c], zero)
///
/// Levels live in the normalized space (a group's min maps to 0 and its max to 1), so one
/// codebook serves every group of a layer. The codebook is per-layer metadata: 2^b floats
/// (4 * 2^b bytes) held by the layer's QuantConfig, counted once per layer by the accountant
/// (nuq_codebook_bytes), never per block.
///
/// weighted_kmeans_1d is the learner: Lloyd iterations to convergence from a deterministic
/// seed (weighted quantiles), on sorted samples with prefix sums, so one iteration costs
/// O(K log N). On N(0, 1) samples it converges to the Lloyd-Max levels of
/// format/codebook.hpp (tests/format/test_nuq.cpp checks it).
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "kvq/core/error.hpp"
#include "kvq/format/codebook.hpp"

namespace kvq {

/// Largest nuq codebook: 2^4 levels.
inline constexpr int kNuqMaxLevels = 16;

/// Checks that `bits` is a nuq width (2, 3 or 4).
inline void check_nuq_bits(int bits) {
  KVQ_REQUIRE(bits >= 2 && bits <= 4, kInvalidArgument, "nuq formats have 2, 3 or 4 bits, got ",
              bits);
}

/// Bytes a nuq<bits> codebook takes as per-layer metadata (f32 levels).
inline std::size_t nuq_codebook_bytes(int bits) {
  check_nuq_bits(bits);
  return 4u * (std::size_t{1} << bits);
}

/// Thresholds (midpoints of adjacent levels, computed in float) of `n` ascending levels;
/// `thr` gets n - 1 values. The encoder compares with these only, so quantizer and oracle
/// agree bit for bit.
KVQ_HOST_DEVICE void nuq_thresholds(const float* levels, int n, float* thr) {
  for (int i = 0; i + 1 < n; ++i) thr[i] = 0.5f * (levels[i] + levels[i + 1]);
}

/// Throws kInvalidArgument unless levels[0..2^bits) are finite and strictly ascending.
inline void check_nuq_levels(const float* levels, int bits, const char* what = "nuq codebook") {
  check_nuq_bits(bits);
  const int n = 1 << bits;
  for (int i = 0; i < n; ++i) {
    KVQ_REQUIRE(std::isfinite(levels[i]), kInvalidArgument, what, ": level ", i, " is ",
                levels[i], " (levels must be finite)");
    KVQ_REQUIRE(i == 0 || levels[i] > levels[i - 1], kInvalidArgument, what, ": levels must be ",
                "strictly ascending, but level ", i, " (", levels[i], ") <= level ", i - 1, " (",
                levels[i - 1], ")");
  }
}

/// Result of weighted_kmeans_1d.
struct KMeansResult {
  std::vector<double> centroids;  ///< [k], ascending
  int iterations = 0;             ///< Lloyd iterations run
  bool converged = false;         ///< assignments stopped changing before the iteration cap
  double distortion = 0.0;        ///< weighted mean squared error of the final assignment
};

/// Options of the k-means learner.
struct KMeansOptions {
  int max_iterations = 1000;
};

/// Weighted 1-D k-means (Lloyd). `x` and `w` (w >= 0, same length) are the samples and their
/// weights (nullptr = uniform). Deterministic: samples are sorted, the seeds are the weighted
/// (i + 0.5) / k quantiles, and each iteration moves every centroid to the weighted mean of its
/// cell (cells are split at the midpoints of adjacent centroids; a sample exactly on a
/// midpoint goes up, as codebook_encode does). An empty cell keeps its centroid. Stops when no
/// cell boundary moves (exact convergence of Lloyd's algorithm on a finite sample). When the
/// data has fewer distinct values than k, the missing centroids are spread between the
/// neighbours so the levels stay strictly ascending.
inline KMeansResult weighted_kmeans_1d(const std::vector<float>& x, const std::vector<float>* w,
                                       int k, KMeansOptions opt = {}) {
  KVQ_REQUIRE(k >= 1 && k <= 256, kInvalidArgument, "k-means: k must be in [1, 256], got ", k);
  KVQ_REQUIRE(!x.empty(), kInvalidArgument, "k-means: no samples");
  KVQ_REQUIRE(w == nullptr || w->size() == x.size(), kInvalidArgument, "k-means: ", x.size(),
              " samples but ", w ? w->size() : 0, " weights");
  const std::size_t n = x.size();
  std::vector<std::size_t> order(n);
  std::iota(order.begin(), order.end(), std::size_t{0});
  for (std::size_t i = 0; i < n; ++i) {
    KVQ_REQUIRE(std::isfinite(x[i]), kNonFinite, "k-means: sample ", i, " is ", x[i]);
    if (w)
      KVQ_REQUIRE(std::isfinite((*w)[i]) && (*w)[i] >= 0.f, kInvalidArgument, "k-means: weight ",
                  i, " is ", (*w)[i], " (weights must be finite and >= 0)");
  }
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return x[a] < x[b]; });
  std::vector<double> xs(n), cw(n + 1, 0.0), cwx(n + 1, 0.0);
  for (std::size_t i = 0; i < n; ++i) {
    xs[i] = x[order[i]];
    const double wi = w ? static_cast<double>((*w)[order[i]]) : 1.0;
    cw[i + 1] = cw[i] + wi;
    cwx[i + 1] = cwx[i] + wi * xs[i];
  }
  const double total = cw[n];
  KVQ_REQUIRE(total > 0.0, kInvalidArgument, "k-means: all weights are zero");

  KMeansResult r;
  r.centroids.resize(static_cast<std::size_t>(k));
  // Seeds: weighted quantiles.
  for (int j = 0; j < k; ++j) {
    const double target = (j + 0.5) / k * total;
    const auto it = std::upper_bound(cw.begin() + 1, cw.end(), target);
    const std::size_t i = std::min<std::size_t>(static_cast<std::size_t>(it - (cw.begin() + 1)), n - 1);
    r.centroids[static_cast<std::size_t>(j)] = xs[i];
  }
  auto spread = [&](std::vector<double>& c) {  // make strictly ascending
    std::sort(c.begin(), c.end());
    for (int j = 1; j < k; ++j) {
      if (!(c[j] > c[j - 1])) {
        const double step = std::max(std::fabs(c[j - 1]) * 1e-6, 1e-6);
        c[j] = c[j - 1] + step;
      }
    }
  };
  spread(r.centroids);
  std::vector<std::size_t> bounds(static_cast<std::size_t>(k) + 1, 0), prev;
  auto assign = [&]() {  // bounds[j]..bounds[j+1] = cell j
    bounds[0] = 0;
    bounds[static_cast<std::size_t>(k)] = n;
    for (int j = 0; j + 1 < k; ++j) {
      const double mid = 0.5 * (r.centroids[j] + r.centroids[j + 1]);
      bounds[static_cast<std::size_t>(j) + 1] =
          static_cast<std::size_t>(std::lower_bound(xs.begin(), xs.end(), mid) - xs.begin());
    }
  };
  assign();
  for (r.iterations = 0; r.iterations < opt.max_iterations;) {
    for (int j = 0; j < k; ++j) {
      const std::size_t a = bounds[j], b = bounds[j + 1];
      const double wsum = cw[b] - cw[a];
      if (b > a && wsum > 0.0) r.centroids[j] = (cwx[b] - cwx[a]) / wsum;
    }
    spread(r.centroids);
    ++r.iterations;
    prev = bounds;
    assign();
    if (bounds == prev) {
      r.converged = true;
      break;
    }
  }
  double err = 0.0;
  for (int j = 0; j < k; ++j)
    for (std::size_t i = bounds[j]; i < bounds[j + 1]; ++i) {
      const double d = xs[i] - r.centroids[j];
      err += (w ? static_cast<double>((*w)[order[i]]) : 1.0) * d * d;
    }
  r.distortion = err / total;
  return r;
}

/// A learned nuq codebook: 2^bits ascending float levels in the normalized space.
struct NuqCodebook {
  int bits = 0;
  std::array<float, kNuqMaxLevels> levels{};
  int size() const { return 1 << bits; }
};

/// Learns a nuq<bits> codebook from normalized samples (u in [0, 1]) and weights.
inline NuqCodebook learn_nuq_codebook(const std::vector<float>& u, const std::vector<float>* w,
                                      int bits, KMeansOptions opt = {}) {
  check_nuq_bits(bits);
  const KMeansResult r = weighted_kmeans_1d(u, w, 1 << bits, opt);
  NuqCodebook cb;
  cb.bits = bits;
  for (int i = 0; i < cb.size(); ++i) cb.levels[static_cast<std::size_t>(i)] = static_cast<float>(r.centroids[static_cast<std::size_t>(i)]);
  for (int i = 1; i < cb.size(); ++i)  // float rounding may merge close levels
    if (!(cb.levels[i] > cb.levels[i - 1]))
      cb.levels[i] = std::nextafter(cb.levels[i - 1], INFINITY);
  check_nuq_levels(cb.levels.data(), bits);
  return cb;
}

}  // namespace kvq
