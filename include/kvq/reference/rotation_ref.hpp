#pragma once
/// \file rotation_ref.hpp
/// Scalar oracles for kvq/geometry/rotation.hpp, written straight from the definitions with no
/// SIMD and no shared code, so a wrong fast path cannot hide behind a shared helper.
///
/// fwht_ref and the hadamard_rotation_*_ref functions keep the operation order documented in
/// rotation.hpp (+-1 signs first, butterfly stages h = 1, 2, 4, ..., one rounding multiply
/// last), so the fast paths must match them bit for bit. hadamard_matrix_ref and
/// dense_rotation_ref accumulate in double from the explicit matrices: they check the fast
/// transforms to a tolerance, independently of operation order.
#include <cmath>
#include <cstdint>
#include <vector>

namespace kvq {
namespace reference {

/// Orthonormal FWHT, in place: butterfly stages h = 1, 2, ..., n/2, then * (1/sqrt(n)).
inline void fwht_ref(float* x, int n) {
  for (int h = 1; h < n; h *= 2) {
    for (int i = 0; i < n; i += 2 * h) {
      for (int j = i; j < i + h; ++j) {
        const float a = x[j];
        const float b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
    }
  }
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(n)));
  for (int i = 0; i < n; ++i) x[i] = x[i] * scale;
}

/// Sylvester Hadamard entry H[i][j] = (-1)^popcount(i & j).
inline int hadamard_entry_ref(int i, int j) {
  int bits = i & j;
  int parity = 0;
  while (bits) {
    parity ^= bits & 1;
    bits >>= 1;
  }
  return parity ? -1 : 1;
}

/// y = H x / sqrt(n) from the explicit matrix, in double. O(n^2).
inline std::vector<double> hadamard_matrix_ref(const float* x, int n) {
  std::vector<double> y(n, 0.0);
  for (int i = 0; i < n; ++i) {
    double s = 0.0;
    for (int j = 0; j < n; ++j) s += hadamard_entry_ref(i, j) * static_cast<double>(x[j]);
    y[i] = s / std::sqrt(static_cast<double>(n));
  }
  return y;
}

/// Unscaled butterflies of one block (helper of the rotation oracles below).
inline void butterflies_ref(float* x, int n) {
  for (int h = 1; h < n; h *= 2) {
    for (int i = 0; i < n; i += 2 * h) {
      for (int j = i; j < i + h; ++j) {
        const float a = x[j];
        const float b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
    }
  }
}

/// Forward randomized Hadamard rotation y = Hb D2 P Hb D1 x (or H D1 x / sqrt(d) when
/// block == dim, in which case perm and sign2 are unused), in place. Hb = blocks of `block`
/// orthonormal Hadamard, (P u)[i] = u[perm[i]].
inline void hadamard_rotation_ref(float* x, int dim, int block, const float* sign1,
                                  const int32_t* perm, const float* sign2) {
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(block)));
  for (int i = 0; i < dim; ++i) x[i] = x[i] * sign1[i];
  for (int o = 0; o < dim; o += block) butterflies_ref(x + o, block);
  for (int i = 0; i < dim; ++i) x[i] = x[i] * scale;
  if (block == dim) return;
  std::vector<float> t(dim);
  for (int i = 0; i < dim; ++i) t[i] = x[perm[i]] * sign2[i];
  for (int o = 0; o < dim; o += block) butterflies_ref(t.data() + o, block);
  for (int i = 0; i < dim; ++i) x[i] = t[i] * scale;
}

/// Inverse of hadamard_rotation_ref: x = D1 Hb P^T D2 Hb y, in place.
inline void hadamard_rotation_inverse_ref(float* x, int dim, int block, const float* sign1,
                                          const int32_t* perm, const float* sign2) {
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(block)));
  if (block == dim) {
    butterflies_ref(x, dim);
    for (int i = 0; i < dim; ++i) x[i] = x[i] * (sign1[i] * scale);
    return;
  }
  for (int o = 0; o < dim; o += block) butterflies_ref(x + o, block);
  std::vector<float> t(dim);
  for (int i = 0; i < dim; ++i) t[perm[i]] = x[i] * (sign2[i] * scale);
  for (int o = 0; o < dim; o += block) butterflies_ref(t.data() + o, block);
  for (int i = 0; i < dim; ++i) x[i] = t[i] * (sign1[i] * scale);
}

/// y = Q x (or Q^T x when inverse) for a row-major dim x dim matrix q, accumulated in double.
inline std::vector<double> dense_rotation_ref(const float* q, const float* x, int dim,
                                              bool inverse) {
  std::vector<double> y(dim, 0.0);
  for (int i = 0; i < dim; ++i) {
    double s = 0.0;
    for (int j = 0; j < dim; ++j) {
      const float qij =
          inverse ? q[static_cast<int64_t>(j) * dim + i] : q[static_cast<int64_t>(i) * dim + j];
      s += static_cast<double>(qij) * x[j];
    }
    y[i] = s;
  }
  return y;
}

}  // namespace reference
}  // namespace kvq
