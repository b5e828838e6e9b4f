#pragma once
/// \file common.cuh
/// What every kvq CUDA kernel shares: the device description of a page (PagedDesc, built from
/// the CPU's PageLayout, so the kernels read and write exactly the bytes of
/// layout/page_layout.hpp), the per-element reads of a packed page, and the translation of CUDA
/// runtime errors into kvq::Error naming the kernel.
///
/// Only headers under cuda/ include <cuda_runtime.h>; they need nvcc (.cu files).
/// GPU support per format: f32/f16/bf16, int2/3/4/8 (any axis and group the page layout
/// accepts), e4m3/e5m2, nuq2/3/4 (calibrated codebook), lm1..4 without QJL for power-of-two
/// head_dim in [32, 256], and dense-and-sparse outliers over int, fp8 and nuq (load_element
/// applies a vector's exact outliers; AppendPlan selects them, at most kMaxGpuOutliers per
/// vector). The FP4 formats (nvfp4, mxfp4): one e2m1 code per element, one scale byte per
/// block of 16 / 32 channels (format/fp4.hpp's element math, the CPU's bits). QJL and rotated
/// int / fp8 / FP4 (/rot) are CPU-only:
/// make_paged_desc throws kUnsupported.
#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kvq/core/error.hpp"
#include "kvq/format/element.hpp"
#include "kvq/format/fp4.hpp"
#include "kvq/layout/page_layout.hpp"
#include "kvq/quant/lloyd_max_quant.hpp"
#include "kvq/quant/nuq_quant.hpp"

namespace kvq {
namespace cuda {

/// Largest head_dim of a Lloyd-Max tensor on the GPU (one warp holds a vector in registers).
inline constexpr int kMaxLmDim = 256;
/// Largest head_dim the decode-attention kernel takes (8 floats per lane).
inline constexpr int kMaxHeadDim = 256;

/// One packed tensor (keys or values) of a page, as the kernels see it. Trivially copyable:
/// passed to kernels by value (a few hundred bytes of kernel parameters).
struct TensorDesc {
  int32_t format = 0;     ///< kvq::Format
  int32_t bits = 0;       ///< code bits (int, lm); 8 for fp8
  int32_t symmetric = 0;  ///< int: absmax scale, no zero point
  int32_t f16meta = 1;    ///< metadata stored as fp16 (else f32)
  int32_t e5m2 = 0;       ///< fp8 kind
  float off = 0.f;        ///< int code offset (2^(b-1) symmetric, else 0)
  float qmax = 0.f;       ///< int largest code
  float margin = 1.f;     ///< fp8 scale margin
  float fp4_g = 1.f;      ///< nvfp4: the per-tensor decode scale (QuantConfig::fp4_tensor_scale)
  int64_t gt = 1, gh = 1, gc = 1;  ///< group box on the page shape [P, H, D]
  int64_t nh = 1, nc = 1;          ///< boxes along heads and channels
  uint64_t codes = 0, scales = 0, zeros = 0, norms = 0;  ///< region offsets in the page
  int32_t has_zeros = 0;
  // Lloyd-Max (power-of-two head_dim): y = H D1 x * scale.
  float lm_scale = 0.f;                   ///< 1/sqrt(head_dim), as Rotation
  uint32_t sign_mask[kMaxLmDim / 32] = {};  ///< D1: bit i set = -1
  // Lloyd-Max: the codebook; nuq: the layer's levels (normalized space) and their midpoints.
  float centroids[16] = {};
  float thresholds[15] = {};
  // Dense-and-sparse outliers: k per (token, head) vector, fp16 values and channel positions.
  int32_t outliers = 0;   ///< k (0: none)
  int32_t pos_bytes = 1;  ///< 1, or 2 (little-endian) when head_dim > 256
  uint64_t out_values = 0, out_pos = 0;  ///< region offsets in the page

  KVQ_HOST_DEVICE bool is_lm() const { return format == static_cast<int32_t>(Format::kLloydMax); }
  KVQ_HOST_DEVICE bool is_nuq() const { return format == static_cast<int32_t>(Format::kNuq); }
  KVQ_HOST_DEVICE bool is_fp4() const {
    return format == static_cast<int32_t>(Format::kNvfp4) ||
           format == static_cast<int32_t>(Format::kMxfp4);
  }
  /// Group box of element (t, h, d) of the page (GroupBox::index).
  KVQ_HOST_DEVICE int64_t box(int64_t t, int64_t h, int64_t d) const {
    return ((t / gt) * nh + h / gh) * nc + d / gc;
  }
};

/// Both tensors of a page plus its geometry.
struct PagedDesc {
  TensorDesc k, v;
  int64_t P = 0, H = 0, D = 0;  ///< page tokens, kv heads, head_dim
  int64_t granule = 1;          ///< token ranges are appended in multiples of this
  uint64_t page_bytes = 0;
};

namespace detail {

inline TensorDesc make_tensor_desc(const QuantConfig& c, const TensorRegions& r, const Shape& s) {
  const char* name = "make_paged_desc";
  KVQ_REQUIRE(!c.qjl, kUnsupported, name, ": ", c.name(),
              ": the QJL residual is not implemented on the GPU (CPU only)");
  KVQ_REQUIRE(!(c.rotate && c.format != Format::kLloydMax), kUnsupported, name, ": ", c.name(),
              ": the rotation of int / fp8 / FP4 formats (/rot) is not implemented on the GPU "
              "(CPU only)");
  TensorDesc d;
  d.format = static_cast<int32_t>(c.format);
  d.f16meta = c.meta == MetaDType::kF16 ? 1 : 0;
  d.codes = r.codes.offset;
  d.scales = r.scales.offset;
  d.zeros = r.zeros.offset;
  d.norms = r.norms.offset;
  d.has_zeros = r.zeros.bytes > 0 ? 1 : 0;
  const int64_t k = outlier_count(c, s.head_dim);
  if (k > 0) {
    KVQ_REQUIRE(k <= s.head_dim && r.outlier_values.bytes > 0 && r.outlier_pos.bytes > 0,
                kInvalidArgument, name, ": ", c.name(), ": layout lacks its outlier regions");
    d.outliers = static_cast<int32_t>(k);
    d.pos_bytes = outlier_pos_bytes(s.head_dim);
    d.out_values = r.outlier_values.offset;
    d.out_pos = r.outlier_pos.offset;
  }
  switch (c.format) {
    case Format::kF32: d.bits = 32; break;
    case Format::kF16:
    case Format::kBF16: d.bits = 16; break;
    case Format::kInt: {
      const UniformLevels lv = uniform_levels(c.bits, c.symmetric);
      d.bits = c.bits;
      d.symmetric = c.symmetric ? 1 : 0;
      d.off = lv.off;
      d.qmax = lv.qmax;
      break;
    }
    case Format::kE4M3:
    case Format::kE5M2: {
      d.bits = 8;
      d.e5m2 = c.format == Format::kE5M2 ? 1 : 0;
      const uint32_t mb = kvq::detail::f32_bits(c.fp8_margin) & 0x7fffffffu;
      KVQ_REQUIRE(mb < 0x7f800000u && c.fp8_margin > 0.f, kInvalidArgument, name, ": ", c.name(),
                  ": fp8 margin must be finite and > 0, got ", c.fp8_margin);
      d.margin = c.fp8_margin;
      break;
    }
    case Format::kNuq: {
      kvq::detail::require_nuq_codebook(c);
      d.bits = c.bits;
      const int n = 1 << c.bits;
      for (int i = 0; i < n; ++i) d.centroids[i] = c.nuq_levels[static_cast<std::size_t>(i)];
      nuq_thresholds(d.centroids, n, d.thresholds);
      break;
    }
    case Format::kLloydMax: {
      KVQ_REQUIRE(c.bits >= 1 && c.bits <= 4, kInvalidArgument, name,
                  ": Lloyd-Max codebooks have 1..4 bits, got ", c.bits);
      KVQ_REQUIRE(kvq::detail::is_pow2(s.head_dim) && s.head_dim >= 32 && s.head_dim <= kMaxLmDim,
                  kUnsupported, name, ": ", c.name(), " on the GPU needs a power-of-two head_dim "
                  "in [32, ", kMaxLmDim, "] (one warp per vector), got ", s.head_dim);
      d.bits = c.bits;
      const auto& ctx = kvq::detail::lloyd_max_context(static_cast<int>(s.head_dim), c.bits, c.seed);
      KVQ_REQUIRE(ctx.rotation.block() == s.head_dim, kUnsupported, name,
                  ": two-stage Hadamard rotations are CPU only");
      d.lm_scale = kvq::detail::inv_sqrt_f(s.head_dim);
      const auto& sg = ctx.rotation.signs();
      for (int64_t i = 0; i < s.head_dim; ++i)
        if (sg[static_cast<std::size_t>(i)] < 0.f) d.sign_mask[i >> 5] |= 1u << (i & 31);
      const Codebook& cb = *ctx.codebook;
      for (int i = 0; i < cb.levels(); ++i) d.centroids[i] = cb.centroids[static_cast<std::size_t>(i)];
      for (int i = 0; i + 1 < cb.levels(); ++i)
        d.thresholds[i] = cb.thresholds[static_cast<std::size_t>(i)];
      return d;
    }
    case Format::kNvfp4:
    case Format::kMxfp4: {
      // Blocks of `blk` consecutive channels of one (token, head) vector: the group box
      // (1, 1, blk), one scale byte per box in [tokens, heads, head_dim / blk] order.
      const int64_t blk = fp4_block(c.format);
      KVQ_REQUIRE(s.head_dim % blk == 0, kShapeMismatch, name, ": ", c.name(),
                  " needs head_dim to be a multiple of its block of ", blk, " channels, got ",
                  s.head_dim);
      KVQ_REQUIRE(std::isfinite(c.fp4_tensor_scale) && c.fp4_tensor_scale > 0.f,
                  kInvalidArgument, name, ": ", c.name(),
                  ": tensor scale must be finite and > 0, got ", c.fp4_tensor_scale);
      d.bits = 4;
      d.fp4_g = c.fp4_tensor_scale;
      d.gt = 1;
      d.gh = 1;
      d.gc = blk;
      d.nh = s.heads;
      d.nc = s.head_dim / blk;
      return d;
    }
    default:
      fail(ErrorKind::kUnsupported, name, ": format ", c.name(), " has no GPU kernels");
  }
  if (c.format == Format::kInt || c.format == Format::kE4M3 || c.format == Format::kE5M2 ||
      c.format == Format::kNuq) {
    const GroupBox b = group_box(c.axis, c.group, s);
    d.gt = b.gt;
    d.gh = b.gh;
    d.gc = b.gc;
    d.nh = b.nh;
    d.nc = b.nc;
  }
  return d;
}

}  // namespace detail

/// The device description of pages laid out by L. Throws kUnsupported for what the GPU kernels
/// do not implement (see the file comment) and when the page size is not a multiple of the
/// layout's granule (appends could then not stay byte-aligned across a page boundary).
inline PagedDesc make_paged_desc(const PageLayout& L) {
  KVQ_REQUIRE(L.page_tokens % L.granule == 0, kUnsupported, "make_paged_desc: page of ",
              L.page_tokens, " tokens is not a multiple of the layout's granule ", L.granule);
  PagedDesc p;
  p.k = detail::make_tensor_desc(L.key, L.k, L.page_shape());
  p.v = detail::make_tensor_desc(L.value, L.v, L.page_shape());
  p.P = L.page_tokens;
  p.H = L.kv_heads;
  p.D = L.head_dim;
  p.granule = L.granule;
  p.page_bytes = L.bytes;
  return p;
}

/// The exact value of outlier channel d of vector v = t * H + h when d is one of its k
/// positions (apply_outliers of quant/outlier_quant.hpp: the last of equal positions wins);
/// false otherwise. Positions >= head_dim (corrupt pages; the CPU throws) match nothing.
KVQ_HOST_DEVICE bool load_outlier(const TensorDesc& T, const uint8_t* page, int64_t v, int64_t d,
                                  float* x) {
  bool hit = false;
  const int64_t k = T.outliers;
  for (int64_t j = 0; j < k; ++j) {
    const uint8_t* p = page + T.out_pos + static_cast<uint64_t>(T.pos_bytes * (v * k + j));
    const int64_t c = T.pos_bytes == 1 ? p[0] : (p[0] | (p[1] << 8));
    if (c == d) {
      const uint8_t* b = page + T.out_values + static_cast<uint64_t>(2 * (v * k + j));
      *x = half_bits_to_float(static_cast<uint16_t>(b[0] | (b[1] << 8)));
      hit = true;
    }
  }
  return hit;
}

/// Value of element (t, h, d) of one page tensor (t page-local): the dequantized value for the
/// raw, int, fp8 and nuq formats with their outliers (the CPU dequantizer's bits); for
/// Lloyd-Max the rotated-domain coordinate norm * centroid (apply the inverse rotation to the
/// vector for the value).
KVQ_HOST_DEVICE float load_element(const TensorDesc& T, const uint8_t* page, int64_t H, int64_t D,
                                   int64_t t, int64_t h, int64_t d) {
  const auto i = static_cast<std::size_t>((t * H + h) * D + d);
  if (T.outliers > 0) {
    float x;
    if (load_outlier(T, page, t * H + h, d, &x)) return x;
  }
  const uint8_t* codes = page + T.codes;
  switch (static_cast<Format>(T.format)) {
    case Format::kF32: {
      const uint8_t* p = codes + 4 * i;
      return kvq::detail::bits_f32(static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
                                   (static_cast<uint32_t>(p[2]) << 16) |
                                   (static_cast<uint32_t>(p[3]) << 24));
    }
    case Format::kF16:
      return half_bits_to_float(static_cast<uint16_t>(codes[2 * i] | (codes[2 * i + 1] << 8)));
    case Format::kBF16:
      return bf16_bits_to_float(static_cast<uint16_t>(codes[2 * i] | (codes[2 * i + 1] << 8)));
    case Format::kInt: {
      const auto g = static_cast<std::size_t>(T.box(t, h, d));
      const float s = elem::load_meta(page + T.scales, T.f16meta != 0, g);
      const float z = T.has_zeros ? elem::load_meta(page + T.zeros, T.f16meta != 0, g) : 0.f;
      return uniform_decode(elem::get_code(codes, i, T.bits), s, z, T.off);
    }
    case Format::kE4M3:
    case Format::kE5M2: {
      const auto g = static_cast<std::size_t>(T.box(t, h, d));
      const float s = elem::load_meta(page + T.scales, T.f16meta != 0, g);
      return elem::fp8_decode_scaled(T.e5m2 != 0, codes[i], s);
    }
    case Format::kNuq: {
      const auto g = static_cast<std::size_t>(T.box(t, h, d));
      const float s = elem::load_meta(page + T.scales, T.f16meta != 0, g);
      const float z = elem::load_meta(page + T.zeros, T.f16meta != 0, g);
      return elem::nuq_decode(T.centroids, T.bits, elem::get_code(codes, i, T.bits), s, z);
    }
    case Format::kLloydMax: {
      const float n = elem::load_meta(page + T.norms, T.f16meta != 0,
                                      static_cast<std::size_t>(t * H + h));
      return elem::mul_rn(T.centroids[elem::get_code(codes, i, T.bits)], n);
    }
    case Format::kNvfp4:
    case Format::kMxfp4: {
      const uint8_t sc = page[T.scales + static_cast<std::size_t>(T.box(t, h, d))];
      const auto c = static_cast<uint8_t>(elem::get_code(codes, i, 4));
      return T.format == static_cast<int32_t>(Format::kMxfp4)
                 ? fp4::mx_decode(c, sc)
                 : fp4::nv_decode(c, fp4::nv_element_scale(sc, T.fp4_g));
    }
    default: return 0.f;
  }
}

/// Converts a float to the output element type (round to nearest even).
template <class T>
KVQ_HOST_DEVICE T to_out(float x);
template <>
KVQ_HOST_DEVICE float to_out<float>(float x) { return x; }
template <>
KVQ_HOST_DEVICE f16 to_out<f16>(float x) { return f16::from_bits(float_to_half_bits(x)); }
template <>
KVQ_HOST_DEVICE bf16 to_out<bf16>(float x) { return bf16::from_bits(float_to_bf16_bits(x)); }

namespace detail {

/// Throws kvq::Error naming `kernel` when the CUDA runtime reports an error for it.
inline void check_cuda(cudaError_t e, const char* kernel) {
  if (e == cudaSuccess) return;
  const ErrorKind kind = (e == cudaErrorInvalidValue || e == cudaErrorInvalidDevicePointer ||
                          e == cudaErrorIllegalAddress || e == cudaErrorInvalidConfiguration)
                             ? ErrorKind::kInvalidArgument
                             : ErrorKind::kUnsupported;
  fail(kind, "CUDA kernel ", kernel, ": ", cudaGetErrorName(e), ": ", cudaGetErrorString(e));
}
/// After a launch: the launch error, if any, as a kvq::Error naming the kernel.
inline void check_launch(const char* kernel) { check_cuda(cudaGetLastError(), kernel); }

inline unsigned blocks_for(int64_t n, int threads) {
  return static_cast<unsigned>((n + threads - 1) / threads);
}

}  // namespace detail

/// Number of CUDA devices visible (0 when none or when the driver is missing).
inline int visible_devices() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
}

}  // namespace cuda
}  // namespace kvq
