#pragma once
/// \file prefetch.hpp
/// Software prefetch for the streaming kernels (quantize, dequantize, FP8 bulk conversion):
/// prefetch_ahead(p, bytes) prefetches [p + KVQ_PREFETCH_AHEAD_BYTES, + bytes) into L1.
///
/// Off by default (KVQ_PREFETCH_AHEAD_BYTES 0: prefetch_ahead does nothing). On the 2-vCPU
/// Zen 4 VM kvq is benchmarked on (2026-12-04), 8 KiB of lookahead made every streaming kernel
/// slower than the hardware prefetcher alone: per-token int4 quantize 8.81-8.93 -> 8.21-8.23
/// GB/s, int3 with 1% outliers 4.04 -> 3.42-3.52, FP8 e4m3 encode 17.7 -> 16.2-16.9 (2-4 KiB,
/// 16-256 KiB and the T1 / NTA hints were no better). An earlier host (docs/benchmarks.md, per
/// token int4 quantize) measured 0.56x memcpy without it and 0.62-0.68x with 4-16 KiB: define
/// KVQ_PREFETCH_AHEAD_BYTES (e.g. 8192) on every translation unit to turn it on where it pays.
///
/// A loop whose body is only prefetches has no side effect in the compiler's eyes, and C++ lets
/// it delete such a loop (forward progress): GCC 12 -O3 silently removed every prefetch of an
/// earlier four-lines-per-iteration prefetch_ahead. prefetch_lines keeps its loops with an empty
/// volatile asm per iteration (no instruction, no memory clobber);
/// tests/kernels/cpu/test_prefetch.cpp checks its compiled code holds prefetch instructions.
#include <cstddef>

#include "kvq/config.hpp"

#ifndef KVQ_PREFETCH_AHEAD_BYTES
#define KVQ_PREFETCH_AHEAD_BYTES 0
#endif

namespace kvq::kernels {

/// How far ahead of the current position the streaming kernels prefetch (0: not at all).
constexpr std::size_t kPrefetchAheadBytes = KVQ_PREFETCH_AHEAD_BYTES;

/// Prefetches [p, p + bytes) into L1, one cache line at a time (prefetches never fault, so
/// running past the end of a buffer is harmless). No-op without SIMD.
inline void prefetch_lines(const void* p, std::size_t bytes) {
#if KVQ_HAS_AVX512 || KVQ_HAS_AVX2
  const char* a = static_cast<const char*>(p);
  std::size_t q = 0;
  for (; q + 256 <= bytes; q += 256) {  // four lines per iteration (a 128-float row: two)
    _mm_prefetch(a + q, _MM_HINT_T0);
    _mm_prefetch(a + q + 64, _MM_HINT_T0);
    _mm_prefetch(a + q + 128, _MM_HINT_T0);
    _mm_prefetch(a + q + 192, _MM_HINT_T0);
    __asm__ __volatile__("" : : "r"(a + q));
  }
  for (; q < bytes; q += 64) {
    _mm_prefetch(a + q, _MM_HINT_T0);
    __asm__ __volatile__("" : : "r"(a + q));
  }
#else
  (void)p;
  (void)bytes;
#endif
}

/// prefetch_lines(p + kPrefetchAheadBytes, bytes) when kPrefetchAheadBytes > 0.
inline void prefetch_ahead(const void* p, std::size_t bytes) {
  if constexpr (kPrefetchAheadBytes > 0) {
    prefetch_lines(static_cast<const char*>(p) + kPrefetchAheadBytes, bytes);
  } else {
    (void)p;
    (void)bytes;
  }
}

}  // namespace kvq::kernels
