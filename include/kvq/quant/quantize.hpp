#pragma once
/// \file quantize.hpp
/// The one entry point for storing a tensor under a QuantConfig. Compile-time policies and
/// runtime specs both end here.
///
///   quantize_into(cfg, x, span, ws)  writes into caller memory (a page region, an engine's
///                                    buffer): no allocation once `ws` has grown
///   quantize(cfg, x, out)            into a QTensor, with the strong guarantee
///   dequantize(view, out[, ws])      from any PackedView (QTensor, page, engine page)
///   dequantize(qtensor, out)         the same through view_of()
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvq/core/half.hpp"
#include "kvq/core/rows.hpp"
#include "kvq/core/tensor.hpp"
#include "kvq/simd/uniform_cpu.hpp"
#include "kvq/quant/fp4_quant.hpp"
#include "kvq/quant/grouped_quant.hpp"
#include "kvq/quant/lloyd_max_quant.hpp"
#include "kvq/quant/nuq_quant.hpp"
#include "kvq/quant/outlier_quant.hpp"
#include "kvq/quant/packed_view.hpp"
#include "kvq/quant/qtensor.hpp"
#include "kvq/quant/rotated_quant.hpp"

namespace kvq {

namespace detail {

/// Largest |x| that rounds to a finite value of the stored raw type (f16: below 65520, the
/// midpoint to the next binade; bf16: below 0x7F7F8000, the midpoint above bf16's maximum).
template <class Stored>
constexpr float raw_limit() {
  if constexpr (std::is_same_v<Stored, f16>) {
    return 65520.f;
  } else if constexpr (std::is_same_v<Stored, bf16>) {
    return 3.3961776e38f;  // bit pattern 0x7F7F8000
  } else {
    return INFINITY;
  }
}

/// Raw formats validate every row (finite, and representable in the stored type) before
/// writing a byte, so a throw leaves the span as it was.
template <class Stored, class T>
void quantize_raw(const KVView<const T>& x, const PackedSpan& q, QuantWorkspace& ws) {
  const int64_t D = x.head_dim();
  float* buf = QuantWorkspace::at_least(ws.buf, static_cast<std::size_t>(D));
  constexpr float kLimit = raw_limit<Stored>();
  for (int64_t t = 0; t < x.tokens(); ++t)
    for (int64_t h = 0; h < x.heads(); ++h) {
      const float* row = load_row(x, t, h, buf);
      float lo = INFINITY, hi = -INFINITY;
      if (!kernels::minmax(row, D, lo, hi)) throw_non_finite_row(x, t, h, "quantize");
      if (std::isfinite(kLimit) && (hi >= kLimit || -lo >= kLimit)) {
        for (int64_t d = 0; d < D; ++d)
          if (std::fabs(row[d]) >= kLimit)
            fail(ErrorKind::kOutOfRange, "quantize: element (token=", t, ", head=", h,
                 ", channel=", d, ") is ", row[d], ", which ",
                 std::is_same_v<Stored, f16> ? "f16" : "bf16", " cannot store (it would become inf)");
      }
    }
  // Caller memory may be unaligned for Stored (a span carved from a byte buffer): rows are then
  // converted into an aligned staging row and copied as bytes (no misaligned f16/bf16 access).
  const auto row_bytes = static_cast<std::size_t>(D) * sizeof(Stored);
  const bool aligned = reinterpret_cast<std::uintptr_t>(q.codes) % alignof(Stored) == 0;
  Stored* stage = nullptr;
  if constexpr (std::is_same_v<Stored, f16>) {
    if (!aligned) stage = QuantWorkspace::at_least(ws.h16, static_cast<std::size_t>(D));
  } else if constexpr (std::is_same_v<Stored, bf16>) {
    if (!aligned) stage = QuantWorkspace::at_least(ws.b16, static_cast<std::size_t>(D));
  }
  for (int64_t t = 0; t < x.tokens(); ++t)
    for (int64_t h = 0; h < x.heads(); ++h) {
      const float* row = load_row(x, t, h, buf);
      uint8_t* o = q.codes + static_cast<std::size_t>(t * x.heads() + h) * row_bytes;
      if constexpr (std::is_same_v<Stored, float>) {
        std::memcpy(o, row, row_bytes);
      } else if (stage != nullptr) {
        convert(row, stage, static_cast<std::size_t>(D));
        std::memcpy(o, stage, row_bytes);
      } else {
        convert(row, reinterpret_cast<Stored*>(o), static_cast<std::size_t>(D));
      }
    }
}

template <class Stored, class T>
void dequantize_raw(const PackedView& q, int64_t t0, const KVView<T>& out, QuantWorkspace& ws) {
  const int64_t D = q.shape.head_dim, H = q.shape.heads;
  float* buf = QuantWorkspace::at_least(ws.buf, static_cast<std::size_t>(D));
  // As in quantize_raw: an unaligned view is staged through an aligned row first.
  const auto row_bytes = static_cast<std::size_t>(D) * sizeof(Stored);
  const bool aligned = reinterpret_cast<std::uintptr_t>(q.codes) % alignof(Stored) == 0;
  Stored* stage = nullptr;
  if constexpr (std::is_same_v<Stored, f16>) {
    if (!aligned) stage = QuantWorkspace::at_least(ws.h16, static_cast<std::size_t>(D));
  } else if constexpr (std::is_same_v<Stored, bf16>) {
    if (!aligned) stage = QuantWorkspace::at_least(ws.b16, static_cast<std::size_t>(D));
  }
  for (int64_t t = t0; t < t0 + out.tokens(); ++t)
    for (int64_t h = 0; h < H; ++h) {
      const uint8_t* r = q.codes + static_cast<std::size_t>(t * H + h) * row_bytes;
      if constexpr (std::is_same_v<Stored, float>) {
        std::memcpy(buf, r, row_bytes);
      } else if (stage != nullptr) {
        std::memcpy(stage, r, row_bytes);
        convert(stage, buf, static_cast<std::size_t>(D));
      } else {
        convert(reinterpret_cast<const Stored*>(r), buf, static_cast<std::size_t>(D));
      }
      store_row(out, t - t0, h, buf);
    }
}

inline void check_span(const PackedSizes& p, const PackedSpan& q) {
  KVQ_REQUIRE((p.codes == 0 || q.codes) && (p.scales == 0 || q.scales) &&
                  (p.zeros == 0 || q.zeros) && (p.norms == 0 || q.norms) &&
                  (p.qjl_signs == 0 || q.qjl_signs) && (p.qjl_norms == 0 || q.qjl_norms) &&
                  (p.outlier_values == 0 || q.outlier_values) &&
                  (p.outlier_pos == 0 || q.outlier_pos),
              kInvalidArgument, "quantize_into: the span lacks a region that ",
              q.config.name(), " needs");
}

/// Per-thread scratch of quantize(cfg, x, QTensor&): the result is built here and swapped
/// into `out`, so `out` is untouched when quantizing throws.
inline QTensor& quantize_scratch() {
  thread_local QTensor q;
  return q;
}
inline QuantWorkspace& quantize_workspace() {
  thread_local QuantWorkspace ws;
  return ws;
}

}  // namespace detail

/// Quantizes `x` ([tokens, heads, head_dim], any strides, f32/f16/bf16) under `cfg` into
/// caller memory `q` (q.shape == x.shape(); every region packed_sizes(cfg, x.shape()) lists,
/// with exactly that many bytes). The bytes written are exactly those quantize() puts in a
/// QTensor. Allocates nothing once `ws` has grown to the geometry (first call). Throws on bad
/// input (NaN/inf, groups that do not divide the shape, metadata overflow, unsupported
/// parameters); the span's contents are then unspecified (a page slot not yet committed).
template <class T>
void quantize_into(const QuantConfig& cfg, const KVView<const T>& x, const PackedSpan& q,
                   QuantWorkspace& ws) {
  KVQ_REQUIRE(q.shape == x.shape(), kShapeMismatch, "quantize_into: span shape ", q.shape.str(),
              " but the input is ", x.shape().str());
  const PackedSizes sizes = packed_sizes(cfg, x.shape());  // validates bits, groups, sizes
  detail::check_span(sizes, q);
  if (rotated_plain(cfg)) {  // rotate every vector, then the unrotated quantizer (rotated_quant.hpp)
    if (x.numel() == 0) return;
    const Rotation& rot = hadamard_rotation_for(x.head_dim(), cfg.seed);
    float* stage = QuantWorkspace::at_least(ws.rot, static_cast<std::size_t>(x.numel()));
    detail::rotate_rows(rot, x, stage,
                        QuantWorkspace::at_least(ws.buf, static_cast<std::size_t>(x.head_dim())));
    QuantConfig plain = cfg;
    plain.rotate = false;
    PackedSpan s = q;
    s.config = plain;
    return quantize_into(plain, KVView<const float>(stage, x.shape()), s, ws);
  }
  if (sizes.outlier_values > 0) {  // dense-and-sparse (quant/outlier_quant.hpp)
    if (cfg.format == Format::kNuq) detail::require_nuq_codebook(cfg);
    return quantize_with_outliers(cfg, x, q, ws,
                                  [&ws](const QuantConfig& c, const KVView<const float>& d,
                                        const PackedSpan& s) { quantize_into(c, d, s, ws); });
  }
  switch (cfg.format) {
    case Format::kF32: return detail::quantize_raw<float>(x, q, ws);
    case Format::kF16: return detail::quantize_raw<f16>(x, q, ws);
    case Format::kBF16: return detail::quantize_raw<bf16>(x, q, ws);
    case Format::kInt: return quantize_uniform(cfg, x, q, ws);
    case Format::kE4M3:
    case Format::kE5M2: return quantize_fp8(cfg, x, q, ws);
    case Format::kLloydMax: return quantize_lloyd_max(cfg, x, q, ws);
    case Format::kNuq: return quantize_nuq(cfg, x, q, ws);
    case Format::kNvfp4:
    case Format::kMxfp4: return quantize_fp4(cfg, x, q, ws);
  }
  fail(ErrorKind::kInvalidArgument, "unknown format code ", static_cast<int>(cfg.format));
}
template <class T>
void quantize_into(const QuantConfig& cfg, const KVView<T>& x, const PackedSpan& q,
                   QuantWorkspace& ws) {
  quantize_into(cfg, KVView<const std::remove_const_t<T>>(x), q, ws);
}

/// Stores `x` ([tokens, heads, head_dim]) under `cfg` into `out`. Bad input (NaN/inf, values a
/// raw f16/bf16 cannot hold, shapes that do not fit the groups, metadata overflow, unsupported
/// parameters) throws kvq::Error and leaves `out` exactly as it was: the tensor is built in a
/// per-thread scratch QTensor and swapped into `out` on success. Buffers ping-pong between
/// `out` and the scratch, so quantizing the same shape into the same `out` again allocates
/// nothing from the third call on a thread.
template <class T>
void quantize(const QuantConfig& cfg, const KVView<const T>& x, QTensor& out) {
  QTensor& tmp = detail::quantize_scratch();
  size_for(tmp, cfg, x.shape());
  quantize_into(cfg, x, span_of(tmp), detail::quantize_workspace());
  std::swap(tmp, out);
}
template <class T>
QTensor quantize(const QuantConfig& cfg, const KVView<const T>& x) {
  QTensor q;
  quantize(cfg, x, q);
  return q;
}
template <class T>
QTensor quantize(const QuantConfig& cfg, const KVView<T>& x) {
  return quantize(cfg, KVView<const std::remove_const_t<T>>(x));
}

/// Reconstructs tokens [t0, t0 + out.tokens()) of the packed tensor `q` into `out`
/// ([out.tokens(), heads, head_dim], any strides, f32/f16/bf16). Allocates nothing once `ws`
/// has grown (what the paged layout's token-range reads use).
template <class T>
void dequantize_tokens(const PackedView& q, int64_t t0, const KVView<T>& out,
                       QuantWorkspace& ws) {
  static_assert(!std::is_const_v<T>, "dequantize needs a writable view");
  KVQ_REQUIRE(t0 >= 0 && t0 + out.tokens() <= q.shape.tokens && out.heads() == q.shape.heads &&
                  out.head_dim() == q.shape.head_dim,
              kShapeMismatch, "dequantize tokens [", t0, ", ", t0 + out.tokens(), ") into ",
              out.shape().str(), " but the stored tensor is ", q.shape.str());
  if (rotated_plain(q.config)) {  // decode the rotated vectors, then R^T each (rotated_quant.hpp)
    if (out.numel() == 0) return;
    const int64_t D = q.shape.head_dim, H = q.shape.heads;
    const Rotation& rot = hadamard_rotation_for(D, q.config.seed);
    PackedView plain = q;
    plain.config.rotate = false;
    float* stage = QuantWorkspace::at_least(ws.rot, static_cast<std::size_t>(out.numel()));
    dequantize_tokens(plain, t0, KVView<float>(stage, out.shape()), ws);
    for (int64_t t = 0; t < out.tokens(); ++t)
      for (int64_t h = 0; h < H; ++h) {
        float* row = stage + (t * H + h) * D;
        rot.apply_inverse(row);
        detail::store_row(out, t, h, row);
      }
    return;
  }
  switch (q.config.format) {
    case Format::kF32: return detail::dequantize_raw<float>(q, t0, out, ws);
    case Format::kF16: return detail::dequantize_raw<f16>(q, t0, out, ws);
    case Format::kBF16: return detail::dequantize_raw<bf16>(q, t0, out, ws);
    case Format::kInt:
      dequantize_uniform(q, t0, out, ws);
      return apply_outliers(q, t0, out);
    case Format::kE4M3:
    case Format::kE5M2:
      dequantize_fp8(q, t0, out, ws);
      return apply_outliers(q, t0, out);
    case Format::kLloydMax: return dequantize_lloyd_max(q, t0, out, ws);
    case Format::kNuq:
      dequantize_nuq(q, t0, out, ws);
      return apply_outliers(q, t0, out);
    case Format::kNvfp4:
    case Format::kMxfp4: return dequantize_fp4(q, t0, out, ws);
  }
  fail(ErrorKind::kInvalidArgument, "unknown format code ", static_cast<int>(q.config.format));
}

// Compiled-kernels mode (config.hpp): the f32 instances, which every other entry point and the
// cache reach, are instantiated once, in the KVQ_KERNELS_IMPLEMENTATION (all, or 3: the quantizers) translation
// unit.
#ifdef KVQ_EXTERN_KERNELS
#ifdef KVQ_DETAIL_DEFINE_QUANTIZE
#define KVQ_EXTERN_TEMPLATE_ template
#else
#define KVQ_EXTERN_TEMPLATE_ extern template
#endif
KVQ_EXTERN_TEMPLATE_ void quantize_into<float>(const QuantConfig&, const KVView<const float>&,
                                               const PackedSpan&, QuantWorkspace&);
KVQ_EXTERN_TEMPLATE_ void dequantize_tokens<float>(const PackedView&, int64_t,
                                                   const KVView<float>&, QuantWorkspace&);
#undef KVQ_EXTERN_TEMPLATE_
#endif

/// Reconstructs `q` into `out` (same shape, any strides, f32/f16/bf16).
template <class T>
void dequantize(const PackedView& q, const KVView<T>& out, QuantWorkspace& ws) {
  KVQ_REQUIRE(out.shape() == q.shape, kShapeMismatch, "dequantize into ", out.shape().str(),
              " but the stored tensor is ", q.shape.str());
  dequantize_tokens(q, 0, out, ws);
}
template <class T>
void dequantize(const PackedView& q, const KVView<T>& out) {
  QuantWorkspace ws;
  dequantize(q, out, ws);
}
template <class T>
void dequantize(const QTensor& q, const KVView<T>& out) {
  dequantize(view_of(q), out);
}

}  // namespace kvq
