#pragma once
/// \file append.cuh
/// Quantize-append on the GPU: n new tokens ([n, kv_heads, head_dim] f32 / f16 / bf16, device)
/// written into a sequence's pages at token position `pos`, with the bytes quantize_page()
/// writes on the CPU.
///
/// Three passes per tensor, each trivially parallel:
///  1. params (int, fp8): one thread per group box of the new tokens finds the box's [min, max]
///     (flagging NaN/Inf in the status word), computes the parameters with the shared element
///     functions (kernels/common/element.hpp) and stores them in the page's metadata regions.
///  2. encode: one thread per element reads its group's stored parameters back (the CPU encodes
///     with the rounded stored values too) and writes its code: in place for 8-bit codes, else
///     into the workspace. Lloyd-Max: one warp per vector computes the norm (sum of squares in
///     double, eight interleaved partial sums combined in the CPU's fixed tree), normalizes,
///     applies the randomized Hadamard rotation in registers (warp_fwht) and encodes against
///     the codebook thresholds.
///  3. pack: one thread per output byte gathers the codes overlapping that byte (appends are
///     granule-aligned, so every range starts and ends on a byte): no atomics, no
///     read-modify-write.
/// Plan once (AppendPlan: checks, workspace size), run many times with no allocation.
#include "kvq/kernels/cuda/dequantize.cuh"

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

/// Pass 1 for group box idx of the new tokens [pos, pos + n) (int and fp8).
template <class T>
KVQ_HOST_DEVICE void append_params(const TensorDesc& X, const PagedDesc& L, std::byte* const* pages,
                                   int64_t pos, const T* x, int64_t idx, AppendStatus* st,
                                   int tensor) {
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
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
      }
  elem::GroupParams p;
  const elem::ElementStatus s =
      X.format == static_cast<int32_t>(Format::kInt)
          ? elem::int_params(lo, hi, X.bits, X.symmetric != 0, X.f16meta != 0, &p)
          : elem::fp8_params(lo, hi, X.e5m2 != 0, X.margin, X.f16meta != 0, &p);
  if (s != elem::ElementStatus::kOk) {
    report(st, s, tensor, idx);
    return;
  }
  const auto g = static_cast<std::size_t>(X.box(tp, hb * X.gh, cb * X.gc));
  elem::store_meta(page + X.scales, X.f16meta != 0, g, p.scale);
  if (X.has_zeros) elem::store_meta(page + X.zeros, X.f16meta != 0, g, p.zero);
}

/// Pass 2 for element idx of the new tokens (raw, int, fp8): the code byte (in place when 8 or
/// more bits wide, else into scratch[idx]).
template <class T>
KVQ_HOST_DEVICE void append_encode(const TensorDesc& X, const PagedDesc& L, std::byte* const* pages,
                                   int64_t pos, const T* x, int64_t idx, uint8_t* scratch) {
  const int64_t d = idx % L.D, h = (idx / L.D) % L.H, t = pos + idx / (L.D * L.H);
  auto* page = reinterpret_cast<uint8_t*>(pages[t / L.P]);
  const int64_t tp = t % L.P;
  const auto i = static_cast<std::size_t>((tp * L.H + h) * L.D + d);
  uint8_t* codes = page + X.codes;
  const float v = in_value(x, idx);
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
__global__ void append_params_kernel(TensorDesc X, PagedDesc L, std::byte* const* pages,
                                     int64_t pos, const T* x, int64_t n, AppendStatus* st,
                                     int tensor) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx < n) append_params(X, L, pages, pos, x, idx, st, tensor);
}
template <class T>
__global__ void append_encode_kernel(TensorDesc X, PagedDesc L, std::byte* const* pages,
                                     int64_t pos, const T* x, int64_t n, uint8_t* scratch,
                                     const AppendStatus* st) {
  if (st->code != 0) return;  // parameters incomplete: leave the range alone
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx < n) append_encode(X, L, pages, pos, x, idx, scratch);
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
  /// Throws kUnsupported for formats without GPU kernels (make_paged_desc), kInvalidArgument
  /// for max_new_tokens < 1.
  AppendPlan(const PageLayout& layout, int64_t max_new_tokens)
      : L_(make_paged_desc(layout)), max_new_(max_new_tokens) {
    KVQ_REQUIRE(max_new_tokens >= 1, kInvalidArgument,
                "cuda::AppendPlan: max_new_tokens must be >= 1, got ", max_new_tokens);
  }
  const PagedDesc& desc() const { return L_; }

  /// Device workspace bytes run() needs: the status word plus one code byte per element of
  /// the largest append (sub-byte codes before packing).
  std::size_t workspace_bytes() const {
    return kStatusBytes + static_cast<std::size_t>(max_new_ * L_.H * L_.D);
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
    }
    fail(ErrorKind::kInvalidArgument, "cuda append: corrupt status word ", st.code);
  }

 private:
  static constexpr std::size_t kStatusBytes = 256;  // keeps the scratch 256-byte aligned
  static_assert(sizeof(AppendStatus) <= kStatusBytes, "status word fits its slot");

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
      const bool grouped = X.format == static_cast<int32_t>(Format::kInt) ||
                           X.format == static_cast<int32_t>(Format::kE4M3) ||
                           X.format == static_cast<int32_t>(Format::kE5M2);
      if (grouped) {
        const int64_t boxes = n / X.gt * X.nh * X.nc;
        detail::append_params_kernel<T><<<detail::blocks_for(boxes, kThreads), kThreads, 0, stream>>>(
            X, L_, pages, pos, x, boxes, st, tensor);
        detail::check_launch(name);
      }
      detail::append_encode_kernel<T><<<detail::blocks_for(elems, kThreads), kThreads, 0, stream>>>(
          X, L_, pages, pos, x, elems, scratch, st);
      detail::check_launch(name);
    }
    const bool packed = (X.format == static_cast<int32_t>(Format::kInt) && X.bits < 8) || X.is_lm();
    if (packed) {
      const int64_t bytes = elems * X.bits / 8;
      detail::append_pack_kernel<<<detail::blocks_for(bytes, kThreads), kThreads, 0, stream>>>(
          X, L_, pages, pos, bytes, scratch, st);
      detail::check_launch(name);
    }
  }

  PagedDesc L_;
  int64_t max_new_;
};

}  // namespace cuda
}  // namespace kvq
