#pragma once
/// \file uniform_quant.hpp
/// Grouped uniform integer quantizer (fast path). Codes are packed in [tokens, heads, head_dim]
/// order; metadata is one scale (and one zero point when asymmetric) per group box, in box
/// order ((token block, head block, channel block)). reference/uniform_ref.hpp is its scalar
/// oracle: both give identical bytes.
///
/// Work is done one token block (the group extent along tokens) at a time so that per-channel
/// statistics and encoding read the block while it is still in cache.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "kvq/core/bitpack.hpp"
#include "kvq/core/rows.hpp"
#include "kvq/format/uniform.hpp"
#include "kvq/geometry/grouping.hpp"
#include "kvq/kernels/cpu/uniform_cpu.hpp"
#include "kvq/quant/qtensor.hpp"

namespace kvq {

namespace detail {
/// Prepares `q` for (cfg, s), reusing its buffers' capacity (engines quantize into the same
/// block repeatedly; fresh allocations would page-fault on every call).
inline void prepare_qtensor(QTensor& q, const QuantConfig& cfg, const Shape& s, std::size_t groups,
                            std::size_t code_bytes) {
  q.config = cfg;
  q.shape = s;
  q.codes.resize(code_bytes);
  if (code_bytes > 0) q.codes.back() = 0;  // unused trailing bits are zero
  q.scales.reset(cfg.meta, groups);
  q.zeros.reset(cfg.meta, cfg.symmetric || cfg.format != Format::kInt ? 0 : groups);
  q.norms.reset(cfg.meta, 0);
  q.qjl_signs.clear();
  q.qjl_norms.reset(cfg.meta, 0);
  q.has_seed = false;
}
}  // namespace detail

/// Quantizes `x` ([tokens, heads, head_dim], any strides, f32/f16/bf16) with a uniform integer
/// config. Throws on NaN/inf input (naming the element), on groups that do not divide the
/// shape, and on metadata overflow.
/// The result is written into `q`, reusing its storage; on error `q` is left unspecified but
/// valid (callers that must keep a block intact quantize into a scratch QTensor).
template <class T>
void quantize_uniform(const QuantConfig& cfg, const KVView<const T>& x, QTensor& q) {
  KVQ_REQUIRE(cfg.format == Format::kInt, kInvalidArgument, "quantize_uniform needs an int config");
  check_uniform_bits(cfg.bits);
  const Shape s = x.shape();
  const GroupBox box = group_box(cfg.axis, cfg.group, s);
  const auto n = static_cast<std::size_t>(s.numel());
  detail::prepare_qtensor(q, cfg, s, n > 0 ? static_cast<std::size_t>(box.count()) : 0,
                          packed_bytes(n, cfg.bits));
  if (n == 0) return;

  const int64_t H = s.heads, D = s.head_dim;
  const UniformLevels lv = uniform_levels(cfg.bits, cfg.symmetric);
  const int bits = cfg.bits;
  std::vector<float> buf(static_cast<std::size_t>(D));
  std::vector<uint8_t> code_buf(static_cast<std::size_t>(D));
  // Per-block parameters for the channel/head/tensor axes: [heads, head_dim] or [heads] or [1].
  const bool per_channel = cfg.axis == Axis::kChannel;
  const std::size_t np = per_channel ? static_cast<std::size_t>(H * D)
                                     : (cfg.axis == Axis::kHead ? static_cast<std::size_t>(H) : 1);
  std::vector<float> lo(np), hi(np), zv(np), iv(np);
  constexpr float kInf = std::numeric_limits<float>::infinity();

  auto store_params = [&](int64_t g, float l, float h) {
    const UniformParams p = uniform_params(l, h, bits, cfg.symmetric, cfg.meta, g);
    q.scales.set(static_cast<std::size_t>(g), p.scale);
    if (!cfg.symmetric) q.zeros.set(static_cast<std::size_t>(g), p.zero);
    return p;
  };
  auto emit = [&](int64_t t, int64_t h, const uint8_t* codes) {
    const std::size_t off = static_cast<std::size_t>((t * H + h) * D);
    if (bits == 8) return;  // encoded in place
    kernels::pack_codes(codes, static_cast<std::size_t>(D), bits, q.codes.data(), off * bits);
  };
  auto code_dst = [&](int64_t t, int64_t h) {
    return bits == 8 ? q.codes.data() + (t * H + h) * D : code_buf.data();
  };

  for (int64_t tb = 0; tb < box.nt; ++tb) {
    const int64_t t0 = tb * box.gt, t1 = t0 + box.gt;
    if (cfg.axis == Axis::kToken) {
      for (int64_t t = t0; t < t1; ++t) {
        for (int64_t h = 0; h < H; ++h) {
          const float* row = detail::load_row(x, t, h, buf.data());
          uint8_t* dst = code_dst(t, h);
          for (int64_t cb = 0; cb < box.nc; ++cb) {
            const int64_t c0 = cb * box.gc;
            float l = kInf, u = -kInf;
            if (!kernels::minmax(row + c0, box.gc, l, u))
              detail::throw_non_finite_row(x, t, h, "quantize");
            const UniformParams p = store_params(box.index(t, h, c0), l, u);
            kernels::encode_run(row + c0, box.gc, p.zero, p.inv, lv.off, lv.qmax, dst + c0);
          }
          emit(t, h, dst);
        }
      }
      continue;
    }
    // Statistics over the token block.
    std::fill(lo.begin(), lo.end(), kInf);
    std::fill(hi.begin(), hi.end(), -kInf);
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t h = 0; h < H; ++h) {
        const float* row = detail::load_row(x, t, h, buf.data());
        bool ok;
        if (per_channel) {
          ok = kernels::minmax_elementwise(row, lo.data() + h * D, hi.data() + h * D, D);
        } else {
          const std::size_t k = cfg.axis == Axis::kHead ? static_cast<std::size_t>(h) : 0;
          ok = kernels::minmax(row, D, lo[k], hi[k]);
        }
        if (!ok) detail::throw_non_finite_row(x, t, h, "quantize");
      }
    }
    const int64_t g0 = tb * box.nh * box.nc;  // first group of this token block
    for (std::size_t k = 0; k < np; ++k) {
      const UniformParams p = store_params(g0 + static_cast<int64_t>(k), lo[k], hi[k]);
      zv[k] = p.zero;
      iv[k] = p.inv;
    }
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t h = 0; h < H; ++h) {
        const float* row = detail::load_row(x, t, h, buf.data());
        uint8_t* dst = code_dst(t, h);
        if (per_channel) {
          kernels::encode_run_vec(row, zv.data() + h * D, iv.data() + h * D, D, lv.off, lv.qmax,
                                  dst);
        } else {
          const std::size_t k = cfg.axis == Axis::kHead ? static_cast<std::size_t>(h) : 0;
          kernels::encode_run(row, D, zv[k], iv[k], lv.off, lv.qmax, dst);
        }
        emit(t, h, dst);
      }
    }
  }
}

template <class T>
QTensor quantize_uniform(const QuantConfig& cfg, const KVView<const T>& x) {
  QTensor q;
  quantize_uniform(cfg, x, q);
  return q;
}

/// Reconstructs a uniform-int QTensor into `out` (same shape; f32/f16/bf16; any strides).
template <class T>
void dequantize_uniform(const QTensor& q, const KVView<T>& out) {
  const QuantConfig& cfg = q.config;
  KVQ_REQUIRE(cfg.format == Format::kInt, kInvalidArgument, "dequantize_uniform needs int data");
  KVQ_REQUIRE(out.shape() == q.shape, kShapeMismatch, "dequantize into ", out.shape().str(),
              " but the tensor is ", q.shape.str());
  const Shape s = q.shape;
  if (s.numel() == 0) return;
  const GroupBox box = group_box(cfg.axis, cfg.group, s);
  const int64_t H = s.heads, D = s.head_dim;
  const int bits = cfg.bits;
  const UniformLevels lv = uniform_levels(bits, cfg.symmetric);
  std::vector<float> buf(static_cast<std::size_t>(D));
  std::vector<uint8_t> code_buf(static_cast<std::size_t>(D));
  const bool per_channel = cfg.axis == Axis::kChannel;
  std::vector<float> sv, zv;
  if (per_channel) {
    sv.resize(static_cast<std::size_t>(H * D));
    zv.resize(static_cast<std::size_t>(H * D));
  }
  const bool direct = std::is_same_v<T, float> && out.dim_contiguous();

  for (int64_t tb = 0; tb < box.nt; ++tb) {
    const int64_t g0 = tb * box.nh * box.nc;
    if (per_channel) {
      for (int64_t k = 0; k < H * D; ++k) {
        sv[static_cast<std::size_t>(k)] = q.scales.get(static_cast<std::size_t>(g0 + k));
        zv[static_cast<std::size_t>(k)] =
            cfg.symmetric ? 0.f : q.zeros.get(static_cast<std::size_t>(g0 + k));
      }
    }
    for (int64_t t = tb * box.gt; t < (tb + 1) * box.gt; ++t) {
      for (int64_t h = 0; h < H; ++h) {
        const std::size_t off = static_cast<std::size_t>((t * H + h) * D);
        const uint8_t* codes = q.codes.data() + off;
        if (bits != 8) {
          kernels::unpack_codes(q.codes.data(), static_cast<std::size_t>(D), bits,
                                code_buf.data(), off * bits);
          codes = code_buf.data();
        }
        float* dst = buf.data();
        if constexpr (std::is_same_v<T, float>) {
          if (direct) dst = out.row(t, h);
        }
        if (per_channel) {
          kernels::decode_run_vec(codes, sv.data() + h * D, zv.data() + h * D, D, lv.off, dst);
        } else {
          for (int64_t cb = 0; cb < box.nc; ++cb) {
            const auto g = static_cast<std::size_t>(box.index(t, h, cb * box.gc));
            const float sc = q.scales.get(g);
            const float z = cfg.symmetric ? 0.f : q.zeros.get(g);
            kernels::decode_run(codes + cb * box.gc, box.gc, sc, z, lv.off, dst + cb * box.gc);
          }
        }
        if (!direct) detail::store_row(out, t, h, dst);
      }
    }
  }
}

}  // namespace kvq
