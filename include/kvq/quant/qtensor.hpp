#pragma once
/// \file qtensor.hpp
/// Quantizer configuration and the packed block a quantizer produces.
///
/// One QuantConfig describes every scheme kvq stores (raw f32/f16/bf16, grouped integers,
/// scaled FP8, rotate-then-Lloyd-Max). Compile-time policies (policy/) and runtime spec strings
/// both produce a QuantConfig and go through the same quantize()/dequantize() dispatch.
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "kvq/core/error.hpp"
#include "kvq/core/half.hpp"
#include "kvq/core/tensor.hpp"
#include "kvq/format/meta.hpp"
#include "kvq/format/nuq.hpp"
#include "kvq/geometry/grouping.hpp"
#include "kvq/geometry/rotation.hpp"

namespace kvq {

/// Element format of the stored codes.
enum class Format : uint8_t {
  kF32,        ///< unquantized float32
  kF16,        ///< unquantized fp16 (round to nearest even)
  kBF16,       ///< unquantized bf16
  kInt,        ///< grouped uniform integer, asymmetric (min + scale) or symmetric (absmax)
  kE4M3,       ///< scaled FP8 e4m3fn
  kE5M2,       ///< scaled FP8 e5m2
  kLloydMax,   ///< per-vector norm + rotation + Lloyd-Max codebook (TurboQuant-style)
  kNuq,        ///< grouped min/max normalization + learned per-layer codebook (KVQuant nuq)
  kNvfp4,      ///< NVFP4: e2m1 codes, one e4m3 scale per 16 channels, fp32 tensor scale
  kMxfp4,      ///< MXFP4 (OCP): e2m1 codes, one e8m0 power-of-two scale per 32 channels
};

/// True for the FP4 block formats (format/fp4.hpp): 4-bit e2m1 codes along head_dim in blocks of
/// fp4_block(f), one scale byte per block (e4m3 for NVFP4, e8m0 for MXFP4).
inline bool is_fp4(Format f) { return f == Format::kNvfp4 || f == Format::kMxfp4; }
/// True for the formats that take the optional rotation (QuantConfig::rotate, spec /rot): int,
/// fp8 and FP4. Lloyd-Max always rotates; raw and nuq formats do not.
inline bool rotation_format(Format f) {
  return f == Format::kInt || f == Format::kE4M3 || f == Format::kE5M2 || f == Format::kNvfp4 ||
         f == Format::kMxfp4;
}
/// Elements per scale block of an FP4 format (16 NVFP4, 32 MXFP4).
inline int64_t fp4_block(Format f) { return f == Format::kNvfp4 ? 16 : 32; }

inline const char* to_string(Format f) {
  switch (f) {
    case Format::kF32: return "f32";
    case Format::kF16: return "f16";
    case Format::kBF16: return "bf16";
    case Format::kInt: return "int";
    case Format::kE4M3: return "e4m3";
    case Format::kE5M2: return "e5m2";
    case Format::kLloydMax: return "lm";
    case Format::kNuq: return "nuq";
    case Format::kNvfp4: return "nvfp4";
    case Format::kMxfp4: return "mxfp4";
  }
  return "?";
}

/// Everything that defines how one tensor is stored.
struct QuantConfig {
  Format format = Format::kInt;
  int bits = 4;                        ///< code width: int 2/3/4/8, lm 1..4 (8 for fp8)
  bool symmetric = false;              ///< int only: absmax scale, no zero point
  Axis axis = Axis::kToken;            ///< grouping axis of scales
  int64_t group = 0;                   ///< group size along the axis; 0 = whole extent
  MetaDType meta = MetaDType::kF16;    ///< storage of scales / zero points / norms
  float fp8_margin = 1.0f;             ///< fp8: scale = amax * margin / max_finite
  bool qjl = false;                    ///< lm: 1-bit QJL residual (opt-in)
  /// int, fp8 (e4m3/e5m2) and FP4 (nvfp4/mxfp4): rotate every (token, head) vector by the
  /// seeded randomized Hadamard rotation of head_dim (the one Lloyd-Max uses, `seed`) before
  /// quantizing, and back after dequantizing (spec /rot; quant/rotated_quant.hpp). Costs no
  /// bytes. Lloyd-Max always rotates and ignores this field; raw, nuq and dense-and-sparse
  /// configs refuse it.
  bool rotate = false;
  uint64_t seed = 0x6b7671u;           ///< lm, and int/fp8/fp4 with rotate: rotation seed
  /// Dense-and-sparse (int, fp8, nuq): entries kept exactly (fp16 value + position) per
  /// (token, head) vector; outlier_pct > 0 wins: ceil(pct / 100 * head_dim) (spec /out<P>%).
  /// See quant/outlier_quant.hpp and docs/outliers.md.
  int outliers = 0;
  float outlier_pct = 0.f;
  /// nuq: the layer's calibrated codebook (2^bits ascending levels in the normalized space),
  /// per-layer metadata; nuq_ready is false until kvq::calibrate or a calibration file set it.
  bool nuq_ready = false;
  std::array<float, kNuqMaxLevels> nuq_levels{};
  /// nvfp4: the per-tensor fp32 decode scale g (> 0, finite; format/fp4.hpp): block scales are
  /// e4m3(amax / 6 / g) and elements decode as e2m1 * e4m3 * g. 1 by default (TensorRT-LLM's
  /// and vLLM's uncalibrated KV scale); a calibrated value comes from the data (spec /ts<g>).
  /// Per-layer metadata (4 bytes, layer_metadata_bytes), not stored in any page.
  float fp4_tensor_scale = 1.0f;
  bool is_raw() const {
    return format == Format::kF32 || format == Format::kF16 || format == Format::kBF16;
  }
  /// Short human-readable name, e.g. "int4/token/g32/f16meta" or "e4m3/head".
  std::string name() const {
    std::string s;
    switch (format) {
      case Format::kF32: return "f32";
      case Format::kF16: return "f16";
      case Format::kBF16: return "bf16";
      case Format::kInt: s = (symmetric ? "sint" : "int") + std::to_string(bits); break;
      case Format::kE4M3: s = "e4m3"; break;
      case Format::kE5M2: s = "e5m2"; break;
      case Format::kLloydMax: s = "lm" + std::to_string(bits); break;
      case Format::kNuq: s = "nuq" + std::to_string(bits); break;
      case Format::kNvfp4: s = "nvfp4"; break;
      case Format::kMxfp4: s = "mxfp4"; break;
    }
    if (is_fp4(format)) {
      // The block (axis and group) is part of the format; a calibrated tensor scale is shown.
      if (format == Format::kNvfp4 && fp4_tensor_scale != 1.0f) {
        char buf[32];
        std::snprintf(buf, sizeof buf, "/ts%g", static_cast<double>(fp4_tensor_scale));
        s += buf;
      }
    } else if (format != Format::kLloydMax) {
      s += "/";
      s += to_string(axis);
      if (group > 0) s += "/g" + std::to_string(group);
    }
    if (format != Format::kLloydMax) {
      if (rotate) s += "/rot";
    } else {
      s += "/rot";
      if (qjl) s += "/qjl";
    }
    if (outlier_pct > 0.f) {
      char buf[32];
      std::snprintf(buf, sizeof buf, "/out%g%%", static_cast<double>(outlier_pct));
      s += buf;
    } else if (outliers > 0) {
      s += "/out" + std::to_string(outliers);
    }
    if (meta == MetaDType::kF32 && !is_fp4(format)) s += "/f32meta";  // FP4: byte scales
    return s;
  }
};

/// Outliers per (token, head) vector of `cfg` for vectors of `head_dim` entries: outlier_pct
/// > 0 gives ceil(pct / 100 * head_dim), else cfg.outliers. Not clamped (packed_sizes rejects
/// k > head_dim).
inline int64_t outlier_count(const QuantConfig& cfg, int64_t head_dim) {
  if (cfg.outlier_pct > 0.f)
    return static_cast<int64_t>(
        std::ceil(static_cast<double>(cfg.outlier_pct) * static_cast<double>(head_dim) / 100.0));
  return cfg.outliers;
}
/// Bytes of one scale slot of `cfg`: 1 for the FP4 formats (an e4m3 or e8m0 code), else the
/// metadata type's size.
inline std::size_t scale_slot_bytes(const QuantConfig& cfg) {
  return is_fp4(cfg.format) ? 1u : static_cast<std::size_t>(meta_size(cfg.meta));
}
/// Bytes of one outlier position: 1 when head_dim <= 256, else 2 (little-endian uint16).
inline int outlier_pos_bytes(int64_t head_dim) { return head_dim <= 256 ? 1 : 2; }

/// A typed array of metadata values stored as fp16 or fp32 bytes.
class MetaBuffer {
 public:
  MetaBuffer() = default;
  MetaBuffer(MetaDType dt, std::size_t n) { reset(dt, n); }
  /// Sizes the buffer for n values of type dt. Existing storage is reused (not cleared): every
  /// slot is written by the quantizer that calls this.
  void reset(MetaDType dt, std::size_t n) {
    dtype_ = dt;
    count_ = n;
    bytes_.resize(n * static_cast<std::size_t>(meta_size(dt)));
  }
  /// Sizes the buffer for n one-byte scale codes (the FP4 formats' e4m3 / e8m0 block scales):
  /// raw() and data() hold them; get()/set() do not apply.
  void reset_codes(std::size_t n) {
    dtype_ = MetaDType::kF16;
    count_ = n;
    bytes_.resize(n);
  }
  /// Stores v (rounded to the storage type) and returns the value actually stored.
  float set(std::size_t i, float v) {
    if (dtype_ == MetaDType::kF16) {
      const uint16_t h = float_to_half_bits_fast(v);
      std::memcpy(bytes_.data() + 2 * i, &h, 2);
      return half_bits_to_float_fast(h);
    }
    std::memcpy(bytes_.data() + 4 * i, &v, 4);
    return v;
  }
  float get(std::size_t i) const {
    if (dtype_ == MetaDType::kF16) {
      uint16_t h;
      std::memcpy(&h, bytes_.data() + 2 * i, 2);
      return half_bits_to_float_fast(h);
    }
    float v;
    std::memcpy(&v, bytes_.data() + 4 * i, 4);
    return v;
  }
  std::size_t size() const { return count_; }
  std::size_t bytes() const { return bytes_.size(); }
  MetaDType dtype() const { return dtype_; }
  const std::vector<uint8_t>& raw() const { return bytes_; }
  /// Storage of value i (fp16 bits or f32), for kernels that write many values at once.
  uint8_t* data_at(std::size_t i) {
    return bytes_.data() + i * static_cast<std::size_t>(meta_size(dtype_));
  }
  /// Start of the storage (null when empty), for PackedSpan.
  uint8_t* data() { return bytes_.empty() ? nullptr : bytes_.data(); }
  void swap(MetaBuffer& o) noexcept {
    std::swap(dtype_, o.dtype_);
    std::swap(count_, o.count_);
    bytes_.swap(o.bytes_);
  }
  bool operator==(const MetaBuffer& o) const {
    return dtype_ == o.dtype_ && count_ == o.count_ && bytes_ == o.bytes_;
  }

 private:
  MetaDType dtype_ = MetaDType::kF16;
  std::size_t count_ = 0;
  std::vector<uint8_t> bytes_;
};

/// Byte count of a stored tensor, by kind. effective bits = 8 * total / elements.
/// Every kind counts bytes some buffer really holds: the Lloyd-Max rotation seed lives in the
/// config (one per layer config, not per block) and is not counted here.
struct ByteBreakdown {
  std::size_t codes = 0;      ///< packed codes (or raw values for f32/f16/bf16)
  std::size_t scales = 0;     ///< per-group scales
  std::size_t zeros = 0;      ///< per-group zero points (asymmetric int)
  std::size_t norms = 0;      ///< per-vector norms (rotate-then-Lloyd-Max)
  std::size_t residual = 0;   ///< QJL sign bits and residual norms
  std::size_t outliers = 0;   ///< sparse outliers (fp16 values + positions; k fixed: no counts)
  std::size_t codebooks = 0;  ///< stored codebooks (0 when derived from (d, b) or per-layer)
  std::size_t padding = 0;    ///< alignment padding between the regions of a page (layout/)
  std::size_t total() const {
    return codes + scales + zeros + norms + residual + outliers + codebooks + padding;
  }
  ByteBreakdown& operator+=(const ByteBreakdown& o) {
    codes += o.codes;
    scales += o.scales;
    zeros += o.zeros;
    norms += o.norms;
    residual += o.residual;
    outliers += o.outliers;
    codebooks += o.codebooks;
    padding += o.padding;
    return *this;
  }
  bool operator==(const ByteBreakdown& o) const {
    return codes == o.codes && scales == o.scales && zeros == o.zeros && norms == o.norms &&
           residual == o.residual && outliers == o.outliers && codebooks == o.codebooks &&
           padding == o.padding;
  }
  /// 8 * total / numel; 0 for an empty tensor (documented: no NaN).
  double effective_bits(int64_t numel) const {
    return numel > 0 ? 8.0 * static_cast<double>(total()) / static_cast<double>(numel) : 0.0;
  }
};

/// Bytes of every array of a packed tensor (config, shape), in the byte order PackedView
/// documents (quant/packed_view.hpp). Validates the config and the shape first: bit widths
/// the format supports, groups that divide the shape, Lloyd-Max head_dim, and sizes that fit
/// size_t (kInvalidArgument / kShapeMismatch / kOutOfRange).
struct PackedSizes {
  std::size_t codes = 0;      ///< bitstream (raw values for f32/f16/bf16, 1 byte per fp8 code)
  std::size_t scales = 0;     ///< one metadata value per group box
  std::size_t zeros = 0;      ///< one per group box (asymmetric int)
  std::size_t norms = 0;      ///< one per vector (Lloyd-Max)
  std::size_t qjl_signs = 0;  ///< one bit per coordinate (Lloyd-Max + QJL)
  std::size_t qjl_norms = 0;  ///< one per vector (Lloyd-Max + QJL)
  std::size_t groups = 0;     ///< group boxes (int, fp8, nuq)
  std::size_t outlier_values = 0;  ///< k fp16 values per vector (dense-and-sparse), else 0
  std::size_t outlier_pos = 0;     ///< k positions per vector (1 byte, 2 if head_dim > 256)
  std::size_t total() const {
    return codes + scales + zeros + norms + qjl_signs + qjl_norms + outlier_values + outlier_pos;
  }
};

namespace detail {
/// Throws kInvalidArgument unless `bits` is a code width `cfg.format` stores (int: 2, 3, 4, 8;
/// Lloyd-Max: 1..4). Raw and fp8 formats ignore cfg.bits (their width is fixed).
inline void check_format_bits(const QuantConfig& cfg) {
  if (cfg.format == Format::kInt) {
    KVQ_REQUIRE(cfg.bits == 2 || cfg.bits == 3 || cfg.bits == 4 || cfg.bits == 8,
                kInvalidArgument, "integer formats support 2, 3, 4 or 8 bits, got ", cfg.bits);
  } else if (cfg.format == Format::kLloydMax) {
    KVQ_REQUIRE(cfg.bits >= 1 && cfg.bits <= 4, kInvalidArgument,
                "Lloyd-Max codebooks have 1..4 bits, got ", cfg.bits);
  } else if (cfg.format == Format::kNuq) {
    check_nuq_bits(cfg.bits);
  } else if (is_fp4(cfg.format)) {
    KVQ_REQUIRE(cfg.bits == 4, kInvalidArgument, to_string(cfg.format),
                " stores 4-bit e2m1 codes, got bits = ", cfg.bits);
    KVQ_REQUIRE(cfg.axis == Axis::kToken && cfg.group == fp4_block(cfg.format),
                kInvalidArgument, to_string(cfg.format), " scales blocks of ",
                fp4_block(cfg.format), " channels along head_dim (token axis, group ",
                fp4_block(cfg.format), "), got axis ", to_string(cfg.axis), " and group ",
                cfg.group);
    KVQ_REQUIRE(std::isfinite(cfg.fp4_tensor_scale) && cfg.fp4_tensor_scale > 0.f,
                kInvalidArgument, to_string(cfg.format),
                ": the tensor scale must be finite and > 0, got ", cfg.fp4_tensor_scale);
  }
  KVQ_REQUIRE(static_cast<uint8_t>(cfg.format) <= static_cast<uint8_t>(Format::kMxfp4),
              kInvalidArgument, "unknown format code ", static_cast<int>(cfg.format));
}
/// a * b, throwing kOutOfRange when it does not fit size_t.
inline std::size_t checked_mul(std::size_t a, std::size_t b, const Shape& s) {
  KVQ_REQUIRE(a == 0 || b <= SIZE_MAX / a, kOutOfRange, "a packed tensor of shape ", s.str(),
              " does not fit in memory (size_t overflow)");
  return a * b;
}
}  // namespace detail

inline PackedSizes packed_sizes(const QuantConfig& cfg, const Shape& shape) {
  detail::check_format_bits(cfg);
  KVQ_REQUIRE(shape.tokens >= 0 && shape.heads >= 0 && shape.head_dim >= 0, kShapeMismatch,
              "negative extent in shape ", shape.str());
  PackedSizes p;
  const std::size_t vectors = detail::checked_mul(static_cast<std::size_t>(shape.tokens),
                                                  static_cast<std::size_t>(shape.heads), shape);
  const std::size_t n =
      detail::checked_mul(vectors, static_cast<std::size_t>(shape.head_dim), shape);
  detail::checked_mul(n, 32, shape);  // every bit count below fits
  const auto msz = static_cast<std::size_t>(meta_size(cfg.meta));
  switch (cfg.format) {
    case Format::kF32: p.codes = 4 * n; break;
    case Format::kF16:
    case Format::kBF16: p.codes = 2 * n; break;
    case Format::kInt:
    case Format::kNuq:
    case Format::kE4M3:
    case Format::kE5M2: {
      const GroupBox box = group_box(cfg.axis, cfg.group, shape);
      const bool coded = cfg.format == Format::kInt || cfg.format == Format::kNuq;
      p.groups = n > 0 ? static_cast<std::size_t>(box.count()) : 0;
      p.codes = coded ? (n * static_cast<std::size_t>(cfg.bits) + 7) / 8 : n;
      p.scales = p.groups * msz;
      p.zeros = (cfg.format == Format::kInt && !cfg.symmetric) || cfg.format == Format::kNuq
                    ? p.groups * msz
                    : 0;
      break;
    }
    case Format::kNvfp4:
    case Format::kMxfp4: {
      const int64_t blk = fp4_block(cfg.format);
      KVQ_REQUIRE(shape.head_dim % blk == 0, kShapeMismatch, to_string(cfg.format),
                  " needs head_dim to be a multiple of its block of ", blk,
                  " channels, but the shape is ", shape.str(), " (head_dim ", shape.head_dim,
                  ")");
      p.groups = n / static_cast<std::size_t>(blk);
      p.codes = (n * 4 + 7) / 8;
      p.scales = p.groups;  // one e4m3 / e8m0 byte per block
      break;
    }
    case Format::kLloydMax:
      p.codes = (n * static_cast<std::size_t>(cfg.bits) + 7) / 8;
      p.norms = vectors * msz;
      if (cfg.qjl) {
        p.qjl_signs = (n + 7) / 8;
        p.qjl_norms = vectors * msz;
      }
      break;
  }
  KVQ_REQUIRE(cfg.outliers >= 0 && std::isfinite(cfg.outlier_pct) && cfg.outlier_pct >= 0.f &&
                  cfg.outlier_pct <= 100.f,
              kInvalidArgument, "outliers must be >= 0 and outlier_pct in [0, 100], got ",
              cfg.outliers, " and ", cfg.outlier_pct);
  if (cfg.rotate && cfg.format != Format::kLloydMax) {
    KVQ_REQUIRE(rotation_format(cfg.format), kUnsupported, "rotation (/rot) applies to the int, ",
                "fp8 (e4m3, e5m2) and FP4 (nvfp4, mxfp4) formats and Lloyd-Max, not ",
                to_string(cfg.format));
    KVQ_REQUIRE(cfg.outliers == 0 && cfg.outlier_pct == 0.f, kUnsupported, "rotation (/rot) with ",
                "dense-and-sparse outliers is not supported (", cfg.name(), "): the rotation ",
                "spreads an outlier channel over the whole vector; use one or the other");
    if (shape.head_dim > 0) {
      const std::string why = shape.head_dim > 0x7fffffff
                                  ? std::string("head_dim too large")
                                  : Rotation::hadamard_unsupported_reason(
                                        static_cast<int>(shape.head_dim));
      KVQ_REQUIRE(why.empty(), kUnsupported, cfg.name(), " rotates every head vector: ", why);
    }
  }
  const int64_t k = outlier_count(cfg, shape.head_dim);
  if (k > 0) {
    KVQ_REQUIRE(cfg.format == Format::kInt || cfg.format == Format::kNuq ||
                    cfg.format == Format::kE4M3 || cfg.format == Format::kE5M2,
                kInvalidArgument, "outliers (dense-and-sparse) apply to int, fp8 and nuq formats, not ",
                to_string(cfg.format));
    KVQ_REQUIRE(k <= shape.head_dim, kInvalidArgument, k, " outliers per vector but head_dim is ",
                shape.head_dim);
    const std::size_t kv = detail::checked_mul(vectors, static_cast<std::size_t>(k), shape);
    p.outlier_values = 2 * kv;
    p.outlier_pos = static_cast<std::size_t>(outlier_pos_bytes(shape.head_dim)) * kv;
  }
  return p;
}
/// A packed, quantized tensor: owns its codes and all metadata. Its bytes() is exactly what
/// the accountant predicts for (config, shape).
struct QTensor {
  QuantConfig config;
  Shape shape;
  std::vector<uint8_t> codes;  ///< bitstream in [tokens, heads, head_dim] order
  MetaBuffer scales;           ///< one per group (int, fp8)
  MetaBuffer zeros;            ///< one per group (asymmetric int)
  MetaBuffer norms;            ///< one per (token, head) vector (lm)
  std::vector<uint8_t> qjl_signs;  ///< lm + qjl: one bit per coordinate
  MetaBuffer qjl_norms;            ///< lm + qjl: residual norm per vector
  std::vector<uint8_t> outlier_values;  ///< dense-and-sparse: [tokens, heads, k] fp16 bits
  std::vector<uint8_t> outlier_pos;     ///< dense-and-sparse: [tokens, heads, k] channel indices

  ByteBreakdown breakdown() const {
    ByteBreakdown b;
    b.codes = codes.size();
    b.scales = scales.bytes();
    b.zeros = zeros.bytes();
    b.norms = norms.bytes();
    b.residual = qjl_signs.size() + qjl_norms.bytes();
    b.outliers = outlier_values.size() + outlier_pos.size();
    return b;
  }
  std::size_t bytes() const { return breakdown().total(); }
  double effective_bits() const { return breakdown().effective_bits(shape.numel()); }
};

}  // namespace kvq
