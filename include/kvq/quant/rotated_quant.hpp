#pragma once
/// \file rotated_quant.hpp
/// The optional rotation of the int, fp8 and FP4 formats (QuantConfig::rotate, spec /rot).
///
/// Every (token, head) vector x of head_dim d is rotated by the seeded randomized Hadamard
/// rotation R of d (geometry/rotation.hpp; the rotation rotate-then-Lloyd-Max uses for the same
/// seed) and the rotated tensor is stored with the unrotated quantizer; dequantization decodes
/// the rotated tensor and applies R^T to every vector, so dequantize(quantize(x)) approximates
/// x in the original basis. The packed bytes are exactly those of the unrotated format applied
/// to R x: the rotation costs no bytes (the seed is in the config). Attention reads the codes in
/// the rotated domain instead (q . k = (R q) . (R k); attention/cpu/).
///
/// Why: a channel outlier makes the per-group scale of a plain int / fp8 / FP4 block coarse for
/// every other channel of the group; after the rotation the vector's energy is spread evenly
/// over its coordinates (docs/formats.md).
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <utility>

#include "kvq/core/error.hpp"
#include "kvq/core/rows.hpp"
#include "kvq/core/tensor.hpp"
#include "kvq/geometry/rotation.hpp"
#include "kvq/quant/packed_view.hpp"
#include "kvq/quant/qtensor.hpp"
#include "kvq/simd/uniform_cpu.hpp"

namespace kvq {

/// True when `c` stores rotated vectors with a format whose codes are not rotation-aware by
/// themselves (int, fp8, FP4 with rotate); Lloyd-Max always rotates and is not counted here.
inline bool rotated_plain(const QuantConfig& c) {
  return c.rotate && c.format != Format::kLloydMax;
}

namespace detail {

/// Bound of the process-wide rotation registry below: at most this many distinct
/// (head_dim, seed) rotations (O(head_dim) bytes each), so hostile archives or specs naming
/// ever new seeds cannot grow it without limit.
inline constexpr std::size_t kMaxPlainRotations = 4096;

struct PlainRotationRegistry {
  std::mutex mu;
  std::map<std::pair<int, uint64_t>, std::unique_ptr<Rotation>> all;
};
inline PlainRotationRegistry& plain_rotation_registry() {
  static PlainRotationRegistry r;
  return r;
}

}  // namespace detail

/// The randomized Hadamard rotation of head_dim `d` and `seed`, built once per process and never
/// freed (the reference stays valid). Throws kUnsupported for a head_dim the Hadamard rotation
/// does not take (Rotation::hadamard_unsupported_reason) and kOutOfRange beyond
/// detail::kMaxPlainRotations distinct (d, seed).
inline const Rotation& hadamard_rotation_for(int64_t d, uint64_t seed) {
  KVQ_REQUIRE(d > 0 && d <= 0x7fffffff, kUnsupported, "rotation: head_dim ", d,
              " is out of range");
  const int di = static_cast<int>(d);
  detail::PlainRotationRegistry& r = detail::plain_rotation_registry();
  std::lock_guard<std::mutex> lock(r.mu);
  const auto key = std::make_pair(di, seed);
  auto it = r.all.find(key);
  if (it == r.all.end()) {
    KVQ_REQUIRE(r.all.size() < detail::kMaxPlainRotations, kOutOfRange, "rotation (head_dim ", d,
                ", seed ", seed, "): the process already holds ", r.all.size(),
                " distinct rotations, kvq's limit (each distinct seed builds one)");
    it = r.all.emplace(key, std::make_unique<Rotation>(Rotation::hadamard(di, seed))).first;
  }
  return *it->second;
}

namespace detail {

/// x's rows rotated into `stage` ([tokens, heads, head_dim] contiguous floats). A row with a
/// NaN or inf is refused with its (token, head) before anything is rotated.
template <class T>
void rotate_rows(const Rotation& rot, const KVView<const T>& x, float* stage, float* buf) {
  const int64_t D = x.head_dim();
  for (int64_t t = 0; t < x.tokens(); ++t)
    for (int64_t h = 0; h < x.heads(); ++h) {
      const float* row = load_row(x, t, h, buf);
      float lo = INFINITY, hi = -INFINITY;
      if (!kernels::minmax(row, D, lo, hi)) throw_non_finite_row(x, t, h, "quantize");
      float* o = stage + (t * x.heads() + h) * D;
      std::copy(row, row + D, o);
      rot.apply(o);
    }
}

}  // namespace detail
}  // namespace kvq
