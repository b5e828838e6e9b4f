#pragma once
/// \file dense_rotation.hpp
/// Dense Haar-random rotations (the oracle and the alternative to the randomized Hadamard
/// transform). Kept apart from rotation.hpp because drawing one needs Eigen's Householder QR,
/// and Eigen's headers cost far more compile time than the rest of kvq together; include this
/// header only where a dense rotation is built.
///
/// Stream layout (reproducible from (dim, seed) alone): Xoshiro256ss(seed).normal() fills a
/// dim x dim matrix G row by row (double); G = Q R by Householder QR; column j of Q is negated
/// when R(j, j) < 0 (this makes Q exactly Haar-distributed); Q is rounded to float and applied
/// as y = Q x (inverse y = Q^T x). Q's last bits depend on the math library and Eigen's SIMD
/// level: deterministic per build, equal across platforms up to float rounding.

#include <Eigen/Dense>
#include <cstdint>
#include <vector>

#include "kvq/core/error.hpp"
#include "kvq/geometry/rotation.hpp"

namespace kvq {

/// The Haar-random orthogonal matrix of (dim, seed), [dim, dim] row-major float.
/// kUnsupported for dim above Rotation::kMaxDenseDim, kInvalidArgument for dim <= 0.
inline std::vector<float> dense_rotation_matrix(int dim, uint64_t seed) {
  KVQ_REQUIRE(dim > 0, kInvalidArgument, "rotation: dimension must be positive, got ", dim);
  KVQ_REQUIRE(dim <= Rotation::kMaxDenseDim, kUnsupported, "dense rotation: dimension ", dim,
              " exceeds ", Rotation::kMaxDenseDim, " (its matrix would be dim^2 floats)");
  detail::Xoshiro256ss rng(seed);
  Eigen::MatrixXd g(dim, dim);
  for (int i = 0; i < dim; ++i) {
    for (int j = 0; j < dim; ++j) g(i, j) = rng.normal();
  }
  const Eigen::HouseholderQR<Eigen::MatrixXd> qr(g);
  Eigen::MatrixXd q = qr.householderQ();
  const Eigen::MatrixXd& r = qr.matrixQR();  // R is its upper triangle
  for (int j = 0; j < dim; ++j) {
    if (r(j, j) < 0) q.col(j) = -q.col(j);
  }
  std::vector<float> out(static_cast<size_t>(dim) * static_cast<size_t>(dim));
  for (int i = 0; i < dim; ++i) {
    for (int j = 0; j < dim; ++j) {
      out[static_cast<size_t>(i) * dim + j] = static_cast<float>(q(i, j));
    }
  }
  return out;
}

/// A dense Haar-random rotation of R^dim (O(d^3) to draw, ~50 ms at d = 512; O(d^2) per vector).
inline Rotation dense_rotation(int dim, uint64_t seed) {
  // Float rounding of an orthonormal double matrix leaves |Q^T Q - I| ~ sqrt(d) * 2^-24.
  return Rotation::from_matrix(dim, seed, dense_rotation_matrix(dim, seed), 1e-4);
}

/// Either kind: Rotation::hadamard or dense_rotation.
inline Rotation make_rotation(RotationKind kind, int dim, uint64_t seed) {
  return kind == RotationKind::kDense ? dense_rotation(dim, seed) : Rotation::hadamard(dim, seed);
}

}  // namespace kvq
