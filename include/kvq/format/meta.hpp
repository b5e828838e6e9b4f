#pragma once
/// \file meta.hpp
/// Storage types of metadata (scales, zero points, norms): fp16 by default, f32 selectable.
/// Lives in format/ because the format formulas (format/uniform.hpp) round their parameters
/// to the metadata type; quant/ and everything above include it from here.
#include <cstdint>

#include "kvq/core/half.hpp"

namespace kvq {

/// Storage type of metadata (scales, zero points, norms).
enum class MetaDType : uint8_t { kF16, kF32 };
inline int meta_size(MetaDType m) { return m == MetaDType::kF16 ? 2 : 4; }
inline const char* to_string(MetaDType m) { return m == MetaDType::kF16 ? "f16" : "f32"; }

/// Rounds v to what a metadata slot of type m stores.
inline float round_meta(MetaDType m, float v) {
  return m == MetaDType::kF32 ? v : half_bits_to_float_fast(float_to_half_bits_fast(v));
}

}  // namespace kvq
