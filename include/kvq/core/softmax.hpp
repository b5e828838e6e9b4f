#pragma once
/// \file softmax.hpp
/// The online-softmax state, written once for host and device: a running maximum m and the
/// running sum l of exp(score - m) for one query row. The fused CPU kernels (per tile and when
/// merging the flash-decoding chunks), the CUDA decode (merging its warps and splits) and the
/// attention oracle (per segment, in double) keep their rows in it; the accumulators that go with a row stay with the caller, which rescales
/// them by the factor raise() returns.
#include "kvq/config.hpp"

namespace kvq {

template <class T>
struct SoftmaxState {
  T m;  ///< running maximum of the scores seen (-inf: none yet)
  T l;  ///< running sum of exp(score - m)

  /// No scores yet: m = -inf, l = 0.
  static KVQ_HOST_DEVICE SoftmaxState empty() {
    return SoftmaxState{-static_cast<T>(__builtin_huge_val()), T(0)};
  }

  /// Raises the running maximum to max(m, mx). When it rose, sets *alpha = exp(old m - new m),
  /// rescales l by it (the caller rescales its accumulators by the same factor) and returns true;
  /// returns false when m stays (nothing to rescale). exp(-inf) = 0 on the first raise.
  template <class Exp>
  KVQ_HOST_DEVICE bool raise(T mx, Exp&& exp, T* alpha) {
    const T mn = m < mx ? mx : m;
    if (mn == m) return false;
    *alpha = exp(m - mn);
    m = mn;
    l *= *alpha;
    return true;
  }

  /// Weight of this partial state in a merge whose common maximum is M (the largest m of the
  /// non-empty states): exp(m - M); 0 for an empty state (l == 0).
  template <class Exp>
  KVQ_HOST_DEVICE T weight(T M, Exp&& exp) const {
    return l > T(0) ? exp(m - M) : T(0);
  }
};

}  // namespace kvq
