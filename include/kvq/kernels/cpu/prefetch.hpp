#pragma once
/// \file prefetch.hpp
/// Software prefetch for the streaming kernels (quantize, dequantize, FP8 bulk conversion). On
/// the shared VMs kvq is benchmarked on, the hardware prefetcher alone leaves a single thread
/// well below the machine's read bandwidth on these loops (measured on per-token int4 quantize:
/// 0.56x memcpy without it, 0.62-0.68x with 4-16 KiB of lookahead).
#include <cstddef>

#include "kvq/config.hpp"

namespace kvq::kernels {

/// How far ahead of the current position the kernels prefetch.
constexpr std::size_t kPrefetchAheadBytes = 8192;

/// Prefetches [p + kPrefetchAheadBytes, + bytes) into L1, one cache line at a time (prefetches
/// never fault, so running past the end of the buffer is harmless). No-op without SIMD.
inline void prefetch_ahead(const void* p, std::size_t bytes) {
#if KVQ_HAS_AVX512 || KVQ_HAS_AVX2
  const char* a = static_cast<const char*>(p) + kPrefetchAheadBytes;
  std::size_t q = 0;
  for (; q + 256 <= bytes; q += 256) {  // four lines per iteration (a 128-float row: two)
    _mm_prefetch(a + q, _MM_HINT_T0);
    _mm_prefetch(a + q + 64, _MM_HINT_T0);
    _mm_prefetch(a + q + 128, _MM_HINT_T0);
    _mm_prefetch(a + q + 192, _MM_HINT_T0);
  }
  for (; q < bytes; q += 64) _mm_prefetch(a + q, _MM_HINT_T0);
#else
  (void)p;
  (void)bytes;
#endif
}

}  // namespace kvq::kernels
