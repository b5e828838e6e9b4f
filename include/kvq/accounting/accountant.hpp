#pragma once
/// \file accountant.hpp
/// The metadata accountant: for a configuration and a shape, the exact bytes a scheme stores,
/// broken down by kind, and the effective bits per value (payload + metadata). Tests check that
/// these numbers equal QTensor::bytes() for every configuration the suite builds.
///
/// Known values (group 32, fp16 metadata): int2 asymmetric 3.0 bits/value; sint4 4.5 (llama.cpp
/// q4_0); sint8 8.5 (q8_0); int4 asymmetric 5.0 (q4_1). FP4: nvfp4 4.5 (4 + one e4m3 byte per
/// 16, plus 4 bytes of tensor scale per layer), mxfp4 4.25 (4 + one e8m0 byte per 32).
#include <cstdint>

#include "kvq/core/bitpack.hpp"
#include "kvq/core/error.hpp"
#include "kvq/core/tensor.hpp"
#include "kvq/geometry/grouping.hpp"
#include "kvq/quant/qtensor.hpp"

namespace kvq {

/// Exact byte breakdown of storing a tensor of `shape` under `cfg`: the sizes of the arrays
/// quantize() fills (packed_sizes), by kind. Throws for bit widths the format does not
/// support (int5, negative, ...), groups that do not divide the shape, and sizes beyond
/// size_t. tests/accounting checks it against the buffers quantize() really fills and against
/// an independent formula. Bytes that live elsewhere are not counted: the Lloyd-Max rotation
/// seed is part of the config (one per layer config), Lloyd-Max codebooks are derived from
/// (d, b), and nuq codebooks are per-layer metadata (layer_metadata_bytes).
inline ByteBreakdown account(const QuantConfig& cfg, const Shape& shape) {
  const PackedSizes p = packed_sizes(cfg, shape);
  ByteBreakdown b;
  b.codes = p.codes;
  b.scales = p.scales;
  b.zeros = p.zeros;
  b.norms = p.norms;
  b.residual = p.qjl_signs + p.qjl_norms;
  b.outliers = p.outlier_values + p.outlier_pos;  // dense-and-sparse: k fixed, no counts
  return b;
}

/// Per-layer metadata of `cfg` that no block holds: a nuq codebook (4 * 2^bits bytes, stored
/// once per layer and K/V in the config, docs/outliers.md); NVFP4's fp32 tensor scale (4
/// bytes, config.fp4_tensor_scale); 0 for every other format. A whole-cache figure adds this
/// once per (layer, K or V).
inline std::size_t layer_metadata_bytes(const QuantConfig& cfg) {
  if (cfg.format == Format::kNuq) return nuq_codebook_bytes(cfg.bits);
  if (cfg.format == Format::kNvfp4) return sizeof(float);
  return 0;
}

/// Effective bits per value of `cfg` on `shape` (0 for an empty shape).
inline double effective_bits(const QuantConfig& cfg, const Shape& shape) {
  return account(cfg, shape).effective_bits(shape.numel());
}

}  // namespace kvq
