#pragma once
/// \file accountant.hpp
/// The metadata accountant: for a configuration and a shape, the exact bytes a scheme stores,
/// broken down by kind, and the effective bits per value (payload + metadata). Tests check that
/// these numbers equal QTensor::bytes() for every configuration the suite builds.
///
/// Known values (group 32, fp16 metadata): int2 asymmetric 3.0 bits/value; sint4 4.5 (llama.cpp
/// q4_0); sint8 8.5 (q8_0); int4 asymmetric 5.0 (q4_1).
#include <cstdint>

#include "kvq/core/bitpack.hpp"
#include "kvq/core/error.hpp"
#include "kvq/core/tensor.hpp"
#include "kvq/geometry/grouping.hpp"
#include "kvq/quant/qtensor.hpp"

namespace kvq {

/// Exact byte breakdown of storing a tensor of `shape` under `cfg`.
inline ByteBreakdown account(const QuantConfig& cfg, const Shape& shape) {
  ByteBreakdown b;
  const auto n = static_cast<std::size_t>(shape.numel());
  const auto vectors = static_cast<std::size_t>(shape.tokens * shape.heads);
  const auto msz = static_cast<std::size_t>(meta_size(cfg.meta));
  switch (cfg.format) {
    case Format::kF32: b.codes = 4 * n; break;
    case Format::kF16:
    case Format::kBF16: b.codes = 2 * n; break;
    case Format::kInt: {
      const GroupBox box = group_box(cfg.axis, cfg.group, shape);
      const auto groups = n > 0 ? static_cast<std::size_t>(box.count()) : 0;
      b.codes = packed_bytes(n, cfg.bits);
      b.scales = groups * msz;
      b.zeros = cfg.symmetric ? 0 : groups * msz;
      break;
    }
    case Format::kE4M3:
    case Format::kE5M2: {
      const GroupBox box = group_box(cfg.axis, cfg.group, shape);
      b.codes = n;
      b.scales = (n > 0 ? static_cast<std::size_t>(box.count()) : 0) * msz;
      break;
    }
    case Format::kLloydMax:
      b.codes = packed_bytes(n, cfg.bits);
      b.norms = vectors * msz;
      b.seeds = n > 0 ? sizeof(uint64_t) : 0;
      if (cfg.qjl) b.residual = packed_bytes(n, 1) + vectors * msz;
      break;
  }
  return b;
}

/// Effective bits per value of `cfg` on `shape` (0 for an empty shape).
inline double effective_bits(const QuantConfig& cfg, const Shape& shape) {
  return account(cfg, shape).effective_bits(shape.numel());
}

}  // namespace kvq
