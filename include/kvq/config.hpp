#pragma once
/// \file config.hpp
/// Version, host/device annotation and compile-time SIMD selection.
///
/// SIMD paths are chosen at compile time from the compiler's target macros (-march=...).
/// Define KVQ_NO_SIMD before including any kvq header to force the portable scalar paths
/// (tests use this to check the scalar fallbacks against the reference oracles).

#define KVQ_VERSION_MAJOR 0
#define KVQ_VERSION_MINOR 1
#define KVQ_VERSION_PATCH 0
#define KVQ_VERSION_STRING "0.1.0"

#if defined(__CUDACC__)
/// Per-element math written once for host and device.
#define KVQ_HOST_DEVICE __host__ __device__ inline
#define KVQ_HAS_CUDA 1
#else
#define KVQ_HOST_DEVICE inline
#define KVQ_HAS_CUDA 0
#endif

// SIMD levels (host code only; never inside device code).
#if !defined(KVQ_NO_SIMD) && !defined(__CUDA_ARCH__)
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__)
#define KVQ_HAS_AVX512 1
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define KVQ_HAS_AVX2 1
#endif
#if defined(__F16C__)
#define KVQ_HAS_F16C 1
#endif
#endif
#ifndef KVQ_HAS_AVX512
#define KVQ_HAS_AVX512 0
#endif
#ifndef KVQ_HAS_AVX2
#define KVQ_HAS_AVX2 0
#endif
#ifndef KVQ_HAS_F16C
#define KVQ_HAS_F16C 0
#endif

#if KVQ_HAS_AVX512 || KVQ_HAS_AVX2 || KVQ_HAS_F16C
#include <immintrin.h>
#endif

// Compiled-kernels mode (optional; docs/architecture.md, "Compiled-kernels mode"). By default
// kvq is header-only: every translation unit that quantizes or runs attention instantiates those
// kernels itself, and with -O3 the fused attention alone costs a minute or more of compile time
// per translation unit. A project with many translation units can instead compile them once,
// with two macros:
//   * KVQ_EXTERN_KERNELS (declare only): define it in every translation unit that includes kvq.
//     The heavy entry points -- kernels::attn::attend_segments, quantize_into<float>,
//     dequantize_tokens<float> -- are then only declared there.
//   * KVQ_KERNELS_IMPLEMENTATION (define here): define it in exactly one translation unit that
//     includes <kvq/kvq.hpp>; it holds their one definition (it implies KVQ_EXTERN_KERNELS).
//     Its value may split the definitions over two units compiled in parallel: 2 = the fused
//     attention only (include kvq/attention/attention.hpp), 3 = the quantizers only (include
//     kvq/quant/quantize.hpp); empty or 1 = all of them.
// All of them must see the same SIMD level (-march, KVQ_NO_SIMD). kvq's own tests, tools,
// benchmarks and Python module build this way: src/kvq_kernels_attention.cpp and
// src/kvq_kernels_quantize.cpp (CMake target kvq_kernels, option KVQ_COMPILED_KERNELS).
#ifdef KVQ_KERNELS_IMPLEMENTATION
#ifndef KVQ_EXTERN_KERNELS
#define KVQ_EXTERN_KERNELS 1
#endif
// (KVQ_KERNELS_IMPLEMENTATION + 0): an empty definition reads as 0, i.e. "all".
#if (KVQ_KERNELS_IMPLEMENTATION + 0) != 3
#define KVQ_DETAIL_DEFINE_ATTENTION 1  // internal: derived, never set by hand
#endif
#if (KVQ_KERNELS_IMPLEMENTATION + 0) != 2
#define KVQ_DETAIL_DEFINE_QUANTIZE 1  // internal: derived, never set by hand
#endif
#endif

namespace kvq {
/// Name of the SIMD level the fast paths were compiled for ("avx512", "avx2", "scalar").
inline const char* simd_level() {
#if KVQ_HAS_AVX512
  return "avx512";
#elif KVQ_HAS_AVX2
  return "avx2";
#else
  return "scalar";
#endif
}
}  // namespace kvq
