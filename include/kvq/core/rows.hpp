#pragma once
/// \file rows.hpp
/// Row access for kernels: a (token, head) row of head_dim elements as contiguous floats,
/// converting from f16/bf16 or gathering strided data into a scratch buffer only when needed.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "kvq/core/error.hpp"
#include "kvq/core/half.hpp"
#include "kvq/core/tensor.hpp"

namespace kvq::detail {

/// Returns a pointer to row (t, h) of `v` as floats: the data itself for a dim-contiguous float
/// view, else `buf` (head_dim floats) filled by conversion.
template <class T>
const float* load_row(const KVView<const T>& v, int64_t t, int64_t h, float* buf) {
  const T* p = v.row(t, h);
  const int64_t d = v.head_dim();
  if (v.dim_contiguous()) {
    if constexpr (std::is_same_v<T, float>) {
      return p;
    } else {
      convert(p, buf, static_cast<std::size_t>(d));
      return buf;
    }
  }
  const int64_t sd = v.strides().dim;
  for (int64_t i = 0; i < d; ++i) buf[i] = to_float(p[i * sd]);
  return buf;
}

/// Writes head_dim floats into row (t, h) of `v`, rounding to its element type.
template <class T>
void store_row(const KVView<T>& v, int64_t t, int64_t h, const float* src) {
  T* p = v.row(t, h);
  const int64_t d = v.head_dim();
  if (v.dim_contiguous()) {
    if constexpr (std::is_same_v<T, float>) {
      if (p != src) std::copy(src, src + d, p);
    } else {
      convert(src, p, static_cast<std::size_t>(d));
    }
    return;
  }
  const int64_t sd = v.strides().dim;
  for (int64_t i = 0; i < d; ++i) p[i * sd] = from_float<T>(src[i]);
}

/// Throws kNonFinite naming the first NaN/inf element of row (t, h).
template <class T>
[[noreturn]] void throw_non_finite_row(const KVView<const T>& v, int64_t t, int64_t h,
                                       const char* what) {
  for (int64_t d = 0; d < v.head_dim(); ++d) {
    const float x = to_float(v.at(t, h, d));
    if (!std::isfinite(x))
      fail(ErrorKind::kNonFinite, what, ": element (token=", t, ", head=", h, ", channel=", d,
           ") is ", x, "; kvq quantizes finite values only");
  }
  fail(ErrorKind::kNonFinite, what, ": non-finite value in row (token=", t, ", head=", h, ")");
}

}  // namespace kvq::detail

namespace kvq {

/// The whole view as contiguous [tokens, heads, head_dim] floats (any strides, f32/f16/bf16).
template <class T>
std::vector<float> to_float_nhd(const KVView<const T>& v) {
  const int64_t d = v.head_dim();
  std::vector<float> out(static_cast<std::size_t>(v.numel()));
  for (int64_t t = 0; t < v.tokens(); ++t)
    for (int64_t h = 0; h < v.heads(); ++h) {
      float* dst = out.data() + (t * v.heads() + h) * d;
      const float* r = detail::load_row(v, t, h, dst);
      if (r != dst) std::copy(r, r + d, dst);
    }
  return out;
}

}  // namespace kvq
