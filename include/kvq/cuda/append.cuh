#pragma once
/// \file append.cuh
/// Quantize-append on the GPU: n new tokens ([n, kv_heads, head_dim] f32 / f16 / bf16, device)
/// written into a sequence's pages at token position `pos`, with the bytes quantize_page()
/// writes on the CPU.
///
/// Three passes per tensor, each trivially parallel:
///  1. params (int, fp8, nuq): one thread per group box of the new tokens finds the box's [min, max]
///     (flagging NaN/Inf in the status word), computes the parameters with the shared element
///     functions (format/element.hpp) and stores them in the page's metadata regions.
///  2. encode: one thread per element reads its group's stored parameters back (the CPU encodes
///     with the rounded stored values too) and writes its code: in place for 8-bit codes, else
///     into the workspace. Lloyd-Max: one warp per vector computes the norm (sum of squares in
///     double, eight interleaved partial sums combined in the CPU's fixed tree), normalizes,
///     applies the randomized Hadamard rotation in registers (warp_fwht) and encodes against
///     the codebook thresholds.
///  3. pack: one thread per output byte gathers the codes overlapping that byte (appends are
///     granule-aligned, so every range starts and ends on a byte): no atomics, no
///     read-modify-write.
/// Dense-and-sparse outliers (over int, fp8, nuq) add two passes before these, with the
/// selection of reference/outlier_ref.hpp (split_outliers), the definition the CPU quantizers
/// reproduce bit for bit:
///  S. statistics: one thread per group box: mean and 1 / standard deviation in double (four
///     partial sums by channel mod 4 in element order, squares by explicit fma); NaN/Inf here.
///  O. selection: one thread per (token, head) vector scores every channel,
///     |x - mean| * (1 / sd) rounded to float, keeps the k largest (ties: lower channel) in a
///     register list, writes their fp16 values and channels (ascending) into the page and
///     flags them in the workspace; |value| >= 65520 is reported (kOutOfRange on the CPU).
///  Pass 1 then takes each box's range over its unflagged elements (all flagged: the float
///  mean), and pass 2 encodes a flagged element as its value clamped to that range.
/// Plan once (AppendPlan: checks, workspace size), run many times with no allocation.
#include "kvq/cuda/dequantize.cuh"

namespace kvq {
namespace cuda {

/// Status word of an append (in the workspace): first error code and the flat element or
/// group index it concerns.
struct AppendStatus {
  int32_t code = 0;  ///< elem::ElementStatus
  int32_t tensor = 0;  ///< 0 keys, 1 values
  int64_t where = 0;
};

namespace detail {

KVQ_HOST_DEVICE void report(AppendStatus* st, elem::ElementStatus s, int tensor, int64_t where) {
#if defined(__CUDA_ARCH__)
  if (atomicCAS(&st->code, 0, static_cast<int32_t>(s)) == 0) {
    st->tensor = tensor;
    st->where = where;
  }
#else
  if (st->code == 0) {
    st->code = static_cast<int32_t>(s);
    st->tensor = tensor;
    st->where = where;
  }
#endif
}

template <class T>
KVQ_HOST_DEVICE float in_value(const T* x, int64_t i) {
  return to_float(x[i]);
}

/// Largest k (outliers per vector) the GPU append selects: a per-thread top-k list.
inline constexpr int kMaxGpuOutliers = 32;

/// Per group box of the new tokens of a dense-and-sparse append (workspace): what pass O
/// scores against and what pass 2 clamps flagged elements to.
struct OutlierBox {
  double mean = 0.0;  ///< mean of the box (all its elements)
  double isd = 0.0;   ///< 1 / standard deviation, 0 for a constant box
  float lo = 0.f, hi = 0.f;  ///< range of the unflagged elements (pass 1)
  int32_t dense = 0;         ///< the box has unflagged elements
  int32_t pad = 0;
};

/// Group box of element (tr, h, d) of the new tokens (tr relative to pos), numbered as the
/// boxes of passes S and 1.
KVQ_HOST_DEVICE int64_t new_box(const TensorDesc& X, int64_t tr, int64_t h, int64_t d) {
  return ((tr / X.gt) * X.nh + h / X.gh) * X.nc + d / X.gc;
}

/// Pass S for group box idx of the new tokens (dense-and-sparse): mean and inverse spread.
template <class T>
KVQ_HOST_DEVICE void outlier_stats(const TensorDesc& X, const PagedDesc& L, const T* x,
                                   int64_t idx, OutlierBox* boxes, AppendStatus* st, int tensor) {
  const int64_t per_block = X.nh * X.nc;
  const int64_t tb = idx / per_block, hb = (idx % per_block) / X.nc, cb = idx % X.nc;
  double part[4] = {0.0, 0.0, 0.0, 0.0};
  for (int64_t t = tb * X.gt; t < (tb + 1) * X.gt; ++t)
    for (int64_t h = hb * X.gh; h < (hb + 1) * X.gh; ++h)
      for (int64_t c = cb * X.gc; c < (cb + 1) * X.gc; ++c) {
        const int64_t i = (t * L.H + h) * L.D + c;
        const float v = in_value(x, i);
        if (!elem::is_finite_bits(v)) {
          report(st, elem::ElementStatus::kNonFinite, tensor, i);
          return;
        }
        part[c % 4] += static_cast<double>(v);
      }
  const double inv_n = 1.0 / static_cast<double>(X.gt * X.gh * X.gc);
  const double mean = elem::mul_rn_d((part[0] + part[1]) + (part[2] + part[3]), inv_n);
  part[0] = part[1] = part[2] = part[3] = 0.0;
  for (int64_t t = tb * X.gt; t < (tb + 1) * X.gt; ++t)
    for (int64_t h = hb * X.gh; h < (hb + 1) * X.gh; ++h)
      for (int64_t c = cb * X.gc; c < (cb + 1) * X.gc; ++c) {
        const double dv = static_cast<double>(in_value(x, (t * L.H + h) * L.D + c)) - mean;
        part[c % 4] = std::fma(dv, dv, part[c % 4]);
      }
  const double r = std::sqrt(elem::mul_rn_d((part[0] + part[1]) + (part[2] + part[3]), inv_n));
  boxes[idx].mean = mean;
  boxes[idx].isd = r > 0.0 ? 1.0 / r : 0.0;
}

/// Pass O for vector v = tr * H + h of the new tokens (dense-and-sparse): selects its k
/// outliers, writes them into the page and flags them in chosen[] (one byte per element).
template <class T>
KVQ_HOST_DEVICE void outlier_select(const TensorDesc& X, const PagedDesc& L,
                                    std::byte* const* pages, int64_t pos, const T* x, int64_t v,
                                    const OutlierBox* boxes, uint8_t* chosen, AppendStatus* st,
                                    int tensor) {
  const int64_t tr = v / L.H, h = v % L.H, t = pos + tr;
  const int k = X.outliers;
  float top[kMaxGpuOutliers];
  int32_t ch[kMaxGpuOutliers];
  int m = 0;
  for (int64_t d = 0; d < L.D; ++d) {
    chosen[v * L.D + d] = 0;
    const OutlierBox& b = boxes[new_box(X, tr, h, d)];
    const double dv = static_cast<double>(in_value(x, v * L.D + d)) - b.mean;
    const float s = static_cast<float>(elem::mul_rn_d(dv < 0.0 ? -dv : dv, b.isd));
    // Order: score descending, then channel ascending; channels arrive ascending, so a score
    // equal to one already listed ranks after it.
    if (m == k && !(s > top[k - 1])) continue;
    int j = m < k ? m++ : k - 1;
    for (; j > 0 && s > top[j - 1]; --j) {
      top[j] = top[j - 1];
      ch[j] = ch[j - 1];
    }
    top[j] = s;
    ch[j] = static_cast<int32_t>(d);
  }
  for (int a = 1; a < k; ++a) {  // channels ascending, as stored
    const int32_t c = ch[a];
    int b = a;
    for (; b > 0 && ch[b - 1] > c; --b) ch[b] = ch[b - 1];
    ch[b] = c;
  }
  auto* page = reinterpret_cast<uint8_t*>(pages[t / L.P]);
  const auto vi = static_cast<uint64_t>((t % L.P) * L.H + h);
  for (int j = 0; j < k; ++j) {
    const int64_t i = v * L.D + ch[j];
    const float val = in_value(x, i);
    if (!((val < 0.f ? -val : val) < 65520.f)) {
      report(st, elem::ElementStatus::kOutlierRange, tensor, i);
      return;
    }
    const uint16_t hb = float_to_half_bits(val);
    const uint64_t o = vi * static_cast<uint64_t>(k) + static_cast<uint64_t>(j);
    page[X.out_values + 2 * o] = static_cast<uint8_t>(hb & 0xffu);
    page[X.out_values + 2 * o + 1] = static_cast<uint8_t>(hb >> 8);
    if (X.pos_bytes == 2) {
      page[X.out_pos + 2 * o] = static_cast<uint8_t>(ch[j] & 0xff);
      page[X.out_pos + 2 * o + 1] = static_cast<uint8_t>(ch[j] >> 8);
    } else {
      page[X.out_pos + o] = static_cast<uint8_t>(ch[j]);
    }
    chosen[i] = 1;
  }
}

/// Which passes an append of X runs besides the encode pass (run_tensor, and the tests that
/// emulate it on the host): the parameter pass per group box (int, fp8, nuq, FP4 blocks) and
/// the pack pass of sub-byte codes (int below 8 bits, nuq, FP4; Lloyd-Max packs in its own
/// kernel's pass too).
struct AppendPasses {
  bool grouped = false;
  bool packed = false;
};
inline AppendPasses append_passes(const TensorDesc& X) {
  const auto f = static_cast<Format>(X.format);
  AppendPasses p;
  p.grouped = f == Format::kInt || f == Format::kE4M3 || f == Format::kE5M2 || X.is_nuq() ||
              X.is_fp4();
  p.packed = (f == Format::kInt && X.bits < 8) || X.is_lm() || X.is_nuq() || X.is_fp4();
  return p;
}

/// Pass 1 for group box idx of the new tokens [pos, pos + n) (int, fp8, nuq and the FP4
/// blocks, whose scale byte comes from the block's largest magnitude as on the CPU). With
/// outliers (chosen, boxes non-null) the range is that of the box's unflagged elements.
template <class T>
KVQ_HOST_DEVICE void append_params(const TensorDesc& X, const PagedDesc& L, std::byte* const* pages,
                                   int64_t pos, const T* x, int64_t idx, AppendStatus* st,
                                   int tensor, const uint8_t* chosen = nullptr,
                                   OutlierBox* boxes = nullptr) {
  const int64_t per_block = X.nh * X.nc;
  const int64_t tb = idx / per_block, hb = (idx % per_block) / X.nc, cb = idx % X.nc;
  const int64_t t0 = pos + tb * X.gt;  // first sequence token of the box
  auto* page = reinterpret_cast<uint8_t*>(pages[t0 / L.P]);
  const int64_t tp = t0 % L.P;
  float lo = INFINITY, hi = -INFINITY;
  for (int64_t t = 0; t < X.gt; ++t)
    for (int64_t h = hb * X.gh; h < (hb + 1) * X.gh; ++h)
      for (int64_t c = cb * X.gc; c < (cb + 1) * X.gc; ++c) {
        const int64_t i = ((t0 - pos + t) * L.H + h) * L.D + c;
        const float v = in_value(x, i);
        if (!elem::is_finite_bits(v)) {
          report(st, elem::ElementStatus::kNonFinite, tensor, i);
          return;
        }
        if (chosen != nullptr && chosen[i]) continue;
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
      }
  if (X.is_fp4()) {  // the block's scale byte from its largest magnitude (no outliers)
    const float mag = -lo > hi ? -lo : hi;  // max |x| of the block (all finite here)
    const float amax = mag > 0.f ? mag : 0.f;
    const auto g = static_cast<std::size_t>(X.box(tp, hb * X.gh, cb * X.gc));
    page[X.scales + g] = X.format == static_cast<int32_t>(Format::kMxfp4)
                             ? fp4::mx_scale_code(amax)
                             : fp4::nv_scale_code(amax, X.fp4_g);
    return;
  }
  if (boxes != nullptr) {
    OutlierBox& b = boxes[idx];
    b.dense = lo <= hi ? 1 : 0;
    if (!b.dense) lo = hi = static_cast<float>(b.mean);  // the dense part is the mean
    b.lo = lo;
    b.hi = hi;
  }
  elem::GroupParams p;
  const elem::ElementStatus s =
      X.format == static_cast<int32_t>(Format::kInt)
          ? elem::int_params(lo, hi, X.bits, X.symmetric != 0, X.f16meta != 0, &p)
          : (X.is_nuq() ? elem::nuq_params(lo, hi, X.f16meta != 0, &p)
                        : elem::fp8_params(lo, hi, X.e5m2 != 0, X.margin, X.f16meta != 0, &p));
  if (s != elem::ElementStatus::kOk) {
    report(st, s, tensor, idx);
    return;
  }
  const auto g = static_cast<std::size_t>(X.box(tp, hb * X.gh, cb * X.gc));
  elem::store_meta(page + X.scales, X.f16meta != 0, g, p.scale);
  if (X.has_zeros) elem::store_meta(page + X.zeros, X.f16meta != 0, g, p.zero);
}

/// Pass 2 for element idx of the new tokens (raw, int, fp8, nuq, FP4): the code byte (in place when 8
/// or more bits wide, else into scratch[idx]). With outliers, a flagged element is encoded as
/// its value clamped to its box's dense range (the mean when the box has no dense element).
template <class T>
KVQ_HOST_DEVICE void append_encode(const TensorDesc& X, const PagedDesc& L, std::byte* const* pages,
                                   int64_t pos, const T* x, int64_t idx, uint8_t* scratch,
                                   const uint8_t* chosen = nullptr,
                                   const OutlierBox* boxes = nullptr) {
  const int64_t d = idx % L.D, h = (idx / L.D) % L.H, t = pos + idx / (L.D * L.H);
  auto* page = reinterpret_cast<uint8_t*>(pages[t / L.P]);
  const int64_t tp = t % L.P;
  const auto i = static_cast<std::size_t>((tp * L.H + h) * L.D + d);
  uint8_t* codes = page + X.codes;
  float v = in_value(x, idx);
  if (chosen != nullptr && chosen[idx]) {
    const OutlierBox& b = boxes[new_box(X, t - pos, h, d)];
    if (b.dense) {  // std::min(std::max(v, lo), hi), as the oracle
      const float a = v < b.lo ? b.lo : v;
      v = b.hi < a ? b.hi : a;
    } else {
      v = static_cast<float>(b.mean);
    }
  }
  switch (static_cast<Format>(X.format)) {
    case Format::kF32: {
      const uint32_t u = kvq::detail::f32_bits(v);
      for (int b = 0; b < 4; ++b) codes[4 * i + b] = static_cast<uint8_t>((u >> (8 * b)) & 0xffu);
      return;
    }
    case Format::kF16:
    case Format::kBF16: {
      const uint16_t u = X.format == static_cast<int32_t>(Format::kF16) ? float_to_half_bits(v)
                                                                         : float_to_bf16_bits(v);
      codes[2 * i] = static_cast<uint8_t>(u & 0xffu);
      codes[2 * i + 1] = static_cast<uint8_t>(u >> 8);
      return;
    }
    case Format::kInt: {
      const auto g = static_cast<std::size_t>(X.box(tp, h, d));
      const float s = elem::load_meta(page + X.scales, X.f16meta != 0, g);
      const float z = X.has_zeros ? elem::load_meta(page + X.zeros, X.f16meta != 0, g) : 0.f;
      const uint8_t c = uniform_encode(v, z, elem::int_inv(s), X.off, X.qmax);
      if (X.bits == 8) {
        codes[i] = c;
      } else {
        scratch[idx] = c;
      }
      return;
    }
    case Format::kE4M3:
    case Format::kE5M2: {
      const auto g = static_cast<std::size_t>(X.box(tp, h, d));
      const float s = elem::load_meta(page + X.scales, X.f16meta != 0, g);
      codes[i] = elem::fp8_encode_scaled(X.e5m2 != 0, v, 1.0f / s);
      return;
    }
    case Format::kNuq: {  // 2..4-bit codes: always through the scratch and the pack pass
      const auto g = static_cast<std::size_t>(X.box(tp, h, d));
      const float s = elem::load_meta(page + X.scales, X.f16meta != 0, g);
      const float z = elem::load_meta(page + X.zeros, X.f16meta != 0, g);
      scratch[idx] = elem::nuq_encode(X.thresholds, X.bits, v, z, elem::int_inv(s));
      return;
    }
    case Format::kNvfp4:
    case Format::kMxfp4: {  // e2m1 codes through the scratch and the pack pass
      const uint8_t sc = page[X.scales + static_cast<std::size_t>(X.box(tp, h, d))];
      scratch[idx] = X.format == static_cast<int32_t>(Format::kMxfp4)
                         ? fp4::mx_encode(v, sc)
                         : fp4::nv_encode(v, fp4::nv_element_scale(sc, X.fp4_g));
      return;
    }
    default: return;
  }
}

/// Pass 3 for output byte idx: codes of granule-token blocks are byte-aligned runs.
KVQ_HOST_DEVICE void append_pack(const TensorDesc& X, const PagedDesc& L, std::byte* const* pages,
                                 int64_t pos, int64_t idx, const uint8_t* scratch) {
  const int64_t per_block_codes = L.granule * L.H * L.D;
  const int64_t per_block_bytes = per_block_codes * X.bits / 8;
  const int64_t blk = idx / per_block_bytes, j = idx % per_block_bytes;
  const int64_t t = pos + blk * L.granule;
  auto* page = reinterpret_cast<uint8_t*>(pages[t / L.P]);
  const int64_t byte0 = (t % L.P) * L.H * L.D * X.bits / 8;
  page[X.codes + static_cast<uint64_t>(byte0 + j)] = elem::packed_byte(
      scratch + blk * per_block_codes, static_cast<std::size_t>(per_block_codes), X.bits,
      static_cast<std::size_t>(j));
}

template <class T>
__global__ void outlier_stats_kernel(TensorDesc X, PagedDesc L, const T* x, int64_t n,
                                     OutlierBox* boxes, AppendStatus* st, int tensor) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx < n) outlier_stats(X, L, x, idx, boxes, st, tensor);
}
template <class T>
__global__ void outlier_select_kernel(TensorDesc X, PagedDesc L, std::byte* const* pages,
                                      int64_t pos, const T* x, int64_t vectors,
                                      const OutlierBox* boxes, uint8_t* chosen, AppendStatus* st,
                                      int tensor) {
  if (st->code != 0) return;  // statistics incomplete
  const int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (v < vectors) outlier_select(X, L, pages, pos, x, v, boxes, chosen, st, tensor);
}
template <class T>
__global__ void append_params_kernel(TensorDesc X, PagedDesc L, std::byte* const* pages,
                                     int64_t pos, const T* x, int64_t n, AppendStatus* st,
                                     int tensor, const uint8_t* chosen, OutlierBox* boxes) {
  if (chosen != nullptr && st->code != 0) return;  // the selection failed
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx < n) append_params(X, L, pages, pos, x, idx, st, tensor, chosen, boxes);
}
template <class T>
__global__ void append_encode_kernel(TensorDesc X, PagedDesc L, std::byte* const* pages,
                                     int64_t pos, const T* x, int64_t n, uint8_t* scratch,
                                     const AppendStatus* st, const uint8_t* chosen,
                                     const OutlierBox* boxes) {
  if (st->code != 0) return;  // parameters incomplete: leave the range alone
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx < n) append_encode(X, L, pages, pos, x, idx, scratch, chosen, boxes);
}
__global__ void append_pack_kernel(TensorDesc X, PagedDesc L, std::byte* const* pages, int64_t pos,
                                   int64_t n, const uint8_t* scratch, const AppendStatus* st) {
  if (st->code != 0) return;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx < n) append_pack(X, L, pages, pos, idx, scratch);
}

/// Lloyd-Max encode: one warp per vector of the new tokens (codes into scratch).
template <class T, int E>
__global__ void append_lm_kernel(TensorDesc X, PagedDesc L, std::byte* const* pages, int64_t pos,
                                 const T* x, int64_t vectors, uint8_t* scratch, AppendStatus* st,
                                 int tensor) {
  constexpr int D = 32 * E;
  const int64_t v = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  if (v >= vectors) return;
  const int lane = static_cast<int>(threadIdx.x & 31u);
  const int64_t t = pos + v / L.H, h = v % L.H;
  auto* page = reinterpret_cast<uint8_t*>(pages[t / L.P]);
  const auto vi = static_cast<std::size_t>((t % L.P) * L.H + h);
  float r[E];
  bool finite = true;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    r[e] = in_value(x, v * D + e * 32 + lane);
    finite = finite && elem::is_finite_bits(r[e]);
  }
  if (!__all_sync(0xffffffffu, finite)) {
    if (lane == 0) report(st, elem::ElementStatus::kNonFinite, tensor, v * D);
    return;
  }
  // Sum of squares as kvq::detail::dot_d: acc[k] over i = k (mod 8) in order, then the tree
  // ((0+4)+(2+6))+((1+5)+(3+7)). Lane k < 8 owns acc[k]; coordinate i lives in lane i % 32,
  // register i / 32, so lane k's sequence k, k + 8, ... is gathered with shuffles.
  double acc = 0.0;
#pragma unroll
  for (int e = 0; e < E; ++e) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {  // i = e * 32 + q * 8 + k
      const float xi = __shfl_sync(0xffffffffu, r[e], (q * 8 + lane) & 31);
      acc = __dadd_rn(acc, __dmul_rn(static_cast<double>(xi), static_cast<double>(xi)));
    }
  }
  double a[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) a[k] = __shfl_sync(0xffffffffu, acc, k);
  const double ss = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
  const float norm = elem::round_meta(X.f16meta != 0, static_cast<float>(sqrt(ss)));
  if (!elem::is_finite_bits(norm)) {
    if (lane == 0) report(st, elem::ElementStatus::kScaleOverflow, tensor, v);
    return;
  }
  if (lane == 0) elem::store_meta(page + X.norms, X.f16meta != 0, vi, norm);
  const float inv = norm > 0.f ? 1.0f / norm : 0.f;
  const bool inv_ok = elem::is_finite_bits(inv);
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const int d = e * 32 + lane;
    const float u = inv_ok ? elem::mul_rn(r[e], inv)
                           : static_cast<float>(static_cast<double>(r[e]) / static_cast<double>(norm));
    r[e] = elem::mul_rn(u, elem::sign_of(X.sign_mask, d));  // exact: +-1
  }
  warp_fwht<E>(r);
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const float u = elem::mul_rn(r[e], X.lm_scale);
    scratch[v * D + e * 32 + lane] = elem::lm_encode(X.thresholds, X.bits, u);
  }
}

}  // namespace detail

/// Quantize-append of new tokens into pages, planned once for a layout and a largest append.
class AppendPlan {
 public:
  /// Throws kUnsupported for formats without GPU kernels (make_paged_desc) and for more than
  /// kMaxGpuOutliers outliers per vector, kInvalidArgument for max_new_tokens < 1.
  AppendPlan(const PageLayout& layout, int64_t max_new_tokens)
      : L_(make_paged_desc(layout)), max_new_(max_new_tokens) {
    for (const TensorDesc* X : {&L_.k, &L_.v})
      KVQ_REQUIRE(X->outliers <= detail::kMaxGpuOutliers, kUnsupported, "cuda::AppendPlan: ",
                  X == &L_.k ? layout.key.name() : layout.value.name(), ": ", X->outliers,
                  " outliers per vector; the GPU append selects at most ",
                  detail::kMaxGpuOutliers, " (quantize such pages with quantize_page())");
    KVQ_REQUIRE(max_new_tokens >= 1, kInvalidArgument,
                "cuda::AppendPlan: max_new_tokens must be >= 1, got ", max_new_tokens);
    for (const TensorDesc* X : {&L_.k, &L_.v})
      if (X->outliers > 0) {
        const int64_t boxes = (max_new_tokens + X->gt - 1) / X->gt * X->nh * X->nc;
        max_boxes_ = boxes > max_boxes_ ? boxes : max_boxes_;
      }
  }
  const PagedDesc& desc() const { return L_; }

  /// Device workspace bytes run() needs: the status word plus one code byte per element of
  /// the largest append (sub-byte codes before packing); with outliers also one flag byte per
  /// element and an OutlierBox per group box.
  std::size_t workspace_bytes() const {
    std::size_t b = kStatusBytes + elems_bytes();
    if (max_boxes_ > 0)
      b += elems_bytes() + static_cast<std::size_t>(max_boxes_) * sizeof(detail::OutlierBox);
    return b;
  }

  /// Quantizes k and v (device, contiguous [n, kv_heads, head_dim]) into tokens [pos, pos + n)
  /// of the sequence whose pages are `pages` (device array of device page pointers, writable;
  /// page i holds tokens [i P, (i + 1) P)). pos and n must be multiples of the layout's
  /// granule, n <= max_new_tokens. Asynchronous; call check() (synchronizes) to learn whether
  /// the input held NaN/Inf or a parameter overflowed the metadata type — then the bytes of
  /// that range are unspecified, as with quantize_page().
  template <class T>
  void run(void* workspace, std::byte* const* pages, int64_t pos, const T* k, const T* v,
           int64_t n, cudaStream_t stream = nullptr) const {
    KVQ_REQUIRE(n >= 0 && n <= max_new_, kInvalidArgument, "cuda::AppendPlan::run: ", n,
                " new tokens, planned for at most ", max_new_);
    KVQ_REQUIRE(pos >= 0 && pos % L_.granule == 0 && n % L_.granule == 0, kInvalidArgument,
                "cuda::AppendPlan::run: token range [", pos, ", ", pos + n,
                ") must start and end on multiples of the layout's granule ", L_.granule);
    KVQ_REQUIRE(workspace != nullptr && pages != nullptr && (n == 0 || (k != nullptr && v != nullptr)),
                kInvalidArgument, "cuda::AppendPlan::run: null device pointer");
    auto* st = static_cast<AppendStatus*>(workspace);
    detail::check_cuda(cudaMemsetAsync(st, 0, sizeof(AppendStatus), stream),
                       "kvq::cuda::AppendPlan::run (status reset)");
    if (n == 0) return;
    uint8_t* scratch = static_cast<uint8_t*>(workspace) + kStatusBytes;
    run_tensor(L_.k, pages, pos, k, n, scratch, st, 0, stream);
    run_tensor(L_.v, pages, pos, v, n, scratch, st, 1, stream);
  }

  /// Waits for `stream` and throws what the CPU quantizer would have thrown for the last run
  /// with this workspace (kNonFinite, kOutOfRange), naming the tensor and index.
  void check(const void* workspace, cudaStream_t stream = nullptr) const {
    AppendStatus st;
    detail::check_cuda(cudaMemcpyAsync(&st, workspace, sizeof st, cudaMemcpyDeviceToHost, stream),
                       "kvq::cuda::AppendPlan::check");
    detail::check_cuda(cudaStreamSynchronize(stream), "kvq::cuda::AppendPlan (kernels)");
    throw_status(st);
  }

  /// The kvq::Error a status word stands for (nothing when it is clear).
  static void throw_status(const AppendStatus& st) {
    const char* which = st.tensor == 0 ? "keys" : "values";
    switch (static_cast<elem::ElementStatus>(st.code)) {
      case elem::ElementStatus::kOk: return;
      case elem::ElementStatus::kNonFinite:
        fail(ErrorKind::kNonFinite, "cuda append: ", which, " element ", st.where,
             " of the new tokens is NaN or Inf");
      case elem::ElementStatus::kZeroOverflow:
        fail(ErrorKind::kOutOfRange, "cuda append: zero point of ", which, " group ", st.where,
             " overflows fp16 metadata; use f32 metadata");
      case elem::ElementStatus::kScaleOverflow:
        fail(ErrorKind::kOutOfRange, "cuda append: scale or norm of ", which, " group/vector ",
             st.where, " overflows the metadata type; use f32 metadata");
      case elem::ElementStatus::kOutlierRange:
        fail(ErrorKind::kOutOfRange, "cuda append: outlier ", which, " element ", st.where,
             " of the new tokens does not fit fp16 (|x| >= 65520)");
    }
    fail(ErrorKind::kInvalidArgument, "cuda append: corrupt status word ", st.code);
  }

 private:
  static constexpr std::size_t kStatusBytes = 256;  // keeps the scratch 256-byte aligned
  static_assert(sizeof(AppendStatus) <= kStatusBytes, "status word fits its slot");
  /// One byte per element of the largest append, rounded up to 256 bytes.
  std::size_t elems_bytes() const {
    return (static_cast<std::size_t>(max_new_ * L_.H * L_.D) + 255) / 256 * 256;
  }

  template <class T>
  void run_tensor(const TensorDesc& X, std::byte* const* pages, int64_t pos, const T* x, int64_t n,
                  uint8_t* scratch, AppendStatus* st, int tensor, cudaStream_t stream) const {
    constexpr int kThreads = 256;
    const int64_t elems = n * L_.H * L_.D;
    const char* name = tensor == 0 ? "kvq::cuda::append(keys)" : "kvq::cuda::append(values)";
    if (X.is_lm()) {
      const int64_t vectors = n * L_.H;
      const unsigned blocks = detail::blocks_for(vectors * 32, 128);
      switch (L_.D) {
        case 32: detail::append_lm_kernel<T, 1><<<blocks, 128, 0, stream>>>(X, L_, pages, pos, x, vectors, scratch, st, tensor); break;
        case 64: detail::append_lm_kernel<T, 2><<<blocks, 128, 0, stream>>>(X, L_, pages, pos, x, vectors, scratch, st, tensor); break;
        case 128: detail::append_lm_kernel<T, 4><<<blocks, 128, 0, stream>>>(X, L_, pages, pos, x, vectors, scratch, st, tensor); break;
        case 256: detail::append_lm_kernel<T, 8><<<blocks, 128, 0, stream>>>(X, L_, pages, pos, x, vectors, scratch, st, tensor); break;
        default: fail(ErrorKind::kUnsupported, name, ": Lloyd-Max head_dim ", L_.D);
      }
      detail::check_launch(name);
    } else {
      const bool grouped = detail::append_passes(X).grouped;
      const int64_t boxes = grouped ? n / X.gt * X.nh * X.nc : 0;
      uint8_t* chosen = nullptr;
      detail::OutlierBox* obox = nullptr;
      if (X.outliers > 0) {  // passes S and O (the workspace was sized for them)
        chosen = scratch + elems_bytes();
        obox = reinterpret_cast<detail::OutlierBox*>(chosen + elems_bytes());
        detail::outlier_stats_kernel<T><<<detail::blocks_for(boxes, kThreads), kThreads, 0, stream>>>(
            X, L_, x, boxes, obox, st, tensor);
        detail::check_launch(name);
        const int64_t vectors = n * L_.H;
        detail::outlier_select_kernel<T><<<detail::blocks_for(vectors, 128), 128, 0, stream>>>(
            X, L_, pages, pos, x, vectors, obox, chosen, st, tensor);
        detail::check_launch(name);
      }
      if (grouped) {
        detail::append_params_kernel<T><<<detail::blocks_for(boxes, kThreads), kThreads, 0, stream>>>(
            X, L_, pages, pos, x, boxes, st, tensor, chosen, obox);
        detail::check_launch(name);
      }
      detail::append_encode_kernel<T><<<detail::blocks_for(elems, kThreads), kThreads, 0, stream>>>(
          X, L_, pages, pos, x, elems, scratch, st, chosen, obox);
      detail::check_launch(name);
    }
    if (detail::append_passes(X).packed) {
      const int64_t bytes = elems * X.bits / 8;
      detail::append_pack_kernel<<<detail::blocks_for(bytes, kThreads), kThreads, 0, stream>>>(
          X, L_, pages, pos, bytes, scratch, st);
      detail::check_launch(name);
    }
  }

  PagedDesc L_;
  int64_t max_new_;
  int64_t max_boxes_ = 0;  ///< group boxes of the largest append of a tensor with outliers
};

}  // namespace cuda
}  // namespace kvq
