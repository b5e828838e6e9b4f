#pragma once
/// \file quantize.hpp
/// The one entry point for storing a tensor under a QuantConfig: quantize() -> QTensor,
/// dequantize(QTensor) -> floats. Compile-time policies and runtime specs both end here.
#include <type_traits>
#include <vector>

#include "kvq/core/half.hpp"
#include "kvq/core/rows.hpp"
#include "kvq/core/tensor.hpp"
#include "kvq/quant/qtensor.hpp"
#include "kvq/quant/grouped_quant.hpp"
#include "kvq/quant/lloyd_max_quant.hpp"

namespace kvq {

namespace detail {
template <class Stored, class T>
QTensor quantize_raw(const QuantConfig& cfg, const KVView<const T>& x) {
  QTensor q;
  q.config = cfg;
  q.shape = x.shape();
  const int64_t D = x.head_dim();
  q.codes.resize(static_cast<std::size_t>(x.numel()) * sizeof(Stored));
  std::vector<float> buf(static_cast<std::size_t>(D));
  auto* dst = reinterpret_cast<Stored*>(q.codes.data());
  for (int64_t t = 0; t < x.tokens(); ++t)
    for (int64_t h = 0; h < x.heads(); ++h) {
      const float* row = load_row(x, t, h, buf.data());
      Stored* o = dst + (t * x.heads() + h) * D;
      if constexpr (std::is_same_v<Stored, float>) {
        std::copy(row, row + D, o);
      } else {
        convert(row, o, static_cast<std::size_t>(D));
      }
    }
  return q;
}

template <class Stored, class T>
void dequantize_raw(const QTensor& q, const KVView<T>& out) {
  const int64_t D = q.shape.head_dim;
  std::vector<float> buf(static_cast<std::size_t>(D));
  const auto* src = reinterpret_cast<const Stored*>(q.codes.data());
  for (int64_t t = 0; t < q.shape.tokens; ++t)
    for (int64_t h = 0; h < q.shape.heads; ++h) {
      const Stored* r = src + (t * q.shape.heads + h) * D;
      if constexpr (std::is_same_v<Stored, float>) {
        std::copy(r, r + D, buf.begin());
      } else {
        convert(r, buf.data(), static_cast<std::size_t>(D));
      }
      store_row(out, t, h, buf.data());
    }
}
}  // namespace detail

/// Stores `x` ([tokens, heads, head_dim]) under `cfg`. Bad input (NaN/inf, shapes that do not
/// fit the groups, metadata overflow, unsupported parameters) throws kvq::Error and leaves no
/// partial result.
/// The result goes into `out`, whose buffers are reused (no allocation when the shape repeats).
template <class T>
void quantize(const QuantConfig& cfg, const KVView<const T>& x, QTensor& out) {
  switch (cfg.format) {
    case Format::kF32: out = detail::quantize_raw<float>(cfg, x); return;
    case Format::kF16: out = detail::quantize_raw<f16>(cfg, x); return;
    case Format::kBF16: out = detail::quantize_raw<bf16>(cfg, x); return;
    case Format::kInt: quantize_uniform(cfg, x, out); return;
    case Format::kE4M3:
    case Format::kE5M2: quantize_fp8(cfg, x, out); return;
    case Format::kLloydMax: quantize_lloyd_max(cfg, x, out); return;
  }
  fail(ErrorKind::kInvalidArgument, "unknown format code ", static_cast<int>(cfg.format));
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

/// Reconstructs `q` into `out` (same shape, any strides, f32/f16/bf16).
template <class T>
void dequantize(const QTensor& q, const KVView<T>& out) {
  static_assert(!std::is_const_v<T>, "dequantize needs a writable view");
  KVQ_REQUIRE(out.shape() == q.shape, kShapeMismatch, "dequantize into ", out.shape().str(),
              " but the stored tensor is ", q.shape.str());
  switch (q.config.format) {
    case Format::kF32: return detail::dequantize_raw<float>(q, out);
    case Format::kF16: return detail::dequantize_raw<f16>(q, out);
    case Format::kBF16: return detail::dequantize_raw<bf16>(q, out);
    case Format::kInt: return dequantize_uniform(q, out);
    case Format::kE4M3:
    case Format::kE5M2: return dequantize_fp8(q, out);
    case Format::kLloydMax: return dequantize_lloyd_max(q, out);
  }
  fail(ErrorKind::kInvalidArgument, "unknown format code ", static_cast<int>(q.config.format));
}

}  // namespace kvq
