#pragma once
/// \file packed_view.hpp
/// A quantized tensor [tokens, heads, head_dim] in memory kvq does not own: a page region, an
/// engine's buffer, or a QTensor's own vectors (QTensor::view()). It is the one interface
/// between storage (quant/, layout/, cache/) and the kernels that read packed data
/// (simd/, attention/): a kernel that takes a PackedView works on a QTensor, on a page
/// of the paged layout and on a page an engine allocated, with no copy.
///
/// Every array has exactly the byte order QTensor documents (quant/qtensor.hpp,
/// quant/grouped_quant.hpp, quant/lloyd_max_quant.hpp):
///   codes      packed_bytes(numel, bits) bytes: the [tokens, heads, head_dim] bitstream (raw
///              f32/f16/bf16 values for the unquantized formats, one byte per fp8 code)
///   scales     one metadata value per group box, in box order (token block, head block,
///              channel block) (int, fp8); one e4m3 / e8m0 code byte per block (nvfp4, mxfp4)
///   zeros      one per group box (asymmetric int), else null
///   norms      one per (token, head) vector in token-major order (Lloyd-Max), else null
///   qjl_signs  one bit per coordinate (Lloyd-Max + QJL), else null
///   qjl_norms  one per vector (Lloyd-Max + QJL), else null
///   outlier_values  k fp16 values per (token, head) vector, [tokens, heads, k] (dense-and-
///              sparse, quant/outlier_quant.hpp), else null
///   outlier_pos     their channels, same order, 1 byte each (2, little-endian, when
///              head_dim > 256), ascending within a vector, else null
/// A nuq tensor's codebook is not a region: it is per-layer metadata in config.nuq_levels.
/// Metadata values are config.meta (fp16 or f32) little-endian and need no alignment (read
/// with memcpy); the paged layout aligns every region to 64 bytes anyway.
#include <cstdint>
#include <cstring>
#include <vector>

#include "kvq/core/half.hpp"
#include "kvq/core/tensor.hpp"
#include "kvq/geometry/outliers.hpp"
#include "kvq/quant/qtensor.hpp"

namespace kvq {

namespace detail {
inline float load_meta(const uint8_t* base, MetaDType m, std::size_t i) {
  if (m == MetaDType::kF16) {
    uint16_t h;
    std::memcpy(&h, base + 2 * i, 2);
    return half_bits_to_float_fast(h);
  }
  float v;
  std::memcpy(&v, base + 4 * i, 4);
  return v;
}
/// Stores v at slot i (rounded to m) and returns the value stored.
inline float store_meta(uint8_t* base, MetaDType m, std::size_t i, float v) {
  if (m == MetaDType::kF16) {
    const uint16_t h = float_to_half_bits_fast(v);
    std::memcpy(base + 2 * i, &h, 2);
    return half_bits_to_float_fast(h);
  }
  std::memcpy(base + 4 * i, &v, 4);
  return v;
}
}  // namespace detail

/// Read-only view of one packed tensor (see the file comment for the byte order).
struct PackedView {
  QuantConfig config;
  Shape shape;
  const uint8_t* codes = nullptr;
  const uint8_t* scales = nullptr;
  const uint8_t* zeros = nullptr;
  const uint8_t* norms = nullptr;
  const uint8_t* qjl_signs = nullptr;
  const uint8_t* qjl_norms = nullptr;
  const uint8_t* outlier_values = nullptr;
  const uint8_t* outlier_pos = nullptr;

  float scale(std::size_t g) const { return detail::load_meta(scales, config.meta, g); }
  float zero(std::size_t g) const {
    return zeros != nullptr ? detail::load_meta(zeros, config.meta, g) : 0.f;
  }
  float norm(std::size_t v) const { return detail::load_meta(norms, config.meta, v); }
  float qjl_norm(std::size_t v) const { return detail::load_meta(qjl_norms, config.meta, v); }
};

/// Writable twin of PackedView (what a quantizer fills).
struct PackedSpan {
  QuantConfig config;
  Shape shape;
  uint8_t* codes = nullptr;
  uint8_t* scales = nullptr;
  uint8_t* zeros = nullptr;
  uint8_t* norms = nullptr;
  uint8_t* qjl_signs = nullptr;
  uint8_t* qjl_norms = nullptr;
  uint8_t* outlier_values = nullptr;
  uint8_t* outlier_pos = nullptr;

  PackedView view() const {
    PackedView v;
    v.config = config;
    v.shape = shape;
    v.codes = codes;
    v.scales = scales;
    v.zeros = zeros;
    v.norms = norms;
    v.qjl_signs = qjl_signs;
    v.qjl_norms = qjl_norms;
    v.outlier_values = outlier_values;
    v.outlier_pos = outlier_pos;
    return v;
  }
};

/// A writable view of q's buffers (sized by the caller, e.g. size_for()).
inline PackedSpan span_of(QTensor& q) {
  auto ptr = [](std::vector<uint8_t>& v) -> uint8_t* { return v.empty() ? nullptr : v.data(); };
  PackedSpan v;
  v.config = q.config;
  v.shape = q.shape;
  v.codes = ptr(q.codes);
  v.scales = q.scales.data();
  v.zeros = q.zeros.data();
  v.norms = q.norms.data();
  v.qjl_signs = ptr(q.qjl_signs);
  v.qjl_norms = q.qjl_norms.data();
  v.outlier_values = ptr(q.outlier_values);
  v.outlier_pos = ptr(q.outlier_pos);
  return v;
}

/// Sizes q's buffers for (cfg, s) as packed_sizes() says (contents unspecified; existing
/// capacity is reused).
inline void size_for(QTensor& q, const QuantConfig& cfg, const Shape& s) {
  const PackedSizes p = packed_sizes(cfg, s);
  const auto msz = static_cast<std::size_t>(meta_size(cfg.meta));
  q.config = cfg;
  q.shape = s;
  q.codes.resize(p.codes);
  if (is_fp4(cfg.format)) {
    q.scales.reset_codes(p.scales);  // one e4m3 / e8m0 byte per block (quant/fp4_quant.hpp)
  } else {
    q.scales.reset(cfg.meta, p.scales / msz);
  }
  q.zeros.reset(cfg.meta, p.zeros / msz);
  q.norms.reset(cfg.meta, p.norms / msz);
  q.qjl_signs.resize(p.qjl_signs);
  q.qjl_norms.reset(cfg.meta, p.qjl_norms / msz);
  q.outlier_values.resize(p.outlier_values);
  q.outlier_pos.resize(p.outlier_pos);
}

/// Scratch of the span/view quantizers (quantize_into, dequantize(PackedView, ..., ws)): every
/// vector only grows, so a caller that reuses one workspace for the same geometry allocates
/// nothing after the first call.
struct QuantWorkspace {
  std::vector<float> buf, u, r;       // [head_dim] one row
  std::vector<uint8_t> codes, signs;  // [head_dim] unpacked codes / QJL signs
  std::vector<float> lo, hi, zv, iv;  // [heads * head_dim] per-block group parameters
  std::vector<float> ca, cb;          // dense-and-sparse lean path: per-group code bounds
  std::vector<float> dense, ovals;    // dense-and-sparse: [tokens, heads, head_dim], [.., k]
  std::vector<int32_t> sel;           // dense-and-sparse: [tokens, heads, k] channels
  OutlierScratch outlier;             // selection statistics (geometry/outliers.hpp)
  std::vector<f16> h16;               // [head_dim] raw f16 row staged for an unaligned span
  std::vector<bf16> b16;              // [head_dim] raw bf16 row staged for an unaligned span
  std::vector<float> rot;             // rotated int / fp8 / FP4: [tokens, heads, head_dim] staged
  template <class V>
  static typename V::value_type* at_least(V& v, std::size_t n) {
    if (v.size() < n) v.resize(n);
    return v.data();
  }
};

/// A view of q's buffers (valid while q is alive and unchanged).
inline PackedView view_of(const QTensor& q) {
  auto ptr = [](const std::vector<uint8_t>& v) -> const uint8_t* {
    return v.empty() ? nullptr : v.data();
  };
  PackedView v;
  v.config = q.config;
  v.shape = q.shape;
  v.codes = ptr(q.codes);
  v.scales = ptr(q.scales.raw());
  v.zeros = ptr(q.zeros.raw());
  v.norms = ptr(q.norms.raw());
  v.qjl_signs = ptr(q.qjl_signs);
  v.qjl_norms = ptr(q.qjl_norms.raw());
  v.outlier_values = ptr(q.outlier_values);
  v.outlier_pos = ptr(q.outlier_pos);
  return v;
}

}  // namespace kvq
