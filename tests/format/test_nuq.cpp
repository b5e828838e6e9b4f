// Tests of format/nuq.hpp: weighted 1-D k-means (determinism, convergence, Lloyd-Max limit on
// Gaussian data, weights), codebook learning and validation.
#include "kvq/format/nuq.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kvq/format/codebook.hpp"

namespace {

std::vector<float> gaussian(std::size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> x(n);
  for (auto& v : x) v = nd(rng);
  return x;
}

/// n quantiles of N(0, 1): x_i = Phi^-1((i + 0.5) / n) by bisection (a noise-free sample).
std::vector<float> gaussian_quantiles(std::size_t n) {
  std::vector<float> x(n);
  for (std::size_t i = 0; i < n; ++i) {
    const double p = (static_cast<double>(i) + 0.5) / static_cast<double>(n);
    double lo = -10, hi = 10;
    for (int it = 0; it < 60; ++it) {
      const double mid = 0.5 * (lo + hi);
      (0.5 * std::erfc(-mid / std::sqrt(2.0)) < p ? lo : hi) = mid;
    }
    x[i] = static_cast<float>(0.5 * (lo + hi));
  }
  return x;
}

TEST(NuqKMeans, GaussianApproachesLloydMax) {
  const auto x = gaussian_quantiles(100000);
  for (int bits = 1; bits <= 4; ++bits) {
    const kvq::Codebook& lm = kvq::lloyd_max_gaussian(bits);
    const auto r = kvq::weighted_kmeans_1d(x, nullptr, 1 << bits);
    ASSERT_TRUE(r.converged) << bits;
    ASSERT_EQ(r.centroids.size(), lm.centroids.size());
    // The quantile sample cuts the tails at |x| ~ 4.4: the outer cells of 4 bits move most.
    const double tol = bits <= 3 ? 2e-3 : 1e-2;
    for (std::size_t i = 0; i < r.centroids.size(); ++i)
      EXPECT_NEAR(r.centroids[i], lm.centroids[i], tol) << "bits " << bits << " level " << i;
    EXPECT_NEAR(r.distortion, lm.mse, 0.1 * lm.mse + 1e-3) << bits;
  }
}

TEST(NuqKMeans, Deterministic) {
  auto x = gaussian(5000, 3);
  const auto a = kvq::weighted_kmeans_1d(x, nullptr, 8);
  const auto b = kvq::weighted_kmeans_1d(x, nullptr, 8);
  EXPECT_EQ(a.centroids, b.centroids);
  EXPECT_EQ(a.iterations, b.iterations);
  // Sample order does not matter (samples are sorted first).
  std::reverse(x.begin(), x.end());
  const auto c = kvq::weighted_kmeans_1d(x, nullptr, 8);
  EXPECT_EQ(a.centroids, c.centroids);
}

TEST(NuqKMeans, ConvergesToFixedPoint) {
  const auto x = gaussian(3000, 11);
  const auto r = kvq::weighted_kmeans_1d(x, nullptr, 4);
  ASSERT_TRUE(r.converged);
  // Every centroid is the mean of its cell (Lloyd's fixed point).
  std::vector<double> sum(4, 0.0), cnt(4, 0.0);
  for (float v : x) {
    int j = 0;
    while (j + 1 < 4 && v >= 0.5 * (r.centroids[j] + r.centroids[j + 1])) ++j;
    sum[j] += v;
    cnt[j] += 1;
  }
  for (int j = 0; j < 4; ++j) EXPECT_NEAR(r.centroids[j], sum[j] / cnt[j], 1e-9);
}

TEST(NuqKMeans, WeightsPullCentroids) {
  // Two clusters at 0 and 1 plus one at 10; with k = 2 and heavy weight on 10, one centroid
  // sits at 10.
  std::vector<float> x, w;
  for (int i = 0; i < 100; ++i) {
    x.push_back(0.f), w.push_back(1.f);
    x.push_back(1.f), w.push_back(1.f);
  }
  x.push_back(10.f), w.push_back(1000.f);
  const auto r = kvq::weighted_kmeans_1d(x, &w, 2);
  EXPECT_NEAR(r.centroids[1], 10.0, 1e-9);
  EXPECT_NEAR(r.centroids[0], 0.5, 1e-9);
  const auto u = kvq::weighted_kmeans_1d(x, nullptr, 2);
  EXPECT_LT(u.centroids[1], 10.0);
}

TEST(NuqKMeans, FewDistinctValuesStayAscending) {
  const std::vector<float> x(50, 0.25f);
  // One distinct value: every sample in the first cell, whose centroid is the value itself
  // (zero distortion); the empty cells are spread 1e-6 apart above it (the documented step).
  const auto r = kvq::weighted_kmeans_1d(x, nullptr, 8);
  EXPECT_TRUE(r.converged);
  EXPECT_EQ(r.distortion, 0.0);
  const auto cb = kvq::learn_nuq_codebook(x, nullptr, 3);
  EXPECT_EQ(cb.levels[0], 0.25f);
  for (int i = 1; i < cb.size(); ++i) {
    EXPECT_GT(cb.levels[i], cb.levels[i - 1]);
    EXPECT_FLOAT_EQ(cb.levels[i], static_cast<float>(0.25 + 1e-6 * i)) << i;
  }
  // The value encodes to level 0 and decodes exactly.
  float thr[kvq::kNuqMaxLevels];
  kvq::nuq_thresholds(cb.levels.data(), cb.size(), thr);
  EXPECT_EQ(kvq::codebook_encode(thr, 3, 0.25f), 0);
  // Two distinct values, k = 4: the quantile seeds are 0, 0, 1, 1; the duplicates are spread
  // 1e-6 above and the empty cells keep them, so two centroids sit exactly on the values.
  std::vector<float> y(40, 0.f);
  for (std::size_t i = 0; i < y.size(); i += 2) y[i] = 1.f;
  const auto r2 = kvq::weighted_kmeans_1d(y, nullptr, 4);
  EXPECT_EQ(r2.distortion, 0.0);
  EXPECT_EQ(r2.centroids[0], 0.0);
  EXPECT_DOUBLE_EQ(r2.centroids[1], 1e-6);
  EXPECT_EQ(r2.centroids[2], 1.0);
  EXPECT_DOUBLE_EQ(r2.centroids[3], 1.0 + 1e-6);
}

TEST(NuqKMeans, BadInputRejected) {
  std::vector<float> x{0.f, 1.f, NAN};
  EXPECT_THROW(kvq::weighted_kmeans_1d(x, nullptr, 2), kvq::Error);
  std::vector<float> y{0.f, 1.f}, w{1.f, -1.f};
  EXPECT_THROW(kvq::weighted_kmeans_1d(y, &w, 2), kvq::Error);
  std::vector<float> w0{0.f, 0.f};
  EXPECT_THROW(kvq::weighted_kmeans_1d(y, &w0, 2), kvq::Error);
  EXPECT_THROW(kvq::weighted_kmeans_1d({}, nullptr, 2), kvq::Error);
  EXPECT_THROW(kvq::learn_nuq_codebook(y, nullptr, 5), kvq::Error);
  const float bad[4] = {0.f, 0.5f, 0.5f, 1.f};
  EXPECT_THROW(kvq::check_nuq_levels(bad, 2), kvq::Error);
  EXPECT_EQ(kvq::nuq_codebook_bytes(3), 32u);
}

}  // namespace
