#pragma once
/// \file dequantize.cuh
/// Dequantize packed pages on the GPU into [tokens, kv_heads, head_dim] f32 / f16 / bf16 —
/// the same bits dequantize_page() produces on the CPU.
///
/// Raw, int and fp8 tensors: one thread per element (load_element). Lloyd-Max: one warp per
/// (token, head) vector; each lane holds head_dim / 32 coordinates (coordinate e * 32 + lane),
/// the inverse Hadamard butterflies run in the CPU's stage order (h = 1, 2, ..., D/2: shuffles
/// for h < 32, registers above), then x *= sign * scale and x *= norm, as Rotation and
/// dequantize_lloyd_max do, so every value has the CPU's bits.
#include "kvq/cuda/common.cuh"

namespace kvq {
namespace cuda {
namespace detail {

/// Element idx of a dequantize launch ([tokens, H, D] order over pages of P tokens).
template <class T>
KVQ_HOST_DEVICE void dequantize_element(const TensorDesc& X, const std::byte* const* pages,
                                        int64_t P, int64_t H, int64_t D, int64_t idx, T* out) {
  const int64_t d = idx % D;
  const int64_t h = (idx / D) % H;
  const int64_t t = idx / (D * H);
  const auto* page = reinterpret_cast<const uint8_t*>(pages[t / P]);
  out[idx] = to_out<T>(load_element(X, page, H, D, t % P, h, d));
}

template <class T>
__global__ void dequantize_elements_kernel(TensorDesc X, const std::byte* const* pages, int64_t P,
                                           int64_t H, int64_t D, int64_t n, T* out) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx < n) dequantize_element(X, pages, P, H, D, idx, out);
}

/// In-warp Walsh-Hadamard butterflies over E registers per lane, coordinate e * 32 + lane
/// (D = 32 E), stages h = 1 .. D/2 in order: (a, b) -> (a + b, a - b).
template <int E>
__device__ __forceinline__ void warp_fwht(float (&x)[E]) {
  const unsigned lane = threadIdx.x & 31u;
#pragma unroll
  for (int h = 1; h < 32; h *= 2) {
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const float other = __shfl_xor_sync(0xffffffffu, x[e], h);
      x[e] = (lane & static_cast<unsigned>(h)) ? __fsub_rn(other, x[e]) : __fadd_rn(x[e], other);
    }
  }
#pragma unroll
  for (int hr = 1; hr < E; hr *= 2) {
#pragma unroll
    for (int e = 0; e < E; ++e) {
      if ((e & hr) == 0) {
        const float a = x[e], b = x[e | hr];
        x[e] = __fadd_rn(a, b);
        x[e | hr] = __fsub_rn(a, b);
      }
    }
  }
}

/// One warp per vector: centroids -> inverse rotation -> * norm -> out.
template <class T, int E>
__global__ void dequantize_lm_kernel(TensorDesc X, const std::byte* const* pages, int64_t P,
                                     int64_t H, int64_t vectors, T* out) {
  const int64_t D = 32 * E;
  const int64_t v = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  if (v >= vectors) return;  // whole warps exit together
  const int lane = static_cast<int>(threadIdx.x & 31u);
  const int64_t t = v / H, h = v % H;
  const auto* page = reinterpret_cast<const uint8_t*>(pages[t / P]);
  const int64_t tp = t % P;
  const auto vi = static_cast<std::size_t>(tp * H + h);
  float x[E];
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const int d = e * 32 + lane;
    x[e] = X.centroids[elem::get_code(page + X.codes, vi * static_cast<std::size_t>(D) + d, X.bits)];
  }
  warp_fwht<E>(x);
  const float norm = elem::load_meta(page + X.norms, X.f16meta != 0, vi);
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const int d = e * 32 + lane;
    const float post = elem::mul_rn(elem::sign_of(X.sign_mask, d), X.lm_scale);  // exact
    out[v * D + d] = to_out<T>(elem::mul_rn(elem::mul_rn(x[e], post), norm));
  }
}

template <class T>
void dequantize_tensor(const TensorDesc& X, const PagedDesc& L, const std::byte* const* pages,
                       int64_t tokens, T* out, cudaStream_t stream, const char* name) {
  const int64_t n = tokens * L.H * L.D;
  if (n == 0) return;
  if (X.is_lm()) {
    const int64_t vectors = tokens * L.H;
    constexpr int kThreads = 128;
    const unsigned blocks = blocks_for(vectors * 32, kThreads);
    switch (L.D) {
      case 32: dequantize_lm_kernel<T, 1><<<blocks, kThreads, 0, stream>>>(X, pages, L.P, L.H, vectors, out); break;
      case 64: dequantize_lm_kernel<T, 2><<<blocks, kThreads, 0, stream>>>(X, pages, L.P, L.H, vectors, out); break;
      case 128: dequantize_lm_kernel<T, 4><<<blocks, kThreads, 0, stream>>>(X, pages, L.P, L.H, vectors, out); break;
      case 256: dequantize_lm_kernel<T, 8><<<blocks, kThreads, 0, stream>>>(X, pages, L.P, L.H, vectors, out); break;
      default: fail(ErrorKind::kUnsupported, name, ": Lloyd-Max head_dim ", L.D);
    }
    check_launch(name);
    return;
  }
  constexpr int kThreads = 256;
  dequantize_elements_kernel<T><<<blocks_for(n, kThreads), kThreads, 0, stream>>>(
      X, pages, L.P, L.H, L.D, n, out);
  check_launch(name);
}

}  // namespace detail

/// Dequantizes the first `tokens` tokens of a sequence stored in pages (`pages`: a device array
/// of device page pointers, page i holding tokens [i P, (i + 1) P)) into k_out and v_out
/// (device, contiguous [tokens, kv_heads, head_dim], T = float, f16 or bf16). Asynchronous on
/// `stream`; no allocation. Launch errors throw kvq::Error naming the kernel.
template <class T>
void dequantize_pages(const PagedDesc& L, const std::byte* const* pages, int64_t tokens, T* k_out,
                      T* v_out, cudaStream_t stream = nullptr) {
  KVQ_REQUIRE(tokens >= 0, kInvalidArgument, "cuda::dequantize_pages: negative token count ",
              tokens);
  if (tokens == 0) return;
  KVQ_REQUIRE(pages != nullptr && k_out != nullptr && v_out != nullptr, kInvalidArgument,
              "cuda::dequantize_pages: null device pointer");
  detail::dequantize_tensor(L.k, L, pages, tokens, k_out, stream, "kvq::cuda::dequantize_pages(keys)");
  detail::dequantize_tensor(L.v, L, pages, tokens, v_out, stream,
                            "kvq::cuda::dequantize_pages(values)");
}

}  // namespace cuda
}  // namespace kvq
