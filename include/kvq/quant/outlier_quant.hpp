#pragma once
/// \file outlier_quant.hpp
/// Dense-and-sparse quantization (KVQuant): k entries per (token, head) vector are kept exactly
/// as fp16 value + channel position, the rest is quantized by the dense format (int, fp8 or
/// nuq) with ranges computed without them (geometry/outliers.hpp says which entries and what
/// the dense part holds in their place). k is fixed per vector (config.outliers, or
/// ceil(outlier_pct / 100 * head_dim)), so a block's size depends only on its shape: no count
/// fields, no CSR row pointers.
///
/// Byte layout (quant/packed_view.hpp): the dense format's regions unchanged, then
///   outlier_values  [tokens, heads, k] fp16 (2 bytes each, round to nearest even)
///   outlier_pos     [tokens, heads, k] channel, 1 byte (2 bytes LE when head_dim > 256),
///                   ascending within a vector
/// e.g. head_dim 128, k = 2 (/out1%): 6 bytes per vector = 0.375 bits per value on top of the
/// dense format. Dequantization decodes the dense part, then writes the k exact values.
///
/// An outlier whose magnitude fp16 cannot hold (|x| >= 65520) is rejected (kOutOfRange), as a
/// raw f16 tensor rejects it. reference/outlier_ref.hpp is the scalar oracle.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kvq/core/half.hpp"
#include "kvq/core/rows.hpp"
#include "kvq/core/tensor.hpp"
#include "kvq/geometry/outliers.hpp"
#include "kvq/kernels/cpu/uniform_cpu.hpp"
#include "kvq/quant/packed_view.hpp"
#include "kvq/quant/qtensor.hpp"

namespace kvq {

namespace detail {

/// The config of the dense part (no outliers).
inline QuantConfig dense_config(QuantConfig c) {
  c.outliers = 0;
  c.outlier_pct = 0.f;
  return c;
}

/// Stores k outliers of one vector: values as fp16, positions 1 or 2 bytes.
inline void store_outliers(const float* vals, const int32_t* sel, int64_t k, int pos_bytes,
                           uint8_t* vdst, uint8_t* pdst) {
  for (int64_t j = 0; j < k; ++j) {
    const uint16_t hb = float_to_half_bits(vals[j]);
    std::memcpy(vdst + 2 * j, &hb, 2);
    if (pos_bytes == 1) {
      pdst[j] = static_cast<uint8_t>(sel[j]);
    } else {
      pdst[2 * j] = static_cast<uint8_t>(sel[j] & 0xff);
      pdst[2 * j + 1] = static_cast<uint8_t>(sel[j] >> 8);
    }
  }
}

/// Throws kOutOfRange naming the first outlier fp16 cannot store.
inline void check_outlier_range(const float* vals, const int32_t* sel, int64_t vectors, int64_t k,
                                int64_t H) {
  for (int64_t i = 0; i < vectors * k; ++i)
    if (!(std::fabs(vals[i]) < 65520.f))
      fail(ErrorKind::kOutOfRange, "quantize: outlier (token=", (i / k) / H, ", head=", (i / k) % H,
           ", channel=", sel[i], ") is ", vals[i],
           ", which fp16 cannot store (it would become inf); outliers are kept as fp16");
}

}  // namespace detail

/// Quantizes `x` with k > 0 outliers per vector: selection and dense replacement into ws, then
/// `dense(dense_cfg, dense_view, span)` (the format's quantizer: quantize.hpp passes its own
/// dispatch), then the sparse arrays. Throws like the dense quantizer, plus kOutOfRange for an
/// outlier fp16 cannot hold; the span's contents are then unspecified.
template <class T, class Dense>
void quantize_with_outliers(const QuantConfig& cfg, const KVView<const T>& x, const PackedSpan& q,
                            QuantWorkspace& ws, Dense&& dense) {
  const Shape s = x.shape();
  const int64_t T_ = s.tokens, H = s.heads, D = s.head_dim;
  const int64_t k = outlier_count(cfg, D);
  const auto n = static_cast<std::size_t>(s.numel());
  float* buf = QuantWorkspace::at_least(ws.dense, n);
  const std::size_t nk = static_cast<std::size_t>(T_ * H * k);
  float* vals = QuantWorkspace::at_least(ws.ovals, nk);
  int32_t* sel = QuantWorkspace::at_least(ws.sel, nk);
  for (int64_t t = 0; t < T_; ++t)
    for (int64_t h = 0; h < H; ++h) {
      float* dst = buf + (t * H + h) * D;
      const float* r = detail::load_row(x, t, h, dst);
      if (r != dst) std::memcpy(dst, r, static_cast<std::size_t>(D) * sizeof(float));
      float lo = INFINITY, hi = -INFINITY;
      if (!kernels::minmax(dst, D, lo, hi)) detail::throw_non_finite_row(x, t, h, "quantize");
    }
  isolate_outliers(s, cfg.axis, cfg.group, k, buf, sel, vals, ws.outlier);
  detail::check_outlier_range(vals, sel, T_ * H, k, H);
  PackedSpan dq = q;
  dq.config = detail::dense_config(cfg);
  dense(dq.config, KVView<const float>(buf, s), dq);
  const int pb = outlier_pos_bytes(D);
  for (int64_t v = 0; v < T_ * H; ++v)
    detail::store_outliers(vals + v * k, sel + v * k, k, pb, q.outlier_values + 2 * v * k,
                           q.outlier_pos + pb * v * k);
}

/// Writes the exact outliers of tokens [t0, t0 + out.tokens()) of `q` over `out` (which holds
/// the dense reconstruction of those tokens). No-op when q has no outliers.
template <class T>
void apply_outliers(const PackedView& q, int64_t t0, const KVView<T>& out) {
  const int64_t H = q.shape.heads, D = q.shape.head_dim;
  const int64_t k = outlier_count(q.config, D);
  if (k <= 0 || out.numel() == 0) return;
  KVQ_REQUIRE(q.outlier_values != nullptr && q.outlier_pos != nullptr, kInvalidArgument,
              "dequantize: ", q.config.name(), " data lacks its outlier regions");
  const int pb = outlier_pos_bytes(D);
  for (int64_t t = t0; t < t0 + out.tokens(); ++t)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t v = t * H + h;
      for (int64_t j = 0; j < k; ++j) {
        uint16_t hb;
        std::memcpy(&hb, q.outlier_values + 2 * (v * k + j), 2);
        const uint8_t* p = q.outlier_pos + pb * (v * k + j);
        const int64_t d = pb == 1 ? p[0] : (p[0] | (p[1] << 8));
        KVQ_REQUIRE(d < D, kInvalidArgument, "dequantize: outlier position ", d,
                    " outside head_dim ", D, " (corrupt data)");
        out.at(t - t0, h, d) = from_float<std::remove_const_t<T>>(half_bits_to_float(hb));
      }
    }
}

}  // namespace kvq
