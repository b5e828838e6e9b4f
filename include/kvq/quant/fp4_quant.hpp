#pragma once
/// \file fp4_quant.hpp
/// The FP4 block quantizers (NVFP4, MXFP4) over [tokens, heads, head_dim] tensors: the element
/// and block rules of format/fp4.hpp applied to every (token, head) vector in blocks of
/// fp4_block(format) consecutive channels (16 for NVFP4, 32 for MXFP4; head_dim must be a
/// multiple, packed_sizes refuses other shapes).
///
/// Regions (quant/packed_view.hpp):
///   codes   the 4-bit e2m1 codes as the bits = 4 bitstream of core/bitpack.hpp (element 2i in
///           the low nibble of byte i), [tokens, heads, head_dim] order
///   scales  one byte per block, in [tokens, heads, head_dim / block] order: the e4m3 code of
///           the block scale (NVFP4) or the e8m0 shared exponent (MXFP4)
/// NVFP4's per-tensor decode scale is config.fp4_tensor_scale (per-layer metadata).
///
/// Element math is format/fp4.hpp's host/device functions, so a page written here decodes
/// bit for bit with the CUDA element functions; reference/fp4_ref.hpp is the independent
/// oracle the tests compare with. NaN and Inf inputs are refused (kNonFinite, naming the
/// element), like every other quantizer: e2m1 would saturate them silently.
#include <cmath>
#include <cstdint>

#include "kvq/core/rows.hpp"
#include "kvq/core/tensor.hpp"
#include "kvq/format/fp4.hpp"
#include "kvq/quant/packed_view.hpp"
#include "kvq/quant/qtensor.hpp"

namespace kvq {

namespace detail {

/// Encodes one row of D (a multiple of the block) finite values into D / 2 code bytes and
/// D / block scale bytes. Returns false (writing nothing meaningful) on a non-finite value.
inline bool fp4_encode_row(Format f, float g, const float* x, int64_t D, uint8_t* codes,
                           uint8_t* scales) {
  const int64_t blk = fp4_block(f);
  for (int64_t b = 0; b < D / blk; ++b) {
    const float* e = x + b * blk;
    float amax = 0.f;
    for (int64_t i = 0; i < blk; ++i) {
      if (!std::isfinite(e[i])) return false;
      amax = std::fmax(amax, std::fabs(e[i]));
    }
    uint8_t* c = codes + b * blk / 2;
    if (f == Format::kMxfp4) {
      const uint8_t sc = fp4::mx_scale_code(amax);
      scales[b] = sc;
      for (int64_t i = 0; i < blk; i += 2)
        c[i / 2] = static_cast<uint8_t>(fp4::mx_encode(e[i], sc) |
                                        (fp4::mx_encode(e[i + 1], sc) << 4));
    } else {
      const uint8_t sc = fp4::nv_scale_code(amax, g);
      scales[b] = sc;
      const float es = fp4::nv_element_scale(sc, g);
      for (int64_t i = 0; i < blk; i += 2)
        c[i / 2] = static_cast<uint8_t>(fp4::nv_encode(e[i], es) |
                                        (fp4::nv_encode(e[i + 1], es) << 4));
    }
  }
  return true;
}

/// Decodes one row of D values from its code and scale bytes.
inline void fp4_decode_row(Format f, float g, const uint8_t* codes, const uint8_t* scales,
                           int64_t D, float* out) {
  const int64_t blk = fp4_block(f);
  for (int64_t b = 0; b < D / blk; ++b) {
    const uint8_t* c = codes + b * blk / 2;
    float* o = out + b * blk;
    if (f == Format::kMxfp4) {
      const uint8_t sc = scales[b];
      for (int64_t i = 0; i < blk; i += 2) {
        o[i] = fp4::mx_decode(static_cast<uint8_t>(c[i / 2] & 0xf), sc);
        o[i + 1] = fp4::mx_decode(static_cast<uint8_t>(c[i / 2] >> 4), sc);
      }
    } else {
      const float es = fp4::nv_element_scale(scales[b], g);
      for (int64_t i = 0; i < blk; i += 2) {
        o[i] = fp4::nv_decode(static_cast<uint8_t>(c[i / 2] & 0xf), es);
        o[i + 1] = fp4::nv_decode(static_cast<uint8_t>(c[i / 2] >> 4), es);
      }
    }
  }
}

/// The 16 values of the e2m1 codes times `scale` (one rounding each, as nv_decode/mx_decode):
/// the per-block lookup table of the fused attention kernels.
inline void fp4_block_lut(Format f, uint8_t scale_code, float g, float* lut16) {
  if (f == Format::kMxfp4) {
    for (int c = 0; c < 16; ++c) lut16[c] = fp4::mx_decode(static_cast<uint8_t>(c), scale_code);
  } else {
    const float es = fp4::nv_element_scale(scale_code, g);
    for (int c = 0; c < 16; ++c) lut16[c] = fp4::nv_decode(static_cast<uint8_t>(c), es);
  }
}

}  // namespace detail

/// Quantizes `x` ([tokens, heads, head_dim], any strides, f32/f16/bf16) under an NVFP4 or
/// MXFP4 config into caller memory `q` (sized by packed_sizes). Throws kNonFinite on NaN/Inf
/// (naming the element); the span's contents are then unspecified.
template <class T>
void quantize_fp4(const QuantConfig& cfg, const KVView<const T>& x, const PackedSpan& q,
                  QuantWorkspace& ws) {
  KVQ_REQUIRE(is_fp4(cfg.format), kInvalidArgument, "quantize_fp4 needs an nvfp4 or mxfp4 config, got ",
              cfg.name());
  const Shape s = x.shape();
  const int64_t H = s.heads, D = s.head_dim, blk = fp4_block(cfg.format);
  KVQ_REQUIRE(D % blk == 0, kShapeMismatch, to_string(cfg.format),
              " needs head_dim to be a multiple of its block of ", blk, " channels, got ",
              s.str());
  float* buf = QuantWorkspace::at_least(ws.buf, static_cast<std::size_t>(D));
  for (int64_t t = 0; t < s.tokens; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const float* row = detail::load_row(x, t, h, buf);
      const int64_t v = t * H + h;
      if (!detail::fp4_encode_row(cfg.format, cfg.fp4_tensor_scale, row, D,
                                  q.codes + v * D / 2, q.scales + v * (D / blk)))
        detail::throw_non_finite_row(x, t, h, "quantize");
    }
}

/// Reconstructs tokens [t0, t0 + out.tokens()) of FP4 data into `out` (f32/f16/bf16, any
/// strides).
template <class T>
void dequantize_fp4(const PackedView& q, int64_t t0, const KVView<T>& out, QuantWorkspace& ws) {
  KVQ_REQUIRE(is_fp4(q.config.format), kInvalidArgument,
              "dequantize_fp4 needs nvfp4 or mxfp4 data, got ", q.config.name());
  const int64_t H = q.shape.heads, D = q.shape.head_dim, blk = fp4_block(q.config.format);
  float* buf = QuantWorkspace::at_least(ws.buf, static_cast<std::size_t>(D));
  for (int64_t t = t0; t < t0 + out.tokens(); ++t)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t v = t * H + h;
      detail::fp4_decode_row(q.config.format, q.config.fp4_tensor_scale, q.codes + v * D / 2,
                             q.scales + v * (D / blk), D, buf);
      detail::store_row(out, t - t0, h, buf);
    }
}

}  // namespace kvq
