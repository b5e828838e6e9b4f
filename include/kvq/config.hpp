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
