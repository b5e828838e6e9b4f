#pragma once
/// \file grouped_quant.hpp
/// Grouped scalar quantizers (fast path): uniform integers and scaled FP8 share one driver that
/// walks the tensor one token block (the group extent along tokens) at a time, so per-channel
/// statistics and encoding read the block while it is still in cache. A codec supplies the
/// per-group parameters from the group's [min, max] and the encode/decode of contiguous runs.
///
/// Codes are packed in [tokens, heads, head_dim] order; metadata is one scale (and one zero
/// point for asymmetric integers) per group box, in box order (token block, head block,
/// channel block). reference/uniform_ref.hpp and reference/fp8_quant_ref.hpp are the scalar
/// oracles: tests require identical bytes.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "kvq/core/bitpack.hpp"
#include "kvq/core/rows.hpp"
#include "kvq/format/fp8.hpp"
#include "kvq/format/uniform.hpp"
#include "kvq/geometry/grouping.hpp"
#include "kvq/simd/fp8_cpu.hpp"
#include "kvq/simd/uniform_cpu.hpp"
#include "kvq/quant/packed_view.hpp"
#include "kvq/quant/qtensor.hpp"

namespace kvq {

namespace detail {

/// Uniform integer codec (see format/uniform.hpp for the formulas).
struct IntCodec {
  int bits;
  bool symmetric;
  MetaDType meta;
  UniformLevels lv;
  explicit IntCodec(const QuantConfig& c)
      : bits(c.bits), symmetric(c.symmetric), meta(c.meta), lv(uniform_levels(c.bits, c.symmetric)) {}
  bool has_zero() const { return !symmetric; }
  UniformParams params(float lo, float hi, int64_t g) const {
    return uniform_params(lo, hi, bits, symmetric, meta, g);
  }
  void encode(const float* x, int64_t n, float z, float inv, uint8_t* c) const {
    kernels::encode_run(x, n, z, inv, lv.off, lv.qmax, c);
  }
  void encode_vec(const float* x, const float* z, const float* inv, int64_t n, uint8_t* c) const {
    kernels::encode_run_vec(x, z, inv, n, lv.off, lv.qmax, c);
  }
  void decode(const uint8_t* c, int64_t n, float s, float z, float* out) const {
    kernels::decode_run(c, n, s, z, lv.off, out);
  }
  void decode_vec(const uint8_t* c, const float* s, const float* z, int64_t n, float* out) const {
    kernels::decode_run_vec(c, s, z, n, lv.off, out);
  }
  // Straight to fp16 output (same bits as decoding to float, then rounding to fp16).
  void decode_f16(const uint8_t* c, int64_t n, float s, float z, f16* out) const {
    kernels::decode_run_f16<false>(c, n, &s, &z, lv.off, reinterpret_cast<uint16_t*>(out));
  }
  void decode_vec_f16(const uint8_t* c, const float* s, const float* z, int64_t n, f16* out) const {
    kernels::decode_run_f16<true>(c, n, s, z, lv.off, reinterpret_cast<uint16_t*>(out));
  }
};

/// Scaled FP8 codec: scale = amax * margin / max_finite (fp8::compute_scale), rounded to the
/// metadata type; code = encode(x * (1/scale)) saturating; x' = decode(code) * scale.
/// With fp16 metadata a scale that underflows fp16 is raised to the smallest fp16 subnormal and
/// one that overflows it is an error (kOutOfRange: use fp32 metadata).
struct Fp8Codec {
  fp8::Fp8Kind kind;
  float margin;
  MetaDType meta;
  explicit Fp8Codec(const QuantConfig& c)
      : kind(c.format == Format::kE5M2 ? fp8::Fp8Kind::kE5M2 : fp8::Fp8Kind::kE4M3),
        margin(c.fp8_margin),
        meta(c.meta) {}
  bool has_zero() const { return false; }
  UniformParams params(float lo, float hi, int64_t g) const {
    const float amax = std::max(-lo, hi) + 0.0f;
    UniformParams p;
    p.scale = round_meta(meta, fp8::compute_scale(kind, amax, margin));
    if (p.scale == 0.f) p.scale = half_bits_to_float(1);  // fp16 underflow: smallest subnormal
    KVQ_REQUIRE(std::isfinite(p.scale), kOutOfRange, "fp8 scale of group ", g, " (amax ", amax,
                ") overflows ", to_string(meta), " metadata; use f32 metadata");
    p.inv = 1.0f / p.scale;
    return p;
  }
  void encode(const float* x, int64_t n, float, float inv, uint8_t* c) const {
    fp8::encode(kind, x, c, static_cast<std::size_t>(n), inv, true);
  }
  void encode_vec(const float* x, const float*, const float* inv, int64_t n, uint8_t* c) const {
    for (int64_t i = 0; i < n; ++i) c[i] = fp8::encode(kind, x[i] * inv[i], true);
  }
  void decode(const uint8_t* c, int64_t n, float s, float, float* out) const {
    fp8::decode(kind, c, out, static_cast<std::size_t>(n), s);
  }
  void decode_vec(const uint8_t* c, const float* s, const float*, int64_t n, float* out) const {
    for (int64_t i = 0; i < n; ++i) out[i] = fp8::decode(kind, c[i]) * s[i];
  }
};

/// The driver: quantizes x into `q` (caller memory sized by packed_sizes(cfg, x.shape())) with
/// `codec`, `bits` wide codes. On a throw the span's contents are unspecified.
template <class Codec, class T>
void grouped_quantize(const QuantConfig& cfg, const Codec& codec, int bits,
                      const KVView<const T>& x, const PackedSpan& q, QuantWorkspace& ws) {
  const Shape s = x.shape();
  const GroupBox box = group_box(cfg.axis, cfg.group, s);
  const auto n = static_cast<std::size_t>(s.numel());
  if (n == 0) return;
  const std::size_t code_bytes = packed_bytes(n, bits);
  q.codes[code_bytes - 1] = 0;  // unused trailing bits are zero
  const MetaDType meta = cfg.meta;
  [[maybe_unused]] const auto msz = static_cast<std::size_t>(meta_size(meta));  // SIMD paths

  const int64_t H = s.heads, D = s.head_dim;
  float* buf = QuantWorkspace::at_least(ws.buf, static_cast<std::size_t>(D));
  uint8_t* code_buf = QuantWorkspace::at_least(ws.codes, static_cast<std::size_t>(D));
  // Per-block parameters for the channel/head/tensor axes: [heads, head_dim] or [heads] or [1].
  const bool per_channel = cfg.axis == Axis::kChannel;
  const std::size_t np = per_channel ? static_cast<std::size_t>(H * D)
                                     : (cfg.axis == Axis::kHead ? static_cast<std::size_t>(H) : 1);
  float* lo = QuantWorkspace::at_least(ws.lo, np);
  float* hi = QuantWorkspace::at_least(ws.hi, np);
  float* zv = QuantWorkspace::at_least(ws.zv, np);
  float* iv = QuantWorkspace::at_least(ws.iv, np);
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const std::size_t row_bytes = static_cast<std::size_t>(D) * sizeof(T);
#if KVQ_ROW_TOKEN_KERNEL
  // Whole-row kernel for per-token int groups (falls back per row on any error).
  const bool row_kernel = cfg.axis == Axis::kToken &&
                          box.gc % kernels::kRowTokenGroupMultiple == 0 &&
                          D / box.gc <= kernels::kRowTokenMaxGroups;
#endif

  auto store_params = [&](int64_t g, float l, float h) {
    UniformParams p = codec.params(l, h, g);
    store_meta(q.scales, meta, static_cast<std::size_t>(g), p.scale);
    if (codec.has_zero()) store_meta(q.zeros, meta, static_cast<std::size_t>(g), p.zero);
    return p;
  };
  auto code_dst = [&](int64_t t, int64_t h) {
    return bits == 8 ? q.codes + (t * H + h) * D : code_buf;
  };
  auto emit = [&](int64_t t, int64_t h, const uint8_t* codes) {
    if (bits == 8) return;  // encoded in place
    const auto off = static_cast<std::size_t>((t * H + h) * D);
    kernels::pack_codes(codes, static_cast<std::size_t>(D), bits, q.codes, off * bits);
  };

  for (int64_t tb = 0; tb < box.nt; ++tb) {
    const int64_t t0 = tb * box.gt, t1 = t0 + box.gt;
    if (cfg.axis == Axis::kToken) {  // groups inside one row: statistics and encoding fused
      for (int64_t t = t0; t < t1; ++t) {
        for (int64_t h = 0; h < H; ++h) {
          if (x.dim_contiguous()) kernels::prefetch_ahead(x.row(t, h), row_bytes);
          const float* row = load_row(x, t, h, buf);
          uint8_t* dst = code_dst(t, h);
#if KVQ_ROW_TOKEN_KERNEL
          if constexpr (std::is_same_v<Codec, IntCodec>) {
            if (row_kernel) {
              const auto g = static_cast<std::size_t>(box.index(t, h, 0));
              if (kernels::quantize_row_token(
                      row, D, box.gc, bits, codec.symmetric, meta == MetaDType::kF16,
                      codec.lv.off, codec.lv.qmax, q.scales + g * msz,
                      codec.has_zero() ? q.zeros + g * msz : nullptr, dst,
                      bits == 4 ? q.codes + (t * H + h) * D / 2 : nullptr)) {
                if (bits != 4) emit(t, h, dst);
                continue;
              }
            }
          }
#endif
          for (int64_t c0 = 0; c0 < D; c0 += box.gc) {
            float l = kInf, u = -kInf;
            if (!kernels::minmax(row + c0, box.gc, l, u)) throw_non_finite_row(x, t, h, "quantize");
            const UniformParams p = store_params(box.index(t, h, c0), l, u);
            codec.encode(row + c0, box.gc, p.zero, p.inv, dst + c0);
          }
          emit(t, h, dst);
        }
      }
      continue;
    }
    std::fill(lo, lo + np, kInf);
    std::fill(hi, hi + np, -kInf);
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t h = 0; h < H; ++h) {
        if (x.dim_contiguous()) kernels::prefetch_ahead(x.row(t, h), row_bytes);
        const float* row = load_row(x, t, h, buf);
        bool ok;
        if (per_channel) {
          ok = kernels::minmax_elementwise(row, lo + h * D, hi + h * D, D);
        } else {
          const std::size_t k = cfg.axis == Axis::kHead ? static_cast<std::size_t>(h) : 0;
          ok = kernels::minmax(row, D, lo[k], hi[k]);
        }
        if (!ok) throw_non_finite_row(x, t, h, "quantize");
      }
    }
    const int64_t g0 = tb * box.nh * box.nc;  // first group of this token block
    bool params_done = false;
#if KVQ_ROW_TOKEN_KERNEL
    if constexpr (std::is_same_v<Codec, IntCodec>) {
      // The block's groups are consecutive metadata slots g0 .. g0 + np - 1.
      params_done = kernels::uniform_params_array(
          lo, hi, static_cast<int64_t>(np), bits, codec.symmetric, meta == MetaDType::kF16,
          codec.lv.qmax, q.scales + static_cast<std::size_t>(g0) * msz,
          codec.has_zero() ? q.zeros + static_cast<std::size_t>(g0) * msz : nullptr, zv, iv);
    }
#endif
    for (std::size_t k = 0; k < np && !params_done; ++k) {
      const UniformParams p = store_params(g0 + static_cast<int64_t>(k), lo[k], hi[k]);
      zv[k] = p.zero;
      iv[k] = p.inv;
    }
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t h = 0; h < H; ++h) {
        const float* row = load_row(x, t, h, buf);
        uint8_t* dst = code_dst(t, h);
        if (per_channel) {
          codec.encode_vec(row, zv + h * D, iv + h * D, D, dst);
        } else {
          const std::size_t k = cfg.axis == Axis::kHead ? static_cast<std::size_t>(h) : 0;
          codec.encode(row, D, zv[k], iv[k], dst);
        }
        emit(t, h, dst);
      }
    }
  }
}

/// The inverse driver: reconstructs the tokens [t0, t0 + out.tokens()) of `q` into `out`
/// with `codec` (any token range: per-channel parameters are loaded per token block).
template <class Codec, class T>
void grouped_dequantize(const PackedView& q, const Codec& codec, int bits, int64_t t0,
                        const KVView<T>& out, QuantWorkspace& ws) {
  const QuantConfig& cfg = q.config;
  const Shape s = q.shape;
  if (out.numel() == 0) return;
  const GroupBox box = group_box(cfg.axis, cfg.group, s);
  const int64_t H = s.heads, D = s.head_dim;
  float* buf = QuantWorkspace::at_least(ws.buf, static_cast<std::size_t>(D));
  uint8_t* code_buf = QuantWorkspace::at_least(ws.codes, static_cast<std::size_t>(D));
  const bool per_channel = cfg.axis == Axis::kChannel;
  float* sv = nullptr;
  float* zv = nullptr;
  if (per_channel) {
    sv = QuantWorkspace::at_least(ws.lo, static_cast<std::size_t>(H * D));
    zv = QuantWorkspace::at_least(ws.zv, static_cast<std::size_t>(H * D));
  }
  const bool direct = std::is_same_v<T, float> && out.dim_contiguous();
  auto zero_of = [&](std::size_t g) { return codec.has_zero() ? q.zero(g) : 0.f; };

  int64_t loaded = -1;  // token block whose per-channel parameters are in sv / zv
  for (int64_t t = t0; t < t0 + out.tokens(); ++t) {
    if (per_channel && t / box.gt != loaded) {
      loaded = t / box.gt;
      const int64_t g0 = loaded * box.nh * box.nc;
      for (int64_t k = 0; k < H * D; ++k) {
        sv[k] = q.scale(static_cast<std::size_t>(g0 + k));
        zv[k] = zero_of(static_cast<std::size_t>(g0 + k));
      }
    }
    const int64_t ot = t - t0;
    for (int64_t h = 0; h < H; ++h) {
      const auto off = static_cast<std::size_t>((t * H + h) * D);
      const uint8_t* codes = q.codes + off;
      if (bits != 8) {
        kernels::unpack_codes(q.codes, static_cast<std::size_t>(D), bits, code_buf, off * bits);
        codes = code_buf;
      }
      if constexpr (std::is_same_v<T, f16> && std::is_same_v<Codec, IntCodec>) {
        if (out.dim_contiguous()) {  // decode straight into the fp16 row
          f16* o = out.row(ot, h);
          if (per_channel) {
            codec.decode_vec_f16(codes, sv + h * D, zv + h * D, D, o);
          } else {
            for (int64_t c0 = 0; c0 < D; c0 += box.gc) {
              const auto g = static_cast<std::size_t>(box.index(t, h, c0));
              codec.decode_f16(codes + c0, box.gc, q.scale(g), zero_of(g), o + c0);
            }
          }
          continue;
        }
      }
      float* dst = buf;
      if constexpr (std::is_same_v<T, float>) {
        if (direct) dst = out.row(ot, h);
      }
      if (per_channel) {
        codec.decode_vec(codes, sv + h * D, zv + h * D, D, dst);
      } else {
        for (int64_t c0 = 0; c0 < D; c0 += box.gc) {
          const auto g = static_cast<std::size_t>(box.index(t, h, c0));
          codec.decode(codes + c0, box.gc, q.scale(g), zero_of(g), dst + c0);
        }
      }
      if (!direct) store_row(out, ot, h, dst);
    }
  }
}

}  // namespace detail

/// Quantizes `x` ([tokens, heads, head_dim], any strides, f32/f16/bf16) with a uniform integer
/// config into caller memory `q` (sized by packed_sizes). Throws on NaN/inf input (naming the
/// element), on groups that do not divide the shape, and on metadata overflow; the span's
/// contents are then unspecified. quantize() (quant/quantize.hpp) is the checked entry point.
template <class T>
void quantize_uniform(const QuantConfig& cfg, const KVView<const T>& x, const PackedSpan& q,
                      QuantWorkspace& ws) {
  KVQ_REQUIRE(cfg.format == Format::kInt, kInvalidArgument, "quantize_uniform needs an int config");
  detail::grouped_quantize(cfg, detail::IntCodec(cfg), cfg.bits, x, q, ws);
}
/// Reconstructs tokens [t0, t0 + out.tokens()) of uniform-int data into `out` (f32/f16/bf16;
/// any strides).
template <class T>
void dequantize_uniform(const PackedView& q, int64_t t0, const KVView<T>& out,
                        QuantWorkspace& ws) {
  KVQ_REQUIRE(q.config.format == Format::kInt, kInvalidArgument, "dequantize_uniform needs int data");
  detail::grouped_dequantize(q, detail::IntCodec(q.config), q.config.bits, t0, out, ws);
}

/// Scaled FP8 (e4m3fn / e5m2) with one computed scale per group (axis token, channel, head or
/// tensor); codes are the same bytes CUDA's saturating conversion of x / scale gives.
template <class T>
void quantize_fp8(const QuantConfig& cfg, const KVView<const T>& x, const PackedSpan& q,
                  QuantWorkspace& ws) {
  KVQ_REQUIRE(cfg.format == Format::kE4M3 || cfg.format == Format::kE5M2, kInvalidArgument,
              "quantize_fp8 needs an e4m3 or e5m2 config");
  detail::grouped_quantize(cfg, detail::Fp8Codec(cfg), 8, x, q, ws);
}
template <class T>
void dequantize_fp8(const PackedView& q, int64_t t0, const KVView<T>& out, QuantWorkspace& ws) {
  KVQ_REQUIRE(q.config.format == Format::kE4M3 || q.config.format == Format::kE5M2,
              kInvalidArgument, "dequantize_fp8 needs fp8 data");
  detail::grouped_dequantize(q, detail::Fp8Codec(q.config), 8, t0, out, ws);
}

}  // namespace kvq
